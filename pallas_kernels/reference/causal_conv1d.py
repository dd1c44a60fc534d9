"""Plain-JAX ``causal_conv1d_update`` (decode, DS layout) and ``causal_conv1d_varlen`` (prefill).

The plans (``conv_update_plan``, ``conv_varlen_plan``), argument checks and index
validation are shared with the Pallas kernels in ``pallas_kernels/causal_conv1d_*.py``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.layout import NULL_SLOT, PAD_SLOT_ID
from pallas_kernels.reference.common import (
    check_query_start_loc,
    check_range,
    check_slots,
    concrete,
    kernel_slots,
    shape_error,
    silu,
    take_along,
    take_rows,
)

_F32 = jnp.float32


# ----------------------------------------------------------------------------
# causal_conv1d_update (decode / speculative decode), DS layout
# ----------------------------------------------------------------------------


class ConvUpdatePlan(NamedTuple):
    src: jax.Array  # (batch,) int32 slot to read, -1 = skip the row entirely
    dst: jax.Array  # (batch,) int32 slot to write, -1 = no write
    start: jax.Array  # (batch,) first token in x
    length: jax.Array  # (batch,) tokens (<= max_query_len)
    offset: jax.Array  # (batch,) history offset (num_accepted - 1), 0 without spec
    max_query_len: int
    spec: bool


def conv_update_plan(
    num_slots: int,
    num_tokens: int,
    state_len: int,
    width: int,
    conv_state_indices,
    dst_conv_state_indices,
    num_accepted_tokens,
    query_start_loc,
    max_query_len,
    pad_slot_id: int,
) -> ConvUpdatePlan:
    """Resolve ``causal_conv1d_update``'s index arguments (vLLM semantics).

    ``conv_state_indices`` may be 2-D: column 0 is used (vLLM). Without
    ``query_start_loc`` there is one token per row. ``max_query_len`` (vLLM's
    argument) defaults to ``state_len - width + 2`` (= ``1 + num_spec``) with
    ``query_start_loc`` and to 1 without.
    """
    idx = jnp.asarray(conv_state_indices, jnp.int32)
    if idx.ndim == 2:
        idx = idx[:, 0]
    batch = num_tokens if query_start_loc is None else jnp.asarray(query_start_loc).shape[0] - 1
    maxq = resolve_max_query_len(state_len, width, query_start_loc, max_query_len)
    if maxq < 1:
        raise shape_error(f"max_query_len={maxq} must be >= 1 (conv state has {state_len} rows, width {width})")
    if idx.shape[0] < batch:
        raise shape_error(f"conv_state_indices has {idx.shape[0]} rows for {batch} requests")
    idx = idx[:batch]
    spec = num_accepted_tokens is not None
    if spec and state_len < width - 2 + maxq:
        raise shape_error(
            f"speculative conv update needs state_len >= width - 2 + max_query_len = {width - 2 + maxq}, "
            f"got state_len={state_len}"
        )
    if dst_conv_state_indices is None:
        dsti = idx
    else:
        dsti = jnp.asarray(dst_conv_state_indices, jnp.int32)
        dsti = (dsti[:, 0] if dsti.ndim == 2 else dsti)[:batch]
    src = kernel_slots(idx, num_slots, pad_slot_id)
    dst = jnp.where(src >= 0, kernel_slots(dsti, num_slots, pad_slot_id), -1).astype(jnp.int32)
    if query_start_loc is None:
        start = jnp.arange(batch, dtype=jnp.int32)
        length = jnp.ones((batch,), jnp.int32)
    else:
        q = jnp.asarray(query_start_loc, jnp.int32)
        start = jnp.clip(q[:-1], 0, num_tokens)
        length = jnp.clip(q[1:] - q[:-1], 0, jnp.minimum(num_tokens - start, maxq))
    if spec:
        na = jnp.asarray(num_accepted_tokens, jnp.int32).reshape(-1)[:batch]
        offset = jnp.clip(na - 1, 0, maxq - 1)
    else:
        offset = jnp.zeros((batch,), jnp.int32)
    return ConvUpdatePlan(src, dst, start, length, offset.astype(jnp.int32), maxq, spec)


def validate_conv_update_indices(
    num_slots, num_tokens, conv_state_indices, dst_conv_state_indices, num_accepted_tokens, query_start_loc,
    max_query_len, pad_slot_id,
) -> None:
    """Raise ``SlotError``/``MetadataError`` for bad concrete index arguments (no-op on tracers).

    ``max_query_len`` is the resolved value (see ``conv_update_plan``).
    """
    check_slots("conv_state_indices", conv_state_indices, num_slots, pad_slot_id)
    if dst_conv_state_indices is not None:
        check_slots("dst_conv_state_indices", dst_conv_state_indices, num_slots, pad_slot_id)
    q = concrete(query_start_loc)
    if query_start_loc is not None:
        check_query_start_loc("query_start_loc", query_start_loc, num_tokens)
        if q is not None:
            check_range("request length (from query_start_loc) ", np.diff(q), 0, max_query_len)
    idx = concrete(conv_state_indices)
    if num_accepted_tokens is not None and idx is not None:
        idx = idx[:, 0] if idx.ndim == 2 else idx
        live = (idx != pad_slot_id) & (idx > NULL_SLOT) & (idx < num_slots)
        if q is not None:
            live = live[: len(q) - 1] & (np.diff(q) > 0)
        na = concrete(num_accepted_tokens)
        if na is not None:
            check_range("num_accepted_tokens", na.reshape(-1)[: len(live)], 1, max_query_len, where=live)


def resolve_max_query_len(state_len, width, query_start_loc, max_query_len) -> int:
    """vLLM's ``max_query_len``: given, else ``1 + num_spec = R - K + 2`` with ``query_start_loc``, else 1."""
    if query_start_loc is None:
        return 1
    return int(max_query_len) if max_query_len is not None else state_len - width + 2


