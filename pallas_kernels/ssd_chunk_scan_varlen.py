"""Chunked SSD scan (Mamba2 state-space duality) over a packed varlen batch, Triton-Pallas.

Runs as vLLM's five passes (``pallas_kernels.ssd``) over chunks that never cross a request. The chunk
table, the passes and the numerics: docs/architecture.md, "ssd_chunk_scan_varlen" and "SSD numerics".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.reference.common import next_pow2
from pallas_kernels.reference.ssd import normalize_ssd_args, resolve_chunk_plan, validate_chunk_metadata
from pallas_kernels.ssd import chunk_bmm, chunk_cumsum, chunk_scan, chunk_state, state_passing
from pallas_kernels.ssd._common import check_block

__all__ = ["ssd_chunk_scan_varlen", "default_block_sizes"]

_F32 = jnp.float32


def default_block_sizes(dtype, chunk_size: int, head_dim: int, d_state: int, tokens_per_row: int | None = None) -> dict:
    """Launch table of the five passes (no autotuning), keyed by shape and dtype.

    Returns ``dict(block_l, block_p, scan_block_p, block_n, state_block_n, bmm_block_n, block_h, num_warps,
    scan_num_warps, state_num_warps, num_stages)``: ``block_l`` rows per program of ``chunk_state``/``chunk_scan``
    and the ``chunk_bmm`` tile (divides ``chunk_size``); ``block_p`` head-dim
    columns per program (``scan_block_p`` those of ``chunk_scan``); ``block_n`` the ``d_state`` slice of
    ``chunk_scan``'s ``C h_in``; ``state_block_n`` the ``d_state`` tile of ``chunk_state`` and
    ``state_passing``; ``bmm_block_n`` the ``d_state`` slice of ``chunk_bmm``;
    ``block_h`` heads per ``chunk_cumsum`` program; ``scan_num_warps`` the warps
    of ``chunk_scan`` (8 once a program's ``block_l x block_p`` tile reaches
    2048 elements), ``state_num_warps`` those of ``state_passing`` (8 for a
    4096-element tile: ptxas spilled a 64x64 tile over 4 warps), ``num_warps``
    those of the other passes.

    ``tokens_per_row``: the packed tokens per request of the launch (``T / batch``, static). Where it is
    below ``block_l``, ``block_l`` shrinks to the power of two that holds it (at least 16): the passes run
    whole ``block_l``-row tiles of every non-empty chunk, so a step of many short prompt chunks (a mixed
    bucket with ``T = R``: one-token chunks) did 64-row tiles for each token and spent more on the SSD's
    padding rows than on its projections (``python -m jaxmamba plan``'s flops beside batch_flops).

    Checked with ptxas for sm_90a over chunk sizes 16..256, head_dim 32..128,
    d_state 16..256, f32/bf16: no spills, chunk_scan under 200 registers,
    shared memory well within the 227 KiB opt-in limit
    (``tests/pallas_kernels/test_h100_compile.py``).
    """
    itemsize = jnp.dtype(dtype).itemsize
    p_pad = next_pow2(max(head_dim, 16))
    n_pad = next_pow2(max(d_state, 16))
    block_l = min(chunk_size, 64 if itemsize <= 2 else 32)
    if tokens_per_row is not None:
        block_l = min(block_l, max(16, next_pow2(max(int(tokens_per_row), 1))))
    block_p = min(p_pad, 64)
    # Float32 products run as 3xTF32 (pallas_kernels.precision): three tensor-core products per dot. On
    # sm_90a a 32 x 64 chunk_scan tile spilled 16 bytes, and a 32 x 32 one over 4 warps did with jax 0.11.2's
    # Triton (chunk 256, d_state 16): float32 takes 8 warps from 1024 elements.
    scan_block_p = min(p_pad, 64 if itemsize <= 2 else 32)
    state_block_n = min(n_pad, 64)
    return dict(
        block_l=block_l,
        block_p=block_p,
        scan_block_p=scan_block_p,
        block_n=min(n_pad, 32),
        state_block_n=state_block_n,
        bmm_block_n=min(n_pad, 64),
        # <= 1024 elements of (chunk, heads) per program: 2048 spilled 16 bytes on 4 warps with jax 0.11.2.
        block_h=max(1, min(16, 1024 // chunk_size)),
        num_warps=4,
        scan_num_warps=8 if block_l * scan_block_p >= (2048 if itemsize <= 2 else 1024) else 4,
        state_num_warps=8 if block_p * state_block_n >= 4096 else 4,
        num_stages=2,
    )


@functools.partial(
    jax.jit,
    static_argnames=("chunk_size", "return_intermediate_states", "dt_softplus", "dt_limit", "state_dtype",
                     "interpret", "blocks"),
)
def _ssd_jit(x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_states, has_initial_state, cu_chunk_seqlens,
             last_chunk_indices, seq_idx, *, chunk_size, return_intermediate_states, dt_softplus, dt_limit,
             state_dtype, interpret, blocks):
    a = normalize_ssd_args(x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_states, has_initial_state)
    T = x.shape[0]
    plan = resolve_chunk_plan(cu_seqlens, chunk_size, T, cu_chunk_seqlens, seq_idx, last_chunk_indices)
    cc, sidx = plan.cu_chunk_seqlens, plan.seq_idx
    nc = cc.shape[0] - 1
    b = dict(blocks)
    launch = dict(num_warps=b["num_warps"], num_stages=b["num_stages"], interpret=interpret)
    scan_launch = dict(launch, num_warps=b["scan_num_warps"])
    state_launch = dict(launch, num_warps=b["state_num_warps"])
    # one past the last non-empty chunk: the padded tail of the table is empty
    nonempty = cc[1:] > cc[:-1]
    num_real = jnp.max(jnp.where(nonempty, jnp.arange(1, nc + 1, dtype=jnp.int32), 0)).reshape(1)

    dt_c, da_cs, da_suffix = chunk_cumsum(a.dt, a.A, a.dt_bias, cc, chunk_size=chunk_size, dt_softplus=dt_softplus,
                                          dt_limit=dt_limit, block_l=b["block_l"], block_h=b["block_h"], **launch)
    cb = chunk_bmm(a.C, a.B, cc, chunk_size=chunk_size, block_m=b["block_l"], block_n=b["bmm_block_n"], **launch)
    contrib = chunk_state(a.x, a.B, dt_c, da_suffix, a.A, cc, chunk_size=chunk_size, block_l=b["block_l"],
                          block_p=b["block_p"], block_n=b["state_block_n"], **launch)
    states = state_passing(da_cs, a.init, contrib, cc, sidx, num_real, chunk_size=chunk_size,
                           block_p=b["block_p"], block_n=b["state_block_n"],
                           write_tail=return_intermediate_states, **state_launch)
    out = chunk_scan(a.x, a.C, cb, dt_c, da_cs, da_suffix, a.A, a.init, states, cc, sidx, a.D, a.z,
                     chunk_size=chunk_size, block_l=b["block_l"], block_p=b["scan_block_p"], block_n=b["block_n"],
                     **scan_launch)

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
    batch = int(jnp.shape(cu_seqlens)[0]) - 1
    d = default_block_sizes(x.dtype, chunk_size, x.shape[2], B.shape[2], tokens_per_row=-(-x.shape[0] // max(batch, 1)))
    for name, v in (("block_l", block_l), ("block_p", block_p), ("scan_block_p", block_p), ("num_warps", num_warps),
                    ("scan_num_warps", num_warps), ("state_num_warps", num_warps), ("num_stages", num_stages)):
        if v is not None:
            d[name] = v
    for name in ("block_l", "block_p", "scan_block_p", "block_n", "bmm_block_n", "state_block_n"):
        d[name] = check_block(name, d[name], 16)
    if chunk_size % d["block_l"]:
        raise ValueError(f"block_l={d['block_l']} must divide chunk_size={chunk_size}")
    return _ssd_jit(
        x, dt, A, B, C, D, z, dt_bias, cu_seqlens, initial_states, has_initial_state, cu_chunk_seqlens,
        last_chunk_indices, seq_idx, chunk_size=chunk_size,
        return_intermediate_states=bool(return_intermediate_states), dt_softplus=bool(dt_softplus),
        dt_limit=(float(dt_limit[0]), float(dt_limit[1])), state_dtype=state_dtype, interpret=bool(interpret),
        blocks=tuple(sorted((k, int(v)) for k, v in d.items())),
    )
