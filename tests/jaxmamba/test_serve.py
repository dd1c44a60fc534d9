"""The OpenAI-compatible server, driven by the real ``openai`` client over HTTP: completions and chat,
streaming and not, concurrent clients, bad requests, metrics, and a client hanging up mid-stream."""

from __future__ import annotations

import concurrent.futures
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
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


@pytest.fixture
def server_errors():
    """Records at ERROR or above from uvicorn and asyncio ("Exception in ASGI application", "Task exception
    was never retrieved") while a test runs: uvicorn's loggers do not propagate to pytest's."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn", "asyncio")]
    for lg in loggers:
        lg.addHandler(handler)
    yield records
    for lg in loggers:
        lg.removeHandler(handler)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_idle(server, timeout=30):
    """Every request finished and its slots and blocks back in the pools. The engine thread frees a request's
    pools a moment after the request leaves the unfinished set (the step recording it), so both are polled;
    a leak still fails at the deadline."""
    deadline = time.time() + timeout
    while server.engine.num_unfinished_requests():
        assert time.time() < deadline, "requests were left in the engine"
        time.sleep(0.05)
    while True:
        s = server.engine.stats()
        if s.slots_in_use == 0 and s.blocks_in_use == 0:
            break
        assert time.time() < deadline, f"pools not emptied: {s.slots_in_use} slots, {s.blocks_in_use} blocks in use"
        time.sleep(0.05)
    server.engine.check_invariants()


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
                         (dict(temperature=-1.0), "temperature"),
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


def _post_raw(server, route: str, body: dict) -> httpx.Response:
    """POST ``body`` as json.dumps writes it: a lone surrogate goes out as the escape ``\\udce9``, which the
    openai client cannot send (it encodes the body as UTF-8 itself and fails before sending)."""
    return httpx.post(server.base_url + route, content=json.dumps({"model": "tiny", **body}),
                      headers={"content-type": "application/json"}, timeout=60)


def test_text_that_is_not_utf8_is_a_400_naming_it(server, client):
    """A lone surrogate was once a 500 carrying the tokenizer's TypeError, on both routes: now a 400 naming it."""
    for route, body in (
            ("/v1/completions", {"prompt": "caf\udce9", "max_tokens": 3}),
            ("/v1/completions", {"prompt": ["fine", "caf\udce9"], "max_tokens": 3}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "caf\udce9"}], "max_tokens": 3}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
                                      "max_tokens": 3})):
        r = _post_raw(server, route, body)
        assert r.status_code == 400, (route, r.text)
        error = r.json()["error"]
        assert "not valid UTF-8" in error["message"] and error["code"] == 400 and error["type"] == "BadRequestError"
    # A model name the error message quotes back, surrogate and all: still OpenAI's 404, not a 500.
    r = _post_raw(server, "/v1/completions", {"model": "x\udce9", "prompt": "hi"})
    assert r.status_code == 404 and "x\\udce9" in r.json()["error"]["message"]
    assert client.completions.create(model="tiny", prompt="caf\u00e9", max_tokens=3).choices[0].finish_reason
    _wait_idle(server)


def test_unknown_routes_are_openai_error_objects(server, client):
    r = httpx.get(server.base_url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "GET /v1/nope: Not Found", "type": "NotFoundError", "param": None, "code": 404}
    assert httpx.get(server.base_url + "/v1/completions").json()["error"]["code"] == 405
    with pytest.raises(openai.NotFoundError, match="Not Found") as e:
        client.get("/nope", cast_to=object)
    assert e.value.body["type"] == "NotFoundError"


def test_chat_content_parts_and_temperature_above_2(client, server):
    """Content as a list of text parts (what many clients send) was once a 400; so was temperature 3."""
    ask = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(messages=[{"role": "user", "content": "What is\nthe capital?"}], **ask)
    parts = client.chat.completions.create(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]}], **ask)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}], **ask)
    hot = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=3.0, seed=5,
                                    extra_body={"ignore_eos": True})
    assert hot.usage.completion_tokens == 4
    _wait_idle(server)


def test_served_model_id_is_the_checkpoint_directory_name(server, ckpt):
    """Without --served-model-name the id was once the full cache path; now the checkpoint directory's name."""
    from jaxmamba.serve import served_name

    assert build_server(server.engine).model_name == ckpt.name
    assert served_name(str(ckpt) + "/", None) == ckpt.name
    assert build_server(server.engine, served_model_name="mine").model_name == "mine"


