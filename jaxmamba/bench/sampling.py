"""``python -m jaxmamba.bench sampling``: the sampling tail alone (``verify_and_sample``), greedy vs full.

Times the jitted tail on ``[rows, 1, vocab]`` float32 logits (``N(0, scale^2)``; a larger scale is a more
peaked distribution, as a trained model's) for each row count, in these cases:

* ``greedy``: the ``GREEDY`` variant (an argmax), every row greedy;
* ``full-greedy-rows``: ``FULL`` on greedy rows (what ``bench decode --profile-step`` feeds it);
* ``full-top-k-p``: ``FULL``, temperature 0.8, top_k 50, top_p 0.95, no logprobs asked: the candidates serve
  it when the distribution is peaked enough;
* ``full-top-k-p-logprobs``: the same with every row asking for logprobs (the log-softmax and its top-k);
* ``full-temperature``: ``FULL``, temperature 1.0 alone: the draw covers the whole vocabulary;
* ``full-flat-top-p``: ``FULL``, top_p 0.9 on logits scaled to 0.3: the filter needs the bisection.

Each case runs ``--repeats`` times alternately with the others; its fastest run counts. The load average
is printed before and after: compare runs only at similar loads.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


def _load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def cases(rows: int, vocab: int, scale: float, seed: int = 0) -> dict[str, tuple]:
    """``name -> (variant, verify_and_sample keyword arguments)`` for the module's cases."""
    import jax.numpy as jnp

    from jaxmamba.sampling import FULL, GREEDY

    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.standard_normal((rows, 1, vocab)) * scale, jnp.float32)
    full = lambda v, dtype=jnp.float32: jnp.full((rows,), v, dtype)  # noqa: E731

    def args(temperature, top_k, top_p, x=logits, logprobs=False):
        return dict(logits=x, drafts=jnp.zeros((rows, 0), jnp.int32), num_drafts=full(0, jnp.int32),
                    temperature=full(temperature), top_k=full(top_k, jnp.int32), top_p=full(top_p),
                    seeds=jnp.arange(rows, dtype=jnp.int32), steps=full(3, jnp.int32), min_p=full(0.0),
                    wants_logprobs=full(logprobs, bool))

    return {"greedy": (GREEDY, args(0.0, 0, 1.0)), "full-greedy-rows": (FULL, args(0.0, 0, 1.0)),
            "full-top-k-p": (FULL, args(0.8, 50, 0.95)),
            "full-top-k-p-logprobs": (FULL, args(0.8, 50, 0.95, logprobs=True)),
            "full-temperature": (FULL, args(1.0, 0, 1.0)),
            "full-flat-top-p": (FULL, args(1.0, 0, 0.9, logits * (0.3 / scale)))}


def time_cases(rows: int, vocab: int, scale: float, repeats: int, calls: int = 5) -> dict[str, float]:
    """Milliseconds per tail call, the fastest of ``repeats`` runs of ``calls`` calls, per case."""
    import jax

    from jaxmamba.sampling import MAX_LOGPROBS, verify_and_sample

    runs = {}
    for name, (variant, kwargs) in cases(rows, vocab, scale).items():
        fn = jax.jit(lambda a, v=variant: verify_and_sample(**a, num_logprobs=MAX_LOGPROBS, variant=v))
        jax.block_until_ready(fn(kwargs))  # compile
        runs[name] = (fn, kwargs, [])
    for _ in range(repeats):
        for fn, kwargs, walls in runs.values():
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn(kwargs)
            jax.block_until_ready(out)
            walls.append((time.perf_counter() - t0) / calls)
    return {name: 1e3 * min(walls) for name, (_, _, walls) in runs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxmamba.bench sampling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="32,128", help="comma-separated row counts")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--scale", type=float, default=5.0, help="the logits' standard deviation")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    if not rows or min(rows) < 1 or args.vocab < 2:
        p.error("--rows needs positive row counts and --vocab at least 2")

    import jax

    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; vocab "
          f"{args.vocab}, logits N(0, {args.scale}^2), best of {args.repeats}; load average {_load_average()}")
    results = {}
    for r in rows:
        ms = time_cases(r, args.vocab, args.scale, args.repeats)
        results[r] = ms
        base = ms["greedy"]
        print(f"rows {r:4d}: " + "   ".join(f"{name} {v:.3f} ms ({v / base:.2f}x)" for name, v in ms.items()))
    print(f"load average after: {_load_average()}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "ms": results}, indent=2))
    return 0
