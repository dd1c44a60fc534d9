"""The plain-JAX references against naive per-token numpy loops (float64) written from vLLM's kernels."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import (
    causal_conv1d_update_reference,
    causal_conv1d_varlen_reference,
    naive_ssm_recurrence,
    selective_state_update_reference,
    ssd_chunk_metadata,
    ssd_chunk_scan_varlen_reference,
)
from pallas_kernels.reference.common import segment_sum

ATOL = 1e-5


def usable(i, num_slots):
    return 0 < i < num_slots


def softplus(v):
    return np.where(v > 20, v, np.log1p(np.exp(np.minimum(v, 20))))


def silu(v):
    return v / (1 + np.exp(-v))


# ----------------------------------------------------------------------------- oracles


def naive_ssu(state, x, dt, A, B, C, D, z, dt_bias, sbi, dst, na, cu):
    """vLLM's selective_state_update, one request and one token at a time (head-tied A/dt)."""
    state = np.array(state, np.float64)
    T, H, P = x.shape
    G = B.shape[1]
    out = np.zeros((T, H, P))
    sbi = sbi[:, None] if sbi.ndim == 1 else sbi
    dst = sbi if dst is None else (dst[:, None] if dst.ndim == 1 else dst)
    batch = T if cu is None else len(cu) - 1
    per_token = na is not None or (cu is not None and dst.shape[1] > 1)
    for b in range(batch):
        col = max(na[b] - 1, 0) if na is not None else 0
        src = sbi[b, col]
        h = state[src].copy() if usable(src, len(state)) else np.zeros(state.shape[1:])
        s, e = (b, b + 1) if cu is None else (cu[b], cu[b + 1])
        for j, t in enumerate(range(s, e)):
            d = softplus(dt[t] + dt_bias)  # (H,)
            Bt, Ct = np.repeat(B[t], H // G, 0), np.repeat(C[t], H // G, 0)
            h = np.exp(d * A)[:, None, None] * h + (d[:, None] * x[t])[:, :, None] * Bt[:, None, :]
            out[t] = (np.einsum("hpn,hn->hp", h, Ct) + D[:, None] * x[t]) * silu(z[t])
            if per_token and usable(dst[b, j], len(state)):
                state[dst[b, j]] = h
        if not per_token and usable(src, len(state)) and usable(dst[b, 0], len(state)):
            state[dst[b, 0]] = h
    return out, state


def naive_conv_update(x, conv_state, w, bias, idx, na, qsl, maxq):
    """vLLM's _causal_conv1d_update_kernel transcribed as loops (state_len revised per request)."""
    conv_state = np.array(conv_state, np.float64)
    x = np.asarray(x, np.float64)
    out = x.copy()
    _, dim, R = conv_state.shape
    K = w.shape[1]
    idx = idx[:, 0] if idx.ndim == 2 else idx
    batch = len(x) if qsl is None else len(qsl) - 1
    for b in range(batch):
        src = idx[b]
        if not usable(src, len(conv_state)):
            continue
        s, e = (b, b + 1) if qsl is None else (qsl[b], qsl[b + 1])
        L = e - s
        if L == 0:
            continue
        state_len = R - (maxq - L)
        o = na[b] - 1 if na is not None else 0
        old = conv_state[src].copy()
        window = np.concatenate([old[:, o : o + K - 1], x[s:e].T], axis=1)
        for t in range(L):
            acc = bias + (window[:, t : t + K] * w).sum(1)
            out[s + t] = silu(acc)
        new = conv_state[src].copy()
        for i in range(state_len):
            if i + L < state_len:
                new[:, i] = old[:, o + i + (1 if na is not None else L)]
            else:
                new[:, i] = x[s + i - (state_len - L)]
        conv_state[src] = new
    return out, conv_state


def naive_conv_varlen(x, conv_state, w, bias, qsl, idx, has_init, bpos, bslots):
    conv_state = np.array(conv_state, np.float64)
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    K = w.shape[1]
    for b in range(len(qsl) - 1):
        s, e = qsl[b], qsl[b + 1]
        if has_init[b] and usable(idx[b], len(conv_state)):
            hist = conv_state[idx[b], :, : K - 1]
        else:
            hist = np.zeros_like(conv_state[0, :, : K - 1])
        seq = np.concatenate([hist, x[s:e].T], axis=1)  # (dim, K-1+L)
        for t in range(e - s):
            out[s + t] = silu(bias + (seq[:, t : t + K] * w).sum(1))
        for p, slot in zip(bpos[b], bslots[b]):
            if 1 <= p <= e - s and usable(slot, len(conv_state)):
                conv_state[slot, :, : K - 1] = seq[:, p : p + K - 1]
        if e > s and usable(idx[b], len(conv_state)):
            conv_state[idx[b], :, : K - 1] = seq[:, e - s : e - s + K - 1]
    return out, conv_state


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("num_spec,accepted", [(0, False), (2, True), (2, False)])
def test_selective_state_update_reference_vs_naive(num_spec, accepted):
    rng = np.random.default_rng(num_spec)
    H, G, P, N, batch, slots = 4, 2, 8, 16, 6, 30
    n = lambda *s, sc=1.0: rng.standard_normal(s) * sc  # noqa: E731
    state = n(slots, H, P, N, sc=0.5)
    if num_spec:
        lens = np.array([3, 1, 0, 3, 2, 3])
        cu = np.concatenate([[0], np.cumsum(lens)])
        T = cu[-1] + 1
        sbi = rng.permutation(np.arange(1, slots))[: batch * 3].reshape(batch, 3)
        sbi[1] = -1
        sbi[4, 1] = 0
        na = np.array([1, 2, 3, 3, 1, 2]) if accepted else None
    else:
        cu, na = None, None
        T = batch
        sbi = np.array([5, -1, 9, 0, 12, 3])
    x, dt, z = n(T, H, P), n(T, H) - 1, n(T, H, P)
    A, D, dtb = -np.exp(n(H, sc=0.5)), n(H), n(H, sc=0.5)
    B, C = n(T, G, N, sc=N**-0.5), n(T, G, N, sc=N**-0.5)
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    out, st = selective_state_update_reference(
        f(state), f(x), f(dt), f(A), f(B), f(C), f(D), f(z), f(dtb), dt_softplus=True,
        state_batch_indices=sbi.astype(np.int32), num_accepted_tokens=None if na is None else na.astype(np.int32),
        cu_seqlens=None if cu is None else cu.astype(np.int32),
    )
    e_out, e_st = naive_ssu(state, x, dt, A, B, C, D, z, dtb, sbi, None, na, cu)
    np.testing.assert_allclose(np.asarray(out), e_out, atol=ATOL)
    np.testing.assert_allclose(np.asarray(st), e_st, atol=ATOL)


@pytest.mark.parametrize("K,num_spec", [(2, 0), (4, 0), (3, 1), (4, 3)])
def test_causal_conv1d_update_reference_vs_naive(K, num_spec):
    rng = np.random.default_rng(K * 10 + num_spec)
    dim, slots, batch = 12, 20, 6
    R = K - 1 + num_spec
    state = rng.standard_normal((slots, dim, R))
    w, bias = rng.standard_normal((dim, K)) * 0.5, rng.standard_normal(dim)
    idx = np.array([4, -1, 7, 0, 11, 2], np.int32)
    if num_spec:
        maxq = num_spec + 1
        lens = np.array([maxq, 1, maxq, maxq, 0, maxq - 1])
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        na = rng.integers(1, maxq + 1, size=batch).astype(np.int32)
        T = qsl[-1] + 2
    else:
        maxq, qsl, na, T = 1, None, None, batch
    x = rng.standard_normal((T, dim))
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    out, st = causal_conv1d_update_reference(
        f(x), f(state), f(w), f(bias), activation="silu", conv_state_indices=idx, num_accepted_tokens=na,
        query_start_loc=qsl,
    )
    e_out, e_st = naive_conv_update(x, state, w, bias, idx, na, qsl, maxq)
    np.testing.assert_allclose(np.asarray(out), e_out, atol=ATOL)
    np.testing.assert_allclose(np.asarray(st), e_st, atol=ATOL)


def test_causal_conv1d_update_spec_keeps_latest_rows_last():
    """Full-length spec rows leave the latest K-1 inputs in the state's last K-1 rows."""
    K, S, dim = 4, 2, 3
    R = K - 1 + S
    state = jnp.arange(2 * dim * R, dtype=jnp.float32).reshape(2, dim, R)
    x = jnp.full((S + 1, dim), 100.0) + jnp.arange(S + 1, dtype=jnp.float32)[:, None]
    _, st = causal_conv1d_update_reference(
        x, state, jnp.ones((dim, K)), conv_state_indices=np.array([1]), num_accepted_tokens=np.array([2]),
        query_start_loc=np.array([0, S + 1]),
    )
    np.testing.assert_array_equal(np.asarray(st[1, 0, -3:]), [100.0, 101.0, 102.0])
    # kept history: old rows o+1 .. o+K-2 with o = num_accepted - 1 = 1
    np.testing.assert_array_equal(np.asarray(st[1, 0, : K - 2]), np.asarray(state[1, 0, 2 : 2 + K - 2]))


@pytest.mark.parametrize("K", [2, 4])
def test_causal_conv1d_varlen_reference_vs_naive(K):
    rng = np.random.default_rng(K)
    dim, slots = 10, 16
    lens = np.array([1, 2, 0, 9, 5])
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = qsl[-1] + 2
    idx = np.array([3, 5, 7, 0, 9], np.int32)
    has_init = np.array([1, 1, 0, 1, 0], bool)
    bpos = np.array([[1, 0], [1, 2], [1, 1], [4, 8], [2, 5]], np.int32)
    bslots = np.array([[10, -1], [11, 12], [13, 13], [14, 15], [0, 2]], np.int32)
    state = rng.standard_normal((slots, dim, K + 1))
    x, w, bias = rng.standard_normal((T, dim)), rng.standard_normal((dim, K)) * 0.5, rng.standard_normal(dim)
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    out, st = causal_conv1d_varlen_reference(
        f(x), f(state), f(w), f(bias), query_start_loc=qsl, cache_indices=idx, has_initial_state=has_init,
        block_boundary_indices=bpos, block_boundary_slots=bslots,
    )
    e_out, e_st = naive_conv_varlen(x, state, w, bias, qsl, idx, has_init, bpos, bslots)
    np.testing.assert_allclose(np.asarray(out), e_out, atol=ATOL)
    np.testing.assert_allclose(np.asarray(st), e_st, atol=ATOL)


def test_segment_sum():
    v = -np.abs(np.random.default_rng(0).standard_normal((3, 7)))
    seg = np.asarray(segment_sum(jnp.asarray(v)))
    for i in range(7):
        for j in range(7):
            expect = v[:, j + 1 : i + 1].sum(-1) if i >= j else -np.inf
            np.testing.assert_allclose(seg[:, i, j], expect, atol=1e-6)


def test_chunk_metadata_counts_from_each_request():
    cu = np.array([0, 5, 5, 22, 23], np.int32)
    plan = ssd_chunk_metadata(cu, 8, 23 // 8 + 4)
    cc = np.asarray(plan.cu_chunk_seqlens)
    np.testing.assert_array_equal(cc, [0, 5, 13, 21, 22, 23, 23])
    np.testing.assert_array_equal(np.asarray(plan.seq_idx)[:5], [0, 2, 2, 2, 3])
    np.testing.assert_array_equal(np.asarray(plan.last_chunk_indices)[[0, 2, 3]], [0, 3, 4])
    # with computed tokens the first chunk ends at the next multiple of chunk_size
    aligned = ssd_chunk_metadata(cu, 8, 23 // 8 + 8, num_computed_tokens=np.array([0, 0, 3, 7]))
    np.testing.assert_array_equal(np.asarray(aligned.cu_chunk_seqlens)[:6], [0, 5, 10, 18, 22, 23])


@pytest.mark.parametrize("aligned", [False, True])
def test_ssd_reference_vs_naive_recurrence(aligned):
    rng = np.random.default_rng(int(aligned))
    H, G, P, N, cs = 4, 2, 8, 16, 8
    lens = np.array([1, 19, 0, 8, 13])
    computed = np.array([0, 5, 0, 8, 3])
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    batch, T = len(lens), int(cu[-1]) + 2
    n = lambda *s, sc=1.0: rng.standard_normal(s) * sc  # noqa: E731
    x, dt, z = n(T, H, P), n(T, H) * 0.5 - 1, n(T, H, P)
    A, D, dtb = -np.exp(n(H, sc=0.5)), n(H), n(H, sc=0.5)
    B, C = n(T, G, N, sc=N**-0.5), n(T, G, N, sc=N**-0.5)
    init = n(batch, H, P, N, sc=0.5)
    has_init = np.array([1, 1, 1, 0, 1], bool)
    nchunks = T // cs + 2 * batch
    plan = ssd_chunk_metadata(cu, cs, nchunks, num_computed_tokens=computed if aligned else None)
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    out, final, chunk_states = ssd_chunk_scan_varlen_reference(
        f(x), f(dt), f(A), f(B), f(C), f(D), f(z), f(dtb), chunk_size=cs, cu_seqlens=cu,
        initial_states=f(init), has_initial_state=has_init, return_intermediate_states=True,
        cu_chunk_seqlens=plan.cu_chunk_seqlens, seq_idx=plan.seq_idx, last_chunk_indices=plan.last_chunk_indices,
        dt_limit=(0.0, math.inf),
    )
    cc, sidx = np.asarray(plan.cu_chunk_seqlens), np.asarray(plan.seq_idx)
    dtp = softplus(dt + dtb)
    for b in range(batch):
        s, e = cu[b], cu[b + 1]
        h0 = init[b] if has_init[b] else np.zeros((H, P, N))
        y, hs = naive_ssm_recurrence(h0, x[s:e], dtp[s:e], A, B[s:e], C[s:e], np.repeat(D[:, None], P, 1), z[s:e])
        np.testing.assert_allclose(np.asarray(out[s:e]), y, atol=ATOL)
        np.testing.assert_allclose(np.asarray(final[b]), hs[-1] if e > s else h0, atol=ATOL)
        for c in np.nonzero((sidx == b) & (cc[1:] > cc[:-1]))[0]:
            np.testing.assert_allclose(np.asarray(chunk_states[c]), hs[cc[c + 1] - s - 1], atol=ATOL)
            if aligned:  # chunk ends are multiples of cs in the request's own token count
                assert (computed[b] + cc[c + 1] - s) % cs == 0 or cc[c + 1] == e
    np.testing.assert_array_equal(np.asarray(out[cu[-1] :]), 0.0)
