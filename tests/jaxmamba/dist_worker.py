"""Multi-process engine checks, run as separate processes by ``tests/jaxmamba/test_distributed.py``.

* ``dist_worker.py pair PROCESS_ID PORT OUT MODEL...`` is one of two processes of JAX's multi-controller
  runtime on 127.0.0.1:PORT, each with 2 virtual CPU devices: ``LLM(tensor_parallel_size=4,
  coordinator_address=..., num_processes=2, process_id=...)`` over the 4 global devices serves the workload
  below (chunked prefill, prefix caching) for each ``MODEL`` (``name=checkpoint_dir``) and writes what it got to
  ``OUT`` (JSON). With ``--kill``, both then start a longer batch, and after its first step process 1 kills
  itself (SIGKILL, after writing the time to ``OUT.killed``): process 0 must then exit with the runtime's
  error, not hang.
* ``dist_worker.py single OUT MODEL...``: one process with 4 virtual CPU devices, the same workload at
  ``tensor_parallel_size=4`` and at 1 (the references).

The device count is an XLA flag that must be set before JAX starts, hence the separate processes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

#: The runtime's heartbeat timeout in the pair (seconds): how long process 0 may wait for a dead process 1.
HEARTBEAT_TIMEOUT_S = 10

ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, buckets=[(4, 16)],
                   sampling_variants="full", enable_prefix_caching=True, mamba_cache_mode="all",
                   compile_cache=None, executable_cache=False)


def workload():
    """Waves of prompts: the first computes a 33-token shared prefix (chunked: 16 tokens a step), the later
    ones resume from its cached blocks; one prompt is shorter than a block."""
    import numpy as np

    rng = np.random.default_rng(2)
    shared = rng.integers(3, 500, size=33).tolist()
    return [[shared + [7, 8], rng.integers(3, 500, size=5).tolist()],
            [shared + rng.integers(3, 500, size=n).tolist() for n in (1, 6)] + [shared[:20]]]


def serve(llm) -> dict:
    from jaxmamba import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = [o for wave in workload() for o in llm.generate(wave, params, use_tqdm=False)]
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        # per token: the chosen token's logprob and the top-2 logprobs (their gap is the top-2 logit gap)
        "logprobs": [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs],
        "top2": [[sorted(lp.values())[-2:] for lp in o.outputs[0].logprobs] for o in outs],
        "hit_tokens": llm.stats.num_prefix_hit_tokens,
        "compiles_while_serving": llm.stats.backend_compiles_since_warmup,
        "slots_in_use": llm.stats.slots_in_use,
        "blocks_in_use": llm.stats.blocks_in_use,
    }


def serve_across(llm) -> dict:
    """Serving on the same engine: process 0 takes the workload through AsyncLLM (waves of concurrent requests,
    plus one whose consumer stops after two outputs, so it is aborted) and leads; process 1 follows its steps."""
    import asyncio

    import jax

    from jaxmamba import SamplingParams
    from jaxmamba.engine.async_engine import AsyncLLM
    from jaxmamba.engine.multiprocess import follow

    core = llm.engine_core
    steps_before = core.stats.num_steps
    if jax.process_index() != 0:
        followed = follow(core)
        return {"steps_followed": followed, "steps": core.stats.num_steps - steps_before,
                "slots_in_use": core.stats.slots_in_use, "blocks_in_use": core.stats.blocks_in_use}

    engine = AsyncLLM(llm.llm_engine)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)

    async def one(prompt, rid):
        final = None
        async for out in engine.generate(prompt, params, rid):
            final = out
        return final.outputs[0]

    async def abandoned():
        n = 0
        async for _ in engine.generate([9, 8, 7, 6, 5], SamplingParams(temperature=0.0, max_tokens=40,
                                                                        ignore_eos=True), "abandoned"):
            n += 1
            if n == 2:
                break
        return n

    async def run():
        outs = []
        for w, wave in enumerate(workload()):
            tasks = [one(p, f"w{w}-{i}") for i, p in enumerate(wave)]
            if w == 0:
                tasks.append(abandoned())
            got = await asyncio.gather(*tasks)
            outs += [g for g in got if not isinstance(g, int)]
        return outs

    outs = asyncio.run(run())
    engine.shutdown()
    return {"tokens": [o.token_ids for o in outs],
            "logprobs": [[lp[t] for t, lp in zip(o.token_ids, o.logprobs)] for o in outs],
            "steps": core.stats.num_steps - steps_before,
            "slots_in_use": core.stats.slots_in_use, "blocks_in_use": core.stats.blocks_in_use}


def _models(specs: list[str]) -> dict[str, str]:
    return dict(s.split("=", 1) for s in specs)


def pair(process_id: int, port: int, out: str, specs: list[str], kill: bool) -> None:
    from jaxmamba import LLM, SamplingParams

    dist = dict(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                distributed_timeout_s=HEARTBEAT_TIMEOUT_S)
    import jax

    results, llm = {}, None
    for name, path in _models(specs).items():
        llm = LLM(path, tensor_parallel_size=4, **dist, **ENGINE_ARGS)
        results[name] = serve(llm)
        results[name]["mesh_processes"] = sorted({d.process_index for d in llm.mesh.devices.flat})
    results["serving"] = serve_across(llm)
    results["runtime"] = {"process_count": jax.process_count(), "process_index": jax.process_index(),
                          "device_count": jax.device_count(), "local_device_count": jax.local_device_count()}
    with open(out, "w") as f:
        json.dump(results, f)
    if not kill:
        return
    engine = llm.llm_engine
    for i in range(2):
        engine.add_request(f"long-{i}", [5 + i] * 9, SamplingParams(temperature=0.0, max_tokens=40,
                                                                    ignore_eos=True))
    engine.step()
    if process_id == 1:
        with open(out + ".killed", "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    while engine.has_unfinished_requests():  # process 0: the next step's collectives wait for process 1
        engine.step()
    print("process 0 finished a batch whose peer died", flush=True)


def single(out: str, specs: list[str]) -> None:
    from jaxmamba import LLM

    results = {}
    for name, path in _models(specs).items():
        results[name] = {f"tp{tp}": serve(LLM(path, tensor_parallel_size=tp, **ENGINE_ARGS)) for tp in (4, 1)}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "pair":
        kill = "--kill" in rest
        rest = [a for a in rest if a != "--kill"]
        pair(int(rest[0]), int(rest[1]), rest[2], rest[3:], kill)
    elif mode == "single":
        single(rest[0], rest[1:])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} pair PROCESS_ID PORT OUT MODEL... [--kill] | single OUT MODEL...")
