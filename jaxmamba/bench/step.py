"""``python -m jaxmamba.bench step``: one bucket's step on the device, profiled kernel by kernel.

The engine serves ``--batch`` prompts of ``--prompt-len`` seeded random tokens for two tokens; the inputs of
its first step of the chosen kind (a mixed bucket: the prompts' prefill; ``--decode``: the first decode-only
step) are captured and that step's executable re-run alone, the returned caches fed back: ``--repeats``
timed runs (the fastest counts: the step's wall ms), then ``--steps`` runs under ``jax.profiler.trace`` (their
own wall time per step is what the kernels' shares are of).
The trace's kernels (optimized-HLO instructions) become a table: launches, time and share of the step, and
achieved FLOP/s and bytes/s where the kernel's work is known from the optimized HLO (``jaxmamba.hlo_flops``,
``jaxmamba.hlo_traffic``; bytes count the cache pools at the rows' real extent). On the CPU XLA's thunks
are host events; where a trace holds no kernel event the table says so.

``--config``: random weights of a config.json's shape (the 8B widths: benchmarks/configs/); default: the
``--size`` random NemotronH checkpoint. ``--json`` writes the table; ``--trace-dir`` keeps the trace (for
Perfetto / TensorBoard), else it goes to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxmamba.bench._kernel_trace import kernel_table, latest_xplane
from jaxmamba.bench.decode import checkpoint_for, load_average


class CapturedStep:
    """One dispatched step's inputs (the persistent tables copied: later steps update them in place)."""

    def __init__(self, bucket, args: tuple, kwargs: dict):
        from jaxmamba.engine.block_table import copy_of_table_argument

        self.bucket = bucket
        # args: caches, int_buf, float_buf, block_table, state_table, then dispatch's optional arguments.
        # Copies: the engine may fill the same host buffers for its next step.
        self.int_buf, self.float_buf = np.array(args[1]), np.array(args[2])
        self.tables = [copy_of_table_argument(t) for t in (args[3], args[4])]
        self.rest, self.kwargs = args[5:], dict(kwargs)

    def run(self, steps, caches):
        """Dispatch the step once on ``caches`` (donated); ``(outputs, caches)``."""
        return steps.dispatch(self.bucket, caches, self.int_buf, self.float_buf, *self.tables, *self.rest,
                              **self.kwargs)


def capture_step(llm, prompts, decode: bool) -> CapturedStep:
    """The first step of ``llm.generate(prompts)`` (two greedy tokens) whose bucket is decode-only (``decode``)
    or mixed."""
    from jaxmamba import SamplingParams

    steps = llm.runner.steps
    captured: list[CapturedStep] = []
    real_dispatch = steps.dispatch

    def capture(bucket, *args, **kwargs):
        if bucket.decode_only == decode and not captured:
            captured.append(CapturedStep(bucket, args, kwargs))
        return real_dispatch(bucket, *args, **kwargs)

    steps.dispatch = capture
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    finally:
        del steps.dispatch  # back to the class's method
    if not captured:
        kind = "decode-only" if decode else "mixed"
        raise RuntimeError(f"no {kind} step ran for {len(prompts)} prompts of {len(prompts[0])} tokens")
    return captured[0]


def time_and_trace(llm, captured: CapturedStep, repeats: int, traced_steps: int, trace_dir: str):
    """``(fastest step ms, ms per traced step, ProfileData of traced_steps steps)``: the captured step re-run
    alone, timed, then under the profiler (the traced steps' own wall time is the kernels' shares' base)."""
    import jax

    runner = llm.runner
    outputs, runner.caches = captured.run(runner.steps, runner.caches)  # warm-up
    jax.block_until_ready(outputs)
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs, runner.caches = captured.run(runner.steps, runner.caches)
        jax.block_until_ready(outputs)
        walls.append(time.perf_counter() - start)
    with jax.profiler.trace(trace_dir):
        start = time.perf_counter()
        for _ in range(traced_steps):
            outputs, runner.caches = captured.run(runner.steps, runner.caches)
            jax.block_until_ready(outputs)
        traced = time.perf_counter() - start
    profile = jax.profiler.ProfileData.from_file(latest_xplane(trace_dir))
    return 1e3 * min(walls), 1e3 * traced / traced_steps, profile


def step_batch(args):
    """The rows of the profiled step: the prompts' prefill, or their first decode token."""
    from jaxmamba.pallas_work import BatchShape

    n = args.batch
    if args.decode:
        return BatchShape((1,) * n, (args.prompt_len,) * n, (False,) * n)
    return BatchShape((args.prompt_len,) * n, (0,) * n, (True,) * n)


