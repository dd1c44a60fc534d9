"""Paged attention for decode steps (flash-decoding), Triton-Pallas, over vLLM's KV layout.

One program per (query token, KV head, context split). The program holds the
query heads of its KV head together (GQA: ``[G, d]``, padded to ``block_h`` rows
so ``dot`` has at least 16 of them) and walks its share of the token's real
context, ``block_k`` keys per step, with an online softmax. The context of a
token (``position + 1`` keys of its row) is cut into ``num_splits`` equal runs of
tiles, so a long context is spread over programs while a short one leaves the
later splits empty (they only write an empty partial); the loop bound is each
token's own context, never the table width. A small plain-JAX combine merges
the splits' partials ``(acc, max, sum)``.

Keys are gathered tile-wise from the paged layout: key position ``j`` of row
``r`` sits at ``kv[., block_table[r, j // block_size], j % block_size, h, :]``, so
``block_k`` is independent of ``block_size`` (as vLLM's ``unified_attention``
tiles). One token per program covers speculative decode too (a row's 1 + k
tokens each see their own prefix).

Semantics (masking, padding tokens, ``0 * NaN``) are those of
``pallas_kernels.reference.paged_attention``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxmamba.errors import ConfigError
from pallas_kernels.reference.common import next_pow2
from pallas_kernels.reference.paged_attention import (
    MASK_VALUE,
    check_paged_attention_args,
    token_rows_and_context,
    validate_paged_attention_indices,
)

__all__ = ["combine_splits", "default_block_sizes", "paged_attention_decode"]

_F32 = jnp.float32


#: Programs a decode launch aims for (about twice an H100's 132 SMs): a token's context is split over more
#: programs only while tokens x KV heads leave the GPU short of them. Every split writes a float32 partial
#: ``[block_h, d]`` whatever its context, which the combine reads back: at 128 tokens x 8 KV heads, 8 splits
#: moved 135 MB of partials where the step's KV reads at a 96-token context were 50 MB.
TARGET_PROGRAMS = 256
MAX_SPLITS = 8


def default_block_sizes(head_dim: int, block_size: int, num_tokens: int | None = None,
                        num_kv_heads: int | None = None) -> dict:
    """Launch table (no autotuning): ``dict(block_k=..., num_splits=..., num_warps=..., num_stages=...)``;
    ``num_splits`` fills ``TARGET_PROGRAMS`` programs for ``num_tokens`` x ``num_kv_heads`` (a power of 2,
    1 to ``MAX_SPLITS``; ``MAX_SPLITS`` when either is not given)."""
    del block_size
    splits = MAX_SPLITS
    if num_tokens is not None and num_kv_heads is not None:
        per_token = max(TARGET_PROGRAMS // max(num_tokens * num_kv_heads, 1), 1)
        splits = min(MAX_SPLITS, 1 << (per_token.bit_length() - 1))
    return dict(block_k=64 if head_dim <= 64 else 32, num_splits=splits, num_warps=4, num_stages=2)


def _check_pow2(name: str, v: int, least: int = 16) -> None:
    if v < least or v & (v - 1):
        raise ConfigError(f"{name}={v} must be a power of 2 >= {least} (Triton tiles)")


def _mm(a, b, contract):
    """2-D matmul with float32 accumulation (exact float32 products when the operands are float32)."""
    precision = lax.Precision.HIGHEST if a.dtype == _F32 else None
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=_F32, precision=precision)


def key_tile(kv_ref, bt_ref, row, start, h, *, block_k, block_size, num_cols, context):
    """K and V tiles ``[block_k, d]`` of keys ``start .. start + block_k`` of ``row`` and their validity.

    Keys at or past ``context`` read a clamped (in-range) address and come back with
    value 0, whatever that slot holds.
    """
    pos = start + jnp.arange(block_k)
    valid = pos < context
    blocks = bt_ref[row, jnp.minimum(pos // block_size, num_cols - 1)]  # [block_k]
    # Under jit the table is not validated: an out-of-range id must still never leave the cache.
    blocks = jnp.clip(blocks, 0, kv_ref.shape[1] - 1)
    offsets = pos % block_size
    # Fully broadcast index arrays (no slices beside them): the form Triton-Pallas gathers.
    blocks, offsets = blocks[:, None], offsets[:, None]
    cols = jnp.arange(kv_ref.shape[-1])[None, :]
    k = kv_ref[0, blocks, offsets, h, cols]
    v = jnp.where(valid[:, None], kv_ref[1, blocks, offsets, h, cols], 0)
    return pos, valid, k, v


def online_softmax_step(q, k, v, visible, carry, scale):
    """One tile of the online softmax: ``carry = (acc [M, d], m [M], l [M])`` float32."""
    acc, m, l = carry
    s = _mm(q, k, ((1,), (1,))) * scale  # [M, block_k]
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    acc = alpha[:, None] * acc + _mm(p.astype(v.dtype), v, ((1,), (0,)))
    return acc, m_new, alpha * l + p.sum(axis=1)


def _decode_kernel(row_ref, ctx_ref, bt_ref, q_ref, kv_ref, acc_ref, m_ref, l_ref, *, scale, block_k, block_size,
                   num_cols, num_splits):
    # row_ref, ctx_ref: int32[T]; bt_ref: int32[R, B]; q_ref: [T, Hkv, block_h, d]
    # kv_ref: [2, num_blocks, block_size, Hkv, d]
    # acc_ref: f32[T, Hkv, S, block_h, d]; m_ref, l_ref: f32[T, Hkv, S, block_h]
    t, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = row_ref[t]
    context = ctx_ref[t]
    tiles = pl.cdiv(context, block_k)
    per_split = pl.cdiv(tiles, num_splits)
    first = split * per_split
    last = jnp.minimum(first + per_split, tiles)
    q = q_ref[t, h]  # [block_h, d]
    block_h, d = q.shape

    def body(i, carry):
        _, valid, k, v = key_tile(kv_ref, bt_ref, row, i * block_k, h, block_k=block_k, block_size=block_size,
                                  num_cols=num_cols, context=context)
        return online_softmax_step(q, k, v, valid[None, :], carry, scale)

    init = (jnp.zeros((block_h, d), _F32), jnp.full((block_h,), MASK_VALUE, _F32), jnp.zeros((block_h,), _F32))
    acc, m, l = lax.fori_loop(first, last, body, init)
    acc_ref[t, h, split] = acc
    m_ref[t, h, split] = m
    l_ref[t, h, split] = l


def combine_splits(acc, m, l):
    """Merge per-split partials: ``acc [..., S, M, d]``, ``m, l [..., S, M]`` -> ``[..., M, d]`` float32.

    Empty splits (``l == 0``) weigh nothing; a token with no keys at all gets 0.
    """
    m_all = m.max(axis=-2, keepdims=True)
    w = jnp.where(l > 0, jnp.exp(m - m_all), 0.0)  # [..., S, M]
    total = (w * l).sum(axis=-2)
    out = (w[..., None] * acc).sum(axis=-3)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_splits", "num_warps", "num_stages", "interpret"))
def _decode_jit(q, kv, block_table, query_start_loc, positions, row_map, *, scale, block_k, num_splits, num_warps,
                num_stages, interpret):
    t, hq, d = q.shape
    _, _, bs, hkv, _ = kv.shape
    g = hq // hkv
    block_h = max(16, next_pow2(g))
    row, context = token_rows_and_context(query_start_loc, positions)
    if row_map is not None:
        row = row_map.astype(jnp.int32)[row]
    qg = jnp.pad(q.reshape(t, hkv, g, d), ((0, 0), (0, 0), (0, block_h - g), (0, 0)))
    kernel = functools.partial(_decode_kernel, scale=scale, block_k=block_k, block_size=bs,
                               num_cols=block_table.shape[1], num_splits=num_splits)
    acc, m, l = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((t, hkv, num_splits, block_h, d), _F32),
                   jax.ShapeDtypeStruct((t, hkv, num_splits, block_h), _F32),
                   jax.ShapeDtypeStruct((t, hkv, num_splits, block_h), _F32)),
        grid=(t, hkv, num_splits),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_decode_h{block_h}_d{d}_bs{bs}_bk{block_k}",
    )(row, context, block_table.astype(jnp.int32), qg, kv)
    out = combine_splits(acc, m, l)[:, :, :g]  # [T, Hkv, G, d]
    return out.reshape(t, hq, d).astype(q.dtype)


def paged_attention_decode(
    q,
    kv,
    block_table,
    query_start_loc,
    positions,
    *,
    scale: float,
    row_map=None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
):
    """Flash-decoding paged attention: each token over keys ``0 .. position`` of its row.

    Args:
      q: ``[T, Hq, d]`` (``d`` a power of 2 >= 16); kv: ``[2, num_blocks, block_size, Hkv, d]``.
      block_table: ``int32[R, B]``; query_start_loc: ``int32[R+1]``; positions: ``int32[T]``.
      scale: softmax scale.
      row_map: ``int32[R]`` or None: batch row ``r`` reads ``block_table[row_map[r]]`` (then any rows).
      block_k: keys per tile (power of 2 >= 16, any multiple or fraction of ``block_size``).
      num_splits: programs sharing one token's context (flash-decoding splits).
      num_warps, num_stages: Triton launch parameters; interpret: run in the Pallas interpreter.

    Returns:
      ``[T, Hq, d]`` in ``q.dtype``; padding tokens get 0.
    """
    _, _, _, d, bs = check_paged_attention_args(q, kv, block_table, query_start_loc, positions, row_map)
    validate_paged_attention_indices(kv, block_table, query_start_loc, positions)
    dflt = default_block_sizes(d, bs, q.shape[0], kv.shape[3])
    block_k = int(dflt["block_k"] if block_k is None else block_k)
    num_splits = int(dflt["num_splits"] if num_splits is None else num_splits)
    _check_pow2("head_dim", d)
    _check_pow2("block_k", block_k)
    if num_splits < 1:
        raise ConfigError(f"num_splits={num_splits} must be >= 1")
    return _decode_jit(q, kv, block_table, query_start_loc, positions, row_map, scale=float(scale), block_k=block_k,
                       num_splits=num_splits, num_warps=int(dflt["num_warps"] if num_warps is None else num_warps),
                       num_stages=int(dflt["num_stages"] if num_stages is None else num_stages),
                       interpret=bool(interpret))
