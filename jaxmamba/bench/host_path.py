"""``python -m jaxmamba.bench host-path``: the engine's whole host path per output token, without the device.

``bench serve --profile-host`` measures the host path beside a running device; on a CPU device XLA's step
shares the host's cores, caches and memory bandwidth with it, and its run-to-run spread is +-10-15%. Here the
compiled steps are ``bench host-inputs``' stand-in (tokens from a seeded generator, timed as ``wait``), so only
the host runs: schedule, metadata, dispatch, read-back, record and detokenize of a workload, with the engine's
own ``HostProfile`` (the engine thread's CPU per phase, ``other`` included; no device time watched, whose
thread would disturb the engine thread: ``device_time=False``), best of ``--passes`` passes over
the same workload on one engine. A development A/B tool for host-path changes; what a device's interference
adds is ``bench serve``'s to show (BENCHMARKS.md, "Session 18").

``--workload mixed`` (the default): ``bench serve``'s, ``--num-requests`` requests of mixed prompt and output
lengths through ``max_num_seqs`` rows (admissions, prompt chunks and finishes in most steps). ``--workload
decode``: what ``bench decode --roofline``'s engine runs, ``max_num_seqs`` requests of ``--prompt-len`` tokens
admitted at once, then ``--max-tokens`` greedy tokens each: after the first step every step decodes all of them.

    PYTHONPATH=<tree> python -m jaxmamba.bench host-path [--profile-batches 128,256] [--workload decode]
        [--no-async-scheduling] [--async-dispatch inline] [--count-bytecodes TOP]

``--count-bytecodes`` adds the Python bytecodes the engine thread runs per step (a pass under ``sys.settrace``), which
do not spread with the machine's load (runs agree to a fraction of a percent): the A/B figure where the
timings' spread hides a change. ``--time-functions`` times named functions inside the engine (inclusive wall time
per call and per step, over the timed passes): a small numpy call costs several times inside a step what it
costs in a loop that repeats it (its code and data are out of the CPU's caches there), so a function's cost is
measured where it runs, not in a micro-benchmark.

``--device-traffic-mib N``: each stand-in step also copies an N MiB buffer on the engine thread, timed as ``wait``
(not host time), as a CPU device's step streams its caches and temporaries through the host's caches between the
host's phases. The host path then runs cold, as it does beside a CPU device (32 MiB reproduced ``bench serve``'s
2x there, BENCHMARKS.md "Session 29"): the figure that shows whether a change makes the host path cheaper to
run from cold caches, which on a CPU device is what it pays.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from jaxmamba.bench import checked_baseline
from jaxmamba.bench.decode import add_async_dispatch_argument


def count_bytecodes(llm, prompts, params, top: int) -> dict:
    """One more pass over the workload with the Python bytecodes of the engine's steps counted
    (``sys.settrace`` inside ``LLMEngine.step``, with its detokenization; requests being queued, ``generate``'s
    closing outputs and the dispatch thread are not traced): ``bytecodes_per_step`` and the ``top`` functions'
    ``[name, bytecodes per step]``. The work the host path interprets (a numpy or other C call counts as the
    bytecode that calls it), reproducible to a fraction of a percent where timings are not (a shared
    machine's timings of the same code spread by 2x): an A/B of a host-path change on a noisy machine."""
    ops: Counter = Counter()
    steps = 0

    def local(frame, event, arg):
        if event == "opcode":
            ops[frame.f_code] += 1
        return local

    def enter(frame, event, arg):
        frame.f_trace_opcodes = True
        return local

    def traced_step(step=llm.llm_engine.step):
        nonlocal steps
        steps += 1
        sys.settrace(enter)  # the frames the step calls, not this one
        try:
            return step()
        finally:
            sys.settrace(None)

    llm.llm_engine.step = traced_step
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.llm_engine.step
    steps = max(steps, 1)
    by_function: Counter = Counter()
    for code, n in ops.items():
        by_function[f"{Path(code.co_filename).name}:{code.co_qualname}"] += n
    return {"bytecodes_per_step": sum(ops.values()) / steps,
            "top_functions": [[name, n / steps] for name, n in by_function.most_common(top)]}


def _function_named(name: str) -> tuple[object, str, object]:
    """``(owner, attribute, raw)`` of ``module:Qualified.name``; ``ValueError`` naming what is not there."""
    import importlib

    module_name, _, qualname = name.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"{name!r} is not MODULE:NAME")
    try:
        owner = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{name!r}: no module {module_name!r} ({e})") from None
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    raw = vars(owner).get(attr) if hasattr(owner, "__dict__") else None
    if not callable(raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw):
        raise ValueError(f"{name!r}: {module_name} has no function {qualname!r}")
    return owner, attr, raw


