"""The prefix cache's index: chained block hash -> the KV block and/or Mamba state slot cached for it, over the two
pools, with LRU eviction (vLLM's ``BlockPool.cached_block_hash_to_block``). ``PrefixCacheManager`` owns one and
decides what enters it; docs/architecture.md, "Prefix caching", says what a hit is."""

from __future__ import annotations

from dataclasses import dataclass

from jaxmamba.engine.block_pool import NULL_ID, BlockPool, CacheEntry
from jaxmamba.errors import SlotError


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # admitted requests that were looked up
    num_query_tokens: int = 0  # their tokens
    num_hit_requests: int = 0  # admissions with a non-empty hit
    num_hit_tokens: int = 0  # tokens served from the cache
    num_kv_evictions: int = 0  # cached KV blocks evicted (each drops its entry)
    num_state_evictions: int = 0  # cached state slots evicted on their own

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens (vLLM's prefix-cache hit rate); 0 before any query."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    @property
    def num_evictions(self) -> int:
        return self.num_kv_evictions + self.num_state_evictions


class PrefixIndex:
    """``entries``: hash -> ``CacheEntry``; ``kv`` / ``state``: the pools, whose ``cached`` maps point back at
    the entries. Taking an id from a pool evicts the least recently freed cached one when no free id is left."""

    def __init__(self, kv: BlockPool, state: BlockPool, *, has_attention: bool, has_mamba: bool):
        self.kv = kv
        self.state = state
        self.has_attention = has_attention
        self.has_mamba = has_mamba
        self.entries: dict[bytes, CacheEntry] = {}
        self.stats = PrefixCacheStats()

    def find_hit(self, hashes: list[bytes]) -> int:
        """Number of leading blocks a request can take from the cache (``hashes``: candidate blocks)."""
        if not self.has_attention:  # Mamba only: the last cached state wins (vLLM searches right to left)
            for j in range(len(hashes) - 1, -1, -1):
                e = self.entries.get(hashes[j])
                if e is not None and e.state:
                    return j + 1
            return 0
        best = 0
        for j, h in enumerate(hashes):
            e = self.entries.get(h)
            if e is None or not e.kv:
                break
            if not self.has_mamba or e.state:
                best = j + 1
        return best

    def take_kv(self, n: int) -> list[int]:
        """``n`` KV blocks, referenced once each (the caller checked ``kv.num_available``)."""
        return self._take(self.kv, n, self._evict_kv)

    def take_state(self, n: int) -> list[int]:
        """``n`` state slots, referenced once each (the caller checked ``state.num_available``)."""
        return self._take(self.state, n, self._evict_state)

    @staticmethod
    def _take(pool: BlockPool, n: int, evict) -> list[int]:
        out = []
        for _ in range(n):
            if pool.free:
                i = pool.free.popleft()
            else:
                i, _ = pool.evictable.popitem(last=False)
                evict(i)
            pool.refs[i] = 1
            out.append(i)
        return out

    def _evict_kv(self, i: int) -> None:
        h = self.kv.cached.pop(i)
        entry = self.entries.pop(h)
        self.stats.num_kv_evictions += 1
        s = entry.state
        if s:
            del self.state.cached[s]
            if self.state.refs[s] == 0:
                del self.state.evictable[s]
                self.state.free.append(s)

    def _evict_state(self, i: int) -> None:
        h = self.state.cached.pop(i)
        entry = self.entries[h]
        entry.state = NULL_ID
        if not entry.kv:
            del self.entries[h]
        self.stats.num_state_evictions += 1

    def cache_block(self, h: bytes, kv: int, state: int) -> None:
        """Enter a computed full block: its KV block and/or the slot holding the state at its end."""
        entry = self.entries.get(h)
        if entry is None:
            if not kv and not state:
                return
            self.entries[h] = CacheEntry(kv, state)
            if kv:
                self.kv.cached[kv] = h
            if state:
                self.state.cached[state] = h
        elif state and not entry.state and state not in self.state.cached:
            # Same content computed twice: our KV block stays a private duplicate,
            # but the entry gains the state it lacked.
            entry.state = state
            self.state.cached[state] = h

    def clear(self) -> None:
        """Drop every entry; the unreferenced cached ids go back to the free lists."""
        for pool in (self.kv, self.state):
            for i in list(pool.evictable):
                del pool.evictable[i]
                pool.free.append(i)
            pool.cached.clear()
        self.entries.clear()

    def check(self) -> None:
        """``SlotError`` unless every entry points at live ids whose reverse maps point back, and back only."""
        seen_kv, seen_st = {}, {}
        for h, e in self.entries.items():
            if not e.kv and not e.state:
                raise SlotError("a cache entry holds neither a KV block nor a state")
            if e.kv and self.kv.cached.get(e.kv) != h:
                raise SlotError(f"cache entry's KV block {e.kv} does not map back to it")
            if e.state and self.state.cached.get(e.state) != h:
                raise SlotError(f"cache entry's state slot {e.state} does not map back to it")
            if self.has_attention and not e.kv:
                raise SlotError("a cache entry of an attention model lost its KV block")
            if e.kv:
                seen_kv[e.kv] = h
            if e.state:
                seen_st[e.state] = h
        if seen_kv != self.kv.cached or seen_st != self.state.cached:
            raise SlotError("cached-id maps disagree with the hash entries")
