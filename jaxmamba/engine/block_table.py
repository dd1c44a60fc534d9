"""The attention block table as a persistent device array, updated by the entries that changed.

A step used to send its whole ``int32[R, cdiv(max_model_len, block_size)]`` block table (8 MiB at a
128k context with ``R = 128``), although between two steps a request's row only gains the blocks
allocated since. ``DeviceBlockTable`` keeps one row per running request in a device array that
persists across steps, with a host mirror of exactly what it holds. ``sync(ids, block_lists)`` gives
each request of a step a row (on its first step, or again when its KV block list is a new object: a
re-admission), writes on the device only the ``(row, column, block)`` entries that differ from the
mirror, through a scatter program compiled once at construction (``update_capacity`` entries per
call, called as often as needed), and returns ``row_map``: the persistent row of each batch row.
The step gathers ``table[row_map]`` itself; padding rows map to ``NULL_ROW``, which stays all zeros
(the null KV block, as padded block-table rows always were).

Rows are a fixed pool (``num_rows``, the null row included), so host and device memory never grow
with the requests served. The runner sees only the rows of each step, so a departed request
(finished, preempted, aborted) is noticed lazily: when a new request needs a row and none is free,
the rows of requests that are not in the step and no longer hold KV blocks (``holds``) are freed,
else the least recently used row outside the step. A request that was evicted while still running
simply gets a row again (its whole list is rewritten): correctness never depends on the eviction
order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxmamba.errors import SlotError
from jaxmamba.metadata.checks import cdiv

#: Row of the persistent table that padding batch rows read: never assigned, always zeros.
NULL_ROW = 0


def _scatter(table, updates):
    """``table`` (int32[N, B]) with ``table[updates[0], updates[1]] = updates[2]`` (int32[3, U])."""
    return table.at[updates[0], updates[1]].set(updates[2])


def block_table_rows(max_num_reqs: int) -> int:
    """Rows of the persistent table for steps of up to ``max_num_reqs`` requests: one each, plus ``NULL_ROW``."""
    return max_num_reqs + 1


def block_table_bytes(max_num_reqs: int, max_model_len: int, block_size: int) -> int:
    """Device bytes of the persistent table, ``int32[block_table_rows(max_num_reqs), cdiv(max_model_len,
    block_size)]`` (4 MiB at a 128k context, 128 rows): neither a cache nor a step temporary, so the
    planner subtracts it from the cache budget itself (``jaxmamba.plan``). Replicated under tensor
    parallelism: every rank holds all of it."""
    return block_table_rows(max_num_reqs) * cdiv(max_model_len, block_size) * np.dtype(np.int32).itemsize


def default_update_capacity(max_num_tokens: int, max_num_reqs: int, block_size: int) -> int:
    """Entries one scatter call applies: room for the blocks of a full step (each row's scheduled
    tokens, plus one partial block per row), as a power of two between 64 and 1024. Larger bursts
    (a prefix-cache hit brings its whole prefix at once) take several calls."""
    need = max_num_tokens // block_size + max_num_reqs
    return int(min(1024, max(64, 1 << (need - 1).bit_length())))


class DeviceBlockTable:
    """A persistent ``int32[num_rows, blocks_per_req]`` device block table and its host mirror.

    ``sharding``: where the table lives (a replicated ``NamedSharding`` under tensor parallelism;
    ``None`` for the default device). ``holds(request_id)``: whether a request still holds KV blocks
    (a departed request's row may be reused first).
    """

    def __init__(self, num_rows: int, blocks_per_req: int, *, update_capacity: int, sharding=None,
                 holds: Callable[[str], bool] | None = None):
        if num_rows < 2:
            raise ValueError(f"num_rows={num_rows}: the null row and at least one request row are needed")
        self.num_rows = num_rows
        self.blocks_per_req = blocks_per_req
        self.update_capacity = update_capacity
        self.sharding = sharding
        self._holds = holds
        self.mirror = np.zeros((num_rows, blocks_per_req), np.int32)  # what the device table holds
        table_spec = jax.ShapeDtypeStruct(self.mirror.shape, np.int32, sharding=sharding)
        update_spec = jax.ShapeDtypeStruct((3, update_capacity), np.int32, sharding=sharding)
        # Compiled here, before the engine starts counting compilations: serving only calls it.
        self._scatter = jax.jit(_scatter, donate_argnums=0).lower(table_spec, update_spec).compile()
        self.num_scatter_calls = 0  # over the table's life
        self.last_updates = np.zeros((0, 3), np.int32)  # (row, column, block) written by the last sync
        # Updates are written on the device by whoever runs the step (``flush``): under async scheduling
        # that is the dispatch thread, in step order, so a step never sees a later step's rows.
        self._lock = threading.Lock()
        self._queued: list[tuple[int, np.ndarray]] = []  # (sync number, int32[3, update_capacity])
        self.reset()

    def reset(self) -> None:
        """Forget every row and upload a zero table (after a fault that may have lost the device table)."""
        self.mirror[:] = 0
        with self._lock:
            self._queued = []
            # A fresh host array: on the CPU device_put may alias it, and the mirror changes before the device does.
            self._array = jax.device_put(np.zeros_like(self.mirror), self.sharding)
        self._row_of: dict[str, int] = {}  # request id -> its row
        self._owner: list[str | None] = [None] * self.num_rows
        self._list: list[list[int] | None] = [None] * self.num_rows  # the KV block list a row was written from
        # Leading entries of its list the row holds; past them the row is zeros (kept when a row is freed).
        # Python lists, not numpy: sync reads and writes them once per batch row.
        self._synced = [0] * self.num_rows
        self._last_used = [0] * self.num_rows  # sync count when the row was last in a step
        self._free = list(range(self.num_rows - 1, NULL_ROW, -1))  # popped from the end: lowest row first
        self._syncs = 0

    def row_of(self, request_id: str) -> int | None:
        return self._row_of.get(request_id)

    def release(self, request_id: str) -> None:
        """Free the request's row (its entries stay in place until the row is rewritten)."""
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._owner[row], self._list[row] = None, None
            self._free.append(row)

    def sync(self, ids: Sequence[str], block_lists: Sequence[list[int]]) -> np.ndarray:
        """Make the device rows of ``ids`` hold ``block_lists`` (each request's KV block ids, the
        manager's own lists: they only grow while a request runs). Returns ``row_map`` (int32[len(ids)]).

        Raises ``SlotError`` naming a request that holds more than ``blocks_per_req`` blocks, before
        anything changes."""
        if len(ids) >= self.num_rows:
            raise SlotError(f"a step of {len(ids)} requests needs more than the {self.num_rows - 1} block-table rows")
        for rid, blocks in zip(ids, block_lists):
            if len(blocks) > self.blocks_per_req:
                raise SlotError(f"request {rid!r} holds {len(blocks)} KV blocks, more than {self.blocks_per_req}")
        self._syncs += 1
        in_step = set(ids)
        row_map = np.empty(len(ids), np.int32)
        rows, cols, vals = [], [], []
        for i, (rid, blocks) in enumerate(zip(ids, block_lists)):
            row = self._row_of.get(rid)
            if row is None:
                row = self._take_row(in_step)
                self._row_of[rid], self._owner[row] = row, rid
            if self._list[row] is not blocks:  # a new row or a re-admission: rewrite it where it differs
                width = max(len(blocks), self._synced[row])  # past _synced[row] the row is zeros
                target = np.zeros(width, np.int32)
                target[: len(blocks)] = blocks
                changed = np.flatnonzero(self.mirror[row, :width] != target)
                rows.append(np.full(changed.size, row, np.int32))
                cols.append(changed.astype(np.int32))
                vals.append(target[changed])
                self._list[row] = blocks
            else:
                start = self._synced[row]
                if len(blocks) > start:
                    rows.append(np.full(len(blocks) - start, row, np.int32))
                    cols.append(np.arange(start, len(blocks), dtype=np.int32))
                    vals.append(np.asarray(blocks[start:], np.int32))
            self._synced[row] = len(blocks)
            self._last_used[row] = self._syncs
            row_map[i] = row
        updates = (np.stack([np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)], axis=1)
                   if rows else np.zeros((0, 3), np.int32))
        self._apply(updates)
        return row_map

    def _take_row(self, in_step: set[str]) -> int:
        if not self._free:
            candidates = [row for row in range(NULL_ROW + 1, self.num_rows) if self._owner[row] not in in_step]
            departed = [row for row in candidates if self._holds is not None and not self._holds(self._owner[row])]
            for row in departed or [min(candidates, key=lambda r: self._last_used[r])]:
                self.release(self._owner[row])
        return self._free.pop()

    @property
    def ticket(self) -> int:
        """The number of the last ``sync``: ``flush(ticket)`` writes that step's updates and those before."""
        return self._syncs

    @property
    def array(self) -> jax.Array:
        """The device table with every update so far written (``flush`` of the last sync)."""
        return self.flush(self._syncs)

    def flush(self, ticket: int) -> jax.Array:
        """Write the queued updates of syncs up to ``ticket`` on the device and return the table; the
        table is donated to each scatter, so callers run steps in the order they synced them."""
        with self._lock:
            try:
                while self._queued and self._queued[0][0] <= ticket:
                    _, padded = self._queued.pop(0)
                    self._array = self._scatter(self._array, jax.device_put(padded, self.sharding))
            except BaseException:
                # The table was donated to a call that may not have run: the engine resets it (its
                # recovery re-allocates the caches and re-queues the requests).
                self._queued = []
                raise
            return self._array

    def _apply(self, updates: np.ndarray) -> None:
        """Write ``updates`` (int32[k, 3] rows of (row, column, block)) to the mirror and queue them for the
        device table, ``update_capacity`` per scatter call; unused entries rewrite the null row's first zero."""
        self.last_updates = updates
        if not len(updates):
            return
        self.mirror[updates[:, 0], updates[:, 1]] = updates[:, 2]
        with self._lock:
            for start in range(0, len(updates), self.update_capacity):
                chunk = updates[start : start + self.update_capacity]
                padded = np.zeros((3, self.update_capacity), np.int32)
                padded[:, : len(chunk)] = chunk.T
                self._queued.append((self._syncs, padded))
                self.num_scatter_calls += 1
