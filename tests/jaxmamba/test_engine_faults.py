"""The engine survives its users: every request is validated before any is queued, and a step that raises
(any exception, Ctrl-C included) leaves the engine consistent, its caches live, and nothing of a failed
call computed later (each fault tested here once broke the engine for good)."""

from __future__ import annotations

import math
import signal

import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams, random_model
from jaxmamba.errors import ConfigError, RequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 42, 7], [300, 2, 44, 19, 8, 1], [9, 9, 3]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_model("nemotron_h", path=tmp_path_factory.mktemp("faults") / "ckpt")


@pytest.fixture(scope="module")
def llm(ckpt):
    # Synchronous steps: the faults are injected into ``steps.run``; test_async_scheduling.py injects
    # them into the async engine's dispatch and read-back.
    return LLM(ckpt, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, async_scheduling=False)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _assert_clean(llm):
    llm.check_invariants()
    assert not llm.scheduler.has_work and not llm.has_unfinished_requests()
    s = llm.stats
    assert s.slots_in_use == 0 and s.blocks_in_use == 0


def test_large_seeds_are_taken_as_vllm_takes_them(llm):
    """Fault 1: seed=2**31 passed validation, then overflowed int32 inside every later step."""
    hot = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    for seed in (2**31, 3_000_000_000, 2**63 - 1, -5, -(2**63)):
        out = llm.generate([PROMPTS[0]], SamplingParams(seed=seed, **hot))[0]
        assert out.error is None and len(out.outputs[0].token_ids) == 6
    again = llm.generate([PROMPTS[0]], SamplingParams(seed=3_000_000_000, **hot))[0]
    assert again.outputs[0].token_ids == llm.generate([PROMPTS[0]], SamplingParams(seed=3_000_000_000, **hot))[
        0].outputs[0].token_ids
    for seed in (2**63, -(2**63) - 1, 1.5, "7", True):
        with pytest.raises(RequestError, match="seed"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=-1).seed is None  # vLLM: -1 = no seed
    assert SamplingParams(seed=np.int64(7)).seed == 7
    _assert_clean(llm)


@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", 5), ("stop_token_ids", [1, 2.0]), ("stop_token_ids", "5"), ("stop_token_ids", [-1]),
    ("max_tokens", 2.5), ("max_tokens", 0), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", math.nan), ("top_k", 1.5), ("logprobs", 2.0), ("n", 0), ("n", 2.0), ("stop", [""]), ("stop", 5),
    ("ignore_eos", 1), ("output_kind", "delta"),
])
def test_sampling_params_refuse_bad_types_and_ranges(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 0.5), ("frequency_penalty", -0.5),
    ("repetition_penalty", 1.2), ("prompt_logprobs", 1),
])
def test_vllm_fields_not_served_are_refused_by_name(field, value):
    with pytest.raises(RequestError, match=f"{field}=.*not supported"):
        SamplingParams(**{field: value})


def test_prompt_token_types(llm, reference):
    ok = llm.generate([np.array(PROMPTS[0], np.int32), [np.int64(t) for t in PROMPTS[1]],
                       {"prompt_token_ids": tuple(PROMPTS[2])}], GREEDY)
    assert [o.outputs[0].token_ids for o in ok] == reference
    bad = llm.generate([[1.0, 2.0], [1, None], np.array([1.5, 2.0]), [True, 3], 7, [[1, 2]]], GREEDY)
    assert all(o.error for o in bad), [o.error for o in bad]
    assert "position 0" in bad[0].error and "None" in bad[1].error and "numpy" in bad[2].error
    _assert_clean(llm)


