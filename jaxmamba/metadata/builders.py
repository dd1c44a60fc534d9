"""Host-side (numpy) builders of the metadata pytrees, and bucket padding.

Every builder reads only the first ``num_reqs`` rows of its input buffers:
vLLM-style persistent buffers are longer than the batch and their tail rows
hold stale data from earlier steps (seed 002). Each output is first built for
the real rows only and then padded to the bucket by the same routine that
``pad_to_bucket`` uses, so "build at bucket B'" and "build at B, then pad to
B'" give identical metadata, and padding can never change a real row.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmamba.errors import MetadataError, SlotError
from jaxmamba.layout import NULL_SLOT, PAD_SLOT_ID
from jaxmamba.metadata.classify import (
    _check_non_negative,
    check_batch_order,
    mamba_is_prefilling,
    split_decodes_and_prefills,
)
from jaxmamba.metadata.pytree import CommonAttentionMetadata, MambaMetadata

CACHE_MODES = ("none", "align", "all")


def _cdiv(a, b):
    return -(-a // b)


# --------------------------------------------------------------------------- checks


def _scalar(name: str, value, minimum: int = 0) -> int:
    arr = np.asarray(value)
    if arr.ndim != 0 or not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
        raise MetadataError(f"{name} must be an integer, got {value!r}")
    v = int(arr)
    if v < minimum:
        raise MetadataError(f"{name}={v} must be >= {minimum}")
    return v


def _buffer(name: str, value, num_reqs: int, ndim: int = 1) -> np.ndarray:
    """First ``num_reqs`` rows of a persistent per-request buffer, as int64 (seed 002)."""
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise MetadataError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise MetadataError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.shape[0] < num_reqs:
        raise MetadataError(f"num_reqs={num_reqs} exceeds the {arr.shape[0]} rows of {name}")
    return arr[:num_reqs].astype(np.int64)


def _check_slots(name: str, values: np.ndarray, rows: np.ndarray, cols, num_slots: int | None) -> None:
    """Every slot is ``PAD_SLOT_ID`` or in ``[0, num_slots)`` (interpret mode would clamp, DESIGN §9)."""
    bad = values < PAD_SLOT_ID
    if num_slots is not None:
        bad |= values >= num_slots
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        where = f"row {int(rows[i[0]])}" + (f", column {int(cols[i])}" if cols is not None else "")
        raise SlotError(
            f"{name}[{where}]={int(values[i])} is outside the state pool [0, {num_slots}) and is not PAD_SLOT_ID"
        )


def _require_real(name: str, values: np.ndarray, rows: np.ndarray, what: str) -> None:
    """Slots that a real row reads or writes must be real: not PAD, not the null slot."""
    bad = values <= NULL_SLOT
    if bad.any():
        i = int(np.argmax(bad))
        raise SlotError(f"{name} for row {int(rows[i])} is {int(values[i])}, but {what} must be a real slot (>= 1)")


# --------------------------------------------------------------------------- helpers


def mamba_block_table_columns(
    cache_mode: str, max_model_len: int, block_size: int, num_speculative_blocks: int
) -> int:
    """Columns of the per-request Mamba block table (seed 001; as vLLM ``max_num_blocks_per_req``).

    Modes ``align``/``all`` index the table by block position over the whole
    sequence and a decode touches ``1 + num_speculative_blocks`` consecutive
    slots from the last block, so the table needs ``cdiv(max_model_len,
    block_size) + num_speculative_blocks`` columns. Mode ``none``: one running
    slot plus the speculative ones, ``1 + num_speculative_blocks``.
    The cache allocator sizes its tables with this function.
    """
    if cache_mode not in CACHE_MODES:
        raise MetadataError(f"cache_mode={cache_mode!r} must be one of {CACHE_MODES}")
    _scalar("max_model_len", max_model_len, 1)
    _scalar("block_size", block_size, 1)
    _scalar("num_speculative_blocks", num_speculative_blocks, 0)
    if cache_mode == "none":
        return 1 + num_speculative_blocks
    return _cdiv(max_model_len, block_size) + num_speculative_blocks


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
    t = _scalar("num_tokens_padded", num_tokens_padded, 0)
    p = _scalar("num_prefills_padded", num_prefills_padded, 1)
    cs = _scalar("chunk_size", chunk_size, 1)
    return min(t, t // cs + 2 * p) + 1


def compute_chunk_metadata(num_computed_tokens, query_lens, chunk_size: int):
    """SSD chunks of the prefill rows (as vLLM's ``_compute_chunk_metadata``, no checkpoints).

    Chunks are counted from each request's first token: row ``i``'s first
    chunk runs from position ``num_computed_tokens[i]`` to the next multiple of
    ``chunk_size`` (a prefix-cached or chunked-prefill restart finishes the
    partial chunk first), then whole chunks, then a partial last one.

    Args: int[P] computed tokens and int[P] (>= 1) query lengths of the prefill
    rows, in batch order. Returns ``(cu_chunk_seqlens int32[nc+1], seq_idx
    int32[nc], last_chunk_indices int32[P])`` with offsets into the packed
    prefill tokens (starting at 0).
    """
    computed = np.asarray(num_computed_tokens, dtype=np.int64).reshape(-1)
    q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    cs = _scalar("chunk_size", chunk_size, 1)
    if computed.shape != q.shape:
        raise MetadataError(f"num_computed_tokens {computed.shape} and query_lens {q.shape} differ in length")
    _check_non_negative("num_computed_tokens", computed)
    if q.size and q.min() < 1:
        i = int(np.argmin(q))
        raise MetadataError(f"query_lens[{i}]={int(q[i])}: a prefill row needs at least one token")
    first_chunk = computed // cs
    n_chunks = (computed + q - 1) // cs - first_chunk + 1
    total = int(n_chunks.sum())
    seq_idx = np.repeat(np.arange(q.size, dtype=np.int64), n_chunks)
    chunk_in_row = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
    row_end = computed + q
    chunk_end_abs = np.minimum((first_chunk[seq_idx] + chunk_in_row + 1) * cs, row_end[seq_idx])
    query_start = np.concatenate([[0], np.cumsum(q)])[:-1]
    cu = np.zeros(total + 1, dtype=np.int64)
    cu[1:] = query_start[seq_idx] + chunk_end_abs - computed[seq_idx]
    last = np.cumsum(n_chunks) - 1
    return cu.astype(np.int32), seq_idx.astype(np.int32), last.astype(np.int32)


def _bucket(bucket) -> tuple[int, int, int | None]:
    """``(R, T)`` or ``(R, T, P)`` -> ``(R, T, P or None)``."""
    try:
        r, t, *rest = bucket
        if len(rest) > 1:
            raise ValueError
    except (TypeError, ValueError):
        raise MetadataError(
            f"bucket={bucket!r} must be (num_reqs_padded, num_tokens_padded[, num_prefills_padded])") from None
    p = _scalar("num_prefills_padded", rest[0], 1) if rest else None
    return _scalar("num_reqs_padded", r, 1), _scalar("num_tokens_padded", t, 0), p


def _prefill_rows(num_prefills_padded, num_reqs_padded: int) -> int:
    """``P`` of a bucket: given, or every request row (``R``); never more than ``R``."""
    if num_prefills_padded is None:
        return num_reqs_padded
    p = _scalar("num_prefills_padded", num_prefills_padded, 1)
    if p > num_reqs_padded:
        raise MetadataError(f"num_prefills_padded={p} exceeds num_reqs_padded={num_reqs_padded}")
    return p


def _pad(values: np.ndarray, length: int, fill, what: str) -> np.ndarray:
    """``values`` extended along axis 0 to ``length`` rows of ``fill``."""
    if values.shape[0] > length:
        raise MetadataError(f"bucket too small: {what} needs {values.shape[0]} rows, bucket has {length}")
    out = np.full((length,) + values.shape[1:], fill, dtype=values.dtype)
    out[: values.shape[0]] = values
    return out


def _offsets(lengths: np.ndarray, length: int) -> np.ndarray:
    """int32[length+1] exclusive prefix sum of ``lengths``, repeating the total after them."""
    out = np.zeros(length + 1, dtype=np.int64)
    out[1 : lengths.size + 1] = np.cumsum(lengths)
    out[lengths.size + 1 :] = out[lengths.size]
    return out.astype(np.int32)


def _i32(v) -> np.ndarray:
    return np.asarray(v, dtype=np.int32)


# --------------------------------------------------------------------------- common


@dataclasses.dataclass
class _CommonRows:
    """The real (unpadded) content of a ``CommonAttentionMetadata``."""

    query_lens: np.ndarray  # [n]
    seq_lens: np.ndarray  # [n]
    is_prefilling: np.ndarray  # bool[n]
    block_table: np.ndarray  # [n, B]
    slot_mapping: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens]
    max_seq_len: int
    num_decodes: int


def _pad_common(rows: _CommonRows, R: int, T: int, block_size: int, max_model_len: int) -> CommonAttentionMetadata:
    n = rows.query_lens.size
    num_tokens = int(rows.query_lens.sum())
    if n > R:
        raise MetadataError(f"bucket too small: num_reqs={n} > num_reqs_padded={R}")
    if num_tokens > T:
        raise MetadataError(f"bucket too small: {num_tokens} scheduled tokens > num_tokens_padded={T}")
    return CommonAttentionMetadata(
        query_start_loc=_offsets(rows.query_lens, R),
        seq_lens=_pad(rows.seq_lens, R, 0, "seq_lens").astype(np.int32),
        # Seed 002: padded rows are never prefilling, whatever a stale buffer said.
        is_prefilling=_pad(rows.is_prefilling, R, False, "is_prefilling"),
        block_table=_pad(rows.block_table, R, NULL_SLOT, "block_table").astype(np.int32),
        slot_mapping=_pad(rows.slot_mapping, T, PAD_SLOT_ID, "slot_mapping").astype(np.int32),
        positions=_pad(rows.positions, T, 0, "positions").astype(np.int32),
        num_reqs=_i32(n),
        num_actual_tokens=_i32(num_tokens),
        max_query_len=_i32(rows.query_lens.max() if n else 0),
        max_seq_len=_i32(rows.max_seq_len),
        distribution=_i32([rows.num_decodes, n, R]),
        num_reqs_padded=R,
        num_tokens_padded=T,
        block_size=block_size,
        max_model_len=max_model_len,
    )


def _common_rows(md: CommonAttentionMetadata) -> _CommonRows:
    n = int(np.asarray(md.num_reqs))
    num_tokens = int(np.asarray(md.num_actual_tokens))
    qsl = np.asarray(md.query_start_loc, dtype=np.int64)
    return _CommonRows(
        query_lens=np.diff(qsl[: n + 1]),
        seq_lens=np.asarray(md.seq_lens, dtype=np.int64)[:n],
        is_prefilling=np.asarray(md.is_prefilling, dtype=bool)[:n],
        block_table=np.asarray(md.block_table, dtype=np.int64)[:n],
        slot_mapping=np.asarray(md.slot_mapping, dtype=np.int64)[:num_tokens],
        positions=np.asarray(md.positions, dtype=np.int64)[:num_tokens],
        max_seq_len=int(np.asarray(md.max_seq_len)),
        num_decodes=int(np.asarray(md.distribution)[0]),
    )


def build_common_metadata(
    *,
    num_reqs: int,
    num_computed_tokens,
    num_scheduled_tokens,
    num_prompt_tokens,
    block_table,
    block_size: int,
    num_reqs_padded: int,
    num_tokens_padded: int,
    max_model_len: int,
    warmup: bool = False,
    decode_threshold: int = 1,
    num_blocks: int | None = None,
) -> CommonAttentionMetadata:
    """Build the per-step ``CommonAttentionMetadata`` for a bucket.

    Args (per-request arrays may be persistent buffers longer than ``num_reqs``;
    rows past ``num_reqs`` are ignored whatever they hold -- seed 002):
      num_reqs: real rows, already in batch order (see ``reorder_batch``).
      num_computed_tokens: int[>= num_reqs], tokens with state/KV already computed.
      num_scheduled_tokens: int[>= num_reqs], tokens this step (>= 1 per real row).
      num_prompt_tokens: int[>= num_reqs], prompt length (``is_prefilling`` =
        computed < prompt).
      block_table: int[>= num_reqs, B] attention KV block ids per request; a row
        needs ``cdiv(seq_len, block_size)`` valid columns.
      block_size: attention KV block size in tokens.
      num_reqs_padded, num_tokens_padded: the bucket (static shapes).
      max_model_len: longest sequence allowed.
      warmup: only when compiling a bucket ahead of time: ``max_seq_len`` is then
        ``max_model_len`` (seed 004); otherwise it is the real batch maximum.
      decode_threshold: reorder threshold the scheduler used (``1 + num_spec``
        with speculative decoding); checks the batch order and sets
        ``distribution[0]`` (attention-style split, short extends as decodes).
      num_blocks: KV pool size; block ids a real row uses must be below it.

    Raises ``MetadataError``/``SlotError`` (both ``ValueError``) naming the field.
    """
    n = _scalar("num_reqs", num_reqs, 0)
    bs = _scalar("block_size", block_size, 1)
    R = _scalar("num_reqs_padded", num_reqs_padded, 1)
    T = _scalar("num_tokens_padded", num_tokens_padded, 0)
    mml = _scalar("max_model_len", max_model_len, 1)
    threshold = _scalar("decode_threshold", decode_threshold, 1)
    computed = _buffer("num_computed_tokens", num_computed_tokens, n)
    scheduled = _buffer("num_scheduled_tokens", num_scheduled_tokens, n)
    prompt = _buffer("num_prompt_tokens", num_prompt_tokens, n)
    table = _buffer("block_table", block_table, n, ndim=2)
    if n > R:
        raise MetadataError(f"bucket too small: num_reqs={n} > num_reqs_padded={R}")
    _check_non_negative("num_computed_tokens", computed)
    _check_non_negative("num_scheduled_tokens", scheduled)
    _check_non_negative("num_prompt_tokens", prompt)
    if n and scheduled.min() < 1:
        i = int(np.argmin(scheduled))
        raise MetadataError(f"num_scheduled_tokens[{i}]=0: a real row schedules at least one token")
    if n and prompt.min() < 1:
        i = int(np.argmin(prompt))
        raise MetadataError(f"num_prompt_tokens[{i}]=0: a request has at least one prompt token")
    seq = computed + scheduled
    if n and seq.max() > mml:
        i = int(np.argmax(seq))
        raise MetadataError(
            f"seq_len of row {i} (num_computed_tokens + num_scheduled_tokens = {int(seq[i])}) "
            f"exceeds max_model_len={mml}"
        )
    num_tokens = int(scheduled.sum())
    if num_tokens > T:
        raise MetadataError(f"bucket too small: {num_tokens} scheduled tokens > num_tokens_padded={T}")

    # Block table: a row uses its first cdiv(seq_len, block_size) columns.
    blocks_needed = _cdiv(seq, bs)
    if n and blocks_needed.max() > table.shape[1]:
        i = int(np.argmax(blocks_needed))
        raise MetadataError(
            f"block_table has {table.shape[1]} columns but row {i} (seq_len={int(seq[i])}) needs "
            f"cdiv(seq_len, block_size)={int(blocks_needed[i])}"
        )
    used = np.arange(table.shape[1])[None, :] < blocks_needed[:, None]
    bad = used & ((table < 0) | (table >= (num_blocks if num_blocks is not None else np.iinfo(np.int64).max)))
    if bad.any():
        r, c = (int(x) for x in np.argwhere(bad)[0])
        raise SlotError(f"block_table[{r}, {c}]={int(table[r, c])} is outside the KV block pool [0, {num_blocks})")
    # Columns past a row's last block are nulled so stale ids never reach a kernel.
    table = np.where(used, table, NULL_SLOT)

    row_of_token = np.repeat(np.arange(n), scheduled)
    token_in_row = np.arange(num_tokens) - np.repeat(np.cumsum(scheduled) - scheduled, scheduled)
    positions = computed[row_of_token] + token_in_row
    slot_mapping = table[row_of_token, positions // bs] * bs + positions % bs

    is_prefilling = computed < prompt
    check_batch_order(scheduled, computed, is_prefilling, threshold)
    num_decodes = split_decodes_and_prefills(scheduled, is_prefilling, threshold)[0]
    # Seed 004: the real maximum; max_model_len only while warming a bucket.
    max_seq_len = mml if warmup else (int(seq.max()) if n else 0)
    rows = _CommonRows(scheduled, seq, is_prefilling, table, slot_mapping, positions, max_seq_len, num_decodes)
    return _pad_common(rows, R, T, bs, mml)


# --------------------------------------------------------------------------- mamba


@dataclasses.dataclass
class _MambaRows:
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


def _pad_mamba(
    rows: _MambaRows, R: int, T: int, P: int, chunk_size: int, block_size: int, num_spec: int, cache_mode: str
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
    cu = np.full(NC + 1, npt, dtype=np.int64)
    cu[: nc + 1] = rows.cu_chunk_seqlens
    return MambaMetadata(
        num_reqs=_i32(n),
        num_decodes=_i32(nd),
        num_prefills=_i32(npf),
        num_decode_tokens=_i32(ndt),
        num_prefill_tokens=_i32(npt),
        distribution=_i32([nd, n, R]),
        query_start_loc_decode=_offsets(rows.decode_query_lens, R),
        state_indices_decode=_pad(rows.state_indices_decode, R, PAD_SLOT_ID, "state_indices_decode").astype(np.int32),
        state_indices_decode_dst=_pad(rows.state_indices_decode_dst, R, PAD_SLOT_ID, "state_indices_decode").astype(
            np.int32
        ),
        num_accepted_tokens=_pad(rows.num_accepted_tokens, R, 1, "num_accepted_tokens").astype(np.int32),
        query_start_loc_prefill=_offsets(rows.prefill_query_lens, P),
        state_indices_prefill=_pad(rows.state_indices_prefill, P, PAD_SLOT_ID, "state_indices_prefill").astype(
            np.int32
        ),
        state_indices_prefill_initial=_pad(rows.state_indices_prefill_initial, P, PAD_SLOT_ID, "prefill").astype(
            np.int32
        ),
        has_initial_state=_pad(rows.has_initial_state, P, False, "has_initial_state"),
        block_idx_last_computed_token=_pad(rows.block_idx_last_computed_token, R, 0, "block_idx").astype(np.int32),
        block_idx_first_scheduled_token=_pad(rows.block_idx_first_scheduled_token, R, 0, "block_idx").astype(np.int32),
        block_idx_last_scheduled_token=_pad(rows.block_idx_last_scheduled_token, R, 0, "block_idx").astype(np.int32),
        block_idx_last_scheduled_token_prev_step=_pad(
            rows.block_idx_last_scheduled_token_prev_step, R, 0, "block_idx"
        ).astype(np.int32),
        cu_chunk_seqlens=cu.astype(np.int32),
        last_chunk_indices=_pad(rows.last_chunk_indices, P, NC - 1, "last_chunk_indices").astype(np.int32),
        seq_idx=_pad(rows.seq_idx, NC, P - 1, "seq_idx").astype(np.int32),
        state_indices_chunk_checkpoint=_pad(rows.state_indices_chunk_checkpoint, NC, PAD_SLOT_ID, "chunks").astype(
            np.int32
        ),
        num_reqs_padded=R,
        num_tokens_padded=T,
        num_prefills_padded=P,
        num_chunks_padded=NC,
        chunk_size=chunk_size,
        block_size=block_size,
        num_spec=num_spec,
        cache_mode=cache_mode,
    )


def _mamba_rows(md: MambaMetadata) -> _MambaRows:
    def a(x, dtype=np.int64):
        return np.asarray(x, dtype=dtype)

    n, nd, npf = int(a(md.num_reqs)), int(a(md.num_decodes)), int(a(md.num_prefills))
    last = a(md.last_chunk_indices)[:npf]
    nc = int(last[-1]) + 1 if npf else 0
    return _MambaRows(
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
    cache_mode: str,
    block_size: int,
    num_speculative_blocks: int,
    num_accepted_tokens=None,
    prev_step_last_block=None,
    chunk_size: int,
    num_slots: int | None = None,
    num_decode_draft_tokens=None,
    num_prefills_padded: int | None = None,
) -> MambaMetadata:
    """Build ``MambaMetadata`` for the batch and bucket of ``common`` (host numpy).

    Args (per-request arrays may be persistent buffers longer than the batch;
    only the first ``common.num_reqs`` rows are read):
      common: from ``build_common_metadata`` (numpy leaves).
      state_indices: int[>= num_reqs, C] the per-request Mamba block table of
        state-pool slots; ``C`` must equal ``mamba_block_table_columns(cache_mode,
        common.max_model_len, block_size, num_speculative_blocks)`` (seed 001).
      cache_mode: ``"none"``, ``"align"`` or ``"all"``.
      block_size: Mamba block size in tokens (modes align/all: a multiple of
        ``chunk_size``, as vLLM requires, so block ends are chunk ends).
      num_speculative_blocks: speculative tokens per step (0 without spec decode).
      num_accepted_tokens: int[>= num_reqs], tokens each row accepted last step
        (spec decode). When given, rows of up to ``1 + num_speculative_blocks``
        tokens can be decodes; when None they can have only one (as vLLM).
        Decode rows that were prefilling last step read column 0 whatever it says.
      prev_step_last_block: int[>= num_reqs], mode ``all`` only: the Mamba block
        of each row's last scheduled token in the previous step, where spec
        decode wrote its states (-1: fall back to the last computed block).
      chunk_size: SSD chunk size.
      num_slots: state-pool size; every slot index used must be in
        ``[0, num_slots)`` or ``PAD_SLOT_ID``, else ``SlotError``.
      num_decode_draft_tokens: int[>= num_reqs], drafts per row (-1 = none), to
        spot draft-padded prompt tails (see ``mamba_is_prefilling``).
      num_prefills_padded: rows of the prefill-indexed arrays (``P <= R``; default
        ``R``). A batch with more prefill rows raises ``MetadataError``.
    """
    if not isinstance(common, CommonAttentionMetadata):
        raise MetadataError(f"common must be a CommonAttentionMetadata, got {type(common).__name__}")
    if cache_mode not in CACHE_MODES:
        raise MetadataError(f"cache_mode={cache_mode!r} must be one of {CACHE_MODES}")
    bs = _scalar("block_size", block_size, 1)
    cs = _scalar("chunk_size", chunk_size, 1)
    k = _scalar("num_speculative_blocks", num_speculative_blocks, 0)
    if num_slots is not None:
        _scalar("num_slots", num_slots, 1)
    if cache_mode != "none" and bs % cs:
        raise MetadataError(
            f"block_size={bs} must be a multiple of chunk_size={cs} in cache_mode={cache_mode!r} "
            "(block-end states are taken at chunk ends)"
        )
    R, T = common.num_reqs_padded, common.num_tokens_padded
    P = _prefill_rows(num_prefills_padded, R)
    rows = _common_rows(common)
    n = rows.query_lens.size
    q, seq, prefilling = rows.query_lens, rows.seq_lens, rows.is_prefilling
    computed = seq - q
    K = 1 + k

    table = _buffer("state_indices", state_indices, n, ndim=2)
    columns = mamba_block_table_columns(cache_mode, common.max_model_len, bs, k)
    if table.shape[1] != columns:
        rule = (
            "1 + num_speculative_blocks"
            if cache_mode == "none"
            else "cdiv(max_model_len, block_size) + num_speculative_blocks"
        )
        raise MetadataError(
            f"state_indices has {table.shape[1]} columns; cache_mode={cache_mode!r} needs {rule} = {columns} "
            "(seed 001: the 1 + num_spec slots a decode touches must exist)"
        )
    check_batch_order(q, computed, prefilling, 1 + k)

    drafts = None if num_decode_draft_tokens is None else _buffer("num_decode_draft_tokens", num_decode_draft_tokens, n)
    mamba_prefilling = mamba_is_prefilling(prefilling, q, seq, drafts)  # seed 000
    decode_threshold = 1 + k if (k > 0 and num_accepted_tokens is not None) else 1
    nd = split_decodes_and_prefills(q, mamba_prefilling, decode_threshold, treat_short_extends_as_decodes=False)[0]
    all_rows = np.arange(n)

    # Block-table columns (modes align/all).
    zeros = np.zeros(n, dtype=np.int64)
    if cache_mode == "none":
        blk_computed = blk_first = blk_last = zeros
    else:
        blk_computed = np.maximum(_cdiv(computed, bs) - 1, 0)
        blk_first = computed // bs
        blk_last = _cdiv(seq, bs) - 1
    src_start = blk_computed  # mode none: all zeros
    blk_prev = zeros
    if prev_step_last_block is not None and cache_mode != "all":
        raise MetadataError(f"prev_step_last_block is only used in cache_mode='all', not {cache_mode!r}")
    if cache_mode == "all":
        if k > 0 and prev_step_last_block is not None:
            prev = _buffer("prev_step_last_block", prev_step_last_block, n)
            max_block = _cdiv(common.max_model_len, bs) - 1
            bad = ((prev < -1) | (prev > max_block))[:nd]
            if bad.any():
                i = int(np.argmax(bad))
                raise MetadataError(f"prev_step_last_block[{i}]={int(prev[i])} is outside [-1, {max_block}]")
            # Spec decode wrote its states from the previous step's last
            # scheduled block (seed 001); -1 falls back to the last computed block.
            src_start = np.where(prev >= 0, prev, blk_computed)
        # Without spec decode every scheduled token was computed, so the two agree.
        blk_prev = np.where(all_rows < nd, src_start, 0)
    dst_start = blk_last

    # Decode rows [0, nd).
    d = all_rows[:nd]
    cols = np.arange(K)[None, :]
    src_cols, dst_cols = src_start[:nd, None] + cols, dst_start[:nd, None] + cols
    if nd and max(src_cols.max(), dst_cols.max()) >= table.shape[1]:  # guarded by the column rule above
        raise MetadataError("state_indices: a decode window runs past the block table")
    src = table[d[:, None], src_cols]
    dst = table[d[:, None], dst_cols]
    _check_slots("state_indices", src, d, src_cols, num_slots)
    _check_slots("state_indices", dst, d, dst_cols, num_slots)
    if k == 0:
        if num_accepted_tokens is not None:
            acc = _buffer("num_accepted_tokens", num_accepted_tokens, n)[:nd]
            if np.any(acc != 1):
                raise MetadataError("num_accepted_tokens must be 1 for every decode row without speculative decoding")
        accepted = np.ones(nd, dtype=np.int64)
    elif num_accepted_tokens is not None:
        accepted = _buffer("num_accepted_tokens", num_accepted_tokens, n)[:nd].copy()
    else:
        accepted = q[:nd].copy()  # as vLLM: no counts yet -> every token counts as accepted
    # A decode row that was still prefilling had its state written by a prefill,
    # to column 0; a stale count from an earlier request must not move the read.
    accepted[prefilling[:nd]] = 1
    if nd and (accepted.min() < 1 or accepted.max() > K):
        i = int(np.argmax((accepted < 1) | (accepted > K)))
        raise MetadataError(f"num_accepted_tokens[{i}]={int(accepted[i])} is outside [1, {K}]")
    _require_real("state_indices (decode read slot)", src[np.arange(nd), accepted - 1], d, "the slot a decode reads")
    written = np.arange(K)[None, :] < q[:nd, None]
    _require_real("state_indices (decode write slot)", dst[written], np.repeat(d, q[:nd]), "every slot a decode writes")

    # Prefill rows [nd, n).
    p = all_rows[nd:]
    has_initial = computed[nd:] > 0
    # Mode none: column 0 (dst_start and blk_computed are all 0 there).
    pre_dst = table[p, dst_start[nd:]]
    pre_init = np.where(has_initial, table[p, blk_computed[nd:]], PAD_SLOT_ID)
    _check_slots("state_indices", pre_dst, p, dst_start[nd:], num_slots)
    _check_slots("state_indices", pre_init, p, blk_computed[nd:], num_slots)
    _require_real("state_indices (prefill final state)", pre_dst, p, "the slot a prefill writes")
    _require_real("state_indices (prefill initial state)", pre_init[has_initial], p[has_initial], "a read state")

    cu, seq_idx, last = compute_chunk_metadata(computed[nd:], q[nd:], cs)
    checkpoint = np.full(seq_idx.size, PAD_SLOT_ID, dtype=np.int64)
    if cache_mode != "none" and seq_idx.size:
        qsl_p = np.concatenate([[0], np.cumsum(q[nd:])])
        end_abs = computed[nd:][seq_idx] + cu[1:] - qsl_p[seq_idx]
        is_last = np.zeros(seq_idx.size, dtype=bool)
        is_last[last] = True
        ends_block = (end_abs % bs == 0) & ~is_last
        c = np.nonzero(ends_block)[0]
        slots = table[p[seq_idx[c]], end_abs[c] // bs - 1]
        _check_slots("state_indices", slots, p[seq_idx[c]], end_abs[c] // bs - 1, num_slots)
        # A null/PAD entry means the allocator keeps no state for that block: skip it.
        checkpoint[c] = np.where(slots > NULL_SLOT, slots, PAD_SLOT_ID)

    mrows = _MambaRows(
        num_reqs=n,
        decode_query_lens=q[:nd],
        state_indices_decode=src,
        state_indices_decode_dst=dst,
        num_accepted_tokens=accepted,
        prefill_query_lens=q[nd:],
        state_indices_prefill=pre_dst,
        state_indices_prefill_initial=pre_init,
        has_initial_state=has_initial,
        block_idx_last_computed_token=blk_computed,
        block_idx_first_scheduled_token=blk_first,
        block_idx_last_scheduled_token=blk_last,
        block_idx_last_scheduled_token_prev_step=blk_prev,
        cu_chunk_seqlens=cu.astype(np.int64),
        seq_idx=seq_idx.astype(np.int64),
        last_chunk_indices=last.astype(np.int64),
        state_indices_chunk_checkpoint=checkpoint,
    )
    return _pad_mamba(mrows, R, T, P, cs, bs, k, cache_mode)


# --------------------------------------------------------------------------- padding


def pad_to_bucket(metadata, bucket):
    """Move a built metadata (``CommonAttentionMetadata`` or ``MambaMetadata``) to a larger bucket.

    ``bucket`` is ``(num_reqs_padded, num_tokens_padded)`` or, for Mamba
    metadata, ``(num_reqs_padded, num_tokens_padded, num_prefills_padded)``
    (default: ``P = R``). Real rows, tokens and chunks are unchanged; only
    padding is added (and the static chunk count grows with the bucket). Equal
    to building at the larger bucket directly. A bucket smaller than the
    metadata's own raises ``MetadataError``.
    """
    R, T, P = _bucket(bucket)
    if R < metadata.num_reqs_padded or T < metadata.num_tokens_padded:
        raise MetadataError(
            f"bucket too small: ({R}, {T}) is smaller than the metadata's bucket "
            f"({metadata.num_reqs_padded}, {metadata.num_tokens_padded})"
        )
    if isinstance(metadata, CommonAttentionMetadata):
        return _pad_common(_common_rows(metadata), R, T, metadata.block_size, metadata.max_model_len)
    if isinstance(metadata, MambaMetadata):
        P = _prefill_rows(P, R)
        if P < metadata.num_prefills_padded:
            raise MetadataError(
                f"bucket too small: num_prefills_padded={P} < the metadata's {metadata.num_prefills_padded}")
        return _pad_mamba(
            _mamba_rows(metadata),
            R,
            T,
            P,
            metadata.chunk_size,
            metadata.block_size,
            metadata.num_spec,
            metadata.cache_mode,
        )
    raise MetadataError(f"pad_to_bucket: {type(metadata).__name__} is not a metadata pytree")
