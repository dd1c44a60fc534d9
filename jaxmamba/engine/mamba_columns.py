"""The columns of a request's Mamba block table, per cache mode (vLLM's ``MambaManager`` rules): which ones a step
needs private slots in, may write, and leaves behind. ``PrefixCacheManager`` owns the tables and the slots; this
says which columns. docs/architecture.md, "Prefix caching" (the modes) and Rule 2 (the speculative columns)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxmamba.engine.block_pool import NULL_ID
from jaxmamba.metadata.checks import cdiv


@dataclass(frozen=True)
class MambaColumns:
    cache_mode: str  # none / align / all
    block_size: int
    num_spec: int
    num_columns: int  # mamba_block_table_columns(cache_mode, max_model_len, block_size, num_spec)
    has_mamba: bool

    def step_columns(self, c: int, s: int) -> range:
        """Mamba columns that must hold private slots for a step from ``c`` to ``s`` tokens."""
        if not self.has_mamba:
            return range(0)
        if self.cache_mode == "none":
            return range(self.num_columns)
        blk_s = cdiv(s, self.block_size) - 1
        lo = c // self.block_size if self.cache_mode == "all" else blk_s
        return range(lo, blk_s + self.num_spec + 1)

    def write_columns(self, table: list[int], c: int, s: int) -> list[int]:
        """Columns of ``table`` a step from ``c`` to ``s`` tokens may write (those holding a slot)."""
        if not self.has_mamba:
            return []
        if self.cache_mode == "none":
            return list(range(self.num_columns))
        blk_s = cdiv(s, self.block_size) - 1
        first = c // self.block_size
        return [j for j in range(first, blk_s + self.num_spec + 1) if table[j] != NULL_ID]

    def missing_columns(self, table: list[int], s: int) -> list[int]:
        """Columns a step to ``s`` tokens wrote its window to (caching modes) that hold no slot."""
        if not self.has_mamba or self.cache_mode == "none":
            return []
        end = cdiv(s, self.block_size)
        return [j for j in range(end - 1, end + self.num_spec) if not table[j]]

    def align_prefill_chunk(self, c: int, num_tokens: int, n: int, *, max_num_batched_tokens: int | None) -> int:
        """vLLM's ``_mamba_block_aligned_split`` in mode ``align`` (see
        ``PrefixCacheManager.align_prefill_chunk``): the tokens of a chunk from ``c`` computed tokens, asked for
        ``n`` of a request's ``num_tokens``, once cut to the block ends."""
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
            if self.cache_mode == "all":
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
