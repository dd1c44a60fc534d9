"""``python -m jaxmamba.bench decode``: decode throughput at a fixed batch, jaxmamba vs transformers.

The same ``--batch`` prompts of ``--prompt-len`` seeded random tokens go through ``LLM.generate`` and
through transformers' batched ``generate`` (torch eager, CPU), greedy, ``--new-tokens`` tokens each, same
process and checkpoint; after a warm-up the sides are timed alternately ``--repeats`` times, each side's
fastest run counting. Reported per side: generate tok/s (``batch x new_tokens / wall``, prefill included)
and decode tok/s (``batch x (new_tokens - 1) / (wall - wall of a 1-token call)``). The load average is
printed before and after: compare runs only at similar loads.

``--profile-step``: also time the decode-bucket step executable alone, per sampling tail.
``--roofline``: each ``--batch`` (``32,128``) against the memory roofline (bytes a decode step must move,
copy bandwidth measured over ``--copy-mib`` MiB) instead of against transformers. ``--config``: random
weights of a config.json's shape. ``--size``: ``tiny`` (0.16M parameters), ``small`` (5.1M) or ``21m``
(a 20.4M-parameter NemotronH written once under the user cache).

Method and reports in full: docs/architecture.md, "Benchmarks: bench decode and bench transfer".
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

#: config.json overrides of ``random_model(family, "small")`` for ``--size 21m`` (NemotronH spelling).
SIZE_21M = dict(hidden_size=512, mamba_head_dim=64, head_dim=64, intermediate_size=1280,
                layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"] * 3)


def checkpoint_for(size: str) -> Path:
    from jaxmamba.random_checkpoint import default_checkpoint, random_model

    if size in ("tiny", "small"):
        return default_checkpoint("nemotron_h", size)
    path = Path.home() / ".cache" / "jaxmamba" / "random-nemotron_h-21m-seed0"
    if not (path / "model.safetensors").exists():
        random_model("nemotron_h", size="small", seed=0, path=path, **SIZE_21M)
    return path


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _rates(batch: int, new_tokens: int, wall: float, wall_one: float) -> dict:
    return {"wall_s": wall, "wall_one_token_s": wall_one, "generate_tok_per_s": batch * new_tokens / wall,
            "decode_tok_per_s": batch * (new_tokens - 1) / max(wall - wall_one, 1e-9)}


class Side:
    """One side of the comparison: ``generate(n)`` runs the batch for ``n`` new tokens and returns the
    token lists; ``walls`` collects the timed runs of the full and the 1-token call."""

    def __init__(self, name: str, generate, new_tokens: int):
        self.name, self.generate, self.new_tokens = name, generate, new_tokens
        self.tokens = generate(new_tokens)  # warm-up (first-call costs), and the tokens
        generate(1)
        self.walls = {new_tokens: [], 1: []}

    def time_once(self) -> None:
        for n in (self.new_tokens, 1):
            t0 = time.perf_counter()
            self.generate(n)
            self.walls[n].append(time.perf_counter() - t0)

    def rates(self, batch: int) -> dict:
        return _rates(batch, self.new_tokens, min(self.walls[self.new_tokens]), min(self.walls[1]))


def jaxmamba_side(path, prompts, new_tokens: int, async_scheduling: bool = True,
                  num_scheduler_steps: int = 1, async_dispatch: str = "auto") -> tuple[Side, object, float]:
    from jaxmamba import LLM, SamplingParams

    batch, prompt_len = len(prompts), len(prompts[0])
    t0 = time.perf_counter()
    llm = LLM(path, max_num_seqs=batch, max_num_batched_tokens=max(batch * prompt_len, 16),
              max_model_len=prompt_len + new_tokens + 1, async_scheduling=async_scheduling,
              num_scheduler_steps=num_scheduler_steps, sampling_variants="decode",  # both tails, to compare
              async_dispatch=async_dispatch, restore="eager")  # every program in before the timed decode starts
    warmup = time.perf_counter() - t0

    def generate(n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    return Side("jaxmamba", generate, new_tokens), llm, warmup


def _time_decode_step(llm, prompts, repeats: int, steps: int = 32) -> dict[str, float]:
    """Milliseconds per decode step of the step executable alone, for each sampling variant the decode
    bucket has (timed alternately): one decode step's inputs, captured from a real run, re-run
    ``steps`` times with the returned caches fed back (what a step costs without the engine's host work)."""
    from jaxmamba import SamplingParams
    from jaxmamba.engine.block_table import copy_of_table_argument
    from jaxmamba.sampling import FULL, GREEDY

    runner = llm.runner
    captured = []
    real_dispatch, real = runner.steps.dispatch, runner.steps.run

    def capture(bucket, caches, int_buf, float_buf, block_table, state_table, *rest):
        if bucket.decode_only and not captured:
            # The persistent tables are updated in place by later steps: keep copies (np.asarray may be a view).
            tables = [copy_of_table_argument(t) for t in (block_table, state_table)]
            captured.append((bucket, int_buf, float_buf, tables))
        return real_dispatch(bucket, caches, int_buf, float_buf, block_table, state_table, *rest)

    runner.steps.dispatch = capture
    try:
        # Two tokens: the prefill's, then one decode step, never a window (num_scheduler_steps): a window's
        # row needs two tokens still to come, and its program takes other inputs.
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    finally:
        del runner.steps.dispatch  # back to the class's method
    bucket, int_buf, float_buf, tables = captured[0]
    block_table, state_table = tables
    walls = {v: [] for v in runner.steps.sampling_variants[bucket]}
    for _ in range(repeats):
        for variant, times in walls.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                _, runner.caches = real(bucket, runner.caches, int_buf, float_buf, block_table, state_table,
                                       variant=variant)
            times.append(time.perf_counter() - t0)
    names = {GREEDY: "greedy", FULL: "full"}
    return {names.get(v, str(v)): 1e3 * min(times) / steps for v, times in walls.items()}


def _batches(text: str) -> list[int]:
    """``--batch``: ``8`` or ``32,128`` (argparse type: a malformed or non-positive entry is a usage error)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--batch wants positive integers separated by commas, got {text!r}")
    return values


def roofline_row(model, batch: int, args, bandwidth: float) -> dict:
    """One ``--batch`` of the roofline report: the ideal bytes and roofline ms, the step alone and the engine
    (ms per decode step and their shares of the roofline), and the engine's host profile."""
    import gc

    from flax import nnx

    from jaxmamba.host_profile import HostProfile
    from jaxmamba.plan import param_bytes
    from jaxmamba.roofline import ideal_decode_bytes

    cfg = model.cfg
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(3, cfg.vocab_size, size=(batch, args.prompt_len)).tolist()
    side, llm, warmup = jaxmamba_side(model, prompts, args.new_tokens, args.async_scheduling,
                                      args.num_scheduler_steps, args.async_dispatch)
    for _ in range(args.repeats):
        side.time_once()
    walls = side.walls
    engine_ms = 1e3 * (min(walls[args.new_tokens]) - min(walls[1])) / (args.new_tokens - 1)
    alone = _time_decode_step(llm, prompts, args.repeats)
    llm.host_profile = HostProfile()
    side.generate(args.new_tokens)
    host = llm.host_profile.summary()
    llm.host_profile = None
    caches, dispatch = llm.runner.caches, llm.config.async_dispatch
    ssm_dtype = caches.ssm[0].dtype if caches.ssm else model.dtype
    # Each row's context grows from prompt_len + 1 to prompt_len + new_tokens over the run.
    ideal = ideal_decode_bytes(cfg, batch, args.prompt_len + args.new_tokens // 2, model.dtype, ssm_dtype,
                               weights=param_bytes(nnx.state(model, nnx.Param)))
    roofline_ms = 1e3 * ideal.total / bandwidth
    del llm, side, caches
    gc.collect()
    return {"batch": batch, "mean_context": ideal.mean_context, "ideal_bytes": ideal.total,
            "ideal": {k: getattr(ideal, k) for k in ("weights", "embedding", "ssm_state", "conv_state", "kv")},
            "roofline_ms": roofline_ms, "step_alone_ms": alone,
            "step_alone_share": {name: roofline_ms / ms for name, ms in alone.items()},
            "engine_ms": engine_ms, "engine_share": roofline_ms / engine_ms, "warmup_s": warmup,
            "async_dispatch": dispatch, "host_profile": host}


def roofline(args, model, source: str) -> dict:
    """``--roofline``: print and return the report of every ``--batch``."""
    import jax

    from jaxmamba.host_profile import PHASES
    from jaxmamba.roofline import measure_copy_bandwidth

    on_gpu = jax.default_backend() == "gpu"
    copy_mib = args.copy_mib or (1024 if on_gpu else 64)
    bandwidth = measure_copy_bandwidth(copy_mib << 20, args.repeats)
    print(f"model: {source} ({model.cfg.family}, {model.cfg.num_hidden_layers} layers, hidden "
          f"{model.cfg.hidden_size}, {model.dtype}); {args.prompt_len}-token prompts, {args.new_tokens} greedy "
          f"tokens, best of {args.repeats}")
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (an elementwise pass over {copy_mib} MiB, read + written); "
          f"load average {load_average()}")
    rows = [roofline_row(model, batch, args, bandwidth) for batch in args.batch]
    tails = sorted({name for r in rows for name in r["step_alone_ms"]})
    print(f"\n{'batch':>5} {'ideal MB':>9} {'roofline ms':>11} "
          + " ".join(f"{'alone ' + t + ' ms':>18}" for t in tails) + f" {'engine ms':>14}")
    for r in rows:
        alone = " ".join(f"{r['step_alone_ms'][t]:>9.3f} ({100 * r['step_alone_share'][t]:3.0f}%)".rjust(18)
                         for t in tails)
        print(f"{r['batch']:>5} {r['ideal_bytes'] / 1e6:>9.1f} {r['roofline_ms']:>11.3f} {alone} "
              f"{r['engine_ms']:>7.3f} ({100 * r['engine_share']:3.0f}%)")
    print("\nhost ms per step by phase (one more run per batch; device = the steps' device time)")
    print(f"{'batch':>5} " + " ".join(f"{p:>10}" for p in PHASES) + f" {'host':>8} {'device':>8} {'host us/tok':>11}")
    for r in rows:
        h = r["host_profile"]
        print(f"{r['batch']:>5} " + " ".join(f"{h[p + '_ms_per_step']:>10.3f}" for p in PHASES)
              + f" {h['host_ms_per_step']:>8.3f} {h['device_ms_per_step']:>8.3f}"
              f" {h['host_us_per_output_token']:>11.1f}")
    print(f"load average after: {load_average()}")
    return {"copy_bandwidth_bytes_per_s": bandwidth, "copy_mib": copy_mib, "rows": rows}


