"""One manager per cache kind, as vLLM's ``SingleTypeKVCacheManager``s: ``AttentionManager`` (vLLM's
``FullAttentionManager``) for the attention KV blocks, ``MambaManager`` for the Mamba state slots.

Each owns its pool (taken through the shared ``PrefixIndex``, whose entries pair a block's KV id with its
state slot) and its kind's rules: how many ids a step needs, which are shared on a hit, how a request's
ids are freed and checked. ``PrefixCacheManager`` (``engine.prefix_cache``) is the coordinator above them
(vLLM's ``KVCacheCoordinator``): it keeps the requests, the hashes and the hits, and asks both managers.
docs/architecture.md, "Prefix caching".
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxmamba.engine.block_pool import NULL_ID
from jaxmamba.engine.mamba_columns import MambaColumns
from jaxmamba.engine.prefix_index import PrefixIndex
from jaxmamba.errors import SlotError
from jaxmamba.metadata.checks import cdiv


class AttentionManager:
    """The attention KV blocks: one per ``block_size`` tokens of a request, every one of them cacheable.
    ``enabled`` False (a model without attention layers): a pool of size 0 that no step needs."""

    def __init__(self, index: PrefixIndex, block_size: int, enabled: bool):
        self.index, self.pool, self.block_size, self.enabled = index, index.kv, block_size, enabled

    def num_needed(self, num_held: int, num_tokens: int) -> int:
        """New blocks a request holding ``num_held`` needs to hold ``num_tokens`` tokens."""
        return max(cdiv(num_tokens, self.block_size) - num_held, 0) if self.enabled else 0

    def num_available(self, shared: Sequence[int] = ()) -> int:
        """Blocks an allocation can take once the hit's ``shared`` blocks are referenced (an unreferenced
        cached block counts as available until a hit takes it)."""
        pool = self.pool
        return pool.num_available - sum(1 for i in shared if pool.refs[i] == 0)

    def share(self, blocks: Sequence[int]) -> None:
        for i in blocks:
            self.pool.touch(i)

    def take(self, n: int) -> list[int]:
        return self.index.take_kv(n)

    def free(self, blocks: Sequence[int]) -> None:
        """Release a request's blocks, tail first: LRU eviction then takes a sequence's last blocks before
        its (more shareable) first ones."""
        for b in reversed(blocks):
            self.pool.release(b)

    def usage(self) -> float:
        """Fraction of the pool (null block excluded) that requests reference; 0 without attention."""
        return self.pool.num_used / (self.pool.size - 1) if self.enabled else 0.0

    def check_request(self, rid: str, blocks: list[int], num_computed: int, refs: list[int]) -> None:
        """``SlotError`` unless request ``rid``'s blocks are in range, none twice, enough for its computed
        tokens, and private from the block of its first uncomputed token on; counted into ``refs``."""
        pool, bs = self.pool, self.block_size
        if NULL_ID in blocks:
            raise SlotError(f"request {rid!r} holds the null KV block")
        if len(set(blocks)) != len(blocks):
            raise SlotError(f"request {rid!r} holds an id twice")
        for b in blocks:
            if not 0 < b < pool.size:
                raise SlotError(f"request {rid!r}: KV block {b} out of range")
            refs[b] += 1
        if self.enabled and len(blocks) < cdiv(num_computed, bs):
            raise SlotError(f"request {rid!r}: {num_computed} computed tokens but only {len(blocks)} KV blocks")
        for j in range(num_computed // bs, len(blocks)):
            b = blocks[j]
            if pool.refs[b] != 1 or b in pool.cached:
                raise SlotError(f"request {rid!r}: KV block {b} (block {j}) will be written but is shared/cached")


class MambaManager:
    """The Mamba state slots of each request's Mamba block table; which columns hold one is the cache mode's
    rule (``columns``, ``MambaColumns``). ``enabled`` False (a model without Mamba layers): no column ever
    needs a slot."""

    def __init__(self, index: PrefixIndex, columns: MambaColumns, enabled: bool):
        self.index, self.pool, self.columns, self.enabled = index, index.state, columns, enabled

    def missing_columns(self, table: list[int], c: int, s: int) -> list[int]:
        """Columns a step from ``c`` to ``s`` tokens needs a private slot in that hold none yet."""
        return [j for j in self.columns.step_columns(c, s) if table[j] == NULL_ID]

    def num_available(self, shared: int = NULL_ID) -> int:
        """Slots an allocation can take once the hit's ``shared`` slot is referenced."""
        pool = self.pool
        return pool.num_available - (1 if shared and pool.refs[shared] == 0 else 0)

    def new_table(self, hit: int, shared: int) -> list[int]:
        """The Mamba block table of a request admitted with ``hit`` cached blocks: the hit's ``shared`` slot
        (its last block's state) in column ``hit - 1``, referenced; ``fill`` adds the step's fresh slots."""
        table = [NULL_ID] * self.columns.num_columns
        if shared:
            self.pool.touch(shared)
            table[hit - 1] = shared
        return table

    def fill(self, table: list[int], cols: Sequence[int]) -> None:
        """A fresh slot in each of ``cols`` (the caller checked there are enough)."""
        for j, slot in zip(cols, self.index.take_state(len(cols)), strict=True):
            table[j] = slot

    def free(self, table: list[int]) -> None:
        """Release a request's slots, tail first (as ``AttentionManager.free``)."""
        for slot in reversed(table):
            if slot:
                self.pool.release(slot)

    def usage(self) -> float:
        """Fraction of the pool (null slot excluded) that requests reference; 0 without Mamba."""
        return self.pool.num_used / (self.pool.size - 1) if self.enabled else 0.0

    def check_request(self, rid: str, table: list[int], refs: list[int]) -> None:
        """``SlotError`` unless the table has Rule 2's width and its slots are in range, none twice; counted
        into ``refs``. (Which columns must hold a slot: ``MambaColumns.check_table``.)"""
        width = self.columns.num_columns
        if len(table) != width:
            raise SlotError(f"request {rid!r}: Mamba table has {len(table)} columns, not {width}")
        slots = [x for x in table if x]
        if len(set(slots)) != len(slots):
            raise SlotError(f"request {rid!r} holds an id twice")
        for x in slots:
            if not 0 < x < self.pool.size:
                raise SlotError(f"request {rid!r}: state slot {x} out of range")
            refs[x] += 1
