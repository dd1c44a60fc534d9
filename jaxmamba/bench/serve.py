"""``python -m jaxmamba.bench serve``: a fixed mixed workload through the engine, and through transformers.

The workload (seeded): ``--num-requests`` requests with prompt lengths uniform in
``[--min-prompt, --max-prompt]`` and output lengths uniform in
``[--min-output, --max-output]``, greedy, all submitted at once (continuous
batching with chunked prefill does the rest). Reported: wall time (warm-up
excluded and reported apart), output and total tokens/s, time per output token,
step compilations vs buckets, and peak memory. Unless ``--no-reference``, the
same greedy generations run through transformers (torch, CPU, one request at a
time with its KV/SSM cache, as ``generate`` does) in the same process, and the
throughput ratio is printed.

``--workload prefix``: requests share one of ``--num-prefixes`` system prompts of
``--prefix-len`` tokens plus a unique tail, arriving in waves of
``--max-num-seqs``; the engine runs with prefix caching (``--mamba-cache-mode``)
and without it in the same process, and the hit rate and speed-up are printed.
``--workload spec``: prompts built from short repeated motifs (what the ngram
proposer can predict); the engine runs with ``--num-spec`` drafts per step
(``--spec-method ngram``, or ``draft_model`` with ``--draft-checkpoint``, by
default the target itself: an upper bound on acceptance) and without, and the acceptance rate and speed-up are printed. Both check that the
two runs produce identical tokens. ``--data-parallel-size N``: the workload through the asyncio front, one
engine and N replicas (``jaxmamba.bench.serve_dp``).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np


def workload(num_requests: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, size=int(rng.integers(prompt_range[0], prompt_range[1] + 1))).tolist()
               for _ in range(num_requests)]
    outputs = [int(rng.integers(output_range[0], output_range[1] + 1)) for _ in range(num_requests)]
    return prompts, outputs


def prefix_workload(num_requests: int, vocab: int, num_prefixes: int, prefix_len: int, tail_range: tuple[int, int],
                    output_range: tuple[int, int], seed: int):
    """Requests that share one of ``num_prefixes`` system prompts, each with its own tail."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, vocab, size=prefix_len).tolist() for _ in range(num_prefixes)]
    prompts = [systems[i % num_prefixes] + rng.integers(3, vocab, size=int(rng.integers(*tail_range) + 1)).tolist()
               for i in range(num_requests)]
    outputs = [int(rng.integers(output_range[0], output_range[1] + 1)) for _ in range(num_requests)]
    return prompts, outputs


