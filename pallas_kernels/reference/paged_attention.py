"""Paged attention over vLLM's KV layout (plain JAX), and the plans its kernels share.

Token ``t`` of row ``r`` at position ``p`` attends keys ``0 .. p`` of its row through ``block_table[r]``
(or ``block_table[row_map[r]]``); masked keys never reach it and cost follows the real context.
Details: docs/architecture.md, "Paged attention".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmamba.errors import ConfigError, MetadataError
from pallas_kernels.reference.common import check_query_start_loc, concrete, shape_error

__all__ = [
    "check_paged_attention_args",
    "paged_attention_reference",
    "token_rows_and_context",
    "validate_paged_attention_indices",
]

#: Masked scores: finite (``-inf - -inf`` is NaN in the running maximum), far below any real score.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_paged_attention_args(q, kv, block_table, query_start_loc, positions,
                               row_map=None) -> tuple[int, int, int, int, int]:
    """Shapes of a paged-attention call: ``(T, Hq, Hkv, d, block_size)``; raises on a mismatch."""
    if q.ndim != 3:
        raise shape_error(f"q must be [T, Hq, head_dim], got shape {q.shape}")
    t, hq, d = q.shape
    if kv.ndim != 5 or kv.shape[0] != 2 or kv.shape[4] != d:
        raise shape_error(f"kv must be [2, num_blocks, block_size, kv_heads, {d}], got shape {kv.shape}")
    _, _, bs, hkv, _ = kv.shape
    if hq % hkv:
        raise ConfigError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if block_table.ndim != 2:
        raise shape_error(f"block_table must be [R, blocks_per_row], got shape {block_table.shape}")
    r = block_table.shape[0]
    if row_map is not None:
        if row_map.ndim != 1:
            raise shape_error(f"row_map must be [R] (one block-table row per batch row), got shape {row_map.shape}")
        r = row_map.shape[0]
    if query_start_loc.shape != (r + 1,):
        raise shape_error(f"query_start_loc must be [{r + 1}] (rows + 1), got shape {query_start_loc.shape}")
    if positions.shape != (t,):
        raise shape_error(f"positions must be [{t}] (one per token), got shape {positions.shape}")
    return t, hq, hkv, d, bs


def validate_paged_attention_indices(kv, block_table, query_start_loc, positions) -> None:
    """Raise ``MetadataError`` for concrete index arrays that would address outside the cache.

    Under ``jit`` (traced arrays) nothing is checked here: the metadata builders validate.
    """
    t = positions.shape[0]
    check_query_start_loc("query_start_loc", query_start_loc, t)
    num_blocks, bs = kv.shape[1], kv.shape[2]
    bt = concrete(block_table)
    if bt is not None and ((bt < 0) | (bt >= num_blocks)).any():
        bad = tuple(int(i) for i in np.argwhere((bt < 0) | (bt >= num_blocks))[0])
        raise MetadataError(f"block_table{list(bad)} = {int(bt[bad])} is outside [0, {num_blocks}) (num_blocks)")
    pos, qsl = concrete(positions), concrete(query_start_loc)
    if pos is not None and qsl is not None:
        real = np.arange(t) < int(qsl[-1])
        limit = block_table.shape[1] * bs
        bad = real & ((pos < 0) | (pos >= limit))
        if bad.any():
            i = int(np.argmax(bad))
            raise MetadataError(f"positions[{i}] = {int(pos[i])} is outside [0, {limit}) (blocks_per_row * block_size)")


def token_rows_and_context(query_start_loc, positions):
    """Row of each packed token and how many keys it sees: ``(row int32[T], context int32[T])``.

    ``context = position + 1`` for real tokens, 0 for padding tokens (past
    ``query_start_loc[-1]``); ``row`` is clipped into ``[0, R)`` so it is always a
    valid block-table row (padding reads nothing from it).
    """
    t = positions.shape[0]
    r = query_start_loc.shape[0] - 1
    tok = jnp.arange(t, dtype=jnp.int32)
    # Compare-all for small batches (every decode bucket): the default binary search is a while loop of
    # ~log2(R) trips, each a handful of XLA CPU thunks; [T, R] comparisons are one fusion.
    method = "compare_all" if t * r <= 1 << 16 else "scan"
    row = jnp.searchsorted(query_start_loc[1:], tok, side="right", method=method).astype(jnp.int32)
    real = tok < query_start_loc[r]
    context = jnp.where(real, positions.astype(jnp.int32) + 1, 0)
    return jnp.clip(row, 0, r - 1), context


def paged_attention_reference(
    q: jax.Array,
    kv: jax.Array,
    block_table: jax.Array,
    query_start_loc: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    row_map=None,
    kv_tokens_per_step: int = 64,
    interpret=None,
    **unused_block_sizes,
) -> jax.Array:
    """Causal attention of each packed token over its row's paged context.

    Args:
      q: ``[T, Hq, d]`` queries (this step's tokens, packed by row).
      kv: ``[2, num_blocks, block_size, Hkv, d]`` paged K/V, already holding this step's keys.
      block_table: ``int32[R, B]`` block ids per row (0, the null block, past a row's last block);
        with ``row_map``, ``int32[N, B]`` read at row ``row_map[r]`` for batch row ``r``.
      query_start_loc: ``int32[R+1]`` token offset of each row; padded rows repeat the total.
      positions: ``int32[T]`` absolute position of each token (anything for padding tokens).
      scale: softmax scale (usually ``d ** -0.5``).
      kv_tokens_per_step: keys per loop step, rounded to whole blocks (memory vs loop overhead).
      interpret, unused_block_sizes: accepted and ignored (the kernels' calling convention).

    Returns:
      ``[T, Hq, d]`` in ``q.dtype``; 0 for padding tokens. Scores and the softmax are float32,
      probabilities are cast to the value dtype for the second product (as the kernels).
    """
    del interpret, unused_block_sizes
    t, hq, hkv, d, bs = check_paged_attention_args(q, kv, block_table, query_start_loc, positions, row_map)
    validate_paged_attention_indices(kv, block_table, query_start_loc, positions)
    block_table, query_start_loc, positions = (jnp.asarray(a, jnp.int32) for a in (block_table, query_start_loc,
                                                                                  positions))
    g = hq // hkv
    num_cols = block_table.shape[1]
    pages = max(1, min(num_cols, -(-int(kv_tokens_per_step) // bs)))
    step = pages * bs
    row, context = token_rows_and_context(query_start_loc, positions)
    if row_map is not None:
        row = jnp.asarray(row_map, jnp.int32)[row]
    qg = q.reshape(t, hkv, g, d)
    f32 = jnp.float32
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(i, carry):
        m, l, acc = carry  # [T, Hkv, G], [T, Hkv, G], [T, Hkv, G, d]
        cols = jnp.minimum(i * pages + jnp.arange(pages), num_cols - 1)
        blocks = jnp.clip(block_table[row[:, None], cols[None, :]], 0, kv.shape[1] - 1)  # [T, pages]
        # Heads before keys ([T, Hkv, step, d]): the dots' batch axes lead, so XLA CPU copies the
        # gathered blocks once in that order instead of transposing the keys to [T, Hkv, d, step]
        # (~15 us of a tiny-model decode step).
        keys = jnp.swapaxes(kv[0][blocks].reshape(t, step, hkv, d), 1, 2)
        values = jnp.swapaxes(kv[1][blocks].reshape(t, step, hkv, d), 1, 2)
        visible = (i * step + jnp.arange(step))[None, :] < context[:, None]  # [T, step]
        s = jnp.einsum("tkgd,tksd->tkgs", qg, keys, preferred_element_type=f32, precision=precision) * scale
        s = jnp.where(visible[:, None, None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(visible[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        values = jnp.where(visible[:, None, :, None], values, 0)
        pv = jnp.einsum("tkgs,tksd->tkgd", p.astype(values.dtype), values, preferred_element_type=f32,
                        precision=precision)
        return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

    # The loop bound is traced: the batch's longest real context, never the table width.
    num_steps = (jnp.max(context) + step - 1) // step
    init = (jnp.full((t, hkv, g), MASK_VALUE, f32), jnp.zeros((t, hkv, g), f32), jnp.zeros((t, hkv, g, d), f32))
    _, l, acc = lax.fori_loop(0, num_steps, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(t, hq, d).astype(q.dtype)
