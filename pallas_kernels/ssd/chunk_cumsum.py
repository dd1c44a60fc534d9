"""SSD pass 1: processed ``dt`` and the in-chunk prefix sum of ``dA = dt * A`` per (head, chunk).

Grid ``(nchunks, cdiv(H, block_h))``; a program reads the chunk's ``(chunk_size,
block_h)`` slab of raw ``dt`` once, so later passes neither recompute
``softplus`` nor read ``dt`` with the token-major stride.
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


def _cumsum_kernel(cc_ref, dt_ref, *refs, has_bias, softplus_dt, dt_lo, dt_hi, chunk_size, block_h, num_heads,
                   num_tokens):
    # cc_ref: [nchunks + 1]; dt_ref: [T, H]; dtb_ref: [H] float32; a_ref: [H] float32
    # out dt_out_ref, da_cs_ref: [H, nchunks, chunk_size] float32
    if has_bias:
        dtb_ref, a_ref, dt_out_ref, da_cs_ref = refs
    else:
        dtb_ref = None
        a_ref, dt_out_ref, da_cs_ref = refs
    c = pl.program_id(0)
    heads = pl.program_id(1) * block_h + jnp.arange(block_h)
    h_ok = heads < num_heads
    hh = jnp.minimum(heads, num_heads - 1)
    start, clen = chunk_bounds(cc_ref, c, chunk_size)
    lpos = jnp.arange(chunk_size)
    valid = (lpos < clen)[:, None] & h_ok[None, :]
    tok = jnp.clip(start + lpos, 0, num_tokens - 1)
    dt = plt.load(dt_ref.at[tok[:, None], hh[None, :]], mask=valid, other=0.0).astype(F32)  # [cs, bh]
    if dtb_ref is not None:
        dt = dt + plt.load(dtb_ref.at[hh], mask=h_ok, other=0.0)[None, :]
    if softplus_dt:
        dt = softplus(dt)
    if dt_lo > 0.0 or dt_hi < math.inf:
        dt = jnp.clip(dt, dt_lo, dt_hi)
    dt = jnp.where(valid, dt, 0.0)
    a = plt.load(a_ref.at[hh], mask=h_ok, other=0.0)
    # a direct cumsum of same-sign terms (not a difference of two), so it is exact to rounding
    da_cs = jnp.cumsum(dt * a[None, :], axis=0)
    addr = (hh[None, :], c, lpos[:, None])
    plt.store(dt_out_ref.at[addr], dt, mask=h_ok[None, :])
    plt.store(da_cs_ref.at[addr], da_cs, mask=h_ok[None, :])


@functools.partial(jax.jit, static_argnames=("chunk_size", "dt_softplus", "dt_limit", "block_h", "num_warps",
                                             "num_stages", "interpret"))
def chunk_cumsum(dt, A, dt_bias, cu_chunk_seqlens, *, chunk_size, dt_softplus, dt_limit, block_h, num_warps=4,
                 num_stages=2, interpret=False):
    """Processed ``dt`` and in-chunk inclusive prefix sums of ``dA``.

    Args:
      dt: ``(T, H)`` raw; A: ``(H,)`` float32; dt_bias: ``(H,)`` float32 or None.
      cu_chunk_seqlens: ``(nchunks + 1,)`` int32 chunk table.
      dt_limit: ``(lo, hi)``: ``dt = clip(softplus(dt + dt_bias), lo, hi)``.
      block_h: heads per program (power of 2).

    Returns:
      ``(dt_chunks, da_cumsum)``, both ``(H, nchunks, chunk_size)`` float32:
      ``dt_chunks[h, c, l]`` is the processed ``dt`` of the chunk's ``l``-th
      token (0 past the chunk's end) and ``da_cumsum[h, c, l] = sum_{k<=l} dt A``
      (so ``da_cumsum[..., -1]`` is the chunk's total).
    """
    T, H = dt.shape
    nc = cu_chunk_seqlens.shape[0] - 1
    block_h = min(block_h, next_pow2(H))
    has_bias = dt_bias is not None
    out = jax.ShapeDtypeStruct((H, nc, chunk_size), F32)
    return pl.pallas_call(
        functools.partial(_cumsum_kernel, has_bias=has_bias, softplus_dt=dt_softplus, dt_lo=dt_limit[0],
                          dt_hi=dt_limit[1], chunk_size=chunk_size, block_h=block_h, num_heads=H, num_tokens=T),
        out_shape=(out, out),
        grid=(nc, pl.cdiv(H, block_h)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ssd_chunk_cumsum_cs{chunk_size}_bh{block_h}",
    )(cu_chunk_seqlens, dt, *([dt_bias] if has_bias else []), A)