@contextmanager
def timed_functions(names: list[str]):
    """Wrap each function named ``module:Qualified.name`` (looked up where its callers find it: a function
    imported by name into another module is named there) with a wall-time counter for the duration; yields
    ``{name: [calls, ns]}``, inclusive of what each call calls."""
    totals: dict[str, list[int]] = {}
    patched = []
    clock = time.perf_counter_ns
    for name in names:
        owner, attr, raw = _function_named(name)
        func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        total = totals[name] = [0, 0]

        def timed(*a, _func=func, _total=total, **k):
            start = clock()
            try:
                return _func(*a, **k)
            finally:
                _total[0] += 1
                _total[1] += clock() - start

        setattr(owner, attr, type(raw)(timed) if isinstance(raw, (classmethod, staticmethod)) else timed)
        patched.append((owner, attr, raw))
    try:
        yield totals
    finally:
        for owner, attr, raw in reversed(patched):
            setattr(owner, attr, raw)


def run(max_num_seqs: int, args) -> dict:
    """The best of ``args.passes`` passes' ``HostProfile.summary()`` (by host CPU per output token), with every
    pass's figure under ``passes_us_per_output_token``; with ``--count-bytecodes``, ``count_bytecodes``' figures too."""
    import numpy as np

    from jaxmamba import SamplingParams
    from jaxmamba.bench import serve
    from jaxmamba.bench.decode import checkpoint_for
    from jaxmamba.bench.host_inputs import stubbed_host_profiles, stubbed_llm
    from jaxmamba.config import HybridConfig

    path = str(checkpoint_for("tiny"))
    # The decode workload admits every request in its first step.
    first_step = max_num_seqs * args.prompt_len if args.workload == "decode" else 0
    llm = stubbed_llm(device_traffic_mib=args.device_traffic_mib, async_scheduling=args.async_scheduling,
                      async_dispatch=args.async_dispatch, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max(max_num_seqs, args.max_num_batched_tokens, first_step),
                      max_model_len=args.max_model_len)
    vocab_size = HybridConfig.from_hf(Path(path)).vocab_size
    if args.workload == "decode":
        rng = np.random.default_rng(args.seed)
        prompts = rng.integers(1, vocab_size, (max_num_seqs, args.prompt_len)).tolist()
        max_tokens = [args.max_tokens] * max_num_seqs
    else:
        workload = serve._parser().parse_args(["--num-requests", str(args.num_requests), "--seed", str(args.seed)])
        prompts, max_tokens = serve._workload_of(workload, vocab_size)
    with timed_functions(args.time_functions) as totals:
        passes = stubbed_host_profiles(llm, prompts, max_tokens, args.passes)
    best = min(passes, key=lambda h: h["host_cpu_us_per_output_token"])
    best |= {"passes_us_per_output_token": [h["host_cpu_us_per_output_token"] for h in passes]}
    if totals:
        steps = sum(h["steps"] for h in passes)
        best["timed_functions"] = {name: {"calls_per_step": calls / steps, "us_per_step": ns / 1e3 / steps,
                                          "us_per_call": ns / 1e3 / max(calls, 1)}
                                   for name, (calls, ns) in totals.items()}
    if not args.count_bytecodes:
        return best
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return best | count_bytecodes(llm, prompts, params, args.count_bytecodes)


def _child_argv(args) -> list[str]:
    """This bench's workload and measurement options, as a child run (``compare_with_baseline``) takes them."""
    argv = ["--profile-batches", ",".join(map(str, args.profile_batches)), "--workload", args.workload,
            "--num-requests", str(args.num_requests), "--prompt-len", str(args.prompt_len),
            "--max-tokens", str(args.max_tokens), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len), "--seed", str(args.seed), "--passes", str(args.passes),
            "--async-scheduling" if args.async_scheduling else "--no-async-scheduling",
            "--async-dispatch", args.async_dispatch]
    return argv + (["--device-traffic-mib", str(args.device_traffic_mib)] if args.device_traffic_mib else [])


