"""``python -m jaxmamba {generate,serve,serve-prefill,compare,convert,plan,bench}``.

User errors (a bad argument, a checkpoint that cannot be served, a missing extra) print one line,
``error: ...``, and exit with status 2; only bugs print a traceback."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from jaxmamba.cli_interrupts import (exit_at_sigint_from_any_thread, exit_interrupted, on_main_thread,
                                     run_forwarding_sigint)
from jaxmamba.config import DEFAULT_FAMILY


def __getattr__(name: str):
    """``jaxmamba.cli.default_checkpoint`` is ``jaxmamba.random_checkpoint``'s, loaded on first use: importing
    the CLI must not pay for JAX (``python -m jaxmamba --help``)."""
    if name == "default_checkpoint":
        from jaxmamba.random_checkpoint import default_checkpoint

        return default_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _checkpoint(arg: str | None, family: str) -> Path:
    if arg:
        return Path(arg)
    from jaxmamba.random_checkpoint import default_checkpoint  # JAX: only once a command needs a checkpoint

    return default_checkpoint(family)


class UserError(Exception):
    """A mistake of the command line's user: reported as one line, exit status 2."""


def _parse_prompt(text: str) -> list[int] | str:
    """Token ids separated by spaces or commas, or else text (needs the checkpoint's tokenizer)."""
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        return text


def _needs(extra: str, *modules: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"this command needs {', '.join(missing)}: pip install 'jaxmamba[{extra}]'")


def _sizing_kwargs(args) -> dict:
    """The engine's pool and bucket sizes (generate, serve-prefill): only those given on the command line."""
    names = ("max_num_seqs", "max_num_batched_tokens", "block_size", "buckets")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _job_limits(args, prompts: list) -> dict[str, int]:
    """``engine_args.limits_for_prompts`` of ``prompts`` (text counted as its UTF-8 bytes plus two special tokens, which
    byte-level and byte-fallback tokenizers do not exceed; a longer prompt would only be chunked), unless the command
    line sizes the engine itself or ``--kv-peer`` imports the prompts' state (the engine then runs as configured)."""
    from jaxmamba.engine.engine_args import limits_for_prompts

    if args.kv_peer or any(getattr(args, name) is not None
                           for name in ("max_num_seqs", "max_num_batched_tokens", "buckets")):
        return {}
    return limits_for_prompts([max(1, len(p)) if isinstance(p, list) else len(p.encode()) + 2 for p in prompts])


def cmd_generate(args) -> int:
    from jaxmamba import LLM, SamplingParams

    path = _checkpoint(args.checkpoint, args.family)
    prompts = [_parse_prompt(p) for p in (args.prompt or ["1 17 42 7 99 3", "5 6 7", "300 2 44 19"])]
    if args.kv_peer:  # fail fast, before the model loads, when the prefill engine cannot be reached
        from transfer.control import ControlClient, parse_address

        parse_address(args.kv_peer, what="peer address")
        if not args.process_id:  # only process 0 of a multi-process decode engine dials it (RemoteDisaggregation)
            ControlClient(args.kv_peer, connect_timeout_s=args.kv_connect_timeout).close()
    llm = LLM(path, dtype=args.dtype, kernel_backend=args.kernel_backend, max_model_len=args.max_model_len,
              dt_clamp=args.dt_clamp, async_scheduling=args.async_scheduling,
              num_scheduler_steps=args.num_scheduler_steps, matmul_precision=args.matmul_precision,
              **_parallel_kwargs(args), **_sizing_kwargs(args), **_job_limits(args, prompts),
              **({} if args.quiet else {"compile_progress": True}))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    transfers = None
    if args.kv_peer:
        outputs, transfers = _generate_with_remote_prefill(llm, args, prompts, params)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    if args.json:
        import json

        for i, out in enumerate(outputs):
            print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "token_ids": out.outputs[0].token_ids,
                              "text": out.outputs[0].text, "finish_reason": out.outputs[0].finish_reason,
                              "error": out.error, "transfer": None if transfers is None else transfers[i]}))
        return 0 if all(o.error is None for o in outputs) else 1
    print(f"checkpoint: {path}")
    for out in outputs:
        if out.error:
            print(f"prompt {out.prompt_token_ids} rejected: {out.error}")
        else:
            text = f" {out.outputs[0].text!r}" if out.outputs[0].text else ""
            print(f"prompt {out.prompt_token_ids} -> {out.outputs[0].token_ids}{text} ({out.outputs[0].finish_reason})")
    s = llm.stats
    print(f"steps {s.num_steps}, buckets {s.num_buckets}, compilations {s.num_compilations}, "
          f"generated {s.num_generated_tokens} tokens")
    return 0 if all(o.error is None for o in outputs) else 1


