"""Plain-JAX ``selective_state_update`` (decode / speculative decode / varlen), and its index plan.

``normalize_ssu_args``, ``ssu_plan`` and ``validate_ssu_indices`` are shared with the
Pallas kernel in ``pallas_kernels/selective_state_update.py``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.layout import PAD_SLOT_ID
from pallas_kernels.reference.common import (
    check_query_start_loc,
    check_range,
    check_slots,
    concrete,
    expand_groups,
    kernel_slots,
    process_dt,
    shape_error,
    silu,
    take_along,
    take_rows,
)

_F32 = jnp.float32


class SsuArgs(NamedTuple):
    x: jax.Array  # (T, H, P)
    dt: jax.Array  # (T, H) or (T, H, P)
    dt_bias: jax.Array | None  # (H,) or (H, P), same "tied" form as dt
    A: jax.Array  # (H,) or (H, P, N)
    B: jax.Array  # (T, G, N)
    C: jax.Array  # (T, G, N)
    D: jax.Array | None  # (H, P) float32
    z: jax.Array | None  # (T, H, P)


def normalize_ssu_args(ssm_state, x, dt, A, B, C, D, z, dt_bias) -> SsuArgs:
    """Check vLLM's argument shapes and bring them to the kernel forms.

    dt, dt_bias and A may each be head-tied (``(T,H)``, ``(H,)``, ``(H,)``) or full
    (``(T,H,P)``, ``(H,P)``, ``(H,P,N)``). A tied dt with a full dt_bias is expanded.
    """
    if ssm_state.ndim != 4:
        raise shape_error(f"ssm_state must be (slots, H, P, N), got {ssm_state.shape}")
    _, H, P, N = ssm_state.shape
    if x.ndim != 3 or x.shape[1:] != (H, P):
        raise shape_error(f"x must be (T, {H}, {P}) to match ssm_state {ssm_state.shape}, got {x.shape}")
    T = x.shape[0]
    if dt.shape not in ((T, H), (T, H, P)):
        raise shape_error(f"dt must be ({T}, {H}) or ({T}, {H}, {P}), got {dt.shape}")
    if A.shape not in ((H,), (H, P, N)):
        raise shape_error(f"A must be ({H},) or ({H}, {P}, {N}), got {A.shape}")
    if B.ndim != 3 or B.shape[0] != T or B.shape[2] != N or H % B.shape[1]:
        raise shape_error(f"B must be ({T}, G, {N}) with G dividing {H}, got {B.shape}")
    if C.shape != B.shape:
        raise shape_error(f"C must have B's shape {B.shape}, got {C.shape}")
    if z is not None and z.shape != x.shape:
        raise shape_error(f"z must have x's shape {x.shape}, got {z.shape}")
    if D is not None:
        if D.shape not in ((H,), (H, P)):
            raise shape_error(f"D must be ({H},) or ({H}, {P}), got {D.shape}")
        D = jnp.broadcast_to(D.astype(_F32).reshape(H, -1), (H, P))
    if dt_bias is not None:
        if dt_bias.shape not in ((H,), (H, P)):
            raise shape_error(f"dt_bias must be ({H},) or ({H}, {P}), got {dt_bias.shape}")
        if dt.ndim == 2 and dt_bias.ndim == 2:
            dt = jnp.broadcast_to(dt[:, :, None], (T, H, P))
        if dt.ndim == 3 and dt_bias.ndim == 1:
            dt_bias = jnp.broadcast_to(dt_bias[:, None], (H, P))
    return SsuArgs(x, dt, dt_bias, A, B, C, D, z)


class SsuPlan(NamedTuple):
    src: jax.Array  # (batch,) int32 source slot, -1 = none (start from zeros)
    dst: jax.Array  # (batch, ncols) int32: per-token destinations if spec, else (batch, 1) final destination
    start: jax.Array  # (batch,) int32 first token of each request in x
    length: jax.Array  # (batch,) int32 tokens of each request
    spec: bool  # per-token destinations (see per_token_destinations)
    varlen: bool  # cu_seqlens given


def ssu_plan(
    num_slots: int,
    num_tokens: int,
    state_batch_indices,
    dst_state_batch_indices,
    num_accepted_tokens,
    cu_seqlens,
    pad_slot_id: int,
    max_query_len: int | None = None,
) -> SsuPlan:
    """Resolve vLLM's index arguments into per-request source/destination slots.

    Semantics of vLLM's ``selective_state_update`` (0.32 ``pad_slot_id`` / 0.33
    ``null_block_id``):

    * index arrays are ``(batch,)`` or ``(batch, ncols)``; 1-D means one column.
    * source column = ``max(num_accepted_tokens[b] - 1, 0)`` when given, else 0.
    * per-token destinations: with ``num_accepted_tokens`` (speculative
      decoding), and also with ``cu_seqlens`` when the destination array has
      more than one column, the state after the request's ``t``-th token goes to
      ``dst[b, t]`` (skipped entries are not written);
    * otherwise (one destination column) only the final state is written, to
      ``dst[b, 0]``, and only when the source is usable -- vLLM's in-place update,
      also for multi-token varlen requests.
    * ``dst_state_batch_indices`` defaults to ``state_batch_indices``.
    * ``max_query_len`` (varlen): a static bound on every request's length, so
      the token loop runs that many times rather than ``T - batch + 1`` (a mixed
      step's decode rows have ``1 + num_spec`` tokens at most, however many
      tokens the bucket holds). Longer requests are an error where the offsets
      are concrete (``validate_ssu_indices``); inside a trace they are cut.

    (vLLM's kernel keys per-token writes on ``num_accepted_tokens`` alone; it is
    never called with ``cu_seqlens``, several destination columns and no
    ``num_accepted_tokens``, which is where this project's multi-column
    contract -- one destination per token -- is applied.)
    """
    sbi, dsti = _request_index_rows(num_tokens, state_batch_indices, dst_state_batch_indices, cu_seqlens)
    batch = sbi.shape[0]
    spec = per_token_destinations(num_accepted_tokens, cu_seqlens, dsti.shape[1])
    if num_accepted_tokens is not None:
        na = jnp.asarray(num_accepted_tokens, jnp.int32).reshape(-1)[:batch]
        col = jnp.clip(na - 1, 0, sbi.shape[1] - 1)
    else:
        col = jnp.zeros((batch,), jnp.int32)
    src = kernel_slots(take_along(sbi, col[:, None], axis=1)[:, 0], num_slots, pad_slot_id)
    if spec:
        dst = kernel_slots(dsti, num_slots, pad_slot_id)
    else:
        dst = jnp.where(src[:, None] >= 0, kernel_slots(dsti[:, :1], num_slots, pad_slot_id), -1)
    start, length = _request_spans(num_tokens, batch, cu_seqlens, max_query_len)
    return SsuPlan(src, dst.astype(jnp.int32), start, length, spec, cu_seqlens is not None)


def _request_index_rows(num_tokens: int, state_batch_indices, dst_state_batch_indices, cu_seqlens):
    """The source and destination index arrays as int32 ``(batch, ncols)``, one row per request.

    Raises a shape error when either has fewer rows than there are requests (or, without ``cu_seqlens``,
    ``state_batch_indices`` is not one row per token).
    """
    sbi = jnp.asarray(state_batch_indices, jnp.int32)
    if sbi.ndim == 1:
        sbi = sbi[:, None]
    if sbi.ndim != 2:
        raise shape_error(f"state_batch_indices must be 1-D or 2-D, got {sbi.shape}")
    if dst_state_batch_indices is None:
        dsti = sbi
    else:
        dsti = jnp.asarray(dst_state_batch_indices, jnp.int32)
        if dsti.ndim == 1:
            dsti = dsti[:, None]
    if cu_seqlens is None:
        batch = num_tokens
        if sbi.shape[0] != batch:
            raise shape_error(
                f"without cu_seqlens, state_batch_indices needs one row per token ({batch}), got {sbi.shape}"
            )
    else:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        batch = cu.shape[0] - 1
        if sbi.shape[0] < batch:
            raise shape_error(f"state_batch_indices has {sbi.shape[0]} rows, cu_seqlens has {batch} requests")
    if dsti.shape[0] < batch:
        raise shape_error(f"dst_state_batch_indices has {dsti.shape[0]} rows for {batch} requests")
    return sbi[:batch], dsti[:batch]


def _request_spans(num_tokens: int, batch: int, cu_seqlens, max_query_len: int | None):
    """Each request's first token in x and its token count, int32 ``(batch,)`` each."""
    if cu_seqlens is None:
        start = jnp.arange(batch, dtype=jnp.int32)
        length = jnp.ones((batch,), jnp.int32)
    else:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        start = jnp.clip(cu[:-1], 0, num_tokens)
        length = jnp.clip(cu[1:] - cu[:-1], 0, num_tokens - start)
        if max_query_len is not None:
            length = jnp.minimum(length, max_query_len)
    return start, length


