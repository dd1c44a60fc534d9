"""A pure-decode step's packed metadata, written straight into its buffer (the steady state of serving).

``build_common_metadata`` + ``build_mamba_metadata`` + ``pack`` build any batch; for the batch a serving
engine runs most (every row one decode token, Mamba cache mode ``none``, no speculative tokens) nearly all
of their output is the same whatever the rows hold. ``DecodeStepWriter`` keeps that output for the bucket
(the builders' own, at zero rows) and writes only what the rows change: query offsets, sequence lengths,
positions, the slot mapping, the counts and maxima. A few vectorised checks guard the values the
builders would check (positions inside ``max_model_len``, KV blocks inside the pool, state slots real);
when one fails the writer returns None and the caller runs the builders, whose errors name the problem.
Equality with the builders is a test (tests/jaxmamba/test_decode_step_writer.py).
"""

from __future__ import annotations

import numpy as np

from jaxmamba.metadata.common_builder import build_common_metadata
from jaxmamba.metadata.mamba_builder import build_mamba_metadata
from jaxmamba.metadata.pytree import CacheMode, PackLayout, pack

#: The metadata classes' names, by which the layout's field offsets are looked up.
_COMMON = "CommonAttentionMetadata"
_MAMBA = "MambaMetadata"


class DecodeStepWriter:
    """The packed buffer (``int32[layout.size]``) of a pure-decode batch of one bucket.

    Built by ``for_bucket`` (None when the bucket cannot take the fast path); ``write`` then costs a buffer
    copy and a dozen small numpy operations whatever the batch size, against the builders' ~50 calls."""

    def __init__(self, template: np.ndarray, offsets: dict[tuple[str, str], int], num_reqs_padded: int, *,
                 block_size: int, max_model_len: int, num_blocks: int, num_slots: int, num_tokens_padded: int = 0,
                 num_prefills_padded: int = 1, chunk_size: int = 1):
        self._template = template
        self._at = offsets
        self._R = num_reqs_padded
        self._T = num_tokens_padded
        self._P = num_prefills_padded
        self._cs = chunk_size
        self._bs = block_size
        self._mml = max_model_len
        self._num_blocks = num_blocks
        self._num_slots = num_slots
        self._ones_cumsum = np.arange(1, num_reqs_padded + 1, dtype=np.int32)  # query offsets of 1-token rows

    @classmethod
    def for_bucket(cls, layout: PackLayout, *, num_reqs_padded: int, num_tokens_padded: int,
                   num_prefills_padded: int, separate: tuple[str, ...], block_size: int, max_model_len: int,
                   num_blocks: int, num_slots: int, chunk_size: int, block_table_columns: int,
                   cache_mode: str, num_spec: int) -> DecodeStepWriter | None:
        """A writer for a bucket whose packed metadata has ``layout``, or None when the fast path does not apply
        (a cache mode other than ``none``, speculative tokens, or a layout the zero-row build does not match)."""
        if cache_mode != CacheMode.NONE or num_spec:
            return None
        empty = np.zeros(0, np.int32)
        common = build_common_metadata(
            num_reqs=0, num_computed_tokens=empty, num_scheduled_tokens=empty, num_prompt_tokens=empty,
            block_table=np.zeros((1, block_table_columns), np.int32), block_table_rows=empty, block_size=block_size,
            num_reqs_padded=num_reqs_padded, num_tokens_padded=num_tokens_padded, max_model_len=max_model_len,
            num_blocks=num_blocks)
        mamba = build_mamba_metadata(
            common, state_indices=np.zeros((1, 1), np.int32), cache_mode="none", block_size=block_size,
            num_speculative_blocks=0, chunk_size=chunk_size, num_slots=num_slots,
            num_prefills_padded=num_prefills_padded, state_indices_rows=empty)
        packed = pack(common, mamba, separate=separate)
        if packed.layout != layout:
            return None
        offsets = {(c.__name__, s.name): s.offset for c, _, slots in layout.entries for s in slots}
        return cls(packed.buffer, offsets, num_reqs_padded, block_size=block_size, max_model_len=max_model_len,
                   num_blocks=num_blocks, num_slots=num_slots, num_tokens_padded=num_tokens_padded,
                   num_prefills_padded=num_prefills_padded, chunk_size=chunk_size)

    def write(self, computed: np.ndarray, prompt: np.ndarray, table_rows: np.ndarray, block_table: np.ndarray,
              state_table: np.ndarray) -> np.ndarray | None:
        """The buffer of ``n = len(computed)`` decode rows (one token each), or None when a value fails a check.

        ``computed``/``prompt``: int[n], each row's computed and prompt tokens (every row decodes: computed >=
        prompt, computed >= 1); ``table_rows``: int[n], each row's row of the persistent ``block_table``
        (int32[N, B], the KV block ids) and ``state_table`` (int32[N, 1], the state slot of mode ``none``)."""
        n = len(computed)
        if not 0 < n <= self._R:
            return None
        bs, at = self._bs, self._at
        positions = computed.astype(np.int64, copy=False)
        seq = positions + 1
        max_seq = int(seq.max())
        columns = positions // bs
        if (max_seq > self._mml or positions.min() < 1 or (prompt > positions).any()
                or int(columns.max()) >= block_table.shape[1]):
            return None
        blocks = block_table[table_rows, columns].astype(np.int64)
        slots = state_table[table_rows, 0]
        if (blocks.min() < 0 or blocks.max() >= self._num_blocks or slots.min() < 1
                or slots.max() >= self._num_slots):
            return None
        buf = self._template.copy()
        qsl = at[_COMMON, "query_start_loc"]
        buf[qsl + 1 : qsl + 1 + self._R] = np.minimum(self._ones_cumsum, n)
        qsl_decode = at[_MAMBA, "query_start_loc_decode"]
        buf[qsl_decode : qsl_decode + 1 + self._R] = buf[qsl : qsl + 1 + self._R]
        start = at[_COMMON, "seq_lens"]
        buf[start : start + n] = seq
        start = at[_COMMON, "positions"]
        buf[start : start + n] = positions
        start = at[_COMMON, "slot_mapping"]
        buf[start : start + n] = blocks * bs + positions % bs
        for field in ("num_reqs", "num_actual_tokens"):
            buf[at[_COMMON, field]] = n
        buf[at[_COMMON, "max_query_len"]] = 1
        buf[at[_COMMON, "max_seq_len"]] = max_seq
        for field in ("num_reqs", "num_decodes", "num_decode_tokens"):
            buf[at[_MAMBA, field]] = n
        for cls in (_COMMON, _MAMBA):
            start = at[cls, "distribution"]
            buf[start : start + 2] = n  # (num_decodes, num_reqs, R): every row decodes
        return buf