def check_conv_args(x, conv_state, weight, bias):
    if conv_state.ndim != 3:
        raise shape_error(f"conv_state must be (slots, conv_dim, R) (DS layout), got {conv_state.shape}")
    _, dim, R = conv_state.shape
    if x.ndim != 2 or x.shape[1] != dim:
        raise shape_error(f"x must be (num_tokens, {dim}) to match conv_state {conv_state.shape}, got {x.shape}")
    if weight.ndim != 2 or weight.shape[0] != dim:
        raise shape_error(f"weight must be ({dim}, K), got {weight.shape}")
    K = weight.shape[1]
    if K < 2 or R < K - 1:
        raise shape_error(f"conv width K={K} needs K >= 2 and conv_state rows R={R} >= K-1")
    if bias is not None and bias.shape != (dim,):
        raise shape_error(f"bias must be ({dim},), got {bias.shape}")
    return dim, R, K


def check_activation(activation):
    if activation in (True, "silu", "swish"):
        return True
    if activation in (None, False):
        return False
    raise shape_error(f"activation must be None or 'silu', got {activation!r}")


def causal_conv1d_update_reference(
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
    interpret=None,
    **unused_block_sizes,
):
    """Plain-JAX ``causal_conv1d_update``; same contract as the Pallas kernel."""
    del interpret, unused_block_sizes
    dim, R, K = check_conv_args(x, conv_state, weight, bias)
    maxq = resolve_max_query_len(R, K, query_start_loc, max_query_len)
    validate_conv_update_indices(
        conv_state.shape[0], x.shape[0], conv_state_indices, dst_conv_state_indices, num_accepted_tokens,
        query_start_loc, maxq, pad_slot_id,
    )
    return _conv_update_reference_jit(
        x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens, query_start_loc,
        dst_conv_state_indices, use_silu=check_activation(activation), pad_slot_id=int(pad_slot_id),
        max_query_len=maxq,
    )


