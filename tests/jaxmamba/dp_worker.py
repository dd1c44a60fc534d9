"""Data-parallel serving checks, run as a separate process by ``tests/jaxmamba/test_data_parallel.py`` (the
virtual CPU device count is an XLA flag that must be set before JAX starts).

``dp_worker.py CHECKPOINT OUT``, with 2 virtual CPU devices: the reference (one engine, offline ``LLM``), then
the OpenAI server over ``data_parallel_size=2`` replicas with prefix caching, driven over HTTP:

1. ``spread``: distinct prompts at once through the front (``DataParallelAsyncLLM.generate``, which the
   server's routes call): which replica ran each, their greedy tokens and the reference's top-2 logprobs.
2. ``http``: the same prompts as concurrent HTTP completions: their texts and the reference's.
3. ``abort``: a long streaming request the client hangs up on: the replica it ran on, and that replica's
   pools afterwards.
4. ``affinity``: a prompt of a 2-block prefix family sent while replica 0 is busy (so it lands on replica 1
   by load), then a sibling with the same prefix sent with both replicas idle (where load alone picks
   replica 0): where each went, and each replica's prefix-cache hits.
5. ``metrics``: the server's /metrics text at the end.

Writes what it saw to ``OUT`` (JSON); the test asserts on it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, buckets=[(4, 16)],
                   sampling_variants="full", compile_cache=None, executable_cache=False)
MAX_TOKENS = 6
LONG_TOKENS = 200  # the request the client hangs up on


def prompts() -> list[list[int]]:
    """Distinct first tokens: no prompt shares a leading block with another."""
    return [[10 + 7 * i + k for k in range(5 + i)] for i in range(6)]


def reference(checkpoint: str) -> dict:
    from jaxmamba import LLM, SamplingParams

    llm = LLM(checkpoint, **ENGINE_ARGS)
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2))
    tokens, top2 = [], []
    for o in outs:
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        top2.append([sorted((float(v) for v in entry.values()), reverse=True)[:2] for entry in c.logprobs])
    texts = [o.outputs[0].text for o in outs]
    return {"tokens": tokens, "top2": top2, "texts": texts}


def start_server(checkpoint: str):
    import socket

    import uvicorn

    from jaxmamba.serve import build_server

    server = build_server(checkpoint, served_model_name="tiny", data_parallel_size=2, enable_prefix_caching=True,
                          **ENGINE_ARGS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=uv.run, daemon=True).start()
    deadline = time.time() + 60
    while not uv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    return server, uv, f"http://127.0.0.1:{port}"


def spread(front) -> dict:
    """Every prompt through the front at once: where each ran and its greedy tokens."""
    from jaxmamba import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def one(i, p):
        replica, last = None, None
        async for out in front.generate(p, params, f"spread-{i}"):
            replica = front.replica_of(f"spread-{i}") if replica is None else replica
            last = out
        return replica, list(last.outputs[0].token_ids)

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts())))

    got = asyncio.run(run())
    return {"replicas": [r for r, _ in got], "tokens": [t for _, t in got]}


def wait_idle(front, timeout: float = 60) -> list[dict]:
    """Each replica's pools once every request left it (the engine thread frees them a moment later)."""
    deadline = time.time() + timeout
    while True:
        stats = front.stats()
        if front.num_unfinished_requests() == 0 and all(s.blocks_in_use == 0 and s.slots_in_use == 0 for s in stats):
            break
        if time.time() > deadline:
            break
        time.sleep(0.05)
    return [{"blocks_in_use": s.blocks_in_use, "slots_in_use": s.slots_in_use} for s in front.stats()]


def http_completions(base: str) -> list[str]:
    import concurrent.futures

    import httpx

    def ask(p):
        body = {"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        return httpx.post(base + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts())) as pool:
        return list(pool.map(ask, prompts()))


def hang_up(front, base: str) -> dict:
    """A long streaming completion, hung up on mid-run, while its replica's engine thread is held between
    two steps (an ``AsyncLLM.call`` that waits), so that it cannot finish before the hang-up is seen. While
    it is held, the first of the prefix family (``affinity_first``). Returns the replica the long request ran
    on, its blocks while it ran, and the tokens that replica generated in all (the request's abort must
    stop it short of ``LONG_TOKENS``)."""
    import httpx

    body = {"model": "tiny", "prompt": [400 + k for k in range(20)], "max_tokens": LONG_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True}
    seen: dict = {}
    release = threading.Event()
    with httpx.Client(base_url=base, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()  # kept: closing the line iterator would close the connection (a hang-up)
        next(line for line in lines if line.startswith("data:"))
        (rid, seen["replica"]), = front.running().items()
        replica = front.replicas[seen["replica"]]

        def hold():  # on the engine thread, between two steps
            seen["blocks_while_running"] = replica.engine_core.stats.blocks_in_use
            release.wait(120)

        held = replica.call(hold)
        seen["affinity_first"] = affinity_first(base)
    deadline = time.time() + 60
    while rid in front.running() and time.time() < deadline:  # the server sees the hang-up (it polls)
        time.sleep(0.05)
    release.set()
    held.result(60)
    return seen


FAMILY = [300 + k for k in range(32)]  # two full blocks (block_size 16)


def affinity_first(base: str) -> dict:
    """While the long request holds replica 0: the first of the family (load sends it to replica 1)."""
    import httpx

    body = {"model": "tiny", "prompt": FAMILY + [1, 2, 3], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    return {"status": httpx.post(base + "/v1/completions", json=body, timeout=120).status_code}


def affinity_second(base: str) -> dict:
    import httpx

    body = {"model": "tiny", "prompt": FAMILY + [4, 5], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    return {"status": httpx.post(base + "/v1/completions", json=body, timeout=120).status_code}


def main(checkpoint: str, out: str) -> None:
    import httpx

    result = {"reference": reference(checkpoint)}
    server, uv, base = start_server(checkpoint)
    front = server.engine
    try:
        result["spread"] = spread(front)
        result["http"] = http_completions(base)
        routed_before = [load.routed for load in front.router.loads]
        result["abort"] = hang_up(front, base)
        result["abort"]["pools_after"] = wait_idle(front)
        result["abort"]["generated"] = [s.num_generated_tokens for s in front.stats()]
        routed_mid = [load.routed for load in front.router.loads]
        result["affinity"] = {"second": affinity_second(base), "routed_before": routed_before,
                              "routed_mid": routed_mid, "routed_after": [load.routed for load in front.router.loads],
                              "affinity_routed": [load.affinity_routed for load in front.router.loads],
                              "hit_tokens": [s.num_prefix_hit_tokens for s in front.stats()]}
        result["pools_at_end"] = wait_idle(front)
        result["metrics"] = httpx.get(base + "/metrics").text
    finally:
        uv.should_exit = True
        front.shutdown()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
