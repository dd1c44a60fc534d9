"""Plain-JAX (XLA) references of the four Mamba2 state kernels, and the shared semantics.

Everything here runs under ``jax.jit`` on any backend. The Pallas kernels in this
package are tested against these functions, the model can run on them
(``backend="reference"``), and the benchmark measures the kernels against them.

Slot conventions (DESIGN.md sections 3 and 9), shared by every op:

* A slot index is *usable* when ``NULL_SLOT < index < num_slots`` and
  ``index != pad_slot_id``. ``PAD_SLOT_ID`` (-1, vLLM <= 0.32) and the null slot
  ``0`` (vLLM 0.33's ``null_block_id``) both mean "skip": a skipped source is
  never read (the state starts from zeros instead) and a skipped destination is
  never written. Out-of-range indices are skipped too, so under ``jit`` a bad
  index can never reach memory; outside ``jit`` the public wrappers raise
  ``SlotError`` for them first (interpret mode would otherwise clamp silently).
* Inside kernels an index array holds either a usable slot or ``-1``; the
  wrappers map every skipped entry to ``-1`` and kernels guard on ``>= 0``, so
  ``-1`` is never used as an address.

Numerics follow HuggingFace transformers' Mamba2 torch path and vLLM's kernels:
``dt = softplus(dt + dt_bias)`` (threshold 20), clamped to ``dt_limit``;
``h <- exp(dt*A) h + dt * x B^T``; ``y = h C + D x``; ``y *= silu(z)`` when ``z``
is given. Accumulation is float32; states keep their storage dtype.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.errors import JaxMambaError, MetadataError, SlotError
from jaxmamba.layout import NULL_SLOT, PAD_SLOT_ID
# The model's masked-cumsum segment sum (no difference of cumsums) serves the SSD reference too.
from jaxmamba.model.ops import segment_sum as stable_segsum

__all__ = [
    "selective_state_update_reference",
    "causal_conv1d_update_reference",
    "causal_conv1d_varlen_reference",
    "ssd_chunk_scan_varlen_reference",
    "ssd_chunk_metadata",
    "naive_ssm_recurrence",
    "slot_usable",
]

_F32 = jnp.float32


# ----------------------------------------------------------------------------
# Small numeric helpers (also used inside the Pallas kernels: plain jnp only)
# ----------------------------------------------------------------------------


def softplus(v):
    """torch/vLLM softplus with threshold 20: ``v`` above 20, else ``log1p(exp(v))``."""
    return jnp.where(v > 20.0, v, jnp.log1p(jnp.exp(jnp.minimum(v, 20.0))))


def silu(v):
    return v / (1.0 + jnp.exp(-v))


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def process_dt(dt, dt_bias, dt_softplus: bool, dt_limit=(0.0, math.inf)):
    """``dt (+ dt_bias)``, softplus, clamp to ``dt_limit`` (float32)."""
    dt = dt.astype(_F32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(_F32)
    if dt_softplus:
        dt = softplus(dt)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    if lo > 0.0 or hi < math.inf:
        dt = jnp.clip(dt, lo, hi)
    return dt


def slot_usable(index, num_slots: int, pad_slot_id: int = PAD_SLOT_ID):
    """True where ``index`` names a real slot (not PAD, not the null slot, in range)."""
    index = jnp.asarray(index)
    return (index != pad_slot_id) & (index > NULL_SLOT) & (index < num_slots)


def kernel_slots(index, num_slots: int, pad_slot_id: int = PAD_SLOT_ID):
    """Map an index array to the kernels' convention: a usable slot, or -1 (skip)."""
    index = jnp.asarray(index, jnp.int32)
    return jnp.where(slot_usable(index, num_slots, pad_slot_id), index, -1).astype(jnp.int32)


# ----------------------------------------------------------------------------
# Validation of concrete index arrays (skipped under jit: the caller validates)
# ----------------------------------------------------------------------------