def per_token_destinations(num_accepted_tokens, cu_seqlens, dst_columns: int) -> bool:
    """Whether ``selective_state_update`` writes every token's state (see ``ssu_plan``)."""
    return num_accepted_tokens is not None or (cu_seqlens is not None and dst_columns > 1)


def validate_ssu_indices(
    num_slots, num_tokens, state_batch_indices, dst_state_batch_indices, num_accepted_tokens, cu_seqlens, pad_slot_id,
    max_query_len=None,
) -> None:
    """Raise ``SlotError``/``MetadataError`` for bad concrete index arguments (no-op on tracers)."""
    if max_query_len is not None:
        if int(max_query_len) < 1:
            raise shape_error(f"max_query_len={max_query_len} must be >= 1")
        if cu_seqlens is None:
            raise shape_error("max_query_len bounds varlen requests: it needs cu_seqlens")
        if concrete(cu_seqlens) is not None:
            check_range("request length (from cu_seqlens) ", np.diff(concrete(cu_seqlens)), 0, int(max_query_len))
    check_slots("state_batch_indices", state_batch_indices, num_slots, pad_slot_id)
    if dst_state_batch_indices is not None:
        check_slots("dst_state_batch_indices", dst_state_batch_indices, num_slots, pad_slot_id)
    if cu_seqlens is not None:
        check_query_start_loc("cu_seqlens", cu_seqlens, num_tokens)
    sbi = np.shape(state_batch_indices)
    if num_accepted_tokens is not None:
        check_range("num_accepted_tokens", num_accepted_tokens, 0, sbi[1] if len(sbi) == 2 else 1)
    dshape = np.shape(dst_state_batch_indices if dst_state_batch_indices is not None else state_batch_indices)
    dcols = dshape[1] if len(dshape) == 2 else 1
    if per_token_destinations(num_accepted_tokens, cu_seqlens, dcols) and concrete(cu_seqlens) is not None:
        check_range("request length (from cu_seqlens) ", np.diff(concrete(cu_seqlens)), 0, dcols)


