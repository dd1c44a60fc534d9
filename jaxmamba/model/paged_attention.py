"""Paged attention for the serving step, over vLLM's KV layout.

KV cache of one layer: ``(2, num_blocks, block_size, kv_heads, head_dim)``, K
then V. New keys/values are written at ``slot_mapping`` (``-1`` = padding, not
written), then every token attends over its request's blocks up to its own
position, through the dispatched kernels (``pallas_kernels.paged_attention_decode``
/ ``paged_attention_varlen``, or their plain-JAX reference). Block 0 is the null
block: padded block-table entries point there and are masked out by position, so
nothing from another request can leak in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch


def write_kv(kv: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter ``k, v [T, kv_heads, d]`` into ``kv`` at ``slot_mapping [T]`` (-1 dropped).

    Indexed by (block, offset) on the cache's own shape: scattering into a reshaped
    ``[2, num_blocks * block_size, ...]`` view made XLA copy the whole layer cache into a
    temporary whenever the head axis is 1 (the reshape is then no free bitcast; jax 0.11 keeps the
    copy inside the step: +67 MB per layer for a 128k-token pool of the tiny model, one KV head),
    where this form updates the donated cache in place."""
    nb, bs = kv.shape[1], kv.shape[2]
    idx = jnp.where(slot_mapping >= 0, slot_mapping, nb * bs)  # out of range -> dropped
    block, offset = idx // bs, idx % bs
    kv = kv.at[0, block, offset].set(k.astype(kv.dtype), mode="drop")
    return kv.at[1, block, offset].set(v.astype(kv.dtype), mode="drop")


def paged_attention(
    q: jax.Array,  # [T, Hq, d]
    kv: jax.Array,  # [2, num_blocks, block_size, Hkv, d] (already holding this step's keys)
    block_table: jax.Array,  # int32[R, B]
    query_start_loc: jax.Array,  # int32[R+1]
    positions: jax.Array,  # int32[T]
    scale: float,
    *,
    backend: str = "reference",
    interpret: bool | None = None,
    decode_only: bool = False,
    row_map: jax.Array | None = None,  # int32[R]
) -> jax.Array:
    """Causal attention of each token over its row's cached context: ``[T, Hq, d]``.

    Token ``t`` sees keys ``0 .. positions[t]`` of its row; padding tokens get 0.
    ``decode_only`` (a pure-decode bucket, trace-time) picks the flash-decoding
    kernel, else the varlen kernel; ``backend="reference"`` runs the plain-JAX
    block-by-block reference for both. Cost follows the batch's real contexts,
    never ``max_model_len`` (see ``pallas_kernels.reference.paged_attention``).
    ``interpret``: the Pallas interpreter (None: when jax's default backend is the CPU; False when
    compiling for a GPU target).
    ``row_map``: batch row ``r`` reads ``block_table[row_map[r]]``, ``block_table`` then being the engine's
    persistent ``int32[N, B]`` table (read in place: no ``[R, B]`` copy).
    """
    op = dispatch.paged_attention_decode if decode_only else dispatch.paged_attention_varlen
    extra = {} if row_map is None else {"row_map": row_map}
    return op(q, kv, block_table, query_start_loc, positions, scale=scale, backend=backend, interpret=interpret,
              **extra)
