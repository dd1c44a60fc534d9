"""``python -m jaxmamba.bench transfer``: P/D state transfer across TP sizes over real NIXL READs.

For every ``P_TP/D_TP`` ratio (``--ratios``) a synthetic prefill engine of ``P_TP`` ranks runs in a
spawned process (``transfer.pages.synthetic_prefill_main``) and this process is the decode engine, one
``PageImporter`` (NIXL agent, UCX backend) per D rank, host memory on both sides. ``--requests`` prompts
of ``--prompt-len`` tokens; each D rank READs every request's pages (exactly the ``TransferPlan`` byte
ranges, notifications included). Reported per ratio: bytes per request over the D ranks (Mamba and KV
apart), READ descriptors per request, the P ranks each D rank reads from, cold and warm READ wall time and
bandwidth (GB = 1e9 bytes). Every READ is verified byte for byte against ``transfer.pages`` (sentinels in
unread pages, the bridge's bytes equal the plan's, every notification heard). Exit status 1 if any
verification failed; 0 with a message (and no table) if NIXL is not importable.

``--engine``: the engine flow instead (``jaxmamba.engine.disagg``): a prefill ``LLM`` (P_TP) and a decode
``LLM`` (D_TP) in two spawned processes; D READs, installs and decodes ``--max-tokens`` greedy tokens,
verified against the same engine computing from the prompts alone.

Method and reports in full: docs/architecture.md, "Benchmarks: bench decode and bench transfer".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from jaxmamba.bench._transfer_engine import (  # noqa: F401 - the engine flow's names, importable from here
    ENGINE_HEADER,
    _run_engine,
    format_engine_row,
    run_engine_ratio,
)
from jaxmamba.bench._transfer_pages import (  # noqa: F401 - the page-level flow's names, importable from here
    SENTINEL,
    DecodeRank,
    PrefillProcess,
    Workload,
    _host,
    _nixl_version,
    row_status,
    run_ratio,
)

DEFAULT_RATIOS = "1/2,1/4,2/4,2/1,4/2,4/1,1/1"
_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parse_ratios(text: str) -> list[tuple[int, int]]:
    """``"1/2,4/1"`` -> ``[(1, 2), (4, 1)]`` (P_TP/D_TP)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            p, d = (int(v) for v in item.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"ratio {item!r} is not P_TP/D_TP (e.g. 2/4)") from None
        if p <= 0 or d <= 0:
            raise argparse.ArgumentTypeError(f"ratio {item!r}: TP sizes must be positive")
        out.append((p, d))
    if not out:
        raise argparse.ArgumentTypeError("no ratios given")
    return out


HEADER = (f"{'P/D':>5} {'ratio':>5} {'src':>3} {'Mamba B/req':>12} {'KV B/req':>11} {'total B/req':>12} "
          f"{'descs/req':>9} {'cold ms':>8} {'READ ms':>8} {'ms/req':>7} {'GB/s':>6}  verified")


