"""Caches in the TP layout: device ``r``'s shard of each cache array is vLLM's rank-``r`` page tensor. Placing a
TP=1 state on the mesh and back, and reading one rank's pages (what a NIXL READ of them returns)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmamba.cache import StateCaches, zero_caches
from jaxmamba.config import HybridConfig
from jaxmamba.errors import SlotError
from jaxmamba.layout import kv_cache_shape, state_shapes
from jaxmamba.parallel.distributed import device_put_global
from jaxmamba.parallel.params import take_layout
from jaxmamba.parallel.ranks import TP_AXIS, conv_channel_index, kv_head_index, mesh_tp_size, validate_tp


def cache_specs(cfg: HybridConfig) -> StateCaches:
    """``PartitionSpec``s of ``StateCaches`` in the TP layout (conv channels, ssm heads, KV heads)."""
    return StateCaches(
        conv=tuple(P(None, TP_AXIS, None) for _ in cfg.mamba_layer_ids),
        ssm=tuple(P(None, TP_AXIS, None, None) for _ in cfg.mamba_layer_ids),
        kv=tuple(P(None, None, None, TP_AXIS, None) for _ in cfg.attention_layer_ids),
    )


def cache_shardings(cfg: HybridConfig, mesh: Mesh) -> StateCaches:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(cfg), is_leaf=lambda x: isinstance(x, P))


def shard_caches(
    cfg: HybridConfig,
    mesh: Mesh,
    num_slots: int,
    num_blocks: int,
    block_size: int,
    num_spec: int = 0,
    dtype=jnp.float32,
    ssm_dtype=None,
) -> StateCaches:
    """Zero-filled ``StateCaches`` whose device-``r`` shards are vLLM's rank-``r`` pages.

    Global shapes: conv ``(num_slots, tp*conv_dim_local, K-1+num_spec)`` (rank-major
    ``[x_r|B_r|C_r]``), ssm ``(num_slots, H, P, N)``, kv ``(2, num_blocks, block_size,
    tp*kv_local, head_dim)``; device ``r`` holds ``layout.state_shapes(cfg, tp)`` /
    ``layout.kv_cache_shape(..., tp)`` per slot/block. Slot 0 and block 0 are null (as
    ``cache.allocate_caches``).
    """
    tp = mesh_tp_size(mesh)
    validate_tp(cfg, tp)
    conv_shape = ssm_shape = kv_shape = None
    if cfg.mamba_layer_ids:
        (cl, rows), (hl, p, n) = state_shapes(cfg, tp, num_spec=num_spec)
        conv_shape, ssm_shape = (num_slots, tp * cl, rows), (num_slots, tp * hl, p, n)
    if cfg.attention_layer_ids:
        _, nb, bs, kl, hd = kv_cache_shape(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, tp)
        kv_shape = (2, nb, bs, tp * kl, hd)
    return zero_caches(cfg, num_slots, num_blocks, conv_shape, ssm_shape, kv_shape, dtype=dtype,
                       ssm_dtype=ssm_dtype, out_shardings=cache_shardings(cfg, mesh))


def place_logical_caches(logical: StateCaches, cfg: HybridConfig, mesh: Mesh) -> StateCaches:
    """TP-layout caches (placed on ``mesh``) holding a TP=1 state: conv ``(slots, I+2GN, R)``,
    ssm ``(slots, H, P, N)``, kv ``(2, blocks, bs, K, hd)`` -> what each rank of a TP engine holds."""
    tp = mesh_tp_size(mesh)
    validate_tp(cfg, tp)
    conv_idx = conv_channel_index(cfg, tp) if cfg.mamba_layer_ids else None
    kv_idx = kv_head_index(cfg, tp) if cfg.attention_layer_ids else None
    sh = cache_shardings(cfg, mesh)
    conv = tuple(device_put_global(take_layout(np.asarray(c), conv_idx, 1), s)
                 for c, s in zip(logical.conv, sh.conv, strict=True))
    ssm = tuple(device_put_global(np.asarray(x), s) for x, s in zip(logical.ssm, sh.ssm, strict=True))
    kv = tuple(device_put_global(take_layout(np.asarray(x), kv_idx, 3), s) for x, s in zip(logical.kv, sh.kv, strict=True))
    return StateCaches(conv=conv, ssm=ssm, kv=kv)


def gather_logical_caches(caches: StateCaches, cfg: HybridConfig, tp_size: int) -> StateCaches:
    """Inverse of ``place_logical_caches`` (numpy): replicated channels/heads are read from the lowest rank."""

    def invert(a: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
        rows, first = np.unique(index, return_index=True)
        assert np.array_equal(rows, np.arange(rows.shape[0]))
        return np.take(a, first, axis=axis)

    conv_idx = conv_channel_index(cfg, tp_size) if cfg.mamba_layer_ids else None
    kv_idx = kv_head_index(cfg, tp_size) if cfg.attention_layer_ids else None
    return StateCaches(
        conv=tuple(invert(np.asarray(c), conv_idx, 1) for c in caches.conv),
        ssm=tuple(np.asarray(x) for x in caches.ssm),
        kv=tuple(invert(np.asarray(x), kv_idx, 3) for x in caches.kv),
    )


def rank_shard(array: jax.Array, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard of a TP-layout array, as numpy (the bytes that device holds).

    A replicated or single-device array is the whole array on every rank.
    """
    sharding = getattr(array, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        if rank != 0 and not (sharding is not None and sharding.is_fully_replicated):
            raise ValueError(f"rank {rank}: array is not sharded over a {TP_AXIS!r} mesh")
        return np.asarray(array)
    mesh = sharding.mesh
    tp = mesh_tp_size(mesh)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is out of range for tensor_parallel_size={tp}")
    axis_pos = mesh.axis_names.index(TP_AXIS)
    device = np.asarray(np.moveaxis(np.asarray(mesh.devices), axis_pos, 0)[rank], dtype=object).reshape(-1)[0]
    for shard in array.addressable_shards:
        if shard.device == device:
            return np.asarray(shard.data)
    raise ValueError(f"rank {rank}'s device {device} holds no addressable shard of this array")


def rank_pages(caches: StateCaches, rank: int) -> StateCaches:
    """Rank ``rank``'s caches as numpy: conv ``(slots, conv_dim_local, R)``, ssm ``(slots, H/tp, P, N)``,
    kv ``(2, blocks, bs, kv_local, hd)`` -- exactly vLLM's per-rank cache tensors."""
    return StateCaches(
        conv=tuple(rank_shard(c, rank) for c in caches.conv),
        ssm=tuple(rank_shard(s, rank) for s in caches.ssm),
        kv=tuple(rank_shard(k, rank) for k in caches.kv),
    )


def mamba_page_bytes(conv: np.ndarray, ssm: np.ndarray) -> np.ndarray:
    """``(slots, conv_bytes + ssm_bytes)`` uint8: each slot's vLLM ``MambaSpec`` page (DS conv, then ssm)."""
    slots = conv.shape[0]
    if ssm.shape[0] != slots:
        raise ValueError(f"conv has {slots} slots but ssm has {ssm.shape[0]}")
    conv_b = np.ascontiguousarray(conv).view(np.uint8).reshape(slots, -1)
    ssm_b = np.ascontiguousarray(ssm).view(np.uint8).reshape(slots, -1)
    return np.concatenate([conv_b, ssm_b], axis=1)


def gather_rank_page(caches: StateCaches, rank: int, mamba_layer: int, slot: int) -> np.ndarray:
    """One slot's page (uint8, unpadded) of Mamba layer ``mamba_layer`` (an index into ``caches.conv``)
    on rank ``rank``: the bytes a NIXL READ of that page would return."""
    conv = rank_shard(caches.conv[mamba_layer], rank)
    ssm = rank_shard(caches.ssm[mamba_layer], rank)
    if not 0 <= slot < conv.shape[0]:
        raise SlotError(f"slot {slot} is out of range [0, {conv.shape[0]})")
    return mamba_page_bytes(conv[slot : slot + 1], ssm[slot : slot + 1])[0]
