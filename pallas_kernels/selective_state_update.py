"""Multi-slot selective state update (Mamba2 decode and speculative decode), Triton-Pallas.

One program per (request, head, block of head-dim rows); the state is updated in place (aliased, the
cache donated). Semantics (vLLM's ``selective_state_update``): docs/architecture.md,
"selective_state_update".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxmamba.errors import JaxMambaError
from jaxmamba.layout import PAD_SLOT_ID
from pallas_kernels.reference.common import next_pow2, silu, softplus
from pallas_kernels.reference.selective_state_update import normalize_ssu_args, ssu_plan, validate_ssu_indices

__all__ = ["selective_state_update", "default_block_sizes"]


def default_block_sizes(state_dtype, head_dim: int, d_state: int) -> dict:
    """Launch table, chosen by hand (never autotune an in-place kernel: a trial
    run would overwrite the state). A program holds ``block_p x next_pow2(N)``
    state elements: 2048 (8 KiB in float32) or 4096 (8 KiB in bfloat16), e.g.
    ``block_p = 16`` for ``N = 128`` in float32. Checked with ptxas for sm_90a (no spills), not
    yet timed on a GPU.

    Returns ``dict(block_p=..., num_warps=..., num_stages=...)``.
    """
    itemsize = jnp.dtype(state_dtype).itemsize
    n_pad = next_pow2(d_state)
    elems = {4: 2048, 2: 4096}.get(itemsize, 2048)
    block_p = max(1, min(next_pow2(head_dim), elems // n_pad))
    tile = block_p * n_pad
    # A tile of <= 512 elements spread over 2-4 warps made ptxas spill (sm_90a, 32x16 with spec decode);
    # one warp holds it in ~60 registers.
    num_warps = 1 if tile <= 512 else 4 if tile <= 4096 else 8
    return dict(block_p=block_p, num_warps=num_warps, num_stages=2)


def _ssu_kernel(*refs, dt_full, a_full, has_bias, has_d, has_z, zero_init, spec, softplus_dt,
                head_dim, d_state, block_p, n_pad, heads_per_group, ncols, num_tokens):
    # Inputs (whole arrays; indices come from int32 refs, no scalar prefetch):
    src_ref, dst_ref, start_ref, len_ref = refs[:4]  # [batch] [batch, ncols] [batch] [batch]
    refs = list(refs[4:])
    x_ref = refs.pop(0)  # [T, H, P]
    dt_ref = refs.pop(0)  # [T, H, P] or [T, H]
    dtb_ref = refs.pop(0) if has_bias else None  # [H, P] or [H]
    a_ref = refs.pop(0)  # [H, P, N] or [H]
    b_ref = refs.pop(0)  # [T, G, N]
    c_ref = refs.pop(0)  # [T, G, N]
    d_ref = refs.pop(0) if has_d else None  # [H, P] float32
    z_ref = refs.pop(0) if has_z else None  # [T, H, P]
    if zero_init:
        refs.pop(0)  # [T, H, P] zeros, aliased to out_ref
    refs.pop(0)  # [slots, H, P, N] state input, aliased to state_ref
    out_ref, state_ref = refs  # [T, H, P], [slots, H, P, N]

    b = pl.program_id(0)
    h = pl.program_id(1)
    g = h // heads_per_group
    rows = pl.program_id(2) * block_p + jnp.arange(block_p)  # head-dim rows of this tile
    cols = jnp.arange(n_pad)  # d_state columns
    row_ok = rows < head_dim
    tile_ok = row_ok[:, None] & (cols < d_state)[None, :]

    src = src_ref[b]
    start = start_ref[b]
    length = len_ref[b]
    # The source slot is read only when usable; -1 is never an address.
    s0 = plt.load(
        state_ref.at[jnp.maximum(src, 0), h, rows[:, None], cols[None, :]],
        mask=tile_ok & (src >= 0), other=0.0,
    ).astype(jnp.float32)
    if a_full:
        a_val = plt.load(a_ref.at[h, rows[:, None], cols[None, :]], mask=tile_ok, other=0.0).astype(jnp.float32)
    else:
        a_val = a_ref[h].astype(jnp.float32)
    if has_bias:
        bias = (plt.load(dtb_ref.at[h, rows], mask=row_ok, other=0.0) if dt_full else dtb_ref[h]).astype(jnp.float32)
    if has_d:
        d_val = plt.load(d_ref.at[h, rows], mask=row_ok, other=0.0)

    def store_state(slot, s, ok):
        plt.store(state_ref.at[jnp.maximum(slot, 0), h, rows[:, None], cols[None, :]],
                  s.astype(state_ref.dtype), mask=tile_ok & ok)

    def token(t, s):
        tok = jnp.minimum(start + t, num_tokens - 1)
        x = plt.load(x_ref.at[tok, h, rows], mask=row_ok, other=0.0).astype(jnp.float32)  # [bp]
        if dt_full:
            dt = plt.load(dt_ref.at[tok, h, rows], mask=row_ok, other=0.0).astype(jnp.float32)  # [bp]
        else:
            dt = dt_ref[tok, h].astype(jnp.float32)  # scalar
        if has_bias:
            dt = dt + bias
        if softplus_dt:
            dt = softplus(dt)
        bvec = plt.load(b_ref.at[tok, g, cols], mask=cols < d_state, other=0.0).astype(jnp.float32)  # [n]
        cvec = plt.load(c_ref.at[tok, g, cols], mask=cols < d_state, other=0.0).astype(jnp.float32)  # [n]
        dt_col = dt[:, None] if dt_full else dt
        decay = jnp.exp(a_val * dt_col)  # scalar, [bp, 1] or [bp, n]
        s = s * decay + (bvec[None, :] * dt_col) * x[:, None]
        if spec:
            slot = dst_ref[b, jnp.minimum(t, ncols - 1)]
            store_state(slot, s, (slot >= 0) & (t < ncols))
        y = jnp.sum(s * cvec[None, :], axis=1)
        if has_d:
            y = y + x * d_val
        if has_z:
            y = y * silu(plt.load(z_ref.at[tok, h, rows], mask=row_ok, other=0.0).astype(jnp.float32))
        plt.store(out_ref.at[tok, h, rows], y.astype(out_ref.dtype), mask=row_ok)
        return s

    s = jax.lax.fori_loop(0, length, token, s0)
    if not spec:
        slot = dst_ref[b, 0]
        store_state(slot, s, slot >= 0)


@functools.partial(
    jax.jit,
    static_argnames=("dt_softplus", "pad_slot_id", "max_query_len", "interpret", "block_p", "num_warps",
                     "num_stages"),
)
def _ssu_jit(ssm_state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dst_state_batch_indices,
             num_accepted_tokens, cu_seqlens, *, dt_softplus, pad_slot_id, max_query_len, interpret, block_p,
             num_warps, num_stages):
    num_slots, H, P, N = ssm_state.shape
    a = normalize_ssu_args(ssm_state, x, dt, A, B, C, D, z, dt_bias)
    T = x.shape[0]
    plan = ssu_plan(num_slots, T, state_batch_indices, dst_state_batch_indices, num_accepted_tokens,
                    cu_seqlens, pad_slot_id, max_query_len)
    batch = plan.src.shape[0]
    G = a.B.shape[1]
    p_pad = next_pow2(P)
    block_p = min(block_p, p_pad)
    operands = [plan.src, plan.dst, plan.start, plan.length, a.x, a.dt]
    if a.dt_bias is not None:
        operands.append(a.dt_bias)
    operands += [a.A, a.B, a.C]
    if a.D is not None:
        operands.append(a.D)
    if a.z is not None:
        operands.append(a.z)
    zero_init = plan.varlen  # varlen padding tokens belong to no program: start them at zero
    aliases = {}
    if zero_init:
        aliases[len(operands)] = 0
        operands.append(jnp.zeros(x.shape, x.dtype))
    aliases[len(operands)] = 1
    operands.append(ssm_state)
    kernel = functools.partial(
        _ssu_kernel,
        dt_full=a.dt.ndim == 3, a_full=a.A.ndim == 3, has_bias=a.dt_bias is not None, has_d=a.D is not None,
        has_z=a.z is not None, zero_init=zero_init, spec=plan.spec, softplus_dt=dt_softplus, head_dim=P,
        d_state=N, block_p=block_p, n_pad=next_pow2(N), heads_per_group=H // G, ncols=plan.dst.shape[1],
        num_tokens=T,
    )
    out, state = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(ssm_state.shape, ssm_state.dtype)),
        grid=(batch, H, p_pad // block_p),
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"selective_state_update_bp{block_p}_n{next_pow2(N)}{'_spec' if plan.spec else ''}",
    )(*operands)
    return out, state


def selective_state_update(
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
    interpret=False,
    block_p=None,
    num_warps=None,
    num_stages=None,
):
    """Advance Mamba2 SSM states by one or more tokens per request, in place.

    Args:
      ssm_state: ``(slots, H, P, N)`` float32/bfloat16 state cache (aliased to
        the returned state; donate it at the enclosing jit for in-place updates).
      x: ``(T, H, P)``; ``z``: ``(T, H, P)`` or None (output gate ``y *= silu(z)``).
      dt: ``(T, H, P)`` or head-tied ``(T, H)``.
      A: ``(H, P, N)`` or ``(H,)`` (already negative: ``-exp(A_log)``).
      B, C: ``(T, G, N)``; head ``h`` uses group ``h // (H // G)``.
      D, dt_bias: ``(H, P)``, ``(H,)`` or None.
      dt_softplus: apply ``softplus(dt + dt_bias)``.
      state_batch_indices: ``(batch,)`` (one token per request, source and
        destination) or ``(batch, 1 + num_spec)``.
      dst_state_batch_indices: defaults to ``state_batch_indices``.
      num_accepted_tokens: ``(batch,)``; speculative decoding: the source is
        column ``max(num_accepted - 1, 0)`` and token ``t``'s state goes to
        ``dst[:, t]`` (also without it when ``cu_seqlens`` is given and the
        destination array has several columns; one column: final state only).
      cu_seqlens: ``(batch + 1,)`` token offsets of each request in ``x``.
      pad_slot_id: index meaning "skip" (the null slot 0 is skipped as well).
      max_query_len: with ``cu_seqlens``, a static bound on every request's
        length (see ``ssu_plan``; the reference loops that many times).
      interpret: run the kernel in the Pallas interpreter (CPU).
      block_p, num_warps, num_stages: launch parameters (see ``default_block_sizes``).

    Returns:
      ``(out (T, H, P) in x.dtype, ssm_state)``.
    """
    if ssm_state.ndim != 4 or x.ndim != 3:
        raise JaxMambaError(f"ssm_state must be (slots, H, P, N) and x (T, H, P); got {ssm_state.shape}, {x.shape}")
    validate_ssu_indices(ssm_state.shape[0], x.shape[0], state_batch_indices, dst_state_batch_indices,
                         num_accepted_tokens, cu_seqlens, pad_slot_id, max_query_len)
    defaults = default_block_sizes(ssm_state.dtype, ssm_state.shape[2], ssm_state.shape[3])
    block_p = defaults["block_p"] if block_p is None else block_p
    if block_p < 1 or block_p & (block_p - 1):
        raise ValueError(f"block_p={block_p} must be a power of 2")
    return _ssu_jit(
        ssm_state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dst_state_batch_indices,
        num_accepted_tokens, cu_seqlens, dt_softplus=bool(dt_softplus), pad_slot_id=int(pad_slot_id),
        max_query_len=None if max_query_len is None else int(max_query_len),
        interpret=bool(interpret), block_p=int(block_p),
        num_warps=int(defaults["num_warps"] if num_warps is None else num_warps),
        num_stages=int(defaults["num_stages"] if num_stages is None else num_stages),
    )