def concrete(a):
    """``a`` as a numpy array when its value is known now, else None (traced under jit)."""
    if a is None or isinstance(a, getattr(jax.core, "Tracer", ())):
        return None
    try:
        return np.asarray(a)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_slots(name: str, index, num_slots: int, pad_slot_id: int) -> None:
    """Raise ``SlotError`` if a concrete index array has an entry outside
    ``[0, num_slots)`` that is not ``pad_slot_id`` (the null slot 0 is allowed)."""
    a = concrete(index)
    if a is None:
        return
    bad = (a != pad_slot_id) & ((a < 0) | (a >= num_slots))
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise SlotError(
            f"{name}{list(pos)} = {int(a[pos])} is out of range: slots are [0, {num_slots}) "
            f"and pad_slot_id={pad_slot_id}"
        )


def check_query_start_loc(name: str, qsl, num_tokens: int) -> None:
    """Raise ``MetadataError`` unless a concrete ``qsl`` is non-decreasing within ``[0, num_tokens]``."""
    a = concrete(qsl)
    if a is None:
        return
    if a.ndim != 1 or a.shape[0] < 1:
        raise MetadataError(f"{name} must be 1-D with batch+1 entries, got shape {a.shape}")
    if (a < 0).any() or (a > num_tokens).any():
        raise MetadataError(f"{name}={a.tolist()} has entries outside [0, {num_tokens}] (num_tokens)")
    if (np.diff(a) < 0).any():
        raise MetadataError(f"{name}={a.tolist()} is not non-decreasing")


def check_range(name: str, values, lo: int, hi: int, where=None) -> None:
    """Raise ``MetadataError`` if a concrete array has entries outside ``[lo, hi]`` (where ``where``)."""
    a = concrete(values)
    if a is None:
        return
    bad = (a < lo) | (a > hi)
    w = concrete(where)
    if w is not None:
        bad &= w.astype(bool)
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise MetadataError(f"{name}{list(i)} = {int(a[i])} is outside [{lo}, {hi}]")


def _shape_error(msg: str) -> JaxMambaError:
    return JaxMambaError(msg)


# ----------------------------------------------------------------------------
# selective_state_update: argument normalization and index plan
# ----------------------------------------------------------------------------


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
        raise _shape_error(f"ssm_state must be (slots, H, P, N), got {ssm_state.shape}")
    _, H, P, N = ssm_state.shape
    if x.ndim != 3 or x.shape[1:] != (H, P):
        raise _shape_error(f"x must be (T, {H}, {P}) to match ssm_state {ssm_state.shape}, got {x.shape}")
    T = x.shape[0]
    if dt.shape not in ((T, H), (T, H, P)):
        raise _shape_error(f"dt must be ({T}, {H}) or ({T}, {H}, {P}), got {dt.shape}")
    if A.shape not in ((H,), (H, P, N)):
        raise _shape_error(f"A must be ({H},) or ({H}, {P}, {N}), got {A.shape}")
    if B.ndim != 3 or B.shape[0] != T or B.shape[2] != N or H % B.shape[1]:
        raise _shape_error(f"B must be ({T}, G, {N}) with G dividing {H}, got {B.shape}")
    if C.shape != B.shape:
        raise _shape_error(f"C must have B's shape {B.shape}, got {C.shape}")
    if z is not None and z.shape != x.shape:
        raise _shape_error(f"z must have x's shape {x.shape}, got {z.shape}")
    if D is not None:
        if D.shape not in ((H,), (H, P)):
            raise _shape_error(f"D must be ({H},) or ({H}, {P}), got {D.shape}")
        D = jnp.broadcast_to(D.astype(_F32).reshape(H, -1), (H, P))
    if dt_bias is not None:
        if dt_bias.shape not in ((H,), (H, P)):
            raise _shape_error(f"dt_bias must be ({H},) or ({H}, {P}), got {dt_bias.shape}")
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

    (vLLM's kernel keys per-token writes on ``num_accepted_tokens`` alone; it is
    never called with ``cu_seqlens``, several destination columns and no
    ``num_accepted_tokens``, which is where the issue-4 contract -- one
    destination per token -- is applied.)
    """
    sbi = jnp.asarray(state_batch_indices, jnp.int32)
    if sbi.ndim == 1:
        sbi = sbi[:, None]
    if sbi.ndim != 2:
        raise _shape_error(f"state_batch_indices must be 1-D or 2-D, got {sbi.shape}")
    if dst_state_batch_indices is None:
        dsti = sbi
    else:
        dsti = jnp.asarray(dst_state_batch_indices, jnp.int32)
        if dsti.ndim == 1:
            dsti = dsti[:, None]
    if cu_seqlens is None:
        batch = num_tokens
        if sbi.shape[0] != batch:
            raise _shape_error(
                f"without cu_seqlens, state_batch_indices needs one row per token ({batch}), got {sbi.shape}"
            )
    else:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        batch = cu.shape[0] - 1
        if sbi.shape[0] < batch:
            raise _shape_error(f"state_batch_indices has {sbi.shape[0]} rows, cu_seqlens has {batch} requests")
    if dsti.shape[0] < batch:
        raise _shape_error(f"dst_state_batch_indices has {dsti.shape[0]} rows for {batch} requests")
    sbi, dsti = sbi[:batch], dsti[:batch]
    spec = per_token_destinations(num_accepted_tokens, cu_seqlens, dsti.shape[1])
    if num_accepted_tokens is not None:
        na = jnp.asarray(num_accepted_tokens, jnp.int32).reshape(-1)[:batch]
        col = jnp.clip(na - 1, 0, sbi.shape[1] - 1)
    else:
        col = jnp.zeros((batch,), jnp.int32)
    src = kernel_slots(jnp.take_along_axis(sbi, col[:, None], axis=1)[:, 0], num_slots, pad_slot_id)
    if spec:
        dst = kernel_slots(dsti, num_slots, pad_slot_id)
    else:
        dst = jnp.where(src[:, None] >= 0, kernel_slots(dsti[:, :1], num_slots, pad_slot_id), -1)
    if cu_seqlens is None:
        start = jnp.arange(batch, dtype=jnp.int32)
        length = jnp.ones((batch,), jnp.int32)
    else:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        start = jnp.clip(cu[:-1], 0, num_tokens)
        length = jnp.clip(cu[1:] - cu[:-1], 0, num_tokens - start)
    return SsuPlan(src, dst.astype(jnp.int32), start, length, spec, cu_seqlens is not None)


def per_token_destinations(num_accepted_tokens, cu_seqlens, dst_columns: int) -> bool:
    """Whether ``selective_state_update`` writes every token's state (see ``ssu_plan``)."""
    return num_accepted_tokens is not None or (cu_seqlens is not None and dst_columns > 1)


