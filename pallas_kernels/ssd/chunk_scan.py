"""SSD pass 5: outputs of the chunked scan.

``y_i = sum_{j<=i} (C_i . B_j) exp(S[i, j]) dt_j x_j + exp(sum_{l<=i} dA_l) C_i h_in + D x_i``,
then ``y *= silu(z)``, with ``S[i, j] = sum_{j<l<=i} dA_l`` inside the chunk and
``h_in`` the state entering the chunk (the request's initial state on its first
chunk, else the previous chunk-end state).

Grid ``(nchunks, H, (chunk_size / block_l) * (P / block_p))``: a program owns
``block_l`` rows and ``block_p`` head-dim columns. ``C B^T`` comes from
``chunk_bmm`` (computed once per group). Column blocks are walked from the
diagonal down to the chunk's start, carrying the sum of ``dA`` over the blocks
in between, so an off-diagonal ``S`` is (within-row-block prefix) + (between)
+ (within-column-block suffix, from ``chunk_cumsum``), each a sum of ``dA <= 0`` terms; the diagonal
block uses the masked cumsum. ``C h_in`` is accumulated over ``d_state`` in
``block_n`` slices, so no program holds a whole ``(P, N)`` state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.reference.common import next_pow2, silu
from pallas_kernels.precision import f32_matmul_precision
from pallas_kernels.ssd._common import F32, chunk_bounds, matmul_dtype, mm

__all__ = ["chunk_scan"]


def _entering_state_term(seq_ref, c_ref, init_ref, states_ref, *, c, h, g, pcol, p_ok, tok_i, ok_i, block_l, block_p,
                         block_n, d_state, mm_dtype, f32_precision):
    """``C_i h_in`` for a program's rows: float32 ``[block_l, block_p]``, not yet decayed.

    ``h_in`` is the request's initial state (``init_ref [batch, H, P, N]``) on its first chunk, else the previous
    chunk-end state (``states_ref [nchunks, H, P, N]``); ``pcol``/``p_ok`` ``[block_p]`` are the program's head-dim
    columns, ``tok_i``/``ok_i`` ``[block_l]`` its rows' tokens in ``c_ref [T, G, N]`` and which rows are in the chunk.
    """
    seq = seq_ref[c]
    first = (c == 0) | (seq != seq_ref[jnp.maximum(c - 1, 0)])
    prev = jnp.maximum(c - 1, 0)
    nn = jnp.arange(block_n)

    # Sliced over d_state so no program holds a whole (P, N) state.
    def n_slice(s, acc):
        ncol = s * block_n + nn
        n_ok = ncol < d_state
        tile_ok = p_ok[:, None] & n_ok[None, :]
        h_init = plt.load(init_ref.at[seq, h, pcol[:, None], ncol[None, :]], mask=tile_ok & first, other=0.0)
        h_prev = plt.load(states_ref.at[prev, h, pcol[:, None], ncol[None, :]],
                          mask=tile_ok & jnp.logical_not(first), other=0.0)
        cm = plt.load(c_ref.at[tok_i[:, None], g, ncol[None, :]], mask=ok_i[:, None] & n_ok[None, :], other=0.0)
        return acc + mm(cm, jnp.where(first, h_init, h_prev), ((1,), (1,)), F32,
                          exact=mm_dtype == F32, f32_precision=f32_precision)  # [bl, bp]

    return jax.lax.fori_loop(0, pl.cdiv(d_state, block_n), n_slice, jnp.zeros((block_l, block_p), F32))


def _chunk_scan_kernel(cc_ref, seq_ref, x_ref, c_ref, cb_ref, dt_ref, da_cs_ref, suffix_ref, a_ref, init_ref, states_ref, *refs,
                       has_d, has_z, chunk_size, block_l, block_p, block_n, head_dim, d_state, heads_per_group,
                       num_tokens, mm_dtype, f32_precision):
    # cc_ref: [nchunks + 1]; seq_ref: [nchunks]; x_ref: [T, H, P]; c_ref: [T, G, N]
    # cb_ref: [nchunks, G, cs, cs] float32 (C B^T, lower tiles); dt_ref, da_cs_ref, suffix_ref: [H, nchunks, cs]
    # a_ref: [H] float32; init_ref: [batch, H, P, N] float32; states_ref: [nchunks, H, P, N] float32
    # d_ref: [H, P] float32; z_ref: [T, H, P]; out_init (zeros, aliased to out_ref); out_ref: [T, H, P]
    refs = list(refs)
    d_ref = refs.pop(0) if has_d else None
    z_ref = refs.pop(0) if has_z else None
    _, out_ref = refs
    c, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    p_tiles = pl.cdiv(head_dim, block_p)
    m = t // p_tiles
    pcol = (t % p_tiles) * block_p + jnp.arange(block_p)
    p_ok = pcol < head_dim
    g = h // heads_per_group
    start, clen = chunk_bounds(cc_ref, c, chunk_size)

    @pl.when(m * block_l < clen)
    def _():
        a = a_ref[h]
        ii = jnp.arange(block_l)
        jj = ii
        pos_i = m * block_l + ii
        ok_i = pos_i < clen
        tok_i = jnp.clip(start + pos_i, 0, num_tokens - 1)
        dt_m = plt.load(dt_ref.at[h, c, pos_i], mask=ok_i, other=0.0)
        da_m = a * dt_m
        prefix_local = jnp.cumsum(da_m)  # sum_{m*bl <= l <= i} dA

        def x_rows(pos, ok):
            tok = jnp.clip(start + pos, 0, num_tokens - 1)
            return plt.load(x_ref.at[tok[:, None], h, pcol[None, :]], mask=ok[:, None] & p_ok[None, :], other=0.0)

        def cb_tile(pos_j, keep):
            return plt.load(cb_ref.at[c, g, pos_i[:, None], pos_j[None, :]], mask=keep, other=0.0)

        # Diagonal block: S[i, j] = sum_{j < l <= i} dA_l (masked cumsum over l).
        keep = (jj[None, :] <= ii[:, None]) & ok_i[:, None] & ok_i[None, :]
        seg = jnp.cumsum(jnp.where(ii[:, None] > jj[None, :], da_m[:, None], 0.0), axis=0)
        w = jnp.where(keep, cb_tile(pos_i, keep) * jnp.exp(jnp.minimum(seg, 0.0)) * dt_m[None, :], 0.0)
        y = mm(w, x_rows(pos_i, ok_i), ((1,), (0,)), mm_dtype, f32_precision=f32_precision)  # [bl, bp]

        # Off-diagonal blocks kb = m-1 .. 0 (every row of them is inside the chunk).

        def col_block(i, carry):
            y, between = carry
            kb = m - 1 - i
            pos_j = kb * block_l + jj
            dt_k = plt.load(dt_ref.at[h, c, pos_j])
            suffix = plt.load(suffix_ref.at[h, c, pos_j])  # sum_{j < l, same block} dA_l
            seg = prefix_local[:, None] + (between + suffix)[None, :]
            keep = ok_i[:, None] & (pos_j < clen)[None, :]
            w = jnp.where(keep, cb_tile(pos_j, keep) * jnp.exp(jnp.minimum(seg, 0.0)) * dt_k[None, :], 0.0)
            y = y + mm(w, x_rows(pos_j, pos_j < clen), ((1,), (0,)), mm_dtype, f32_precision=f32_precision)
            return y, between + a * jnp.sum(dt_k)

        y, _ = jax.lax.fori_loop(0, m, col_block, (y, jnp.zeros((), F32)))

        # The state entering the chunk, decayed to each row: exp(sum_{l<=i} dA) C_i h_in.
        c_h = _entering_state_term(seq_ref, c_ref, init_ref, states_ref, c=c, h=h, g=g, pcol=pcol, p_ok=p_ok,
                                   tok_i=tok_i, ok_i=ok_i, block_l=block_l, block_p=block_p, block_n=block_n,
                                   d_state=d_state, mm_dtype=mm_dtype, f32_precision=f32_precision)
        prefix = plt.load(da_cs_ref.at[h, c, pos_i], mask=ok_i, other=0.0)
        y = y + jnp.exp(prefix)[:, None] * c_h

        row_ok = ok_i[:, None] & p_ok[None, :]
        if has_d:
            y = y + x_rows(pos_i, ok_i).astype(F32) * plt.load(d_ref.at[h, pcol], mask=p_ok, other=0.0)[None, :]
        if has_z:
            y = y * silu(plt.load(z_ref.at[tok_i[:, None], h, pcol[None, :]], mask=row_ok, other=0.0).astype(F32))
        plt.store(out_ref.at[(start + pos_i)[:, None], h, pcol[None, :]], y.astype(out_ref.dtype), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("chunk_size", "block_l", "block_p", "block_n", "num_warps",
                                             "num_stages", "interpret"))
def chunk_scan(x, C, cb, dt_chunks, da_cumsum, da_suffix, A, init, states, cu_chunk_seqlens, seq_idx, D=None, z=None, *,
               chunk_size, block_l, block_p, block_n, num_warps=4, num_stages=2, interpret=False):
    """Outputs of the chunked scan.

    Args:
      x: ``(T, H, P)``; C: ``(T, G, N)``; cb: ``(nchunks, G, cs, cs)`` float32
        from ``chunk_bmm``; dt_chunks, da_cumsum, da_suffix: ``(H, nchunks, cs)``
        float32 from ``chunk_cumsum`` (``da_suffix`` for this ``block_l``); A: ``(H,)`` float32.
      init: ``(batch, H, P, N)`` float32 (zeros where there is no initial state);
        states: ``(nchunks, H, P, N)`` float32 chunk-end states from ``state_passing``.
      cu_chunk_seqlens: ``(nchunks + 1,)``; seq_idx: ``(nchunks,)`` int32.
      D: ``(H, P)`` float32 or None; z: ``(T, H, P)`` or None.
      block_l: rows per program (power of 2 >= 16 dividing ``chunk_size``, and
        the tile ``chunk_bmm`` was run with or a divisor of it); block_p,
        block_n: head-dim columns per program and ``d_state`` slice (>= 16).

    Returns:
      ``(T, H, P)`` in ``x.dtype``; tokens outside every chunk are zeros.
    """
    T, H, P = x.shape
    G, N = C.shape[1], C.shape[2]
    nc = cu_chunk_seqlens.shape[0] - 1
    block_p = min(block_p, next_pow2(max(P, 16)))
    block_n = min(block_n, next_pow2(max(N, 16)))
    operands = [cu_chunk_seqlens, seq_idx, x, C, cb, dt_chunks, da_cumsum, da_suffix, A, init, states]
    operands += [D] if D is not None else []
    operands += [z] if z is not None else []
    operands += [jnp.zeros(x.shape, x.dtype)]
    return pl.pallas_call(
        functools.partial(_chunk_scan_kernel, has_d=D is not None, has_z=z is not None, chunk_size=chunk_size,
                          block_l=block_l, block_p=block_p, block_n=block_n, head_dim=P, d_state=N,
                          heads_per_group=H // G, num_tokens=T, mm_dtype=matmul_dtype(x.dtype),
                          f32_precision=f32_matmul_precision(interpret)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(nc, H, (chunk_size // block_l) * pl.cdiv(P, block_p)),
        input_output_aliases={len(operands) - 1: 0},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ssd_chunk_scan_cs{chunk_size}_bl{block_l}_bp{block_p}_bn{block_n}",
    )(*operands)
