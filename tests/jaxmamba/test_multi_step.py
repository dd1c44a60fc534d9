"""Multi-step scheduling (docs/architecture.md, "Compiled steps", multi-step windows):
``LLM(num_scheduler_steps=K)`` runs a batch of plain decodes as one
window of up to K decode steps on the device. Every request's tokens, finish and stop reasons equal the
one-step engine's, logprobs to 1e-5; windows are really used (counted at the executable's call); a row
whose window is cut short (length limit, KV pool) writes nothing in the window's later steps."""

from __future__ import annotations

import pytest

from engine_outputs import assert_same_outputs, engine_outputs, random_prompts

from jaxmamba import LLM, SamplingParams, random_model
from jaxmamba.errors import ConfigError

K = 4




@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_model("nemotron_h", path=tmp_path_factory.mktemp("multistep") / "ckpt")


ENGINES = {
    # Every request fits at once (97 prompt tokens, n=2 included): after the prefill step every step is a window.
    "all_at_once": dict(max_num_seqs=8, max_num_batched_tokens=128),
    # Requests queue (no window while one waits), prompts are chunked and a small KV pool preempts.
    "queued_small_pool": dict(max_num_seqs=3, max_num_batched_tokens=16, block_size=8, num_blocks=10),
}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engines(request, ckpt):
    args = dict(max_model_len=64, **ENGINES[request.param])
    single = LLM(ckpt, async_scheduling=False, **args)
    windows = {a: LLM(ckpt, async_scheduling=a, num_scheduler_steps=K, **args) for a in (False, True)}
    return request.param, single, windows


def _spy_windows(llm):
    """Count the executable calls that ran a window, and the window lengths the scheduler gave."""
    seen = {"windows": 0, "steps": 0, "row_steps": []}
    dispatch, extend = llm.runner.steps.dispatch, llm.scheduler.extend_decode_window

    def spy_dispatch(*args, **kwargs):
        seen["steps"] += 1
        # dispatch(bucket, caches, int_buf, float_buf, block_table, state_table, prev, profile, variant, multi_step)
        seen["windows"] += bool(kwargs.get("multi_step", args[9] if len(args) >= 10 else False))
        return dispatch(*args, **kwargs)

    def spy_extend(sched, num_steps):
        extend(sched, num_steps)
        seen["row_steps"].append([row.num_steps for row in sched.rows])
        if max(seen["row_steps"][-1], default=1) > 1 and llm.scheduler.waiting:
            seen["windows_while_waiting"] = seen.get("windows_while_waiting", 0) + 1
            # A waiting request that could take a free row is never held back by a window; one the pools
            # cannot hold waits for a finish either way.
            assert len(sched.rows) == llm.scheduler.max_num_seqs or sched.admission_refused, \
                "window while a row was free for a waiting request"
            if len(sched.rows) < llm.scheduler.max_num_seqs:
                seen["windows_beside_free_rows"] = seen.get("windows_beside_free_rows", 0) + 1

    llm.runner.steps.dispatch = spy_dispatch
    llm.scheduler.extend_decode_window = spy_extend
    return seen






@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_window_tokens_equal_single_steps(engines, async_scheduling):
    name, single, windows = engines
    llm = windows[async_scheduling]
    prompts = random_prompts((5, 23, 1, 30, 9, 17, 3))
    free = [o.outputs[0].token_ids for o in single.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))]
    # Lengths that end inside a window (1, 2, 5, 7, 9, 13), a stop id met mid-window, sampled rows whose
    # per-request step counter must advance inside the window (with logprobs, min_tokens, n=2).
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 13, 5, 9, 2, 7, 14)]
    params[6] = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, stop_token_ids=[free[6][6]])
    params[1] = SamplingParams(temperature=0.9, seed=11, max_tokens=13, logprobs=3)
    params[3] = SamplingParams(temperature=1.0, seed=2, max_tokens=11, min_tokens=6, stop_token_ids=[free[3][2]])
    params[4] = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, max_tokens=10, n=2)
    expected = engine_outputs(single, prompts, params)
    seen = _spy_windows(llm)
    try:
        got = engine_outputs(llm, prompts, params)
    finally:
        del llm.runner.steps.dispatch, llm.scheduler.extend_decode_window
    assert_same_outputs(got, expected)
    assert seen["windows"] > 0, seen
    assert max(n for rows in seen["row_steps"] for n in rows) == K
    if name == "queued_small_pool":
        # Every row taken, or rows free but the pool unable to hold the next prompt's first step: the waiting
        # requests wait for a finish either way, and windows go on.
        assert seen.get("windows_while_waiting", 0) > 0 and seen.get("windows_beside_free_rows", 0) > 0, seen