def _generate_with_remote_prefill(llm, args, prompts, params) -> tuple[list, list[dict]]:
    """``generate --kv-peer``: the prefill engine at that address computes the prompts (P/D across hosts)."""
    from dataclasses import asdict

    from jaxmamba.engine.disagg import DecodeEngine, RemoteDisaggregation

    decode = DecodeEngine(llm, name=args.engine_id or "decode", timeout_s=args.kv_timeout,
                          ucx_devices=args.ucx_devices)
    remote = RemoteDisaggregation(decode, args.kv_peer, lease_s=args.kv_lease,
                                  connect_timeout_s=args.kv_connect_timeout)
    try:
        outputs = remote.generate(prompts, params)
    finally:
        remote.close()
    records = [decode.transfers.get(o.request_id) for o in outputs]
    return outputs, [None if r is None else asdict(r) for r in records]


def cmd_serve_prefill(args) -> int:
    import signal

    from jaxmamba import LLM
    from jaxmamba.engine.disagg import PrefillEngine, PrefillServer, follow_prefill_server
    from transfer.control import advertised_address, parse_address

    host, _ = parse_address(args.kv_listen, what="--kv-listen", allow_port_zero=True)  # before the model loads
    advertised_address(host, 1, args.kv_advertise)
    path = _checkpoint(args.checkpoint, args.family)
    llm = LLM(path, dtype=args.dtype, kernel_backend=args.kernel_backend, max_model_len=args.max_model_len,
              dt_clamp=args.dt_clamp, **_parallel_kwargs(args),
              **_sizing_kwargs(args), **({} if args.quiet else {"compile_progress": True}))
    engine = PrefillEngine(llm, engine_id=args.engine_id or "prefill", staging_requests=args.staging_requests,
                           progress_thread=False, ucx_devices=args.ucx_devices)
    stop = threading.Event()
    if on_main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.process_id:  # a later process of a multi-process prefill engine: process 0 serves
        try:
            print(f"prefill engine {engine.engine_id!r}: process {args.process_id} follows process 0", flush=True)
            follow_prefill_server(engine, stop.is_set)
        finally:
            engine.close()
        return 0
    try:
        server = PrefillServer(engine, args.kv_listen, advertise_host=args.kv_advertise)
        print(f"prefill engine {engine.engine_id!r} ready: decode engines pass --kv-peer {server.address}", flush=True)
        try:
            server.serve_forever(stop.is_set)
        finally:
            server.close()
    finally:
        engine.close()
    return 0


def cmd_serve(args) -> int:
    _needs("serve", "fastapi", "uvicorn", "prometheus_client")
    from jaxmamba.serve import serve

    path = _checkpoint(args.checkpoint, args.family)
    serve(path, host=args.host, port=args.port, served_model_name=args.served_model_name, dtype=args.dtype,
          kernel_backend=args.kernel_backend, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
          max_num_batched_tokens=args.max_num_batched_tokens, dt_clamp=args.dt_clamp,
          async_scheduling=args.async_scheduling, num_scheduler_steps=args.num_scheduler_steps,
          matmul_precision=args.matmul_precision, compile_progress=not args.quiet,
          data_parallel_size=args.data_parallel_size, **_parallel_kwargs(args))
    return 0


def cmd_compare(args) -> int:
    _needs("torch", "torch", "transformers")
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


def cmd_handoff(args) -> int:
    from transfer.vllm_pages.process import vllm_cpu_python

    if vllm_cpu_python() is None:
        raise UserError("vLLM's CPU venv is not built: run bash tests/setup_vllm_cpu.sh first")
    from jaxmamba.handoff_demo import run_handoff

    prompt = [int(t) for t in args.prompt.split()]
    if len(prompt) < 2:
        raise UserError("--prompt needs at least 2 token ids (vLLM prefills all but the last)")
    report = run_handoff(args.checkpoint, prompt, args.max_tokens)
    print(report.format())
    return 0 if report.jaxmamba_tokens == report.vllm_tokens else 1


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


