"""The persistent Mamba state-index table (docs/architecture.md, "Persistent device tables"): a step
sends only the slots that changed.

``DeviceTable`` with windowed lists alone (in-place changes, window moves, rows changing hands, the
value check, the small scatter program), then inside the engine in every ``mamba_cache_mode``: at every
step of a run with admissions, block growth, preemption, finishes and re-admissions, the device table
gathered by the step's ``row_map`` equals the manager's tables (what the host used to send), the mirror
equals the device, and only changed entries are written. The step's gather of the slot arrays from this
table equals the host builder's (test_metadata_properties.py); tokens are checked by the engine tests.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams, random_model
from jaxmamba.engine.block_table import NULL_ROW, DeviceTable
from jaxmamba.errors import SlotError

C = 6  # state-table columns


def _host(lists):
    return np.array(lists, np.int32).reshape(len(lists), C)


def _check(table: DeviceTable, row_map, lists):
    device = np.array(table.array)
    np.testing.assert_array_equal(device, table.mirror)
    np.testing.assert_array_equal(device[np.asarray(row_map)], _host(lists))
    assert not device[NULL_ROW].any(), "padding rows read the null row: it stays zeros"


def _updates(table):
    return {tuple(int(v) for v in u) for u in table.last_updates}


def _window(entries):
    used = [j for j, slot in enumerate(entries) if slot]
    return (used[0], used[-1] + 1) if used else (0, 0)


def test_windowed_rows_send_only_what_changed_in_place(table_diff, table_upload):
    table = DeviceTable(4, C, update_capacity=8, value_limit=50, entry_name="state slots")
    a, b = [0, 0, 5, 6, 0, 0], [7, 0, 0, 0, 0, 0]
    rows = np.array([1, 2], np.int32)
    table.write_rows(["a", "b"], rows, [a, b], [(2, 4), (0, 1)])
    assert _updates(table) == {(1, 2, 5), (1, 3, 6), (2, 0, 7)}
    _check(table, rows, [a, b])

    # Nothing changed: nothing sent, no scatter call, whatever the batch order.
    calls, ticket = table.num_scatter_calls, table.ticket
    table.write_rows(["b", "a"], rows[::-1].copy(), [b, a], [(0, 1), (2, 4)])
    assert _updates(table) == set() and table.num_scatter_calls == calls and table.ticket == ticket + 1
    _check(table, rows, [a, b])

    # Block growth in place (the same list object): the window moves up, the released column is cleared.
    a[2], a[4] = 0, 9
    table.write_rows(["a"], rows[:1], [a], [(3, 5)])
    assert _updates(table) == {(1, 2, 0), (1, 4, 9)}
    _check(table, rows[:1], [a])

    # A rotation inside an unchanged window (align mode's spec decode) is seen too.
    a[3], a[4] = a[4], a[3]
    table.write_rows(["a"], rows[:1], [a], [(3, 5)])
    assert _updates(table) == {(1, 3, 9), (1, 4, 6)}

    # The row changes hands (a new list): it is diffed against what it held, stale slots cleared.
    c = [0, 0, 0, 0, 6, 8]
    table.write_rows(["c"], rows[:1], [c], [(4, 6)])
    assert _updates(table) == {(1, 3, 0), (1, 5, 8)}
    _check(table, rows, [c, b])

    if table.sends_whole:  # the table after each write that changed it: all but the one that changed nothing
        assert table.num_scatter_calls == 0 and table.num_update_bytes == 4 * table.mirror.nbytes
    else:  # a few changes take the smallest scatter program the ladder has (here the only one, 8 entries)
        assert table.num_update_bytes == table.num_scatter_calls * 3 * 8 * 4


def test_an_out_of_range_slot_is_refused_naming_the_request_before_anything_changes(table_diff, table_upload):
    table = DeviceTable(3, C, update_capacity=8, value_limit=10, entry_name="state slots")
    ok = [1, 2, 0, 0, 0, 0]
    table.write_rows(["ok"], np.array([1], np.int32), [ok], [(0, 2)])
    ticket, calls = table.ticket, table.num_scatter_calls
    for bad_slot in (10, -3):
        bad = [0, 0, 3, bad_slot, 0, 0]
        with pytest.raises(SlotError, match=rf"request 'bad': state slots entry {bad_slot} \(column 3\) is outside "
                                            r"\[0, 10\)"):
            table.write_rows(["ok", "bad"], np.array([1, 2], np.int32), [ok, bad], [(0, 2), (2, 4)])
        assert table.ticket == ticket and table.num_scatter_calls == calls
        _check(table, [1], [ok])
        assert not table.mirror[2].any()
    # The refused row is diffed whole once its list is right.
    good = [0, 0, 3, 4, 0, 0]
    table.write_rows(["ok", "bad"], np.array([1, 2], np.int32), [ok, good], [(0, 2), (2, 4)])
    _check(table, [1, 2], [ok, good])
    with pytest.raises(SlotError, match=r"request 'wide' holds 7 state slots, more than 6"):
        table.write_rows(["wide"], np.array([1], np.int32), [[1] * 7], [(0, 7)])


def test_the_update_ladder_sends_a_small_array_for_a_few_changes():
    table = DeviceTable(3, 40, update_capacity=256, whole_table_bytes=0)
    lists = [list(range(1, 41)), [3] + [0] * 39]
    table.write_rows(["x", "y"], np.array([1, 2], np.int32), lists, [(0, 40), (0, 1)])
    assert table.num_scatter_calls == 1 and table.num_update_bytes == 3 * 64 * 4  # 41 entries: the 64 program
    lists[1][1] = 4
    table.write_rows(["x", "y"], np.array([1, 2], np.int32), lists, [(0, 40), (0, 2)])
    assert table.num_scatter_calls == 2 and table.num_update_bytes == 3 * (64 + 16) * 4
    _check_wide = np.array(table.array)[[1, 2]]
    np.testing.assert_array_equal(_check_wide, np.array(lists, np.int32))


# ---------------------------------------------------------------------------------------------- engine
PROMPT_LENS = (20, 47, 3, 60, 33, 17)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return random_model("nemotron_h", path=tmp_path_factory.mktemp("st") / "ckpt")


@pytest.mark.parametrize("mode", ["none", "align", "all"])
def test_engine_state_table_follows_admissions_growth_preemption_and_finishes(nemotron, mode):
    """An 8-block pool of 16-token blocks cannot hold three long requests at once: requests are chunked,
    preempted, re-admitted and finished, and decodes cross block ends (new state columns in align/all).
    At every step the device rows the step gathers equal the manager's tables, and only changed entries
    are written; mode none writes a request's slots once, when it takes a row."""
    caching = mode != "none"
    llm = LLM(nemotron, max_model_len=96, max_num_seqs=3, max_num_batched_tokens=32, block_size=16, num_blocks=9,
              enable_prefix_caching=caching, mamba_cache_mode=mode if caching else None, async_scheduling=False)
    runner, table = llm.runner, llm.runner.state_table
    assert table.array.shape == (4, runner.mamba_columns)
    real = runner._state_indices
    steps, moved = [], []
    previous = {}

    def checked(ids, row_map):
        before = np.array(table.array)
        ticket = table.ticket
        host = real(ids, row_map)
        # A step that leaves the table alone does not write it at all (its write number stays).
        updates = table.last_updates if table.ticket != ticket else np.zeros((0, 3), np.int32)
        after = np.array(table.array)
        expected = llm.kv.state_indices_rows(ids)
        np.testing.assert_array_equal(after[row_map], expected)
        assert host is table.mirror
        np.testing.assert_array_equal(host[row_map], expected)
        np.testing.assert_array_equal(after, table.mirror)
        changed = {(int(r), int(c)) for r, c in np.argwhere(before != after)}
        assert {(int(r), int(c)) for r, c, _ in updates} == changed, "only changed entries are sent"
        for rid, row in zip(ids, expected):
            lst = llm.kv.state_table_list(rid)
            if rid in previous and previous[rid][0] is lst and not np.array_equal(previous[rid][1], row):
                moved.append(rid)  # the same admission's table changed in place
            previous[rid] = (lst, row.copy())
        steps.append(len(updates))
        return host

    runner._state_indices = checked
    prompts = [np.random.default_rng(1).integers(3, 500, size=n).tolist() for n in PROMPT_LENS]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(o.error is None and o.finished for o in outs)
    assert llm.stats.num_preemptions > 0, "the pool must force preemptions and re-admissions"
    assert 0 in steps, "a step that changes no slot sends nothing"
    if caching:
        assert moved, "block growth must change tables in place"
    else:
        assert not moved, "mode none: a request's slots are constant"
    llm.check_invariants()
    assert llm.stats.backend_compiles_since_warmup == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mode_none_writes_slots_only_for_new_lists_and_check_invariants_catches_a_stale_row(async_scheduling):
    """Mode none: the state table and the persistent batch are written only for rows the block table wrote from
    a new list (a request new to its row); check_invariants verifies that every other running row still holds
    its request's slots and inputs, and names a row that does not."""
    from jaxmamba.bench.host_inputs import stubbed_llm

    llm = stubbed_llm(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                      async_scheduling=async_scheduling)
    engine, runner = llm.llm_engine, llm.runner
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i] * (6 + i), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # the three prompts: three new lists, three state rows written
    written = runner.state_table.ticket
    for _ in range(4):  # decodes only: no new list, so the state table is not written again
        engine.step()
        llm.check_invariants()
    assert runner.state_table.ticket == written
    engine.add_request("r3", [9] * 5, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # a new request takes a row: its slots are written
    assert runner.state_table.ticket == written + 1
    llm.check_invariants()

    rid = "r1"
    row = runner.block_table.row_of(rid)
    runner.state_table.mirror[row, 0] += 1  # a row that missed its request's slots
    with pytest.raises(SlotError, match=f"'{rid}': state-table row {row}"):
        llm.check_invariants()
    runner.state_table.mirror[row, 0] -= 1
    llm.check_invariants()
    other = runner.block_table.row_of("r2")
    runner.input_batch.assign(np.array([row], np.int32), [next(r for r in llm.scheduler.running
                                                                if r.request_id == "r2")])
    with pytest.raises(SlotError, match=f"'{rid}': input-batch row {row}"):
        llm.check_invariants()
    assert other != row
