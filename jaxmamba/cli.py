"""``python -m jaxmamba {generate,compare,convert,bench}``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_FAMILY = "nemotron_h"


def default_checkpoint(family: str = DEFAULT_FAMILY, size: str = "tiny") -> Path:
    """The embedded default: a deterministic random checkpoint, written once under the user cache."""
    from jaxmamba.random_checkpoint import random_model

    path = Path.home() / ".cache" / "jaxmamba" / f"random-{family}-{size}-seed0"
    if not (path / "model.safetensors").exists():
        random_model(family, size=size, seed=0, path=path)
    return path


def _checkpoint(arg: str | None, family: str) -> Path:
    return Path(arg) if arg else default_checkpoint(family)


def _parse_prompt(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"--prompt must be token ids separated by spaces or commas, got {text!r}") from None


def cmd_generate(args) -> int:
    from jaxmamba import LLM, SamplingParams

    path = _checkpoint(args.checkpoint, args.family)
    prompts = [_parse_prompt(p) for p in (args.prompt or ["1 17 42 7 99 3", "5 6 7", "300 2 44 19"])]
    llm = LLM(path, dtype=args.dtype, kernel_backend=args.kernel_backend, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    print(f"checkpoint: {path}")
    for out in outputs:
        if out.error:
            print(f"prompt {out.prompt_token_ids} rejected: {out.error}")
        else:
            print(f"prompt {out.prompt_token_ids} -> {out.outputs[0].token_ids} ({out.outputs[0].finish_reason})")
    s = llm.stats
    print(f"steps {s.num_steps}, buckets {s.num_buckets}, compilations {s.num_compilations}, "
          f"generated {s.num_generated_tokens} tokens")
    return 0 if all(o.error is None for o in outputs) else 1


def cmd_compare(args) -> int:
    from jaxmamba.compare import compare_with_transformers, format_report

    path = _checkpoint(args.checkpoint, args.family)
    dtypes = list(dict.fromkeys([args.dtype, *(args.also_dtype or [])]))
    results = []
    for i, dtype in enumerate(dtypes):
        result = compare_with_transformers(path, batch=args.batch, seq_len=args.seq_len, dtype=dtype, seed=args.seed)
        print(("\n" if i else "") + format_report(result))
        results.append(result)
    if args.report:
        from jaxmamba.report import write_compare_report

        target = Path(args.report)
        if target.suffix in (".md", ".html", ".htm"):
            report = write_compare_report(results, target.parent, filename=target.name)
        else:
            report = write_compare_report(results, target)
        print(f"\nreport: {report}")
    return 0 if all(r.ok for r in results) else 1


def cmd_convert(args) -> int:
    from jaxmamba.weights import load_hf, params_to_tensors, restore_orbax, save_hf, save_orbax

    src, dst = Path(args.src), Path(args.dst)
    if args.to == "orbax":
        cfg, params = load_hf(src, dtype=args.dtype)
        save_orbax(dst, cfg, params)
    else:
        cfg, params = restore_orbax(src, dtype=args.dtype)
        save_hf(dst, dict(cfg.hf_config), params_to_tensors(cfg, params))
    print(f"wrote {args.to} checkpoint to {dst}")
    return 0


def cmd_bench(args, rest: list[str]) -> int:
    from jaxmamba.bench.__main__ import main as bench_main

    return bench_main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxmamba", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def ckpt_args(p):
        p.add_argument("checkpoint", nargs="?", help="HF or orbax checkpoint directory (default: embedded random model)")
        p.add_argument("--family", default=DEFAULT_FAMILY, help="family of the embedded default checkpoint")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    g = sub.add_parser("generate", help="greedy generation from token-id prompts")
    ckpt_args(g)
    g.add_argument("--prompt", action="append", help="token ids, e.g. '1 17 42'; repeat for a batch")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--max-model-len", type=int, default=512)
    g.add_argument("--kernel-backend", choices=["reference", "pallas"], default="reference")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    c = sub.add_parser("compare", help="per-layer and logit differences against transformers (torch, CPU)")
    ckpt_args(c)
    c.add_argument("--batch", type=int, default=2)
    c.add_argument("--seq-len", type=int, default=37)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--also-dtype", action="append", choices=["float32", "bfloat16", "float16"],
                   help="compare in this dtype too (repeatable), e.g. --also-dtype bfloat16")
    c.add_argument("--report", metavar="PATH",
                   help="write plots and a report: a directory (report.md inside), or a .md/.html file path")
    v = sub.add_parser("convert", help="HF safetensors <-> orbax")
    v.add_argument("src")
    v.add_argument("dst")
    v.add_argument("--to", choices=["orbax", "hf"], default="orbax")
    v.add_argument("--dtype", default=None)
    sub.add_parser("bench", help="benchmarks: python -m jaxmamba bench {kernels,serve,transfer} ...", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return cmd_bench(None, argv[1:])
    args = build_parser().parse_args(argv)
    return {"generate": cmd_generate, "compare": cmd_compare, "convert": cmd_convert}[args.command](args)
