"""The columns of a request's Mamba block table, per cache mode (vLLM's ``MambaManager`` rules): which ones a step
needs private slots in, may write, and leaves behind. ``PrefixCacheManager`` owns the tables and the slots; this
says which columns. docs/architecture.md, "Prefix caching" (the modes) and Rule 2 (the speculative columns)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxmamba.engine.block_pool import NULL_ID, BlockPool
from jaxmamba.errors import SlotError
from jaxmamba.metadata import CacheMode
from jaxmamba.metadata.checks import cdiv


@dataclass(frozen=True)
class MambaColumns:
    cache_mode: CacheMode
    block_size: int
    num_spec: int
    num_columns: int  # mamba_block_table_columns(cache_mode, max_model_len, block_size, num_spec)
    has_mamba: bool

    def step_columns(self, c: int, s: int) -> range:
        """Mamba columns that must hold private slots for a step from ``c`` to ``s`` tokens."""
        if not self.has_mamba:
            return range(0)
        if self.cache_mode == CacheMode.NONE:
            return range(self.num_columns)
        blk_s = cdiv(s, self.block_size) - 1
        lo = c // self.block_size if self.cache_mode == CacheMode.ALL else blk_s
        return range(lo, blk_s + self.num_spec + 1)

    def write_columns(self, table: list[int], c: int, s: int) -> list[int]:
        """Columns of ``table`` a step from ``c`` to ``s`` tokens may write (those holding a slot)."""
        if not self.has_mamba:
            return []
        if self.cache_mode == CacheMode.NONE:
            return list(range(self.num_columns))
        blk_s = cdiv(s, self.block_size) - 1
        first = c // self.block_size
        return [j for j in range(first, blk_s + self.num_spec + 1) if table[j] != NULL_ID]

    def missing_columns(self, table: list[int], s: int) -> list[int]:
        """Columns a step to ``s`` tokens wrote its window to (caching modes) that hold no slot."""
        if not self.has_mamba or self.cache_mode == CacheMode.NONE:
            return []
        end = cdiv(s, self.block_size)
        return [j for j in range(end - 1, end + self.num_spec) if not table[j]]

    def align_prefill_chunk(self, c: int, num_tokens: int, n: int, *, max_num_batched_tokens: int | None) -> int:
        """vLLM's ``_mamba_block_aligned_split`` in mode ``align``: the tokens of a chunk from ``c`` computed
        tokens, asked for ``n`` of a request's ``num_tokens``, once cut to the block ends.

        Before the last block end that precedes the last known token a chunk is
        cut back to end on a block end (0: it cannot reach one now -- schedule
        it later); a chunk crossing that block end stops on it; the tail after
        it runs as given. A block wider than the whole token budget
        (``max_num_batched_tokens < block_size``) can never be reached in one
        chunk: as vLLM, its chunks then advance inside the block, keeping the
        running state in the block's own (private) column, and re-align at its
        end (a chunk never crosses a block end, so every cached state is still
        taken exactly there). (vLLM takes the last block end at or before
        ``num_tokens``; taking the one before ``num_tokens - 1`` instead also
        saves a state that an identical prompt of whole blocks can hit, whose
        hit must stop before its last token. The final state of such a prompt
        lands on a block end anyway.)
        """
        bs = self.block_size
        last = (num_tokens - 1) // bs * bs
        after = c + n
        if after < last:
            aligned = after // bs * bs
            if aligned > c or max_num_batched_tokens is None or bs <= max_num_batched_tokens:
                return max(aligned - c, 0)
            return n  # inside one block: sub-block progress
        if c < last < after:
            return last - c
        return n

    def after_step(self, table: list[int], low_col: int, c_new: int, s: int, multi_token_decode: bool,
                   release: Callable[[int], None]) -> tuple[int, int]:
        """The table after a step to ``s`` tokens left ``c_new`` computed (caching modes): a multi-token decode's
        window moved where the next step reads it, the columns before the read column released (``release``
        each slot; vLLM's ``remove_skipped_blocks``). Returns ``(low_col, prev_last_block)``."""
        bs = self.block_size
        prev_last_block = -1
        blk_c = cdiv(c_new, bs) - 1
        if multi_token_decode:
            # The step wrote its window [blk_s, blk_s + num_spec]: token t's SSM state to
            # column blk_s + t, the conv history to column blk_s. The next step reads the
            # window at its anchor: conv from column 0, SSM from column accepted - 1.
            blk_s = cdiv(s, bs) - 1
            if self.cache_mode == CacheMode.ALL:
                prev_last_block = blk_s  # Rule 2's block_idx_last_scheduled_token_prev_step
            elif blk_s > blk_c:
                # align: the builder anchors at blk_c; rotate the (private) columns
                # [blk_c, blk_s + num_spec] so the window moves there (no device copy).
                hi = blk_s + self.num_spec + 1
                seg, d = table[blk_c:hi], blk_s - blk_c
                table[blk_c:hi] = seg[d:] + seg[:d]
        for j in range(blk_c - 1, low_col - 1, -1):  # tail first
            if table[j]:
                release(table[j])
                table[j] = NULL_ID
        return max(low_col, blk_c), prev_last_block

    def check_table(self, rid: str, table: list[int], c: int, *, low_col: int, high_col: int, prev_last_block: int,
                    num_accepted: int, state_pool: BlockPool) -> None:
        """``SlotError`` unless request ``rid``'s table (``c`` computed tokens) holds a slot in the columns its next
        step reads, none in released and unallocated columns, and a private one (ref 1, not cached) in every
        column a step may write."""
        bs = self.block_size
        if self.cache_mode == CacheMode.NONE:
            if any(not x for x in table):
                raise SlotError(f"request {rid!r}: mode none needs all {self.num_columns} slots")
            wcols = range(self.num_columns)
        else:
            wcols = range(c // bs, self.num_columns)
            if c > 0:
                anchor = prev_last_block if prev_last_block >= 0 else cdiv(c, bs) - 1
                for j in (anchor, anchor + num_accepted - 1):  # conv, SSM read columns
                    if not table[j]:
                        raise SlotError(f"request {rid!r}: column {j}, read by its next step, holds no slot")
            if any(table[j] for j in range(0, low_col)):
                raise SlotError(f"request {rid!r}: a released Mamba column still holds a slot")
        if any(table[j] for j in range(high_col, self.num_columns)):
            raise SlotError(f"request {rid!r}: a Mamba column past its window (from {high_col}) holds a slot")
        for j in wcols:
            x = table[j]
            if x and (state_pool.refs[x] != 1 or x in state_pool.cached):
                raise SlotError(f"request {rid!r}: state slot {x} (column {j}) is writable but shared/cached")