def selective_state_update_reference(
    ssm_state,
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    *,
    dt_softplus=False,
    state_batch_indices,
    dst_state_batch_indices=None,
    num_accepted_tokens=None,
    cu_seqlens=None,
    pad_slot_id=PAD_SLOT_ID,
    max_query_len=None,
    interpret=None,
    **unused_block_sizes,
):
    """Plain-JAX ``selective_state_update``; same contract as the Pallas kernel.

    Returns ``(out (T, H, P) in x.dtype, ssm_state)``. Tokens that belong to no
    request (varlen padding) get zeros.
    """
    del interpret, unused_block_sizes
    validate_ssu_indices(
        ssm_state.shape[0], x.shape[0], state_batch_indices, dst_state_batch_indices, num_accepted_tokens,
        cu_seqlens, pad_slot_id, max_query_len,
    )
    return _ssu_reference_jit(
        ssm_state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dst_state_batch_indices,
        num_accepted_tokens, cu_seqlens, dt_softplus=bool(dt_softplus), pad_slot_id=int(pad_slot_id),
        max_query_len=None if max_query_len is None else int(max_query_len),
    )


def _advance(s, xt, dtt, Bt, A_full):
    """One token's state update, float32: ``s (batch, H, P, N)`` -> ``s * exp(A dt) + dt B x``."""
    dA = jnp.exp(A_full[None] * dtt[..., None])  # (batch, H, 1|P, 1|N)
    return s * dA + (Bt[:, :, None, :] * dtt[..., None]) * xt[..., None]


def _read_out(s, xt, Ct, D, z):
    """The token's output from its new state ``s``: ``C s (+ D x) (* silu(z))``, float32 ``(batch, H, P)``."""
    # A batched matvec, not sum(s * C): XLA CPU runs that reduction ~2x slower (a decode step's
    # largest Mamba op after the projections).
    y = jnp.einsum("bhpn,bhn->bhp", s, Ct, precision=jax.lax.Precision.HIGHEST)
    if D is not None:
        y = y + xt * D[None]
    if z is not None:
        y = y * silu(z.astype(_F32))
    return y


