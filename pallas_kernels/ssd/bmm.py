"""SSD pass 2: ``C B^T`` of every chunk, once per group (the heads of a group share it).

Grid ``(nchunks, G, (chunk_size / block_m)^2)``: a program computes one
``block_m x block_m`` tile, accumulating over ``d_state`` in ``block_n`` slices.
Tiles strictly above the diagonal (never read by the causal chunk scan) and
tiles past the chunk's end are not written.
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

__all__ = ["chunk_bmm"]


def _bmm_kernel(cc_ref, c_ref, b_ref, cb_ref, *, chunk_size, block_m, block_n, d_state, num_tokens, mm_dtype,
                f32_precision):
    # cc_ref: [nchunks + 1]; c_ref, b_ref: [T, G, N]; out cb_ref: [nchunks, G, chunk_size, chunk_size] float32
    c, g, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tiles = chunk_size // block_m
    rb, kb = t // tiles, t % tiles
    start, clen = chunk_bounds(cc_ref, c, chunk_size)

    @pl.when((kb <= rb) & (rb * block_m < clen))
    def _():
        r = jnp.arange(block_m)
        pos_i, pos_j = rb * block_m + r, kb * block_m + r
        ok_i, ok_j = pos_i < clen, pos_j < clen
        tok_i = jnp.clip(start + pos_i, 0, num_tokens - 1)
        tok_j = jnp.clip(start + pos_j, 0, num_tokens - 1)
        ncol = jnp.arange(block_n)

        def n_slice(s, acc):
            n = s * block_n + ncol
            n_ok = n < d_state
            ci = plt.load(c_ref.at[tok_i[:, None], g, n[None, :]], mask=ok_i[:, None] & n_ok[None, :], other=0.0)
            bj = plt.load(b_ref.at[tok_j[:, None], g, n[None, :]], mask=ok_j[:, None] & n_ok[None, :], other=0.0)
            return acc + mm(ci, bj, ((1,), (1,)), mm_dtype, f32_precision=f32_precision)

        acc = jax.lax.fori_loop(0, pl.cdiv(d_state, block_n), n_slice, jnp.zeros((block_m, block_m), F32))
        plt.store(cb_ref.at[c, g, pos_i[:, None], pos_j[None, :]], acc)


@functools.partial(jax.jit, static_argnames=("chunk_size", "block_m", "block_n", "num_warps", "num_stages",
                                             "interpret"))
def chunk_bmm(C, B, cu_chunk_seqlens, *, chunk_size, block_m, block_n, num_warps=4, num_stages=2, interpret=False):
    """``cb[c, g, i, j] = C[start_c + i, g] . B[start_c + j, g]`` for ``j <= i`` inside chunk ``c``.

    Args:
      C, B: ``(T, G, N)``; cu_chunk_seqlens: ``(nchunks + 1,)`` int32.
      block_m: tile side (power of 2 >= 16 dividing ``chunk_size``); block_n:
        ``d_state`` slice per step (power of 2 >= 16).

    Returns:
      ``(nchunks, G, chunk_size, chunk_size)`` float32. Only the lower-triangular
      tiles (``j``'s tile <= ``i``'s tile) of rows inside the chunk are written;
      the rest is unspecified (the chunk scan masks it out of its loads).
    """
    T, G, N = B.shape
    nc = cu_chunk_seqlens.shape[0] - 1
    block_n = min(block_n, next_pow2(max(N, 16)))
    tiles = chunk_size // block_m
    return pl.pallas_call(
        functools.partial(_bmm_kernel, chunk_size=chunk_size, block_m=block_m, block_n=block_n, d_state=N,
                          num_tokens=T, mm_dtype=matmul_dtype(C.dtype),
                          f32_precision=f32_matmul_precision(interpret)),
        out_shape=jax.ShapeDtypeStruct((nc, G, chunk_size, chunk_size), F32),
        grid=(nc, G, tiles * tiles),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ssd_bmm_cs{chunk_size}_bm{block_m}_bn{block_n}",
    )(cu_chunk_seqlens, C, B)
