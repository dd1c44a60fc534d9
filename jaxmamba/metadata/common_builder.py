"""``build_common_metadata``: the per-step ``CommonAttentionMetadata`` every layer reads (host numpy).

Built for the real rows, then padded to the bucket by ``pad_common`` (the routine
``pad_to_bucket`` uses too), so building at a bucket equals building smaller and padding.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmamba.errors import MetadataError, SlotError
from jaxmamba.layout import NULL_SLOT, PAD_SLOT_ID
from jaxmamba.metadata.checks import (
    INT_KINDS,
    as_i32,
    buffer_rows,
    cdiv,
    check_non_negative,
    offsets,
    pad_rows,
    scalar_arg,
)
from jaxmamba.metadata.classify import check_region_order, num_leading_decodes, region_rows
from jaxmamba.metadata.pytree import CommonAttentionMetadata


@dataclasses.dataclass
class CommonRows:
    """The real (unpadded) content of a ``CommonAttentionMetadata``."""

    query_lens: np.ndarray  # [n]
    seq_lens: np.ndarray  # [n]
    is_prefilling: np.ndarray  # bool[n]
    # [n, B]; None when the rows live in a persistent table (``build_common_metadata(block_table_rows=...)``):
    # the padded metadata then holds a placeholder of ``block_table_columns`` columns.
    block_table: np.ndarray | None
    slot_mapping: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens]
    max_seq_len: int
    num_decodes: int
    block_table_columns: int = 0  # B, when ``block_table`` is None


def pad_common(rows: CommonRows, R: int, T: int, block_size: int, max_model_len: int) -> CommonAttentionMetadata:
    n = rows.query_lens.size
    num_tokens = int(rows.query_lens.sum())
    if n > R:
        raise MetadataError(f"bucket too small: num_reqs={n} > num_reqs_padded={R}")
    if num_tokens > T:
        raise MetadataError(f"bucket too small: {num_tokens} scheduled tokens > num_tokens_padded={T}")
    return CommonAttentionMetadata(
        query_start_loc=offsets(rows.query_lens, R),
        seq_lens=pad_rows(rows.seq_lens, R, 0, "seq_lens", np.int32),
        # docs/architecture.md, Rule 3: padded rows are never prefilling, whatever a stale buffer said.
        is_prefilling=pad_rows(rows.is_prefilling, R, False, "is_prefilling"),
        block_table=(table_placeholder(R, rows.block_table_columns) if rows.block_table is None
                     else pad_rows(rows.block_table, R, NULL_SLOT, "block_table", np.int32)),
        slot_mapping=pad_rows(rows.slot_mapping, T, PAD_SLOT_ID, "slot_mapping", np.int32),
        positions=pad_rows(rows.positions, T, 0, "positions", np.int32),
        num_reqs=as_i32(n),
        num_actual_tokens=as_i32(num_tokens),
        max_query_len=as_i32(rows.query_lens.max() if n else 0),
        max_seq_len=as_i32(rows.max_seq_len),
        distribution=as_i32([rows.num_decodes, n, R]),
        num_reqs_padded=R,
        num_tokens_padded=T,
        block_size=block_size,
        max_model_len=max_model_len,
    )


def table_placeholder(num_rows: int, num_columns: int) -> np.ndarray:
    """int32[num_rows, num_columns] of the null block that owns no memory (a read-only broadcast view): the
    ``block_table`` leaf of metadata whose rows live in a persistent table the step reads itself."""
    return np.broadcast_to(np.int32(NULL_SLOT), (num_rows, num_columns))


def common_rows(md: CommonAttentionMetadata) -> CommonRows:
    n = int(np.asarray(md.num_reqs))
    num_tokens = int(np.asarray(md.num_actual_tokens))
    qsl = np.asarray(md.query_start_loc, dtype=np.int64)
    return CommonRows(
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
    block_table_rows=None,
) -> CommonAttentionMetadata:
    """Build the per-step ``CommonAttentionMetadata`` for a bucket (host numpy).

    Per-request arrays are ``int[>= num_reqs]`` (persistent buffers: rows past ``num_reqs`` are ignored,
    docs/architecture.md, Rule 3): ``num_computed_tokens`` (state/KV already computed),
    ``num_scheduled_tokens`` (this step, >= 1 per real row), ``num_prompt_tokens`` (``is_prefilling`` =
    computed < prompt). ``num_reqs``: real rows, already in batch order (``reorder_batch``).
    ``block_table``: int[>= num_reqs, B] KV block ids (``block_size`` tokens a block), or with
    ``block_table_rows`` (int[>= num_reqs]) the persistent int[N, B] mirror read at those rows (the result
    then holds a zero placeholder table). ``num_reqs_padded``/``num_tokens_padded``: the bucket.
    ``max_model_len``: longest sequence allowed. ``warmup``: compiling ahead of time (``max_seq_len`` =
    ``max_model_len``, Rule 4). ``decode_threshold``: the scheduler's reorder threshold (``1 + num_spec``
    with spec decode). ``num_blocks``: KV pool size, bounds the block ids a real row uses.
    Details: docs/architecture.md, "The metadata builders".

    Raises ``MetadataError``/``SlotError`` (both ``ValueError``) naming the field.
    """
    n = scalar_arg("num_reqs", num_reqs, 0)
    bs = scalar_arg("block_size", block_size, 1)
    R = scalar_arg("num_reqs_padded", num_reqs_padded, 1)
    T = scalar_arg("num_tokens_padded", num_tokens_padded, 0)
    mml = scalar_arg("max_model_len", max_model_len, 1)
    threshold = scalar_arg("decode_threshold", decode_threshold, 1)
    computed = buffer_rows("num_computed_tokens", num_computed_tokens, n)
    scheduled = buffer_rows("num_scheduled_tokens", num_scheduled_tokens, n)
    prompt = buffer_rows("num_prompt_tokens", num_prompt_tokens, n)
    if block_table_rows is None:
        table, table_rows = buffer_rows("block_table", block_table, n, ndim=2), None
    else:
        table = persistent_table(block_table)  # not copied: only the step's entries are read
        table_rows = persistent_rows("block_table", table, block_table_rows, n)
    seq = _checked_seq_lens(computed, scheduled, prompt, mml)
    # A bucket too small for the rows or tokens is refused by pad_common, once (it pads them).
    table_columns = table.shape[1]
    table, slot_mapping, positions = _slot_mapping(table, table_rows, computed, scheduled, seq, bs, num_blocks)

    is_prefilling = computed < prompt
    check_region_order(region_rows(scheduled, computed, is_prefilling, threshold))  # check_batch_order
    num_decodes = num_leading_decodes(scheduled, None, threshold)  # split_decodes_and_prefills(...)[0]
    # docs/architecture.md, Rule 4: the real maximum; max_model_len only while warming a bucket.
    max_seq_len = mml if warmup else (int(seq.max()) if n else 0)
    rows = CommonRows(scheduled, seq, is_prefilling, table, slot_mapping, positions, max_seq_len, num_decodes,
                      block_table_columns=table_columns)
    return pad_common(rows, R, T, bs, mml)


def _checked_seq_lens(computed: np.ndarray, scheduled: np.ndarray, prompt: np.ndarray, mml: int) -> np.ndarray:
    """``computed + scheduled`` (each row's sequence length after the step), once the per-row counts are
    checked: none negative, at least one scheduled and one prompt token a row, no row past ``mml``."""
    n = computed.size
    check_non_negative("num_computed_tokens", computed)
    check_non_negative("num_scheduled_tokens", scheduled)
    check_non_negative("num_prompt_tokens", prompt)
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
    return seq


def _slot_mapping(table: np.ndarray, table_rows: np.ndarray | None, computed: np.ndarray, scheduled: np.ndarray,
                  seq: np.ndarray, bs: int, num_blocks: int | None):
    """``(block_table, slot_mapping, positions)`` of the step's tokens. ``table_rows`` None: ``table`` holds
    the batch's rows, whose used columns are checked against the pool and whose unused ones are nulled;
    otherwise ``table`` is the persistent table, only the entries the tokens write are read and checked, and
    the returned table is None."""
    n = computed.size
    num_tokens = int(scheduled.sum())
    # Block table: a row uses its first cdiv(seq_len, block_size) columns.
    blocks_needed = cdiv(seq, bs)
    table_columns = table.shape[1]
    if n and blocks_needed.max() > table_columns:
        i = int(np.argmax(blocks_needed))
        raise MetadataError(
            f"block_table has {table_columns} columns but row {i} (seq_len={int(seq[i])}) needs "
            f"cdiv(seq_len, block_size)={int(blocks_needed[i])}"
        )
    pool_end = num_blocks if num_blocks is not None else np.iinfo(np.int64).max
    if table_rows is None:
        used = np.arange(table_columns)[None, :] < blocks_needed[:, None]
        bad = used & ((table < 0) | (table >= pool_end))
        if bad.any():
            r, c = (int(x) for x in np.argwhere(bad)[0])
            raise SlotError(f"block_table[{r}, {c}]={int(table[r, c])} is outside the KV block pool [0, {num_blocks})")
        # Columns past a row's last block are nulled so stale ids never reach a kernel.
        table = np.where(used, table, NULL_SLOT)

    row_of_token, positions = token_positions(computed, scheduled, num_tokens)
    if table_rows is None:
        return table, table[row_of_token, positions // bs] * bs + positions % bs, positions
    blocks = table[table_rows[row_of_token], positions // bs].astype(np.int64)
    bad = (blocks < 0) | (blocks >= pool_end)
    if bad.any():
        t = int(np.argmax(bad))
        r, c = int(row_of_token[t]), int(positions[t] // bs)
        raise SlotError(f"block_table[{int(table_rows[r])}, {c}]={int(blocks[t])} (row {r}'s block for position "
                        f"{int(positions[t])}) is outside the KV block pool [0, {num_blocks})")
    return None, blocks * bs + positions % bs, positions


def token_positions(computed: np.ndarray, scheduled: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """``(row_of_token, positions)`` (int[num_tokens] each) of a step's tokens: row ``i`` schedules
    ``scheduled[i] >= 1`` tokens from position ``computed[i]``, rows packed in order."""
    n = computed.size
    if num_tokens == n:  # one token a row (every row schedules at least one): token i is row i's
        return np.arange(n), computed
    row_of_token = np.repeat(np.arange(n), scheduled)
    token_in_row = np.arange(num_tokens) - np.repeat(np.cumsum(scheduled) - scheduled, scheduled)
    return row_of_token, computed[row_of_token] + token_in_row


def persistent_table(value, name: str = "block_table") -> np.ndarray:
    """A persistent ``int[N, B]`` table (``name`` in errors), checked but not copied."""
    arr = np.asarray(value)
    if arr.ndim != 2:
        raise MetadataError(f"{name} must be 2-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in INT_KINDS:
        raise MetadataError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr


def persistent_rows(name: str, table: np.ndarray, rows, n: int) -> np.ndarray:
    """``rows[:n]``: the rows of the persistent ``table`` (``name``) that batch rows ``0 .. n-1`` read, checked
    to be inside it (``MetadataError`` naming ``{name}_rows``)."""
    table_rows = buffer_rows(f"{name}_rows", rows, n)
    if n and (table_rows.min() < 0 or table_rows.max() >= table.shape[0]):
        i = int(np.argmax((table_rows < 0) | (table_rows >= table.shape[0])))
        raise MetadataError(f"{name}_rows[{i}]={int(table_rows[i])} is outside the {table.shape[0]} rows of {name}")
    return table_rows
