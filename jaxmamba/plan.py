"""Capacity planning: what fits on a device, sized as the engine does at start-up.

The sizing itself is the engine's (``jaxmamba.engine.sizing``: the budget, ``size_pools``, the bucket
compile probes); this module is the report on top of it. ``plan(...)`` compiles every bucket of a
checkpoint *or of a config.json alone* (weights stay abstract: nothing is allocated, so an 8B or 30B shape
plans on a laptop), sizes the pools as ``EngineCore`` would on the target, and returns a ``Plan`` with the
per-bucket memory, the decode steps' traffic and, for GPU targets, every Pallas kernel's registers, spills
and shared memory. The sizing names stay importable from here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmamba import aot, cpu_heap
from jaxmamba.buckets import engine_buckets
from jaxmamba.config import HybridConfig
from jaxmamba.engine.block_table import device_tables_bytes
from jaxmamba.engine.sizing import (GIB, PoolSizes, abstract_caches, cache_unit_bytes, compile_buckets, format_gib,
                                    gpu_cache_budget, largest_bucket, largest_bucket_temp_bytes, param_bytes,
                                    probe_pools, resolve_kernel_backend, size_pools)
from jaxmamba.errors import ConfigError
from jaxmamba.hlo_flops import count_flops
from jaxmamba.hlo_traffic import analyze
from jaxmamba.model import HybridForCausalLM
from jaxmamba.pallas_work import filling_batch
from jaxmamba.roofline import batch_flops, cache_touched_bytes, ideal_decode_bytes
from jaxmamba.sampling import FULL, GREEDY
from jaxmamba.weights import _resolve_dtype

# The engine's sizing names, importable from here as before (``jaxmamba.plan.size_pools``, ...).
__all__ = ["GIB", "BucketPlan", "KernelPlan", "Plan", "PoolSizes", "abstract_caches", "cache_unit_bytes",
           "compile_buckets", "decode_traffic", "gpu_cache_budget", "largest_bucket", "largest_bucket_temp_bytes",
           "load_config", "param_bytes", "plan", "probe_pools", "resolve_dtype", "resolve_kernel_backend",
           "size_pools", "write_json"]

# ---------------------------------------------------------------------------------------------- plan
@dataclass
class BucketPlan:
    num_tokens: int
    num_reqs: int
    decode_only: bool
    num_prefills: int  # prefill rows the bucket holds (0 for decode buckets)
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    num_programs: int = 1  # programs compiled for the bucket (sampling variants; a window's too); memory: the largest
    # Decode buckets (one token a row): the single step's traffic (jaxmamba.hlo_traffic, its FULL sampling tail)
    # beside what it must move at the plan's mean context (jaxmamba.roofline); None for mixed buckets.
    bytes_moved: int | None = None
    ideal_bytes: int | None = None
    kernel_launches: int | None = None
    bytes_by_source: dict[str, int] | None = None  # bytes_moved by the source file of the operations moving them
    worst_case_extra_bytes: int | None = None  # beyond bytes_moved if every conditional took its costliest branch
    greedy_bytes_moved: int | None = None  # the same step with the greedy-only tail, where it was compiled
    # Mixed buckets: the contractions the compiled step performs for the batch that fills it (jaxmamba.hlo_flops,
    # the Pallas kernels' tiles for that batch) beside those the batch needs (jaxmamba.roofline.batch_flops).
    flops: int | None = None
    batch_flops: int | None = None
    unknown_kernels: list[str] | None = None  # Pallas kernels whose work is not known (counted 0 in flops)


@dataclass
class KernelPlan:
    name: str
    registers: int | None
    spill_bytes: int | None
    shared_bytes: int


@dataclass
class Plan:
    target: str
    device_memory_bytes: int
    budget_bytes: int  # cache space: utilisation x memory - weights - max temp - device tables (GPU), cpu_memory_gib (CPU)
    weight_bytes: int
    device_tables_bytes: int  # the persistent block and state-index tables (outside the caches and the temporaries)
    max_model_len: int
    num_blocks: int
    num_slots: int
    block_bytes: int
    slot_bytes: int
    max_concurrency: float
    mean_context: int = 0  # tokens a decode row reads from its KV cache in the traffic report
    buckets: list[BucketPlan] = field(default_factory=list)
    kernels: list[KernelPlan] = field(default_factory=list)
    num_programs: int = 0  # step programs compiled, the sizing probe's included
    compile_wall_s: float = 0.0  # building them, wall clock
    lowering_s: float = 0.0  # tracing and lowering, one thread
    backend_compile_s: float = 0.0  # XLA's compiles, summed over the compile threads
    build_threads: int = 0  # threads the programs compiled on (``program_builder.default_workers``)
    one_malloc_arena: bool = False  # this process's threads shared one malloc arena (``cpu_heap``)

    def to_json(self) -> dict:
        """The keys other tools read (see ``python -m jaxmamba plan --json``)."""
        keys = ("target", "weight_bytes", "num_blocks", "num_slots", "max_concurrency", "max_model_len",
                "budget_bytes", "device_memory_bytes", "block_bytes", "slot_bytes", "device_tables_bytes",
                "mean_context", "num_programs", "compile_wall_s", "lowering_s", "backend_compile_s", "build_threads",
                "one_malloc_arena")
        out = {k: getattr(self, k) for k in keys}
        out["buckets"] = [asdict(b) for b in self.buckets]
        out["kernels"] = [asdict(k) for k in self.kernels]
        return out

    def format(self) -> str:
        mib = lambda n: f"{n / (1 << 20):10.1f}"  # noqa: E731
        lines = [f"target {self.target}: device memory {self.device_memory_bytes / GIB:.1f} GiB, weights "
                 f"{self.weight_bytes / GIB:.2f} GiB, device tables {self.device_tables_bytes / (1 << 20):.2f} MiB, "
                 f"cache budget {self.budget_bytes / GIB:.2f} GiB",
                 "", f"{'bucket (T, R, P | decode)':<28}{'temp MiB':>10}{'args MiB':>10}{'out MiB':>10}{'alias MiB':>10}"]
        for b in self.buckets:
            kind = "decode" if b.decode_only else f"P={b.num_prefills}"
            lines.append(f"{f'({b.num_tokens}, {b.num_reqs}, {kind})':<28}{mib(b.temp_bytes)}{mib(b.argument_bytes)}"
                         f"{mib(b.output_bytes)}{mib(b.alias_bytes)}")
        traffic = [b for b in self.buckets if b.bytes_moved is not None]
        if traffic:
            lines += ["", f"decode step traffic at a mean context of {self.mean_context} tokens (bytes read + written)",
                      f"{'bucket (T, R)':<28}{'moved MiB':>10}{'ideal MiB':>10}{'ratio':>7}{'kernels':>9}"]
            for b in traffic:
                lines.append(f"{f'({b.num_tokens}, {b.num_reqs})':<28}{mib(b.bytes_moved)}{mib(b.ideal_bytes)}"
                             f"{b.bytes_moved / b.ideal_bytes:7.2f}{b.kernel_launches:9d}")
            widest = traffic[-1]
            lines.append(f"moved by source file in ({widest.num_tokens}, {widest.num_reqs}): " + ", ".join(
                f"{name} {mib(n).strip()}" for name, n in list(widest.bytes_by_source.items())[:6]) + " MiB")
        mixed = [b for b in self.buckets if b.flops is not None]
        if mixed:
            lines += ["", f"mixed step FLOPs (contractions) for the batch that fills the bucket (decode rows at "
                          f"{self.mean_context} tokens of context)",
                      f"{'bucket (T, R, P)':<28}{'GFLOP':>10}{'batch GFLOP':>12}{'ratio':>7}"]
            for b in mixed:
                unknown = f"  (unknown: {', '.join(b.unknown_kernels)})" if b.unknown_kernels else ""
                lines.append(f"{f'({b.num_tokens}, {b.num_reqs}, {b.num_prefills})':<28}{b.flops / 1e9:10.1f}"
                             f"{b.batch_flops / 1e9:12.1f}{b.flops / b.batch_flops:7.3f}{unknown}")
        if self.kernels:
            lines += ["", f"{'Pallas kernel':<48}{'registers':>10}{'spill B':>9}{'shared B':>10}"]
            for k in self.kernels:
                lines.append(f"{k.name:<48}{_opt(k.registers):>10}{_opt(k.spill_bytes):>9}{k.shared_bytes:>10}")
        lines += ["", f"KV blocks {self.num_blocks - 1} x {self.block_bytes} B, state slots {self.num_slots - 1} x "
                      f"{self.slot_bytes} B; maximum concurrency for {self.max_model_len} tokens per request: "
                      f"{self.max_concurrency:.2f}x",
                  f"compiled {self.num_programs} programs in {self.compile_wall_s:.1f} s on {self.build_threads} "
                  f"thread(s){' sharing one malloc arena' if self.one_malloc_arena else ''} (lowering "
                  f"{self.lowering_s:.1f} s, backend compiles {self.backend_compile_s:.1f} s summed over the threads)"]
        return "\n".join(lines)


def _opt(v) -> str:
    return "?" if v is None else str(v)


def load_config(model) -> HybridConfig:
    """A ``HybridConfig`` from a checkpoint directory, a ``config.json`` path, or a dict."""
    if isinstance(model, HybridConfig):
        return model
    return HybridConfig.from_hf(model)


def resolve_dtype(dtype, cfg: HybridConfig):
    """``dtype="auto"``: the checkpoint's ``torch_dtype`` (float32 when it names none)."""
    return _resolve_dtype(None if dtype in (None, "auto") else dtype, cfg)