def load_model(args):
    """``(model, description)`` of ``--config`` (random weights), the checkpoint argument, or ``--size``."""
    from jaxmamba.config import HybridConfig
    from jaxmamba.plan import resolve_dtype
    from jaxmamba.random_checkpoint import random_weights
    from jaxmamba.weights import load_pretrained

    if args.config is not None:
        cfg = HybridConfig.from_hf(args.config)
        return random_weights(cfg, resolve_dtype(args.dtype, cfg), args.seed), f"{args.config} (random weights)"
    path = Path(args.checkpoint) if args.checkpoint else checkpoint_for(args.size)
    return load_pretrained(path, dtype=None if args.dtype == "auto" else args.dtype), str(path)


def transformers_side(path, prompts, new_tokens: int) -> Side:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def generate(n):
        with torch.no_grad():
            # eos_token_id=None: generate through EOS, as ignore_eos does.
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    return Side("transformers", generate, new_tokens)


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode tok/s subtracts a 1-token run)")
    if args.roofline:
        if args.checkpoint and args.config:
            p.error("--config serves random weights: give it or a checkpoint, not both")
        model, source = load_model(args)
        result = {"args": vars(args) | {"json": str(args.json), "config": str(args.config)},
                  "roofline": roofline(args, model, source)}
        if args.json:
            args.json.write_text(json.dumps(result, indent=2, default=str))
        return 0
    if args.config is not None or len(args.batch) > 1:
        p.error("--config and several --batch values need --roofline")
    args.batch = args.batch[0]
    result = compare_decode(args)
    print(f"load average after: {load_average()}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


#: ``steps.ASYNC_DISPATCH_MODES``, spelt out: a bench's ``--help`` does not import jax.
ASYNC_DISPATCH_CHOICES = ("auto", "thread", "inline")


def add_async_dispatch_argument(parser: argparse.ArgumentParser) -> None:
    """``--async-dispatch``: ``LLM``'s ``async_dispatch`` (``bench decode``, ``bench host-path``)."""
    parser.add_argument("--async-dispatch", choices=ASYNC_DISPATCH_CHOICES, default="auto",
                        help="LLM's async_dispatch: enqueue steps on a dispatch thread or on the engine thread "
                             "('auto': the thread on a CPU device, inline on an accelerator)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxmamba.bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", help="checkpoint directory (default: --size's random NemotronH)")
    p.add_argument("--size", default="tiny", choices=["tiny", "small", "21m"])
    p.add_argument("--batch", type=_batches, default=[8], help="rows of the batch (--roofline: several, 32,128)")
    p.add_argument("--roofline", action="store_true",
                   help="report each batch against the memory roofline (no transformers run)")
    p.add_argument("--config", type=Path, help="--roofline: a config.json served with random weights of its shape")
    p.add_argument("--dtype", default="auto", help="--roofline: the model's dtype (auto: the config's)")
    p.add_argument("--copy-mib", type=int, help="--roofline: MiB of the copy-bandwidth array (default: 1024 on "
                   "a GPU, 64 on the CPU)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per side, alternating (the fastest counts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-step", action="store_true", help="also time the decode step executable alone")
    p.add_argument("--no-reference", action="store_true", help="skip transformers")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="LLM's async_scheduling (default on)")
    add_async_dispatch_argument(p)
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="LLM's num_scheduler_steps: decode steps per device call (multi-step scheduling)")
    p.add_argument("--torch-threads", type=int, help="torch's intra-op threads (default: torch's own choice; on a "
                   "loaded machine its spinning OpenMP threads can slow it several-fold)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p


def compare_decode(args) -> dict:
    """The engine's decode and generate rates beside transformers' on one batch (printed; the JSON result)."""
    import jax

    from jaxmamba.config import HybridConfig

    path = Path(args.checkpoint) if args.checkpoint else checkpoint_for(args.size)
    cfg = HybridConfig.from_hf(path)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(3, cfg.vocab_size, size=(args.batch, args.prompt_len)).tolist()
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(f"checkpoint: {path} ({cfg.family}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size})")
    print(f"batch {args.batch}, {args.prompt_len}-token prompts, {args.new_tokens} greedy tokens, "
          f"best of {args.repeats}; load average {load_average()}")
    print(f"engine: async_scheduling={args.async_scheduling}, async_dispatch={args.async_dispatch}, "
          f"num_scheduler_steps={args.num_scheduler_steps}")
    jax_side, llm, warmup = jaxmamba_side(path, prompts, args.new_tokens, args.async_scheduling,
                                          args.num_scheduler_steps, args.async_dispatch)
    sides = [jax_side]
    if not args.no_reference:
        import torch

        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        sides.append(transformers_side(path, prompts, args.new_tokens))
    for _ in range(args.repeats):
        for side in sides:
            side.time_once()
    ours = {"warmup_s": warmup, **jax_side.rates(args.batch), "tokens": jax_side.tokens,
            "compiles_while_serving": llm.stats.backend_compiles_since_warmup}
    if args.profile_step:
        ours["step_alone_ms"] = _time_decode_step(llm, prompts, args.repeats)
    print(f"jaxmamba     : {ours['decode_tok_per_s']:9.1f} decode tok/s   {ours['generate_tok_per_s']:9.1f} generate "
          f"tok/s   wall {ours['wall_s']:.3f} s (1 token: {ours['wall_one_token_s']:.3f} s, warm-up "
          f"{ours['warmup_s']:.1f} s), compiles while serving {ours['compiles_while_serving']}")
    if args.profile_step:
        per_step = 1e3 * (ours["wall_s"] - ours["wall_one_token_s"]) / (args.new_tokens - 1)
        alone = ", ".join(f"{ms:.3f} ms {name}" for name, ms in ours["step_alone_ms"].items())
        print(f"decode step  : {per_step:.3f} ms in the engine; the step executable alone, by sampling tail: {alone}")
    result = {"device": jax.devices()[0].device_kind, "args": vars(args) | {"json": str(args.json)},
              "jaxmamba": ours}
    if not args.no_reference:
        ref = {**sides[1].rates(args.batch), "tokens": sides[1].tokens, "torch_threads": torch.get_num_threads()}
        agree = np.mean([a == b for a, b in zip(ours["tokens"], ref["tokens"], strict=True)])
        ratio = ours["decode_tok_per_s"] / ref["decode_tok_per_s"]
        print(f"transformers : {ref['decode_tok_per_s']:9.1f} decode tok/s   {ref['generate_tok_per_s']:9.1f} "
              f"generate tok/s   wall {ref['wall_s']:.3f} s (1 token: {ref['wall_one_token_s']:.3f} s), "
              f"torch threads {ref['torch_threads']}")
        print(f"ratio (jaxmamba / transformers): decode {ratio:.2f}x   generate "
              f"{ours['generate_tok_per_s'] / ref['generate_tok_per_s']:.2f}x   identical greedy outputs: "
              f"{100 * agree:.1f}% of requests")
        if agree < 1:
            print("  note: transformers' cached NemotronH decode skips the time_step_min clamp of dt that its own "
                  "prefill applies\n  (see bench serve); jaxmamba clamps on both paths. Requests may also part "
                  "after near-ties.")
        result.update(transformers=ref, decode_ratio=ratio)
    return result
