"""Plain-JAX reference of ``grouped_matmul``: one matmul per row tile, each tile owned by one group."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmamba.errors import MetadataError


def check_grouped_matmul_args(x, w, tile_group, num_tiles, block_m: int) -> None:
    """Shapes the kernel and the reference accept; raises ``MetadataError`` naming the argument."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2]:
        raise MetadataError(f"x {x.shape} and w {w.shape} must be [R, K] and [G, N, K]")
    if x.shape[0] % block_m:
        raise MetadataError(f"x has {x.shape[0]} rows, not a multiple of block_m={block_m}")
    if tile_group.shape != (x.shape[0] // block_m,):
        raise MetadataError(f"tile_group {tile_group.shape} must have one entry per {block_m}-row tile of x")
    if num_tiles.shape != (1,):
        raise MetadataError(f"num_tiles {num_tiles.shape} must have shape (1,)")


def grouped_matmul_reference(x, w, tile_group, num_tiles, *, block_m: int):
    """``y[r] = x[r] @ w[tile_group[r // block_m]].T`` for rows of the first ``num_tiles`` tiles, 0 after.

    ``x [R, K]``, ``w [G, N, K]`` (torch orientation), ``tile_group int32[R / block_m]`` (entries of
    unused tiles are ignored), ``num_tiles int32[1]`` -> ``[R, N]`` in ``x.dtype`` (float32 accumulation).
    """
    check_grouped_matmul_args(x, w, tile_group, num_tiles, block_m)
    tiles = x.shape[0] // block_m
    used = jnp.arange(tiles) < num_tiles[0]
    group = jnp.where(used, jnp.clip(tile_group, 0, w.shape[0] - 1), 0)
    y = jnp.einsum("tmk,tnk->tmn", x.reshape(tiles, block_m, -1), w[group], preferred_element_type=jnp.float32)
    y = jnp.where(used[:, None, None], y, 0.0)
    return y.reshape(x.shape[0], w.shape[1]).astype(x.dtype)


grouped_matmul_reference_jit = jax.jit(grouped_matmul_reference, static_argnames=("block_m",))