def format_row(row: dict) -> str:
    line, ok = row_status(row)
    if line is not None:
        return line
    return (f"{row['ratio']:>5} {row['tp_ratio']:>+5d} {row['sources_per_d_rank']:>3d} "
            f"{row['mamba_bytes_per_request']:>12,d} {row['kv_bytes_per_request']:>11,d} "
            f"{row['bytes_per_request']:>12,d} {row['descriptors_per_request']:>9,.0f} "
            f"{1e3 * row['cold_wall_s']:>8.2f} {1e3 * row['wall_s']:>8.2f} {row['ms_per_request']:>7.3f} "
            f"{row['gb_per_s']:>6.2f}  {ok}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxmamba.bench transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratios", type=parse_ratios, default=parse_ratios(DEFAULT_RATIOS),
                   help=f"comma-separated P_TP/D_TP pairs (default {DEFAULT_RATIOS})")
    p.add_argument("--family", default="nemotron_h")
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (KV blocks = ceil(len / block))")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="conv and KV cache dtype (default: the model's dtype)")
    p.add_argument("--ssm-dtype", default=None, choices=sorted(_DTYPES), help="SSM state dtype (default: --dtype)")
    p.add_argument("--kv-layout", default="NHD", choices=["NHD", "HND"],
                   help="KV block layout on both engines (NHD: jaxmamba's; HND: vLLM's for heterogeneous TP)")
    p.add_argument("--d-pages", default="jaxmamba", choices=["jaxmamba", "vllm"],
                   help="decode-side Mamba pages: separate conv/SSM arrays (jaxmamba.cache) or vLLM's unified page")
    p.add_argument("--repeats", type=int, default=5, help="passes over all requests; the first is reported as cold")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per READ before it counts as failed")
    p.add_argument("--ucx-tls", default=None,
                   help="UCX_TLS for both engines, e.g. 'tcp' for TCP over loopback only (default: the environment's "
                        "UCX_TLS, else UCX picks: shared memory / CMA between processes on one host)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows (and the run's metadata) here")
    p.add_argument("--engine", action="store_true",
                   help="the engine flow: prefill and decode LLMs in two processes (jaxmamba.engine.disagg)")
    p.add_argument("--max-tokens", type=int, default=4, help="--engine: greedy tokens decoded per request")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="--engine: the engines' token budget")
    p.add_argument("--compile-cache", default=None,
                   help="--engine: JAX compile cache both processes share (default: a fresh directory for the run)")
    args = p.parse_args(argv)
    if args.requests <= 0 or args.prompt_len <= 0 or args.block_size <= 0 or args.repeats <= 0:
        p.error("--requests, --prompt-len, --block-size and --repeats must be positive")

    from transfer.nixl_bridge import nixl_available

    if not nixl_available():
        print("SKIPPED: NIXL is not importable (install the 'nixl' extra: pip install -e '.[nixl]'); "
              "the transfer benchmark needs real NIXL agents")
        return 0
    if not os.environ.get("NIXL_LOG_LEVEL"):  # one INFO line per agent would break up the table
        logging.getLogger("nixl").setLevel(logging.WARNING)
    saved_tls = os.environ.get("UCX_TLS")
    if args.ucx_tls:  # read by UCX when each agent's backend is created (here and in the P process)
        os.environ["UCX_TLS"] = args.ucx_tls
    try:
        return (_run_engine if args.engine else _run)(p, args, argv)
    finally:
        if args.ucx_tls:
            if saved_tls is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = saved_tls


def _run(p: argparse.ArgumentParser, args: argparse.Namespace, argv) -> int:
    from jaxmamba.config import HybridConfig
    from jaxmamba.random_checkpoint import random_config_dict
    from transfer.hetero_tp import TransferShape

    cfg = HybridConfig.from_hf(random_config_dict(args.family, args.size))
    dtype = args.dtype or str(cfg.hf_config.get("dtype") or cfg.hf_config.get("torch_dtype") or "float32")
    ssm_dtype = args.ssm_dtype or dtype
    if dtype not in _DTYPES or ssm_dtype not in _DTYPES:
        p.error(f"unsupported dtype {dtype!r}/{ssm_dtype!r}")
    shape = TransferShape.from_config(cfg, conv_dtype=_DTYPES[dtype], ssm_dtype=_DTYPES[ssm_dtype],
                                      kv_dtype=_DTYPES[dtype], block_size=args.block_size, kv_layout=args.kv_layout)
    work = Workload.build(cfg, args.requests, args.prompt_len, args.block_size, args.seed)

    given = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m jaxmamba.bench transfer", shlex.join(given)]).rstrip()
    meta = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), host=_host(), nixl=_nixl_version(),
        ucx_tls=os.environ.get("UCX_TLS", "unset (UCX picks)"), python=platform.python_version(), command=command,
        family=cfg.family, size=args.size, num_layers=cfg.num_hidden_layers,
        mamba_layers=len(work.mamba_layers), attention_layers=len(work.kv_layers), dtype=dtype, ssm_dtype=ssm_dtype,
        kv_layout=args.kv_layout, d_pages=args.d_pages, block_size=args.block_size, requests=args.requests,
        prompt_len=args.prompt_len, blocks_per_request=work.blocks_per_request, repeats=args.repeats,
        transfer_shape=dataclasses.asdict(shape),
    )
    _print_setup(meta, cfg, args, shape, work)
    out_rows = _run_ratios(args, shape, work)
    idle = [(r["ratio"], r["p_idle_cpu_cores"], r["d_idle_cpu_cores"]) for r in out_rows
            if r.get("p_idle_cpu_cores") is not None and r.get("d_idle_cpu_cores") is not None]
    if idle:
        print("CPU used while idle (after connect, before the READs; NIXL progress threads): "
              + ", ".join(f"{ratio} P {p:.2f} / D {d:.2f} cores" for ratio, p, d in idle)
              + f" -- on {os.cpu_count()} cores shared by both processes")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": out_rows}, indent=2, default=str))
    failed = [r["ratio"] for r in out_rows if "unsupported" not in r and not r.get("verified")]
    if failed:
        print(f"FAILED: {', '.join(failed)} (see the rows above)")
        return 1
    ran = [r for r in out_rows if "unsupported" not in r]
    print(f"{len(ran)} ratio(s) verified: every D rank's pages equal its own sharding of the P state, "
          "unread pages untouched, every notification delivered")
    return 0


