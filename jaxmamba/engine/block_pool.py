"""Ref-counted id pools and the chained block hashes the prefix cache keys on (pure Python).

``BlockPool``: one pool of ids (attention KV blocks, or Mamba state slots), id 0 null (docs/architecture.md,
"Caches"): reference counts, a free list of ids that hold nothing cached, and an LRU queue of unreferenced
ids that still hold a cached block (evicted least recently freed first). ``block_hashes``: a full block's hash chains its
tokens on its parent's (``sha256(parent || int64 tokens)`` from a constant root), so equal hashes mean
equal prefixes, stable within and across processes. ``jaxmamba.engine.prefix_cache`` builds the cache
on both.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from jaxmamba.errors import RequestError, SlotError

NULL_ID = 0

#: Parent hash of a sequence's first block (a constant: hashes are stable across runs).
ROOT_HASH = hashlib.sha256(b"jaxmamba.prefix_cache.root.v1").digest()


def hash_block_tokens(parent_hash: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full block: sha256 of the parent hash and the block's tokens (as int64)."""
    try:
        data = np.asarray(tokens, dtype=np.int64).tobytes()
    except (OverflowError, ValueError, TypeError) as e:
        raise RequestError(f"token ids must be integers: {e}") from None
    return hashlib.sha256(parent_hash + data).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[bytes]:
    """Chained hashes of the first ``num_blocks`` full blocks (default: all full blocks)."""
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    out: list[bytes] = []
    parent = ROOT_HASH
    for j in range(n):
        parent = hash_block_tokens(parent, token_ids[j * block_size : (j + 1) * block_size])
        out.append(parent)
    return out


@dataclass
class CacheEntry:
    """What the cache holds for one block hash."""

    kv: int  # KV block id (0: model without attention)
    state: int  # state slot holding the state at the block's end (0: none)


class BlockPool:
    """Ref counts, a free list of uncached ids and an LRU queue of unreferenced cached ids."""

    def __init__(self, size: int, kind: str):
        self.size = size
        self.kind = kind
        self.refs = [0] * max(size, 1)
        self.free: deque[int] = deque(range(1, size))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.cached: dict[int, bytes] = {}  # id -> hash of the entry holding it

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return max(self.size - 1, 0) - self.num_available

    def touch(self, i: int) -> None:
        if self.refs[i] == 0:
            if i not in self.evictable:
                raise SlotError(f"{self.kind} {i} is neither referenced nor cached; cannot share it")
            del self.evictable[i]
        self.refs[i] += 1

    def release(self, i: int) -> None:
        if not 0 < i < self.size:
            raise SlotError(f"{self.kind} id {i} is out of range [1, {self.size})")
        if self.refs[i] <= 0:
            raise SlotError(f"{self.kind} {i} released twice")
        self.refs[i] -= 1
        if self.refs[i] == 0:
            if i in self.cached:
                self.evictable[i] = None  # most recently freed: evicted last
            else:
                self.free.append(i)

    def check(self) -> None:
        k = self.kind
        if self.size <= 1:
            return
        free = list(self.free)
        if len(set(free)) != len(free):
            raise SlotError(f"{k} free list holds duplicates")
        if NULL_ID in free or NULL_ID in self.evictable or self.refs[NULL_ID] != 0 or NULL_ID in self.cached:
            raise SlotError(f"null {k} 0 was handed out or cached")
        both = set(free) & set(self.evictable)
        if both:
            raise SlotError(f"{k}s {sorted(both)[:5]} are both free and evictable")
        bad = [i for i in free if self.refs[i] != 0 or i in self.cached]
        if bad:
            raise SlotError(f"{k}s {bad[:5]} are in the free list but referenced or cached")
        bad = [i for i in self.evictable if self.refs[i] != 0 or i not in self.cached]
        if bad:
            raise SlotError(f"{k}s {bad[:5]} are evictable but referenced or not cached")
        if any(r < 0 for r in self.refs):
            raise SlotError(f"negative {k} reference count")
        referenced = sum(1 for r in self.refs[1:] if r > 0)
        if len(free) + len(self.evictable) + referenced != self.size - 1:
            raise SlotError(
                f"{k}s leaked: free {len(free)} + evictable {len(self.evictable)} + referenced {referenced} "
                f"!= {self.size - 1}"
            )
