"""A mixed step's packed metadata (decode rows, then prompt chunks), written straight into its buffer.

Continuous batching's usual step is neither pure decode nor pure prefill: a few prompt chunks ride along with
the running requests' decodes. ``MixedStepWriter`` extends ``DecodeStepWriter`` (same template: the builders'
own output for the bucket at zero rows) to such a batch in Mamba cache mode ``none`` without speculative
tokens: per token it writes positions and the slot mapping, per row the sequence lengths and prefill flags,
and for the prompt chunks their query offsets, initial-state flags and SSD chunk arrays
(``compute_chunk_metadata``, the builders' own function). Everything else in the buffer (block-index columns,
accepted counts, chunk checkpoints, padding) is what the template already holds in that mode.

The batch must already be in the builders' order and have the builders' split: leading decode rows (one
token, done prefilling), then prompt chunks (long extends before fresh prompts). A row that Mamba's Rule 1
would turn into a decode (a one-token chunk with prior state, docs/architecture.md) or any value a builder
check would refuse makes ``write_mixed`` return None, and the caller runs the builders, whose errors name
the problem. Equality with the builders is a test (tests/jaxmamba/test_mixed_step_writer.py).
"""

from __future__ import annotations

import numpy as np

from jaxmamba.metadata.checks import offsets
from jaxmamba.metadata.common_builder import token_positions
from jaxmamba.metadata.decode_step import DecodeStepWriter
from jaxmamba.metadata.mamba_builder import compute_chunk_metadata, num_chunks_for_bucket

_COMMON = "CommonAttentionMetadata"
_MAMBA = "MambaMetadata"


class MixedStepWriter(DecodeStepWriter):
    """``DecodeStepWriter`` for any bucket, with ``write_mixed`` for batches of decodes and prompt chunks."""

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
        c = computed.astype(np.int64, copy=False)
        q = scheduled.astype(np.int64, copy=False)
        seq = c + q
        prefilling = c < prompt
        split = _split(c, q, prefilling, self._P)
        if split is None:
            return None
        nd, common_nd = split
        num_tokens = int(q.sum())
        if (num_tokens > self._T or int(seq.max()) > self._mml or int(prompt.min()) < 1
                or int(-(-seq.max() // self._bs)) > block_table.shape[1]):
            return None
        tokens = self._tokens(c, q, num_tokens, table_rows, block_table)
        slots = state_table[table_rows, 0]
        if tokens is None or slots.min() < 1 or slots.max() >= self._num_slots:
            return None
        positions, slot_mapping = tokens
        cu, seq_idx, last = compute_chunk_metadata(c[nd:], q[nd:], self._cs)
        num_chunks_padded = num_chunks_for_bucket(self._T, self._P, self._cs)
        if seq_idx.size >= num_chunks_padded:  # the builders' guard (it cannot trip for a valid batch)
            return None
        buf = self._template.copy()
        self._write_common(buf, c, q, seq, prefilling, positions, slot_mapping, common_nd)
        self._write_mamba(buf, c, q, nd, num_tokens, cu, seq_idx, last, num_chunks_padded)
        return buf, nd

    def _tokens(self, c, q, num_tokens: int, table_rows, block_table) -> tuple[np.ndarray, np.ndarray] | None:
        """``(positions, slot_mapping)`` (int64[num_tokens]) of the step's tokens, or None when a token's KV
        block is outside the pool."""
        row_of_token, positions = token_positions(c, q, num_tokens)
        blocks = block_table[table_rows[row_of_token], positions // self._bs].astype(np.int64)
        if blocks.min() < 0 or blocks.max() >= self._num_blocks:
            return None
        return positions, blocks * self._bs + positions % self._bs

    def _write_common(self, buf, c, q, seq, prefilling, positions, slot_mapping, common_nd: int) -> None:
        at, R, n = self._at, self._R, c.size
        start = at[_COMMON, "query_start_loc"]
        buf[start : start + R + 1] = offsets(q, R)
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
        buf[at[_COMMON, "max_query_len"]] = q.max()
        buf[at[_COMMON, "max_seq_len"]] = seq.max()
        start = at[_COMMON, "distribution"]
        buf[start : start + 2] = (common_nd, n)

    def _write_mamba(self, buf, c, q, nd: int, num_tokens: int, cu, seq_idx, last, num_chunks_padded: int) -> None:
        at, R, n = self._at, self._R, c.size
        npf = n - nd
        for field, value in (("num_reqs", n), ("num_decodes", nd), ("num_prefills", npf), ("num_decode_tokens", nd),
                             ("num_prefill_tokens", num_tokens - nd)):
            buf[at[_MAMBA, field]] = value
        start = at[_MAMBA, "distribution"]
        buf[start : start + 2] = (nd, n)
        start = at[_MAMBA, "query_start_loc_decode"]
        buf[start + 1 : start + 1 + R] = np.minimum(self._ones_cumsum, nd)
        start = at[_MAMBA, "query_start_loc_prefill"]
        buf[start : start + self._P + 1] = offsets(q[nd:], self._P)
        start = at[_MAMBA, "has_initial_state"]
        buf[start : start + npf] = c[nd:] > 0
        start = at[_MAMBA, "cu_chunk_seqlens"]
        num_chunks = seq_idx.size
        end = start + num_chunks_padded + 1
        buf[start : start + num_chunks + 1] = cu
        buf[start + num_chunks + 1 : end] = num_tokens - nd
        start = at[_MAMBA, "seq_idx"]
        buf[start : start + num_chunks] = seq_idx
        start = at[_MAMBA, "last_chunk_indices"]
        buf[start : start + npf] = last


def _split(c: np.ndarray, q: np.ndarray, prefilling: np.ndarray, max_prefills: int) -> tuple[int, int] | None:
    """``(num_decodes, common_num_decodes)``: Mamba's leading decode rows and the common metadata's (leading
    rows of one token, prompt or not), or None when the batch is not decodes then prompt chunks in the
    builders' order (long extends, then fresh prompts), holds a row Rule 1 makes a decode, or has more
    prompt chunks than ``max_prefills``."""
    n = c.size
    if int(q.min()) < 1 or int(c.min()) < 0:
        return None
    is_decode = (q == 1) & ~prefilling
    nd = n if is_decode.all() else int(np.argmin(is_decode))
    if n - nd > max_prefills or is_decode[nd:].any() or (prefilling & (q == 1) & (c > 0)).any():
        return None
    fresh = c[nd:] == 0
    if fresh.size and (np.diff(fresh.astype(np.int8)) < 0).any():  # a long extend after a fresh prompt
        return None
    not_single = q > 1
    common_nd = n if not not_single.any() else int(np.argmax(not_single))
    return nd, common_nd

