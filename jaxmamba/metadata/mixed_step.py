"""A mixed step's packed metadata (decode rows, then prompt chunks), written straight into its buffer.

Continuous batching's usual step is neither pure decode nor pure prefill: a few prompt chunks ride along with
the running requests' decodes. ``MixedStepWriter`` extends ``DecodeStepWriter`` (same template: the builders'
own output for the bucket at zero rows) to such a batch in Mamba cache mode ``none`` without speculative
tokens: per token it writes positions and the slot mapping, per row the sequence lengths and prefill flags,
and for the prompt chunks their query offsets, initial-state flags and SSD chunk arrays (the builders' own
rule, ``mamba_builder.chunk_boundaries``, on the chunks' Python lists: a step holds a few prompt chunks, too
few for numpy calls to pay). Everything else in the buffer (block-index columns,
accepted counts, chunk checkpoints, padding) is what the template already holds in that mode.

The batch must already be in the builders' order and have the builders' split: leading decode rows (one
token, done prefilling), then prompt chunks (long extends before fresh prompts). A row that Mamba's Rule 1
would turn into a decode (a one-token chunk with prior state, docs/architecture.md) or any value a builder
check would refuse makes ``write_mixed`` return None, and the caller runs the builders, whose errors name
the problem. Equality with the builders is a test (tests/jaxmamba/test_mixed_step_writer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxmamba.metadata.decode_step import DecodeStepWriter
from jaxmamba.metadata.mamba_builder import chunk_boundaries, num_chunks_for_bucket

_COMMON = "CommonAttentionMetadata"
_MAMBA = "MambaMetadata"


class MixedStepWriter(DecodeStepWriter):
    """``DecodeStepWriter`` for any bucket, with ``write_mixed`` for batches of decodes and prompt chunks.

    The decode rows (most of a serving step) are written with vectorised numpy; the few prompt chunks after
    them (at most the bucket's prefill rows) are read as Python lists, their checks, query offsets and SSD
    chunks worked out row by row: fewer operations than numpy calls on arrays of a few elements."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._num_chunks_padded = num_chunks_for_bucket(self._T, self._P, self._cs)

    def write_mixed(self, computed: np.ndarray, scheduled: np.ndarray, prompt: np.ndarray, table_rows: np.ndarray,
                    block_table: np.ndarray, state_table: np.ndarray) -> tuple[np.ndarray, int] | None:
        """``(buffer int32[layout.size], num_decodes)`` for ``n = len(computed)`` rows in batch order, or None
        when the batch is not of the shape this writer takes or a value fails a check.

        ``computed``/``scheduled``/``prompt``: int[n], each row's computed tokens, tokens this step and prompt
        tokens; ``table_rows``: int[n], each row's row of the persistent ``block_table`` (int32[N, B], KV
        block ids) and ``state_table`` (int32[N, 1], the state slot of mode ``none``)."""
        n = len(computed)
        if not 0 < n <= self._R:
            return None
        prefilling = computed < prompt
        is_decode = (scheduled == 1) & ~prefilling
        nd = n if is_decode.all() else int(is_decode.argmin())
        chunks = _PromptChunks.of(computed[nd:].tolist(), scheduled[nd:].tolist(), prefilling[nd:].tolist(),
                                  self._P, self._cs)
        if chunks is None:
            return None
        num_tokens = nd + chunks.num_tokens
        max_seq = max(int(computed[:nd].max()) + 1 if nd else 0, chunks.max_seq)
        if (num_tokens > self._T or max_seq > self._mml or int(prompt.min()) < 1
                or -(-max_seq // self._bs) > block_table.shape[1] or len(chunks.seq_idx) >= self._num_chunks_padded):
            return None
        tokens = self._tokens(computed, nd, chunks, table_rows, block_table)
        slots = state_table[table_rows, 0]
        if tokens is None or slots.min() < 1 or slots.max() >= self._num_slots:
            return None
        positions, slot_mapping = tokens
        buf = self._template.copy()
        self._write_common(buf, computed + scheduled, prefilling, positions, slot_mapping, nd, num_tokens, max_seq,
                           chunks)
        self._write_mamba(buf, n, nd, num_tokens, chunks)
        return buf, nd

    def _tokens(self, computed, nd: int, chunks: _PromptChunks, table_rows, block_table
                ) -> tuple[np.ndarray, np.ndarray] | None:
        """``(positions, slot_mapping)`` (int64[num_tokens]) of the step's tokens (the decode rows' one each,
        then the prompt chunks'), or None when a token's KV block is outside the pool."""
        if chunks.positions:
            positions = np.concatenate([computed[:nd], chunks.positions]).astype(np.int64)
            rows = np.concatenate([table_rows[:nd], np.repeat(table_rows[nd:], chunks.query_lens)])
        else:
            positions, rows = computed.astype(np.int64), table_rows
        blocks = block_table[rows, positions // self._bs].astype(np.int64)
        if blocks.min() < 0 or blocks.max() >= self._num_blocks:
            return None
        return positions, blocks * self._bs + positions % self._bs

    def _write_common(self, buf, seq, prefilling, positions, slot_mapping, nd: int, num_tokens: int, max_seq: int,
                      chunks: _PromptChunks) -> None:
        at, R, n = self._at, self._R, seq.size
        start = at[_COMMON, "query_start_loc"]
        buf[start] = 0
        buf[start + 1 : start + 1 + nd] = self._ones_cumsum[:nd]
        buf[start + 1 + nd : start + 1 + n] = [nd + end for end in chunks.offsets[1:]]
        buf[start + 1 + n : start + 1 + R] = num_tokens
        start = at[_COMMON, "seq_lens"]
        buf[start : start + n] = seq
        start = at[_COMMON, "is_prefilling"]
        buf[start : start + n] = prefilling
        start = at[_COMMON, "positions"]
        buf[start : start + positions.size] = positions
        start = at[_COMMON, "slot_mapping"]
        buf[start : start + slot_mapping.size] = slot_mapping
        buf[at[_COMMON, "num_reqs"]] = n
        buf[at[_COMMON, "num_actual_tokens"]] = positions.size
        buf[at[_COMMON, "max_query_len"]] = max(chunks.query_lens, default=1)
        buf[at[_COMMON, "max_seq_len"]] = max_seq
        start = at[_COMMON, "distribution"]
        buf[start : start + 2] = (nd + chunks.num_single, n)

    def _write_mamba(self, buf, n: int, nd: int, num_tokens: int, chunks: _PromptChunks) -> None:
        at, R = self._at, self._R
        npf = n - nd
        for field, value in (("num_reqs", n), ("num_decodes", nd), ("num_prefills", npf), ("num_decode_tokens", nd),
                             ("num_prefill_tokens", num_tokens - nd)):
            buf[at[_MAMBA, field]] = value
        start = at[_MAMBA, "distribution"]
        buf[start : start + 2] = (nd, n)
        start = at[_MAMBA, "query_start_loc_decode"]
        buf[start + 1 : start + 1 + R] = np.minimum(self._ones_cumsum, nd)
        start = at[_MAMBA, "query_start_loc_prefill"]
        offsets = chunks.offsets
        buf[start : start + len(offsets)] = offsets
        buf[start + len(offsets) : start + self._P + 1] = offsets[-1]
        start = at[_MAMBA, "has_initial_state"]
        buf[start : start + npf] = chunks.has_initial_state
        start = at[_MAMBA, "cu_chunk_seqlens"]
        cu = chunks.cu_chunk_seqlens
        buf[start : start + len(cu)] = cu
        buf[start + len(cu) : start + self._num_chunks_padded + 1] = num_tokens - nd
        start = at[_MAMBA, "seq_idx"]
        buf[start : start + len(chunks.seq_idx)] = chunks.seq_idx
        start = at[_MAMBA, "last_chunk_indices"]
        buf[start : start + npf] = chunks.last_chunk_indices


@dataclass
class _PromptChunks:
    """The prompt chunks after a batch's decode rows, as Python lists (one entry a chunk row unless said):
    their ``query_lens``; the ``positions`` of their tokens (packed); ``offsets`` (their query offsets from
    0, one more than the rows); ``has_initial_state``; the SSD chunks (``chunk_boundaries``' ``cu_chunk_seqlens``,
    ``seq_idx``, ``last_chunk_indices``); ``num_single``: the leading one-token rows (fresh one-token prompts,
    decodes to the common metadata); ``num_tokens``; ``max_seq`` (0 for none)."""

    query_lens: list[int]
    positions: list[int]
    offsets: list[int]
    has_initial_state: list[bool]
    cu_chunk_seqlens: list[int]
    seq_idx: list[int]
    last_chunk_indices: list[int]
    num_single: int
    num_tokens: int
    max_seq: int

    @classmethod
    def of(cls, computed: list[int], query_lens: list[int], prefilling: list[bool], max_prefills: int,
           chunk_size: int) -> _PromptChunks | None:
        """The rows after the decodes (``computed``, ``query_lens``, ``prefilling``: one entry a row), or None
        unless they are prompt chunks in the builders' order (long extends, then fresh prompts; none a decode
        or a row Mamba's Rule 1 makes one), at most ``max_prefills`` of them."""
        if len(computed) > max_prefills:
            return None
        positions, offsets = [], [0]
        num_single, fresh_seen, max_seq = -1, False, 0
        for j, (c, q, p) in enumerate(zip(computed, query_lens, prefilling, strict=True)):
            fresh = c == 0
            if q < 1 or c < 0 or (q == 1 and (not p or c > 0)) or (fresh_seen and not fresh):
                return None
            fresh_seen = fresh
            if q > 1 and num_single < 0:
                num_single = j
            end = c + q
            max_seq = max(max_seq, end)
            positions += range(c, end)
            offsets.append(offsets[-1] + q)
        cu, seq_idx, last = chunk_boundaries(computed, query_lens, chunk_size)
        return cls(list(query_lens), positions, offsets, [c > 0 for c in computed], cu, seq_idx, last,
                   len(computed) if num_single < 0 else num_single, offsets[-1], max_seq)
