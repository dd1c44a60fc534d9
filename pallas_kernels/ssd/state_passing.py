"""SSD pass 4: the state at every chunk end, sequentially over the real chunks.

Grid ``(H, (P / block_p) * (N / block_n))``. A program runs the recurrence
``s <- exp(sum_chunk dA) s + contrib`` only over chunks ``0 .. num_real - 1``
(``num_real`` is read on device: the padded tail of the static chunk table is
empty), restarting from the request's initial state whenever ``seq_idx``
changes. With ``write_tail`` the loop goes on over the empty tail, reading
nothing and storing the state each tail chunk would carry (the entering state:
an empty chunk changes nothing), so the returned chunk states match the
reference everywhere; without it the tail is left unspecified.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.reference.common import next_pow2
from pallas_kernels.ssd._common import F32, chunk_bounds

__all__ = ["state_passing"]


def _state_passing_kernel(cc_ref, seq_ref, nreal_ref, da_cs_ref, init_ref, contrib_ref, states_ref, *, chunk_size,
                          block_p, block_n, head_dim, d_state, num_chunks, write_tail):
    # cc_ref: [nchunks + 1]; seq_ref: [nchunks]; nreal_ref: [1]; da_cs_ref: [H, nchunks, cs] float32
    # init_ref: [batch, H, P, N] float32 (zeros where has_initial_state is False)
    # contrib_ref: [nchunks, H, P, N] float32; out states_ref: [nchunks, H, P, N] float32
    h, t = pl.program_id(0), pl.program_id(1)
    n_tiles = pl.cdiv(d_state, block_n)
    prow = (t // n_tiles) * block_p + jnp.arange(block_p)
    ncol = (t % n_tiles) * block_n + jnp.arange(block_n)
    tile_ok = (prow < head_dim)[:, None] & (ncol < d_state)[None, :]
    addr = (h, prow[:, None], ncol[None, :])

    num_real = jnp.clip(nreal_ref[0], 0, num_chunks)

    def chunk(c, s):
        seq = seq_ref[c]
        first = (c == 0) | (seq != seq_ref[jnp.maximum(c - 1, 0)])
        h0 = plt.load(init_ref.at[(seq,) + addr], mask=tile_ok & first, other=0.0)
        s = jnp.where(first, h0, s)
        # past num_real every chunk is empty: nothing is read, the entering state is stored as it is
        _, clen = chunk_bounds(cc_ref, c, chunk_size)
        live = (c < num_real) & (clen > 0)
        total = jnp.where(live, da_cs_ref[h, c, chunk_size - 1], 0.0)  # sum of the chunk's dA
        contrib = plt.load(contrib_ref.at[(c,) + addr], mask=tile_ok & live, other=0.0)
        s = jnp.exp(total) * s + contrib
        plt.store(states_ref.at[(c,) + addr], s, mask=tile_ok)
        return s

    # the tail is walked only when its states are returned
    jax.lax.fori_loop(0, num_chunks if write_tail else num_real, chunk, jnp.zeros((block_p, block_n), F32))


@functools.partial(jax.jit, static_argnames=("chunk_size", "block_p", "block_n", "write_tail", "num_warps",
                                             "num_stages", "interpret"))
def state_passing(da_cumsum, init, contrib, cu_chunk_seqlens, seq_idx, num_real_chunks, *, chunk_size, block_p,
                  block_n, write_tail=True, num_warps=4, num_stages=2, interpret=False):
    """Chunk-end states.

    Args:
      da_cumsum: ``(H, nchunks, chunk_size)`` float32 from ``chunk_cumsum``.
      init: ``(batch, H, P, N)`` float32, zeros where a request has no initial state.
      contrib: ``(nchunks, H, P, N)`` float32 from ``chunk_state`` (its buffer
        becomes the output's: donate it, or XLA copies it first).
      cu_chunk_seqlens: ``(nchunks + 1,)``; seq_idx: ``(nchunks,)`` int32.
      num_real_chunks: ``(1,)`` int32, one past the last non-empty chunk.
      write_tail: also write the states of the chunks past ``num_real_chunks``
        (else they are unspecified).

    Returns:
      ``(nchunks, H, P, N)`` float32.
    """
    H, nc, _ = da_cumsum.shape
    P, N = init.shape[2], init.shape[3]
    block_p = min(block_p, next_pow2(max(P, 16)))
    block_n = min(block_n, next_pow2(max(N, 16)))
    return pl.pallas_call(
        functools.partial(_state_passing_kernel, chunk_size=chunk_size, block_p=block_p, block_n=block_n,
                          head_dim=P, d_state=N, num_chunks=nc, write_tail=write_tail),
        out_shape=jax.ShapeDtypeStruct(contrib.shape, F32),
        grid=(H, pl.cdiv(P, block_p) * pl.cdiv(N, block_n)),
        # each tile of chunk c is read (contribution) before it is written (state) by the same program, so the
        # states overwrite the contributions in place: one (nchunks, H, P, N) buffer instead of two
        input_output_aliases={5: 0},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ssd_state_passing_cs{chunk_size}_bp{block_p}_bn{block_n}",
    )(cu_chunk_seqlens, seq_idx, num_real_chunks, da_cumsum, init, contrib)