def cmd_plan(args) -> int:
    import os

    from jaxmamba import aot
    from jaxmamba.compile_progress import CompileProgress
    from jaxmamba.errors import ConfigError
    from jaxmamba.plan import plan, write_json

    if args.target != "cpu" and aot.aot_available() and aot.ptxas_log_path() is None:
        # ptxas' register report needs a wrapper on XLA's CUDA path, which jax reads once at import:
        # run the plan again in a process that starts with it.
        # JAX_PLATFORMS=cpu: a compile-only target needs no GPU, and without one jax would drop its CUDA plugin.
        # JAXMAMBA_CPU_HEAP=0: that process runs no large CPU program, and glibc's own arenas let its compile
        # threads allocate side by side (an 8B-widths plan: 52-58 s against 71-76 s under one arena).
        env = {"JAX_PLATFORMS": "cpu", "JAXMAMBA_CPU_HEAP": "0", **os.environ, **aot.ptxas_environment()}
        return run_forwarding_sigint([sys.executable, "-m", "jaxmamba", *args.argv], env)
    progress = None if args.quiet else CompileProgress(desc_prefix=f"{args.target}: ")
    stop_watching = exit_at_sigint_from_any_thread(progress) if on_main_thread() else None
    try:
        result = plan(
            args.model, args.target, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
            block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
            mamba_cache_mode=args.mamba_cache_mode, num_speculative_tokens=args.num_speculative_tokens,
            dtype=args.dtype, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
            gpu_memory_utilization=args.gpu_memory_utilization, cpu_memory_gib=args.cpu_memory_gib,
            kernel_backend=args.kernel_backend, num_blocks=args.num_blocks, buckets=args.buckets,
            num_scheduler_steps=args.num_scheduler_steps, mean_context=args.mean_context, progress=progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        exit_interrupted(progress)
    finally:
        if stop_watching is not None:
            stop_watching()
        if progress is not None:
            progress.close()
    print(result.format())
    if args.json:
        write_json(result, args.json)
        print(f"\nwrote {args.json}")
    return 0


def cmd_bench(args, rest: list[str]) -> int:
    from jaxmamba.bench.__main__ import main as bench_main

    return bench_main(rest)


#: --dtype of generate and serve: auto, the three served dtypes, and vLLM's (and short) aliases.
SERVE_DTYPES = ("auto", "float32", "bfloat16", "float16", "float", "half", "bf16", "fp16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxmamba", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_serve_prefill(sub)
    _add_compare(sub)
    _add_convert(sub)
    _add_plan(sub)
    h = sub.add_parser("handoff", help="vLLM prefills, jaxmamba decodes; the state at the handoff per layer "
                                      "(needs tests/setup_vllm_cpu.sh)")
    h.add_argument("checkpoint", nargs="?", help="HF checkpoint (default: a random NemotronH with head_dim 32)")
    h.add_argument("--prompt", default="1 17 42 7 99 3 250 11 64 5 8 13 21 34 55 89 144",
                   help="token ids (default: 17 of them, 16 prefilled by vLLM: two blocks of 8)")
    h.add_argument("--max-tokens", type=int, default=16)
    sub.add_parser("bench", help="benchmarks: python -m jaxmamba bench {kernels,serve,transfer} ...", add_help=False)
    return parser


def _checkpoint_args(p, dtypes=("float32", "bfloat16", "float16")) -> None:
    """The checkpoint, its family (for the embedded default) and --dtype."""
    p.add_argument("checkpoint", nargs="?", help="HF or orbax checkpoint directory (default: embedded random model)")
    p.add_argument("--family", default=DEFAULT_FAMILY, help="family of the embedded default checkpoint")
    p.add_argument("--dtype", default=dtypes[0], choices=dtypes,
                   help="auto: the checkpoint's torch_dtype" if "auto" in dtypes else None)


def _engine_loop_args(p) -> None:
    """--dt-clamp and the step loop's scheduling flags (generate, serve)."""
    # A server compared against a vLLM server needs vLLM's numbers as much as offline generate does.
    p.add_argument("--dt-clamp", choices=["checkpoint", "vllm"], default="checkpoint",
                   help="checkpoint: dt clamped as the config says (transformers); "
                        "vllm: (0, inf) as vLLM's MambaMixer2")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule each step while the previous one runs (vLLM's async scheduling; default on)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps per device call for batches of plain decodes (vLLM's multi-step "
                        "scheduling; default 1)")
    p.add_argument("--matmul-precision", choices=["auto", "float32", "tf32"], default="auto",
                   help="float32 matmuls on a GPU: auto (a float32 model at full float32, as torch), float32, "
                        "or tf32 (faster, ~1e-3 relative)")


def _add_generate(sub) -> None:
    """The ``generate`` command's arguments."""
    about = "generate from text or token-id prompts (greedy unless --temperature)"
    g = sub.add_parser("generate", help=about, description=about[0].upper() + about[1:] + ". Without "
                       "--max-num-seqs, --max-num-batched-tokens and --buckets the engine is sized to the prompts "
                       "(a row each, their tokens in one step, at most the engine's defaults): it compiles only "
                       "the step programs such a job can use.")
    _checkpoint_args(g, SERVE_DTYPES)
    g.add_argument("--prompt", action="append",
                   help="text (needs the checkpoint's tokenizer.json), or token ids such as '1 17 42'; "
                        "repeat for a batch")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--max-model-len", type=int, default=512)
    g.add_argument("--kernel-backend", choices=["auto", "reference", "pallas"], default="auto",
                   help="auto: Pallas on a GPU, the plain-JAX reference on the CPU")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt (tokens, text, transfer)")
    _sizing_args(g)
    _engine_loop_args(g)
    _parallel_args(g)
    k = g.add_argument_group("P/D across hosts", "decode here what a serve-prefill engine on another host prefills")
    k.add_argument("--kv-peer", metavar="HOST:PORT", help="the prefill engine's address (its serve-prefill line)")
    k.add_argument("--kv-timeout", type=float, default=10.0, help="seconds a READ of its pages may take")
    k.add_argument("--kv-connect-timeout", type=float, default=10.0,
                   help="seconds to reach the prefill engine before failing with TransferError")
    k.add_argument("--kv-lease", type=float, default=60.0,
                   help="seconds a handoff may wait for its READ (then its prompt is computed here)")
    _kv_agent_args(k, "decode")


def _sizing_args(p) -> None:
    """Pool and bucket sizes, which a prefill and a decode engine must agree on (block size) or fit."""
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--buckets", nargs="+", type=_bucket_arg, metavar="R,T",
                   help="compile only these buckets (rows, tokens)")


def _kv_agent_args(p, role: str) -> None:
    p.add_argument("--engine-id", default=None, help=f"this engine's name in handoffs and logs (default {role})")
    p.add_argument("--ucx-devices", default=None, metavar="DEVICES",
                   help="network devices NIXL/UCX moves pages over, UCX_NET_DEVICES syntax such as mlx5_0:1 or "
                        "eth0 (default: UCX's choice)")


def _add_serve_prefill(sub) -> None:
    """The ``serve-prefill`` command's arguments."""
    about = "P/D across hosts: serve prompt prefills to decode engines (generate --kv-peer) on other hosts"
    p = sub.add_parser("serve-prefill", help=about, description=about + "; needs the nixl extra.")
    _checkpoint_args(p, SERVE_DTYPES)
    p.add_argument("--kv-listen", required=True, metavar="HOST:PORT",
                   help="where the control channel listens (port 0: any free one, printed)")
    p.add_argument("--kv-advertise", default=None, metavar="HOST",
                   help="the host decode engines dial (default: the --kv-listen host; required with 0.0.0.0)")
    p.add_argument("--staging-requests", type=int, default=None,
                   help="handoffs that may wait to be read at once (default: max-num-seqs)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kernel-backend", choices=["auto", "reference", "pallas"], default="auto")
    p.add_argument("--dt-clamp", choices=["checkpoint", "vllm"], default="checkpoint")
    p.add_argument("--quiet", action="store_true", help="no compile progress bar")
    _sizing_args(p)
    _kv_agent_args(p, "prefill")
    _parallel_args(p)


def _add_serve(sub) -> None:
    """The ``serve`` command's arguments."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra)")
    _checkpoint_args(s, SERVE_DTYPES)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port_arg, default=8000, help="TCP port, 0-65535 (0: any free one; default 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: the checkpoint directory's name)")
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--max-num-seqs", type=int, default=8)
    s.add_argument("--max-num-batched-tokens", type=int, default=256)
    s.add_argument("--kernel-backend", choices=["auto", "reference", "pallas"], default="auto")
    s.add_argument("--quiet", action="store_true", help="no compile progress bar")
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas behind the server, each on its own --tensor-parallel-size devices")
    _engine_loop_args(s)
    _parallel_args(s)


def _parallel_args(p) -> None:
    """Tensor parallelism, and the multi-process runtime (``jax.distributed``) it may span."""
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks of the tp mesh (over every process's devices with --num-processes)")
    p.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's address as every process reaches it (jax.distributed.initialize)")
    p.add_argument("--num-processes", type=int, default=None, help="processes of the multi-process engine")
    p.add_argument("--process-id", type=int, default=None,
                   help="this process's id, 0..N-1 (serve: 0 serves HTTP, the others follow its steps)")


def _parallel_kwargs(args) -> dict:
    return dict(tensor_parallel_size=args.tensor_parallel_size, coordinator_address=args.coordinator_address,
                num_processes=args.num_processes, process_id=args.process_id)


def _add_compare(sub) -> None:
    """The ``compare`` command's arguments."""
    c = sub.add_parser("compare", help="per-layer and logit differences against transformers (torch, CPU)")
    _checkpoint_args(c)
    c.add_argument("--batch", type=int, default=2)
    c.add_argument("--seq-len", type=int, default=37)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--also-dtype", action="append", choices=["float32", "bfloat16", "float16"],
                   help="compare in this dtype too (repeatable), e.g. --also-dtype bfloat16")
    c.add_argument("--report", metavar="PATH",
                   help="write plots and a report: a directory (report.md inside), or a .md/.html file path")


