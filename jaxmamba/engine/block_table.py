"""Persistent device tables updated by the entries that changed: the attention block table and the
Mamba state-index table.

``DeviceTable`` is one table (device array, host mirror, scatter programs); ``DeviceBlockTable`` adds the
fixed pool of rows and returns ``row_map``, each batch row's persistent row. Design:
docs/architecture.md, "Persistent device tables".
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxmamba.compile_cache import build_one
from jaxmamba.errors import SlotError
from jaxmamba.metadata.checks import cdiv
from jaxmamba.metadata.mamba_builder import mamba_block_table_columns
from jaxmamba.parallel.distributed import call_arguments, device_put_global

#: Row of the persistent table that padding batch rows read: never assigned, always zeros.
NULL_ROW = 0
#: Candidate entries a write compares one by one in Python (more: with numpy, ``DeviceTable._changed_entries``).
_SMALL_SPANS = 64
# ``DeviceBlockTable``'s row map of no sync (read-only): every release forgets the last sync, a few times a step.
_NO_ROWS = np.zeros(0, np.int32)
_NO_ROWS.flags.writeable = False
#: A table of at most this many bytes is sent whole, as a step argument, after a write that changed it (no
#: scatter program: a call of one costs more host time than passing a small array with the step's other inputs;
#: docs/architecture.md, "Persistent device tables"). 32 KiB: 128 rows of 64 blocks.
WHOLE_TABLE_BYTES = 32 * 1024


def _scatter(table, updates):
    """``table`` (int32[N, B]) with ``table[updates[0], updates[1]] = updates[2]`` (int32[3, U])."""
    return table.at[updates[0], updates[1]].set(updates[2])


def copy_of_table_argument(table):
    """A copy of a table as ``DeviceTable.flush`` handed it to a step, of the same kind and placement (a numpy
    array where the table is sent whole on one device, else a device array): for replaying a captured step
    after later writes changed the table."""
    if isinstance(table, np.ndarray):
        return table.copy()
    return jax.device_put(np.array(table), table.sharding)


def update_capacity_ladder(update_capacity: int) -> tuple[int, ...]:
    """Entries of the scatter programs a table compiles: ``16, 64, 256, ...`` below ``update_capacity``, then
    ``update_capacity``. A step's updates are sent in the smallest program that holds them (full calls of the
    largest first), so a step that changes a few entries sends ``int32[3, 16]``, not ``int32[3, capacity]``."""
    return tuple(c for c in (16, 64, 256) if c < update_capacity) + (update_capacity,)


def block_table_rows(max_num_reqs: int) -> int:
    """Rows of the persistent table for steps of up to ``max_num_reqs`` requests: one each, plus ``NULL_ROW``."""
    return max_num_reqs + 1


def block_table_bytes(max_num_reqs: int, max_model_len: int, block_size: int) -> int:
    """Device bytes of the persistent table, ``int32[block_table_rows(max_num_reqs), cdiv(max_model_len,
    block_size)]`` (4 MiB at a 128k context, 128 rows): neither a cache nor a step temporary, so the
    planner subtracts it from the cache budget itself (``jaxmamba.plan``). Replicated under tensor
    parallelism: every rank holds all of it."""
    return block_table_rows(max_num_reqs) * cdiv(max_model_len, block_size) * np.dtype(np.int32).itemsize


def device_tables_bytes(max_num_reqs: int, max_model_len: int, block_size: int, cache_mode: str,
                        num_spec: int = 0) -> int:
    """Device bytes of both persistent tables on the same rows: the block table (``block_table_bytes``) and
    the Mamba state-index table, ``int32[rows, mamba_block_table_columns(...)]`` (``1 + num_spec``
    columns in mode ``none``; as wide as the block table plus ``num_spec`` in ``align``/``all``). The
    planner subtracts them from the cache budget; replicated under tensor parallelism."""
    state_columns = mamba_block_table_columns(cache_mode, max_model_len, block_size, num_spec)
    state_bytes = block_table_rows(max_num_reqs) * state_columns * np.dtype(np.int32).itemsize
    return block_table_bytes(max_num_reqs, max_model_len, block_size) + state_bytes


def default_update_capacity(max_num_tokens: int, max_num_reqs: int, block_size: int) -> int:
    """Entries one scatter call applies: room for the blocks of a full step (each row's scheduled
    tokens, plus one partial block per row), as a power of two between 64 and 1024. Larger bursts
    (a prefix-cache hit brings its whole prefix at once) take several calls."""
    need = max_num_tokens // block_size + max_num_reqs
    return int(min(1024, max(64, 1 << (need - 1).bit_length())))


class DeviceTable:
    """A persistent ``int32[num_rows, num_columns]`` device table and its host mirror, written by rows.

    ``write_rows(ids, row_map, lists, windows)`` makes rows ``row_map`` hold ``lists`` (per-request Python
    lists, the cache manager's own, read never modified) and queues the ``(row, column, value)`` entries
    that differ from the mirror; ``flush(ticket)`` writes them on the device. A row remembers the list it
    was last written from; a different list (a new request in the row, a re-admission) is diffed whole.
    The same list is re-read in one of two ways:

    * growing lists (``windows=None``: attention KV blocks): entries are only appended, so only the
      entries past the last write are new (a row whose list did not grow costs no numpy call);
    * windowed lists (``windows[i] = (lo, hi)``: the list is zero outside ``[lo, hi)`` and may change in
      place inside it, Mamba state slots): the union of that window and the row's last one is compared
      (a row whose window and entries did not change costs one short list comparison).

    ``sharding``: where the table lives (a replicated ``NamedSharding`` under tensor parallelism; ``None``
    for the default device). ``value_limit``: entries must be in ``[0, value_limit)`` (``SlotError``
    otherwise, before anything changes; ``None``: unchecked). ``entry_name`` names the entries in errors.
    ``executable_cache``: a ``compile_cache.ExecutableCache`` the scatter programs are restored from (and kept
    in), so that a warm start compiles none of them. ``whole_table_bytes`` (default ``WHOLE_TABLE_BYTES``): a
    table whose mirror is at most this large is sent whole instead (``sends_whole``): each write that changed
    it queues a read-only copy of the mirror, and ``flush`` returns the latest one due, as a step argument
    (placed on ``sharding`` where one is given); no scatter program is built.
    """

    def __init__(self, num_rows: int, num_columns: int, *, update_capacity: int, sharding=None,
                 value_limit: int | None = None, entry_name: str = "entries", executable_cache=None,
                 whole_table_bytes: int | None = None):
        if num_rows < 2:
            raise ValueError(f"num_rows={num_rows}: the null row and at least one request row are needed")
        self.num_rows = num_rows
        self.num_columns = num_columns
        self.update_capacity = update_capacity
        self.sharding = sharding
        self.value_limit = value_limit
        self.entry_name = entry_name
        self.mirror = np.zeros((num_rows, num_columns), np.int32)  # what the device table holds
        limit = WHOLE_TABLE_BYTES if whole_table_bytes is None else whole_table_bytes
        self.sends_whole = self.mirror.nbytes <= limit
        table_spec = jax.ShapeDtypeStruct(self.mirror.shape, np.int32, sharding=sharding)
        # Built here, before the engine starts counting compilations: serving only calls them. Restored from the
        # executable cache where it holds them (a single-device table's: a mesh's are not serialised).
        cache = executable_cache if sharding is None else None
        self._scatters = {
            capacity: build_one(functools.partial(jax.jit(_scatter, donate_argnums=0).lower, table_spec,
                                                  jax.ShapeDtypeStruct((3, capacity), np.int32, sharding=sharding)),
                                cache=cache, description={"program": "device_table_scatter",
                                                          "table": self.mirror.shape, "capacity": capacity})
            for capacity in ([] if self.sends_whole else update_capacity_ladder(update_capacity))}
        self._ladder = sorted(self._scatters)  # _apply picks the smallest program that holds a chunk
        self.num_scatter_calls = 0  # over the table's life
        self.num_update_bytes = 0  # bytes of the update arrays (or whole tables) sent to the device, over its life
        # The last write's entries: (rows, columns, values) lists or an int32[k, 3] array (``last_updates``)
        self._last_entries: tuple[list[int], list[int], list[int]] | np.ndarray = ([], [], [])
        # Updates are written on the device by whoever runs the step (``flush``): under async scheduling
        # that is the dispatch thread, in step order, so a step never sees a later step's rows. The lock
        # orders flushes (and reset) only: the writer appends to the deque without it, as the dispatch
        # thread holds it for a whole scatter call and an engine thread waiting on it cost ~30 us a write.
        self._lock = threading.Lock()
        # (write number, int32[3, capacity] updates), or with sends_whole (write number, the mirror after that write)
        self._queued: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self.reset()

    def reset(self) -> None:
        """Forget every row and upload a zero table (after a fault that may have lost the device table)."""
        self.mirror[:] = 0
        with self._lock:
            self._queued = collections.deque()
            # A fresh host array: on the CPU device_put may alias it, and the mirror changes before the device does.
            zeros = np.zeros_like(self.mirror)
            if self.sends_whole:
                zeros.flags.writeable = False
                self._array = call_arguments(zeros, self.sharding)
            else:
                self._array = device_put_global(zeros, self.sharding)
        self._list: list[list[int] | None] = [None] * self.num_rows  # the list a row was last written from
        # The mirror row is zero outside [_lo, _hi) (kept when a row changes hands). Python lists, not numpy:
        # write_rows reads and writes them once per batch row.
        self._lo = [0] * self.num_rows
        self._hi = [0] * self.num_rows
        self._seen: list[list[int] | None] = [None] * self.num_rows  # windowed rows: the list's [_lo, _hi)
        self._syncs = 0
        #: The batch rows (indices into the last write's ``ids``) written from another list than the one their
        #: table row held: a request new to the row, or a new admission of the same one. Every other row of
        #: that write held the same list object as before.
        self.new_lists: list[int] = []

    def check_lengths(self, ids: Sequence[str], lists: Sequence[list[int]]) -> None:
        """``SlotError`` naming the first request whose list is longer than the table is wide."""
        if len(ids) == len(lists) and (not lists or max(map(len, lists)) <= self.num_columns):
            return
        for rid, entries in zip(ids, lists, strict=True):
            if len(entries) > self.num_columns:
                raise SlotError(f"request {rid!r} holds {len(entries)} {self.entry_name}, more than {self.num_columns}")

    def write_rows(self, ids: Sequence[str], row_map: np.ndarray, lists: Sequence[list[int]],
                   windows: Sequence[tuple[int, int]] | None = None) -> None:
        """Make rows ``row_map`` (int32[len(ids)], distinct, never ``NULL_ROW``) hold ``lists`` (see the
        class: growing lists, or windowed ones with ``windows``, ``lo <= hi``). Raises ``SlotError`` naming the request
        of a list longer than the table or of an entry outside ``[0, value_limit)``, before anything changes."""
        self.check_lengths(ids, lists)
        self._write_checked_rows(ids, row_map.tolist(), lists, windows)

    def _write_checked_rows(self, ids: Sequence[str], row_list: list[int], lists: Sequence[list[int]],
                            windows: Sequence[tuple[int, int]] | None) -> None:
        """``write_rows`` once ``check_lengths`` has passed, ``row_map`` as a list."""
        last, los, his, seens = self._list, self._lo, self._hi, self._seen
        if windows is None:
            # Growing lists: the rows whose list is another one or grew (most steps: the few rows that took a
            # block), found in one pass; every other row costs this comparison only.
            todo = [i for i, (row, entries) in enumerate(zip(row_list, lists, strict=True))
                    if last[row] is not entries or len(entries) != his[row]]
        else:
            todo = range(len(row_list))
        # Each changed row's candidate span [start, end) of columns and the values it must hold there, gathered
        # for all rows at once: the spans are compared with the mirror in one numpy pass (_changed_entries).
        spans: list[tuple[int, int, int, int]] = []  # (batch row, table row, first column, width)
        values: list[int] = []
        written = []
        new_lists = []
        for i in todo:
            row, entries = row_list[i], lists[i]
            lo, hi = los[row], his[row]
            same = last[row] is entries
            if not same:
                new_lists.append(i)
            if windows is None:
                # A list that shrank (never, from the cache manager) is diffed whole, as a new one.
                start, end = (hi, len(entries)) if same and len(entries) > hi else (0, max(len(entries), hi))
                new_lo, new_hi, seen = 0, len(entries), None
            else:
                new_lo, new_hi = windows[i]
                seen = entries[new_lo:new_hi]
                if same and (new_lo, new_hi) == (lo, hi) and seen == seens[row]:
                    continue  # nothing changed in place
                # Outside both windows the list and the mirror row are zero.
                start, end = (min(new_lo, lo), max(new_hi, hi)) if lo < hi else (new_lo, new_hi)
            part = entries[start:end]
            values += part
            if len(part) < end - start:
                values += [0] * (end - start - len(part))
            spans.append((i, row, start, end - start))
            written.append((row, entries, new_lo, new_hi, seen))
        small = len(values) <= _SMALL_SPANS
        changed = (self._changed_entries_small if small else self._changed_entries)(ids, spans, values)
        self._syncs += 1
        for row, entries, lo, hi, seen in written:
            last[row], los[row], his[row], seens[row] = entries, lo, hi, seen
        self.new_lists = new_lists
        if small:
            self._apply_small(*changed)
        else:
            self._apply(changed)

    def _changed_entries(self, ids: Sequence[str], spans: list[tuple[int, int, int, int]],
                         values: list[int]) -> np.ndarray:
        """The ``(row, column, value)`` entries (int32[k, 3], spans in order, columns ascending) where the mirror
        differs from ``values`` (the spans' target values, concatenated); ``spans``: ``(batch row, table row,
        first column, width)``. ``SlotError`` naming the request of the first changed entry outside
        ``[0, value_limit)``."""
        batch_rows, table_rows, starts, widths = np.array(spans, np.int64).reshape(-1, 4).T
        target = np.array(values, np.int32)
        rows = np.repeat(table_rows, widths)
        # Column of each candidate: its span's first column plus its place in the span.
        cols = np.arange(target.size) - np.repeat(np.cumsum(widths) - widths - starts, widths)
        changed = np.flatnonzero(self.mirror[rows, cols] != target)
        updates = np.stack([rows[changed], cols[changed], target[changed]], axis=1).astype(np.int32)
        limit = self.value_limit
        if limit is not None and updates.size and (updates[:, 2].min() < 0 or updates[:, 2].max() >= limit):
            bad = int(np.flatnonzero((updates[:, 2] < 0) | (updates[:, 2] >= limit))[0])
            i = int(batch_rows[np.searchsorted(np.cumsum(widths), changed[bad], side="right")])
            raise SlotError(f"request {ids[i]!r}: {self.entry_name} entry {int(updates[bad, 2])} (column "
                            f"{int(updates[bad, 1])}) is outside [0, {limit})")
        return updates

    def _changed_entries_small(self, ids: Sequence[str], spans: list[tuple[int, int, int, int]],
                               values: list[int]) -> tuple[list[int], list[int], list[int]]:
        """``_changed_entries`` entry by entry, as three lists (rows, columns, values): a usual step changes a few
        entries (a block appended to a few rows), fewer than the numpy calls of the vectorised comparison
        would cost."""
        read, limit = self.mirror.item, self.value_limit
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        k = 0
        for i, row, start, width in spans:
            for col in range(start, start + width):
                value = values[k]
                k += 1
                if read(row, col) != value:
                    if limit is not None and not 0 <= value < limit:
                        raise SlotError(f"request {ids[i]!r}: {self.entry_name} entry {value} (column {col}) is "
                                        f"outside [0, {limit})")
                    rows.append(row)
                    cols.append(col)
                    vals.append(value)
        return rows, cols, vals

    @property
    def last_updates(self) -> np.ndarray:
        """int32[k, 3]: the (row, column, value) entries the last write changed."""
        entries = self._last_entries
        return entries if isinstance(entries, np.ndarray) else np.array(entries, np.int32).reshape(3, -1).T

    def written_from(self, row: int) -> list[int] | None:
        """The list row ``row`` was last written from (None: none since it was last forgotten)."""
        return self._list[row]

    def forget_row(self, row: int) -> None:
        """The row changes hands: its next write diffs it whole (its entries stay until then)."""
        self._list[row] = self._seen[row] = None

    @property
    def ticket(self) -> int:
        """The number of the last write: ``flush(ticket)`` writes that step's updates and those before."""
        return self._syncs

    @property
    def array(self) -> jax.Array | np.ndarray:
        """The device table with every update so far written (``flush`` of the last write)."""
        return self.flush(self._syncs)

    def flush(self, ticket: int) -> jax.Array | np.ndarray:
        """Write the queued updates of writes up to ``ticket`` on the device and return the table; the
        table is donated to each scatter, so callers run steps in the order they wrote them. With
        ``sends_whole``: the mirror as that write left it (a read-only numpy array on one device, which the step
        call places with its other inputs; the table placed on ``sharding`` where one is given)."""
        with self._lock:
            try:
                if self.sends_whole:
                    latest = None
                    while self._queued and self._queued[0][0] <= ticket:
                        latest = self._queued.popleft()[1]
                    if latest is not None:
                        self._array = call_arguments(latest, self.sharding)
                while self._queued and self._queued[0][0] <= ticket:
                    _, padded = self._queued.popleft()
                    self._array = self._scatters[padded.shape[1]](self._array, call_arguments(padded, self.sharding))
            except BaseException:
                # The table was donated to a call that may not have run: the engine resets it (its
                # recovery re-allocates the caches and re-queues the requests).
                self._queued.clear()
                raise
            return self._array

    def _apply_small(self, rows: list[int], cols: list[int], vals: list[int]) -> None:
        """``_apply`` of entries given as lists (more than ``update_capacity``: ``_apply`` itself): the mirror
        written entry by entry and the update array made in one call. A step's few changed entries cost less
        this way than numpy's fancy-index write and the array shuffles of ``_apply``, whose code a step's other
        work leaves out of the CPU's caches (docs/architecture.md, "Persistent device tables")."""
        num_updates = len(rows)
        if not num_updates:
            self._last_entries = ([], [], [])
            return
        if num_updates > self.update_capacity:  # several scatter calls: the general path
            self._apply(np.array((rows, cols, vals), np.int32).T)
            return
        mirror = self.mirror
        for row, col, value in zip(rows, cols, vals, strict=True):
            mirror[row, col] = value
        if self.sends_whole:
            self._last_entries = (rows, cols, vals)  # an array only when asked (tests and benches ask)
            self._queue_whole()
            return
        capacity = self._ladder[bisect.bisect_left(self._ladder, num_updates)]
        pad = [0] * (capacity - num_updates)
        padded = np.array((rows + pad, cols + pad, vals + pad), np.int32)
        self._last_entries = padded[:, :num_updates].T
        self.num_update_bytes += padded.nbytes
        self.num_scatter_calls += 1
        self._queued.append((self._syncs, padded))

    def _apply(self, updates: np.ndarray) -> None:
        """Write ``updates`` (int32[k, 3] rows of (row, column, value)) to the mirror and queue them for the
        device table: full calls of the largest scatter program, the rest in the smallest that holds it;
        unused entries rewrite the null row's first zero."""
        self._last_entries = updates
        num_updates = len(updates)
        if not num_updates:
            return
        rows, cols, values = updates.T
        self.mirror[rows, cols] = values
        if self.sends_whole:
            self._queue_whole()
            return
        calls = []
        for start in range(0, num_updates, self.update_capacity):
            width = min(num_updates - start, self.update_capacity)
            capacity = self._ladder[bisect.bisect_left(self._ladder, width)]
            padded = np.zeros((3, capacity), np.int32)
            padded[:, :width] = updates[start : start + width].T
            calls.append((self._syncs, padded))
            self.num_update_bytes += padded.nbytes
        self.num_scatter_calls += len(calls)
        self._queued.extend(calls)  # one deque call: atomic against flush's popleft

    def _queue_whole(self) -> None:
        """Queue the mirror as this write left it (``sends_whole``)."""
        snapshot = self.mirror.copy()
        snapshot.flags.writeable = False  # the CPU device may read it in place while a step runs
        self.num_update_bytes += snapshot.nbytes
        self._queued.append((self._syncs, snapshot))


class DeviceBlockTable(DeviceTable):
    """A persistent ``int32[num_rows, blocks_per_req]`` device block table, its host mirror and its row pool.

    ``sharding``: where the table lives (a replicated ``NamedSharding`` under tensor parallelism;
    ``None`` for the default device). ``holds(request_id)``: whether a request still holds KV blocks
    (a departed request's row may be reused first).
    """

    def __init__(self, num_rows: int, blocks_per_req: int, *, update_capacity: int, sharding=None,
                 holds: Callable[[str], bool] | None = None, executable_cache=None,
                 whole_table_bytes: int | None = None):
        self._holds = holds
        super().__init__(num_rows, blocks_per_req, update_capacity=update_capacity, sharding=sharding,
                         entry_name="KV blocks", executable_cache=executable_cache,
                         whole_table_bytes=whole_table_bytes)

    @property
    def blocks_per_req(self) -> int:
        return self.num_columns

    def reset(self) -> None:
        """Forget every row and upload a zero table (after a fault that may have lost the device table)."""
        super().reset()
        self._row_of: dict[str, int] = {}  # request id -> its row
        self._owner: list[str | None] = [None] * self.num_rows
        self._last_used = np.zeros(self.num_rows, np.int64)  # write number when the row was last in a step
        self._free = list(range(self.num_rows - 1, NULL_ROW, -1))  # popped from the end: lowest row first
        self._forget_last_sync()

    def _forget_last_sync(self) -> None:
        # The last sync's ids (a copy), their rows (list) and row_map (read-only int32), and its id -> batch row
        # map once built: a sync of the same ids in the same order (the steady state of decoding) reuses them,
        # as each of those requests still holds its row (rows change hands only in a sync of other ids).
        self._last_ids: list[str] | None = None
        self._last_rows: list[int] = []
        self._last_row_map = _NO_ROWS
        self._last_position: dict[str, int] | None = None

    def row_of(self, request_id: str) -> int | None:
        return self._row_of.get(request_id)

    def release(self, request_id: str) -> None:
        """Free the request's row (its entries stay in place until the row is rewritten)."""
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._forget_last_sync()
            self._owner[row] = None
            self.forget_row(row)
            self._free.append(row)

    def sync(self, ids: Sequence[str], block_lists: Sequence[list[int]]) -> np.ndarray:
        """Make the device rows of ``ids`` hold ``block_lists`` (each request's KV block ids, the
        manager's own lists: they only grow while a request runs). Returns ``row_map`` (int32[len(ids)],
        read-only: a sync of the same ids in the same order returns the same array), the rows other tables of
        the step (``DeviceTable.write_rows``) use too.

        Raises ``SlotError`` naming a request that holds more than ``blocks_per_req`` blocks, before
        anything changes."""
        lists_of = dict(zip(ids, block_lists, strict=True))
        return self.sync_changed(ids, set(ids), lambda todo: [lists_of[rid] for rid in todo])

    def sync_changed(self, ids: Sequence[str], changed: set[str],
                     block_lists: Callable[[list[str]], list[list[int]]]) -> np.ndarray:
        """``sync`` for a manager that names the requests whose lists changed: ``changed`` holds every request
        whose list was made or grew since its row was last written (others hold the very list, as long, that
        their row was written from; ``PrefixCacheManager.kv_lists_changed``), ``block_lists(ids)`` returns the
        lists of ``ids``. Only those rows and rows new to the table are read, so a step's cost follows the
        rows that took blocks, not its batch; the ids written leave ``changed``. Same ``row_map``, entries and
        ``new_lists`` as ``sync``; ``ModelRunner.check_tables`` holds the rows to the manager's lists."""
        if len(ids) >= self.num_rows:
            raise SlotError(f"a step of {len(ids)} requests needs more than the {self.num_rows - 1} block-table rows")
        # The last sync's requests in its order (decoding's steady state): the same rows, none to find or take.
        same = ids == self._last_ids
        if same:
            rows, new_rows, position = self._last_rows, [], self._last_position
        else:
            rows, position = list(map(self._row_of.get, ids)), None
            new_rows = []  # requests new to the table (list.index: a few a step, found without a Python loop)
            with contextlib.suppress(ValueError):
                while True:
                    new_rows.append(rows.index(None, new_rows[-1] + 1 if new_rows else 0))
        todo = set(new_rows)
        if changed:
            if position is None:
                position = dict(zip(ids, range(len(ids)), strict=True))
            todo.update(position[rid] for rid in changed if rid in position)
        todo = sorted(todo)  # batch order, as sync writes them
        todo_ids = [ids[i] for i in todo]
        lists = block_lists(todo_ids)
        self.check_lengths(todo_ids, lists)  # before anything changes
        for i in new_rows:  # one still in this step is never evicted
            rows[i] = row = self._take_row(ids)
            self._row_of[ids[i]], self._owner[row] = row, ids[i]
        self._write_checked_rows(todo_ids, [rows[i] for i in todo], lists, None)
        self.new_lists = [todo[j] for j in self.new_lists]  # batch rows of ``ids``, not of ``todo_ids``
        changed.difference_update(todo_ids)
        if same:
            row_map = self._last_row_map
        else:
            row_map = np.array(rows, np.int32)
            row_map.flags.writeable = False  # the next sync of the same ids returns it again
            self._last_ids, self._last_rows, self._last_row_map = list(ids), rows, row_map
        self._last_position = position
        self._last_used.put(row_map, self._syncs)
        return row_map

    def _take_row(self, ids: Sequence[str]) -> int:
        """A free row; when none is left, the rows of departed requests are freed (else the least recently
        used row of a request outside ``ids``, the step's requests)."""
        if not self._free:
            in_step = set(ids)
            candidates = [row for row in range(NULL_ROW + 1, self.num_rows) if self._owner[row] not in in_step]
            departed = [row for row in candidates if self._holds is not None and not self._holds(self._owner[row])]
            for row in departed or [min(candidates, key=lambda r: self._last_used[r])]:
                self.release(self._owner[row])
        return self._free.pop()
