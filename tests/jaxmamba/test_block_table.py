"""The persistent device block table (docs/architecture.md, "Persistent device tables"): a step sends
only the entries that changed.

``DeviceBlockTable`` alone (rows, updates, the scatter program), then inside the engine: at every step
of a run with admissions, growth, preemption, finishes and re-admissions, the device table gathered by
the step's ``row_map`` equals the block table the host would have sent whole, and the entries written
are exactly the ones that changed.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams, random_model
from jaxmamba.engine.block_table import NULL_ROW, DeviceBlockTable, default_update_capacity
from jaxmamba.errors import SlotError
from jaxmamba.steps import _CompileCounter

B = 6  # blocks per request


def _host_table(block_lists, width=B):
    table = np.zeros((len(block_lists), width), np.int32)
    for i, blocks in enumerate(block_lists):
        table[i, : len(blocks)] = blocks
    return table


def _check(table: DeviceBlockTable, row_map, block_lists):
    device = np.array(table.array)
    np.testing.assert_array_equal(device, table.mirror)
    np.testing.assert_array_equal(device[row_map], _host_table(block_lists))
    assert not device[NULL_ROW].any(), "padding rows read the null row: it stays zeros"


def _updates(table):
    return {tuple(int(v) for v in u) for u in table.last_updates}


def test_a_step_writes_only_the_entries_that_changed(table_diff, table_upload):
    live = {"a", "b", "c"}
    table = DeviceBlockTable(4, B, update_capacity=8, holds=live.__contains__)
    a, b = [3, 4], [7]
    row_map = table.sync(["a", "b"], [a, b])
    ra, rb = (int(r) for r in row_map)
    assert NULL_ROW not in (ra, rb) and ra != rb
    assert _updates(table) == {(ra, 0, 3), (ra, 1, 4), (rb, 0, 7)}
    _check(table, row_map, [a, b])

    # Growth: only the new blocks travel; rows keep their place whatever the batch order.
    a.append(9)
    row_map = table.sync(["b", "a"], [b, a])
    assert list(row_map) == [rb, ra] and _updates(table) == {(ra, 2, 9)}
    _check(table, row_map, [b, a])

    # Nothing allocated: nothing sent, no scatter call.
    calls = table.num_scatter_calls
    row_map = table.sync(["a", "b"], [a, b])
    assert _updates(table) == set() and table.num_scatter_calls == calls
    _check(table, row_map, [a, b])

    # Re-admission (a new list object: preempted and recomputed): the row is rewritten where it
    # differs, its stale tail cleared.
    a = [3, 11]
    row_map = table.sync(["a"], [a])
    assert int(row_map[0]) == ra and _updates(table) == {(ra, 1, 11), (ra, 2, 0)}
    _check(table, row_map, [a])

    # A new request while a row is free takes it; once rows run out, a departed request's row is reused.
    c = [5, 6, 8]
    row_map = table.sync(["c", "a"], [c, a])
    rc = int(row_map[0])
    assert rc not in (NULL_ROW, ra, rb)
    live.discard("b")  # b finished
    d = [2]
    row_map = table.sync(["d", "a", "c"], [d, a, c])
    assert int(row_map[0]) == rb and table.row_of("b") is None
    assert _updates(table) == {(rb, 0, 2)}  # b's one block is overwritten, nothing else
    _check(table, row_map, [d, a, c])

    # No departed request: the least recently used row outside the step goes; its owner, still
    # running, gets a row again and is rewritten whole.
    live.add("e")
    e = [1, 10, 12, 13]
    row_map = table.sync(["e", "d", "a"], [e, d, a])
    assert int(row_map[0]) == rc and table.row_of("c") is None
    _check(table, row_map, [e, d, a])
    row_map = table.sync(["c", "a", "e"], [c, a, e])
    assert int(row_map[0]) == rb and table.row_of("d") is None  # d holds no blocks: departed
    _check(table, row_map, [c, a, e])


def test_more_updates_than_the_capacity_take_several_calls(table_diff):
    """A prefix-cache hit brings many blocks at once: the scatter program (4 entries) runs as often as needed."""
    table = DeviceBlockTable(3, 12, update_capacity=4, whole_table_bytes=0)
    long, short = list(range(1, 12)), [20]
    calls = table.num_scatter_calls
    row_map = table.sync(["x", "y"], [long, short])
    assert len(table.last_updates) == 12 and table.num_scatter_calls - calls == 3
    np.testing.assert_array_equal(np.array(table.array)[row_map], _host_table([long, short], 12))


def test_too_many_blocks_is_refused_naming_the_request_before_anything_changes(table_upload):
    table = DeviceBlockTable(3, B, update_capacity=8)
    row_map = table.sync(["ok"], [[1, 2]])
    with pytest.raises(SlotError, match=r"request 'big' holds 7 KV blocks, more than 6"):
        table.sync(["ok", "big"], [[1, 2, 3], list(range(1, 8))])
    assert table.row_of("big") is None
    _check(table, row_map, [[1, 2]])
    with pytest.raises(SlotError, match="block-table rows"):
        table.sync(["p", "q", "r"], [[1], [2], [3]])


def test_sync_changed_reads_only_new_rows_and_the_lists_named_changed(table_diff, table_upload):
    """The runner's path: the cache manager names the requests whose lists it made or grew
    (``kv_lists_changed``); the table reads those and rows new to it, and leaves every other row as
    written (it trusts the name: a list grown unnamed is not seen, which is why the manager must name it).
    The ids written leave the set; a named request outside the step stays named."""
    table = DeviceBlockTable(5, B, update_capacity=8)
    lists = {"a": [3], "b": [7], "c": [5]}
    asked = []

    def lists_of(ids):
        asked.append(list(ids))
        return [lists[rid] for rid in ids]

    changed = {"a", "b", "c"}
    row_map = table.sync_changed(["a", "b"], changed, lists_of)
    ra, rb = (int(r) for r in row_map)
    assert asked == [["a", "b"]] and changed == {"c"} and table.new_lists == [0, 1]
    _check(table, row_map, [lists["a"], lists["b"]])

    lists["a"].append(9)
    lists["b"].append(8)  # grown, but not named: not read
    changed.add("a")
    row_map = table.sync_changed(["b", "a"], changed, lists_of)
    assert asked[-1] == ["a"] and list(row_map) == [rb, ra] and _updates(table) == {(ra, 1, 9)}
    assert changed == {"c"} and table.new_lists == []
    assert np.array(table.array)[rb, :2].tolist() == [7, 0]

    # A new request (unnamed too) takes a row and is read whole; new_lists are batch rows of this step.
    lists["d"] = [1, 2]
    row_map = table.sync_changed(["b", "d", "a"], changed, lists_of)
    assert asked[-1] == ["d"] and table.new_lists == [1] and changed == {"c"}
    _check(table, row_map[1:2], [lists["d"]])

    # Too long a named list: refused before anything changes (no row taken, the name kept).
    lists["e"] = list(range(1, 8))
    changed.add("e")
    with pytest.raises(SlotError, match="request 'e' holds 7 KV blocks"):
        table.sync_changed(["a", "e"], changed, lists_of)
    assert table.row_of("e") is None and "e" in changed


def test_a_sync_of_the_last_syncs_ids_reuses_its_rows_and_writes_what_an_unmemoised_table_writes(table_diff, table_upload):
    """Decoding's steady state syncs the same requests in the same order step after step: the table then
    returns the very (read-only) ``row_map`` of the last sync, and still writes every named list, with the
    entries, ``new_lists`` and ``changed`` of a table that keeps no memo (``_forget_last_sync`` before each
    sync). Other ids (or the same in another order) and a reset end the reuse."""
    tables = DeviceBlockTable(6, B, update_capacity=8), DeviceBlockTable(6, B, update_capacity=8)
    memo, plain = tables
    lists = {"a": [3], "b": [7], "c": [5, 6]}
    names = [set(lists), set(lists)]  # each table's kv_lists_changed

    def sync(ids, grown=(), new=()):
        for rid in grown:
            lists[rid].append(lists[rid][-1] + 10)
        for rid in new:  # a re-admission: another list object, the same id
            lists[rid] = list(lists[rid][:1]) + [40]
        for changed in names:
            changed.update(grown, new)
        plain._forget_last_sync()
        maps = [t.sync_changed(list(ids), changed, lambda todo: [lists[r] for r in todo])
                for t, changed in zip(tables, names, strict=True)]
        assert maps[0].tolist() == maps[1].tolist()
        assert _updates(memo) == _updates(plain) and memo.new_lists == plain.new_lists and names[0] == names[1]
        np.testing.assert_array_equal(memo.mirror, plain.mirror)
        _check(memo, maps[0], [lists[r] for r in ids])
        return maps[0]

    first = sync(["a", "b", "c"])
    assert not first.flags.writeable
    again = sync(["a", "b", "c"], grown=["b"])
    assert again is first and _updates(memo) == {(int(first[1]), 1, 17)}
    assert sync(["a", "b", "c"], new=["a"]) is first and memo.new_lists == [0]
    assert sync(["a", "b", "c"]) is first and _updates(memo) == set()
    other = sync(["b", "a", "c"], grown=["c"])  # another order: rows looked up again
    assert other is not first and other.tolist() == first[[1, 0, 2]].tolist()
    assert sync(["b", "a", "c"]) is other
    for table in tables:
        table.reset()
    assert sync(["b", "a", "c"]) is not other


def test_serving_compiles_nothing_and_reset_clears_the_table(table_upload):
    _CompileCounter.install()
    table = DeviceBlockTable(5, B, update_capacity=4)
    before = _CompileCounter.count
    lists = [[1, 2, 3, 4, 5], [6], [7, 8]]
    for step in range(4):
        row_map = table.sync(["a", "b", "c"], lists)
        _check(table, row_map, lists)
        lists = [blocks + [10 * step + i + 1] if len(blocks) < B else blocks for i, blocks in enumerate(lists)]
    table.reset()
    assert not np.array(table.array).any() and table.row_of("a") is None
    assert _CompileCounter.count == before


def test_a_small_table_is_sent_whole_as_each_write_left_it():
    """A table of at most ``WHOLE_TABLE_BYTES`` builds no scatter program: a write that changes it queues the
    mirror as it left it, and ``flush(ticket)`` hands the step of that write its own copy (read-only: under async
    scheduling the host writes the next steps' tables while this one runs); a write that changes nothing
    queues nothing."""
    _CompileCounter.install()
    before = _CompileCounter.count
    table = DeviceBlockTable(5, B, update_capacity=4)
    assert table.sends_whole and not table._scatters
    a, b = [1, 2], [3]
    table.sync(["a", "b"], [a, b])
    first_ticket, first = table.ticket, table.mirror.copy()
    a.append(4)
    table.sync(["a", "b"], [a, b])
    second = table.mirror.copy()
    row_map = table.sync(["a", "b"], [a, b])  # nothing changed
    sent_first = table.flush(first_ticket)
    np.testing.assert_array_equal(sent_first, first)
    assert not sent_first.flags.writeable
    sent = table.flush(table.ticket)
    np.testing.assert_array_equal(sent, second)
    np.testing.assert_array_equal(sent_first, first)  # the earlier step's table did not change under it
    assert table.flush(table.ticket) is sent  # nothing queued since: the same array again
    _check(table, row_map, [a, b])
    assert table.num_scatter_calls == 0 and table.num_update_bytes == 2 * table.mirror.nbytes
    table.reset()
    assert not np.array(table.array).any()
    assert _CompileCounter.count == before
    # One byte more than the limit: the scatter programs instead.
    assert not DeviceBlockTable(5, B, update_capacity=4, whole_table_bytes=table.mirror.nbytes - 1).sends_whole


def test_update_capacity_fits_a_full_step():
    assert default_update_capacity(2048, 128, 16) == 256  # 128 + 128 entries
    assert default_update_capacity(16, 4, 16) == 64
    assert default_update_capacity(65536, 256, 16) == 1024


# ---------------------------------------------------------------------------------------------- engine
PROMPT_LENS = (5, 23, 1, 40, 9, 17)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return random_model("nemotron_h", path=tmp_path_factory.mktemp("bt") / "ckpt")


def test_engine_device_table_follows_admissions_growth_preemption_and_finishes(nemotron, table_upload):
    """A 7-block pool of 8-token blocks holds the longest request but not three at once: requests are
    chunked, preempted, re-admitted and finished. At every step the rows the step gathers equal the
    whole block table the host used to send, only changed entries are written, and nothing compiles."""
    # Synchronous steps: the check reads the device table between steps, which under async scheduling
    # only the dispatch thread may write (DeviceBlockTable.flush); the async engine runs the same table
    # in test_async_scheduling.py and every engine test.
    llm = LLM(nemotron, max_model_len=128, max_num_seqs=3, max_num_batched_tokens=8, block_size=8, num_blocks=8,
              async_scheduling=False)
    runner, table = llm.runner, llm.runner.block_table
    assert table.array.shape == (4, 16)  # max_num_seqs rows + the null row, cdiv(128, 8) columns
    assert table.sends_whole == (table_upload == "whole") == runner.state_table.sends_whole
    real = runner._block_table
    seen_rows, rewrites, steps = {}, [], []

    def checked(ids):
        before = np.array(table.array)
        row_map = real(ids)
        after = np.array(table.array)
        expected = np.stack([llm.kv.block_table_row(rid, runner.blocks_per_req) for rid in ids])
        np.testing.assert_array_equal(after[row_map], expected)
        np.testing.assert_array_equal(table.mirror[row_map], expected)  # what the metadata builder reads
        changed = {(int(r), int(c)) for r, c in np.argwhere(before != after)}
        assert {(int(r), int(c)) for r, c, _ in table.last_updates} == changed, "only changed entries are sent"
        assert changed <= {(int(r), c) for r in row_map for c in range(runner.blocks_per_req)}
        for rid, row in zip(ids, row_map.tolist()):
            blocks = llm.kv.kv_block_list(rid)
            if rid in seen_rows and seen_rows[rid] is not blocks:
                rewrites.append(rid)
            seen_rows[rid] = blocks
        steps.append(len(table.last_updates))
        return row_map

    runner._block_table = checked
    prompts = [np.random.default_rng(0).integers(3, 500, size=n).tolist() for n in PROMPT_LENS]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(o.error is None and o.finished for o in outs)
    assert llm.stats.num_preemptions > 0 and rewrites, "the pool must force preemptions and re-admissions"
    assert 0 in steps, "a step that allocates no block sends nothing"
    # A second call reuses the rows of finished requests.
    again = llm.generate(prompts[:3], params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:3]]
    assert llm.stats.backend_compiles_since_warmup == 0
    llm.check_invariants()


def test_engine_host_inputs_do_not_follow_max_model_len(tmp_path):
    """The runner hands the metadata builder the table's host mirror and each row's row in it, never a
    full-width ``[rows, max_model_len / block_size]`` slice: the host memory a step's inputs allocate is
    the same at a 4k and a 128k context (the slice and its copies were ~0.5 MiB a step here at 128k)."""
    import tracemalloc

    ckpt = random_model("nemotron_h", path=tmp_path / "ckpt", max_position_embeddings=131072)
    prompts = [np.random.default_rng(1).integers(3, 500, size=n).tolist() for n in (30, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    peaks, sizes, tokens = {}, {}, {}
    for mml in (4096, 131072):
        # restore="eager": tracemalloc counts every thread's allocations, and a background restore of cached
        # programs (deserialising one allocated ~1.5 MiB inside a traced step once) is not the step's.
        llm = LLM(ckpt, max_model_len=mml, max_num_seqs=2, max_num_batched_tokens=16, block_size=16,
                  num_blocks=16, num_slots=4, buckets=[(2, 16), (2, 2)], async_scheduling=False, restore="eager")
        runner, real = llm.runner, llm.runner._inputs
        peaks[mml], sizes[mml] = [], []

        def traced(sched, real=real, mml=mml):
            tracemalloc.start()
            try:
                out = real(sched)
                peaks[mml].append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()
            sizes[mml].append((out.int_buf.shape, out.float_buf.shape))
            return out

        runner._inputs = traced
        tokens[mml] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert runner.block_table.mirror.shape[1] == mml // 16
    assert tokens[4096] == tokens[131072]
    assert sizes[4096] == sizes[131072] and len(peaks[4096]) == len(peaks[131072]) > 2
    for short, long in zip(peaks[4096], peaks[131072]):
        assert long - short < 8192, (peaks[4096], peaks[131072])


def test_updates_reach_a_one_device_table_without_device_put(monkeypatch):
    """On one device a table's updates go to its scatter program as numpy arrays (``call_arguments``): the
    call places them itself, where ``jax.device_put``'s Python path costs about 35 us an array, every step."""
    import jax

    from jaxmamba.parallel import distributed

    table = DeviceBlockTable(5, B, update_capacity=4, whole_table_bytes=0)
    whole = DeviceBlockTable(5, B, update_capacity=4)
    puts = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: (puts.append(a), real_put(*a, **k))[1])
    lists = [[1, 2, 3], [4]]
    row_map = table.sync(["a", "b"], lists)
    _check(table, row_map, lists)  # flushed: the device table holds the updates
    _check(whole, whole.sync(["a", "b"], lists), lists)  # a table sent whole is the step's numpy argument
    assert isinstance(whole.array, np.ndarray)
    assert puts == []
    arrays = (np.arange(3), np.ones(2, np.float32))
    assert distributed.call_arguments(arrays, None) is arrays
    placed = distributed.call_arguments(arrays, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert all(isinstance(a, jax.Array) for a in placed) and len(puts) == 1
