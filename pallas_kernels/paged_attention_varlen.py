"""Paged attention for prefill and mixed steps (varlen, causal), Triton-Pallas, over vLLM's KV layout.

One program per (query block, KV head). A query block is up to ``block_q``
consecutive tokens of one row, taken with all the query heads of the KV head
(GQA: the tile has ``block_q * next_pow2(G)`` rows, so K/V tiles are read once
for the G heads) (rows are cut into blocks from their first token,
as vLLM's ``unified_attention``; the tokens past ``query_start_loc[-1]`` form one
more pseudo-row of padding that sees nothing). The program walks its row's keys
``block_k`` at a time up to the block's longest context (its last token's
position + 1) with an online softmax, each token masked causally to keys
``0 .. position``: prior chunks and prefix-cache hits are simply earlier keys of
the row, found through the block table. Loop bounds come from each block's real
positions, never from the table width.

The grid holds a static upper bound of query blocks, ``T // block_q + R + 1``
(each row wastes at most one partial block); programs past the real blocks
store nothing. The output is padded by ``block_q`` tokens and to ``next_pow2(G)``
heads per KV head so a partial tile's masked lanes never need a clamped
(possibly aliasing) address.

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
from pallas_kernels.paged_attention_decode import _check_pow2, key_tile, online_softmax_step
from pallas_kernels.reference.common import next_pow2
from pallas_kernels.reference.paged_attention import (
    MASK_VALUE,
    check_paged_attention_args,
    token_rows_and_context,
    validate_paged_attention_indices,
)

__all__ = ["default_block_sizes", "paged_attention_varlen", "query_block_plan"]

_F32 = jnp.float32


def default_block_sizes(head_dim: int, block_size: int, groups: int = 1) -> dict:
    """Launch table (no autotuning): ``dict(block_q=..., block_k=..., num_warps=..., num_stages=...)``.

    A program's tile has ``block_q * next_pow2(groups)`` query rows (GQA heads share K/V); it is kept
    near 64 rows at head_dim 128 (the float32 accumulator lives in registers) and 128 below.
    """
    del block_size
    gp = next_pow2(groups)
    rows = 128 if head_dim <= 64 else 64
    # 8 warps: ptxas (sm_90a) gives the 64x128 / 128x64 float32 tiles 123 / 141 registers, against 159 / 242
    # with 4 warps (no spill either way).
    return dict(block_q=max(1, rows // gp, 16 // gp), block_k=64 if head_dim <= 64 else 32, num_warps=8,
                num_stages=2)


def query_block_plan(query_start_loc, num_tokens: int, block_q: int):
    """Cut every row (plus the padding pseudo-row) into query blocks of at most ``block_q`` tokens.

    Returns ``(row, start, length)``, each ``int32[T // block_q + R + 1]``: block ``i``
    covers tokens ``start[i] .. start[i] + length[i]`` of block-table row ``row[i]``;
    blocks past the real ones have length 0.
    """
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    r = qsl.shape[0] - 1
    starts = qsl  # [R+1]: row starts, then the padding pseudo-row's start
    ends = jnp.concatenate([qsl[1:], jnp.array([num_tokens], jnp.int32)])
    nblocks = (ends - starts + block_q - 1) // block_q
    cum = jnp.cumsum(nblocks)
    first = cum - nblocks
    num_programs = num_tokens // block_q + r + 1
    i = jnp.arange(num_programs, dtype=jnp.int32)
    owner = jnp.searchsorted(cum, i, side="right").astype(jnp.int32)  # R+1 past the last block
    o = jnp.minimum(owner, r)
    start = starts[o] + (i - first[o]) * block_q
    length = jnp.where(owner <= r, jnp.clip(ends[o] - start, 0, block_q), 0)
    return jnp.minimum(o, r - 1), jnp.where(length > 0, start, 0), length


def _varlen_kernel(qb_row_ref, qb_start_ref, qb_len_ref, ctx_ref, bt_ref, q_ref, kv_ref, o_ref, *, scale, block_q,
                   block_k, block_size, num_cols, groups, groups_padded, num_tokens):
    # qb_*_ref: int32[P]; ctx_ref: int32[T]; bt_ref: int32[R, B]; q_ref: [T, Hq, d]
    # kv_ref: [2, num_blocks, block_size, Hkv, d]; o_ref: [T + block_q, Hkv * groups_padded, d]
    i, h = pl.program_id(0), pl.program_id(1)
    row = qb_row_ref[i]
    # Row m of the program's tile is (token m // Gp, query head h*G + m % Gp): the G query heads of
    # KV head h for block_q tokens share every K/V tile (GQA), with no reshape in the kernel.
    m = jnp.arange(block_q * groups_padded)
    tok = qb_start_ref[i] + m // groups_padded
    g = m % groups_padded
    live = (m // groups_padded < qb_len_ref[i]) & (g < groups)
    tok_in = jnp.minimum(tok, num_tokens - 1)  # reads only; stores use the padded output
    context = jnp.where(live, ctx_ref[tok_in], 0)  # [M]
    block_context = context.max()
    cols = jnp.arange(q_ref.shape[-1])[None, :]
    q = q_ref[tok_in[:, None], (h * groups + jnp.minimum(g, groups - 1))[:, None], cols]  # [M, d]

    def body(j, carry):
        pos, _, k, v = key_tile(kv_ref, bt_ref, row, j * block_k, h, block_k=block_k, block_size=block_size,
                                num_cols=num_cols, context=block_context)
        return online_softmax_step(q, k, v, pos[None, :] < context[:, None], carry, scale)

    rows, d = q.shape
    init = (jnp.zeros((rows, d), _F32), jnp.full((rows,), MASK_VALUE, _F32), jnp.zeros((rows,), _F32))
    acc, _, l = lax.fori_loop(0, pl.cdiv(block_context, block_k), body, init)
    out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    # Every (token, padded head) of the tile has its own address, so masked lanes never alias live ones.
    plt.store(o_ref.at[tok[:, None], (h * groups_padded + g)[:, None], cols], out.astype(o_ref.dtype),
              mask=live[:, None])


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "num_warps", "num_stages", "interpret"))
def _varlen_jit(q, kv, block_table, query_start_loc, positions, row_map, *, scale, block_q, block_k, num_warps,
                num_stages, interpret):
    t, hq, d = q.shape
    _, _, bs, hkv, _ = kv.shape
    g = hq // hkv
    gp = next_pow2(g)
    _, context = token_rows_and_context(query_start_loc, positions)
    qb_row, qb_start, qb_len = query_block_plan(query_start_loc, t, block_q)
    if row_map is not None:
        qb_row = row_map.astype(jnp.int32)[qb_row]
    kernel = functools.partial(_varlen_kernel, scale=scale, block_q=block_q, block_k=block_k, block_size=bs,
                               num_cols=block_table.shape[1], groups=g, groups_padded=gp, num_tokens=t)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t + block_q, hkv * gp, d), q.dtype),
        grid=(qb_row.shape[0], hkv),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_varlen_g{gp}_d{d}_bs{bs}_bq{block_q}_bk{block_k}",
    )(qb_row, qb_start, qb_len, context, block_table.astype(jnp.int32), q, kv)
    return out[:t].reshape(t, hkv, gp, d)[:, :, :g].reshape(t, hq, d)


def paged_attention_varlen(
    q,
    kv,
    block_table,
    query_start_loc,
    positions,
    *,
    scale: float,
    row_map=None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
):
    """Causal paged attention of packed varlen rows (prefill, chunked prefill, mixed steps).

    Args:
      q: ``[T, Hq, d]`` (``d`` a power of 2 >= 16); kv: ``[2, num_blocks, block_size, Hkv, d]``.
      block_table: ``int32[R, B]``; query_start_loc: ``int32[R+1]``; positions: ``int32[T]``.
      scale: softmax scale.
      row_map: ``int32[R]`` or None: batch row ``r`` reads ``block_table[row_map[r]]`` (then any rows).
      block_q: tokens per query block (power of 2; times ``next_pow2(Hq // Hkv)`` at least 16);
        block_k: keys per tile (power of 2 >= 16).
      num_warps, num_stages: Triton launch parameters; interpret: run in the Pallas interpreter.

    Returns:
      ``[T, Hq, d]`` in ``q.dtype``; padding tokens get 0.
    """
    _, _, _, d, bs = check_paged_attention_args(q, kv, block_table, query_start_loc, positions, row_map)
    validate_paged_attention_indices(kv, block_table, query_start_loc, positions)
    groups = q.shape[1] // kv.shape[3]
    dflt = default_block_sizes(d, bs, groups)
    block_q = int(dflt["block_q"] if block_q is None else block_q)
    block_k = int(dflt["block_k"] if block_k is None else block_k)
    _check_pow2("head_dim", d)
    _check_pow2("block_q", block_q, least=1)
    if block_q * next_pow2(groups) < 16:
        raise ConfigError(f"block_q={block_q} times the padded query heads per KV head ({next_pow2(groups)}) "
                          "must be >= 16 (Triton dot)")
    _check_pow2("block_k", block_k)
    if not q.shape[0]:
        raise ConfigError("paged_attention_varlen needs at least one token")
    return _varlen_jit(q, kv, block_table, query_start_loc, positions, row_map, scale=float(scale), block_q=block_q,
                       block_k=block_k, num_warps=int(dflt["num_warps"] if num_warps is None else num_warps),
                       num_stages=int(dflt["num_stages"] if num_stages is None else num_stages),
                       interpret=bool(interpret))