@functools.partial(jax.jit, static_argnames=("use_silu", "pad_slot_id", "max_query_len"))
def _conv_update_reference_jit(
    x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens, query_start_loc,
    dst_conv_state_indices, *, use_silu, pad_slot_id, max_query_len,
):
    dim, R, K = check_conv_args(x, conv_state, weight, bias)
    num_slots, T = conv_state.shape[0], x.shape[0]
    p = conv_update_plan(
        num_slots, T, R, K, conv_state_indices, dst_conv_state_indices, num_accepted_tokens,
        query_start_loc, max_query_len, pad_slot_id,
    )
    maxq = p.max_query_len
    sdt = conv_state.dtype
    process = (p.src >= 0) & (p.length > 0)
    old = take_rows(conv_state, jnp.maximum(p.src, 0))  # (batch, dim, R)
    old = jnp.where(process[:, None, None], old, jnp.zeros((), sdt))
    j = jnp.arange(maxq)
    tok_ok = j[None, :] < p.length[:, None]  # (batch, maxq)
    tok = jnp.minimum(p.start[:, None] + j[None, :], T - 1)
    xt = jnp.where(tok_ok[..., None], take_rows(x, tok).astype(sdt), jnp.zeros((), sdt))  # (batch, maxq, dim)
    hist_cols = p.offset[:, None] + jnp.arange(K - 1)[None, :]  # (batch, K-1)
    hist = take_along(old, hist_cols[:, None, :], axis=2)  # (batch, dim, K-1)
    window = jnp.concatenate([hist, jnp.swapaxes(xt, 1, 2)], axis=2).astype(_F32)  # (batch, dim, K-1+maxq)
    w = weight.astype(_F32)
    acc = jnp.zeros((p.src.shape[0], maxq, dim), _F32)
    if bias is not None:
        acc = acc + bias.astype(_F32)
    for k in range(K):
        acc = acc + jnp.swapaxes(window[:, :, k : k + maxq], 1, 2) * w[:, k]
    if use_silu:
        acc = silu(acc)
    # New state (vLLM's sliding window): with keep = R - max_query_len,
    #   row i < keep            <- old row i + shift   (shift = num_accepted (spec) or query_len)
    #   keep <= i < keep + len  <- new token i - keep
    #   rows >= keep + len keep the destination's own values.
    i = jnp.arange(R)
    keep = R - maxq
    shift = p.offset + 1 if p.spec else p.length
    shift_cols = jnp.clip(i[None, :] + shift[:, None], 0, R - 1)  # (batch, R)
    from_old = take_along(old, shift_cols[:, None, :], axis=2)
    xi = jnp.broadcast_to(jnp.clip(i - keep, 0, maxq - 1)[None, None, :], (old.shape[0], 1, R))
    from_x = take_along(jnp.swapaxes(xt, 1, 2), xi, axis=2)
    new = jnp.where((i < keep)[None, None, :], from_old, from_x)
    s_eff = keep + p.length  # (batch,)
    write = (p.dst >= 0) & process
    cur_dst = take_rows(conv_state, jnp.maximum(p.dst, 0))
    rows = jnp.where((i[None, :] < s_eff[:, None])[:, None, :], new.astype(sdt), cur_dst)
    conv_state = conv_state.at[jnp.where(write, p.dst, num_slots)].set(rows, mode="drop")
    # Outputs: processed tokens get the conv; everything else keeps x (vLLM writes in place into x).
    out_tok = jnp.where(tok_ok & process[:, None], p.start[:, None] + j[None, :], T)
    out = jnp.concatenate([x, jnp.zeros((1, dim), x.dtype)], axis=0)
    out = out.at[out_tok.reshape(-1)].set(acc.reshape(-1, dim).astype(x.dtype))
    return out[:T], conv_state


