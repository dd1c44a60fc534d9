"""Chunked SSD scan (Mamba2 state-space duality) over a packed varlen batch, Triton-Pallas.

Chunks never cross a request: the chunk table ``cu_chunk_seqlens (nchunks + 1)``
with ``seq_idx (nchunks,)`` comes from the metadata (built on the host so that a
request with ``c`` computed tokens has a first chunk ending at the next multiple
of ``chunk_size``), or is built on device from ``cu_seqlens`` with chunks
counted from each request's first token (``reference.ssd_chunk_metadata``).
``nchunks`` is a static padded size; chunks past the last real one are empty.

Three kernels (``dA = dt * A``, every exponent a sum of ``dA <= 0`` terms):

1. ``chunk_state`` -- grid (chunk, head, P block): the chunk's own contribution
   to the state at its end, ``sum_j exp(sum_{l>j} dA_l) dt_j x_j B_j^T``.
2. ``state_passing`` -- grid (head, P block), sequential over chunks: the
   state at each chunk end, restarting from the request's initial state
   (``has_initial_state`` selects; garbage behind False never leaks) whenever
   ``seq_idx`` changes. These are the returned chunk states (prefix caching
   stores the ones at block ends; ``block_size`` is a multiple of ``chunk_size``).
3. ``chunk_scan`` -- grid (chunk, head, block of ``block_l`` rows): output =
   intra-chunk quadratic form ``(C B^T o L) (dt x)`` over the causal row x
   column blocks + ``exp(prefix) C h_in`` + ``D x``, optionally ``* silu(z)``.

Segment sums are built without differences of cumulative sums: the diagonal
block uses the masked cumsum ``S[i, j] = sum_{j<l<=i} dA_l``, off-diagonal
blocks add a within-block prefix, a between-blocks sum and a within-block
suffix, each a sum of non-positive terms; no ``exp(a) * exp(-b)`` anywhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.reference.common import next_pow2, silu, softplus
from pallas_kernels.reference.ssd import normalize_ssd_args, resolve_chunk_plan, validate_chunk_metadata

__all__ = ["ssd_chunk_scan_varlen", "default_block_sizes"]

_F32 = jnp.float32


def default_block_sizes(dtype, chunk_size: int, head_dim: int, d_state: int) -> dict:
    """Launch table: ``dict(block_l=..., block_p=..., num_warps=..., num_stages=...)``.

    ``block_l`` (rows of a chunk per program, and the column block of the
    quadratic form) divides ``chunk_size``; both are >= 16 (Triton ``dot``).
    """
    itemsize = jnp.dtype(dtype).itemsize
    block_l = min(chunk_size, 64 if itemsize <= 2 else 32)
    p_pad = next_pow2(max(head_dim, 16))
    n_pad = next_pow2(max(d_state, 16))
    block_p = min(p_pad, 64)
    num_warps = 8 if p_pad * n_pad >= 128 * 128 else 4
    return dict(block_l=block_l, block_p=block_p, num_warps=num_warps, num_stages=2)


def _chunk_dt(dt_ref, dtb_ref, tok, valid, h, *, softplus_dt, dt_lo, dt_hi, num_tokens):
    """Processed ``dt`` of head ``h`` at token rows ``tok`` (0 where not ``valid``)."""
    dt = plt.load(dt_ref.at[jnp.clip(tok, 0, num_tokens - 1), h], mask=valid, other=0.0).astype(_F32)
    if dtb_ref is not None:
        dt = dt + dtb_ref[h].astype(_F32)
    if softplus_dt:
        dt = softplus(dt)
    if dt_lo > 0.0 or dt_hi < math.inf:
        dt = jnp.clip(dt, dt_lo, dt_hi)
    return jnp.where(valid, dt, 0.0)


def _chunk_bounds(cc_ref, c, chunk_size):
    start = cc_ref[c]
    return start, jnp.clip(cc_ref[c + 1] - start, 0, chunk_size)


def _mm(a, b, contract, mm_dtype):
    """2-D matmul with float32 accumulation; operands in ``mm_dtype``."""
    return jax.lax.dot_general(a.astype(mm_dtype), b.astype(mm_dtype), (contract, ((), ())),
                               preferred_element_type=_F32)


def _chunk_state_kernel(cc_ref, x_ref, dt_ref, *refs, has_bias, dtk, chunk_size, block_l, block_p, head_dim,
                        d_state, n_pad, heads_per_group, num_tokens, mm_dtype):
    # cc_ref: [nchunks + 1]; x_ref: [T, H, P]; dt_ref: [T, H]; dtb_ref: [H]; a_ref: [H]; b_ref: [T, G, N]
    # out contrib_ref: [nchunks, H, P, N] float32
    if has_bias:
        dtb_ref, a_ref, b_ref, contrib_ref = refs
    else:
        dtb_ref = None
        a_ref, b_ref, contrib_ref = refs
    c, h = pl.program_id(0), pl.program_id(1)
    g = h // heads_per_group
    prow = pl.program_id(2) * block_p + jnp.arange(block_p)  # head-dim rows
    ncol = jnp.arange(n_pad)
    start, clen = _chunk_bounds(cc_ref, c, chunk_size)
    a = a_ref[h].astype(_F32)
    lpos = jnp.arange(chunk_size)
    da_full = a * _chunk_dt(dt_ref, dtb_ref, start + lpos, lpos < clen, h, **dtk)  # [chunk]
    jj = jnp.arange(block_l)

    def block(kb, acc):
        pos = kb * block_l + jj
        ok = pos < clen
        tok = jnp.clip(start + pos, 0, num_tokens - 1)
        dt_k = _chunk_dt(dt_ref, dtb_ref, start + pos, ok, h, **dtk)
        da_k = a * dt_k
        within = jnp.sum(jnp.where(jj[None, :] > jj[:, None], da_k[None, :], 0.0), axis=1)  # sum_{l>j, same block}
        after = jnp.sum(jnp.where(lpos >= (kb + 1) * block_l, da_full, 0.0))  # later blocks
        wgt = jnp.exp(within + after) * dt_k  # decay to the chunk end, times dt
        xk = plt.load(x_ref.at[tok[:, None], h, prow[None, :]], mask=ok[:, None] & (prow < head_dim)[None, :],
                      other=0.0).astype(_F32)  # [bl, bp]
        bk = plt.load(b_ref.at[tok[:, None], g, ncol[None, :]], mask=ok[:, None] & (ncol < d_state)[None, :],
                      other=0.0)  # [bl, n]
        return acc + _mm(xk * wgt[:, None], bk, ((0,), (0,)), mm_dtype)  # [bp, n]

    acc = jax.lax.fori_loop(0, chunk_size // block_l, block, jnp.zeros((block_p, n_pad), _F32))
    plt.store(contrib_ref.at[c, h, prow[:, None], ncol[None, :]], acc,
              mask=(prow < head_dim)[:, None] & (ncol < d_state)[None, :])


def _state_passing_kernel(cc_ref, seq_ref, dt_ref, *refs, has_bias, dtk, chunk_size, block_p, head_dim, d_state,
                          n_pad, num_chunks):
    # cc_ref: [nchunks + 1]; seq_ref: [nchunks]; dt_ref: [T, H]; dtb_ref: [H]; a_ref: [H]
    # init_ref: [batch, H, P, N] float32 (zeros where has_initial_state is False)
    # contrib_ref: [nchunks, H, P, N] float32; out states_ref: [nchunks, H, P, N] float32
    if has_bias:
        dtb_ref, a_ref, init_ref, contrib_ref, states_ref = refs
    else:
        dtb_ref = None
        a_ref, init_ref, contrib_ref, states_ref = refs
    h = pl.program_id(0)
    prow = pl.program_id(1) * block_p + jnp.arange(block_p)
    ncol = jnp.arange(n_pad)
    tile_ok = (prow < head_dim)[:, None] & (ncol < d_state)[None, :]
    a = a_ref[h].astype(_F32)
    lpos = jnp.arange(chunk_size)

    def chunk(c, s):
        seq = seq_ref[c]
        first = (c == 0) | (seq != seq_ref[jnp.maximum(c - 1, 0)])
        h0 = plt.load(init_ref.at[seq, h, prow[:, None], ncol[None, :]], mask=tile_ok & first, other=0.0)
        s = jnp.where(first, h0, s)
        start, clen = _chunk_bounds(cc_ref, c, chunk_size)
        total = jnp.sum(a * _chunk_dt(dt_ref, dtb_ref, start + lpos, lpos < clen, h, **dtk))
        contrib = plt.load(contrib_ref.at[c, h, prow[:, None], ncol[None, :]], mask=tile_ok, other=0.0)
        s = jnp.exp(total) * s + contrib
        plt.store(states_ref.at[c, h, prow[:, None], ncol[None, :]], s, mask=tile_ok)
        return s

    jax.lax.fori_loop(0, num_chunks, chunk, jnp.zeros((block_p, n_pad), _F32))


def _chunk_scan_kernel(cc_ref, seq_ref, x_ref, dt_ref, *refs, has_bias, has_d, has_z, dtk, chunk_size, block_l,
                       head_dim, d_state, p_pad, n_pad, heads_per_group, num_tokens, mm_dtype):
    # cc_ref: [nchunks + 1]; seq_ref: [nchunks]; x_ref: [T, H, P]; dt_ref: [T, H]; dtb_ref: [H]; a_ref: [H]
    # b_ref, c_ref: [T, G, N]; d_ref: [H, P] float32; z_ref: [T, H, P]
    # init_ref: [batch, H, P, N] float32; states_ref: [nchunks, H, P, N] float32 (chunk-end states)
    # out_init (zeros, aliased to out_ref); out_ref: [T, H, P]
    refs = list(refs)
    dtb_ref = refs.pop(0) if has_bias else None
    a_ref, b_ref, c_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    d_ref = refs.pop(0) if has_d else None
    z_ref = refs.pop(0) if has_z else None
    init_ref, states_ref, _, out_ref = refs
    c, h, m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g = h // heads_per_group
    start, clen = _chunk_bounds(cc_ref, c, chunk_size)

    @pl.when(m * block_l < clen)
    def _():
        pcol = jnp.arange(p_pad)
        ncol = jnp.arange(n_pad)
        p_ok = pcol < head_dim
        n_ok = ncol < d_state
        a = a_ref[h].astype(_F32)
        lpos = jnp.arange(chunk_size)
        da_full = a * _chunk_dt(dt_ref, dtb_ref, start + lpos, lpos < clen, h, **dtk)  # [chunk]
        ii = jnp.arange(block_l)
        pos_i = m * block_l + ii
        ok_i = pos_i < clen
        tok_i = jnp.clip(start + pos_i, 0, num_tokens - 1)
        da_m = a * _chunk_dt(dt_ref, dtb_ref, start + pos_i, ok_i, h, **dtk)
        prefix_local = jnp.cumsum(da_m)  # sum_{m*bl <= l <= i} dA (same-sign terms)
        before = jnp.sum(jnp.where(lpos < m * block_l, da_full, 0.0))  # earlier blocks of the chunk
        cm = plt.load(c_ref.at[tok_i[:, None], g, ncol[None, :]], mask=ok_i[:, None] & n_ok[None, :], other=0.0)

        # Inter-chunk term: the state entering the chunk, decayed to each row.
        seq = seq_ref[c]
        first = (c == 0) | (seq != seq_ref[jnp.maximum(c - 1, 0)])
        tile_ok = p_ok[:, None] & n_ok[None, :]
        h_init = plt.load(init_ref.at[seq, h, pcol[:, None], ncol[None, :]], mask=tile_ok & first, other=0.0)
        h_prev = plt.load(states_ref.at[jnp.maximum(c - 1, 0), h, pcol[:, None], ncol[None, :]],
                          mask=tile_ok & jnp.logical_not(first), other=0.0)
        h_in = jnp.where(first, h_init, h_prev)  # [p, n]
        y = jnp.exp(before + prefix_local)[:, None] * _mm(cm, h_in, ((1,), (1,)), _F32)  # [bl, p]

        # Intra-chunk quadratic form over column blocks kb <= m.
        jj = ii
        diag_mask = jj[None, :] <= ii[:, None]

        def col_block(kb, y):
            pos_j = kb * block_l + jj
            ok_j = pos_j < clen
            tok_j = jnp.clip(start + pos_j, 0, num_tokens - 1)
            dt_k = _chunk_dt(dt_ref, dtb_ref, start + pos_j, ok_j, h, **dtk)
            da_k = a * dt_k
            # diagonal block: S[i, j] = sum_{j < l <= i} dA_l (masked cumsum over l)
            seg_diag = jnp.cumsum(jnp.where(ii[:, None] > jj[None, :], da_k[:, None], 0.0), axis=0)
            # off-diagonal: (within block m up to i) + (blocks between) + (within block kb after j)
            suffix = jnp.sum(jnp.where(jj[None, :] > jj[:, None], da_k[None, :], 0.0), axis=1)
            between = jnp.sum(jnp.where((lpos >= (kb + 1) * block_l) & (lpos < m * block_l), da_full, 0.0))
            seg_off = prefix_local[:, None] + (between + suffix)[None, :]
            on_diag = kb == m
            seg = jnp.where(on_diag, seg_diag, seg_off)
            keep = (diag_mask | jnp.logical_not(on_diag)) & ok_i[:, None] & ok_j[None, :]
            decay = jnp.where(keep, jnp.exp(jnp.minimum(seg, 0.0)), 0.0)
            bk = plt.load(b_ref.at[tok_j[:, None], g, ncol[None, :]], mask=ok_j[:, None] & n_ok[None, :],
                          other=0.0)
            xk = plt.load(x_ref.at[tok_j[:, None], h, pcol[None, :]], mask=ok_j[:, None] & p_ok[None, :],
                          other=0.0)
            cb = _mm(cm, bk, ((1,), (1,)), mm_dtype)  # [bl, bl]
            return y + _mm(cb * decay * dt_k[None, :], xk, ((1,), (0,)), mm_dtype)

        y = jax.lax.fori_loop(0, m + 1, col_block, y)
        row_ok = ok_i[:, None] & p_ok[None, :]
        x_m = plt.load(x_ref.at[tok_i[:, None], h, pcol[None, :]], mask=row_ok, other=0.0).astype(_F32)
        if has_d:
            y = y + x_m * plt.load(d_ref.at[h, pcol], mask=p_ok, other=0.0)[None, :]
        if has_z:
            y = y * silu(plt.load(z_ref.at[tok_i[:, None], h, pcol[None, :]], mask=row_ok, other=0.0).astype(_F32))
        plt.store(out_ref.at[(start + pos_i)[:, None], h, pcol[None, :]], y.astype(out_ref.dtype), mask=row_ok)


@functools.partial(
    jax.jit,
    static_argnames=("chunk_size", "return_intermediate_states", "dt_softplus", "dt_limit", "state_dtype",
                     "interpret", "block_l", "block_p", "num_warps", "num_stages"),
)
def _ssd_jit(x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_states, has_initial_state, cu_chunk_seqlens,
             last_chunk_indices, seq_idx, *, chunk_size, return_intermediate_states, dt_softplus, dt_limit,
             state_dtype, interpret, block_l, block_p, num_warps, num_stages):
    a = normalize_ssd_args(x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_states, has_initial_state)
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    plan = resolve_chunk_plan(cu_seqlens, chunk_size, T, cu_chunk_seqlens, seq_idx, last_chunk_indices)
    cc, sidx = plan.cu_chunk_seqlens, plan.seq_idx
    nc = cc.shape[0] - 1
    p_pad, n_pad = next_pow2(max(P, 16)), next_pow2(max(N, 16))
    block_p = min(block_p, p_pad)
    mm_dtype = x.dtype if jnp.dtype(x.dtype).itemsize == 2 else _F32
    dtk = dict(softplus_dt=dt_softplus, dt_lo=dt_limit[0], dt_hi=dt_limit[1], num_tokens=T)
    has_bias = a.dt_bias is not None
    bias_ops = [a.dt_bias] if has_bias else []
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    state_shape = jax.ShapeDtypeStruct((nc, H, P, N), _F32)
    common = dict(chunk_size=chunk_size, head_dim=P, d_state=N, n_pad=n_pad, has_bias=has_bias, dtk=dtk)

    contrib = pl.pallas_call(
        functools.partial(_chunk_state_kernel, block_l=block_l, block_p=block_p, heads_per_group=H // G,
                          num_tokens=T, mm_dtype=mm_dtype, **common),
        out_shape=state_shape,
        grid=(nc, H, p_pad // block_p),
        compiler_params=params,
        interpret=interpret,
        name=f"ssd_chunk_state_cs{chunk_size}_bl{block_l}_bp{block_p}",
    )(cc, a.x, a.dt, *bias_ops, a.A, a.B)

    states = pl.pallas_call(
        functools.partial(_state_passing_kernel, block_p=block_p, num_chunks=nc, **common),
        out_shape=state_shape,
        grid=(H, p_pad // block_p),
        compiler_params=params,
        interpret=interpret,
        name=f"ssd_state_passing_cs{chunk_size}_bp{block_p}",
    )(cc, sidx, a.dt, *bias_ops, a.A, a.init, contrib)

    operands = [cc, sidx, a.x, a.dt, *bias_ops, a.A, a.B, a.C]
    operands += [a.D] if a.D is not None else []
    operands += [a.z] if a.z is not None else []
    operands += [a.init, states, jnp.zeros(x.shape, x.dtype)]
    out = pl.pallas_call(
        functools.partial(_chunk_scan_kernel, block_l=block_l, p_pad=p_pad, has_d=a.D is not None,
                          has_z=a.z is not None, heads_per_group=H // G, num_tokens=T, mm_dtype=mm_dtype, **common),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(nc, H, chunk_size // block_l),
        input_output_aliases={len(operands) - 1: 0},
        compiler_params=params,
        interpret=interpret,
        name=f"ssd_chunk_scan_cs{chunk_size}_bl{block_l}",
    )(*operands)

    batch = a.init.shape[0]
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    lengths = cu[1:] - cu[:-1]
    last = jnp.clip(plan.last_chunk_indices, 0, nc - 1)
    final = jnp.where((lengths > 0)[:batch, None, None, None], states[last], a.init)
    sd = _F32 if state_dtype is None else state_dtype
    return out, final.astype(sd), (states.astype(sd) if return_intermediate_states else None)


def ssd_chunk_scan_varlen(
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
    interpret=False,
    block_l=None,
    block_p=None,
    num_warps=None,
    num_stages=None,
):
    """Chunked SSD scan for prefill; returns outputs, final states and chunk-end states.

    Args:
      x: ``(T, H, P)`` packed tokens; ``dt``: ``(T, H)`` (raw, before ``dt_bias``).
      A: ``(H,)`` negative; B, C: ``(T, G, N)``; D: ``(H,)``/``(H, P)`` or None;
        z: ``(T, H, P)`` or None (``y *= silu(z)``); dt_bias: ``(H,)`` or None.
      chunk_size: power of 2, >= 16.
      cu_seqlens: ``(batch + 1,)`` request offsets in ``x``.
      initial_states: ``(batch, H, P, N)`` or None; ``has_initial_state``:
        ``(batch,)`` bool (default all True when ``initial_states`` is given).
      return_intermediate_states: also return the state at every chunk end.
      dt_softplus, dt_limit: ``dt = clip(softplus(dt + dt_bias), *dt_limit)``.
      cu_chunk_seqlens, seq_idx, last_chunk_indices: the metadata's chunk table
        (``(nchunks + 1,)``, ``(nchunks,)``, ``(batch,)``); built on device from
        ``cu_seqlens`` when absent (``T // chunk_size + batch`` chunks).
      state_dtype: dtype of the returned states (default float32).
      interpret, block_l, block_p, num_warps, num_stages: see ``default_block_sizes``.

    Returns:
      ``(out (T, H, P) in x.dtype, final_states (batch, H, P, N), chunk_states
      (nchunks, H, P, N) or None)``. A request with no tokens returns its
      initial state (zeros without one); tokens outside every request get zeros.
    """
    chunk_size = int(chunk_size)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size={chunk_size} must be a power of 2 >= 16 for the Pallas kernel")
    validate_chunk_metadata(cu_seqlens, chunk_size, x.shape[0], cu_chunk_seqlens, seq_idx, last_chunk_indices)
    d = default_block_sizes(x.dtype, chunk_size, x.shape[2], B.shape[2])
    block_l = d["block_l"] if block_l is None else block_l
    block_p = d["block_p"] if block_p is None else block_p
    for name, v in (("block_l", block_l), ("block_p", block_p)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of 2 >= 16")
    if chunk_size % block_l:
        raise ValueError(f"block_l={block_l} must divide chunk_size={chunk_size}")
    return _ssd_jit(
        x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_states, has_initial_state, cu_chunk_seqlens,
        last_chunk_indices, seq_idx, chunk_size=chunk_size,
        return_intermediate_states=bool(return_intermediate_states), dt_softplus=bool(dt_softplus),
        dt_limit=(float(dt_limit[0]), float(dt_limit[1])), state_dtype=state_dtype, interpret=bool(interpret),
        block_l=int(block_l), block_p=int(block_p),
        num_warps=int(d["num_warps"] if num_warps is None else num_warps),
        num_stages=int(d["num_stages"] if num_stages is None else num_stages),
    )
