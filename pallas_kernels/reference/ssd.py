"""Plain-JAX chunked SSD prefill (``ssd_chunk_scan_varlen``), its chunk table, and the naive recurrence.

``ssd_chunk_metadata`` builds the chunk table on device; ``resolve_chunk_plan``,
``normalize_ssd_args`` and ``validate_chunk_metadata`` are shared with the Pallas
kernel in ``pallas_kernels/ssd_chunk_scan_varlen.py``. ``naive_ssm_recurrence`` is
the float64 numpy oracle the references are tested against.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.errors import MetadataError
from pallas_kernels.reference.common import (
    check_query_start_loc,
    check_range,
    concrete,
    expand_groups,
    process_dt,
    segment_sum,
    shape_error,
    silu,
    take_rows,
)

_F32 = jnp.float32


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
        raise shape_error(f"x must be (T, H, P), got {x.shape}")
    T, H, P = x.shape
    if dt.shape != (T, H):
        raise shape_error(f"dt must be ({T}, {H}), got {dt.shape}")
    if A.shape != (H,):
        raise shape_error(f"A must be ({H},), got {A.shape}")
    if B.ndim != 3 or B.shape[0] != T or H % B.shape[1]:
        raise shape_error(f"B must be ({T}, G, N) with G dividing {H}, got {B.shape}")
    if C.shape != B.shape:
        raise shape_error(f"C must have B's shape {B.shape}, got {C.shape}")
    N = B.shape[2]
    if z is not None and z.shape != x.shape:
        raise shape_error(f"z must have x's shape {x.shape}, got {z.shape}")
    if D is not None:
        if D.shape not in ((H,), (H, P)):
            raise shape_error(f"D must be ({H},) or ({H}, {P}), got {D.shape}")
        D = jnp.broadcast_to(D.astype(_F32).reshape(H, -1), (H, P))
    if dt_bias is not None:
        if dt_bias.shape != (H,):
            raise shape_error(f"dt_bias must be ({H},), got {dt_bias.shape}")
        dt_bias = dt_bias.astype(_F32)
    batch = jnp.asarray(cu_seqlens).shape[0] - 1
    if initial_states is None:
        has_init = jnp.zeros((batch,), bool)
        init = jnp.zeros((batch, H, P, N), _F32)
    else:
        if initial_states.shape != (batch, H, P, N):
            raise shape_error(f"initial_states must be ({batch}, {H}, {P}, {N}), got {initial_states.shape}")
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
    xc = take_rows(a.x, tok).astype(_F32)  # (nc, cs, H, P)
    dtc = process_dt(take_rows(a.dt, tok), a.dt_bias, dt_softplus, dt_limit)  # (nc, cs, H)
    dtc = jnp.where(valid[..., None], dtc, 0.0)
    Bc = expand_groups(take_rows(a.B, tok).astype(_F32), H)  # (nc, cs, H, N)
    Cc = expand_groups(take_rows(a.C, tok).astype(_F32), H)
    dA = jnp.swapaxes(dtc * a.A, 1, 2)  # (nc, H, cs)
    seg = segment_sum(dA)  # (nc, H, cs, cs)
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
        y = y * silu(take_rows(a.z, tok).astype(_F32))
    out_tok = jnp.where(valid, cstart[:, None] + i[None, :], T)
    out = jnp.zeros((T + 1, H, P), _F32).at[out_tok.reshape(-1)].set(y.reshape(-1, H, P))[:T]
    batch = a.init.shape[0]
    lengths = jnp.asarray(cu_seqlens, jnp.int32)[1:] - jnp.asarray(cu_seqlens, jnp.int32)[:-1]
    last = jnp.clip(plan.last_chunk_indices, 0, nc - 1)
    final = jnp.where((lengths > 0)[:batch, None, None, None], take_rows(s_out, last), a.init)
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
