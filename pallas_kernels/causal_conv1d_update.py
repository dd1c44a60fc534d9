"""Depthwise causal conv1d for decode and speculative decode (DS layout), Triton-Pallas.

One program per (request, block of ``block_d`` channels). The conv state of a
slot is ``(conv_dim, R)`` (DS: each channel's ``R`` history values contiguous)
with ``R = K - 1 + num_spec``. Per request the program

1. reads the history window ``rows o .. o + K - 2`` of the source slot, where
   ``o = num_accepted_tokens - 1`` with speculative decoding, else 0 (vLLM's
   rollback by selection: after a verify step the accepted prefix decides which
   rows are "the past"),
2. convolves the request's ``L <= max_query_len`` new tokens (``max_query_len``
   defaults to ``R - K + 2 = 1 + num_spec``), optional bias and SiLU,
3. writes the state back in place (aliased, donated at the enclosing jit) as
   vLLM's ``causal_conv1d_update`` does: with ``keep = R - max_query_len``,
   row ``i < keep`` takes old row ``i + shift`` (``shift = num_accepted`` with
   spec decode, ``L`` without) and rows ``keep .. keep + L - 1`` take the new
   tokens, so for a full-length request the last ``K - 1`` rows are the latest
   tokens; rows past ``keep + L`` are left alone.

Rows whose slot is skipped (``pad_slot_id``, the null slot 0, out of range)
and empty requests are not processed: their state is untouched and their output
rows keep ``x`` (vLLM writes the output into ``x`` in place). A 2-D ``conv_state_indices`` uses column 0 (as vLLM);
``dst_conv_state_indices`` optionally sends the new state to another slot.
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
    conv_update_plan,
    resolve_max_query_len,
    validate_conv_update_indices,
)
from pallas_kernels.reference.common import next_pow2, silu

__all__ = ["causal_conv1d_update", "default_block_sizes"]


def default_block_sizes(state_dtype, conv_dim: int) -> dict:
    """Launch table: ``dict(block_d=..., num_warps=..., num_stages=...)`` (no autotuning)."""
    del state_dtype
    return dict(block_d=min(256, next_pow2(conv_dim)), num_warps=4, num_stages=2)


def _conv_update_kernel(src_ref, dst_ref, start_ref, len_ref, off_ref, x_ref, w_ref, *refs,
                        has_bias, use_silu, spec, width, state_len, max_query_len, conv_dim, block_d,
                        num_tokens, barrier):
    # src_ref, dst_ref, start_ref, len_ref, off_ref: [batch] int32
    # x_ref: [T, conv_dim]; w_ref: [conv_dim, K]; bias_ref: [conv_dim]
    # out_init_ref: [T, conv_dim] (a copy of x, aliased to out_ref)
    # state_in_ref: [slots, conv_dim, R] (aliased to state_ref)
    # out_ref: [T, conv_dim]; state_ref: [slots, conv_dim, R]
    if has_bias:
        bias_ref, _, _, out_ref, state_ref = refs
    else:
        bias_ref = None
        _, _, out_ref, state_ref = refs
    b = pl.program_id(0)
    cols = pl.program_id(1) * block_d + jnp.arange(block_d)  # channels of this program
    col_ok = cols < conv_dim
    src = src_ref[b]
    dst = dst_ref[b]
    start = start_ref[b]
    length = len_ref[b]
    offset = off_ref[b]
    live = col_ok & (src >= 0) & (length > 0)
    src_addr = jnp.maximum(src, 0)
    sdt = state_ref.dtype

    def load_state_row(r):
        return plt.load(state_ref.at[src_addr, cols, r], mask=live, other=0.0)  # [block_d]

    # 1. everything is read before anything is written (src and dst may be the same slot)
    hist = [load_state_row(offset + k) for k in range(width - 1)]
    xs = [
        plt.load(x_ref.at[jnp.minimum(start + j, num_tokens - 1), cols], mask=live & (j < length), other=0.0)
        .astype(sdt)
        for j in range(max_query_len)
    ]
    keep = state_len - max_query_len
    shift = offset + 1 if spec else length
    kept = [load_state_row(jnp.minimum(i + shift, state_len - 1)) for i in range(max(keep, 0))]

    # 2. the convolution, token by token over the window [history | new tokens]
    window = [v.astype(jnp.float32) for v in hist + xs]
    w = [plt.load(w_ref.at[cols, k], mask=col_ok, other=0.0).astype(jnp.float32) for k in range(width)]
    acc0 = (plt.load(bias_ref.at[cols], mask=col_ok, other=0.0).astype(jnp.float32) if has_bias
            else jnp.zeros((block_d,), jnp.float32))
    for j in range(max_query_len):
        acc = acc0
        for k in range(width):
            acc = acc + w[k] * window[j + k]
        if use_silu:
            acc = silu(acc)
        plt.store(out_ref.at[jnp.minimum(start + j, num_tokens - 1), cols], acc.astype(out_ref.dtype),
                  mask=live & (j < length))

    # 3. the sliding-window state update (vLLM semantics, see module docstring). Every read of the
    # slot happened above; the barrier keeps it so on GPU (vLLM's kernel needs one here as well).
    if barrier:
        plt.debug_barrier()
    write = live & (dst >= 0)
    dst_addr = jnp.maximum(dst, 0)
    for i in range(state_len):
        val = kept[i] if i < keep else xs[i - keep]
        plt.store(state_ref.at[dst_addr, cols, i], val.astype(sdt), mask=write & (i < keep + length))


@functools.partial(
    jax.jit,
    static_argnames=("use_silu", "pad_slot_id", "max_query_len", "interpret", "block_d", "num_warps",
                     "num_stages"),
)
def _conv_update_jit(x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens, query_start_loc,
                     dst_conv_state_indices, *, use_silu, pad_slot_id, max_query_len, interpret, block_d,
                     num_warps, num_stages):
    dim, R, K = check_conv_args(x, conv_state, weight, bias)
    T = x.shape[0]
    p = conv_update_plan(conv_state.shape[0], T, R, K, conv_state_indices, dst_conv_state_indices,
                         num_accepted_tokens, query_start_loc, max_query_len, pad_slot_id)
    batch = p.src.shape[0]
    operands = [p.src, p.dst, p.start, p.length, p.offset, x, weight]
    if bias is not None:
        operands.append(bias)
    # Unprocessed rows keep x (vLLM writes in place into x). The output starts as a copy of x rather
    # than aliasing x itself, so the kernel never reads a buffer it writes.
    operands += [x, conv_state]
    kernel = functools.partial(
        _conv_update_kernel, has_bias=bias is not None, use_silu=use_silu, spec=p.spec, width=K, state_len=R,
        max_query_len=p.max_query_len, conv_dim=dim, block_d=block_d, num_tokens=T, barrier=not interpret,
    )
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)),
        grid=(batch, pl.cdiv(dim, block_d)),
        input_output_aliases={len(operands) - 2: 0, len(operands) - 1: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"causal_conv1d_update_k{K}_r{R}_q{p.max_query_len}_bd{block_d}{'_spec' if p.spec else ''}",
    )(*operands)


def causal_conv1d_update(
    x,
    conv_state,
    weight,
    bias=None,
    *,
    activation=None,
    conv_state_indices,
    num_accepted_tokens=None,
    query_start_loc=None,
    pad_slot_id=PAD_SLOT_ID,
    dst_conv_state_indices=None,
    max_query_len=None,
    interpret=False,
    block_d=None,
    num_warps=None,
    num_stages=None,
):
    """Causal conv1d over each request's new tokens, updating conv states in place.

    Args:
      x: ``(T, conv_dim)`` new tokens: one per request without
        ``query_start_loc``, else packed with ``query_start_loc (batch + 1,)``.
      conv_state: ``(slots, conv_dim, R)`` DS layout, ``R >= K - 1`` (aliased to
        the returned state; donate it at the enclosing jit).
      weight: ``(conv_dim, K)``; bias: ``(conv_dim,)`` or None.
      activation: None or ``"silu"``.
      conv_state_indices: ``(batch,)`` or ``(batch, ncols)`` (column 0 is used).
      num_accepted_tokens: ``(batch,)``, speculative decoding (history offset).
      query_start_loc: ``(batch + 1,)`` token offsets; each request has at most
        ``max_query_len`` tokens (default ``R - K + 2``).
      pad_slot_id: index meaning "skip" (the null slot 0 is skipped as well).
      dst_conv_state_indices: optional ``(batch,)`` slots receiving the new state
        (default: the source slot).
      interpret, block_d, num_warps, num_stages: see ``default_block_sizes``.

    Returns:
      ``(out (T, conv_dim) in x.dtype, conv_state)``.
    """
    dim, R, K = check_conv_args(x, conv_state, weight, bias)
    maxq = resolve_max_query_len(R, K, query_start_loc, max_query_len)
    validate_conv_update_indices(conv_state.shape[0], x.shape[0], conv_state_indices, dst_conv_state_indices,
                                 num_accepted_tokens, query_start_loc, maxq, pad_slot_id)
    d = default_block_sizes(conv_state.dtype, dim)
    block_d = d["block_d"] if block_d is None else block_d
    if block_d < 1 or block_d & (block_d - 1):
        raise ValueError(f"block_d={block_d} must be a power of 2")
    return _conv_update_jit(
        x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens, query_start_loc,
        dst_conv_state_indices, use_silu=check_activation(activation), pad_slot_id=int(pad_slot_id),
        max_query_len=maxq, interpret=bool(interpret), block_d=int(block_d),
        num_warps=int(d["num_warps"] if num_warps is None else num_warps),
        num_stages=int(d["num_stages"] if num_stages is None else num_stages),
    )