def spec_workload(num_requests: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int):
    """Prompts made of a short motif repeated (the continuation often repeats it too)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(num_requests):
        motif = rng.integers(3, vocab, size=int(rng.integers(2, 7))).tolist()
        n = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        prompts.append((motif * (n // len(motif) + 1))[:n])
    outputs = [int(rng.integers(output_range[0], output_range[1] + 1)) for _ in range(num_requests)]
    return prompts, outputs


def _peak_memory() -> dict:
    out = {"host_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    try:
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            out["device_peak_mb"] = stats["peak_bytes_in_use"] / 2**20
    except Exception:  # CPU backends may not report
        pass
    return out


def run_engine(path, prompts, max_tokens, args, wave: int | None = None, profile_host: bool = False,
               profile_passes: int = 1, **engine_args) -> dict:
    """Serve the workload; ``wave``: submit that many requests at a time (each wave after the last finished).
    ``profile_host``: time the engine's host phases per step (``jaxmamba.host_profile``), over
    ``profile_passes`` serving passes of the same engine: ``host_profile`` is the median pass's (by host time
    per output token; a pass on a shared machine spreads by +-30%), ``host_profile_passes`` every pass's host
    and host-CPU us per output token; the other figures are the first pass's."""
    from jaxmamba import LLM, SamplingParams
    from jaxmamba.host_profile import HostProfile

    engine_args = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, kernel_backend=args.kernel_backend, dtype=args.dtype,
                       sampling_variants=args.sampling_variants, async_scheduling=args.async_scheduling,
                       restore="eager", **engine_args)  # (every program in before the timed serving starts)
    if not (engine_args.get("enable_prefix_caching") or engine_args.get("speculative_config")):
        engine_args["num_scheduler_steps"] = args.num_scheduler_steps  # windows need both off (LLM's docs)
    t0 = time.perf_counter()
    llm = LLM(path, **engine_args)
    warmup = time.perf_counter() - t0
    if profile_host:
        llm.host_profile = HostProfile()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    wave = wave or len(prompts)
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), wave):
        outs += llm.generate(prompts[i : i + wave], params[i : i + wave], use_tqdm=False)
    wall = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    s = llm.stats
    result = {
        "warmup_s": warmup, "wall_s": wall, "generated_tokens": generated,
        "prompt_tokens": sum(map(len, prompts)), "output_tok_per_s": generated / wall,
        "total_tok_per_s": (generated + s.num_prompt_tokens) / wall, "steps": s.num_steps,
        "time_per_output_token_ms": 1e3 * wall / generated, "num_buckets": s.num_buckets,
        "num_compilations": s.num_compilations, "compiles_while_serving": s.backend_compiles_since_warmup,
        "preemptions": s.num_preemptions, "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        "prefix_hit_tokens": s.num_prefix_hit_tokens, "draft_tokens": s.num_draft_tokens,
        "acceptance_rate": s.acceptance_rate, "tokens": [o.outputs[0].token_ids for o in outs], **_peak_memory(),
    }
    if profile_host:
        passes = [llm.host_profile.summary()]
        for _ in range(profile_passes - 1):
            llm.host_profile = HostProfile()
            llm.generate(prompts, params, use_tqdm=False)
            passes.append(llm.host_profile.summary())
        by_host = sorted(passes, key=lambda h: h["host_us_per_output_token"])
        result["host_profile"] = by_host[(len(by_host) - 1) // 2]
        result["host_profile_passes"] = [{k: h[k] for k in ("host_us_per_output_token", "host_cpu_us_per_output_token")}
                                         for h in passes]
    return result


_ALONE_PASSES = 3  # passes of --profile-host's host path alone (the best is reported)


def _profile_host(path, prompts, max_tokens, args, device: str) -> int:
    """The mixed workload at each batch size of ``--profile-batches``: host ms per step by phase; beside it the
    same workload's host path alone (``host_path_alone``: ``bench host-path``'s stand-in steps enqueued inline,
    as on a GPU, best of ``_ALONE_PASSES``), what the host costs where no device shares its cores and caches."""
    import gc
    import os

    from jaxmamba.bench.host_inputs import stubbed_host_profiles, stubbed_llm
    from jaxmamba.host_profile import HOST_PHASES, PHASES

    results = {}
    for rows in args.profile_batches:
        run_args = argparse.Namespace(**{**vars(args), "max_num_seqs": rows,
                                         "max_num_batched_tokens": max(rows, args.max_num_batched_tokens)})
        load = os.getloadavg()[0]
        results[rows] = out = run_engine(path, prompts, max_tokens, run_args, profile_host=True,
                                         profile_passes=args.host_passes)
        out["load_average_1m"] = load
        out.pop("tokens")
        gc.collect()  # the served engine's caches go before the stand-in sizes its own pools (on a GPU, from free memory)
        alone = stubbed_llm(path, max_num_seqs=rows, max_num_batched_tokens=run_args.max_num_batched_tokens,
                            max_model_len=args.max_model_len, async_scheduling=args.async_scheduling,
                            async_dispatch="inline")
        out["host_path_alone"] = min(stubbed_host_profiles(alone, prompts, max_tokens, _ALONE_PASSES),
                                     key=lambda h: h["host_cpu_us_per_output_token"])
    print("\nhost ms per step by phase (load average at start of each run: "
          + ", ".join(f"{r['load_average_1m']:.2f}" for r in results.values()) + ")")
    print(f"{'max_num_seqs':>12} {'rows/step':>9} " + " ".join(f"{p:>10}" for p in PHASES)
          + f" {'host':>8} {'device':>8} {'hidden':>7} {'host us/tok':>11} {'wall us/tok':>11}")
    for rows, out in results.items():
        h = out["host_profile"]
        print(f"{rows:>12} {h['mean_batch_rows']:>9.1f} " + " ".join(f"{h[p + '_ms_per_step']:>10.3f}" for p in PHASES)
              + f" {h['host_ms_per_step']:>8.3f} {h['device_ms_per_step']:>8.3f} {100 * h['hidden_share']:>6.1f}%"
              f" {h['host_us_per_output_token']:>11.1f} {1e3 * out['time_per_output_token_ms']:>11.1f}")
    if args.host_passes > 1:
        print(f"(the median of {args.host_passes} serving passes; host us/tok of each pass: "
              + "; ".join(f"{rows}: " + " ".join(f"{p['host_us_per_output_token']:.1f}" for p in out["host_profile_passes"])
                          for rows, out in results.items()) + ")")
    print("\nthe engine thread's CPU ms per step by phase (what load inflates least); beside it, the dispatch "
          "thread's (async scheduling; on a CPU device it includes some of XLA's own work), and the host path "
          "alone (stand-in steps enqueued inline, no device sharing the host: what a GPU's host pays)")
    print(f"{'max_num_seqs':>12} " + " ".join(f"{p:>10}" for p in HOST_PHASES) + f" {'host cpu us/tok':>15}"
          f" {'dispatch thr':>12} {'alone us/tok':>12}")
    for rows, out in results.items():
        h = out["host_profile"]
        print(f"{rows:>12} " + " ".join(f"{h[p + '_cpu_ms_per_step']:>10.3f}" for p in HOST_PHASES)
              + f" {h['host_cpu_us_per_output_token']:>15.1f} {h['dispatch_thread_cpu_ms_per_step']:>12.3f}"
              f" {out['host_path_alone']['host_cpu_us_per_output_token']:>12.1f}")
    for rows, out in results.items():
        a = out["host_path_alone"]
        print(f"{rows:>12} alone " + " ".join(f"{a[p + '_cpu_ms_per_step']:>10.3f}" for p in HOST_PHASES))
    if args.json:
        args.json.write_text(json.dumps({"device": device, "args": vars(args) | {"json": str(args.json)},
                                         "profile_host": {str(k): v for k, v in results.items()}}, indent=2,
                                        default=str))
    return 0


def run_transformers(path, prompts, max_tokens, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    tokens = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            # eos_token_id=None: generate through EOS like ignore_eos (min_new_tokens would ban EOS instead).
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, eos_token_id=None, do_sample=False,
                                 pad_token_id=0)
            tokens.append(out[0, len(prompt):].tolist())
    wall = time.perf_counter() - t0
    generated = sum(map(len, tokens))
    return {"wall_s": wall, "generated_tokens": generated, "output_tok_per_s": generated / wall, "tokens": tokens}


def _print_engine(name: str, r: dict) -> None:
    print(f"{name:<14}: {r['output_tok_per_s']:9.1f} output tok/s   {r['total_tok_per_s']:9.1f} total tok/s   "
          f"TPOT {r['time_per_output_token_ms']:.2f} ms   wall {r['wall_s']:.2f} s "
          f"(+ warm-up {r['warmup_s']:.1f} s)   steps {r['steps']}")
    print(f"                compilations {r['num_compilations']} (buckets {r['num_buckets']}), "
          f"compiles while serving {r['compiles_while_serving']}, preemptions {r['preemptions']}, "
          f"host peak RSS {r['host_peak_rss_mb']:.0f} MB"
          + (f", device peak {r['device_peak_mb']:.0f} MB" if "device_peak_mb" in r else ""))


def _compare_feature(path, prompts, max_tokens, args, device: str) -> int:
    """The workload with and without its feature (prefix caching / ngram drafts), same process, same tokens."""
    if args.workload == "prefix":
        on = dict(enable_prefix_caching=True, mamba_cache_mode=args.mamba_cache_mode)
        name = f"prefix caching ({args.mamba_cache_mode})"
    else:
        spec = {"method": args.spec_method, "num_speculative_tokens": args.num_spec}
        if args.spec_method == "draft_model":
            spec["model"] = str(args.draft_checkpoint or path)
        on = dict(speculative_config=spec)
        name = f"{args.spec_method} spec k={args.num_spec}"
    wave = args.max_num_seqs if args.workload == "prefix" else None  # later waves find the prefixes cached
    base = run_engine(path, prompts, max_tokens, args, wave=wave)
    _print_engine("without", base)
    feat = run_engine(path, prompts, max_tokens, args, wave=wave, **on)
    _print_engine("with", feat)
    same = np.mean([a == b for a, b in zip(base["tokens"], feat["tokens"], strict=True)])
    speedup = base["wall_s"] / feat["wall_s"]
    if args.workload == "prefix":
        print(f"{name}: hit rate {100 * feat['prefix_cache_hit_rate']:.1f}% "
              f"({feat['prefix_hit_tokens']} of {sum(map(len, prompts))} prompt tokens from the cache)")
    else:
        print(f"{name}: acceptance rate {100 * feat['acceptance_rate']:.1f}% of {feat['draft_tokens']} drafts")
    print(f"speed-up (wall without / with): {speedup:.2f}x   identical greedy outputs: {100 * same:.1f}% of requests")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "args": vars(args) | {"json": str(args.json)},
                                         "without": base, "with": feat, "speedup": speedup,
                                         "identical_fraction": same}, indent=2, default=str))
    return 0


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.host_passes < 1:
        parser.error(f"--host-passes must be at least 1, got {args.host_passes}")

    from jaxmamba.random_checkpoint import default_checkpoint
    from jaxmamba.config import HybridConfig

    path = Path(args.checkpoint) if args.checkpoint else default_checkpoint(args.family, args.size)
    cfg = HybridConfig.from_hf(path)
    prompts, max_tokens = _workload_of(args, cfg.vocab_size)
    import jax

    from jaxmamba.plan import resolve_dtype, resolve_kernel_backend

    args.dtype = resolve_dtype(args.dtype, cfg).name  # transformers needs the name it resolves to
    args.kernel_backend = resolve_kernel_backend(args.kernel_backend)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(f"checkpoint: {path} ({cfg.family}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size})")
    print(f"workload {args.workload}: {args.num_requests} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(max_tokens)} output tokens, greedy, kernel backend {args.kernel_backend}")
    if args.profile_host:
        return _profile_host(path, prompts, max_tokens, args, jax.devices()[0].device_kind)
    if args.data_parallel_size > 1:
        from jaxmamba.bench.serve_dp import compare_data_parallel

        return compare_data_parallel(path, prompts, max_tokens, args, jax.devices()[0].device_kind)
    if args.workload != "mixed":
        return _compare_feature(path, prompts, max_tokens, args, jax.devices()[0].device_kind)
    ours = run_engine(path, prompts, max_tokens, args)
    _print_engine("jaxmamba", ours)
    result = {"device": jax.devices()[0].device_kind, "args": vars(args) | {"json": str(args.json)}, "jaxmamba": ours}
    if not args.no_reference:
        ref = run_transformers(path, prompts, max_tokens, args.dtype)
        agree = np.mean([a == b for a, b in zip(ours["tokens"], ref["tokens"], strict=True)])
        ratio = ours["output_tok_per_s"] / ref["output_tok_per_s"]
        print(f"transformers  : {ref['output_tok_per_s']:9.1f} output tok/s   wall {ref['wall_s']:.2f} s")
        print(f"ratio (jaxmamba / transformers, output tok/s): {ratio:.2f}x   identical greedy outputs: "
              f"{100 * agree:.1f}% of requests")
        if agree < 1 and cfg.family == "nemotron_h":
            print("  note: transformers' cached NemotronH decode skips the time_step_min clamp of dt that its own\n"
                  "  prefill applies, so its cached generate drifts from its forward; jaxmamba clamps on both paths.\n"
                  "  Requests may also part after near-ties (top-2 gap < 1e-4).")
        result["transformers"] = ref
        result["ratio"] = ratio
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxmamba.bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", help="checkpoint directory (default: embedded random model)")
    p.add_argument("--workload", default="mixed", choices=["mixed", "prefix", "spec"])
    p.add_argument("--family", default="nemotron_h")
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-prompt", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=96)
    p.add_argument("--min-output", type=int, default=8)
    p.add_argument("--max-output", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=160)
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "reference", "pallas"],
                   help="auto: Pallas on a GPU, the plain-JAX reference on the CPU")
    p.add_argument("--dtype", default="auto", help="auto: the checkpoint's torch_dtype")
    p.add_argument("--sampling-variants", default="auto", choices=["auto", "decode", "all", "full"],
                   help="buckets that also compile the greedy-only sampling tail (LLM's sampling_variants)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="LLM's async_scheduling (default on; --no-async-scheduling for the synchronous engine)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="LLM's num_scheduler_steps: decode steps per device call (engines without prefix caching "
                        "or speculative decoding; the prefix and spec workloads' engines run one step a call)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix workload: shared system prompts")
    p.add_argument("--prefix-len", type=int, default=96, help="prefix workload: tokens per system prompt")
    p.add_argument("--mamba-cache-mode", default="align", choices=["align", "all"])
    p.add_argument("--num-spec", type=int, default=3, help="spec workload: draft tokens per step")
    p.add_argument("--spec-method", default="ngram", choices=["ngram", "draft_model"])
    p.add_argument("--draft-checkpoint", help="spec workload, draft_model: the draft (default: the target itself)")
    p.add_argument("--no-reference", action="store_true", help="skip the transformers run (mixed workload)")
    p.add_argument("--profile-host", action="store_true",
                   help="mixed workload at each --profile-batches max_num_seqs: host ms per step by phase")
    p.add_argument("--host-passes", type=int, default=1, metavar="N",
                   help="--profile-host: serving passes per batch size, the median pass reported with every "
                        "pass's figure (5 for an A/B: one pass on a shared machine spreads by +-30%%)")
    p.add_argument("--profile-batches", type=lambda s: [int(v) for v in s.split(",")], default=[32, 128, 256],
                   metavar="R1,R2,...", help="max_num_seqs values of --profile-host (default 32,128,256)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="> 1: the workload through one engine and through this many replicas, same run "
                        "(jaxmamba.bench.serve_dp; on the CPU needs XLA_FLAGS=--xla_force_host_platform_device_count)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p


def _workload_of(args, vocab_size: int) -> tuple[list, list]:
    """``(prompts, max_tokens)`` of ``--workload``."""
    prompt_lens, output_lens = (args.min_prompt, args.max_prompt), (args.min_output, args.max_output)
    if args.workload == "prefix":
        return prefix_workload(args.num_requests, vocab_size, args.num_prefixes, args.prefix_len, prompt_lens,
                               output_lens, args.seed)
    if args.workload == "spec":
        return spec_workload(args.num_requests, vocab_size, prompt_lens, output_lens, args.seed)
    return workload(args.num_requests, vocab_size, prompt_lens, output_lens, args.seed)
