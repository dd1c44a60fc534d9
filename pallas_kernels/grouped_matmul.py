"""Grouped matmul over row tiles that each belong to one group (a MoE's experts), Triton-Pallas.

``x [R, K]`` holds rows sorted by group with every group padded to a multiple of ``block_m`` rows
(megablocks' layout), so each ``block_m``-row tile multiplies by one group's weight:
``y[tile] = x[tile] @ w[tile_group[tile]].T`` with ``w [G, N, K]`` in torch's ``(out, in)``
orientation. One program per (tile, ``block_n`` output columns), looping over ``K`` in
``block_k`` steps with float32 accumulation. Tiles at or past ``num_tiles`` (the padding of the
static buffer) write zeros and read nothing, so a step's cost follows the routed rows, not the
buffer size, and an expert with no rows costs nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.precision import f32_matmul_precision

from pallas_kernels.reference.common import next_pow2
from pallas_kernels.reference.grouped_matmul import check_grouped_matmul_args

__all__ = ["grouped_matmul", "default_block_sizes"]

_F32 = jnp.float32


def default_block_sizes(n: int, k: int) -> dict:
    """Launch table (no autotuning): ``dict(block_n=..., block_k=..., num_warps=..., num_stages=...)``.

    Triton's ``dot`` needs at least 16 along every dimension.
    """
    return dict(block_n=max(16, min(128, next_pow2(n))), block_k=max(16, min(64, next_pow2(k))), num_warps=4,
                num_stages=2)


def _grouped_matmul_kernel(group_ref, ntiles_ref, x_ref, w_ref, out_ref, *, block_m, block_n, block_k, n_dim,
                           k_dim, f32_precision):
    # group_ref: [tiles] int32; ntiles_ref: [1] int32; x_ref: [R, K]; w_ref: [G, N, K]; out_ref: [R, N]
    t, j = pl.program_id(0), pl.program_id(1)
    rows = t * block_m + jnp.arange(block_m)
    cols = j * block_n + jnp.arange(block_n)
    col_ok = cols < n_dim
    used = t < ntiles_ref[0]

    @pl.when(used)
    def _():
        g = group_ref[t]

        def k_step(kb, acc):
            ks = kb * block_k + jnp.arange(block_k)
            k_ok = ks < k_dim
            a = plt.load(x_ref.at[rows[:, None], ks[None, :]], mask=k_ok[None, :], other=0.0)
            b = plt.load(w_ref.at[g, cols[:, None], ks[None, :]], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            # Float32 is not left to Triton's TF32 default (pallas_kernels.precision).
            precision = f32_precision if a.dtype == _F32 else None
            return acc + jax.lax.dot_general(a, b.astype(a.dtype), (((1,), (1,)), ((), ())),
                                             preferred_element_type=_F32, precision=precision)

        acc = jax.lax.fori_loop(0, pl.cdiv(k_dim, block_k), k_step, jnp.zeros((block_m, block_n), _F32))
        plt.store(out_ref.at[rows[:, None], cols[None, :]], acc.astype(out_ref.dtype), mask=col_ok[None, :])

    @pl.when(jnp.logical_not(used))
    def _():
        plt.store(out_ref.at[rows[:, None], cols[None, :]], jnp.zeros((block_m, block_n), out_ref.dtype),
                  mask=col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret"))
def _grouped_matmul_jit(x, w, tile_group, num_tiles, *, block_m, block_n, block_k, num_warps, num_stages,
                        interpret):
    r, k = x.shape
    n = w.shape[1]
    kernel = functools.partial(_grouped_matmul_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                               n_dim=n, k_dim=k, f32_precision=f32_matmul_precision(interpret))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((r, n), x.dtype),
        grid=(r // block_m, pl.cdiv(n, block_n)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"grouped_matmul_m{block_m}_n{block_n}_k{block_k}",
    )(tile_group.astype(jnp.int32), num_tiles.astype(jnp.int32), x, w)


def grouped_matmul(x, w, tile_group, num_tiles, *, block_m: int = 16, block_n: int | None = None,
                   block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                   interpret: bool = False):
    """``y[r] = x[r] @ w[tile_group[r // block_m]].T`` for the first ``num_tiles`` tiles, 0 for the rest.

    ``x [R, K]`` (``R`` a multiple of ``block_m``, a power of 2 >= 16 on GPU), ``w [G, N, K]``,
    ``tile_group int32[R / block_m]`` (group ids in ``[0, G)`` for used tiles), ``num_tiles int32[1]``
    -> ``[R, N]`` in ``x.dtype``. Same semantics as ``grouped_matmul_reference``.
    """
    check_grouped_matmul_args(x, w, tile_group, num_tiles, block_m)
    table = default_block_sizes(w.shape[1], x.shape[1])
    return _grouped_matmul_jit(
        x, w, tile_group, num_tiles, block_m=block_m, block_n=block_n or table["block_n"],
        block_k=block_k or table["block_k"], num_warps=num_warps or table["num_warps"],
        num_stages=num_stages or table["num_stages"], interpret=interpret,
    )
