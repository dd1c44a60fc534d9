"""Device state caches in vLLM's layouts.

Device side (``StateCaches``, a pytree donated into every step):

* per Mamba layer: ``conv`` ``(num_slots, conv_dim, K-1+num_spec)`` (DS layout,
  channels ``[x|B|C]``) and ``ssm`` ``(num_slots, H, P, N)``;
* per attention layer: ``kv`` ``(2, num_blocks, block_size, kv_heads, head_dim)``
  (K then V, as vLLM's FlashAttention backend).

Slot 0 of every Mamba array and block 0 of every KV array are *null*: never
handed out, the target of padded rows, and never read into a real row. Arrays
are created with zeros (``jnp.empty`` is uninitialised from jax 0.11 on).

The host-side pools that hand out slots and blocks are ``jaxmamba.engine.block_pool.BlockPool``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmamba.compile_cache import build_one
from jaxmamba.config import HybridConfig
from jaxmamba.errors import SlotError
from jaxmamba.layout import kv_cache_shape, state_shapes


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StateCaches:
    """Every layer's device state; tuples are indexed by Mamba layer / attention layer order."""

    conv: tuple[jax.Array, ...]  # per Mamba layer: (num_slots, conv_dim, K-1+num_spec)
    ssm: tuple[jax.Array, ...]  # per Mamba layer: (num_slots, H, P, N)
    kv: tuple[jax.Array, ...]  # per attention layer: (2, num_blocks, block_size, kv_heads, head_dim)


def allocate_caches(
    cfg: HybridConfig,
    *,
    num_slots: int,
    num_blocks: int,
    block_size: int,
    num_spec: int = 0,
    dtype=jnp.float32,
    ssm_dtype=None,
    executable_cache=None,
) -> StateCaches:
    """Zero-filled caches. ``num_slots``/``num_blocks`` include the null slot/block 0. ``executable_cache``: a
    ``compile_cache.ExecutableCache`` the allocating program is restored from (and kept in)."""
    conv_shape, ssm_shape = state_shapes(cfg, 1, num_spec=num_spec)
    kv_shape = kv_cache_shape(max(num_blocks, 1), block_size, max(cfg.num_key_value_heads, 1), max(cfg.head_dim, 1))
    return zero_caches(cfg, num_slots, num_blocks, (num_slots, *conv_shape), (num_slots, *ssm_shape), kv_shape,
                       dtype=dtype, ssm_dtype=ssm_dtype, executable_cache=executable_cache)


def zero_caches(cfg: HybridConfig, num_slots: int, num_blocks: int, conv_shape, ssm_shape, kv_shape, *,
                dtype=jnp.float32, ssm_dtype=None, out_shardings=None, executable_cache=None) -> StateCaches:
    """One zero-filled array per layer of the given global shapes (``allocate_caches`` and
    ``parallel.shard_caches``), created on device by one jitted call (``out_shardings``: where; without,
    restored from ``executable_cache`` where it holds the program)."""
    if num_slots < 2:
        raise SlotError(f"num_slots={num_slots} must be >= 2 (slot 0 is the null slot)")
    if cfg.attention_layer_ids and num_blocks < 2:
        raise SlotError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
    ssm_dtype = dtype if ssm_dtype is None else ssm_dtype

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def make():
        return StateCaches(
            conv=tuple(jnp.zeros(conv_shape, dtype) for _ in cfg.mamba_layer_ids),
            ssm=tuple(jnp.zeros(ssm_shape, ssm_dtype) for _ in cfg.mamba_layer_ids),
            kv=tuple(jnp.zeros(kv_shape, dtype) for _ in cfg.attention_layer_ids),
        )

    if out_shardings is not None or executable_cache is None:
        return make()
    description = {"program": "zero_caches", "conv": tuple(conv_shape), "ssm": tuple(ssm_shape), "kv": tuple(kv_shape),
                   "dtype": jnp.dtype(dtype).name, "ssm_dtype": jnp.dtype(ssm_dtype).name,
                   "mamba_layers": len(cfg.mamba_layer_ids), "attention_layers": len(cfg.attention_layer_ids)}
    return build_one(make.lower, cache=executable_cache, description=description)()