def compare_with_baseline(args) -> int:
    """``--baseline-repo``: this bench in the baseline checkout and in this one, alternately (baseline first in even
    rounds, this first in odd ones, so that a machine drifting over minutes weighs on both alike), each run a fresh
    process; prints every round's best-pass host CPU us per output token and, per batch size, the medians and their
    ratio. A run that fails ends the comparison with its tree named and its output's tail."""
    import statistics
    import subprocess
    import tempfile

    import jaxmamba

    trees = {"baseline": (args.baseline_python, args.baseline_repo.resolve()),
             "this": (sys.executable, Path(jaxmamba.__file__).resolve().parents[1])}
    figures: dict[str, dict[int, list[float]]] = {name: {r: [] for r in args.profile_batches} for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for name in (("baseline", "this") if k % 2 == 0 else ("this", "baseline")):
                python, root = trees[name]
                out = Path(tmp) / f"{name}-{k}.json"
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
                proc = subprocess.run([python, "-m", "jaxmamba.bench", "host-path", *_child_argv(args), "--json",
                                       str(out)], cwd=root, env=env, capture_output=True, text=True, check=False)
                if proc.returncode:
                    print(f"the {name} run ({root}) failed with exit code {proc.returncode}:\n"
                          + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]), file=sys.stderr)
                    return 1
                ran = proc.stdout.partition("jaxmamba from ")[2].partition(";")[0]
                if not ran or Path(ran).resolve() != root / "jaxmamba":
                    # An interpreter that imports an installed jaxmamba ahead of the checkout's would compare a
                    # tree with itself.
                    print(f"the {name} run imported jaxmamba from {ran or 'an unknown place'}, not from {root}",
                          file=sys.stderr)
                    return 1
                for rows, h in json.loads(out.read_text())["host_path"].items():
                    figures[name][int(rows)].append(h["host_cpu_us_per_output_token"])
                print(f"round {k + 1}, {name:>8}: " + "; ".join(
                    f"{r} rows {figures[name][r][-1]:.2f}" for r in args.profile_batches) + " us a token", flush=True)
    medians = {name: {r: statistics.median(v) for r, v in per.items()} for name, per in figures.items()}
    for r in args.profile_batches:
        print(f"max_num_seqs {r}: median of {args.rounds} rounds, baseline {medians['baseline'][r]:.2f}, this "
              f"{medians['this'][r]:.2f} us a token (this / baseline {medians['this'][r] / medians['baseline'][r]:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": figures,
                                         "median": medians}, indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxmamba.bench host-path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile-batches", type=lambda s: [int(v) for v in s.split(",")], default=[128, 256],
                    metavar="R1,R2,...", help="max_num_seqs values (default 128,256)")
    ap.add_argument("--workload", choices=("mixed", "decode"), default="mixed",
                    help="mixed: bench serve's (the default); decode: every row decoding after the first step")
    ap.add_argument("--num-requests", type=int, default=768, help="--workload mixed: its requests")
    ap.add_argument("--prompt-len", type=int, default=32, help="--workload decode: each prompt's tokens")
    ap.add_argument("--max-tokens", type=int, default=64, help="--workload decode: each request's output tokens")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--passes", type=int, default=5, help="passes over the workload; the best is printed")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    add_async_dispatch_argument(ap)
    ap.add_argument("--count-bytecodes", type=int, default=0, metavar="TOP",
                    help="one more pass counting the Python bytecodes the engine thread runs per step "
                         "(reproducible), and the TOP functions that run most of them")
    ap.add_argument("--time-functions", type=lambda s: [v for v in s.split(",") if v], default=[],
                    metavar="MODULE:NAME,...", help="inclusive wall time of these functions inside the engine, "
                    "e.g. jaxmamba.engine.runner:ModelRunner._inputs,jaxmamba.engine.runner:token_inputs")
    ap.add_argument("--device-traffic-mib", type=int, default=0, metavar="N",
                    help="each stand-in step copies an N MiB buffer on the engine thread (timed as wait): the host "
                         "path run with caches cold, as beside a CPU device's step (default 0)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--baseline-repo", type=Path, metavar="DIR",
                    help="A/B: run this bench in DIR's checkout (a `git archive` of the base) and here, alternately, "
                         "--rounds times, each a fresh process; prints each round and the medians")
    ap.add_argument("--baseline-python", default=sys.executable, help="--baseline-repo: its interpreter")
    ap.add_argument("--rounds", type=int, default=3, help="--baseline-repo: rounds of the two runs (default 3)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from jaxmamba.host_profile import HOST_PHASES

    ap = _parser()
    args = ap.parse_args(argv)
    if args.device_traffic_mib < 0:
        ap.error(f"--device-traffic-mib={args.device_traffic_mib} must be >= 0")
    if args.passes < 1:
        ap.error(f"--passes={args.passes} must be >= 1")
    for name in args.time_functions:
        try:
            _function_named(name)
        except ValueError as e:
            ap.error(f"--time-functions: {e}")
    if args.count_bytecodes < 0:
        ap.error(f"--count-bytecodes={args.count_bytecodes} must be >= 0")
    if args.prompt_len < 1 or args.max_tokens < 1:
        ap.error(f"--prompt-len={args.prompt_len} and --max-tokens={args.max_tokens} must be >= 1")
    if args.workload == "decode" and args.prompt_len + args.max_tokens > args.max_model_len:
        ap.error(f"--prompt-len + --max-tokens = {args.prompt_len + args.max_tokens} exceeds "
                 f"--max-model-len={args.max_model_len}")
    if args.baseline_repo is not None:
        args.baseline_python = checked_baseline(ap, args.baseline_repo, args.baseline_python)
        if args.rounds < 1:
            ap.error(f"--rounds={args.rounds} must be >= 1")
        if args.count_bytecodes or args.time_functions:
            ap.error("--baseline-repo compares the two trees' timings; --count-bytecodes and --time-functions "
                     "look inside one tree (run them in each)")
        return compare_with_baseline(args)
    import jaxmamba

    print(f"jaxmamba from {os.path.dirname(jaxmamba.__file__)}; the compiled steps stubbed out; "
          f"{'async' if args.async_scheduling else 'synchronous'} scheduling (dispatch {args.async_dispatch}); "
          + (f"decode workload ({args.prompt_len}-token prompts, {args.max_tokens} tokens each, every row "
             "decoding after the first step); " if args.workload == "decode" else f"{args.num_requests} requests; ")
          + (f"{args.device_traffic_mib} MiB copied a step as the device's traffic; " if args.device_traffic_mib
             else "") + f"best of {args.passes} passes; load average {os.getloadavg()[0]:.2f}")
    results = {rows: run(rows, args) for rows in args.profile_batches}
    print("the engine thread's CPU ms per step by phase")
    print(f"{'max_num_seqs':>12} {'rows/step':>9} " + " ".join(f"{p:>10}" for p in HOST_PHASES)
          + f" {'host cpu us/tok':>15} {'passes':>s}")
    for rows, h in results.items():
        spread = " ".join(f"{v:.1f}" for v in h["passes_us_per_output_token"])
        print(f"{rows:>12} {h['mean_batch_rows']:>9.1f} " + " ".join(f"{h[p + '_cpu_ms_per_step']:>10.3f}"
                                                                   for p in HOST_PHASES)
              + f" {h['host_cpu_us_per_output_token']:>15.1f} {spread}")
    for rows, h in results.items():
        for name, t in h.get("timed_functions", {}).items():
            print(f"max_num_seqs {rows}: {t['us_per_step']:>8.1f} us a step {t['calls_per_step']:>6.2f} calls a step "
                  f"{t['us_per_call']:>8.1f} us a call  {name}")
    for rows, h in results.items():
        if "bytecodes_per_step" in h:
            print(f"max_num_seqs {rows}: {h['bytecodes_per_step']:.0f} Python bytecodes a step on the engine "
                  "thread; per step by function:")
            for name, n in h["top_functions"]:
                print(f"{n:>10.1f}  {name}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "host_path": {str(k): v for k, v in results.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
