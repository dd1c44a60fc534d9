"""SSD pass 1: processed ``dt`` and the in-chunk prefix sum of ``dA = dt * A`` per (head, chunk).

Grid ``(nchunks, cdiv(H, block_h))``; a program reads the chunk's ``(chunk_size,
block_h)`` slab of raw ``dt``, so later passes neither recompute ``softplus``
nor read ``dt`` with the token-major stride. It also gives, for the row blocks
of ``block_l`` that ``chunk_state``/``chunk_scan`` walk, the sum of ``dA`` over
the later rows of each block (a cumsum over the block read backwards), which
those passes would otherwise build with a ``block_l x block_l`` masked sum in
every loop step.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.reference.common import next_pow2, softplus
from pallas_kernels.ssd._common import F32, chunk_bounds

__all__ = ["chunk_cumsum"]


def _cumsum_kernel(cc_ref, dt_ref, *refs, has_bias, softplus_dt, dt_lo, dt_hi, chunk_size, block_l, block_h,
                   num_heads, num_tokens):
    # cc_ref: [nchunks + 1]; dt_ref: [T, H]; dtb_ref: [H] float32; a_ref: [H] float32
    # out dt_out_ref, da_cs_ref, da_suffix_ref: [H, nchunks, chunk_size] float32
    if has_bias:
        dtb_ref, a_ref, dt_out_ref, da_cs_ref, da_suffix_ref = refs
    else:
        dtb_ref = None
        a_ref, dt_out_ref, da_cs_ref, da_suffix_ref = refs
    c = pl.program_id(0)
    heads = pl.program_id(1) * block_h + jnp.arange(block_h)
    h_ok = heads < num_heads
    hh = jnp.minimum(heads, num_heads - 1)
    start, clen = chunk_bounds(cc_ref, c, chunk_size)
    bias = plt.load(dtb_ref.at[hh], mask=h_ok, other=0.0) if dtb_ref is not None else None
    a = plt.load(a_ref.at[hh], mask=h_ok, other=0.0)

    def processed_dt(pos, valid, hcol):
        """Processed dt at in-chunk positions ``pos`` (0 where not ``valid``); ``hcol`` broadcasts the heads."""
        tok = jnp.clip(start + pos, 0, num_tokens - 1)
        dt = plt.load(dt_ref.at[tok, hcol], mask=valid, other=0.0).astype(F32)
        if bias is not None:
            dt = dt + (bias[None, :] if hcol.ndim == 2 else bias[None, None, :])
        if softplus_dt:
            dt = softplus(dt)
        if dt_lo > 0.0 or dt_hi < math.inf:
            dt = jnp.clip(dt, dt_lo, dt_hi)
        return jnp.where(valid, dt, 0.0)

    lpos = jnp.arange(chunk_size)[:, None]
    dt = processed_dt(lpos, (lpos < clen) & h_ok[None, :], hh[None, :])  # [cs, bh]
    # a direct cumsum of same-sign terms (not a difference of two), so it is exact to rounding
    da_cs = jnp.cumsum(dt * a[None, :], axis=0)
    addr = (hh[None, :], c, lpos)
    plt.store(dt_out_ref.at[addr], dt, mask=h_ok[None, :])
    plt.store(da_cs_ref.at[addr], da_cs, mask=h_ok[None, :])

    # Within each block of block_l rows, sum_{l > j, same block} dA_l: read each block backwards, shifted by one
    # row (k-th element = row block_end - k), so a forward cumsum gives the exclusive suffix sums.
    blk = jnp.arange(chunk_size // block_l)[:, None, None] * block_l
    k = jnp.arange(block_l)[None, :, None]
    src = blk + block_l - k
    h3 = hh[None, None, :]
    dt_rev = processed_dt(src, (k >= 1) & (src < clen) & h_ok[None, None, :], h3)  # [nb, bl, bh]
    suffix = jnp.cumsum(dt_rev * a[None, None, :], axis=1)
    plt.store(da_suffix_ref.at[h3, c, blk + block_l - 1 - k], suffix, mask=h_ok[None, None, :])


@functools.partial(jax.jit, static_argnames=("chunk_size", "dt_softplus", "dt_limit", "block_l", "block_h",
                                             "num_warps", "num_stages", "interpret"))
def chunk_cumsum(dt, A, dt_bias, cu_chunk_seqlens, *, chunk_size, dt_softplus, dt_limit, block_l, block_h,
                 num_warps=4, num_stages=2, interpret=False):
    """Processed ``dt``, in-chunk inclusive prefix sums of ``dA``, and within-block suffix sums.

    Args:
      dt: ``(T, H)`` raw; A: ``(H,)`` float32; dt_bias: ``(H,)`` float32 or None.
      cu_chunk_seqlens: ``(nchunks + 1,)`` int32 chunk table.
      dt_limit: ``(lo, hi)``: ``dt = clip(softplus(dt + dt_bias), lo, hi)``.
      block_l: row block of ``chunk_state``/``chunk_scan`` (divides ``chunk_size``).
      block_h: heads per program (power of 2).

    Returns:
      ``(dt_chunks, da_cumsum, da_suffix)``, all ``(H, nchunks, chunk_size)``
      float32: ``dt_chunks[h, c, l]`` is the processed ``dt`` of the chunk's
      ``l``-th token (0 past the chunk's end), ``da_cumsum[h, c, l] = sum_{k<=l} dt A``
      (so ``da_cumsum[..., -1]`` is the chunk's total) and ``da_suffix[h, c, l]``
      the sum of ``dt A`` over the rows after ``l`` in its block of ``block_l``.
    """
    T, H = dt.shape
    nc = cu_chunk_seqlens.shape[0] - 1
    block_h = min(block_h, next_pow2(H))
    has_bias = dt_bias is not None
    out = jax.ShapeDtypeStruct((H, nc, chunk_size), F32)
    return pl.pallas_call(
        functools.partial(_cumsum_kernel, has_bias=has_bias, softplus_dt=dt_softplus, dt_lo=dt_limit[0],
                          dt_hi=dt_limit[1], chunk_size=chunk_size, block_l=block_l, block_h=block_h, num_heads=H, num_tokens=T),
        out_shape=(out, out, out),
        grid=(nc, pl.cdiv(H, block_h)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ssd_chunk_cumsum_cs{chunk_size}_bl{block_l}_bh{block_h}",
    )(cu_chunk_seqlens, dt, *([dt_bias] if has_bias else []), A)
