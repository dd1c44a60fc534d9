"""Depthwise causal conv1d for prefill over a packed varlen batch (DS layout), Triton-Pallas.

Programs are (token block of one request, channel block); block-end snapshots serve prefix caching.
Semantics (vLLM's ``causal_conv1d_fn``): docs/architecture.md, "causal_conv1d_varlen".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxmamba.layout import PAD_SLOT_ID
from pallas_kernels.reference.causal_conv1d import (
    check_activation,
    check_conv_args,
    conv_varlen_plan,
    validate_conv_varlen_indices,
)
from pallas_kernels.reference.common import next_pow2, silu

__all__ = ["causal_conv1d_varlen", "default_block_sizes", "program_table"]


def default_block_sizes(state_dtype, conv_dim: int, width: int = 4) -> dict:
    """Launch table: ``dict(block_t=..., block_d=..., num_warps=..., num_stages=...)``."""
    del state_dtype
    return dict(block_t=max(16, next_pow2(width - 1)), block_d=min(128, next_pow2(conv_dim)), num_warps=4,
                num_stages=2)


def program_table(start, length, block_t: int, num_programs: int):
    """``(prog_seq, prog_blk)``: request and block of each program; ``prog_seq = -1`` idles."""
    batch = start.shape[0]
    nblk = jnp.where(length > 0, (length + block_t - 1) // block_t, 0)
    incl = jnp.cumsum(nblk)
    p = jnp.arange(num_programs, dtype=jnp.int32)
    seq = jnp.searchsorted(incl, p, side="right").astype(jnp.int32)
    real = seq < batch
    blk = p - (incl - nblk)[jnp.minimum(seq, batch - 1)]
    return jnp.where(real, seq, -1).astype(jnp.int32), jnp.where(real, blk, 0).astype(jnp.int32)


def _conv_varlen_kernel(pseq_ref, pblk_ref, src_ref, dst_ref, start_ref, len_ref, bpos_ref, bdst_ref, x_ref,
                        w_ref, *refs, has_bias, use_silu, width, conv_dim, block_t, block_d, num_tokens,
                        num_bounds, barrier):
    # pseq_ref, pblk_ref: [num_programs]; src/dst/start/len_ref: [batch]; bpos/bdst_ref: [batch, nb]
    # x_ref: [T, conv_dim]; w_ref: [conv_dim, K]; bias_ref: [conv_dim]
    # out_init (zeros, aliased to out_ref), state_in (aliased to state_ref)
    # out_ref: [T, conv_dim]; state_ref: [slots, conv_dim, R]
    if has_bias:
        bias_ref, _, _, out_ref, state_ref = refs
    else:
        bias_ref = None
        _, _, out_ref, state_ref = refs
    seq = pseq_ref[pl.program_id(0)]
    blk = pblk_ref[pl.program_id(0)]
    b = jnp.maximum(seq, 0)
    cols = pl.program_id(1) * block_d + jnp.arange(block_d)  # channels
    col_ok = cols < conv_dim
    live = col_ok & (seq >= 0)
    first = live & (blk == 0)  # the request's first program owns every slot access
    start = start_ref[b]
    length = len_ref[b]
    src = src_ref[b]
    sdt = state_ref.dtype
    km1 = width - 1

    hist = [plt.load(state_ref.at[jnp.maximum(src, 0), cols, r], mask=first & (src >= 0), other=0.0)
            for r in range(km1)]  # [block_d] each, zeros without initial state

    # Output tile: token rows [tok0, tok0 + block_t) of this request.
    i = jnp.arange(block_t)
    tok0 = start + blk * block_t
    n = jnp.minimum(block_t, length - blk * block_t)
    acc = jnp.zeros((block_t, block_d), jnp.float32)
    if has_bias:
        acc = acc + plt.load(bias_ref.at[cols], mask=col_ok, other=0.0).astype(jnp.float32)[None, :]
    for k in range(width):
        local = blk * block_t + i + (k - km1)  # position of tap k's input within the request
        rows = jnp.clip(tok0 + i + (k - km1), 0, num_tokens - 1)
        ok = (local >= 0) & (i < n)
        tap = plt.load(x_ref.at[rows[:, None], cols[None, :]], mask=ok[:, None] & live[None, :], other=0.0)
        tap = tap.astype(sdt)
        for r in range(km1 - k):  # taps reaching before the request read the initial history
            tap = jnp.where(((i == r) & (blk == 0))[:, None], hist[r + k][None, :], tap)
        w_k = plt.load(w_ref.at[cols, k], mask=col_ok, other=0.0).astype(jnp.float32)
        acc = acc + tap.astype(jnp.float32) * w_k[None, :]
    if use_silu:
        acc = silu(acc)
    plt.store(out_ref.at[(tok0 + i)[:, None], cols[None, :]], acc.astype(out_ref.dtype),
              mask=(i < n)[:, None] & live[None, :])

    def history_after(count):
        """Rows 0..K-2 of the conv state after the request's first ``count`` tokens."""
        vals = []
        for r in range(km1):
            q = count - km1 + r
            xv = plt.load(x_ref.at[jnp.clip(start + q, 0, num_tokens - 1), cols], mask=first & (q >= 0),
                          other=0.0).astype(sdt)
            hv = jnp.zeros((block_d,), sdt)
            for m in range(km1):
                hv = jnp.where(count + r == m, hist[m], hv)
            vals.append(jnp.where(q >= 0, xv, hv))
        return vals

    def write_history(slot, vals, ok):
        for r in range(km1):
            plt.store(state_ref.at[jnp.maximum(slot, 0), cols, r], vals[r], mask=first & ok & (slot >= 0))

    if barrier:  # the initial history was read above; keep every read before the slot writes on GPU
        plt.debug_barrier()
    for jb in range(num_bounds):  # prefix-caching snapshots, then the final state
        write_history(bdst_ref[b, jb], history_after(bpos_ref[b, jb]), True)
    write_history(dst_ref[b], history_after(length), length > 0)