# ----------------------------------------------------------------------------
# causal_conv1d_varlen (prefill over packed tokens)
# ----------------------------------------------------------------------------


class ConvVarlenPlan(NamedTuple):
    src: jax.Array  # (batch,) slot whose first K-1 rows are the initial history, -1 = zeros
    dst: jax.Array  # (batch,) slot that receives the final K-1 rows, -1 = no write
    start: jax.Array  # (batch,)
    length: jax.Array  # (batch,)
    bnd_pos: jax.Array  # (batch, nb) tokens after which to snapshot (<=0 or >length: none)
    bnd_dst: jax.Array  # (batch, nb) snapshot slots, -1 = none


def conv_varlen_plan(
    num_slots: int,
    num_tokens: int,
    query_start_loc,
    cache_indices,
    has_initial_state,
    dst_cache_indices,
    block_boundary_indices,
    block_boundary_slots,
    pad_slot_id: int,
) -> ConvVarlenPlan:
    q = jnp.asarray(query_start_loc, jnp.int32)
    batch = q.shape[0] - 1
    ci = jnp.asarray(cache_indices, jnp.int32)
    ci = (ci[:, 0] if ci.ndim == 2 else ci)[:batch]
    di = ci if dst_cache_indices is None else jnp.asarray(dst_cache_indices, jnp.int32).reshape(-1)[:batch]
    if has_initial_state is None:
        has_init = jnp.zeros((batch,), bool)
    else:
        has_init = jnp.asarray(has_initial_state).reshape(-1)[:batch].astype(bool)
    src = jnp.where(has_init, kernel_slots(ci, num_slots, pad_slot_id), -1).astype(jnp.int32)
    dst = kernel_slots(di, num_slots, pad_slot_id)
    start = jnp.clip(q[:-1], 0, num_tokens)
    length = jnp.clip(q[1:] - q[:-1], 0, num_tokens - start)
    if (block_boundary_indices is None) != (block_boundary_slots is None):
        raise shape_error("block_boundary_indices and block_boundary_slots go together")
    if block_boundary_indices is None:
        bnd_pos = jnp.zeros((batch, 1), jnp.int32)
        bnd_dst = jnp.full((batch, 1), -1, jnp.int32)
    else:
        bnd_pos = jnp.asarray(block_boundary_indices, jnp.int32)
        bslots = jnp.asarray(block_boundary_slots, jnp.int32)
        if bnd_pos.ndim != 2 or bnd_pos.shape != bslots.shape or bnd_pos.shape[0] < batch:
            raise shape_error(
                f"block_boundary_indices {bnd_pos.shape} and block_boundary_slots {bslots.shape} must be "
                f"(batch >= {batch}, nb) and equal"
            )
        bnd_pos, bslots = bnd_pos[:batch], bslots[:batch]
        ok = (bnd_pos >= 1) & (bnd_pos <= length[:, None])
        bnd_dst = jnp.where(ok, kernel_slots(bslots, num_slots, pad_slot_id), -1).astype(jnp.int32)
    return ConvVarlenPlan(src, dst, start, length, bnd_pos, bnd_dst)


def validate_conv_varlen_indices(
    num_slots, num_tokens, query_start_loc, cache_indices, dst_cache_indices, block_boundary_slots, pad_slot_id
) -> None:
    """Raise ``SlotError``/``MetadataError`` for bad concrete index arguments (no-op on tracers)."""
    check_query_start_loc("query_start_loc", query_start_loc, num_tokens)
    check_slots("cache_indices", cache_indices, num_slots, pad_slot_id)
    if dst_cache_indices is not None:
        check_slots("dst_cache_indices", dst_cache_indices, num_slots, pad_slot_id)
    if block_boundary_slots is not None:
        check_slots("block_boundary_slots", block_boundary_slots, num_slots, pad_slot_id)


