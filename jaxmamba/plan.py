"""Capacity planning: what fits on a device, sized as vLLM does at start-up.

vLLM profiles a forward pass, then gives the KV cache what is left of
``gpu_memory_utilization`` x device memory after weights and the peak
activations. We know the peak without running anything: XLA's buffer assignment
of every compiled bucket (``temp_bytes``) is exact, and it is the same whether
the step was compiled for the local device or for a GPU target that is not here
(``jaxmamba.aot``). So:

    budget = gpu_memory_utilization * device memory - weight bytes - max(bucket temp bytes)
             - persistent device table bytes

on a GPU (or a GPU target; the tables are the engine's device-resident attention block table and
Mamba state-index table, ``engine.block_table.device_tables_bytes``: neither a cache nor a step
temporary), and
``cpu_memory_gib`` of cache space on the CPU (vLLM CPU's ``VLLM_CPU_KVCACHE_SPACE``). ``size_pools`` turns a budget into KV
blocks and Mamba state slots; ``LLM`` and ``python -m jaxmamba plan`` both call
it, so the plan is what the engine allocates.

``plan(...)`` compiles every bucket of a checkpoint *or of a config.json alone*
(weights stay abstract: nothing is allocated, so an 8B or 30B shape plans on a
laptop) and returns a ``Plan`` with the per-bucket memory and, for GPU targets,
every Pallas kernel's registers, spills and shared memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.config import HybridConfig
from jaxmamba.errors import ConfigError
from jaxmamba.layout import kv_cache_shape, state_shapes
from jaxmamba.metadata.checks import cdiv
from jaxmamba.sampling import FULL, GREEDY

GIB = 1 << 30


@dataclass(frozen=True)
class PoolSizes:
    """KV blocks and Mamba state slots (both counts include the null block / slot 0)."""

    num_blocks: int
    num_slots: int
    block_bytes: int  # one KV block over every attention layer (per rank)
    slot_bytes: int  # one state slot over every Mamba layer: conv + SSM (per rank)
    max_concurrency: float  # requests of max_model_len tokens that fit at once (vLLM's start-up line)
    cache_bytes: int  # num_blocks * block_bytes + num_slots * slot_bytes

    def describe(self, max_model_len: int) -> str:
        return (f"{self.num_blocks - 1} KV blocks + {self.num_slots - 1} state slots "
                f"({self.cache_bytes / GIB:.2f} GiB); maximum concurrency for {max_model_len} tokens per request: "
                f"{self.max_concurrency:.2f}x")


def cache_unit_bytes(cfg: HybridConfig, *, block_size: int, num_spec: int = 0, dtype=jnp.float32, ssm_dtype=None,
                     tp_size: int = 1) -> tuple[int, int]:
    """``(block_bytes, slot_bytes)`` on one rank: a KV block over all attention layers, a state slot
    (conv ``(conv_dim, K-1+num_spec)`` in ``dtype`` + SSM ``(H, P, N)`` in ``ssm_dtype``) over all Mamba layers."""
    dtype = jnp.dtype(dtype)
    ssm_dtype = jnp.dtype(ssm_dtype or dtype)
    block_bytes = 0
    if cfg.attention_layer_ids:
        kv = kv_cache_shape(1, block_size, max(cfg.num_key_value_heads, 1), max(cfg.head_dim, 1), tp_size)
        block_bytes = len(cfg.attention_layer_ids) * math.prod(kv) * dtype.itemsize
    slot_bytes = 0
    if cfg.mamba_layer_ids:
        conv, ssm = state_shapes(cfg, tp_size, num_spec=num_spec)
        slot_bytes = len(cfg.mamba_layer_ids) * (math.prod(conv) * dtype.itemsize + math.prod(ssm) * ssm_dtype.itemsize)
    return block_bytes, slot_bytes


def size_pools(budget_bytes: int, cfg: HybridConfig, *, max_num_seqs: int, max_model_len: int, block_size: int,
               num_spec: int = 0, cache_mode: str = "none", dtype=jnp.float32, ssm_dtype=None, tp_size: int = 1,
               cap_blocks: bool = True, num_blocks: int | None = None, num_slots: int | None = None) -> PoolSizes:
    """KV blocks and state slots that fit in ``budget_bytes`` of cache space (per rank).

    Every running request holds ``1 + num_spec`` slots and a block per ``block_size`` tokens; in
    cache modes align/all every KV block also carries a slot (its block-end state). Slots for
    ``max_num_seqs`` requests come first, as long as one request at ``max_model_len`` still fits
    beside them; the rest of the budget becomes blocks. ``cap_blocks``: no more blocks than
    ``max_num_seqs`` requests at ``max_model_len`` can use (blocks beyond that only serve the prefix
    cache). ``num_blocks`` / ``num_slots`` given explicitly win (vLLM's ``num_gpu_blocks_override``).
    A budget that cannot hold one request at ``max_model_len`` raises ``ConfigError`` with the numbers.
    """
    block_bytes, slot_bytes = cache_unit_bytes(cfg, block_size=block_size, num_spec=num_spec, dtype=dtype,
                                               ssm_dtype=ssm_dtype, tp_size=tp_size)
    blocks_per_req = cdiv(max_model_len, block_size)
    slots_per_req = 1 + num_spec
    per_block = block_bytes + (slot_bytes if cache_mode != "none" else 0)
    blocks_matter = bool(cfg.attention_layer_ids) or cache_mode != "none"
    one_request = slots_per_req * slot_bytes + (blocks_per_req * per_block if blocks_matter else 0)
    null = slot_bytes + per_block  # slot 0 and block 0
    worst_blocks = max_num_seqs * blocks_per_req + 1
    if num_blocks is None and num_slots is None and budget_bytes < one_request + null:
        raise ConfigError(
            f"one request of max_model_len={max_model_len} tokens needs {_gib(one_request + null)} of cache "
            f"({blocks_per_req} KV blocks of {block_bytes} B, {slots_per_req} state slot(s) of {slot_bytes} B"
            f"{' and a state slot per block (cache mode ' + cache_mode + ')' if cache_mode != 'none' else ''}); "
            f"the budget leaves {_gib(budget_bytes)}: lower max_model_len, raise the memory budget, or use "
            f"a smaller dtype")
    if num_slots is None:
        # Slots for as many running requests as fit beside one full-length request's blocks.
        room = budget_bytes - null - (blocks_per_req * per_block if blocks_matter else 0)
        runnable = max_num_seqs if slot_bytes == 0 else max(1, min(max_num_seqs, room // (slots_per_req * slot_bytes)))
        base_slots = 1 + runnable * slots_per_req
    else:
        base_slots = num_slots
    if num_blocks is None:
        if not blocks_matter:
            num_blocks = worst_blocks  # bookkeeping only: no attention layer, no block-end states
        else:
            left = budget_bytes - base_slots * slot_bytes
            num_blocks = max(2, int(left // per_block)) if per_block else worst_blocks
            if cap_blocks:
                num_blocks = min(num_blocks, worst_blocks)
    if num_slots is None:
        num_slots = base_slots + (num_blocks if cache_mode != "none" else 0)
    if num_blocks < 2:
        raise ConfigError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
    if num_slots < 2:
        raise ConfigError(f"num_slots={num_slots} must be >= 2 (slot 0 is the null slot)")
    running_slots = (num_slots - 1 - (num_blocks if cache_mode != "none" else 0)) // slots_per_req
    concurrency = float(running_slots) if slot_bytes else float(max_num_seqs)
    if blocks_matter:
        concurrency = min(concurrency, (num_blocks - 1) / blocks_per_req)
    cache_bytes = num_blocks * block_bytes + num_slots * slot_bytes
    return PoolSizes(num_blocks, num_slots, block_bytes, slot_bytes, round(concurrency, 2), cache_bytes)


def _gib(n: int) -> str:
    return f"{n / GIB:.3f} GiB ({n} B)"


def param_bytes(tree) -> int:
    """Bytes of every array (or ``ShapeDtypeStruct``) leaf."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree)
               if hasattr(a, "shape"))


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

    def to_json(self) -> dict:
        """The keys other tools read (see ``python -m jaxmamba plan --json``)."""
        keys = ("target", "weight_bytes", "num_blocks", "num_slots", "max_concurrency", "max_model_len",
                "budget_bytes", "device_memory_bytes", "block_bytes", "slot_bytes", "device_tables_bytes",
                "mean_context", "num_programs", "compile_wall_s", "lowering_s", "backend_compile_s")
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
        if self.kernels:
            lines += ["", f"{'Pallas kernel':<48}{'registers':>10}{'spill B':>9}{'shared B':>10}"]
            for k in self.kernels:
                lines.append(f"{k.name:<48}{_opt(k.registers):>10}{_opt(k.spill_bytes):>9}{k.shared_bytes:>10}")
        lines += ["", f"KV blocks {self.num_blocks - 1} x {self.block_bytes} B, state slots {self.num_slots - 1} x "
                      f"{self.slot_bytes} B; maximum concurrency for {self.max_model_len} tokens per request: "
                      f"{self.max_concurrency:.2f}x",
                  f"compiled {self.num_programs} programs in {self.compile_wall_s:.1f} s (lowering "
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
    from jaxmamba.weights import _resolve_dtype

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
    from flax import nnx

    from jaxmamba import aot
    from jaxmamba.engine.block_table import device_tables_bytes
    from jaxmamba.model import HybridForCausalLM
    from jaxmamba.steps import engine_buckets

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
            f"{e}. On {target}: {gpu_memory_utilization} x {_gib(device_memory)} - weights {_gib(weight_bytes)} - "
            f"the largest bucket's temporaries {_gib(temp)} (T={largest.num_tokens}, R={largest.num_reqs}) "
            f"- the block and state-index tables {_gib(table_bytes)} = {_gib(budget)}") from None
    steps = compile_at(pools)
    builds.append(steps.build_stats)
    max_temp = max(m.temp_bytes for m in steps.memory.values())
    if on_gpu and max_temp > temp:
        budget = int(gpu_memory_utilization * device_memory) - weight_bytes - max_temp - table_bytes
        pools = size_pools(budget, cfg, **sizing)
        steps = compile_at(pools)
        builds.append(steps.build_stats)
    result = Plan(target=target, device_memory_bytes=device_memory, budget_bytes=budget, weight_bytes=weight_bytes,
                  device_tables_bytes=table_bytes,
                  max_model_len=max_model_len, num_blocks=pools.num_blocks, num_slots=pools.num_slots,
                  block_bytes=pools.block_bytes, slot_bytes=pools.slot_bytes, max_concurrency=pools.max_concurrency,
                  num_programs=sum(b.num_compiled + b.num_restored for b in builds),
                  compile_wall_s=sum(b.wall_s for b in builds), lowering_s=sum(b.lowering_s for b in builds),
                  backend_compile_s=sum(b.backend_compile_s for b in builds))
    result.mean_context = mean_context or max(max_model_len // 2, 1)
    caches = abstract_caches(cfg, pools, block_size=block_size, num_spec=num_speculative_tokens, dtype=dt,
                             ssm_dtype=ssm_dt)
    for bucket in steps.buckets:
        m = steps.memory[bucket]
        result.buckets.append(BucketPlan(bucket.num_tokens, bucket.num_reqs, bucket.decode_only,
                                         bucket.num_prefills, m.temp_bytes,
                                         m.argument_bytes, m.output_bytes, m.alias_bytes, steps.num_programs(bucket),
                                         **decode_traffic(steps, bucket, caches, cfg, result.mean_context, dt,
                                                          ssm_dt, weight_bytes)))
    seen = {}
    for kernels in steps.kernels.values():
        for k in kernels:
            if k.pallas:
                prev = seen.get(k.name)
                # The same kernel in several buckets: keep the worst case.
                if prev is None or (k.registers or 0, k.shared_bytes) > (prev.registers or 0, prev.shared_bytes):
                    seen[k.name] = KernelPlan(k.name, k.registers, k.spill_bytes, k.shared_bytes)
    result.kernels = sorted(seen.values(), key=lambda k: k.name)
    return result


def decode_traffic(steps, bucket, caches, cfg: HybridConfig, mean_context: int, dtype, ssm_dtype,
                   weights: int) -> dict:
    """``BucketPlan``'s traffic fields of a decode bucket of one token a row (empty for the others);
    ``caches``: the abstract caches ``steps`` was compiled with."""
    from jaxmamba.hlo_traffic import analyze
    from jaxmamba.roofline import cache_touched_bytes, ideal_decode_bytes

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


def abstract_caches(cfg: HybridConfig, pools: PoolSizes, *, block_size: int, num_spec: int, dtype, ssm_dtype):
    """``StateCaches`` of ``ShapeDtypeStruct``s of ``pools``' sizes (nothing allocated)."""
    from jaxmamba.cache import StateCaches

    dt = jnp.dtype(dtype)
    conv, ssm = state_shapes(cfg, 1, num_spec)
    kv = kv_cache_shape(pools.num_blocks, block_size, max(cfg.num_key_value_heads, 1), max(cfg.head_dim, 1))
    return StateCaches(
        conv=tuple(jax.ShapeDtypeStruct((pools.num_slots, *conv), dt) for _ in cfg.mamba_layer_ids),
        ssm=tuple(jax.ShapeDtypeStruct((pools.num_slots, *ssm), jnp.dtype(ssm_dtype)) for _ in cfg.mamba_layer_ids),
        kv=tuple(jax.ShapeDtypeStruct(kv, dt) for _ in cfg.attention_layer_ids))


def compile_buckets(model, pools: PoolSizes, buckets, *, block_size: int, max_model_len: int, cache_mode: str,
                    num_spec: int, enable_caching: bool, ssm_dtype, backend: str, target: str | None = None,
                    on_compiled=None, num_scheduler_steps: int = 1, progress=None, executable_cache=None,
                    sampling_variants: str = "auto"):
    """``CompiledSteps`` of ``model`` (real or abstract) over abstract caches of ``pools``' sizes: nothing is
    allocated. ``target``: a GPU target of ``jaxmamba.aot``, else this machine's default device.
    ``executable_cache``: restore (and keep) the programs there (``compile_cache.ExecutableCache``)."""
    from jaxmamba.engine.prefix_cache import PrefixCacheManager
    from jaxmamba.engine.runner import ModelRunner

    cfg = model.cfg
    caches = abstract_caches(cfg, pools, block_size=block_size, num_spec=num_spec, dtype=model.dtype,
                             ssm_dtype=ssm_dtype)
    manager = PrefixCacheManager(
        pools.num_blocks, pools.num_slots, block_size, cache_mode, num_spec,
        has_attention=bool(cfg.attention_layer_ids), has_mamba=bool(cfg.mamba_layer_ids),
        max_model_len=max_model_len, mamba_chunk_size=cfg.mamba_chunk_size, enable_caching=enable_caching)
    runner = ModelRunner(model, caches, manager, buckets=tuple(buckets), max_model_len=max_model_len,
                         num_slots=pools.num_slots, num_blocks=pools.num_blocks, backend=backend, target=target,
                         on_compiled=on_compiled, num_scheduler_steps=num_scheduler_steps, progress=progress,
                         executable_cache=executable_cache, sampling_variants=sampling_variants)
    return runner.steps


def largest_bucket_temp_bytes(model, buckets, sizing: dict, *, backend: str, enable_caching: bool = False,
                              target: str | None = None, on_compiled=None, progress=None, builds=None,
                              executable_cache=None):
    """``(largest bucket, its step temporaries in bytes)``, compiled at small abstract pools: the step's
    temporaries do not depend on the pool sizes (the caches are donated arguments), so this is what the
    pools must leave room for. ``sizing``: ``size_pools``' keyword arguments; ``builds``: a list that gets the
    compile's ``program_builder.BuildStats``."""
    largest = largest_bucket(buckets)
    steps = compile_buckets(model, probe_pools(model.cfg, **sizing), (largest,), block_size=sizing["block_size"],
                            max_model_len=sizing["max_model_len"], cache_mode=sizing["cache_mode"],
                            num_spec=sizing.get("num_spec", 0), enable_caching=enable_caching,
                            ssm_dtype=sizing["ssm_dtype"], backend=backend, target=target, on_compiled=on_compiled,
                            progress=progress, executable_cache=executable_cache)
    if builds is not None:
        builds.append(steps.build_stats)
    return largest, steps.memory[largest].temp_bytes


def gpu_cache_budget(model, buckets, utilization: float, backend: str, sizing: dict, tp_size: int = 1,
                     executable_cache=None) -> int:
    """Cache bytes on the GPU jax runs on, as vLLM's start-up profile but from XLA's buffer assignment
    instead of a dummy run: ``utilization`` x device memory - weights - the largest bucket's temporaries
    - the persistent device block and state-index tables (``engine.block_table.device_tables_bytes``;
    replicated, so whole on every rank). With tensor parallelism the single-device temporaries are used: an upper bound of
    one rank's. ``executable_cache``: where the probe's program is restored from (a warm start compiles nothing)."""
    from flax import nnx

    from jaxmamba import aot
    from jaxmamba.engine.block_table import device_tables_bytes

    device = jax.devices()[0]
    limit = int((device.memory_stats() or {}).get("bytes_limit", 0))
    known = [aot.get_target(n) for n in aot.target_names()]
    total = next((t.memory_bytes for t in known if t.description in device.device_kind), limit)
    _, temp = largest_bucket_temp_bytes(model, buckets, sizing, backend=backend, executable_cache=executable_cache)
    weights = param_bytes(nnx.state(model, nnx.Param)) // tp_size
    table = device_tables_bytes(max(b.num_reqs for b in buckets), sizing["max_model_len"], sizing["block_size"],
                                sizing.get("cache_mode", "none"), sizing.get("num_spec", 0))
    usable = min(int(utilization * total), limit) if limit else int(utilization * total)
    return usable - weights - temp - table


def largest_bucket(buckets):
    """The bucket whose step needs the most temporaries: the most tokens, mixed before decode, most prefill rows."""
    return max(buckets, key=lambda b: (b.num_tokens, b.num_reqs, not b.decode_only, b.num_prefills))


def probe_pools(cfg: HybridConfig, **sizing) -> PoolSizes:
    """Small pools for measuring a step's temporaries (which do not depend on the pool sizes)."""
    sizing = {**sizing, "max_num_seqs": 1, "cap_blocks": True, "num_blocks": None, "num_slots": None}
    return size_pools(1 << 62, cfg, **sizing)


def resolve_kernel_backend(kernel_backend: str, *, on_gpu: bool | None = None) -> str:
    """``"auto"``: Pallas where the platform is a GPU, the plain-JAX reference on the CPU."""
    if kernel_backend == "auto":
        if on_gpu is None:
            on_gpu = jax.default_backend() == "gpu"
        return "pallas" if on_gpu else "reference"
    if kernel_backend not in ("reference", "pallas"):
        raise ConfigError(f"kernel_backend={kernel_backend!r} must be 'auto', 'reference' or 'pallas'")
    return kernel_backend


def write_json(result: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_json(), indent=1, default=lambda o: np.asarray(o).tolist()) + "\n")
