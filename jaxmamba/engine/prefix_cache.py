"""Host-side prefix cache for hybrid attention + Mamba2 models (pure Python/numpy).

``PrefixCacheManager`` is the coordinator (vLLM's ``KVCacheCoordinator``) over one manager per cache kind
(``engine.single_type_managers``: ``AttentionManager`` for the KV blocks, ``MambaManager`` for the state slots):
it keeps each request's attention and Mamba block tables in every cache mode (``none``/``align``/``all``),
the chained block hashes and the hits, and asks both managers for what a step needs. The modes, hashing, what
a hit is, eviction, and what the model must write for this to be correct: docs/architecture.md, "Prefix caching".
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxmamba.engine.block_pool import NULL_ID, ROOT_HASH, BlockPool, block_hashes, hash_block_tokens
from jaxmamba.engine.mamba_columns import MambaColumns
from jaxmamba.engine.prefix_index import PrefixCacheStats, PrefixIndex
from jaxmamba.engine.request_blocks import PrefixHit, RequestBlocks
from jaxmamba.engine.single_type_managers import AttentionManager, MambaManager
from jaxmamba.errors import ConfigError, RequestError, SlotError
from jaxmamba.metadata.checks import cdiv
from jaxmamba.metadata.mamba_builder import CACHE_MODES, mamba_block_table_columns
from jaxmamba.metadata.pytree import CacheMode

# --------------------------------------------------------------------------- manager


class PrefixCacheManager:
    """KV-block and Mamba-state allocation with prefix caching for one engine: the coordinator of the hash
    index (``PrefixIndex``, shared by both kinds: an entry pairs a block's KV id and state slot), the
    per-request tables and the managers of each kind (``attention``, ``mamba``). The scheduler and the runner
    call it in the order docs/architecture.md, "Prefix caching", lists (admission, growth, the runner's rows,
    commit after the step, free)."""

    def __init__(
        self,
        num_kv_blocks: int,
        num_state_slots: int,
        block_size: int,
        cache_mode: CacheMode | str = CacheMode.ALL,
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
            if has_mamba and cache_mode != CacheMode.NONE and block_size % mamba_chunk_size:
                raise ConfigError(
                    f"block_size={block_size} must be a multiple of mamba_chunk_size={mamba_chunk_size} in "
                    f"cache_mode={cache_mode!r} (block-end states are taken at chunk ends)"
                )
        self.block_size = int(block_size)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache_mode = CacheMode(cache_mode)
        self.num_spec = int(num_spec)
        self.has_attention = has_attention
        self.has_mamba = has_mamba
        self.max_model_len = int(max_model_len)
        self.num_kv_columns = cdiv(self.max_model_len, self.block_size)
        #: Columns of the Mamba block table (docs/architecture.md, Rule 2): the builder's rule, not a copy of it.
        self.num_state_columns = mamba_block_table_columns(
            cache_mode, self.max_model_len, self.block_size, self.num_spec
        )
        self.caching = bool(enable_caching) and (cache_mode != CacheMode.NONE or not has_mamba)
        # Mode none without caching: a running request's step needs KV blocks at most (allocate_more) and its
        # commit only moves a counter. Both take a short path then (called once per row per step).
        self._plain = cache_mode == CacheMode.NONE and not self.caching
        #: A plain manager's requests' tokens their KV blocks hold (at most max_model_len): a step ending within
        #: needs nothing allocated (allocate_more's short path; the scheduler skips the call). Else empty.
        self.token_capacity: dict[str, int] = {}
        #: Requests whose KV block list was made (admission) or grew (allocate_more) since the runner's block
        #: table last wrote their rows (``DeviceBlockTable.sync_changed`` takes out the ids it wrote): every
        #: other request's list is the very list, as long, that its table row was written from.
        self.kv_lists_changed: set[str] = set()
        self.columns = MambaColumns(cache_mode, self.block_size, self.num_spec, self.num_state_columns, has_mamba)
        self._index = PrefixIndex(BlockPool(int(num_kv_blocks) if has_attention else 0, "KV block"),
                                  BlockPool(int(num_state_slots) if has_mamba else 0, "state slot"),
                                  has_attention=has_attention, has_mamba=has_mamba)
        # The index's pools and entries under the names the checks and the tests read.
        self._kv, self._state, self._entries = self._index.kv, self._index.state, self._index.entries
        self.attention = AttentionManager(self._index, self.block_size, has_attention)
        self.mamba = MambaManager(self._index, self.columns, has_mamba)
        self._reqs: dict[str, RequestBlocks] = {}

    # ------------------------------------------------------------------ public views
    @property
    def _stats(self) -> PrefixCacheStats:
        return self._index.stats

    @property
    def stats(self) -> PrefixCacheStats:
        s = self._stats
        return PrefixCacheStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})

    def reset_stats(self) -> None:
        self._index.stats = PrefixCacheStats()

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
        return self.attention.usage()

    @property
    def state_slot_usage(self) -> float:
        """Fraction of the state pool (null slot excluded) that requests reference; 0 without Mamba."""
        return self.mamba.usage()

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
        return self.columns.write_columns(req.table, req.num_computed, num_total_tokens)

    # ------------------------------------------------------------------ lookup
    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        """The prefix hit ``token_ids`` would get now (no side effects, no stats)."""
        n = len(token_ids)
        hashes = block_hashes(token_ids, self.block_size, max(n - 1, 0) // self.block_size) if self.caching else []
        hit = self._find_hit(hashes)
        return self._hit(hashes, hit, n - hit * self.block_size)

    def _find_hit(self, hashes: list[bytes]) -> int:
        """Number of leading blocks a request can take from the cache (``hashes``: candidate blocks)."""
        return self._index.find_hit(hashes) if self.caching else 0

    def _hit(self, hashes, hit: int, num_new: int) -> PrefixHit:
        kv = tuple(self._entries[h].kv for h in hashes[:hit]) if self.has_attention else ()
        state = self._entries[hashes[hit - 1]].state if hit and self.has_mamba else NULL_ID
        return PrefixHit(hit * self.block_size, num_new, hit, kv, state)

    # ------------------------------------------------------------------ allocation
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

        need_kv = self.attention.num_needed(hit, s)
        cols = list(self.columns.step_columns(c, s))
        if (need_kv > self.attention.num_available(result.kv_block_ids)
                or len(cols) > self.mamba.num_available(result.state_slot)):
            return None

        self.attention.share(result.kv_block_ids)
        table = self.mamba.new_table(hit, result.state_slot)
        kv = list(result.kv_block_ids) + self.attention.take(need_kv)
        self.mamba.fill(table, cols)  # after the KV blocks, as ever: an eviction for one may free the other
        allocated = [j for j, slot in enumerate(table) if slot]
        self._reqs[request_id] = RequestBlocks(
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
        self._kv_list_changed(request_id, kv)
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
        if req is not None and req.num_computed < num_total_tokens <= self.token_capacity.get(request_id, 0):
            return True  # the blocks are there; mode none took every state column at admission
        req = self._req(request_id)
        s = int(num_total_tokens)
        if s > self.max_model_len:
            raise RequestError(f"request {request_id!r}: {s} tokens > max_model_len={self.max_model_len}")
        if s <= req.num_computed:
            raise RequestError(
                f"request {request_id!r}: num_total_tokens={s} must exceed its {req.num_computed} computed tokens"
            )
        need_kv = self.attention.num_needed(len(req.kv), s)
        cols = self.mamba.missing_columns(req.table, req.num_computed, s)
        if not (need_kv or cols):  # most decode steps: everything is in place (no pool to ask)
            return True
        if need_kv > self.attention.num_available() or len(cols) > self.mamba.num_available():
            return False
        if need_kv:
            req.kv += self.attention.take(need_kv)
            self._kv_list_changed(request_id, req.kv)
        self.mamba.fill(req.table, cols)
        if cols:
            req.high_col = max(req.high_col, cols[-1] + 1)
        return True

    def _kv_list_changed(self, request_id: str, kv: list[int]) -> None:
        """The request's KV block list is now ``kv`` (made at admission or grown): what follows it, a plain
        manager's ``token_capacity`` and the block table's ``kv_lists_changed``, follows it here only."""
        if self._plain:
            self.token_capacity[request_id] = self._capacity_of(kv)
        self.kv_lists_changed.add(request_id)

    def _capacity_of(self, kv: list[int]) -> int:
        limit = self.max_model_len
        return min(len(kv) * self.block_size, limit) if self.has_attention else limit

    # ------------------------------------------------------------------ after a step
    def _hashes_upto(self, req: RequestBlocks, num_blocks: int) -> list[bytes]:
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
        if self._plain and not multi_token_decode:
            step = num_scheduled_tokens
            if step is None:  # as many as it computed (the full path raises for an unknown request)
                known = self._reqs.get(request_id)
                step = 0 if known is None else int(num_computed_tokens) - known.num_computed
            if step > 0 and not self._commit_plain((request_id,), (int(num_computed_tokens),), token_ids, int(step)):
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
        missing = self.columns.missing_columns(req.table, s)
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
                self._index.cache_block(hashes[j], req.kv[j] if self.has_attention else NULL_ID, state)
                new_cached += len(self._entries) - before
            req.num_committed_blocks = max(req.num_committed_blocks, n_full)
        req.num_computed = c_new

        accepted = c_new - c_old
        req.num_accepted = accepted if multi_token_decode else 1
        req.prev_last_block = -1
        if self.has_mamba and self.cache_mode != CacheMode.NONE:
            req.low_col, req.prev_last_block = self.columns.after_step(req.table, req.low_col, c_new, s,
                                                                       multi_token_decode, self._state.release)
        return new_cached

    @property
    def plain(self) -> bool:
        """Mode none without caching: a step's commits cache nothing and release nothing, so their order
        does not matter (``commit_decodes`` may take a step's rows together)."""
        return self._plain

    def commit_decode(self, request_id: str, num_computed_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        """``commit`` of a row that computed one token (``num_scheduled_tokens=1``, not a multi-token decode):
        the engine's per-row call on most rows of a step. In mode none without caching, for a step inside
        the blocks the request holds, it is ``_commit_plain`` alone; anything else goes to ``commit``."""
        if self._plain and not self._commit_plain((request_id,), (int(num_computed_tokens),), token_ids, 1):
            return 0
        return self.commit(request_id, num_computed_tokens, token_ids, num_scheduled_tokens=1)

    def commit_decodes(self, request_ids: Sequence[str], num_computed_tokens: Sequence[int]) -> None:
        """``commit_decode`` of many rows (no token ids: for a ``plain`` manager, which hashes none;
        ``num_computed_tokens``: Python ints)."""
        left = self._commit_plain(request_ids, num_computed_tokens, None, 1) if self._plain else \
            zip(request_ids, num_computed_tokens, strict=True)
        for request_id, c_new in left:
            self.commit(request_id, c_new, None, num_scheduled_tokens=1)

    def _commit_plain(self, request_ids: Sequence[str], num_computed_tokens: Sequence[int], token_ids,
                      num_scheduled_tokens: int) -> list[tuple[str, int]]:
        """``commit``'s short path in mode none without caching, for steps that computed the
        ``num_scheduled_tokens`` (> 0) they scheduled inside the blocks the requests hold: what the full path
        does then (nothing to cache, no column to release). Takes many requests (Python int counts), as a
        step's decode rows commit together; returns the ``(request id, count)`` pairs it left unchanged, for
        which the full path must run."""
        # capacity: KV blocks' tokens as allocate_more's short path reads them (min(blocks * block_size,
        # max_model_len), or max_model_len without attention): one dict read a row (most rows of every step).
        get, capacity, left = self._reqs.get, self.token_capacity, []
        for request_id, c_new in zip(request_ids, num_computed_tokens, strict=True):
            req = get(request_id)
            if req is not None and c_new - req.num_computed == num_scheduled_tokens and c_new <= capacity[request_id]:
                if token_ids is not None:
                    req.token_ids = token_ids
                req.num_computed, req.num_accepted, req.prev_last_block = c_new, 1, -1
            else:
                left.append((request_id, c_new))
        return left

    def align_prefill_chunk(self, num_computed_tokens: int, num_tokens: int, num_new_tokens: int) -> int:
        """vLLM's ``_mamba_block_aligned_split``: the tokens a prefill chunk may compute in mode ``align``
        (``MambaColumns.align_prefill_chunk`` says how; other modes return ``num_new_tokens``)."""
        if self.cache_mode != CacheMode.ALIGN or not self.caching:
            return num_new_tokens
        return self.columns.align_prefill_chunk(num_computed_tokens, num_tokens, num_new_tokens,
                                                max_num_batched_tokens=self.max_num_batched_tokens)

    def free(self, request_id: str) -> None:
        """Drop the request's references (finish or preemption); cached ids become evictable, others free.

        Blocks are released tail first so that LRU eviction takes a sequence's
        last blocks before its (more shareable) first ones. Unknown ids are ignored.
        """
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        self.token_capacity.pop(request_id, None)
        self.kv_lists_changed.discard(request_id)  # a re-admission makes a new list (and adds it back)
        self.mamba.free(req.table)
        self.attention.free(req.kv)

    def reset_cache(self) -> bool:
        """Drop every unreferenced cached entry (vLLM's ``reset_prefix_cache``); False if requests hold ids."""
        if self._reqs:
            return False
        self._index.clear()
        return True

    # ------------------------------------------------------------------ checks
    def _req(self, request_id: str) -> RequestBlocks:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise SlotError(f"request {request_id!r} holds no cache blocks") from None

    def check_invariants(self) -> None:
        """Raise ``SlotError`` on any inconsistency (tests call it after every step).

        Pools: no id both free and referenced/evictable, null ids never handed out or cached, free + evictable
        + referenced == total (no leak), and ref counts equal the references the requests hold. Cache: every
        entry points at live ids whose reverse maps point back. Requests: tables have Rule 2's width, no id
        twice, the read column holds a slot, every column / KV block a step may write (from the block of the
        first uncomputed token on) is private (ref 1, not cached): writing a shared or cached slot must never
        happen; a plain manager's ``token_capacity`` is what each request's KV blocks hold.
        """
        self._kv.check()
        self._state.check()
        kv_refs = [0] * max(self._kv.size, 1)
        st_refs = [0] * max(self._state.size, 1)
        for rid, req in self._reqs.items():
            self.attention.check_request(rid, req.kv, req.num_computed, kv_refs)
            self.mamba.check_request(rid, req.table, st_refs)
            if self.has_mamba:
                self.columns.check_table(rid, req.table, req.num_computed, low_col=req.low_col, high_col=req.high_col,
                                         prev_last_block=req.prev_last_block, num_accepted=req.num_accepted,
                                         state_pool=self._state)
        if kv_refs[1:] != self._kv.refs[1:]:
            raise SlotError("KV block reference counts disagree with the requests' block lists")
        if st_refs[1:] != self._state.refs[1:]:
            raise SlotError("state slot reference counts disagree with the requests' Mamba tables")
        if self.token_capacity != ({rid: self._capacity_of(req.kv) for rid, req in self._reqs.items()}
                                   if self._plain else {}):
            raise SlotError("token_capacity disagrees with the requests' KV blocks (allocate_more's short path)")
        self._index.check()
