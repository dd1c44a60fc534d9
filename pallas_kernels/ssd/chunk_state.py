"""SSD pass 3: each chunk's own contribution to the state at its end.

``contrib[c, h] = sum_j exp(sum_{l>j} dA_l) dt_j x_j B_j^T`` over the chunk's
tokens. Grid ``(nchunks, H, (P / block_p) * (N / block_n))``; a program walks
the chunk's rows in blocks of ``block_l`` from the last to the first, carrying
the sum of ``dA`` over the rows already passed (the decay from the end of the
current block to the chunk's end); with the within-block suffix sums from
``chunk_cumsum`` every exponent is a sum of ``dA <= 0`` terms. Empty chunks are skipped (their contribution is never read).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.reference.common import next_pow2
from pallas_kernels.precision import f32_matmul_precision
from pallas_kernels.ssd._common import F32, chunk_bounds, matmul_dtype, mm

__all__ = ["chunk_state"]


def _chunk_state_kernel(cc_ref, x_ref, b_ref, dt_ref, suffix_ref, a_ref, contrib_ref, *, chunk_size, block_l, block_p, block_n,
                        head_dim, d_state, heads_per_group, num_tokens, mm_dtype, f32_precision):
    # cc_ref: [nchunks + 1]; x_ref: [T, H, P]; b_ref: [T, G, N]; dt_ref: [H, nchunks, cs] float32 (processed)
    # suffix_ref: [H, nchunks, cs] float32 (sum of dA over the later rows of the block)
    # a_ref: [H] float32; out contrib_ref: [nchunks, H, P, N] float32
    c, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n_tiles = pl.cdiv(d_state, block_n)
    prow = (t // n_tiles) * block_p + jnp.arange(block_p)
    ncol = (t % n_tiles) * block_n + jnp.arange(block_n)
    p_ok, n_ok = prow < head_dim, ncol < d_state
    g = h // heads_per_group
    start, clen = chunk_bounds(cc_ref, c, chunk_size)

    @pl.when(clen > 0)
    def _():
        a = a_ref[h]
        jj = jnp.arange(block_l)
        nblocks = pl.cdiv(clen, block_l)

        def block(i, carry):
            acc, after = carry
            kb = nblocks - 1 - i
            pos = kb * block_l + jj
            ok = pos < clen
            tok = jnp.clip(start + pos, 0, num_tokens - 1)
            dt_k = plt.load(dt_ref.at[h, c, pos], mask=ok, other=0.0)
            within = plt.load(suffix_ref.at[h, c, pos])  # sum_{l>j, same block} dA_l
            wgt = jnp.exp(within + after) * dt_k  # decay to the chunk end, times dt
            xk = plt.load(x_ref.at[tok[:, None], h, prow[None, :]], mask=ok[:, None] & p_ok[None, :],
                          other=0.0).astype(F32)  # [bl, bp]
            bk = plt.load(b_ref.at[tok[:, None], g, ncol[None, :]], mask=ok[:, None] & n_ok[None, :],
                          other=0.0)  # [bl, bn]
            acc = acc + mm(xk * wgt[:, None], bk, ((0,), (0,)), mm_dtype, f32_precision=f32_precision)  # [bp, bn]
            return acc, after + a * jnp.sum(dt_k)

        acc, _ = jax.lax.fori_loop(0, nblocks, block, (jnp.zeros((block_p, block_n), F32), jnp.zeros((), F32)))
        plt.store(contrib_ref.at[c, h, prow[:, None], ncol[None, :]], acc, mask=p_ok[:, None] & n_ok[None, :])


@functools.partial(jax.jit, static_argnames=("chunk_size", "block_l", "block_p", "block_n", "num_warps",
                                             "num_stages", "interpret"))
def chunk_state(x, B, dt_chunks, da_suffix, A, cu_chunk_seqlens, *, chunk_size, block_l, block_p, block_n, num_warps=4,
                num_stages=2, interpret=False):
    """Per-chunk state contributions.

    Args:
      x: ``(T, H, P)``; B: ``(T, G, N)``; dt_chunks: ``(H, nchunks, chunk_size)``
        float32 and da_suffix: ``(H, nchunks, chunk_size)`` float32 (computed
        for this ``block_l``) from ``chunk_cumsum``; A: ``(H,)`` float32;
        cu_chunk_seqlens: ``(nchunks + 1,)`` int32.
      block_l: rows per step (power of 2 >= 16 dividing ``chunk_size``);
        block_p, block_n: state tile (powers of 2 >= 16).

    Returns:
      ``(nchunks, H, P, N)`` float32; entries of empty chunks are unspecified.
    """
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    nc = cu_chunk_seqlens.shape[0] - 1
    block_p = min(block_p, next_pow2(max(P, 16)))
    block_n = min(block_n, next_pow2(max(N, 16)))
    return pl.pallas_call(
        functools.partial(_chunk_state_kernel, chunk_size=chunk_size, block_l=block_l, block_p=block_p,
                          block_n=block_n, head_dim=P, d_state=N, heads_per_group=H // G, num_tokens=T,
                          mm_dtype=matmul_dtype(x.dtype),
                          f32_precision=f32_matmul_precision(interpret)),
        out_shape=jax.ShapeDtypeStruct((nc, H, P, N), F32),
        grid=(nc, H, pl.cdiv(P, block_p) * pl.cdiv(N, block_n)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ssd_chunk_state_cs{chunk_size}_bl{block_l}_bp{block_p}_bn{block_n}",
    )(cu_chunk_seqlens, x, B, dt_chunks, da_suffix, A)
