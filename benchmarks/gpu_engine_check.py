"""The engine end to end on a GPU: Pallas kernels against the plain-JAX reference backend, same greedy work.

Run on the lent GPU (``benchmarks/gpu_session.sh`` stage ``engine``)::

    python benchmarks/gpu_engine_check.py [--size tiny] [--requests 16] [--max-tokens 32]

Prints the engine's start time (bucket compiles), wall and output tokens/s per backend, and how many
requests came out token-identical. Where a run hangs, the stacks of every thread are printed every
``--stack-every`` seconds (faulthandler), so a timed-out device call still says where it stood.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--backends", default="pallas,reference")
    p.add_argument("--stack-every", type=float, default=45.0)
    args = p.parse_args(argv)
    faulthandler.dump_traceback_later(args.stack_every, repeat=True, file=sys.stderr)

    import jax

    from jaxmamba import LLM, SamplingParams
    from jaxmamba.random_checkpoint import default_checkpoint
    from jaxmamba.host_profile import HostProfile

    path = default_checkpoint("nemotron_h", args.size)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, size=int(rng.integers(4, 48))).tolist() for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, {path.name}", flush=True)
    tokens = {}
    for backend in args.backends.split(","):
        t0 = time.perf_counter()
        llm = LLM(path, kernel_backend=backend, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                  compile_progress=True)
        start = time.perf_counter() - t0
        print(f"{backend}: engine start {start:.1f} s ({llm.stats.num_buckets} buckets)", flush=True)
        llm.generate(prompts[:2], params)  # first steps off the clock
        steps0 = llm.stats.num_steps
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        steps = llm.stats.num_steps - steps0
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
        n = sum(map(len, tokens[backend]))
        print(f"{backend}: {n} tokens in {wall:.2f} s = {n / wall:.0f} tok/s, {steps} steps = "
              f"{1e3 * wall / max(steps, 1):.2f} ms/step, compiles while serving "
              f"{llm.stats.backend_compiles_since_warmup}", flush=True)
        # The same run again under the host profiler: where a step's wall time goes on this host.
        llm.host_profile = HostProfile()
        llm.generate(prompts, params)
        summary = llm.host_profile.summary()
        llm.host_profile = None
        print(f"{backend}: host profile (ms/step): " + ", ".join(
            f"{k.removesuffix('_ms_per_step')} {v:.3f}" for k, v in summary.items() if k.endswith("_ms_per_step")
        ) + f"; hidden {summary['hidden_share']:.0%}", flush=True)
        del llm
    if len(tokens) == 2:
        a, b = tokens.values()
        same = sum(x == y for x, y in zip(a, b, strict=True))
        # Outputs may differ in length: the first difference within the shorter one (zip truncates on purpose).
        first = [next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), None)
                 for x, y in zip(a, b, strict=True)]
        print(f"token-identical requests: {same}/{len(a)}; first differing position per request: {first}")
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
