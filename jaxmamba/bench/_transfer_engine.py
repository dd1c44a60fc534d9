"""The engine flow of ``python -m jaxmamba.bench transfer --engine`` (its docstring says what is measured):
a prefill ``LLM`` and a decode ``LLM`` in two spawned processes per ratio (``jaxmamba.engine.disagg``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxmamba.bench._transfer_pages import _host, _nixl_version, row_status

ENGINE_HEADER = (f"{'P/D':>5} {'ratio':>5} {'imported':>8} {'B/req':>12} {'descs/req':>9} {'READ ms/req':>11} "
                 f"{'GB/s':>6} {'prefill s':>9} {'decode s':>8}  verified")


def format_engine_row(row: dict) -> str:
    line, ok = row_status(row)
    if line is not None:
        return line
    return (f"{row['ratio']:>5} {row['tp_ratio']:>+5d} {row['imported']:>4d}/{row['requests']:<3d} "
            f"{row['bytes_per_request']:>12,.0f} {row['descriptors_per_request']:>9,.0f} "
            f"{row['read_ms_per_request']:>11.3f} {row['gb_per_s']:>6.2f} {row['prefill_s']:>9.2f} "
            f"{row['decode_s']:>8.2f}  {ok}")


def run_engine_ratio(model: str, prompts: list[list[int]], p_tp: int, d_tp: int, engine_args: dict,
                     args: argparse.Namespace, compile_cache: str) -> dict:
    """One P_TP/D_TP pair through ``jaxmamba.engine.disagg``'s processes; a row of ``--engine``'s table."""
    from jaxmamba.engine.disagg import EngineProcess, Handoff, decode_process_main, prefill_process_main
    from transfer.hetero_tp import signed_tp_ratio

    env = {"JAX_PLATFORMS": "cpu", "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
           **({"UCX_TLS": os.environ["UCX_TLS"]} if "UCX_TLS" in os.environ else {})}

    def spec(tp: int, engine: dict, **extra) -> dict:
        return {"env": {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}"},
                "compile_cache": compile_cache, "engines": {"m": engine}, **extra}

    tag = f"bench{os.getpid()}"
    row: dict[str, Any] = dict(ratio=f"{p_tp}/{d_tp}", p_tp=p_tp, d_tp=d_tp, tp_ratio=signed_tp_ratio(p_tp, d_tp),
                               requests=len(prompts))
    procs = []
    try:
        # P keeps NIXL's progress thread here (as a deployment would), so READs do not wait for its loop.
        prefill = EngineProcess(prefill_process_main, spec(p_tp, {
            "model": model, "engine_id": f"{tag}-P{p_tp}", "staging_requests": len(prompts),
            "engine_args": dict(engine_args, tensor_parallel_size=p_tp)}, progress_thread=True))
        procs.append(prefill)
        decode = EngineProcess(decode_process_main, spec(d_tp, {
            "model": model, "name": f"{tag}-D{d_tp}", "staging_requests": len(prompts), "timeout_s": args.timeout,
            "engine_args": dict(engine_args, tensor_parallel_size=d_tp)}))
        procs.append(decode)
        problem = decode.call("connect", "m", prefill.ready["m"])
        if problem:
            return dict(row, verified=False, error=problem)
        params = dict(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        handoffs = prefill.call("prefill", "m", prompts)
        t1 = time.perf_counter()
        result = decode.call("generate", "m", handoffs, params)
        t2 = time.perf_counter()
        local = decode.call("generate", "m", [Handoff("none", tuple(p)).to_bytes() for p in prompts], params)
        records = [r for r in result["transfers"] if r is not None]
        imported = [r for r in records if r["status"] == "imported"]
        total_bytes = sum(r["bytes_read"] for r in imported)
        read_s = sum(r["read_seconds"] for r in imported)
        n = max(len(imported), 1)
        problems = []
        if len(imported) != len(prompts):
            problems.append(f"{len(prompts) - len(imported)} request(s) not imported: "
                            + "; ".join(sorted({str(r['error']) for r in records if r["status"] != "imported"})))
        if result["outputs"] != local["outputs"]:
            bad = sum(a != b for a, b in zip(result["outputs"], local["outputs"], strict=True))
            problems.append(f"{bad} request(s) decode other tokens than the D engine computes from the prompt")
        for key in ("slots_in_use", "blocks_in_use", "staging_in_use", "compiles_while_serving"):
            if result[key]:
                problems.append(f"{key}={result[key]}")
        if result["invariants"]:
            problems.append(result["invariants"])
        deadline = time.monotonic() + 10
        while (staged := prefill.call("poll")) != {"m": 0} and time.monotonic() < deadline:
            time.sleep(0.01)
        if staged != {"m": 0}:
            problems.append(f"P still stages {staged['m']} handoff(s): not every reader notified it")
        row.update(imported=len(imported), bytes_per_request=total_bytes / n,
                   descriptors_per_request=sum(r["num_descriptors"] for r in imported) / n,
                   read_ms_per_request=1e3 * read_s / n, gb_per_s=total_bytes / max(read_s, 1e-9) / 1e9,
                   prefill_s=t1 - t0, decode_s=t2 - t1, verified=not problems, problems=problems)
        return row
    finally:
        for proc in procs:
            proc.close()


def _run_engine(p: argparse.ArgumentParser, args: argparse.Namespace, argv) -> int:
    import tempfile

    from jaxmamba.config import HybridConfig
    from jaxmamba.errors import ConfigError, TransferError
    from jaxmamba.random_checkpoint import random_model
    from transfer.hetero_tp import TransferPlan, TransferShape

    if args.dtype or args.ssm_dtype or args.kv_layout != "NHD" or args.d_pages != "jaxmamba":
        p.error("--engine runs the engines' own caches: float32, NHD KV, jaxmamba pages (drop --dtype/--ssm-dtype/"
                "--kv-layout/--d-pages)")
    if args.max_tokens <= 0 or args.max_num_batched_tokens <= 0:
        p.error("--max-tokens and --max-num-batched-tokens must be positive")
    workdir = Path(tempfile.mkdtemp(prefix="jaxmamba-bench-transfer-"))
    model = str(random_model(args.family, args.size, seed=args.seed, path=workdir / "model"))
    compile_cache = args.compile_cache or str(workdir / "jax_cache")
    cfg = HybridConfig.from_hf(json.loads((Path(model) / "config.json").read_text()))
    shape = TransferShape.from_config(cfg, conv_dtype=4, ssm_dtype=4, kv_dtype=4, block_size=args.block_size)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, cfg.vocab_size, size=args.prompt_len).tolist() for _ in range(args.requests)]
    max_num_seqs = min(args.requests, 8)
    batched = max(args.max_num_batched_tokens, max_num_seqs)
    engine_args = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched, block_size=args.block_size,
                       max_model_len=args.prompt_len + args.max_tokens, buckets=[(max_num_seqs, batched)])

    given = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m jaxmamba.bench transfer", shlex.join(given)]).rstrip()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), host=_host(), nixl=_nixl_version(),
                ucx_tls=os.environ.get("UCX_TLS", "unset (UCX picks)"), python=platform.python_version(),
                command=command, mode="engine", family=cfg.family, size=args.size, requests=args.requests,
                prompt_len=args.prompt_len, max_tokens=args.max_tokens, engine_args=engine_args)
    print("transfer benchmark, engine flow: a prefill LLM and a decode LLM in two spawned processes, real NIXL "
          "READs of each request's staged pages (jaxmamba.engine.disagg)")
    print(f"date: {meta['date']}   host: {meta['host']}")
    print(f"nixl {meta['nixl']}, UCX_TLS={meta['ucx_tls']}, python {meta['python']}")
    print(f"command: {command}")
    print(f"model: {cfg.family} {args.size} (random), {len(cfg.mamba_layer_ids)} Mamba2 + "
          f"{len(cfg.attention_layer_ids)} attention layers, float32 caches; {args.requests} prompts x "
          f"{args.prompt_len} tokens (P computes {args.prompt_len - 1}), {args.max_tokens} greedy tokens on D; "
          f"engines: {engine_args}")
    print("columns: B/req = bytes READ per request over all D ranks; READ ms/req = every D rank's READ, one after "
          "another; prefill s / decode s = wall time of the whole prefill / decode call")
    print(ENGINE_HEADER)
    rows = []
    for p_tp, d_tp in dict.fromkeys(args.ratios):
        try:
            TransferPlan(shape, p_tp, d_tp, 0)
        except (ConfigError, TransferError) as err:
            rows.append(dict(ratio=f"{p_tp}/{d_tp}", p_tp=p_tp, d_tp=d_tp, unsupported=str(err)))
        else:
            try:
                rows.append(run_engine_ratio(model, prompts, p_tp, d_tp, engine_args, args, compile_cache))
            except (ConfigError, TransferError) as err:
                rows.append(dict(ratio=f"{p_tp}/{d_tp}", p_tp=p_tp, d_tp=d_tp, verified=False,
                                 error=f"{type(err).__name__}: {err}"))
        print(format_engine_row(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str))
    failed = [r["ratio"] for r in rows if "unsupported" not in r and not r.get("verified")]
    if failed:
        print(f"FAILED: {', '.join(failed)} (see the rows above)")
        return 1
    print(f"{sum('unsupported' not in r for r in rows)} ratio(s) verified: every request imported, the same tokens "
          "as the decode engine alone, nothing left over on either engine")
    return 0