def test_a_bad_item_part_way_queues_nothing(llm, reference):
    """Fault 3: a bad item after good ones used to raise with the good ones queued; the next call
    computed them too."""
    outs = llm.generate([PROMPTS[0], PROMPTS[1], [1, None]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs[:2]] == reference[:2] and "None" in outs[2].error
    with pytest.raises(RequestError, match="2 sampling params for 3 prompts"):
        llm.generate(PROMPTS, [GREEDY, GREEDY])
    with pytest.raises(RequestError, match="SamplingParams"):
        llm.generate(PROMPTS, [GREEDY, GREEDY, dict(max_tokens=3)])
    _assert_clean(llm)
    before = llm.stats.num_generated_tokens
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.stats.num_generated_tokens - before == 3 * 8, "only this call's tokens were computed"


def _wrap_run(llm, monkeypatch, after):
    """Make the next step run for real (caches donated), then call ``after()`` (which raises or signals)."""
    real = llm.runner.steps.run
    calls = []

    def run(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # the second step: some requests are mid-decode
            after()
        return out

    monkeypatch.setattr(llm.runner.steps, "run", run)
    return calls


def test_an_exception_in_a_step_fails_its_requests_and_nothing_else(llm, reference, monkeypatch):
    def boom():
        raise RuntimeError("device fell over")

    _wrap_run(llm, monkeypatch, boom)
    outs = llm.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert all(o.finished for o in outs)
    assert all("device fell over" in o.error and o.outputs[0].finish_reason == "error" for o in outs)
    _assert_clean(llm)
    assert not llm.runner.caches_lost()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_keyboard_interrupt_after_donation_reallocates_the_caches(llm, reference, monkeypatch):
    """Fault 2: Ctrl-C while a step waited for its results left the caches donated ("Buffer has been
    deleted or donated" forever after) and the interrupted requests queued for the next call."""
    def interrupt():
        raise KeyboardInterrupt

    _wrap_run(llm, monkeypatch, interrupt)
    real_realloc, reallocs = llm.runner.reallocate_caches, []
    monkeypatch.setattr(llm.runner, "reallocate_caches", lambda: (reallocs.append(1), real_realloc())[1])
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert reallocs == [1], "the step had the caches (donated) when it was interrupted: they were re-made"
    _assert_clean(llm)
    before = llm.stats.num_generated_tokens
    outs = llm.generate([PROMPTS[0]], GREEDY)
    assert outs[0].outputs[0].token_ids == reference[0]
    assert llm.stats.num_generated_tokens - before == 8, "the interrupted requests were not computed again"


def test_sigint_during_a_step_is_raised_once_the_step_is_recorded(llm, reference, monkeypatch):
    calls = _wrap_run(llm, monkeypatch, lambda: signal.raise_signal(signal.SIGINT))
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"sig{i}", p, GREEDY)
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished_requests():
            engine.step()
    monkeypatch.undo()
    assert len(calls) == 2 and not llm.runner.caches_lost(), "the step completed: nothing was lost"
    llm.check_invariants()
    # The interrupted step's tokens were kept: the requests carry on to the same tokens.
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert [outs[f"sig{i}"].outputs[0].token_ids for i in range(3)] == reference
    _assert_clean(llm)


def test_engine_argument_checks(ckpt):
    small = dict(max_num_seqs=1, max_num_batched_tokens=16, buckets=[(1, 16)], max_model_len=32)
    with pytest.raises(ConfigError, match="mamba_ssm_cache_dtype"):  # fault 4: int8 gave wrong tokens
        LLM(ckpt, mamba_ssm_cache_dtype="int8", **small)
    with pytest.raises(ConfigError, match="max_model_len=0"):
        LLM(ckpt, **{**small, "max_model_len": 0})
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLM(ckpt, **{**small, "max_model_len": 4097})
    with pytest.raises(ConfigError, match="dtype='int8'"):
        LLM(ckpt, dtype="int8", **small)
    assert LLM(ckpt, dtype="auto", **small).dtype == "float32"  # the checkpoint's dtype
    half = LLM(ckpt, dtype="bf16", mamba_ssm_cache_dtype="float32", **small)
    assert half.dtype == "bfloat16" and half.runner.caches.ssm[0].dtype == np.float32
    assert half.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))[0].error is None


def test_request_api_reports_what_an_interrupt_ended(llm, reference, monkeypatch):
    """LLMEngine: requests in the interrupted step are reported (with their error) by the next step();
    those still waiting run normally, to the tokens they would have had."""
    def interrupt():
        raise KeyboardInterrupt

    engine = llm.llm_engine
    prompts = PROMPTS + PROMPTS[:3]  # 6 requests over 4 rows: two wait
    for i, p in enumerate(prompts):
        engine.add_request(f"k{i}", p, GREEDY)
    _wrap_run(llm, monkeypatch, interrupt)
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished_requests():
            engine.step()
    monkeypatch.undo()
    llm.check_invariants()
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert sorted(outs) == [f"k{i}" for i in range(6)] and all(o.finished for o in outs.values())
    failed = [rid for rid, o in outs.items() if o.error]
    assert len(failed) == 4 and all("KeyboardInterrupt" in outs[r].error for r in failed)
    for i in (4, 5):
        assert outs[f"k{i}"].error is None and outs[f"k{i}"].outputs[0].token_ids == reference[i - 3]
    _assert_clean(llm)
