"""Plain-JAX references of the five SSD passes (``pallas_kernels.ssd``), one function per pass.

Same inputs and outputs as the kernels, in float32 with ``HIGHEST`` matmul
precision; the pass tests compare each kernel with its function here, and
composing the five reproduces ``ssd_chunk_scan_varlen_reference``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.reference.common import expand_groups, process_dt, segment_sum, silu

__all__ = [
    "chunk_cumsum_reference",
    "chunk_bmm_reference",
    "chunk_state_reference",
    "state_passing_reference",
    "chunk_scan_reference",
]

_F32 = jnp.float32
_HP = jax.lax.Precision.HIGHEST


def _chunk_tokens(cu_chunk_seqlens, chunk_size, num_tokens):
    """``(token index (nc, cs) clipped into range, valid (nc, cs))`` of every chunk row."""
    cc = jnp.asarray(cu_chunk_seqlens, jnp.int32)
    start, clen = cc[:-1], jnp.clip(cc[1:] - cc[:-1], 0, chunk_size)
    i = jnp.arange(chunk_size)
    return jnp.clip(start[:, None] + i[None, :], 0, num_tokens - 1), i[None, :] < clen[:, None]


def chunk_cumsum_reference(dt, A, dt_bias, cu_chunk_seqlens, *, chunk_size, block_l, dt_softplus=True,
                           dt_limit=(0.0, math.inf)):
    """``(dt_chunks, da_cumsum, da_suffix)``, all ``(H, nchunks, chunk_size)`` float32 (see ``ssd.chunk_cumsum``)."""
    tok, valid = _chunk_tokens(cu_chunk_seqlens, chunk_size, dt.shape[0])
    dtc = jnp.where(valid[..., None], process_dt(dt[tok], dt_bias, dt_softplus, dt_limit), 0.0)  # (nc, cs, H)
    dtc = jnp.transpose(dtc, (2, 0, 1))
    da = dtc * A.astype(_F32)[:, None, None]
    H, nc, _ = da.shape
    blocks = da.reshape(H, nc, chunk_size // block_l, block_l)
    later = jnp.flip(jnp.cumsum(jnp.flip(blocks, -1), -1), -1)  # sum_{l >= j} within the block
    suffix = jnp.concatenate([later[..., 1:], jnp.zeros_like(later[..., :1])], -1).reshape(da.shape)
    return dtc, jnp.cumsum(da, axis=-1), suffix


def chunk_bmm_reference(C, B, cu_chunk_seqlens, *, chunk_size):
    """``(nchunks, G, cs, cs)`` float32 ``C_i . B_j`` of each chunk (zeros at rows/columns past its end)."""
    tok, valid = _chunk_tokens(cu_chunk_seqlens, chunk_size, B.shape[0])
    Cc = jnp.where(valid[..., None, None], C[tok].astype(_F32), 0.0)  # (nc, cs, G, N)
    Bc = jnp.where(valid[..., None, None], B[tok].astype(_F32), 0.0)
    return jnp.einsum("cign,cjgn->cgij", Cc, Bc, precision=_HP)


def chunk_state_reference(x, B, dt_chunks, A, cu_chunk_seqlens, *, chunk_size):
    """``(nchunks, H, P, N)`` float32: ``sum_j exp(sum_{l>j} dA_l) dt_j x_j B_j^T`` per chunk."""
    H = x.shape[1]
    tok, valid = _chunk_tokens(cu_chunk_seqlens, chunk_size, x.shape[0])
    xc = jnp.where(valid[..., None, None], x[tok].astype(_F32), 0.0)  # (nc, cs, H, P)
    Bc = expand_groups(jnp.where(valid[..., None, None], B[tok].astype(_F32), 0.0), H)  # (nc, cs, H, N)
    da = jnp.transpose(dt_chunks * A[:, None, None], (1, 0, 2))  # (nc, H, cs)
    wgt = jnp.exp(segment_sum(da)[:, :, -1, :]) * jnp.transpose(dt_chunks, (1, 0, 2))  # (nc, H, cs)
    return jnp.einsum("cjhn,chj,cjhp->chpn", Bc, wgt, xc, precision=_HP)


def state_passing_reference(da_cumsum, init, contrib, cu_chunk_seqlens, seq_idx):
    """``(nchunks, H, P, N)`` float32 chunk-end states (see ``ssd.state_passing``; every chunk written)."""
    cc = jnp.asarray(cu_chunk_seqlens, jnp.int32)
    nonempty = cc[1:] > cc[:-1]
    total = jnp.exp(da_cumsum[:, :, -1]).T  # (nc, H)
    sidx = jnp.asarray(seq_idx, jnp.int32)

    def step(s, c):
        first = (c == 0) | (sidx[c] != sidx[jnp.maximum(c - 1, 0)])
        s = jnp.where(first, init[sidx[c]], s)
        s = total[c][:, None, None] * s + jnp.where(nonempty[c], contrib[c], 0.0)
        return s, s

    _, states = jax.lax.scan(step, jnp.zeros(init.shape[1:], _F32), jnp.arange(sidx.shape[0]))
    return states


def chunk_scan_reference(x, C, cb, dt_chunks, da_cumsum, A, init, states, cu_chunk_seqlens, seq_idx, D=None, z=None,
                         *, chunk_size):
    """``(T, H, P)`` in ``x.dtype`` (see ``ssd.chunk_scan``); tokens outside every chunk are zeros."""
    T, H, P = x.shape
    G = C.shape[1]
    cc = jnp.asarray(cu_chunk_seqlens, jnp.int32)
    tok, valid = _chunk_tokens(cc, chunk_size, T)
    sidx = jnp.asarray(seq_idx, jnp.int32)
    c = jnp.arange(sidx.shape[0])
    first = (c == 0) | (sidx != sidx[jnp.maximum(c - 1, 0)])
    h_in = jnp.where(first[:, None, None, None], init[sidx], states[jnp.maximum(c - 1, 0)])  # (nc, H, P, N)
    da = jnp.transpose(dt_chunks * A[:, None, None], (1, 0, 2))  # (nc, H, cs)
    keep = valid[:, :, None] & valid[:, None, :] & jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    cbh = jnp.repeat(jnp.where(keep[:, None], cb, 0.0), H // G, axis=1)  # (nc, H, cs, cs)
    M = cbh * jnp.exp(segment_sum(da)) * jnp.transpose(dt_chunks, (1, 0, 2))[:, :, None, :]
    xc = jnp.where(valid[..., None, None], x[tok].astype(_F32), 0.0)  # (nc, cs, H, P)
    y = jnp.einsum("chij,cjhp->cihp", M, xc, precision=_HP)
    Cc = expand_groups(jnp.where(valid[..., None, None], C[tok].astype(_F32), 0.0), H)  # (nc, cs, H, N)
    decay = jnp.transpose(jnp.exp(da_cumsum), (1, 2, 0))  # (nc, cs, H)
    y = y + jnp.einsum("cihn,chpn->cihp", Cc, h_in, precision=_HP) * decay[..., None]
    if D is not None:
        y = y + xc * D.astype(_F32)
    if z is not None:
        y = y * silu(z[tok].astype(_F32))
    out_tok = jnp.where(valid, tok, T).reshape(-1)
    out = jnp.zeros((T + 1, H, P), _F32).at[out_tok].set(y.reshape(-1, H, P))[:T]
    return out.astype(x.dtype)