def _add_convert(sub) -> None:
    """The ``convert`` command's arguments."""
    v = sub.add_parser("convert", help="HF safetensors <-> orbax")
    v.add_argument("src")
    v.add_argument("dst")
    v.add_argument("--to", choices=["orbax", "hf"], default="orbax")
    v.add_argument("--dtype", default=None)


def _add_plan(sub) -> None:
    """The ``plan`` command's arguments."""
    pl = sub.add_parser("plan", help="compile every bucket for a GPU target (no GPU needed) and size the pools")
    pl.add_argument("model", help="checkpoint directory, or a config.json alone (weights stay abstract)")
    pl.add_argument("--target", default="h100", help="h100, h200, or cpu (this machine)")
    pl.add_argument("--max-num-seqs", type=int, default=256)
    pl.add_argument("--max-num-batched-tokens", type=int, default=8192)
    pl.add_argument("--max-model-len", type=int, default=None)
    pl.add_argument("--block-size", type=int, default=16)
    pl.add_argument("--enable-prefix-caching", action="store_true")
    pl.add_argument("--mamba-cache-mode", choices=["none", "align", "all"], default=None)
    pl.add_argument("--num-speculative-tokens", type=int, default=0)
    pl.add_argument("--dtype", default="auto", help="auto (the checkpoint's torch_dtype), bfloat16, float16, float32")
    pl.add_argument("--mamba-ssm-cache-dtype", default=None)
    pl.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    pl.add_argument("--cpu-memory-gib", type=float, default=4.0, help="cache space with --target cpu")
    pl.add_argument("--kernel-backend", choices=["auto", "pallas", "reference"], default="auto")
    pl.add_argument("--num-blocks", type=int, default=None)
    pl.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="also compile each pure-decode bucket's window of that many steps (LLM's num_scheduler_steps)")
    pl.add_argument("--buckets", nargs="+", type=_bucket_arg, metavar="R,T[,P]",
                    help="compile these mixed buckets (rows, tokens[, prefill rows]) instead of the default set")
    pl.add_argument("--mean-context", type=int, default=None,
                    help="tokens each decode row reads from its KV cache in the traffic report (default: "
                         "max_model_len / 2)")
    pl.add_argument("--json", metavar="F", help="also write the plan as JSON")
    pl.add_argument("--quiet", action="store_true", help="no progress bar")


def _port_arg(text: str) -> int:
    """A TCP port (argparse type: a port outside [0, 65535] is a usage error before anything loads)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {text!r} must be an integer in [0, 65535]")
    return port


def _bucket_arg(text: str) -> tuple[int, ...]:
    """``R,T`` or ``R,T,P`` (argparse type: a malformed entry is a usage error, exit 2)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in (2, 3):
        raise argparse.ArgumentTypeError(f"bucket {text!r} must be R,T or R,T,P (integers)")
    return values


def main(argv: list[str] | None = None) -> int:
    from jaxmamba.errors import JaxMambaError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return cmd_bench(None, argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv
    commands = {"generate": cmd_generate, "serve": cmd_serve, "serve-prefill": cmd_serve_prefill,
                "compare": cmd_compare, "convert": cmd_convert, "plan": cmd_plan, "handoff": cmd_handoff}
    try:
        return commands[args.command](args)
    except (UserError, JaxMambaError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
