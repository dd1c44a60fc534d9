"""``build_mamba_metadata``: what the Mamba2 mixers need on top of the common metadata (host numpy).

docs/architecture.md's Rules 1 (one-token extends with prior state are decodes), 2 (the Mamba
block table has ``mamba_block_table_columns`` columns and a decode gathers
``1 + num_spec`` slots from the right block) and 3 (padded rows point at no slot).
Built for the real rows, then padded by ``pad_mamba`` (as ``pad_to_bucket``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxmamba.errors import MetadataError
from jaxmamba.layout import NULL_SLOT, PAD_SLOT_ID
from jaxmamba.metadata.checks import (
    as_i32,
    buffer_rows,
    cdiv,
    check_non_negative,
    check_slots,
    offsets,
    pad_rows,
    prefill_rows,
    require_real_slots,
    scalar_arg,
)
from jaxmamba.metadata.classify import (
    check_query_and_seq_lens,
    check_region_order,
    mamba_prefilling_rows,
    num_leading_decodes,
    region_rows,
)
from jaxmamba.metadata.common_builder import persistent_rows, persistent_table
from jaxmamba.metadata.pytree import CacheMode, CommonAttentionMetadata, MambaMetadata

#: ``CacheMode``'s values, as users spell them.
CACHE_MODES = tuple(mode.value for mode in CacheMode)


def mamba_block_table_columns(
    cache_mode: CacheMode | str, max_model_len: int, block_size: int, num_speculative_blocks: int
) -> int:
    """Columns of the per-request Mamba block table (docs/architecture.md, Rule 2; as vLLM ``max_num_blocks_per_req``).

    Modes ``align``/``all`` index the table by block position over the whole
    sequence and a decode touches ``1 + num_speculative_blocks`` consecutive
    slots from the last block, so the table needs ``cdiv(max_model_len,
    block_size) + num_speculative_blocks`` columns. Mode ``none``: one running
    slot plus the speculative ones, ``1 + num_speculative_blocks``.
    The cache allocator sizes its tables with this function.
    """
    _check_mode(cache_mode)
    scalar_arg("max_model_len", max_model_len, 1)
    scalar_arg("block_size", block_size, 1)
    scalar_arg("num_speculative_blocks", num_speculative_blocks, 0)
    if cache_mode == CacheMode.NONE:
        return 1 + num_speculative_blocks
    return cdiv(max_model_len, block_size) + num_speculative_blocks


def num_chunks_for_bucket(num_tokens_padded: int, num_prefills_padded: int, chunk_size: int) -> int:
    """Static SSD chunk count ``NC`` of a bucket: an upper bound on real chunks, plus one.

    A prefill row of ``q`` tokens starting at absolute position ``c`` spans
    ``floor((c % cs + q - 1) / cs) + 1 <= floor((q - 1) / cs) + 2`` chunks, so
    ``P`` prefill rows have at most ``T // cs + 2 P`` chunks, and never more than
    their ``T`` tokens. (``T // cs + P`` is *not* a bound: two 2-token rows that
    each cross a chunk boundary make 4 chunks with ``T = cs = 4, P = 2``.) The
    bound follows the bucket's prefill rows, not its request rows: decode rows
    have no chunks. The extra last chunk is always empty: padded prefill rows
    point their ``last_chunk_indices`` at it.
    """
    t = scalar_arg("num_tokens_padded", num_tokens_padded, 0)
    p = scalar_arg("num_prefills_padded", num_prefills_padded, 1)
    cs = scalar_arg("chunk_size", chunk_size, 1)
    return min(t, t // cs + 2 * p) + 1


def compute_chunk_metadata(num_computed_tokens, query_lens, chunk_size: int):
    """SSD chunks of the prefill rows (as vLLM's ``_compute_chunk_metadata``, no checkpoints), checked.

    Args: int[P] computed tokens and int[P] (>= 1) query lengths of the prefill
    rows, in batch order. Returns ``(cu_chunk_seqlens int32[nc+1], seq_idx
    int32[nc], last_chunk_indices int32[P])`` with offsets into the packed
    prefill tokens (starting at 0); the rule is ``chunk_boundaries``'.
    """
    computed = np.asarray(num_computed_tokens, dtype=np.int64).reshape(-1)
    q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    cs = scalar_arg("chunk_size", chunk_size, 1)
    if computed.shape != q.shape:
        raise MetadataError(f"num_computed_tokens {computed.shape} and query_lens {q.shape} differ in length")
    check_non_negative("num_computed_tokens", computed)
    if q.size and q.min() < 1:
        i = int(np.argmin(q))
        raise MetadataError(f"query_lens[{i}]={int(q[i])}: a prefill row needs at least one token")
    cu, seq_idx, last = chunk_boundaries(computed.tolist(), q.tolist(), cs)
    return np.array(cu, np.int32), np.array(seq_idx, np.int32), np.array(last, np.int32)


def chunk_boundaries(computed: Sequence[int], query_lens: Sequence[int],
                     chunk_size: int) -> tuple[list[int], list[int], list[int]]:
    """The SSD chunk rule on Python ints, unchecked (``compute_chunk_metadata`` checks; the mixed-step writer
    calls it directly for a step's few prompt chunks). Chunks are counted from each request's first token: row
    ``j``'s first chunk runs from position ``computed[j]`` to the next multiple of ``chunk_size`` (a
    prefix-cached or chunked-prefill restart finishes the partial chunk first), then whole chunks, then a
    partial last one. Returns ``(cu_chunk_seqlens, seq_idx, last_chunk_indices)`` as lists (offsets into the
    rows' packed tokens, from 0). A loop, not numpy: a step's prompt chunks are few (4 rows: 8 us against numpy's
    21-28; a burst of 256 fresh prompts costs ~0.05 ms more than numpy did: 72-80 us against 27-33)."""
    cu, seq_idx, last, start = [0], [], [], 0
    for j, (c, q) in enumerate(zip(computed, query_lens, strict=True)):
        end, first = c + q, c // chunk_size
        n = (end - 1) // chunk_size - first + 1
        if n == 1:  # the row ends inside its first chunk
            cu.append(start + q)
            seq_idx.append(j)
        else:
            cu += [start - c + min((first + i + 1) * chunk_size, end) for i in range(n)]
            seq_idx += [j] * n
        last.append(len(seq_idx) - 1)
        start += q
    return cu, seq_idx, last


@dataclasses.dataclass
class MambaRows:
    """The real (unpadded) content of a ``MambaMetadata``."""

    num_reqs: int
    decode_query_lens: np.ndarray  # [nd]
    state_indices_decode: np.ndarray  # [nd, K]
    state_indices_decode_dst: np.ndarray  # [nd, K]
    num_accepted_tokens: np.ndarray  # [nd]
    prefill_query_lens: np.ndarray  # [np]
    state_indices_prefill: np.ndarray  # [np]
    state_indices_prefill_initial: np.ndarray  # [np]
    has_initial_state: np.ndarray  # bool[np]
    block_idx_last_computed_token: np.ndarray  # [n]
    block_idx_first_scheduled_token: np.ndarray  # [n]
    block_idx_last_scheduled_token: np.ndarray  # [n]
    block_idx_last_scheduled_token_prev_step: np.ndarray  # [n]
    cu_chunk_seqlens: np.ndarray  # [nc+1]
    seq_idx: np.ndarray  # [nc]
    last_chunk_indices: np.ndarray  # [np]
    state_indices_chunk_checkpoint: np.ndarray  # [nc]


def pad_mamba(
    rows: MambaRows, R: int, T: int, P: int, chunk_size: int, block_size: int, num_spec: int, cache_mode: str
) -> MambaMetadata:
    nd = rows.decode_query_lens.size
    npf = rows.prefill_query_lens.size
    n = rows.num_reqs
    ndt = int(rows.decode_query_lens.sum())
    npt = int(rows.prefill_query_lens.sum())
    if n > R:
        raise MetadataError(f"bucket too small: num_reqs={n} > num_reqs_padded={R}")
    if ndt + npt > T:
        raise MetadataError(f"bucket too small: {ndt + npt} scheduled tokens > num_tokens_padded={T}")
    if npf > P:
        raise MetadataError(f"bucket too small: {npf} prefill rows > num_prefills_padded={P}")
    NC = num_chunks_for_bucket(T, P, chunk_size)
    nc = rows.seq_idx.size
    if nc >= NC:  # cannot happen for a valid batch (see num_chunks_for_bucket); a guard, not a rule
        raise MetadataError(f"bucket too small: {nc} SSD chunks > num_chunks_padded-1={NC - 1}")
    cu = np.empty(NC + 1, dtype=np.int32)
    cu[nc + 1 :] = npt
    cu[: nc + 1] = rows.cu_chunk_seqlens
    i32 = np.int32
    return MambaMetadata(
        num_reqs=as_i32(n),
        num_decodes=as_i32(nd),
        num_prefills=as_i32(npf),
        num_decode_tokens=as_i32(ndt),
        num_prefill_tokens=as_i32(npt),
        distribution=as_i32([nd, n, R]),
        query_start_loc_decode=offsets(rows.decode_query_lens, R),
        state_indices_decode=pad_rows(rows.state_indices_decode, R, PAD_SLOT_ID, "state_indices_decode", i32),
        state_indices_decode_dst=pad_rows(rows.state_indices_decode_dst, R, PAD_SLOT_ID, "state_indices_decode", i32),
        num_accepted_tokens=pad_rows(rows.num_accepted_tokens, R, 1, "num_accepted_tokens", i32),
        query_start_loc_prefill=offsets(rows.prefill_query_lens, P),
        state_indices_prefill=pad_rows(rows.state_indices_prefill, P, PAD_SLOT_ID, "state_indices_prefill", i32),
        state_indices_prefill_initial=pad_rows(rows.state_indices_prefill_initial, P, PAD_SLOT_ID, "prefill", i32),
        has_initial_state=pad_rows(rows.has_initial_state, P, False, "has_initial_state"),
        block_idx_last_computed_token=pad_rows(rows.block_idx_last_computed_token, R, 0, "block_idx", i32),
        block_idx_first_scheduled_token=pad_rows(rows.block_idx_first_scheduled_token, R, 0, "block_idx", i32),
        block_idx_last_scheduled_token=pad_rows(rows.block_idx_last_scheduled_token, R, 0, "block_idx", i32),
        block_idx_last_scheduled_token_prev_step=pad_rows(
            rows.block_idx_last_scheduled_token_prev_step, R, 0, "block_idx", i32),
        cu_chunk_seqlens=cu,
        last_chunk_indices=pad_rows(rows.last_chunk_indices, P, NC - 1, "last_chunk_indices", i32),
        seq_idx=pad_rows(rows.seq_idx, NC, P - 1, "seq_idx", i32),
        state_indices_chunk_checkpoint=pad_rows(rows.state_indices_chunk_checkpoint, NC, PAD_SLOT_ID, "chunks", i32),
        num_reqs_padded=R,
        num_tokens_padded=T,
        num_prefills_padded=P,
        num_chunks_padded=NC,
        chunk_size=chunk_size,
        block_size=block_size,
        num_spec=num_spec,
        cache_mode=cache_mode,
    )


def mamba_rows(md: MambaMetadata) -> MambaRows:
    def a(x, dtype=np.int64):
        return np.asarray(x, dtype=dtype)

    n, nd, npf = int(a(md.num_reqs)), int(a(md.num_decodes)), int(a(md.num_prefills))
    last = a(md.last_chunk_indices)[:npf]
    nc = int(last[-1]) + 1 if npf else 0
    return MambaRows(
        num_reqs=n,
        decode_query_lens=np.diff(a(md.query_start_loc_decode)[: nd + 1]),
        state_indices_decode=a(md.state_indices_decode)[:nd],
        state_indices_decode_dst=a(md.state_indices_decode_dst)[:nd],
        num_accepted_tokens=a(md.num_accepted_tokens)[:nd],
        prefill_query_lens=np.diff(a(md.query_start_loc_prefill)[: npf + 1]),
        state_indices_prefill=a(md.state_indices_prefill)[:npf],
        state_indices_prefill_initial=a(md.state_indices_prefill_initial)[:npf],
        has_initial_state=a(md.has_initial_state, bool)[:npf],
        block_idx_last_computed_token=a(md.block_idx_last_computed_token)[:n],
        block_idx_first_scheduled_token=a(md.block_idx_first_scheduled_token)[:n],
        block_idx_last_scheduled_token=a(md.block_idx_last_scheduled_token)[:n],
        block_idx_last_scheduled_token_prev_step=a(md.block_idx_last_scheduled_token_prev_step)[:n],
        cu_chunk_seqlens=a(md.cu_chunk_seqlens)[: nc + 1],
        seq_idx=a(md.seq_idx)[:nc],
        last_chunk_indices=last,
        state_indices_chunk_checkpoint=a(md.state_indices_chunk_checkpoint)[:nc],
    )


def build_mamba_metadata(
    common: CommonAttentionMetadata,
    *,
    state_indices,
    cache_mode: CacheMode | str,
    block_size: int,
    num_speculative_blocks: int,
    num_accepted_tokens=None,
    prev_step_last_block=None,
    chunk_size: int,
    num_slots: int | None = None,
    num_decode_draft_tokens=None,
    num_prefills_padded: int | None = None,
    state_indices_rows=None,
) -> MambaMetadata:
    """Build ``MambaMetadata`` for the batch and bucket of ``common`` (host numpy).

    ``common``: from ``build_common_metadata``. ``state_indices``: int[>= num_reqs, C] Mamba block table of
    state-pool slots, ``C = mamba_block_table_columns(cache_mode, common.max_model_len, block_size,
    num_speculative_blocks)`` (docs/architecture.md, Rule 2); with ``state_indices_rows`` (int[>= num_reqs])
    the persistent table read at those rows. ``cache_mode``: ``"none"``, ``"align"`` or ``"all"``.
    ``block_size``: Mamba block size in tokens (align/all: a multiple of ``chunk_size``, the SSD chunk
    size). ``num_speculative_blocks``: speculative tokens per step (0 without spec decode).
    ``num_accepted_tokens`` (int[>= num_reqs] or None), ``prev_step_last_block`` (int[>= num_reqs], mode
    ``all``; -1: none), ``num_decode_draft_tokens`` (int[>= num_reqs], -1 = none): spec-decode inputs.
    ``num_slots``: state-pool size; a slot outside ``[0, num_slots)`` and not ``PAD_SLOT_ID`` raises
    ``SlotError``. ``num_prefills_padded``: ``P <= R`` rows of the prefill-indexed arrays (default ``R``;
    more prefill rows raise ``MetadataError``). Only the first ``common.num_reqs`` rows of per-request
    arrays are read. What each argument does: docs/architecture.md, "The metadata builders".
    """
    if not isinstance(common, CommonAttentionMetadata):
        raise MetadataError(f"common must be a CommonAttentionMetadata, got {type(common).__name__}")
    cache_mode = _check_mode(cache_mode)
    bs, cs, k = _check_args(cache_mode, block_size, chunk_size, num_speculative_blocks, num_slots)
    R, T = common.num_reqs_padded, common.num_tokens_padded
    P = prefill_rows(num_prefills_padded, R)
    # The rows of common this builder reads (``common_rows`` would also copy the block table).
    n = int(np.asarray(common.num_reqs))
    q = np.diff(np.asarray(common.query_start_loc, dtype=np.int64)[: n + 1])
    seq = np.asarray(common.seq_lens, dtype=np.int64)[:n]
    prefilling = np.asarray(common.is_prefilling, dtype=bool)[:n]
    computed = seq - q
    table = _StateTable.of(state_indices, state_indices_rows, n, cache_mode, common.max_model_len, bs, k)
    nd = _num_decodes(q, seq, computed, prefilling, k, num_decode_draft_tokens, num_accepted_tokens)
    blocks = _block_columns(cache_mode, computed, seq, bs, k, nd, prev_step_last_block, common.max_model_len)
    src, dst, accepted = _decode_rows(table, blocks, q, prefilling, nd, k, num_accepted_tokens, num_slots,
                                      cache_mode)
    prefill = _prefill_rows(table, blocks, q, computed, nd, bs, cs, num_slots, cache_mode)
    mrows = MambaRows(
        num_reqs=n,
        decode_query_lens=q[:nd],
        state_indices_decode=src,
        state_indices_decode_dst=dst,
        num_accepted_tokens=accepted,
        prefill_query_lens=q[nd:],
        block_idx_last_computed_token=blocks.computed,
        block_idx_first_scheduled_token=blocks.first,
        block_idx_last_scheduled_token=blocks.last,
        block_idx_last_scheduled_token_prev_step=blocks.prev,
        **prefill,
    )
    return pad_mamba(mrows, R, T, P, cs, bs, k, cache_mode)


def _num_decodes(q: np.ndarray, seq: np.ndarray, computed: np.ndarray, prefilling: np.ndarray, k: int,
                 num_decode_draft_tokens, num_accepted_tokens) -> int:
    """The batch's leading decode rows (its order checked first), with Mamba's view of which rows prefill
    (docs/architecture.md, Rule 1); with spec decode, rows of up to ``1 + k`` tokens are decodes only once
    acceptance counts are given (as vLLM)."""
    n = q.size
    check_region_order(region_rows(q, computed, prefilling, 1 + k))  # check_batch_order
    drafts = (None if num_decode_draft_tokens is None
              else buffer_rows("num_decode_draft_tokens", num_decode_draft_tokens, n))
    check_query_and_seq_lens(q, seq)
    mamba_prefilling = mamba_prefilling_rows(prefilling, q, seq, drafts)  # Rule 1: mamba_is_prefilling
    decode_threshold = 1 + k if (k > 0 and num_accepted_tokens is not None) else 1
    # split_decodes_and_prefills(..., treat_short_extends_as_decodes=False)[0]
    return num_leading_decodes(q, mamba_prefilling, decode_threshold)


def _check_mode(cache_mode) -> CacheMode:
    if cache_mode not in CACHE_MODES:
        raise MetadataError(f"cache_mode={cache_mode!r} must be one of {CACHE_MODES}")
    return CacheMode(cache_mode)


def _check_args(cache_mode: CacheMode, block_size: int, chunk_size: int, num_speculative_blocks: int,
                num_slots: int | None) -> tuple[int, int, int]:
    """The scalar arguments checked: ``(block_size, chunk_size, num_speculative_blocks)``."""
    bs = scalar_arg("block_size", block_size, 1)
    cs = scalar_arg("chunk_size", chunk_size, 1)
    k = scalar_arg("num_speculative_blocks", num_speculative_blocks, 0)
    if num_slots is not None:
        scalar_arg("num_slots", num_slots, 1)
    if cache_mode != CacheMode.NONE and bs % cs:
        raise MetadataError(
            f"block_size={bs} must be a multiple of chunk_size={cs} in cache_mode={cache_mode!r} "
            "(block-end states are taken at chunk ends)"
        )
    return bs, cs, k


@dataclasses.dataclass
class _StateTable:
    """The Mamba block table a step reads: ``table`` holds the batch's rows (``row_of`` None) or is the
    persistent state-table mirror, whose row ``row_of[i]`` is batch row i's."""

    table: np.ndarray
    row_of: np.ndarray | None

    @classmethod
    def of(cls, state_indices, state_indices_rows, n: int, cache_mode: str, max_model_len: int, bs: int,
           k: int) -> _StateTable:
        if state_indices_rows is None:
            table = cls(buffer_rows("state_indices", state_indices, n, ndim=2), None)
        else:
            persistent = persistent_table(state_indices, "state_indices")  # not copied: only the step's entries
            table = cls(persistent, persistent_rows("state_indices", persistent, state_indices_rows, n))
        columns = mamba_block_table_columns(cache_mode, max_model_len, bs, k)
        if table.num_columns != columns:
            rule = (
                "1 + num_speculative_blocks"
                if cache_mode == CacheMode.NONE
                else "cdiv(max_model_len, block_size) + num_speculative_blocks"
            )
            raise MetadataError(
                f"state_indices has {table.num_columns} columns; cache_mode={cache_mode!r} needs {rule} = {columns} "
                "(the 1 + num_spec slots a decode touches must exist: docs/architecture.md, Rule 2)"
            )
        return table

    @property
    def num_columns(self) -> int:
        return self.table.shape[1]

    def rows(self, batch_rows: np.ndarray) -> np.ndarray:
        """The table rows of ``batch_rows``."""
        return batch_rows if self.row_of is None else self.row_of[batch_rows]

    def at(self, batch_rows: np.ndarray, cols) -> np.ndarray:
        return self.table[self.rows(batch_rows), cols]


@dataclasses.dataclass
class _BlockColumns:
    """Per-row Mamba block-table columns (all zero in mode none): the last computed token's, the first and
    last scheduled tokens', the previous step's last (decode rows, mode all) and where a decode reads from."""

    computed: np.ndarray
    first: np.ndarray
    last: np.ndarray
    prev: np.ndarray
    src_start: np.ndarray


def _block_columns(cache_mode: str, computed: np.ndarray, seq: np.ndarray, bs: int, k: int, nd: int,
                   prev_step_last_block, max_model_len: int) -> _BlockColumns:
    n = computed.size
    zeros = np.zeros(n, dtype=np.int64)
    if cache_mode == CacheMode.NONE:
        blk_computed = blk_first = blk_last = zeros
    else:
        blk_computed = np.maximum(cdiv(computed, bs) - 1, 0)
        blk_first = computed // bs
        blk_last = cdiv(seq, bs) - 1
    src_start = blk_computed  # mode none: all zeros
    blk_prev = zeros
    if prev_step_last_block is not None and cache_mode != CacheMode.ALL:
        raise MetadataError(f"prev_step_last_block is only used in cache_mode='all', not {cache_mode!r}")
    if cache_mode == CacheMode.ALL:
        if k > 0 and prev_step_last_block is not None:
            prev = buffer_rows("prev_step_last_block", prev_step_last_block, n)
            max_block = cdiv(max_model_len, bs) - 1
            bad = ((prev < -1) | (prev > max_block))[:nd]
            if bad.any():
                i = int(np.argmax(bad))
                raise MetadataError(f"prev_step_last_block[{i}]={int(prev[i])} is outside [-1, {max_block}]")
            # Spec decode wrote its states from the previous step's last
            # scheduled block (docs/architecture.md, Rule 2); -1 falls back to the last computed block.
            src_start = np.where(prev >= 0, prev, blk_computed)
        # Without spec decode every scheduled token was computed, so the two agree.
        blk_prev = np.where(np.arange(n) < nd, src_start, 0)
    return _BlockColumns(blk_computed, blk_first, blk_last, blk_prev, src_start)


def _decode_rows(table: _StateTable, blocks: _BlockColumns, q: np.ndarray, prefilling: np.ndarray, nd: int, k: int,
                 num_accepted_tokens, num_slots: int | None, cache_mode: str):
    """Decode rows ``[0, nd)``: ``(src int[nd, K], dst int[nd, K], accepted int[nd])``, the slots their
    states are read from and written to and the tokens each accepted last step, all checked."""
    n, K = q.size, 1 + k
    d = np.arange(nd)
    cols = np.arange(K)[None, :]
    # Mode none: both windows start at column 0 (dst starts at the last scheduled block, 0 there too).
    src_cols, dst_cols = blocks.src_start[:nd, None] + cols, blocks.last[:nd, None] + cols
    if nd and max(src_cols.max(), dst_cols.max()) >= table.num_columns:  # guarded by the column rule
        raise MetadataError("state_indices: a decode window runs past the block table")
    src = table.at(d[:, None], src_cols)
    check_slots("state_indices", src, d, src_cols, num_slots)
    if cache_mode == CacheMode.NONE:  # both windows start at column 0: the same slots, checked once
        dst = src
    else:
        dst = table.at(d[:, None], dst_cols)
        check_slots("state_indices", dst, d, dst_cols, num_slots)
    if k == 0:
        if num_accepted_tokens is not None:
            acc = buffer_rows("num_accepted_tokens", num_accepted_tokens, n)[:nd]
            if np.any(acc != 1):
                raise MetadataError("num_accepted_tokens must be 1 for every decode row without speculative decoding")
        accepted = np.ones(nd, dtype=np.int64)
    elif num_accepted_tokens is not None:
        accepted = buffer_rows("num_accepted_tokens", num_accepted_tokens, n)[:nd].copy()
    else:
        accepted = q[:nd].copy()  # as vLLM: no counts yet -> every token counts as accepted
    # A decode row that was still prefilling had its state written by a prefill,
    # to column 0; a stale count from an earlier request must not move the read.
    accepted[prefilling[:nd]] = 1
    if nd and (accepted.min() < 1 or accepted.max() > K):
        i = int(np.argmax((accepted < 1) | (accepted > K)))
        raise MetadataError(f"num_accepted_tokens[{i}]={int(accepted[i])} is outside [1, {K}]")
    require_real_slots("state_indices (decode read slot)", src[np.arange(nd), accepted - 1], d,
                       "the slot a decode reads")
    written = np.arange(K)[None, :] < q[:nd, None]
    require_real_slots("state_indices (decode write slot)", dst[written], np.repeat(d, q[:nd]),
                       "every slot a decode writes")
    return src, dst, accepted


def _prefill_rows(table: _StateTable, blocks: _BlockColumns, q: np.ndarray, computed: np.ndarray, nd: int,
                  bs: int, cs: int, num_slots: int | None, cache_mode: str) -> dict:
    """Prefill rows ``[nd, n)``: ``MambaRows``' prefill-indexed and chunk fields, checked."""
    n = q.size
    if nd == n:  # a decode-only batch: no prefill rows, no chunks (what the code below gives for them, sooner)
        empty = np.zeros(0, dtype=np.int64)
        return dict(state_indices_prefill=empty, state_indices_prefill_initial=empty,
                    has_initial_state=np.zeros(0, dtype=bool), cu_chunk_seqlens=np.zeros(1, dtype=np.int64),
                    seq_idx=empty, last_chunk_indices=empty, state_indices_chunk_checkpoint=empty)
    p = np.arange(nd, n)
    has_initial = computed[nd:] > 0
    # Mode none: column 0 (the last scheduled and last computed blocks are all 0 there).
    pre_dst = table.at(p, blocks.last[nd:])
    check_slots("state_indices", pre_dst, p, blocks.last[nd:], num_slots)
    if cache_mode == CacheMode.NONE:  # the initial state is read from the slot the final one goes to
        pre_init = np.where(has_initial, pre_dst, PAD_SLOT_ID)
    else:
        pre_init = np.where(has_initial, table.at(p, blocks.computed[nd:]), PAD_SLOT_ID)
        check_slots("state_indices", pre_init, p, blocks.computed[nd:], num_slots)
    require_real_slots("state_indices (prefill final state)", pre_dst, p, "the slot a prefill writes")
    require_real_slots("state_indices (prefill initial state)", pre_init[has_initial], p[has_initial], "a read state")

    cu, seq_idx, last = compute_chunk_metadata(computed[nd:], q[nd:], cs)
    checkpoint = np.full(seq_idx.size, PAD_SLOT_ID, dtype=np.int64)
    if cache_mode != CacheMode.NONE and seq_idx.size:
        qsl_p = np.concatenate([[0], np.cumsum(q[nd:])])
        end_abs = computed[nd:][seq_idx] + cu[1:] - qsl_p[seq_idx]
        is_last = np.zeros(seq_idx.size, dtype=bool)
        is_last[last] = True
        ends_block = (end_abs % bs == 0) & ~is_last
        c = np.nonzero(ends_block)[0]
        slots = table.at(p[seq_idx[c]], end_abs[c] // bs - 1)
        check_slots("state_indices", slots, p[seq_idx[c]], end_abs[c] // bs - 1, num_slots)
        # A null/PAD entry means the allocator keeps no state for that block: skip it.
        checkpoint[c] = np.where(slots > NULL_SLOT, slots, PAD_SLOT_ID)
    return dict(state_indices_prefill=pre_dst, state_indices_prefill_initial=pre_init, has_initial_state=has_initial,
                cu_chunk_seqlens=cu.astype(np.int64), seq_idx=seq_idx.astype(np.int64),
                last_chunk_indices=last.astype(np.int64), state_indices_chunk_checkpoint=checkpoint)
