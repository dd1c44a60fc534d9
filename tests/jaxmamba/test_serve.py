"""The OpenAI-compatible server, driven by the real ``openai`` client over HTTP: completions and chat,
streaming and not, concurrent clients, bad requests, metrics, and a client hanging up mid-stream."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from jaxmamba import LLM, SamplingParams, random_model  # noqa: E402
from jaxmamba.serve import build_server  # noqa: E402

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_model("nemotron_h", path=tmp_path_factory.mktemp("serve") / "ckpt")


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, **ENGINE)


@pytest.fixture(scope="module")
def server(ckpt):
    import uvicorn

    srv = build_server(ckpt, served_model_name="tiny", **ENGINE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(srv.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not uv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    srv.base_url = f"http://127.0.0.1:{port}"
    yield srv
    uv.should_exit = True
    thread.join(timeout=10)
    srv.engine.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _wait_idle(server, timeout=30):
    deadline = time.time() + timeout
    while server.engine.num_unfinished_requests():
        assert time.time() < deadline, "requests were left in the engine"
        time.sleep(0.05)
    server.engine.check_invariants()
    s = server.engine.stats()
    assert s.slots_in_use == 0 and s.blocks_in_use == 0


def test_health_models_and_metrics(server, client):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]
    client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:time_to_first_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:num_preemptions_total"):
        assert name in text, name
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny"}' in text


def test_completion_matches_offline_generate(client, offline):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = offline.generate("The quick brown fox", params)[0].outputs[0]
    got = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 10
    chunks = list(client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    # Several prompts, n samples each, seeded: as offline.
    hot = SamplingParams(temperature=1.0, max_tokens=6, seed=11, n=2, ignore_eos=True)
    want = offline.generate(["Hello", [5, 6, 7]], hot)
    got = client.completions.create(model="tiny", prompt=["Hello"], max_tokens=6, temperature=1.0, seed=11, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [c.text for c in want[0].outputs]
    got = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=1.0, seed=11, n=2,
                                    logprobs=2, extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [c.text for c in want[1].outputs]
    assert len(got.choices[0].logprobs.token_logprobs) == 6


def test_chat_completion(client, offline, server):
    from jaxmamba.random_checkpoint import CHAT_TEMPLATE  # noqa: F401 (the template the checkpoint ships)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = server._render_chat(messages)
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text


def test_concurrent_clients_get_what_offline_gives(client, offline, server):
    prompts = [f"Once upon a time {i}" for i in range(12)]
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=12, ignore_eos=True) for i in range(12)]
    want = [o.outputs[0].text for o in offline.generate(prompts, params)]

    def ask(i):
        if i % 2:
            return "".join(c.choices[0].text for c in client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=12, temperature=0.8, seed=100 + i, stream=True,
                extra_body={"ignore_eos": True}))
        return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0.8,
                                         seed=100 + i, extra_body={"ignore_eos": True}).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(12)))
    assert got == want
    _wait_idle(server)


def test_bad_requests_are_400s_naming_the_field(client, server):
    for extra, field in ((dict(seed=2**64), "seed"), (dict(extra_body={"presence_penalty": 0.2}), "presence_penalty"),
                         (dict(temperature=5.0), "temperature"),
                         (dict(extra_body={"stop_token_ids": 3}), "stop_token_ids")):
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model="tiny", prompt="Hi", max_tokens=3, **extra)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model="tiny", prompt=[1, 99999], max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=3)
    _wait_idle(server)


def test_a_client_hanging_up_mid_stream_aborts_its_request(server):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert '"text"' in first
            assert server.engine.num_unfinished_requests() == 1
    _wait_idle(server)
    assert server.engine.stats().num_generated_tokens > 0


def _soak(server, offline, num_requests: int, seed: int = 0):
    """Random completions through the server, streaming and not, with clients that hang up mid-stream or
    time out, and bad requests mixed in; every completed response must equal offline ``generate``."""
    import random

    rng = random.Random(seed)
    jobs = []
    for i in range(num_requests):
        kind = rng.choices(["plain", "stream", "hangup", "timeout", "bad"], [55, 25, 8, 4, 8])[0]
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
        hot = rng.random() < 0.5
        body = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randrange(1, 10), "ignore_eos": True,
                "temperature": 0.9 if hot else 0.0, "seed": 1000 + i}
        if kind == "bad":
            body[rng.choice(["repetition_penalty", "seed", "prompt"])] = rng.choice([1.5, 2**70, [1, 10**6]])
        jobs.append((kind, body))

    def kw(body):
        known = ("model", "prompt", "max_tokens", "temperature", "seed")
        return {k: body[k] for k in known} | {"extra_body": {k: v for k, v in body.items() if k not in known}}

    async def one(client, http, kind, body):
        if kind == "plain":
            return (await client.completions.create(**kw(body))).choices[0].text
        if kind == "stream":
            stream = await client.completions.create(**kw(body), stream=True)
            return "".join([c.choices[0].text async for c in stream])
        if kind == "bad":
            try:
                await client.completions.create(**kw(body))
            except openai.BadRequestError:
                return "rejected"
            return "accepted a bad request"
        if kind == "timeout":
            try:
                await client.with_options(timeout=0.01).completions.create(**kw({**body, "max_tokens": 60}))
            except openai.APITimeoutError:
                pass
            return None
        async with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 60, "stream": True}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    break  # hang up after the first chunk
        return None

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        limit = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            async def guarded(job):
                async with limit:
                    return await one(client, http, *job)
            return await asyncio.gather(*[guarded(j) for j in jobs])

    import asyncio

    results = asyncio.run(run())
    _wait_idle(server, timeout=120)
    done = [(body, text) for (kind, body), text in zip(jobs, results) if kind in ("plain", "stream")]
    assert all(text == "rejected" for (kind, _), text in zip(jobs, results) if kind == "bad")
    params = [SamplingParams(temperature=b["temperature"], seed=b["seed"], max_tokens=b["max_tokens"], ignore_eos=True)
              for b, _ in done]
    want = [o.outputs[0].text for o in offline.generate([b["prompt"] for b, _ in done], params)]
    assert [text for _, text in done] == want


def test_soak_short(server, offline):
    _soak(server, offline, 60)


@pytest.mark.slow
def test_soak_1000_requests(server, offline):
    _soak(server, offline, 1000, seed=1)
