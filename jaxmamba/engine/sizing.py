"""Engine sizing: how many KV blocks and Mamba state slots fit, sized as vLLM does at start-up.

vLLM profiles a forward pass, then gives the KV cache what is left of ``gpu_memory_utilization`` x device
memory after weights and the peak activations. The peak is known without running anything: XLA's buffer
assignment of every compiled bucket (``temp_bytes``) is exact, and it is the same whether the step was
compiled for the local device or for a GPU target that is not here (``jaxmamba.aot``). So on a GPU

    budget = gpu_memory_utilization * device memory - weight bytes - max(bucket temp bytes)
             - persistent device table bytes

(the tables are the engine's device-resident attention block table and Mamba state-index table,
``engine.block_table.device_tables_bytes``: neither a cache nor a step temporary), and ``cpu_memory_gib``
of cache space on the CPU (vLLM CPU's ``VLLM_CPU_KVCACHE_SPACE``). ``size_pools`` turns a budget into KV
blocks and Mamba state slots; ``EngineCore`` and ``jaxmamba.plan`` (the report of ``python -m jaxmamba
plan``) both call it, so the plan is what the engine allocates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmamba import aot
from jaxmamba.cache import StateCaches
from jaxmamba.config import HybridConfig
from jaxmamba.engine.block_table import device_tables_bytes
from jaxmamba.engine.prefix_cache import PrefixCacheManager
from jaxmamba.engine.runner import ModelRunner
from jaxmamba.errors import ConfigError
from jaxmamba.layout import kv_cache_shape, state_shapes
from jaxmamba.metadata import CacheMode
from jaxmamba.metadata.checks import cdiv

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
    per_block = block_bytes + (slot_bytes if cache_mode != CacheMode.NONE else 0)
    blocks_matter = bool(cfg.attention_layer_ids) or cache_mode != CacheMode.NONE
    one_request = slots_per_req * slot_bytes + (blocks_per_req * per_block if blocks_matter else 0)
    null = slot_bytes + per_block  # slot 0 and block 0
    worst_blocks = max_num_seqs * blocks_per_req + 1
    if num_blocks is None and num_slots is None and budget_bytes < one_request + null:
        raise ConfigError(
            f"one request of max_model_len={max_model_len} tokens needs {format_gib(one_request + null)} of cache "
            f"({blocks_per_req} KV blocks of {block_bytes} B, {slots_per_req} state slot(s) of {slot_bytes} B"
            f"{' and a state slot per block (cache mode ' + cache_mode + ')' if cache_mode != CacheMode.NONE else ''}); "
            f"the budget leaves {format_gib(budget_bytes)}: lower max_model_len, raise the memory budget, or use "
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
        num_slots = base_slots + (num_blocks if cache_mode != CacheMode.NONE else 0)
    if num_blocks < 2:
        raise ConfigError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
    if num_slots < 2:
        raise ConfigError(f"num_slots={num_slots} must be >= 2 (slot 0 is the null slot)")
    running_slots = (num_slots - 1 - (num_blocks if cache_mode != CacheMode.NONE else 0)) // slots_per_req
    concurrency = float(running_slots) if slot_bytes else float(max_num_seqs)
    if blocks_matter:
        concurrency = min(concurrency, (num_blocks - 1) / blocks_per_req)
    cache_bytes = num_blocks * block_bytes + num_slots * slot_bytes
    return PoolSizes(num_blocks, num_slots, block_bytes, slot_bytes, round(concurrency, 2), cache_bytes)


def format_gib(n: int) -> str:
    return f"{n / GIB:.3f} GiB ({n} B)"


def param_bytes(tree) -> int:
    """Bytes of every array (or ``ShapeDtypeStruct``) leaf."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree)
               if hasattr(a, "shape"))


# ------------------------------------------------------------------------ bucket compile probes
def abstract_caches(cfg: HybridConfig, pools: PoolSizes, *, block_size: int, num_spec: int, dtype, ssm_dtype):
    """``StateCaches`` of ``ShapeDtypeStruct``s of ``pools``' sizes (nothing allocated)."""
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
                    sampling_variants: str = "auto", matmul_precision: str = "auto", restore: str = "background"):
    """``CompiledSteps`` of ``model`` (real or abstract) over abstract caches of ``pools``' sizes: nothing is
    allocated. ``target``: a GPU target of ``jaxmamba.aot``, else this machine's default device.
    ``executable_cache``: restore (and keep) the programs there (``compile_cache.ExecutableCache``); ``restore``:
    as ``CompiledSteps``' (``"background"``: a cached program, and its ``memory``, arrive after this returns)."""
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
                         executable_cache=executable_cache, sampling_variants=sampling_variants,
                         matmul_precision=matmul_precision, restore=restore)
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
                            progress=progress, executable_cache=executable_cache,
                            # Its temporaries are read now: a background restore (a warm start's) would not
                            # have put them in ``memory`` yet: a warm start on a GPU (gpu_cache_budget) raised KeyError.
                            restore="eager")
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