def causal_conv1d_varlen_reference(
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
    interpret=None,
    **unused_block_sizes,
):
    """Plain-JAX ``causal_conv1d_varlen``; same contract as the Pallas kernel."""
    del interpret, unused_block_sizes
    check_conv_args(x, conv_state, weight, bias)
    validate_conv_varlen_indices(
        conv_state.shape[0], x.shape[0], query_start_loc, cache_indices, dst_cache_indices, block_boundary_slots,
        pad_slot_id,
    )
    return _conv_varlen_reference_jit(
        x, conv_state, weight, bias, query_start_loc, cache_indices, has_initial_state, dst_cache_indices,
        block_boundary_indices, block_boundary_slots, use_silu=check_activation(activation),
        pad_slot_id=int(pad_slot_id),
    )


@functools.partial(jax.jit, static_argnames=("use_silu", "pad_slot_id"))
def _conv_varlen_reference_jit(
    x, conv_state, weight, bias, query_start_loc, cache_indices, has_initial_state, dst_cache_indices,
    block_boundary_indices, block_boundary_slots, *, use_silu, pad_slot_id,
):
    dim, R, K = check_conv_args(x, conv_state, weight, bias)
    num_slots, T = conv_state.shape[0], x.shape[0]
    p = conv_varlen_plan(
        num_slots, T, query_start_loc, cache_indices, has_initial_state, dst_cache_indices,
        block_boundary_indices, block_boundary_slots, pad_slot_id,
    )
    batch = p.src.shape[0]
    sdt = conv_state.dtype
    init = conv_state[jnp.maximum(p.src, 0), :, : K - 1]  # (batch, dim, K-1)
    init = jnp.where((p.src >= 0)[:, None, None], init, jnp.zeros((), sdt))
    xs = x.astype(sdt)
    t = jnp.arange(T)
    q = jnp.asarray(query_start_loc, jnp.int32)
    seq = jnp.clip(jnp.searchsorted(q, t, side="right") - 1, 0, batch - 1)
    covered = (t >= q[0]) & (t < q[batch])
    pos = t - take_rows(p.start, seq)
    acc = jnp.zeros((T, dim), _F32)
    if bias is not None:
        acc = acc + bias.astype(_F32)
    w = weight.astype(_F32)
    for k in range(K):
        qk = pos - (K - 1) + k  # position of the source token within the request
        xv = take_rows(xs, jnp.clip(t - (K - 1) + k, 0, T - 1))
        hv = init[seq, :, jnp.clip(K - 1 + qk, 0, K - 2)]  # (T, dim)
        v = jnp.where((qk >= 0)[:, None], xv, hv).astype(_F32)
        acc = acc + v * w[:, k]
    if use_silu:
        acc = silu(acc)
    out = jnp.where(covered[:, None], acc, 0.0).astype(x.dtype)

    def state_after(n):
        """(batch, dim, K-1): the conv history after each request's first ``n`` tokens."""
        r = jnp.arange(K - 1)
        qr = n[:, None] - (K - 1) + r[None, :]  # (batch, K-1)
        xv = take_rows(xs, jnp.clip(p.start[:, None] + qr, 0, T - 1))  # (batch, K-1, dim)
        hv = take_along(init, jnp.clip(n[:, None] + r[None, :], 0, K - 2)[:, None, :], axis=2)
        return jnp.where((qr >= 0)[:, None, :], jnp.swapaxes(xv, 1, 2), hv)

    for jb in range(p.bnd_pos.shape[1]):
        snap = state_after(p.bnd_pos[:, jb])
        d = p.bnd_dst[:, jb]
        conv_state = conv_state.at[jnp.where(d >= 0, d, num_slots), :, : K - 1].set(snap, mode="drop")
    final = state_after(p.length)
    d = jnp.where(p.length > 0, p.dst, -1)
    conv_state = conv_state.at[jnp.where(d >= 0, d, num_slots), :, : K - 1].set(final, mode="drop")
    return out, conv_state