@functools.partial(
    jax.jit,
    static_argnames=("use_silu", "pad_slot_id", "interpret", "block_t", "block_d", "num_warps", "num_stages"),
)
def _conv_varlen_jit(x, conv_state, weight, bias, query_start_loc, cache_indices, has_initial_state,
                     dst_cache_indices, block_boundary_indices, block_boundary_slots, *, use_silu, pad_slot_id,
                     interpret, block_t, block_d, num_warps, num_stages):
    dim, R, K = check_conv_args(x, conv_state, weight, bias)
    T = x.shape[0]
    p = conv_varlen_plan(conv_state.shape[0], T, query_start_loc, cache_indices, has_initial_state,
                         dst_cache_indices, block_boundary_indices, block_boundary_slots, pad_slot_id)
    batch = p.src.shape[0]
    num_programs = pl.cdiv(T, block_t) + batch
    pseq, pblk = program_table(p.start, p.length, block_t, num_programs)
    operands = [pseq, pblk, p.src, p.dst, p.start, p.length, p.bnd_pos, p.bnd_dst, x, weight]
    if bias is not None:
        operands.append(bias)
    operands += [jnp.zeros(x.shape, x.dtype), conv_state]
    kernel = functools.partial(
        _conv_varlen_kernel, has_bias=bias is not None, use_silu=use_silu, width=K, conv_dim=dim,
        block_t=block_t, block_d=block_d, num_tokens=T, num_bounds=p.bnd_pos.shape[1], barrier=not interpret,
    )
    n = len(operands)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)),
        grid=(num_programs, pl.cdiv(dim, block_d)),
        input_output_aliases={n - 2: 0, n - 1: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"causal_conv1d_varlen_k{K}_bt{block_t}_bd{block_d}",
    )(*operands)


def causal_conv1d_varlen(
    x,
    conv_state,
    weight,
    bias=None,
    *,
    query_start_loc,
    cache_indices,
    has_initial_state,
    activation="silu",
    pad_slot_id=PAD_SLOT_ID,
    dst_cache_indices=None,
    block_boundary_indices=None,
    block_boundary_slots=None,
    interpret=False,
    block_t=None,
    block_d=None,
    num_warps=None,
    num_stages=None,
):
    """Prefill causal conv1d over packed requests; writes final (and boundary) conv states.

    Args:
      x: ``(T, conv_dim)`` packed tokens; ``query_start_loc (batch + 1,)``.
      conv_state: ``(slots, conv_dim, R)`` DS layout, ``R >= K - 1`` (aliased).
      weight: ``(conv_dim, K)``; bias: ``(conv_dim,)`` or None; activation None/"silu".
      cache_indices: ``(batch,)`` (or 2-D: column 0) source slot, and the
        destination unless ``dst_cache_indices (batch,)`` is given.
      has_initial_state: ``(batch,)`` bool, or None (no request has one).
      block_boundary_indices, block_boundary_slots: ``(batch, nb)`` int32,
        optional snapshots for prefix caching (see the module docstring).
      interpret, block_t, block_d, num_warps, num_stages: see ``default_block_sizes``.

    Returns:
      ``(out (T, conv_dim) in x.dtype, conv_state)``.
    """
    dim, R, K = check_conv_args(x, conv_state, weight, bias)
    validate_conv_varlen_indices(conv_state.shape[0], x.shape[0], query_start_loc, cache_indices,
                                 dst_cache_indices, block_boundary_slots, pad_slot_id)
    d = default_block_sizes(conv_state.dtype, dim, K)
    block_t = d["block_t"] if block_t is None else block_t
    block_d = d["block_d"] if block_d is None else block_d
    for name, v in (("block_t", block_t), ("block_d", block_d)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of 2")
    if block_t < K - 1:
        raise ValueError(f"block_t={block_t} must be >= K - 1 = {K - 1}")
    return _conv_varlen_jit(
        x, conv_state, weight, bias, query_start_loc, cache_indices, has_initial_state, dst_cache_indices,
        block_boundary_indices, block_boundary_slots, use_silu=check_activation(activation),
        pad_slot_id=int(pad_slot_id), interpret=bool(interpret), block_t=int(block_t), block_d=int(block_d),
        num_warps=int(d["num_warps"] if num_warps is None else num_warps),
        num_stages=int(d["num_stages"] if num_stages is None else num_stages),
    )