def step_work(llm, captured: CapturedStep, batch, mean_context: int) -> tuple[str, dict, dict, dict]:
    """``(HLO module name, FLOPs, bytes, (kind, op_name))`` by kernel name of the captured step's program
    running ``batch`` (a ``pallas_work.BatchShape``: the Pallas kernels' work follows it); bytes count each
    cache pool at the bucket's rows, KV at ``mean_context`` tokens a row."""
    from jaxmamba.hlo_flops import count_flops
    from jaxmamba.hlo_traffic import analyze
    from jaxmamba.roofline import cache_touched_bytes

    runner = llm.runner
    steps = runner.steps
    variant = captured.kwargs.get("variant", captured.rest[2] if len(captured.rest) > 2 else None)
    text = steps.executable(captured.bucket, variant).as_text()
    module = text.split(None, 2)[1].rstrip(",") if text.startswith("HloModule") else ""
    flops = count_flops(text, batch)
    kv_dtype = (list(runner.caches.kv) or list(runner.caches.ssm))[0].dtype
    touched = cache_touched_bytes(runner.cfg, runner.caches, captured.bucket.num_reqs, mean_context,
                                  len(steps.param_leaves), kv_dtype)
    moved, kinds = {}, {}
    for k in analyze(text, touched).kernels:
        moved[k.name] = moved.get(k.name, 0) + k.bytes_moved
        kinds.setdefault(k.name, (k.opcode, k.op_name))
    for k in flops.kernels:
        kinds[k.name] = (f"{k.opcode} {k.kind}".strip(), k.op_name or kinds.get(k.name, ("", ""))[1])
    return module, flops.by_name(), moved, kinds


def _model(args):
    """``(model or checkpoint path, description)`` of ``--config`` (random weights) or ``--size``."""
    if args.config is None:
        path = checkpoint_for(args.size)
        return path, str(path)
    from jaxmamba.bench.decode import load_model

    args.checkpoint = None
    return load_model(args)


def main(argv=None) -> int:
    import jax

    from jaxmamba import LLM

    p = _parser()
    args = p.parse_args(argv)
    for name in ("batch", "prompt_len", "repeats", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model, source = _model(args)
    from jaxmamba.config import HybridConfig

    cfg = model.cfg if hasattr(model, "cfg") else HybridConfig.from_hf(model)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(3, cfg.vocab_size, size=(args.batch, args.prompt_len)).tolist()
    tokens = max(args.batch * args.prompt_len, 16)
    # A mixed step needs one bucket only (the prompts fill it): compiling the whole ladder at a large model's
    # widths would take most of a GPU session's time; a decode step needs the decode ladder.
    only = None if args.decode else [(args.batch, tokens)]
    llm = LLM(model, max_num_seqs=args.batch, max_num_batched_tokens=tokens, max_model_len=args.prompt_len + 4,
              kernel_backend=args.kernel_backend, buckets=only)
    captured = capture_step(llm, prompts, args.decode)
    b = captured.bucket
    kind = "decode" if b.decode_only else f"mixed, P={b.num_prefills}"
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; load average "
          f"{load_average()}")
    print(f"model: {source}; {args.batch} prompts x {args.prompt_len} tokens; bucket (T={b.num_tokens}, "
          f"R={b.num_reqs}, {kind})")
    with tempfile.TemporaryDirectory() as tmp:
        step_ms, traced_ms, profile = time_and_trace(llm, captured, args.repeats, args.steps, args.trace_dir or tmp)
    from jaxmamba.roofline import batch_flops

    batch = step_batch(args)
    module, flops, moved, kinds = step_work(llm, captured, batch, args.prompt_len + 1)
    table = kernel_table(profile, module, args.steps, traced_ms, flops, moved, kinds)
    print(table.format(args.top))
    total, needed = sum(flops.values()), batch_flops(cfg, batch)
    print(f"step: {step_ms:.3f} ms wall (fastest of {args.repeats}; {traced_ms:.3f} ms a step while traced); "
          f"contractions: {total / 1e9:.3f} GFLOP in the program, {needed / 1e9:.3f} GFLOP the batch needs ({needed / (step_ms * 1e-3) / 1e12:.3f} TFLOP/s of the "
          f"batch's over the step); load average {load_average()}")
    if args.json:
        result = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "source": source,
                  "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "bucket": {"num_tokens": b.num_tokens, "num_reqs": b.num_reqs, "decode_only": b.decode_only,
                             "num_prefills": b.num_prefills},
                  "hlo_module": module, "fastest_step_ms": step_ms, "program_flops": total, "batch_flops": needed,
                  "batch_tflops_per_s": needed / (step_ms * 1e-3) / 1e12, **table.to_json()}
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxmamba.bench step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=["tiny", "small", "21m"], help="random NemotronH checkpoint")
    p.add_argument("--config", type=Path, help="a config.json served with random weights of its shape")
    p.add_argument("--dtype", default="auto", help="--config: the model's dtype (auto: the config's)")
    p.add_argument("--batch", type=int, default=4, help="prompts (rows of the step)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens a prompt (the mixed step: batch x this)")
    p.add_argument("--decode", action="store_true", help="profile the first decode-only step instead")
    p.add_argument("--kernel-backend", default="auto", help="LLM's kernel_backend (auto, pallas, reference)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of the step (the fastest counts)")
    p.add_argument("--steps", type=int, default=3, help="steps run under the profiler")
    p.add_argument("--top", type=int, default=30, help="kernels printed (the JSON has all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-dir", help="keep the profiler's trace here")
    p.add_argument("--json", type=Path, help="also write the table here")
    return p
