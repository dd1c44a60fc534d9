"""The Mamba slot arrays of ``MambaMetadata``, gathered on the device from the persistent state-index table.

``build_mamba_metadata`` reads each row's state slots from the ``state_indices`` table on the host. The
engine keeps that table on the device between steps (``engine.block_table.DeviceTable``, rows shared
with the block table through ``row_map``) and packs the per-row slot arrays apart
(``pack(..., separate=DEVICE_SLOT_FIELDS)``): inside the step ``gather_slot_indices`` recomputes them
from the table, ``row_map`` and the block-index columns the buffer still carries, exactly as the builder
does, so a step no longer sends ``2 R (1 + num_spec) + 2 P`` slot ids.

Per batch row ``r`` (table row ``row_map[r]``; ``nd = num_decodes``, ``np = num_prefills``):

* decode rows ``r < nd``: ``state_indices_decode[r, k]`` = column ``src[r] + k``, where ``src`` is
  ``block_idx_last_scheduled_token_prev_step`` in mode ``all`` (the builder stores each decode row's
  source window start there) and ``block_idx_last_computed_token`` otherwise (0 in mode ``none``);
  ``state_indices_decode_dst[r, k]`` = column ``block_idx_last_scheduled_token[r] + k``;
* prefill rows ``j < np`` (batch row ``nd + j``): ``state_indices_prefill`` = column
  ``block_idx_last_scheduled_token``; ``state_indices_prefill_initial`` = column
  ``block_idx_last_computed_token`` when ``has_initial_state``;
* everything else ``PAD_SLOT_ID``, as ``pad_mamba`` pads.

The chunk checkpoints (``state_indices_chunk_checkpoint``, per SSD chunk, ``PAD`` in mode ``none``) stay
in the buffer: the builder derives them from chunk boundaries, and skips null columns.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxmamba.layout import PAD_SLOT_ID
from jaxmamba.metadata.pytree import CacheMode, MambaMetadata

#: ``MambaMetadata`` leaves ``gather_slot_indices`` computes on the device (packed apart by the engine).
DEVICE_SLOT_FIELDS = ("state_indices_decode", "state_indices_decode_dst", "state_indices_prefill",
                      "state_indices_prefill_initial")


def gather_slot_indices(mamba: MambaMetadata, state_table, row_map) -> MambaMetadata:
    """``mamba`` with its ``DEVICE_SLOT_FIELDS`` gathered from ``state_table`` (int32[N, C], the persistent
    Mamba block table, C = ``mamba_block_table_columns``) at rows ``row_map`` (int32[R]); traceable.

    The other leaves of ``mamba`` must be the builder's (the block indices, counts and ``has_initial_state``
    are read). Columns are clamped into the table; the host builder has checked them for the real rows."""
    r, p, k = mamba.num_reqs_padded, mamba.num_prefills_padded, 1 + mamba.num_spec
    columns = state_table.shape[1]
    rows = jnp.arange(r)
    window = jnp.arange(k)[None, :]

    def slots(table_rows, first_columns):
        return state_table[table_rows, jnp.clip(first_columns, 0, columns - 1)]

    source = (mamba.block_idx_last_scheduled_token_prev_step if mamba.cache_mode == CacheMode.ALL
              else mamba.block_idx_last_computed_token)
    is_decode = (rows < mamba.num_decodes)[:, None]
    decode = jnp.where(is_decode, slots(row_map[:, None], source[:, None] + window), PAD_SLOT_ID)
    decode_dst = jnp.where(is_decode, slots(row_map[:, None], mamba.block_idx_last_scheduled_token[:, None] + window),
                           PAD_SLOT_ID)
    prefill_rows = jnp.arange(p)
    batch_rows = jnp.minimum(mamba.num_decodes + prefill_rows, r - 1)
    is_prefill = prefill_rows < mamba.num_prefills
    table_rows = row_map[batch_rows]
    prefill = jnp.where(is_prefill, slots(table_rows, mamba.block_idx_last_scheduled_token[batch_rows]), PAD_SLOT_ID)
    initial = jnp.where(is_prefill & mamba.has_initial_state,
                        slots(table_rows, mamba.block_idx_last_computed_token[batch_rows]), PAD_SLOT_ID)
    as_i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    return dataclasses.replace(mamba, state_indices_decode=as_i32(decode), state_indices_decode_dst=as_i32(decode_dst),
                               state_indices_prefill=as_i32(prefill), state_indices_prefill_initial=as_i32(initial))
