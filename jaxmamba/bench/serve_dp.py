"""``python -m jaxmamba.bench serve --data-parallel-size N``: the serve workload through the asyncio front,
one engine (``AsyncLLM``) and then ``N`` replicas (``DataParallelAsyncLLM``), in the same process.

Every request is submitted at once through ``generate`` (what the OpenAI server calls per request), greedy;
the wall time runs from the first submission to the last output. Printed: output and total tokens/s of
both, the speed-up, how the requests spread over the replicas, and whether the tokens are the same. On the
CPU the replicas need that many devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (virtual
devices share the host's cores, so the CPU shows the front's overhead and the GIL's share, not a GPU's
scaling).
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np


def _engine_args(args) -> dict:
    return dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, kernel_backend=args.kernel_backend, dtype=args.dtype,
                sampling_variants=args.sampling_variants, async_scheduling=args.async_scheduling,
                restore="eager")  # every program in before the timed serving starts


async def _drive(front, prompts, max_tokens) -> list[list[int]]:
    from jaxmamba import SamplingParams

    async def one(i):
        last = None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)
        async for out in front.generate(prompts[i], params, f"bench-{i}"):
            last = out
        return list(last.outputs[0].token_ids)

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def run_front(path, prompts, max_tokens, args, data_parallel_size: int) -> dict:
    """Build the front (one engine, or ``data_parallel_size`` replicas), serve the workload, shut it down."""
    from jaxmamba.engine.async_engine import AsyncLLM
    from jaxmamba.engine.data_parallel import DataParallelAsyncLLM

    t0 = time.perf_counter()
    if data_parallel_size == 1:
        front = AsyncLLM(path, **_engine_args(args))
    else:
        front = DataParallelAsyncLLM(path, data_parallel_size=data_parallel_size, **_engine_args(args))
    warmup = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        tokens = asyncio.run(_drive(front, prompts, max_tokens))
        wall = time.perf_counter() - t0
        stats = front.stats() if data_parallel_size > 1 else [front.stats()]
        routed = [load.routed for load in front.router.loads] if data_parallel_size > 1 else [len(prompts)]
    finally:
        front.shutdown()
    generated = sum(map(len, tokens))
    prompt_tokens = sum(s.num_prompt_tokens for s in stats)
    return {"data_parallel_size": data_parallel_size, "warmup_s": warmup, "wall_s": wall,
            "generated_tokens": generated, "output_tok_per_s": generated / wall,
            "total_tok_per_s": (generated + prompt_tokens) / wall, "steps": [s.num_steps for s in stats],
            "routed": routed, "tokens": tokens}


def compare_data_parallel(path, prompts, max_tokens, args, device: str) -> int:
    """DP=1 then DP=``args.data_parallel_size`` on the same workload; prints the table's rows."""
    runs = [run_front(path, prompts, max_tokens, args, n) for n in (1, args.data_parallel_size)]
    for r in runs:
        print(f"DP={r['data_parallel_size']:<3}: {r['output_tok_per_s']:9.1f} output tok/s   "
              f"{r['total_tok_per_s']:9.1f} total tok/s   wall {r['wall_s']:.2f} s (+ warm-up {r['warmup_s']:.1f} s)"
              f"   requests per replica {r['routed']}   steps per replica {r['steps']}")
    one, many = runs
    same = np.mean([a == b for a, b in zip(one["tokens"], many["tokens"], strict=True)])
    speedup = one["wall_s"] / many["wall_s"]
    print(f"speed-up (wall DP=1 / DP={args.data_parallel_size}): {speedup:.2f}x   identical greedy outputs: "
          f"{100 * same:.1f}% of requests")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "args": vars(args) | {"json": str(args.json)},
                                         "runs": runs, "speedup": speedup, "identical_fraction": same},
                                        indent=2, default=str))
    return 0
