"""Paged attention for the serving step (plain JAX), over vLLM's KV layout.

KV cache of one layer: ``(2, num_blocks, block_size, kv_heads, head_dim)``, K
then V. New keys/values are written at ``slot_mapping`` (``-1`` = padding, not
written), then every token attends over its request's blocks up to its own
position. Block 0 is the null block: padded block-table entries point there and
are masked out by position, so nothing from another request can leak in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(kv: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter ``k, v [T, kv_heads, d]`` into ``kv`` at ``slot_mapping [T]`` (-1 dropped)."""
    _, nb, bs, hkv, d = kv.shape
    flat = kv.reshape(2, nb * bs, hkv, d)
    idx = jnp.where(slot_mapping >= 0, slot_mapping, nb * bs)  # out of range -> dropped
    flat = flat.at[0, idx].set(k.astype(kv.dtype), mode="drop")
    flat = flat.at[1, idx].set(v.astype(kv.dtype), mode="drop")
    return flat.reshape(kv.shape)


def paged_attention(
    q: jax.Array,  # [T, Hq, d]
    kv: jax.Array,  # [2, num_blocks, block_size, Hkv, d] (already holding this step's keys)
    block_table: jax.Array,  # int32[R, B]
    query_start_loc: jax.Array,  # int32[R+1]
    positions: jax.Array,  # int32[T]
    scale: float,
) -> jax.Array:
    """Causal attention of each token over its row's cached context: ``[T, Hq, d]``."""
    t, hq, d = q.shape
    _, _, bs, hkv, _ = kv.shape
    r, b = block_table.shape
    # Row of each token; tokens past the real ones land in the last (padded) row.
    row = jnp.clip(jnp.searchsorted(query_start_loc[1:], jnp.arange(t), side="right"), 0, r - 1)
    keys = kv[0][block_table].reshape(r, b * bs, hkv, d)[row]  # [T, L, Hkv, d]
    values = kv[1][block_table].reshape(r, b * bs, hkv, d)[row]
    groups = hq // hkv
    qg = q.reshape(t, hkv, groups, d)
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, keys).astype(jnp.float32) * scale
    visible = jnp.arange(b * bs)[None, :] <= positions[:, None]  # [T, L]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    # 0 * NaN is NaN: zero what a token may not see, so garbage in the null block or in
    # another request's stale tail can never reach it.
    values = jnp.where(visible[:, :, None, None], values, 0)
    return jnp.einsum("tkgl,tlkd->tkgd", probs, values).reshape(t, hq, d)
