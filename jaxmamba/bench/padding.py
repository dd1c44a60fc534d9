"""``python -m jaxmamba.bench padding``: what a bucket ladder costs in padding on ``bench serve``'s workloads.

The workload (``--workload mixed|prefix|spec``, ``bench serve``'s generators and defaults) runs once through
an engine with a single bucket (one program: the batches a scheduler forms do not depend on the buckets), and
every step's batch is recorded: rows, tokens, prefill rows, pure decode or not. Each ladder then picks its
bucket for every recorded batch (``select_bucket``), and the padding is reported per step: tokens padded
(``T - tokens``), rows padded (``R - rows``), prefill rows padded, and the programs the ladder compiles.
Ladders: ``default`` (``buckets.default_buckets``) and ``pow2`` (every power-of-two rung at ``R = min(T, S)``
and ``R = S``, prefill rows ``{4, 32, R}``, greedy tails on every decode bucket and mixed ones of >= 32 rows:
the ladder before ``default_buckets``' short one).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from jaxmamba.buckets import Bucket, bucket_sampling_variants, default_buckets, select_bucket


def pow2_buckets(max_num_seqs: int, max_num_batched_tokens: int, num_spec: int = 0) -> tuple[Bucket, ...]:
    """The ladder before ``default_buckets``' short one (for comparison): every power-of-two rung."""
    def upto(n, start=1):
        out, v = [], start
        while v < n:
            out.append(v)
            v *= 2
        return out + [n]

    rows = lambda r: sorted({p for p in (4, 32) if 4 * p <= r} | {r})  # noqa: E731
    decode = [Bucket(r * (1 + num_spec), r, True) for r in upto(max_num_seqs)]
    mixed = [Bucket(t, r, False, p) for t in upto(max_num_batched_tokens, 16)
             for r in {min(t, max_num_seqs), max_num_seqs} for p in rows(r)]
    return tuple(sorted(set(decode + mixed)))


def pow2_programs(buckets) -> int:
    return sum(2 if (b.decode_only or b.num_reqs >= 32) else 1 for b in buckets)


def record_batches(path, prompts, max_tokens, engine_args: dict, wave: int | None = None) -> list[tuple]:
    """``(rows, tokens, prefill rows, decode_only)`` of every step the workload takes. ``RuntimeError`` if a request
    did not finish normally (a failed step ends its requests with an error: its batches would be missing)."""
    from jaxmamba import LLM, SamplingParams
    from jaxmamba.engine import runner

    batches = []
    select = runner.ModelRunner._select_bucket

    # The runner's own selection, called every step (``select_bucket`` itself only for a batch shape it has not
    # met before: the runner remembers each shape's bucket).
    def recording(self, num_reqs, num_tokens, decode_only, num_prefills):
        batches.append((num_reqs, num_tokens, 0 if decode_only else (num_prefills or num_reqs), decode_only))
        return select(self, num_reqs, num_tokens, decode_only, num_prefills)

    S, B = engine_args["max_num_seqs"], engine_args["max_num_batched_tokens"]
    llm = LLM(path, buckets=[(S, B)], sampling_variants="full", compile_progress=False, **engine_args)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    runner.ModelRunner._select_bucket = recording
    outputs = []
    try:
        wave = wave or len(prompts)
        for i in range(0, len(prompts), wave):
            outputs += llm.generate(prompts[i: i + wave], params[i: i + wave], use_tqdm=False)
    finally:
        runner.ModelRunner._select_bucket = select
    failed = [o for o in outputs if o.outputs[0].finish_reason != "length"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outputs)} requests did not finish normally (first: request "
                           f"{failed[0].request_id}, finish_reason {failed[0].outputs[0].finish_reason!r}): the "
                           "engine's log above names the failed step")
    return batches


def padding(batches, buckets) -> dict:
    """Mean tokens, rows and prefill rows padded per step when ``buckets`` serve ``batches``."""
    pads = []
    for rows, tokens, prefills, decode_only in batches:
        b = select_bucket(buckets, rows, tokens, decode_only, prefills if not decode_only else None)
        pads.append((b.num_tokens - tokens, b.num_reqs - rows, b.num_prefills - prefills, b.num_tokens, b.num_reqs))
    pads = np.array(pads, float)
    return dict(tokens_padded=pads[:, 0].mean(), rows_padded=pads[:, 1].mean(), prefill_rows_padded=pads[:, 2].mean(),
                bucket_tokens=pads[:, 3].mean(), bucket_rows=pads[:, 4].mean())


def main(argv=None) -> int:
    from jaxmamba.bench import serve

    p = argparse.ArgumentParser(prog="python -m jaxmamba.bench padding", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="mixed", choices=["mixed", "prefix", "spec"])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=160)
    p.add_argument("--num-spec", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    from jaxmamba.random_checkpoint import default_checkpoint
    from jaxmamba.config import HybridConfig

    path = default_checkpoint()
    vocab = HybridConfig.from_hf(path).vocab_size
    engine_args = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len)
    wave, num_spec = None, 0
    if args.workload == "prefix":
        prompts, max_tokens = serve.prefix_workload(args.num_requests, vocab, 4, 96, (8, 96), (8, 48), 0)
        engine_args.update(enable_prefix_caching=True, mamba_cache_mode="align")
        wave = args.max_num_seqs
    elif args.workload == "spec":
        prompts, max_tokens = serve.spec_workload(args.num_requests, vocab, (8, 96), (8, 48), 0)
        engine_args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.num_spec}
        num_spec = args.num_spec
    else:
        prompts, max_tokens = serve.workload(args.num_requests, vocab, (8, 96), (8, 48), 0)
    batches = record_batches(path, prompts, max_tokens, engine_args, wave)
    S, B = args.max_num_seqs, args.max_num_batched_tokens
    ladders = {"default": default_buckets(S, B, num_spec), "pow2": pow2_buckets(S, B, num_spec)}
    programs = {"default": sum(len(bucket_sampling_variants(b)) for b in ladders["default"]),
                "pow2": pow2_programs(ladders["pow2"])}
    rows, tokens = np.array([b[0] for b in batches]), np.array([b[1] for b in batches])
    print(f"workload {args.workload} at max_num_seqs={S}, max_num_batched_tokens={B}: {len(batches)} steps, "
          f"{rows.mean():.1f} rows and {tokens.mean():.1f} tokens per step")
    print(f"{'ladder':<9}{'buckets':>8}{'programs':>9}{'tok pad':>9}{'row pad':>9}{'P pad':>8}{'bucket T':>9}"
          f"{'bucket R':>9}")
    results = {}
    for name, buckets in ladders.items():
        r = results[name] = padding(batches, buckets) | {"buckets": len(buckets), "programs": programs[name]}
        print(f"{name:<9}{len(buckets):>8}{programs[name]:>9}{r['tokens_padded']:>9.1f}{r['rows_padded']:>9.1f}"
              f"{r['prefill_rows_padded']:>8.1f}{r['bucket_tokens']:>9.1f}{r['bucket_rows']:>9.1f}")
    if args.json:
        args.json.write_text(json.dumps(dict(args=vars(args) | {"json": str(args.json)}, steps=len(batches),
                                             results=results), indent=1) + "\n")
    return 0