def plan(model, target: str = "h100", *, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
         max_model_len: int | None = None, block_size: int = 16, enable_prefix_caching: bool = False,
         mamba_cache_mode: str | None = None, num_speculative_tokens: int = 0, dtype="auto",
         mamba_ssm_cache_dtype=None, gpu_memory_utilization: float = 0.9, cpu_memory_gib: float = 4.0,
         kernel_backend: str = "auto", buckets=None, num_blocks: int | None = None, num_scheduler_steps: int = 1,
         on_compiled=None, mean_context: int | None = None, progress=None) -> Plan:
    """Compile every bucket of ``model`` (a checkpoint directory or a ``config.json``) for ``target``
    (``"h100"``, ``"h200"``, or ``"cpu"``: this machine) and size the pools as ``LLM`` would there
    (``num_scheduler_steps`` > 1: the pure-decode buckets' window programs too; a bucket's temporaries are
    the larger of its programs'). Each decode bucket also reports its step's traffic beside the ideal
    bytes with rows of ``mean_context`` tokens (default ``max_model_len // 2``). ``on_compiled(bucket)``
    after each bucket; ``progress``: a ``compile_progress.CompileProgress`` counting programs."""
    cfg = load_config(model)
    on_gpu = target != "cpu"
    if on_gpu:
        aot.require_aot()
        device_memory = aot.get_target(target).memory_bytes
    else:
        device_memory = int(cpu_memory_gib * GIB)
    dt = resolve_dtype(dtype, cfg)
    ssm_dt = jnp.dtype(mamba_ssm_cache_dtype or dt)
    backend = resolve_kernel_backend(kernel_backend, on_gpu=on_gpu)
    mode = mamba_cache_mode or ("align" if enable_prefix_caching else "none")
    max_model_len = max_model_len or min(cfg.max_position_embeddings or 2048, 2048)
    abstract_model = nnx.eval_shape(lambda: HybridForCausalLM(cfg, dt))
    weight_bytes = param_bytes(nnx.state(abstract_model, nnx.Param))
    bucket_set = engine_buckets(max_num_seqs, max_num_batched_tokens, num_speculative_tokens, buckets)
    table_bytes = device_tables_bytes(max(b.num_reqs for b in bucket_set), max_model_len, block_size, mode,
                                      num_speculative_tokens)

    def compile_at(pools: PoolSizes, only=None):
        return compile_buckets(abstract_model, pools, only or bucket_set, block_size=block_size,
                               max_model_len=max_model_len, cache_mode=mode, num_spec=num_speculative_tokens,
                               enable_caching=enable_prefix_caching, ssm_dtype=ssm_dt, backend=backend,
                               target=target if on_gpu else None, on_compiled=on_compiled,
                               num_scheduler_steps=num_scheduler_steps, progress=progress)

    sizing = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size,
                  num_spec=num_speculative_tokens, cache_mode=mode, dtype=dt, ssm_dtype=ssm_dt,
                  cap_blocks=not (on_gpu and enable_prefix_caching), num_blocks=num_blocks)
    builds = []
    if on_gpu:
        # Size the pools from the largest bucket's temporaries, compile everything at the real size, and
        # check that no bucket needed more than the one used for sizing.
        largest, temp = largest_bucket_temp_bytes(abstract_model, bucket_set, sizing, backend=backend,
                                                  enable_caching=enable_prefix_caching, target=target,
                                                  on_compiled=on_compiled, progress=progress, builds=builds)
        budget = int(gpu_memory_utilization * device_memory) - weight_bytes - temp - table_bytes
    else:
        budget = device_memory
    try:
        pools = size_pools(budget, cfg, **sizing)
    except ConfigError as e:
        if not on_gpu:
            raise
        raise ConfigError(
            f"{e}. On {target}: {gpu_memory_utilization} x {format_gib(device_memory)} - weights "
            f"{format_gib(weight_bytes)} - the largest bucket's temporaries {format_gib(temp)} (T={largest.num_tokens}, R={largest.num_reqs}) "
            f"- the block and state-index tables {format_gib(table_bytes)} = {format_gib(budget)}") from None
    steps = compile_at(pools)
    builds.append(steps.build_stats)
    max_temp = max(m.temp_bytes for m in steps.memory.values())
    if on_gpu and max_temp > temp:
        budget = int(gpu_memory_utilization * device_memory) - weight_bytes - max_temp - table_bytes
        pools = size_pools(budget, cfg, **sizing)
        steps = compile_at(pools)
        builds.append(steps.build_stats)
    result = Plan(target=target, device_memory_bytes=device_memory, budget_bytes=budget, weight_bytes=weight_bytes,
                  device_tables_bytes=table_bytes, max_model_len=max_model_len, num_blocks=pools.num_blocks,
                  num_slots=pools.num_slots, block_bytes=pools.block_bytes, slot_bytes=pools.slot_bytes,
                  max_concurrency=pools.max_concurrency, mean_context=mean_context or max(max_model_len // 2, 1),
                  build_threads=steps.build_workers, one_malloc_arena=cpu_heap.shares_one_arena(),
                  **_build_totals(builds))
    caches = abstract_caches(cfg, pools, block_size=block_size, num_spec=num_speculative_tokens, dtype=dt,
                             ssm_dtype=ssm_dt)
    result.buckets = [_bucket_plan(steps, bucket, caches, cfg, result.mean_context, dt, ssm_dt, weight_bytes)
                      for bucket in steps.buckets]
    result.kernels = kernel_plans(steps)
    return result


def _build_totals(builds) -> dict:
    """``Plan``'s compile fields summed over the builds (``program_builder.BuildStats``)."""
    return dict(num_programs=sum(b.num_compiled + b.num_restored for b in builds),
                compile_wall_s=sum(b.wall_s for b in builds), lowering_s=sum(b.lowering_s for b in builds),
                backend_compile_s=sum(b.backend_compile_s for b in builds))


def _bucket_plan(steps, bucket, caches, cfg: HybridConfig, mean_context: int, dtype, ssm_dtype,
                 weights: int) -> BucketPlan:
    m = steps.memory[bucket]
    return BucketPlan(bucket.num_tokens, bucket.num_reqs, bucket.decode_only, bucket.num_prefills, m.temp_bytes,
                      m.argument_bytes, m.output_bytes, m.alias_bytes, steps.num_programs(bucket),
                      **decode_traffic(steps, bucket, caches, cfg, mean_context, dtype, ssm_dtype, weights),
                      **mixed_flops(steps, bucket, cfg, mean_context))


def mixed_flops(steps, bucket, cfg: HybridConfig, decode_context: int) -> dict:
    """``BucketPlan``'s FLOPs fields of a mixed bucket (empty for decode buckets): its program (the largest
    sampling tail) running the batch that fills it (``pallas_work.filling_batch``, decode rows at
    ``decode_context`` tokens), and what that batch needs."""
    if bucket.decode_only:
        return {}
    batch = filling_batch(bucket.num_tokens, bucket.num_reqs, bucket.num_prefills, decode_context)
    counted = count_flops(steps.executable(bucket).as_text(), batch)
    return dict(flops=counted.total, batch_flops=batch_flops(cfg, batch),
                unknown_kernels=counted.unknown_kernels or None)


def kernel_plans(steps) -> list[KernelPlan]:
    """Every Pallas kernel the step programs launch, by name, with the worst bucket's registers and memory."""
    seen = {}
    for kernels in steps.kernels.values():
        for k in kernels:
            if k.pallas:
                prev = seen.get(k.name)
                # The same kernel in several buckets: keep the worst case.
                if prev is None or (k.registers or 0, k.shared_bytes) > (prev.registers or 0, prev.shared_bytes):
                    seen[k.name] = KernelPlan(k.name, k.registers, k.spill_bytes, k.shared_bytes)
    return sorted(seen.values(), key=lambda k: k.name)


def decode_traffic(steps, bucket, caches, cfg: HybridConfig, mean_context: int, dtype, ssm_dtype,
                   weights: int) -> dict:
    """``BucketPlan``'s traffic fields of a decode bucket of one token a row (empty for the others);
    ``caches``: the abstract caches ``steps`` was compiled with."""
    if not bucket.decode_only or bucket.num_tokens != bucket.num_reqs:
        return {}
    touched = cache_touched_bytes(cfg, caches, bucket.num_reqs, mean_context,
                                  len(steps.param_leaves), dtype)
    traffic = analyze(steps.executable(bucket, FULL).as_text(), touched)
    ideal = ideal_decode_bytes(cfg, bucket.num_reqs, mean_context, dtype, ssm_dtype, weights=weights)
    out = dict(bytes_moved=traffic.bytes_moved, ideal_bytes=ideal.total, kernel_launches=traffic.kernel_launches,
               bytes_by_source=traffic.by_source(), worst_case_extra_bytes=traffic.worst_case_extra_bytes)
    if GREEDY in steps.sampling_variants[bucket]:  # compiled with sampling_variants="all"
        out["greedy_bytes_moved"] = analyze(steps.executable(bucket, GREEDY).as_text(), touched).bytes_moved
    return out


def write_json(result: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_json(), indent=1, default=lambda o: np.asarray(o).tolist()) + "\n")
