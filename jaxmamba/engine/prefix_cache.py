"""Host-side prefix cache for hybrid attention + Mamba2 models (pure Python/numpy).

``PrefixCacheManager`` owns the KV block and Mamba state slot pools, each request's attention and Mamba
block tables in every cache mode (``none``/``align``/``all``), the chained block hashes and LRU eviction.
The modes, hashing, what a hit is, eviction, and what the model must write for this to be correct:
docs/architecture.md, "Prefix caching".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from jaxmamba.engine.block_pool import (
    NULL_ID,
    ROOT_HASH,
    BlockPool,
    CacheEntry,
    block_hashes,
    hash_block_tokens,
)
from jaxmamba.errors import ConfigError, RequestError, SlotError
from jaxmamba.metadata.checks import cdiv
from jaxmamba.metadata.mamba_builder import CACHE_MODES, mamba_block_table_columns

# --------------------------------------------------------------------------- data


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


@dataclass
class _Req:
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


# --------------------------------------------------------------------------- manager


class PrefixCacheManager:
    """KV-block and Mamba-state allocation with prefix caching for one engine.

    Integration, per engine step (the scheduler/runner hooks):

    1. Admission of a waiting request (also a preempted one, with
       ``token_ids = prompt + outputs``): ``hit = allocate_for_new_request(rid,
       token_ids, budget)``; ``None`` means it cannot start now (pools full, or
       in mode ``align`` the budget cannot reach a block end): keep it waiting,
       nothing changed. Otherwise ``req.num_computed_tokens =
       hit.num_cached_tokens`` and the first step computes exactly
       ``hit.num_new_tokens`` (mode ``align``: already cut to a block end).
       Later prefill chunks in mode ``align``: ``align_prefill_chunk`` (0 -> skip
       the request this step).
    2. Every scheduled row, before the step: ``allocate_more(rid, num_computed +
       num_new)`` (idempotent; ``False`` -> preempt a victim with ``free`` and
       retry, exactly like the current ``blocks.can_allocate`` loop).
    3. Runner: ``block_table_row(rid)`` (or, kept across steps, ``kv_block_list(rid)``) and
       ``state_indices_row(rid)`` (or, kept across steps, ``state_table_list(rid)`` within
       ``state_table_window(rid)``) fill the ``block_table`` / ``state_indices`` rows; with speculative decoding pass
       ``num_accepted_tokens(rid)`` and, in mode ``all``, ``prev_step_last_block(rid)``
       to ``build_mamba_metadata``; pass ``cache_mode`` and ``num_speculative_blocks``.
    4. After the step ran, for every row: ``commit(rid, new_num_computed,
       token_ids=req.all_token_ids, num_scheduled_tokens=q,
       multi_token_decode=(row < num_decodes and q > 1))``.
    5. Finish or preemption: ``free(rid)``.
    """

    def __init__(
        self,
        num_kv_blocks: int,
        num_state_slots: int,
        block_size: int,
        cache_mode: str = "all",
        num_spec: int = 0,
        has_attention: bool = True,
        has_mamba: bool = True,
        *,
        max_model_len: int,
        mamba_chunk_size: int | None = None,
        enable_caching: bool = True,
        max_num_batched_tokens: int | None = None,
    ):
        """``max_num_batched_tokens``: the scheduler's token budget (mode ``align``: a block wider than it
        is prefilled in sub-block chunks, see ``align_prefill_chunk``; None: unbounded)."""
        if cache_mode not in CACHE_MODES:
            raise ConfigError(f"cache_mode={cache_mode!r} must be one of {CACHE_MODES}")
        if not has_attention and not has_mamba:
            raise ConfigError("a model needs attention or Mamba layers (has_attention and has_mamba both False)")
        for name, v, lo in (
            ("block_size", block_size, 1), ("num_spec", num_spec, 0), ("max_model_len", max_model_len, 1)
        ):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise ConfigError(f"{name}={v!r} must be an integer >= {lo}")
        if has_attention and num_kv_blocks < 2:
            raise ConfigError(f"num_kv_blocks={num_kv_blocks} must be >= 2 (block 0 is the null block)")
        if has_mamba and num_state_slots < 2:
            raise ConfigError(f"num_state_slots={num_state_slots} must be >= 2 (slot 0 is the null slot)")
        if mamba_chunk_size is not None:
            if mamba_chunk_size < 1:
                raise ConfigError(f"mamba_chunk_size={mamba_chunk_size} must be >= 1")
            if has_mamba and cache_mode != "none" and block_size % mamba_chunk_size:
                raise ConfigError(
                    f"block_size={block_size} must be a multiple of mamba_chunk_size={mamba_chunk_size} in "
                    f"cache_mode={cache_mode!r} (block-end states are taken at chunk ends)"
                )
        self.block_size = int(block_size)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache_mode = cache_mode
        self.num_spec = int(num_spec)
        self.has_attention = has_attention
        self.has_mamba = has_mamba
        self.max_model_len = int(max_model_len)
        self.num_kv_columns = cdiv(self.max_model_len, self.block_size)
        #: Columns of the Mamba block table (docs/architecture.md, Rule 2): the builder's rule, not a copy of it.
        self.num_state_columns = mamba_block_table_columns(
            cache_mode, self.max_model_len, self.block_size, self.num_spec
        )
        self.caching = bool(enable_caching) and (cache_mode != "none" or not has_mamba)
        # Mode none without caching: a running request's step needs KV blocks at most (allocate_more) and its
        # commit only moves a counter. Both take a short path then (called once per row per step).
        self._plain = cache_mode == "none" and not self.caching
        self._kv = BlockPool(int(num_kv_blocks) if has_attention else 0, "KV block")
        self._state = BlockPool(int(num_state_slots) if has_mamba else 0, "state slot")
        self._entries: dict[bytes, CacheEntry] = {}
        self._reqs: dict[str, _Req] = {}
        self._stats = PrefixCacheStats()

    # ------------------------------------------------------------------ public views
    @property
    def stats(self) -> PrefixCacheStats:
        s = self._stats
        return PrefixCacheStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})

    def reset_stats(self) -> None:
        self._stats = PrefixCacheStats()

    @property
    def num_used_kv_blocks(self) -> int:
        """KV blocks referenced by requests (cached-but-unreferenced ones are not 'used')."""
        return self._kv.num_used

    @property
    def num_used_state_slots(self) -> int:
        return self._state.num_used

    @property
    def num_free_kv_blocks(self) -> int:
        """Blocks an allocation can get: free plus evictable."""
        return self._kv.num_available

    @property
    def num_free_state_slots(self) -> int:
        return self._state.num_available

    @property
    def num_cached_blocks(self) -> int:
        """Hash entries (cached full blocks)."""
        return len(self._entries)

    @property
    def num_cached_states(self) -> int:
        return len(self._state.cached)

    @property
    def kv_block_usage(self) -> float:
        """Fraction of the KV pool (null block excluded) that requests reference; 0 without attention."""
        return self._kv.num_used / (self._kv.size - 1) if self.has_attention else 0.0

    @property
    def state_slot_usage(self) -> float:
        """Fraction of the state pool (null slot excluded) that requests reference; 0 without Mamba."""
        return self._state.num_used / (self._state.size - 1) if self.has_mamba else 0.0

    @property
    def request_ids(self) -> list[str]:
        """Requests that hold blocks or slots now."""
        return list(self._reqs)

    @property
    def usage(self) -> float:
        """Fraction of the scarcer pool that requests reference (0 when idle)."""
        u = []
        if self.has_attention:
            u.append(self._kv.num_used / (self._kv.size - 1))
        if self.has_mamba:
            u.append(self._state.num_used / (self._state.size - 1))
        return max(u)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reqs

    def num_computed_tokens(self, request_id: str) -> int:
        return self._req(request_id).num_computed

    def kv_block_ids(self, request_id: str) -> list[int]:
        return list(self._req(request_id).kv)

    def state_table(self, request_id: str) -> list[int]:
        return list(self._req(request_id).table)

    def block_table_row(self, request_id: str, num_columns: int | None = None) -> np.ndarray:
        """int32 attention block-table row (``cdiv(max_model_len, block_size)`` columns by default), 0-padded."""
        kv = self._req(request_id).kv
        n = self.num_kv_columns if num_columns is None else num_columns
        if len(kv) > n:
            raise SlotError(f"request {request_id!r} holds {len(kv)} KV blocks, more than {n} columns")
        row = np.zeros(n, np.int32)
        row[: len(kv)] = kv
        return row

    def kv_block_list(self, request_id: str) -> list[int]:
        """The request's KV block ids, the manager's own list (read, never modify): it only grows while the
        request runs, and a re-admitted request gets a new list (the runner keeps rows on that basis)."""
        return self._req(request_id).kv

    def kv_block_lists(self, request_ids: Sequence[str]) -> list[list[int]]:
        """``kv_block_list`` of each request (one call a step for the runner's block table)."""
        try:
            return [self._reqs[rid].kv for rid in request_ids]
        except KeyError as e:
            raise SlotError(f"request {e.args[0]!r} holds no cache blocks") from None

    def state_table_lists(self, request_ids: Sequence[str]) -> list[list[int]]:
        """``state_table_list`` of each request (one call a step for the runner's state table)."""
        try:
            return [self._reqs[rid].table for rid in request_ids]
        except KeyError as e:
            raise SlotError(f"request {e.args[0]!r} holds no cache blocks") from None

    def state_indices_row(self, request_id: str) -> np.ndarray:
        """int32 Mamba block-table row, exactly ``mamba_block_table_columns(...)`` columns (Rule 2)."""
        return np.asarray(self._req(request_id).table, dtype=np.int32)

    def state_table_list(self, request_id: str) -> list[int]:
        """The request's Mamba block table, the manager's own list (read, never modify): it changes in place,
        only inside ``state_table_window``, and a re-admitted request gets a new list (the runner keeps its
        device rows on that basis, as ``kv_block_list``'s)."""
        return self._req(request_id).table

    def state_table_window(self, request_id: str) -> tuple[int, int]:
        """``(lo, hi)``: the request's Mamba table is null outside columns ``[lo, hi)`` (released below,
        never allocated above; mode ``none``: every column)."""
        req = self._req(request_id)
        return min(req.low_col, req.high_col), req.high_col

    def state_indices_rows(self, request_ids: Sequence[str]) -> np.ndarray:
        """``int32[len(request_ids), num_state_columns]``: ``state_indices_row`` of each request, stacked (one
        conversion for the batch, not an array per row)."""
        req = self._req
        rows = [req(i).table for i in request_ids]
        return np.array(rows, dtype=np.int32).reshape(len(rows), self.num_state_columns)

    def num_accepted_tokens(self, request_id: str) -> int:
        """The builder's ``num_accepted_tokens`` for this request's next step (1 unless its last step was a
        multi-token decode)."""
        return self._req(request_id).num_accepted

    def prev_step_last_block(self, request_id: str) -> int:
        """The builder's ``prev_step_last_block`` (mode ``all``): where the last multi-token decode wrote its
        states, or -1 (read from the block of the last computed token)."""
        return self._req(request_id).prev_last_block

    def write_columns(self, request_id: str, num_total_tokens: int) -> list[int]:
        """Mamba columns a step taking the request to ``num_total_tokens`` may write (all private after
        ``allocate_more``)."""
        req = self._req(request_id)
        if not self.has_mamba:
            return []
        if self.cache_mode == "none":
            return list(range(self.num_state_columns))
        c, s = req.num_computed, num_total_tokens
        blk_s = cdiv(s, self.block_size) - 1
        first = c // self.block_size
        return [j for j in range(first, blk_s + self.num_spec + 1) if req.table[j] != NULL_ID]

    # ------------------------------------------------------------------ lookup
    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        """The prefix hit ``token_ids`` would get now (no side effects, no stats)."""
        n = len(token_ids)
        hashes = block_hashes(token_ids, self.block_size, max(n - 1, 0) // self.block_size) if self.caching else []
        hit = self._find_hit(hashes)
        return self._hit(hashes, hit, n - hit * self.block_size)

    def _find_hit(self, hashes: list[bytes]) -> int:
        """Number of leading blocks a request can take from the cache (``hashes``: candidate blocks)."""
        if not self.caching:
            return 0
        if not self.has_attention:  # Mamba only: the last cached state wins (vLLM searches right to left)
            for j in range(len(hashes) - 1, -1, -1):
                e = self._entries.get(hashes[j])
                if e is not None and e.state:
                    return j + 1
            return 0
        best = 0
        for j, h in enumerate(hashes):
            e = self._entries.get(h)
            if e is None or not e.kv:
                break
            if not self.has_mamba or e.state:
                best = j + 1
        return best

    def _hit(self, hashes, hit: int, num_new: int) -> PrefixHit:
        kv = tuple(self._entries[h].kv for h in hashes[:hit]) if self.has_attention else ()
        state = self._entries[hashes[hit - 1]].state if hit and self.has_mamba else NULL_ID
        return PrefixHit(hit * self.block_size, num_new, hit, kv, state)

    # ------------------------------------------------------------------ allocation
    def _step_columns(self, c: int, s: int) -> range:
        """Mamba columns that must hold private slots for a step from ``c`` to ``s`` tokens."""
        if not self.has_mamba:
            return range(0)
        if self.cache_mode == "none":
            return range(self.num_state_columns)
        blk_s = cdiv(s, self.block_size) - 1
        lo = c // self.block_size if self.cache_mode == "all" else blk_s
        return range(lo, blk_s + self.num_spec + 1)

    def _take_kv(self, n: int) -> list[int]:
        pool, out = self._kv, []
        for _ in range(n):
            if pool.free:
                i = pool.free.popleft()
            else:
                i, _ = pool.evictable.popitem(last=False)
                self._evict_kv(i)
            pool.refs[i] = 1
            out.append(i)
        return out

    def _take_state(self, n: int) -> list[int]:
        pool, out = self._state, []
        for _ in range(n):
            if pool.free:
                i = pool.free.popleft()
            else:
                i, _ = pool.evictable.popitem(last=False)
                self._evict_state(i)
            pool.refs[i] = 1
            out.append(i)
        return out

    def _evict_kv(self, i: int) -> None:
        h = self._kv.cached.pop(i)
        entry = self._entries.pop(h)
        self._stats.num_kv_evictions += 1
        s = entry.state
        if s:
            del self._state.cached[s]
            if self._state.refs[s] == 0:
                del self._state.evictable[s]
                self._state.free.append(s)

    def _evict_state(self, i: int) -> None:
        h = self._state.cached.pop(i)
        entry = self._entries[h]
        entry.state = NULL_ID
        if not entry.kv:
            del self._entries[h]
        self._stats.num_state_evictions += 1

    def allocate_for_new_request(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens_first_step: int
    ) -> PrefixHit | None:
        """Look up the prefix cache, share the hit, and allocate what the first step writes.

        ``token_ids``: every known token (prompt, plus outputs for a preempted
        request). ``num_new_tokens_first_step``: the most tokens the first step
        may compute (the scheduler's budget); it is clipped to what the hit
        leaves and, in mode ``align``, cut back by ``align_prefill_chunk``.
        ``PrefixHit.num_new_tokens`` is what the first step must compute
        (allocation matches it exactly). Returns ``None`` (and changes nothing)
        when the request cannot start now: the pools cannot hold its first step
        even after evicting unreferenced cached blocks, or (mode ``align``) the
        budget cannot reach the next block end.
        """
        if request_id in self._reqs:
            raise SlotError(f"request {request_id!r} already holds cache blocks")
        n = len(token_ids)
        if n < 1:
            raise RequestError(f"request {request_id!r} has no tokens")
        if n > self.max_model_len:
            raise RequestError(f"request {request_id!r} has {n} tokens > max_model_len={self.max_model_len}")
        if num_new_tokens_first_step < 1:
            raise RequestError(f"num_new_tokens_first_step={num_new_tokens_first_step} must be >= 1")
        bs = self.block_size
        hashes = block_hashes(token_ids, bs) if self.caching else []
        hit = self._find_hit(hashes[: (n - 1) // bs])
        c = hit * bs
        num_new = self.align_prefill_chunk(c, n, min(int(num_new_tokens_first_step), n - c))
        if num_new == 0:
            return None
        s = c + num_new
        result = self._hit(hashes, hit, num_new)

        need_kv = cdiv(s, bs) - hit if self.has_attention else 0
        cols = list(self._step_columns(c, s))
        kv_avail = self._kv.num_available - sum(1 for i in result.kv_block_ids if self._kv.refs[i] == 0)
        hit_slot_idle = result.state_slot and self._state.refs[result.state_slot] == 0
        st_avail = self._state.num_available - (1 if hit_slot_idle else 0)
        if need_kv > kv_avail or len(cols) > st_avail:
            return None

        for i in result.kv_block_ids:
            self._kv.touch(i)
        table = [NULL_ID] * self.num_state_columns
        if result.state_slot:
            self._state.touch(result.state_slot)
            table[hit - 1] = result.state_slot
        kv = list(result.kv_block_ids) + self._take_kv(need_kv)
        for j, slot in zip(cols, self._take_state(len(cols)), strict=True):
            table[j] = slot
        allocated = [j for j, slot in enumerate(table) if slot]
        self._reqs[request_id] = _Req(
            request_id=request_id,
            token_ids=token_ids,
            kv=kv,
            table=table,
            num_computed=c,
            num_committed_blocks=hit,
            hashes=hashes,
            low_col=max(hit - 1, 0),
            high_col=allocated[-1] + 1 if allocated else 0,
        )
        if self.caching:
            st = self._stats
            st.num_queries += 1
            st.num_query_tokens += n
            st.num_hit_tokens += c
            st.num_hit_requests += 1 if hit else 0
        return result

    def allocate_more(self, request_id: str, num_total_tokens: int) -> bool:
        """Make the request ready for a step that ends at ``num_total_tokens`` tokens (its ``seq_len``).

        Adds KV blocks up to ``cdiv(num_total_tokens, block_size)`` and the
        private Mamba slots the step writes (mode ``all``: every column from the
        first scheduled block through ``blk_s + num_spec``; mode ``align``:
        ``blk_s .. blk_s + num_spec``; Rule 2's speculative columns included).
        Idempotent for a given ``num_total_tokens`` (in mode ``align`` a smaller
        one than before may need its own window). Returns ``False`` and changes
        nothing when the pools cannot
        provide them even after evicting unreferenced cached blocks (the caller
        preempts and retries).
        """
        req = self._reqs.get(request_id)
        if req is not None and self._plain and req.num_computed < num_total_tokens <= self.max_model_len and (
                not self.has_attention or num_total_tokens <= len(req.kv) * self.block_size):
            return True  # the blocks are there; mode none took every state column at admission
        req = self._req(request_id)
        s = int(num_total_tokens)
        if s > self.max_model_len:
            raise RequestError(f"request {request_id!r}: {s} tokens > max_model_len={self.max_model_len}")
        if s <= req.num_computed:
            raise RequestError(
                f"request {request_id!r}: num_total_tokens={s} must exceed its {req.num_computed} computed tokens"
            )
        need_kv = max(cdiv(s, self.block_size) - len(req.kv), 0) if self.has_attention else 0
        cols = [j for j in self._step_columns(req.num_computed, s) if req.table[j] == NULL_ID]
        if not (need_kv or cols):  # most decode steps: everything is in place (no pool to ask)
            return True
        if need_kv > self._kv.num_available or len(cols) > self._state.num_available:
            return False
        req.kv += self._take_kv(need_kv)
        for j, slot in zip(cols, self._take_state(len(cols)), strict=True):
            req.table[j] = slot
        if cols:
            req.high_col = max(req.high_col, cols[-1] + 1)
        return True

    # ------------------------------------------------------------------ after a step
    def _hashes_upto(self, req: _Req, num_blocks: int) -> list[bytes]:
        hs, bs, toks = req.hashes, self.block_size, req.token_ids
        if len(toks) < num_blocks * bs:
            raise RequestError(
                f"request {req.request_id!r}: {len(toks)} known tokens cannot cover {num_blocks} full blocks "
                "(pass token_ids to commit)"
            )
        parent = hs[-1] if hs else ROOT_HASH
        for j in range(len(hs), num_blocks):
            parent = hash_block_tokens(parent, toks[j * bs : (j + 1) * bs])
            hs.append(parent)
        return hs

    def _cache_block(self, h: bytes, kv: int, state: int) -> None:
        entry = self._entries.get(h)
        if entry is None:
            if not kv and not state:
                return
            self._entries[h] = CacheEntry(kv, state)
            if kv:
                self._kv.cached[kv] = h
            if state:
                self._state.cached[state] = h
        elif state and not entry.state and state not in self._state.cached:
            # Same content computed twice: our KV block stays a private duplicate,
            # but the entry gains the state it lacked.
            entry.state = state
            self._state.cached[state] = h

    def commit(
        self,
        request_id: str,
        num_computed_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        num_scheduled_tokens: int | None = None,
        multi_token_decode: bool = False,
    ) -> int:
        """Record a step that has run: the request now has ``num_computed_tokens`` computed tokens.

        Newly completed full blocks enter the cache: their KV always, their
        state when it was written at the block's end to the block's own column
        (not for ``multi_token_decode`` rows -- rows the Mamba builder ran
        through the decode path with more than one token, i.e. speculative
        verification -- whose states sit one column per token). Mamba columns
        before the block of the last computed token are released. For
        multi-token decodes (``num_scheduled_tokens`` = tokens scheduled,
        ``num_computed_tokens - before`` = accepted ones) it records what the
        next step's builder needs (``num_accepted_tokens``; mode ``all``:
        ``prev_step_last_block``, the window the step wrote) and, in mode
        ``align`` (where the builder anchors the read window at the block of
        the last computed token), rotates the request's private columns so the
        written window starts there (host-side, no device copy). ``token_ids``: the
        request's tokens, needed when they grew since admission (outputs).
        Returns the number of newly cached blocks.
        """
        req = self._reqs.get(request_id)
        if req is not None and self._plain and not multi_token_decode:
            c_old, c_new = req.num_computed, int(num_computed_tokens)
            if c_old < c_new and (num_scheduled_tokens is None or num_scheduled_tokens == c_new - c_old) and (
                    not self.has_attention or c_new <= len(req.kv) * self.block_size):
                # What the full path below does for such a step: nothing to cache, no column to release.
                if token_ids is not None:
                    req.token_ids = token_ids
                req.num_computed, req.num_accepted, req.prev_last_block = c_new, 1, -1
                return 0
        req = self._req(request_id)
        if token_ids is not None:
            req.token_ids = token_ids
        c_old, c_new = req.num_computed, int(num_computed_tokens)
        bs = self.block_size
        if c_new < c_old:
            raise RequestError(f"request {request_id!r}: num_computed_tokens went back from {c_old} to {c_new}")
        if c_new == c_old:
            return 0
        q = c_new - c_old if num_scheduled_tokens is None else int(num_scheduled_tokens)
        if q < c_new - c_old:
            raise RequestError(f"request {request_id!r}: {c_new - c_old} tokens computed but {q} scheduled")
        if q != c_new - c_old and not multi_token_decode:
            raise RequestError(
                f"request {request_id!r}: {q} tokens scheduled, {c_new - c_old} computed; only a multi-token "
                "decode can reject tokens"
            )
        s = c_old + q
        if self.has_attention and cdiv(s, bs) > len(req.kv):
            raise SlotError(f"request {request_id!r}: a step to {s} tokens ran without KV blocks for them")
        if self.has_mamba and self.cache_mode != "none":
            missing = [j for j in range(cdiv(s, bs) - 1, cdiv(s, bs) + self.num_spec) if not req.table[j]]
            if missing:
                raise SlotError(f"request {request_id!r}: Mamba columns {missing} had no slot for the step to {s}")

        new_cached = 0
        if self.caching:
            n_full = c_new // bs
            hashes = self._hashes_upto(req, n_full)
            for j in range(req.num_committed_blocks, n_full):
                state = NULL_ID
                if self.has_mamba and not multi_token_decode:
                    state = req.table[j]
                before = len(self._entries)
                self._cache_block(hashes[j], req.kv[j] if self.has_attention else NULL_ID, state)
                new_cached += len(self._entries) - before
            req.num_committed_blocks = max(req.num_committed_blocks, n_full)
        req.num_computed = c_new

        accepted = c_new - c_old
        req.num_accepted = accepted if multi_token_decode else 1
        req.prev_last_block = -1
        if self.has_mamba and self.cache_mode != "none":
            blk_c = cdiv(c_new, bs) - 1
            if multi_token_decode:
                # The step wrote its window [blk_s, blk_s + num_spec]: token t's SSM state to
                # column blk_s + t, the conv history to column blk_s. The next step reads the
                # window at its anchor: conv from column 0, SSM from column accepted - 1.
                blk_s = cdiv(s, bs) - 1
                if self.cache_mode == "all":
                    req.prev_last_block = blk_s  # Rule 2's block_idx_last_scheduled_token_prev_step
                elif blk_s > blk_c:
                    # align: the builder anchors at blk_c; rotate the (private) columns
                    # [blk_c, blk_s + num_spec] so the window moves there (no device copy).
                    hi = blk_s + self.num_spec + 1
                    seg, d = req.table[blk_c:hi], blk_s - blk_c
                    req.table[blk_c:hi] = seg[d:] + seg[:d]
            for j in range(blk_c - 1, req.low_col - 1, -1):  # vLLM's remove_skipped_blocks, tail first
                if req.table[j]:
                    self._state.release(req.table[j])
                    req.table[j] = NULL_ID
            req.low_col = max(req.low_col, blk_c)
        return new_cached

    def align_prefill_chunk(self, num_computed_tokens: int, num_tokens: int, num_new_tokens: int) -> int:
        """vLLM's ``_mamba_block_aligned_split`` (mode ``align``; other modes return ``num_new_tokens``).

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
        if self.cache_mode != "align" or not self.caching:
            return num_new_tokens
        bs = self.block_size
        c, n = num_computed_tokens, num_new_tokens
        last = (num_tokens - 1) // bs * bs
        after = c + n
        if after < last:
            aligned = after // bs * bs
            if aligned > c or self.max_num_batched_tokens is None or bs <= self.max_num_batched_tokens:
                return max(aligned - c, 0)
            return n  # inside one block: sub-block progress
        if c < last < after:
            return last - c
        return n

    def free(self, request_id: str) -> None:
        """Drop the request's references (finish or preemption); cached ids become evictable, others free.

        Blocks are released tail first so that LRU eviction takes a sequence's
        last blocks before its (more shareable) first ones. Unknown ids are ignored.
        """
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        for slot in reversed(req.table):
            if slot:
                self._state.release(slot)
        for b in reversed(req.kv):
            self._kv.release(b)

    def reset_cache(self) -> bool:
        """Drop every unreferenced cached entry (vLLM's ``reset_prefix_cache``); False if requests hold ids."""
        if self._reqs:
            return False
        for pool in (self._kv, self._state):
            for i in list(pool.evictable):
                del pool.evictable[i]
                pool.free.append(i)
            pool.cached.clear()
        self._entries.clear()
        return True

    # ------------------------------------------------------------------ checks
    def _req(self, request_id: str) -> _Req:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise SlotError(f"request {request_id!r} holds no cache blocks") from None

    def check_invariants(self) -> None:
        """Raise ``SlotError`` on any inconsistency (tests call it after every step).

        Pools: no id both free and referenced/evictable, null ids never handed
        out or cached, free + evictable + referenced == total (no leak), and
        ref counts equal the references the requests hold. Cache: every entry
        points at live ids whose reverse maps point back. Requests: tables have
        the seed-001 width, no id twice, the read column holds a slot, and every
        column / KV block a step may write (from the block of the first
        uncomputed token on) is private (ref 1, not cached): writing a shared
        or cached slot must never happen.
        """
        self._kv.check()
        self._state.check()
        kv_refs = [0] * max(self._kv.size, 1)
        st_refs = [0] * max(self._state.size, 1)
        bs = self.block_size
        for rid, req in self._reqs.items():
            if len(req.table) != self.num_state_columns:
                raise SlotError(
                    f"request {rid!r}: Mamba table has {len(req.table)} columns, not {self.num_state_columns}"
                )
            kv_ids = [b for b in req.kv]
            st_ids = [x for x in req.table if x]
            if NULL_ID in kv_ids:
                raise SlotError(f"request {rid!r} holds the null KV block")
            if len(set(kv_ids)) != len(kv_ids) or len(set(st_ids)) != len(st_ids):
                raise SlotError(f"request {rid!r} holds an id twice")
            for b in kv_ids:
                if not 0 < b < self._kv.size:
                    raise SlotError(f"request {rid!r}: KV block {b} out of range")
                kv_refs[b] += 1
            for x in st_ids:
                if not 0 < x < self._state.size:
                    raise SlotError(f"request {rid!r}: state slot {x} out of range")
                st_refs[x] += 1
            c = req.num_computed
            if self.has_attention and len(req.kv) < cdiv(c, bs):
                raise SlotError(f"request {rid!r}: {c} computed tokens but only {len(req.kv)} KV blocks")
            first = c // bs
            for j in range(first, len(req.kv)):
                b = req.kv[j]
                if self._kv.refs[b] != 1 or b in self._kv.cached:
                    raise SlotError(f"request {rid!r}: KV block {b} (block {j}) will be written but is shared/cached")
            if self.has_mamba:
                if self.cache_mode == "none":
                    if any(not x for x in req.table):
                        raise SlotError(f"request {rid!r}: mode none needs all {self.num_state_columns} slots")
                    wcols = range(self.num_state_columns)
                else:
                    wcols = range(first, self.num_state_columns)
                    if c > 0:
                        anchor = req.prev_last_block if req.prev_last_block >= 0 else cdiv(c, bs) - 1
                        for j in (anchor, anchor + req.num_accepted - 1):  # conv, SSM read columns
                            if not req.table[j]:
                                raise SlotError(f"request {rid!r}: column {j}, read by its next step, holds no slot")
                    if any(req.table[j] for j in range(0, req.low_col)):
                        raise SlotError(f"request {rid!r}: a released Mamba column still holds a slot")
                if any(req.table[j] for j in range(req.high_col, self.num_state_columns)):
                    raise SlotError(f"request {rid!r}: a Mamba column past its window (from {req.high_col}) holds a slot")
                for j in wcols:
                    x = req.table[j]
                    if x and (self._state.refs[x] != 1 or x in self._state.cached):
                        raise SlotError(f"request {rid!r}: state slot {x} (column {j}) is writable but shared/cached")
        if kv_refs[1:] != self._kv.refs[1:]:
            raise SlotError("KV block reference counts disagree with the requests' block lists")
        if st_refs[1:] != self._state.refs[1:]:
            raise SlotError("state slot reference counts disagree with the requests' Mamba tables")
        seen_kv, seen_st = {}, {}
        for h, e in self._entries.items():
            if not e.kv and not e.state:
                raise SlotError("a cache entry holds neither a KV block nor a state")
            if e.kv and self._kv.cached.get(e.kv) != h:
                raise SlotError(f"cache entry's KV block {e.kv} does not map back to it")
            if e.state and self._state.cached.get(e.state) != h:
                raise SlotError(f"cache entry's state slot {e.state} does not map back to it")
            if self.has_attention and not e.kv:
                raise SlotError("a cache entry of an attention model lost its KV block")
            if e.kv:
                seen_kv[e.kv] = h
            if e.state:
                seen_st[e.state] = h
        if seen_kv != self._kv.cached or seen_st != self._state.cached:
            raise SlotError("cached-id maps disagree with the hash entries")
