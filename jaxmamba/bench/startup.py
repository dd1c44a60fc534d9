"""``python -m jaxmamba.bench startup``: how long an engine takes to start, cold and warm (vLLM's
``vllm bench startup``).

Each start is a fresh process (what a user's restart is) that constructs ``LLM`` with the engine arguments
given and generates one token. The cold start finds an empty cache directory (``--cache-dir``, default a
new temporary one), the warm start the same directory as the cold start left it. Reported per start:
the wall of the construction split into weight loading, cache set-up (the KV/state pools and the cache
directories), tracing/lowering, backend compile (summed over the compile threads, which overlap) and
cache restore (``LLM.startup_times``), how many programs were compiled and restored, the XLA backend
compilations and the lowerings in the whole construction (``XLA/low``), the first token's generate call
(``1st tok``; the token must equal the cold start's: the warm start's programs were restored, not compiled),
construction plus that call (``to 1st``: what a user waits for a first token), and the wall from the constructor's
call until every program is in (``all in``: a background restore, ``restore="background"``, goes on after the
constructor returns; restore and comp/rest count its programs too). ``--baseline-repo`` also runs the same cold and warm
starts from another checkout (e.g. main's, read-only; ``--baseline-python`` its interpreter) in the same
invocation, for a before/after under the same load; a checkout without ``startup_times`` reports its totals.
The load average is printed beside every start: compare runs only at similar loads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from jaxmamba.bench import checked_baseline

REPO = Path(__file__).resolve().parents[2]

#: Run in the started process: argv = checkpoint, engine arguments (JSON). Prints one JSON line.
_CHILD = textwrap.dedent("""
    import dataclasses, json, sys, time
    t0 = time.perf_counter()
    import jax
    from jaxmamba import LLM, SamplingParams
    imported = time.perf_counter() - t0
    t1 = time.perf_counter()
    llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
    construct = time.perf_counter() - t1
    t2 = time.perf_counter()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    first = time.perf_counter() - t2
    steps = llm.runner.steps
    steps.wait_ready()  # programs restoring in the background (restore="background") or built lazily
    all_in = time.perf_counter() - t1
    s = llm.stats
    times = getattr(llm, "startup_times", None)
    build = getattr(steps, "build_stats", None)
    print(json.dumps(dict(import_s=imported, construct_s=construct, first_token_s=first, all_in_s=all_in,
                          first_token=out[0].outputs[0].token_ids,
                          programs=steps.num_compilations, buckets=s.num_buckets,
                          phases=dataclasses.asdict(times) if times is not None else None,
                          build=dataclasses.asdict(build) if build is not None else None)))