def _print_setup(meta: dict, cfg, args: argparse.Namespace, shape, work: Workload) -> None:
    """The run's header: where and what it measures, then the table's columns."""
    command, dtype, ssm_dtype = meta["command"], meta["dtype"], meta["ssm_dtype"]
    print("transfer benchmark: real NIXL READs (UCX backend) from a spawned prefill process into this "
          "decode process, host memory on both sides")
    print(f"date: {meta['date']}   host: {meta['host']}")
    print(f"nixl {meta['nixl']}, UCX_TLS={meta['ucx_tls']}, python {meta['python']}")
    print(f"command: {command}")
    print(f"model: {cfg.family} {args.size} (random), {cfg.num_hidden_layers} layers: {len(work.mamba_layers)} Mamba2 "
          f"(heads {shape.num_heads}x{shape.head_dim}, n_groups {shape.n_groups}, d_state {shape.d_state}, "
          f"conv {shape.conv_kernel}), {len(work.kv_layers)} attention (kv heads {shape.num_kv_heads}x"
          f"{shape.attn_head_dim}); conv/KV {dtype}, SSM {ssm_dtype}")
    print(f"workload: {args.requests} requests x {args.prompt_len} tokens: per request 1 Mamba slot per Mamba layer "
          f"+ {work.blocks_per_request} KV blocks of {args.block_size} per attention layer ({args.kv_layout}); "
          f"D Mamba pages: {args.d_pages}; {args.repeats} passes (cold = first, READ ms = median of the rest)")
    print("columns: ratio = signed D_TP/P_TP (vLLM); src = P ranks one D rank reads from; B/req = bytes per request "
          "over all D ranks; READ ms = all requests x all D ranks, one after another")
    print(HEADER)


def _run_ratios(args: argparse.Namespace, shape, work: Workload) -> list[dict]:
    """One row per ``--ratios`` entry, in that order, printed as it completes: one prefill process per P_TP
    serves every ratio with that P_TP."""
    from jaxmamba.errors import ConfigError, TransferError
    from transfer.hetero_tp import TransferPlan

    rows: dict[tuple[int, int], dict] = {}
    by_p: dict[int, list[int]] = {}
    for p_tp, d_tp in args.ratios:
        try:
            TransferPlan(shape, p_tp, d_tp, 0)  # refuses a TP size the model cannot be sharded over
        except (ConfigError, TransferError) as err:
            rows[(p_tp, d_tp)] = dict(ratio=f"{p_tp}/{d_tp}", p_tp=p_tp, d_tp=d_tp, unsupported=str(err))
            continue
        if d_tp not in by_p.setdefault(p_tp, []):
            by_p[p_tp].append(d_tp)
    printed = 0
    order = list(dict.fromkeys(args.ratios))

    def flush() -> None:
        nonlocal printed
        while printed < len(order) and order[printed] in rows:
            print(format_row(rows[order[printed]]), flush=True)
            printed += 1

    for p_tp, d_tps in by_p.items():
        spec = dict(shape=dataclasses.asdict(shape), p_tp=p_tp, num_slots=work.num_slots, num_blocks=work.num_blocks,
                    seed=args.seed, mamba_layers=list(work.mamba_layers), kv_layers=list(work.kv_layers), p_pad=0,
                    engine_id=f"prefill-p{p_tp}-{os.getpid()}",
                    env={"NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
                         **({"UCX_TLS": os.environ["UCX_TLS"]} if "UCX_TLS" in os.environ else {})})
        prefill = PrefillProcess(spec, timeout_s=max(120.0, args.timeout))
        try:
            for d_tp in d_tps:
                try:
                    rows[(p_tp, d_tp)] = run_ratio(prefill, spec, shape, work, p_tp, d_tp, args)
                except (ConfigError, TransferError) as err:
                    rows[(p_tp, d_tp)] = dict(ratio=f"{p_tp}/{d_tp}", p_tp=p_tp, d_tp=d_tp, verified=False,
                                              error=f"{type(err).__name__}: {err}")
                flush()
        finally:
            prefill.shutdown()
    flush()
    return [rows[k] for k in order]
