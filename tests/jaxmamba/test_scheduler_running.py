"""The scheduler's running list stays in arrival order (``schedule`` walks it unsorted), and a plain manager's
``token_capacity`` says exactly when ``allocate_more`` has nothing to allocate (the scheduler skips the call)."""

from __future__ import annotations

from jaxmamba.engine.prefix_cache import PrefixCacheManager
from jaxmamba.engine.request import Request, SamplingParams
from jaxmamba.engine.scheduler import Scheduler


def _manager(mode: str = "none", num_kv_blocks: int = 64, max_model_len: int = 62, **kw) -> PrefixCacheManager:
    return PrefixCacheManager(num_kv_blocks, 64, 4, mode, 0, max_model_len=max_model_len, mamba_chunk_size=4,
                              max_num_batched_tokens=64, **kw)


def test_running_stays_in_arrival_order_whatever_the_admission_order():
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, kv=_manager())
    # Admitted out of arrival order (as P/D's admit_computed may), ties included: the running list is what a
    # stable sort by arrival of the admission order gives.
    for rid, arrival in [("a", 3), ("b", 0), ("c", 5), ("d", 3), ("e", 1)]:
        req = Request(rid, [1, 2, 3, 4, 5], SamplingParams(), seed=0, arrival=arrival)
        assert sched.admit_computed(req, 4)
    assert [r.request_id for r in sched.running] == ["b", "e", "a", "d", "c"]
    out = sched.schedule()
    assert [row.request.request_id for row in out.rows] == ["b", "e", "a", "d", "c"]


def test_preempted_request_rejoins_running_in_arrival_order():
    # Four usable KV blocks of 4 tokens: two requests of 4-token prompts take one each and a block per 4
    # decodes, so the newest is preempted (and readmitted once the oldest's blocks allow).
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, kv=_manager(num_kv_blocks=5))
    reqs = [Request(f"r{i}", [1, 2, 3, 4], SamplingParams(), seed=0, arrival=i) for i in range(2)]
    for req in reqs:
        sched.add(req)
    preempted = 0
    for _ in range(12):
        out = sched.schedule()
        preempted += len(out.preempted)
        arrivals = [r.arrival for r in sched.running]
        assert arrivals == sorted(arrivals)
        assert [row.request.arrival for row in out.rows] == sorted(row.request.arrival for row in out.rows)
        for row in out.rows:  # record the step: a token per sampling row
            req = row.request
            req.num_computed_tokens += row.num_tokens
            sched.kv.commit(req.request_id, req.num_computed_tokens, None)
            if row.samples:
                req.output_token_ids.append(7)
    assert preempted


def test_token_capacity_is_allocate_mores_short_path():
    kv = _manager()
    assert kv.allocate_for_new_request("r", list(range(6)), 64) is not None
    assert kv.token_capacity["r"] == 8  # two blocks of 4
    kv.commit("r", 6, None)
    blocks = kv.num_used_kv_blocks
    assert kv.allocate_more("r", 8) and kv.num_used_kv_blocks == blocks  # inside its blocks: nothing taken
    assert kv.allocate_more("r", 9) and kv.num_used_kv_blocks == blocks + 1
    assert kv.token_capacity["r"] == 12  # the block it took counts at once
    assert kv.allocate_more("r", 61) and kv.token_capacity["r"] == 62  # 16 blocks, capped at max_model_len
    kv.free("r")
    assert "r" not in kv.token_capacity
    # Any other manager keeps none: every row calls allocate_more.
    cached = _manager(mode="align", enable_caching=True)
    assert cached.allocate_for_new_request("r", list(range(6)), 64) is not None
    assert cached.token_capacity == {}


def test_check_invariants_finds_a_token_capacity_that_disagrees_with_the_blocks():
    import pytest

    from jaxmamba.errors import SlotError

    kv = _manager()
    assert kv.allocate_for_new_request("r", list(range(6)), 64) is not None
    kv.check_invariants()
    kv.token_capacity["r"] += 4  # a block it does not hold: the scheduler would skip a needed allocation
    with pytest.raises(SlotError, match="token_capacity"):
        kv.check_invariants()


def test_the_hot_loops_counts_are_row_counts_and_step_rows_reads_them_back():
    """``Scheduler.schedule`` writes each running row's ``ROW_FIELDS`` inline from the counts it has at hand; they
    must equal what ``row_counts`` derives from the request (prompt chunks, decodes with a token in flight,
    drafts, a recomputing request whose prefill runs past its prompt), and ``StepRows.of`` must give every
    row back in batch order."""
    from jaxmamba.engine.scheduler import NUM_ROW_FIELDS, row_counts
    from jaxmamba.engine.step_rows import StepRows

    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=24, kv=_manager(max_model_len=62))
    reqs = [Request(f"r{i}", list(range(1, 3 + 3 * i)), SamplingParams(max_tokens=9), seed=0, arrival=i)
            for i in range(5)]
    for req in reqs:
        sched.add(req)
    sched.schedule()  # admits what the budget allows: prompts start, the last ones in chunks
    for req in sched.running:  # the step ran: a sampling row's token is in flight (async scheduling)
        req.num_computed_tokens = min(req.num_tokens, req.num_computed_tokens + 5)
        if req.num_computed_tokens == req.num_tokens:
            req.num_output_placeholders = 1
    sched.running[0].output_token_ids += [5, 6]  # two read back (computed), one still in flight
    sched.running[0].num_computed_tokens += 2
    sched.running[1].draft_token_ids = [9, 9]  # drafts to verify with its next token
    sched.running[2].prefill_until = sched.running[2].num_tokens + 1  # as after a preemption with outputs
    out = sched.schedule()
    kinds = set()
    for i, req in enumerate(out.requests):
        counts = out.counts[NUM_ROW_FIELDS * i : NUM_ROW_FIELDS * (i + 1)]
        assert tuple(counts) == row_counts(req, counts[1]), req.request_id
        row = out.row(i)
        kinds.add((row.is_prefill, row.num_drafts > 0, row.samples))
    assert {(True, False, False), (False, False, True), (False, True, True)} <= kinds, kinds
    assert out.num_tokens == sum(row.num_tokens for row in out.rows)
    rows = StepRows.of(out, num_spec=2)
    for b, i in enumerate(rows.order.tolist()):
        assert rows.row(b) == out.row(i)
    out.set_num_steps(0, 3)
    assert out.row(0).num_steps == 3 and out.rows[0].num_steps == 3


