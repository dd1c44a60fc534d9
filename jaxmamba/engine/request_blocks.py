"""What ``PrefixCacheManager`` (jaxmamba.engine.prefix_cache) keeps per request and returns at admission."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class PrefixHit:
    """Result of a lookup / admission.

    ``num_cached_tokens``: tokens whose KV and Mamba state come from the cache
    (a multiple of ``block_size``); the request starts with that many computed
    tokens. ``num_new_tokens``: tokens the first step computes (admission
    only; for ``lookup`` it is everything left). ``kv_block_ids``: the shared
    KV blocks (block-table columns ``0 .. num_hit_blocks-1``). ``state_slot``:
    the shared slot holding the state at the hit's end (the first step's
    initial state; 0 without a hit).
    """

    num_cached_tokens: int
    num_new_tokens: int
    num_hit_blocks: int
    kv_block_ids: tuple[int, ...]
    state_slot: int


@dataclass(slots=True)
class RequestBlocks:
    """One request's record in ``PrefixCacheManager``: its KV block list, its Mamba table (state slot per
    column), its computed and committed counts, its block hashes and the columns a step may touch."""

    request_id: str
    token_ids: Sequence[int]
    kv: list[int]
    table: list[int]
    num_computed: int
    num_committed_blocks: int  # leading full blocks already offered to the cache
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks, computed lazily
    low_col: int = 0  # Mamba columns below this are all null (released)
    high_col: int = 0  # Mamba columns from this one on are all null (never allocated)
    num_accepted: int = 1  # what the builder's num_accepted_tokens must say next step
    prev_last_block: int = -1  # mode all + multi-token decode: last step's block of the last scheduled token