def validate_ssu_indices(
    num_slots, num_tokens, state_batch_indices, dst_state_batch_indices, num_accepted_tokens, cu_seqlens, pad_slot_id
) -> None:
    """Raise ``SlotError``/``MetadataError`` for bad concrete index arguments (no-op on tracers)."""
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


def _expand_groups(v, H):
    """(..., G, N) -> (..., H, N): head h uses group h // (H // G) (as vLLM)."""
    G = v.shape[-2]
    return jnp.repeat(v, H // G, axis=-2)


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
        cu_seqlens, pad_slot_id,
    )
    return _ssu_reference_jit(
        ssm_state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dst_state_batch_indices,
        num_accepted_tokens, cu_seqlens, dt_softplus=bool(dt_softplus), pad_slot_id=int(pad_slot_id),
    )


@functools.partial(jax.jit, static_argnames=("dt_softplus", "pad_slot_id"))
def _ssu_reference_jit(
    ssm_state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dst_state_batch_indices,
    num_accepted_tokens, cu_seqlens, *, dt_softplus, pad_slot_id,
):
    num_slots, H, P, N = ssm_state.shape
    a = normalize_ssu_args(ssm_state, x, dt, A, B, C, D, z, dt_bias)
    T = x.shape[0]
    plan = ssu_plan(
        num_slots, T, state_batch_indices, dst_state_batch_indices, num_accepted_tokens, cu_seqlens, pad_slot_id
    )
    batch = plan.src.shape[0]
    max_len = 1 if not plan.varlen else (plan.dst.shape[1] if plan.spec else max(1, T - batch + 1))
    A32 = a.A.astype(_F32)
    A_full = A32[:, None, None] if A32.ndim == 1 else A32  # (H,1,1) or (H,P,N)
    s = ssm_state[jnp.maximum(plan.src, 0)].astype(_F32)  # (batch, H, P, N)
    s = jnp.where((plan.src >= 0)[:, None, None, None], s, 0.0)
    out = jnp.zeros((T + 1, H, P), _F32)  # row T: sink for inactive tokens
    state = ssm_state

    def step(j, carry):
        s, out, state = carry
        active = j < plan.length
        tok = jnp.where(active, plan.start + j, T)
        tokc = jnp.minimum(tok, T - 1)
        xt = a.x[tokc].astype(_F32)  # (batch, H, P)
        dtt = process_dt(a.dt[tokc], a.dt_bias, dt_softplus)  # (batch,H) or (batch,H,P)
        dtt = dtt[:, :, None] if dtt.ndim == 2 else dtt  # (batch, H, 1|P)
        Bt = _expand_groups(a.B[tokc].astype(_F32), H)  # (batch, H, N)
        Ct = _expand_groups(a.C[tokc].astype(_F32), H)
        dA = jnp.exp(A_full[None] * dtt[..., None])  # (batch, H, 1|P, 1|N)
        s_new = s * dA + (Bt[:, :, None, :] * dtt[..., None]) * xt[..., None]
        s = jnp.where(active[:, None, None, None], s_new, s)
        y = jnp.sum(s * Ct[:, :, None, :], axis=-1)
        if a.D is not None:
            y = y + xt * a.D[None]
        if a.z is not None:
            y = y * silu(a.z[tokc].astype(_F32))
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
        raise _shape_error(f"max_query_len={maxq} must be >= 1 (conv state has {state_len} rows, width {width})")
    if idx.shape[0] < batch:
        raise _shape_error(f"conv_state_indices has {idx.shape[0]} rows for {batch} requests")
    idx = idx[:batch]
    spec = num_accepted_tokens is not None
    if spec and state_len < width - 2 + maxq:
        raise _shape_error(
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
        raise _shape_error(f"conv_state must be (slots, conv_dim, R) (DS layout), got {conv_state.shape}")
    _, dim, R = conv_state.shape
    if x.ndim != 2 or x.shape[1] != dim:
        raise _shape_error(f"x must be (num_tokens, {dim}) to match conv_state {conv_state.shape}, got {x.shape}")
    if weight.ndim != 2 or weight.shape[0] != dim:
        raise _shape_error(f"weight must be ({dim}, K), got {weight.shape}")
    K = weight.shape[1]
    if K < 2 or R < K - 1:
        raise _shape_error(f"conv width K={K} needs K >= 2 and conv_state rows R={R} >= K-1")
    if bias is not None and bias.shape != (dim,):
        raise _shape_error(f"bias must be ({dim},), got {bias.shape}")
    return dim, R, K


def check_activation(activation):
    if activation in (True, "silu", "swish"):
        return True
    if activation in (None, False):
        return False
    raise _shape_error(f"activation must be None or 'silu', got {activation!r}")


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
    old = conv_state[jnp.maximum(p.src, 0)]  # (batch, dim, R)
    old = jnp.where(process[:, None, None], old, jnp.zeros((), sdt))
    j = jnp.arange(maxq)
    tok_ok = j[None, :] < p.length[:, None]  # (batch, maxq)
    tok = jnp.minimum(p.start[:, None] + j[None, :], T - 1)
    xt = jnp.where(tok_ok[..., None], x[tok].astype(sdt), jnp.zeros((), sdt))  # (batch, maxq, dim)
    hist_cols = p.offset[:, None] + jnp.arange(K - 1)[None, :]  # (batch, K-1)
    hist = jnp.take_along_axis(old, hist_cols[:, None, :], axis=2)  # (batch, dim, K-1)
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
    from_old = jnp.take_along_axis(old, shift_cols[:, None, :], axis=2)
    xi = jnp.broadcast_to(jnp.clip(i - keep, 0, maxq - 1)[None, None, :], (old.shape[0], 1, R))
    from_x = jnp.take_along_axis(jnp.swapaxes(xt, 1, 2), xi, axis=2)
    new = jnp.where((i < keep)[None, None, :], from_old, from_x)
    s_eff = keep + p.length  # (batch,)
    write = (p.dst >= 0) & process
    cur_dst = conv_state[jnp.maximum(p.dst, 0)]
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
        raise _shape_error("block_boundary_indices and block_boundary_slots go together")
    if block_boundary_indices is None:
        bnd_pos = jnp.zeros((batch, 1), jnp.int32)
        bnd_dst = jnp.full((batch, 1), -1, jnp.int32)
    else:
        bnd_pos = jnp.asarray(block_boundary_indices, jnp.int32)
        bslots = jnp.asarray(block_boundary_slots, jnp.int32)
        if bnd_pos.ndim != 2 or bnd_pos.shape != bslots.shape or bnd_pos.shape[0] < batch:
            raise _shape_error(
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
    pos = t - p.start[seq]
    acc = jnp.zeros((T, dim), _F32)
    if bias is not None:
        acc = acc + bias.astype(_F32)
    w = weight.astype(_F32)
    for k in range(K):
        qk = pos - (K - 1) + k  # position of the source token within the request
        xv = xs[jnp.clip(t - (K - 1) + k, 0, T - 1)]
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
        xv = xs[jnp.clip(p.start[:, None] + qr, 0, T - 1)]  # (batch, K-1, dim)
        hv = jnp.take_along_axis(init, jnp.clip(n[:, None] + r[None, :], 0, K - 2)[:, None, :], axis=2)
        return jnp.where((qr >= 0)[:, None, :], jnp.swapaxes(xv, 1, 2), hv)

    for jb in range(p.bnd_pos.shape[1]):
        snap = state_after(p.bnd_pos[:, jb])
        d = p.bnd_dst[:, jb]
        conv_state = conv_state.at[jnp.where(d >= 0, d, num_slots), :, : K - 1].set(snap, mode="drop")
    final = state_after(p.length)
    d = jnp.where(p.length > 0, p.dst, -1)
    conv_state = conv_state.at[jnp.where(d >= 0, d, num_slots), :, : K - 1].set(final, mode="drop")
    return out, conv_state


# ----------------------------------------------------------------------------
# ssd_chunk_scan_varlen (chunked SSD prefill)
# ----------------------------------------------------------------------------


class ChunkPlan(NamedTuple):
    cu_chunk_seqlens: jax.Array  # (nchunks + 1,) int32
    seq_idx: jax.Array  # (nchunks,) int32 request of each chunk
    last_chunk_indices: jax.Array  # (batch,) int32


def ssd_chunk_metadata(cu_seqlens, chunk_size: int, num_chunks: int, num_computed_tokens=None) -> ChunkPlan:
    """Build the chunk table on device (jit-safe): ``(cu_chunk_seqlens, seq_idx, last_chunk_indices)``.

    Chunks are counted from each request's first token; with
    ``num_computed_tokens`` the request's first chunk ends at the next multiple
    of ``chunk_size`` in the request's own token count, so chunk ends line up
    with block ends for prefix caching. ``num_chunks`` is a static padded size;
    chunks past the last real one are empty (start == end == cu_seqlens[-1]).
    Enough chunks: ``num_tokens // chunk_size + batch`` without
    ``num_computed_tokens``, ``num_tokens // chunk_size + 2 * batch`` with it.
    """
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    batch = cu.shape[0] - 1
    length = cu[1:] - cu[:-1]
    if num_computed_tokens is None:
        first = jnp.minimum(length, chunk_size)
    else:
        r = jnp.asarray(num_computed_tokens, jnp.int32).reshape(-1)[:batch] % chunk_size
        first = jnp.minimum(length, chunk_size - r)
    n = jnp.where(length > 0, 1 + (length - first + chunk_size - 1) // chunk_size, 0)
    incl = jnp.cumsum(n)
    excl = incl - n
    c = jnp.arange(num_chunks, dtype=jnp.int32)
    b = jnp.searchsorted(incl, c, side="right").astype(jnp.int32)  # request of chunk c (== batch for tail)
    real = b < batch
    bc = jnp.minimum(b, batch - 1)
    i = c - excl[bc]
    start = jnp.where(i == 0, 0, first[bc] + (i - 1) * chunk_size) + cu[bc]
    start = jnp.where(real, start, cu[batch])
    cu_chunk = jnp.concatenate([start, cu[batch:]]).astype(jnp.int32)
    seq_idx = jnp.where(real, bc, batch - 1).astype(jnp.int32)
    last = (incl - 1).astype(jnp.int32)
    return ChunkPlan(cu_chunk, seq_idx, last)


def validate_chunk_metadata(cu_seqlens, chunk_size, num_tokens, cu_chunk_seqlens, seq_idx, last_chunk_indices):
    """Raise ``MetadataError`` for a bad concrete chunk table (no-op on tracers)."""
    check_query_start_loc("cu_seqlens", cu_seqlens, num_tokens)
    if cu_chunk_seqlens is None:
        return
    check_query_start_loc("cu_chunk_seqlens", cu_chunk_seqlens, num_tokens)
    cc = concrete(cu_chunk_seqlens)
    if cc is not None:
        check_range("chunk length (from cu_chunk_seqlens) ", np.diff(cc), 0, chunk_size)
    batch = np.shape(cu_seqlens)[0] - 1
    if seq_idx is not None:
        check_range("seq_idx", seq_idx, 0, batch - 1)
    if last_chunk_indices is not None:
        check_range("last_chunk_indices", last_chunk_indices, -1, np.shape(cu_chunk_seqlens)[0] - 2)
    cu = concrete(cu_seqlens)
    si = concrete(seq_idx)
    if cc is not None and cu is not None and si is not None:
        s, e = cc[:-1], cc[1:]
        bad = (e > s) & ((s < cu[si]) | (e > cu[si + 1]))
        if bad.any():
            c = int(np.argwhere(bad)[0][0])
            raise MetadataError(
                f"chunk {c} [{s[c]}, {e[c]}) crosses the bounds of request seq_idx[{c}]={si[c]} "
                f"[{cu[si[c]]}, {cu[si[c] + 1]})"
            )


def resolve_chunk_plan(cu_seqlens, chunk_size, num_tokens, cu_chunk_seqlens, seq_idx, last_chunk_indices) -> ChunkPlan:
    """Use the metadata's chunk table when given (deriving missing pieces), else build one."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    batch = cu.shape[0] - 1
    if cu_chunk_seqlens is None:
        return ssd_chunk_metadata(cu, chunk_size, num_tokens // chunk_size + batch)
    cc = jnp.asarray(cu_chunk_seqlens, jnp.int32)
    if seq_idx is None:
        seq_idx = jnp.clip(jnp.searchsorted(cu, cc[:-1], side="right") - 1, 0, batch - 1)
    if last_chunk_indices is None:
        last_chunk_indices = jnp.searchsorted(cc[:-1], cu[1:], side="left") - 1
    seq_idx = jnp.asarray(seq_idx, jnp.int32)
    last_chunk_indices = jnp.asarray(last_chunk_indices, jnp.int32)
    return ChunkPlan(cc, seq_idx, last_chunk_indices)


class SsdArgs(NamedTuple):
    x: jax.Array  # (T, H, P)
    dt: jax.Array  # (T, H)
    A: jax.Array  # (H,) float32
    B: jax.Array  # (T, G, N)
    C: jax.Array  # (T, G, N)
    D: jax.Array | None  # (H, P) float32
    z: jax.Array | None  # (T, H, P)
    dt_bias: jax.Array | None  # (H,) float32
    init: jax.Array  # (batch, H, P, N) initial states, zeros where has_initial_state is False
    has_init: jax.Array  # (batch,) bool


def normalize_ssd_args(x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_states, has_initial_state) -> SsdArgs:
    if x.ndim != 3:
        raise _shape_error(f"x must be (T, H, P), got {x.shape}")
    T, H, P = x.shape
    if dt.shape != (T, H):
        raise _shape_error(f"dt must be ({T}, {H}), got {dt.shape}")
    if A.shape != (H,):
        raise _shape_error(f"A must be ({H},), got {A.shape}")
    if B.ndim != 3 or B.shape[0] != T or H % B.shape[1]:
        raise _shape_error(f"B must be ({T}, G, N) with G dividing {H}, got {B.shape}")
    if C.shape != B.shape:
        raise _shape_error(f"C must have B's shape {B.shape}, got {C.shape}")
    N = B.shape[2]
    if z is not None and z.shape != x.shape:
        raise _shape_error(f"z must have x's shape {x.shape}, got {z.shape}")
    if D is not None:
        if D.shape not in ((H,), (H, P)):
            raise _shape_error(f"D must be ({H},) or ({H}, {P}), got {D.shape}")
        D = jnp.broadcast_to(D.astype(_F32).reshape(H, -1), (H, P))
    if dt_bias is not None:
        if dt_bias.shape != (H,):
            raise _shape_error(f"dt_bias must be ({H},), got {dt_bias.shape}")
        dt_bias = dt_bias.astype(_F32)
    batch = jnp.asarray(cu_seqlens).shape[0] - 1
    if initial_states is None:
        has_init = jnp.zeros((batch,), bool)
        init = jnp.zeros((batch, H, P, N), _F32)
    else:
        if initial_states.shape != (batch, H, P, N):
            raise _shape_error(f"initial_states must be ({batch}, {H}, {P}, {N}), got {initial_states.shape}")
        if has_initial_state is None:
            has_init = jnp.ones((batch,), bool)
        else:
            has_init = jnp.asarray(has_initial_state).reshape(-1)[:batch].astype(bool)
        # select, never multiply: garbage (even NaN) behind has_initial_state=False must not leak
        init = jnp.where(has_init[:, None, None, None], initial_states.astype(_F32), 0.0)
    return SsdArgs(x, dt, A.astype(_F32), B, C, D, z, dt_bias, init, has_init)


def ssd_chunk_scan_varlen_reference(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    *,
    chunk_size,
    cu_seqlens,
    initial_states=None,
    has_initial_state=None,
    return_intermediate_states=False,
    dt_softplus=True,
    dt_limit=(0.0, math.inf),
    cu_chunk_seqlens=None,
    last_chunk_indices=None,
    seq_idx=None,
    state_dtype=None,
    interpret=None,
    **unused_block_sizes,
):
    """Plain-JAX chunked SSD (Mamba2 state-space duality) over a packed varlen batch.

    Returns ``(out (T,H,P) x.dtype, final_states (batch,H,P,N), chunk_states
    (nchunks,H,P,N) or None)``; states are float32 unless ``state_dtype`` is given.
    """
    del interpret, unused_block_sizes
    validate_chunk_metadata(cu_seqlens, int(chunk_size), x.shape[0], cu_chunk_seqlens, seq_idx, last_chunk_indices)
    return _ssd_reference_jit(
        x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_states, has_initial_state, cu_chunk_seqlens,
        last_chunk_indices, seq_idx, chunk_size=int(chunk_size),
        return_intermediate_states=bool(return_intermediate_states), dt_softplus=bool(dt_softplus),
        dt_limit=(float(dt_limit[0]), float(dt_limit[1])), state_dtype=state_dtype,
    )


@functools.partial(
    jax.jit, static_argnames=("chunk_size", "return_intermediate_states", "dt_softplus", "dt_limit", "state_dtype")
)
def _ssd_reference_jit(
    x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_states, has_initial_state, cu_chunk_seqlens,
    last_chunk_indices, seq_idx, *, chunk_size, return_intermediate_states, dt_softplus, dt_limit, state_dtype,
):
    a = normalize_ssd_args(x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_states, has_initial_state)
    T, H, P = x.shape
    N = B.shape[2]
    cs = int(chunk_size)
    plan = resolve_chunk_plan(cu_seqlens, cs, T, cu_chunk_seqlens, seq_idx, last_chunk_indices)
    cc = plan.cu_chunk_seqlens
    cstart, clen = cc[:-1], jnp.maximum(cc[1:] - cc[:-1], 0)
    i = jnp.arange(cs)
    valid = i[None, :] < clen[:, None]  # (nc, cs)
    tok = jnp.clip(cstart[:, None] + i[None, :], 0, T - 1)
    xc = a.x[tok].astype(_F32)  # (nc, cs, H, P)
    dtc = process_dt(a.dt[tok], a.dt_bias, dt_softplus, dt_limit)  # (nc, cs, H)
    dtc = jnp.where(valid[..., None], dtc, 0.0)
    Bc = _expand_groups(a.B[tok].astype(_F32), H)  # (nc, cs, H, N)
    Cc = _expand_groups(a.C[tok].astype(_F32), H)
    dA = jnp.swapaxes(dtc * a.A, 1, 2)  # (nc, H, cs)
    seg = stable_segsum(dA)  # (nc, H, cs, cs)
    Lmat = jnp.exp(seg)
    hp = jax.lax.Precision.HIGHEST
    CB = jnp.einsum("cihn,cjhn->chij", Cc, Bc, precision=hp)
    M = CB * Lmat * jnp.swapaxes(dtc, 1, 2)[:, :, None, :]
    y = jnp.einsum("chij,cjhp->cihp", M, xc, precision=hp)
    decay_to_end = jnp.exp(seg[:, :, cs - 1, :])  # exp(sum_{l>j} dA): (nc, H, cs)
    wgt = decay_to_end * jnp.swapaxes(dtc, 1, 2)
    contrib = jnp.einsum("cjhn,chj,cjhp->chpn", Bc, wgt, xc, precision=hp)  # (nc, H, P, N)
    total = jnp.exp(jnp.sum(dA, axis=-1))  # (nc, H)
    sidx = plan.seq_idx

    def pass_state(s, c):
        first = (c == 0) | (sidx[c] != sidx[jnp.maximum(c - 1, 0)])
        s_in = jnp.where(first, a.init[sidx[c]], s)
        s_out = total[c][:, None, None] * s_in + contrib[c]
        return s_out, (s_in, s_out)

    nc = cc.shape[0] - 1
    _, (s_in, s_out) = jax.lax.scan(pass_state, jnp.zeros((H, P, N), _F32), jnp.arange(nc))
    prefix = jnp.exp(jnp.cumsum(dA, axis=-1))  # exp(sum_{l<=i} dA): (nc, H, cs)
    y = y + jnp.einsum("cihn,chpn->cihp", Cc, s_in, precision=hp) * jnp.swapaxes(prefix, 1, 2)[..., None]
    if a.D is not None:
        y = y + xc * a.D
    if a.z is not None:
        y = y * silu(a.z[tok].astype(_F32))
    out_tok = jnp.where(valid, cstart[:, None] + i[None, :], T)
    out = jnp.zeros((T + 1, H, P), _F32).at[out_tok.reshape(-1)].set(y.reshape(-1, H, P))[:T]
    batch = a.init.shape[0]
    lengths = jnp.asarray(cu_seqlens, jnp.int32)[1:] - jnp.asarray(cu_seqlens, jnp.int32)[:-1]
    last = jnp.clip(plan.last_chunk_indices, 0, nc - 1)
    final = jnp.where((lengths > 0)[:batch, None, None, None], s_out[last], a.init)
    sd = _F32 if state_dtype is None else state_dtype
    chunk_states = s_out.astype(sd) if return_intermediate_states else None
    return out.astype(x.dtype), final.astype(sd), chunk_states


# ----------------------------------------------------------------------------
# Naive numpy recurrence (the oracle the references are tested against)
# ----------------------------------------------------------------------------


def naive_ssm_recurrence(h, x, dt, A, B, C, D=None, z=None):
    """One request, token by token, in float64 numpy.

    ``h (H,P,N)``, ``x (L,H,P)``, ``dt (L,H)`` (already processed), ``A (H,)``,
    ``B, C (L,G,N)``, ``D (H,P)``. Returns ``(y (L,H,P), states (L,H,P,N))``.
    """
    h = np.array(h, np.float64)
    L, H, P = x.shape
    G = B.shape[1]
    ys, hs = [], []
    for t in range(L):
        Bt = np.repeat(np.asarray(B[t], np.float64), H // G, axis=0)
        Ct = np.repeat(np.asarray(C[t], np.float64), H // G, axis=0)
        d = np.asarray(dt[t], np.float64)
        h = np.exp(d * np.asarray(A, np.float64))[:, None, None] * h + (
            d[:, None, None] * np.asarray(x[t], np.float64)[:, :, None] * Bt[:, None, :]
        )
        y = np.einsum("hpn,hn->hp", h, Ct)
        if D is not None:
            y = y + np.asarray(D, np.float64) * np.asarray(x[t], np.float64)
        if z is not None:
            zt = np.asarray(z[t], np.float64)
            y = y * zt / (1.0 + np.exp(-zt))
        ys.append(y)
        hs.append(h.copy())
    return np.stack(ys) if ys else np.zeros((0, H, P)), np.stack(hs) if hs else np.zeros((0,) + h.shape)