def test_step_rows_names_a_negative_count_and_keeps_the_scheduler_order_without_copying_it():
    """A negative count (a scheduler bug) is named by the metadata checks before any step is built; a batch
    already in the builders' order keeps the scheduler's rows (``order`` is then the identity, worked out only
    when read), and an empty batch is no error."""
    import numpy as np
    import pytest

    from jaxmamba.engine.scheduler import SchedulerOutput
    from jaxmamba.engine.step_rows import StepRows
    from jaxmamba.errors import MetadataError

    reqs = [Request(f"r{i}", [1, 2, 3, 4], SamplingParams(), seed=0, arrival=i) for i in range(3)]
    decode = [8, 1, 4, 0, 8, 4, 1, 1]  # ROW_FIELDS: a decode past its 4-token prompt
    rows = StepRows.of(SchedulerOutput(reqs, decode * 3, []), num_spec=0)
    assert rows.scheduler_rows is None and rows.order.tolist() == [0, 1, 2] and rows.decode_only
    prompt_first = [0, 4, 4, 0, 4, 0, 1, 1] + decode * 2  # a fresh prompt listed before two decodes
    rows = StepRows.of(SchedulerOutput(reqs, prompt_first, []), num_spec=0)
    assert rows.order.tolist() == [1, 2, 0] and rows.ids == ["r1", "r2", "r0"] and rows.num_prefills == 1
    assert len(StepRows.of(SchedulerOutput([], [], []), num_spec=0).ids) == 0
    bad = decode * 2 + [8, -1, 4, 0, 8, 4, 1, 1]
    with pytest.raises(MetadataError, match=r"scheduled row 2 \(request 'r2'\): num_tokens=-1 is negative"):
        StepRows.of(SchedulerOutput(reqs, bad, []), num_spec=0)
    # Any field: a negative output count (no builder check reads it) is refused too, as is a count past 32 bits.
    with pytest.raises(MetadataError, match=r"scheduled row 0 \(request 'r0'\): num_outputs=-3 is negative"):
        StepRows.of(SchedulerOutput(reqs, [8, 1, 4, 0, 8, -3, 1, 1] + decode * 2, []), num_spec=0)
    with pytest.raises(MetadataError, match=r"scheduled row 1 .*num_known=4294967296 is negative, past 32 bits"):
        StepRows.of(SchedulerOutput(reqs, decode + [8, 1, 4, 0, 2**32, 4, 1, 1] + decode, []), num_spec=0)
    with pytest.raises(MetadataError, match=r"scheduled row 2 .*num_steps=1.5 is negative, past 32 bits or not an int"):
        StepRows.of(SchedulerOutput(reqs, decode * 2 + [8, 1, 4, 0, 8, 4, 1.5, 1], []), num_spec=0)
    assert np.array_equal(StepRows.of(SchedulerOutput(reqs, decode * 3, []), num_spec=0).computed, [8, 8, 8])


def test_a_window_runs_beside_free_rows_only_while_the_pools_refuse_the_waiting_request():
    """``extend_decode_window`` holds windows back while a waiting request could take a free row, but not when
    the pools cannot hold its first step: then it waits for a finish with windows as without them."""
    import dataclasses

    # Six usable KV blocks of 4 tokens: two 5-token prompts take two each, the 9-token third needs three.
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, kv=_manager(num_kv_blocks=7))
    for i, n in enumerate((5, 5, 9)):
        sched.add(Request(f"r{i}", list(range(1, n + 1)), SamplingParams(), seed=0, arrival=i))
    out = sched.schedule()
    assert [row.request.request_id for row in out.rows] == ["r0", "r1"] and out.admission_refused
    for row in out.rows:  # record the prefill step: its tokens computed, a token sampled
        row.request.num_computed_tokens += row.num_tokens
        sched.kv.commit(row.request.request_id, row.request.num_computed_tokens, None)
        row.request.output_token_ids.append(7)
    out = sched.schedule()
    assert len(out.rows) == 2 < sched.max_num_seqs and sched.waiting and out.admission_refused
    free_blocks = sched.kv.num_free_kv_blocks
    assert free_blocks == 2  # room for the rows' look-ahead, not for r2's three blocks
    sched.extend_decode_window(dataclasses.replace(out, admission_refused=False), 4)  # r2 could start: no window
    assert [row.num_steps for row in out.rows] == [1, 1]
    sched.extend_decode_window(out, 4)
    assert [row.num_steps for row in out.rows] == [4, 4]
    assert sched.kv.num_free_kv_blocks == 0  # each row took its look-ahead block