def test_rows_cut_short_keep_their_state(engines):
    """A row whose window the KV pool cuts to one step, beside rows that run K, must leave its caches as
    one step leaves them (its later steps write nothing): it goes on decoding from them. The pool is made
    to refuse every other look-ahead allocation."""
    _, single, windows = engines
    llm = windows[False]
    prompts = random_prompts((5, 23, 1, 30, 9, 17, 3), seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    expected = engine_outputs(single, prompts, params)
    kv = llm.scheduler.kv
    allocate, calls = kv.allocate_more, [0]

    def refuse_every_other_look_ahead(request_id, num_total_tokens):
        if num_total_tokens > kv._req(request_id).num_computed + 1:  # a window's look-ahead, not a step's own
            calls[0] += 1
            if calls[0] % 2:
                return False
        return allocate(request_id, num_total_tokens)

    kv.allocate_more = refuse_every_other_look_ahead
    seen = _spy_windows(llm)
    try:
        got = engine_outputs(llm, prompts, params)
    finally:
        del kv.allocate_more, llm.runner.steps.dispatch, llm.scheduler.extend_decode_window
    # Rows kept at one step beside rows with more, in the same window, and not at their end.
    assert sum(1 in rows and max(rows) > 1 for rows in seen["row_steps"]) >= 3, seen["row_steps"]
    assert_same_outputs(got, expected)


def test_windows_stop_at_max_model_len(ckpt):
    """No window runs past ``max_model_len``: rows end by length exactly where the one-step engine's do."""
    args = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40)
    prompts = random_prompts((30, 33, 21, 38), seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = engine_outputs(LLM(ckpt, async_scheduling=False, **args), prompts, params)
    llm = LLM(ckpt, num_scheduler_steps=8, **args)
    got = engine_outputs(llm, prompts, params)
    assert_same_outputs(got, expected)
    assert [len(o[0][0]) for o in got] == [40 - 30, 40 - 33, 40 - 21, 40 - 38]
    assert {o[0][1] for o in got} == {"length"}


def test_window_programs_compile_at_start(engines):
    _, single, windows = engines
    for llm in windows.values():
        stats = llm.stats
        assert stats.num_compilations == stats.num_step_programs
        decode_programs = sum(len(v) for b, v in llm.runner.steps.sampling_variants.items() if b.decode_only)
        assert stats.num_step_programs == single.stats.num_step_programs + decode_programs


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_scheduler_steps=0), "num_scheduler_steps=0 must be > 0"),
    (dict(num_scheduler_steps="4"), "must be an int"),
    (dict(num_scheduler_steps=4, enable_prefix_caching=True), "num_scheduler_steps=4 needs mamba_cache_mode='none'"),
    (dict(num_scheduler_steps=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "no speculative decoding"),
])
def test_bad_window_configs_fail_before_loading(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LLM(tmp_path / "no-such-checkpoint", **kwargs)


def test_pallas_backend_windows_match_reference_single_steps(ckpt):
    """The Pallas kernels (interpreted on the CPU) run a window against the caches themselves, inactive rows
    named PAD_SLOT_ID, where the reference backend keeps a working set: the same tokens either way."""
    args = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48)
    prompts = random_prompts((6, 13, 2), seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (7, 3, 9)]
    expected = engine_outputs(LLM(ckpt, async_scheduling=False, **args), prompts, params)
    llm = LLM(ckpt, kernel_backend="pallas", num_scheduler_steps=K, **args)
    seen = _spy_windows(llm)
    got = engine_outputs(llm, prompts, params)
    assert seen["windows"] > 0
    assert [[(t, r, s) for t, r, s, _ in o] for o in got] == [[(t, r, s) for t, r, s, _ in o] for o in expected]


def test_a_bucket_without_a_window_runs_one_step(engines):
    """Should a batch of decodes land in a bucket with no window program, its rows run one step each (the
    look-ahead blocks serve later steps): same tokens, no failed step."""
    _, single, windows = engines
    llm = windows[True]
    prompts = random_prompts((4, 9, 15), seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    expected = engine_outputs(single, prompts, params)
    llm.runner.steps.has_window = lambda bucket: False
    seen = _spy_windows(llm)
    try:
        got = engine_outputs(llm, prompts, params)
    finally:
        del llm.runner.steps.has_window, llm.runner.steps.dispatch, llm.scheduler.extend_decode_window
    assert seen["windows"] == 0 and max(n for rows in seen["row_steps"] for n in rows) == K
    assert_same_outputs(got, expected)


def test_explicit_mixed_buckets_refuse_windows(ckpt):
    with pytest.raises(ConfigError, match="pure-decode buckets"):
        LLM(ckpt, num_scheduler_steps=4, max_num_seqs=4, max_num_batched_tokens=64, buckets=[(4, 64)])