def selective_state_update_rows(ssm_state, x, dt, A, B, C, D=None, z=None, dt_bias=None, *, dt_softplus=False,
                                active):
    """``selective_state_update`` over states held per batch row, without index arrays: token ``r`` is row
    ``r``'s only token and ``ssm_state[r]`` its state (``(R, H, P, N)``, a working set gathered from the
    cache). Rows where ``active`` (``bool[R]``) is False keep their state and output zeros. The same
    float32 arithmetic as the reference, minus its gather and scatter: a multi-step decode window keeps
    its rows' states in this form between steps (a CPU step spent ~15% of its time in the scatter).
    Returns ``(out (R, H, P) in x.dtype, ssm_state)``."""
    a = normalize_ssu_args(ssm_state, x, dt, A, B, C, D, z, dt_bias)
    H = ssm_state.shape[1]
    if x.shape[0] != ssm_state.shape[0] or active.shape != (x.shape[0],):
        raise shape_error(f"rows: {x.shape[0]} tokens, {ssm_state.shape[0]} states, active {active.shape}")
    A32 = a.A.astype(_F32)
    A_full = A32[:, None, None] if A32.ndim == 1 else A32
    xt = a.x.astype(_F32)
    dtt = process_dt(a.dt, a.dt_bias, dt_softplus)
    dtt = dtt[:, :, None] if dtt.ndim == 2 else dtt
    s = jnp.where(active[:, None, None, None], _advance(ssm_state.astype(_F32), xt, dtt,
                                                        expand_groups(a.B.astype(_F32), H), A_full),
                  ssm_state.astype(_F32))
    y = _read_out(s, xt, expand_groups(a.C.astype(_F32), H), a.D, a.z)
    out = jnp.where(active[:, None, None], y, 0.0)
    return out.astype(x.dtype), s.astype(ssm_state.dtype)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "pad_slot_id", "max_query_len"))
def _ssu_reference_jit(
    ssm_state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dst_state_batch_indices,
    num_accepted_tokens, cu_seqlens, *, dt_softplus, pad_slot_id, max_query_len,
):
    num_slots, H, P, N = ssm_state.shape
    a = normalize_ssu_args(ssm_state, x, dt, A, B, C, D, z, dt_bias)
    T = x.shape[0]
    plan = ssu_plan(
        num_slots, T, state_batch_indices, dst_state_batch_indices, num_accepted_tokens, cu_seqlens, pad_slot_id,
        max_query_len,
    )
    batch = plan.src.shape[0]
    max_len = 1 if not plan.varlen else (plan.dst.shape[1] if plan.spec else max(1, T - batch + 1))
    if plan.varlen and max_query_len is not None:
        max_len = min(max_len, max_query_len)
    A32 = a.A.astype(_F32)
    A_full = A32[:, None, None] if A32.ndim == 1 else A32  # (H,1,1) or (H,P,N)
    s = take_rows(ssm_state, jnp.maximum(plan.src, 0)).astype(_F32)  # (batch, H, P, N)
    s = jnp.where((plan.src >= 0)[:, None, None, None], s, 0.0)
    out = jnp.zeros((T + 1, H, P), _F32)  # row T: sink for inactive tokens
    state = ssm_state

    def step(j, carry):
        s, out, state = carry
        active = j < plan.length
        tok = jnp.where(active, plan.start + j, T)
        tokc = jnp.minimum(tok, T - 1)
        xt = take_rows(a.x, tokc).astype(_F32)  # (batch, H, P)
        dtt = process_dt(take_rows(a.dt, tokc), a.dt_bias, dt_softplus)  # (batch,H) or (batch,H,P)
        dtt = dtt[:, :, None] if dtt.ndim == 2 else dtt  # (batch, H, 1|P)
        Bt = expand_groups(take_rows(a.B, tokc).astype(_F32), H)  # (batch, H, N)
        Ct = expand_groups(take_rows(a.C, tokc).astype(_F32), H)
        s = jnp.where(active[:, None, None, None], _advance(s, xt, dtt, Bt, A_full), s)
        y = _read_out(s, xt, Ct, a.D, None if a.z is None else take_rows(a.z, tokc))
        out = out.at[tok].set(y)
        if plan.spec:
            col = jnp.minimum(j, plan.dst.shape[1] - 1)
            d = plan.dst[:, col]
            ok = active & (d >= 0) & (j < plan.dst.shape[1])
            state = state.at[jnp.where(ok, d, num_slots)].set(s.astype(state.dtype), mode="drop")
        return s, out, state

    s, out, state = jax.lax.fori_loop(0, max_len, step, (s, out, state))
    if not plan.spec:
        d = plan.dst[:, 0]
        state = state.at[jnp.where(d >= 0, d, num_slots)].set(s.astype(state.dtype), mode="drop")
    return out[:T].astype(x.dtype), state