def test_disconnects_abort_without_a_traceback(server, server_errors):
    """Every disconnect once logged "aclose(): asynchronous generator is already running" (a task
    exception nobody retrieved, or an ASGI exception and a 500) although the request was aborted. Hang up
    mid-stream on both routes, and mid-request on a raw socket without streaming."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 100,
            "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for route, b in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            with http.stream("POST", route, json={**b, "stream": True}) as resp:
                # Hang up after the first token. On a quiet machine the tiny model may finish its 100 tokens
                # before this client reads that chunk: the raw-socket case below waits until its request is
                # in flight, so a mid-request hang-up is always exercised.
                next(line for line in resp.iter_lines() if line.startswith("data:") and '"content": ""' not in line)
    payload = json.dumps({**body, "max_tokens": 120}).encode()
    with socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1]))) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        deadline = time.time() + 30
        while not server.engine.num_unfinished_requests():
            assert time.time() < deadline
            time.sleep(0.01)
    _wait_idle(server)
    time.sleep(0.5)  # the server's side of the hang-ups settles
    gc.collect()  # "Task exception was never retrieved" is logged when the task is collected
    assert not server_errors, [r.getMessage() for r in server_errors]


def test_soak_with_bad_text_aborts_and_a_double_ctrl_c_ends_clean(ckpt, tmp_path):
    """The server as a user runs it (``python -m jaxmamba serve``, loopback, the tiny model): a few seconds
    of completions and chats mixed with hang-ups, client timeouts, bad text and bad fields, then a burst
    of long requests and Ctrl-C twice. Every answer is a completion or OpenAI's error object (400 for
    the bad ones, 503 for the requests the second Ctrl-C aborts; never a 500), the process exits 0, its
    pools are empty at the end, and its log holds no traceback."""
    import asyncio

    port = _free_port()
    log_path = tmp_path / "serve.log"
    import jax

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_repo_root()), os.environ.get("PYTHONPATH")]))}
    if jax.config.jax_compilation_cache_dir:  # the test session's cache: the server loads its programs from it
        env["JAXMAMBA_COMPILE_CACHE"] = jax.config.jax_compilation_cache_dir
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jaxmamba", "serve", str(ckpt), "--port", str(port), "--quiet",
                                 "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.time() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        results = asyncio.run(_soak_mix(base, ckpt.name))
        assert results["bad"] and all(code == 400 for code in results["bad"]), results["bad"]
        assert results["done"] and all(results["done"]), "completions came back empty"
        burst = asyncio.run(_burst_then_ctrl_c(base, ckpt.name, proc))
        assert set(burst) <= {"done", "aborted"} and "aborted" in burst, burst
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    for bad in ("Traceback", "Exception in ASGI", "never retrieved", "ERROR"):
        assert bad not in text, text[-4000:]
    assert "engine stopped: pools empty" in text and "aborting the requests in flight" in text, text[-3000:]


def _repo_root():
    from pathlib import Path

    import jaxmamba

    return Path(jaxmamba.__file__).resolve().parent.parent


async def _soak_mix(base: str, model: str, seconds: float = 4.0) -> dict:
    """Random traffic for ``seconds``: what each kind of client got."""
    import asyncio
    import random

    rng = random.Random(0)
    got: dict[str, list] = {"done": [], "bad": []}
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        async def one(i):
            kind = rng.choice(["plain", "stream", "chat", "hangup", "timeout", "bad_text", "bad_field"])
            prompt = f"Once upon a time {i}"
            if kind == "plain":
                got["done"].append((await client.completions.create(model=model, prompt=prompt, max_tokens=5,
                                                                    temperature=0.5, seed=i)).choices[0].text)
            elif kind == "stream":
                stream = await client.completions.create(model=model, prompt=prompt, max_tokens=5, stream=True,
                                                         extra_body={"ignore_eos": True})
                got["done"].append("".join([c.choices[0].text async for c in stream]))
            elif kind == "chat":
                reply = await client.chat.completions.create(
                    model=model, max_tokens=5, extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": [{"type": "text", "text": prompt}]}])
                got["done"].append(reply.choices[0].message.content)
            elif kind == "hangup":
                long = {"model": model, "prompt": prompt, "stream": True, "max_tokens": 60, "ignore_eos": True}
                async with http.stream("POST", "/v1/completions", json=long) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            break
            elif kind == "timeout":
                with pytest.raises(openai.APITimeoutError):
                    await client.with_options(timeout=0.05).completions.create(
                        model=model, prompt=prompt, max_tokens=100, extra_body={"ignore_eos": True})
            elif kind == "bad_text":
                r = await http.post("/v1/chat/completions", headers={"content-type": "application/json"},
                                    content=json.dumps({"model": model, "messages": [
                                        {"role": "user", "content": prompt + "\udce9"}]}))
                got["bad"].append(r.status_code)
            else:
                try:
                    await client.completions.create(model=model, prompt=prompt, temperature=-1)
                    got["bad"].append(200)
                except openai.BadRequestError as e:
                    got["bad"].append(e.status_code)

        end, i = asyncio.get_running_loop().time() + seconds, 0
        while asyncio.get_running_loop().time() < end:
            await asyncio.gather(*[one(i + k) for k in range(8)])
            i += 8
    return got


async def _burst_then_ctrl_c(base: str, model: str, proc, n: int = 16) -> list[str]:
    """``n`` long requests (half streaming) against 4 engine rows; Ctrl-C twice once tokens flow. Each
    comes back "done" (it finished first) or "aborted" (a 503 error object, or an error event then
    [DONE]); anything else is returned as it is."""
    import asyncio

    started = asyncio.Event()
    body = {"model": model, "max_tokens": 120, "ignore_eos": True, "temperature": 0}

    async def one(http, i):
        if i % 2:
            r = await http.post("/v1/completions", json={**body, "prompt": f"story {i}"})
            if r.status_code == 200:
                return "done"
            return "aborted" if r.status_code == 503 and "shutting down" in r.json()["error"]["message"] else r.text
        events = []
        async with http.stream("POST", "/v1/completions", json={**body, "prompt": f"story {i}", "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    started.set()
                    events.append(line[len("data: "):])
        if events[-1] != "[DONE]":
            return f"no [DONE]: {events[-3:]}"
        last = json.loads(events[-2])
        if "error" in last:
            return "aborted" if last["error"]["code"] == 503 else events[-2]
        return "done" if last["choices"][0]["finish_reason"] == "length" else events[-2]

    async def interrupt():
        await started.wait()
        proc.send_signal(signal.SIGINT)
        await asyncio.sleep(0.3)
        proc.send_signal(signal.SIGINT)

    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        results = await asyncio.gather(*[one(http, i) for i in range(n)], interrupt())
    return results[:n]