""")

PHASES = (("weights", "weight_loading_s"), ("cache set-up", "cache_setup_s"), ("lowering", "lowering_s"),
          ("backend compile", "backend_compile_s"), ("restore", "cache_restore_s"))


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def start_once(checkpoint: Path, engine_args: dict, cache_dir: Path, *, python: str = sys.executable,
               repo: Path = REPO, timeout: float = 3600) -> dict:
    """One start in a fresh process from checkout ``repo``; its JSON report plus the wall and load average."""
    # The checkout first; what PYTHONPATH held stays behind it (a GPU image's carried wheels).
    path = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "JAXMAMBA_COMPILE_CACHE": str(cache_dir)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    load_before = load_average()
    proc = subprocess.run([python, "-c", _CHILD, str(checkpoint), json.dumps(engine_args)], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the start failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["load_before"], report["load_after"] = load_before, load_average()
    return report


def cold_and_warm(checkpoint: Path, engine_args: dict, cache_dir: Path, **kw) -> dict:
    cache_dir.mkdir(parents=True, exist_ok=True)
    if any(cache_dir.iterdir()):
        raise SystemExit(f"--cache-dir {cache_dir} is not empty: a cold start needs an empty one")
    return {"cold": start_once(checkpoint, engine_args, cache_dir, **kw),
            "warm": start_once(checkpoint, engine_args, cache_dir, **kw)}


def format_row(name: str, r: dict) -> str:
    p = r.get("phases")
    if p and r.get("build"):  # the whole build, a background restore's programs included
        p = {**p, "cache_restore_s": r["build"]["restore_s"], "num_restored": r["build"]["num_restored"],
             "num_compiled": r["build"]["num_compiled"]}
    phases = "".join(f"{p[key]:>9.1f}" if p else f"{'-':>9}" for _, key in PHASES)
    programs = f"{p['num_compiled']}/{p['num_restored']}" if p else f"{r['programs']}/?"
    compiles = f"{p['total_backend_compiles']}/{p['total_lowerings']}" if p and "total_lowerings" in p else (
        str(p["backend_compiles"]) if p else "-")
    threads = str(p["build_threads"]) if p and "build_threads" in p else "-"
    imported = r.get("import_s", float("nan"))
    ready = r["construct_s"] + r["first_token_s"]
    return (f"{name:<16}{imported:>7.1f}{r['construct_s']:>8.1f}{phases}{threads:>8}{programs:>10}{compiles:>9}"
            f"{r['first_token_s']:>8.2f}{ready:>9.2f}{r.get('all_in_s', float('nan')):>8.1f}"
            f"  {r['load_before']} -> {r['load_after']}")


def header() -> str:
    names = "".join(f"{label[:8]:>9}" for label, _ in PHASES)
    return (f"{'start':<16}{'import':>7}{'total s':>8}{names}{'threads':>8}{'comp/rest':>10}{'XLA/low':>9}"
            f"{'1st tok':>8}{'to 1st':>9}{'all in':>8}  load average")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxmamba.bench startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", help="checkpoint directory (default: --size's random checkpoint)")
    p.add_argument("--size", default="21m", choices=["tiny", "small", "21m"])
    p.add_argument("--config", type=Path, help="a config.json: start a random checkpoint of its shape (written "
                   "once into the cache directory, outside the timed starts)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--compile", default="eager", choices=["eager", "lazy"])
    p.add_argument("--cache-dir", type=Path, help="an empty directory for the caches (default: a temporary one)")
    p.add_argument("--baseline-repo", type=Path, help="also start from this checkout (today's code), same load")
    p.add_argument("--baseline-python", default=sys.executable, help="the baseline checkout's interpreter")
    p.add_argument("--baseline-first", action="store_true", help="run the baseline's starts before ours")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)

    from jaxmamba.bench.decode import checkpoint_for

    if args.config is not None and args.checkpoint:
        p.error("--config writes a random checkpoint of its shape: give it or a checkpoint, not both")
    if args.baseline_repo is not None:  # checked before any start, not after ours
        args.baseline_python = checked_baseline(p, args.baseline_repo, args.baseline_python)
    engine_args = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, compile_progress=False)
    with tempfile.TemporaryDirectory(prefix="jaxmamba-startup-") as tmp:
        root = args.cache_dir or Path(tmp)
        if args.config is not None:
            from jaxmamba.random_checkpoint import random_model_of_config

            checkpoint = random_model_of_config(args.config, root / "checkpoint")
        else:
            checkpoint = Path(args.checkpoint) if args.checkpoint else checkpoint_for(args.size)
        return _run(args, checkpoint, engine_args, root)


def _run(args, checkpoint: Path, engine_args: dict, root: Path) -> int:
    print(f"startup: {checkpoint} at max_num_seqs={args.max_num_seqs}, max_num_batched_tokens="
          f"{args.max_num_batched_tokens}, max_model_len={args.max_model_len}; load average {load_average()} "
          f"on {os.cpu_count()} cores", flush=True)
    runs = [("this", lambda: cold_and_warm(checkpoint, {**engine_args, "compile": args.compile}, root / "this"))]
    if args.baseline_repo is not None:
        base = args.baseline_repo.resolve()
        # A checkout without compile= takes only the arguments it has always had.
        runs.append(("baseline", lambda: cold_and_warm(checkpoint, engine_args, root / "baseline",
                                                        python=args.baseline_python, repo=base)))
        if args.baseline_first:
            runs.reverse()
    results = {}
    for name, run in runs:
        results[name] = run()
        print(f"{name}: done (load average {load_average()})", flush=True)
    print(header())
    for name in ("baseline", "this"):
        for kind in ("cold", "warm"):
            if name in results:
                print(format_row(f"{name} {kind}", results[name][kind]))
    for name, result in results.items():
        cold, warm = result["cold"].get("first_token"), result["warm"].get("first_token")
        if cold is not None and warm is not None:  # a warm start's programs (restored) compute as the cold's
            print(f"{name}: the warm start's first token {'equals' if cold == warm else 'DIFFERS FROM'} the cold's "
                  f"({warm} vs {cold})")
    if "baseline" in results:
        for kind in ("cold", "warm"):
            ratio = results["baseline"][kind]["construct_s"] / results["this"][kind]["construct_s"]
            print(f"{kind} start: {ratio:.2f}x faster than the baseline")
    if args.json:
        args.json.write_text(json.dumps(dict(checkpoint=str(checkpoint), engine_args=engine_args,
                                             results=results), indent=1) + "\n")
    return 0
