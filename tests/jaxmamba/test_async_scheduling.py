"""Async scheduling (docs/architecture.md, "The data path of one step"): step N+1 is scheduled and
dispatched before step N is read back, its
tokens come from step N's device outputs, and the extra step a finished request may have run is
discarded. Every request's tokens and finish reasons equal the synchronous engine's; logprobs agree to
1e-5 (a step may run in a different bucket: the synchronous engine admits a waiting request one step
earlier, and padding changes the order of float sums)."""

from __future__ import annotations

import dataclasses

import pytest

from engine_outputs import assert_same_outputs, engine_outputs, random_prompts

from jaxmamba import LLM, SamplingParams, random_model




@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_model("nemotron_h", path=tmp_path_factory.mktemp("async") / "ckpt")


ENGINES = {
    # Mixed steps with padded rows; 8 requests over 4 rows.
    "whole_prompt": dict(max_num_seqs=4, max_num_batched_tokens=64),
    # Chunked prompts, and a KV pool too small for three long requests at once: preemption.
    "chunked_preempting": dict(max_num_seqs=3, max_num_batched_tokens=8, block_size=8, num_blocks=8),
    # Steps enqueued on the engine thread (an accelerator's default; a CPU device's is the dispatch thread).
    "whole_prompt_inline": dict(max_num_seqs=4, max_num_batched_tokens=64, async_dispatch="inline"),
}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engines(request, ckpt):
    args = dict(max_model_len=128, **ENGINES[request.param])
    return LLM(ckpt, async_scheduling=False, **args), LLM(ckpt, async_scheduling=True, **args)






def test_tokens_equal_the_synchronous_engine(engines):
    sync, async_ = engines
    prompts = random_prompts((5, 23, 1, 40, 9, 17, 3, 12))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 1, 9, 4, 12, 2, 7, 5)]
    # Sampled rows: the sampler's per-request step counter must count the tokens still on the device.
    params[1] = SamplingParams(temperature=0.9, seed=11, max_tokens=8, logprobs=3)
    params[4] = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, max_tokens=10, n=2)
    params[6] = SamplingParams(temperature=1.0, seed=2, max_tokens=9, min_tokens=5)
    expected = engine_outputs(sync, prompts, params)
    got = engine_outputs(async_, prompts, params)
    assert_same_outputs(got, expected)
    assert async_.stats.backend_compiles_since_warmup == 0


def test_a_stop_token_discards_the_step_run_past_it(engines):
    """Stops that need the token's value (a stop id, EOS) are seen one step late: the request's next
    step has already run, and its token must not appear."""
    sync, async_ = engines
    prompts = random_prompts((7, 19, 4, 30), seed=3)
    free = [o.outputs[0].token_ids for o in sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                                                     ignore_eos=True))]
    # Stop each request on its 3rd..6th token.
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[toks[2 + i]])
              for i, toks in enumerate(free)]
    expected = engine_outputs(sync, prompts, params)
    before = async_.stats.num_generated_tokens
    got = engine_outputs(async_, prompts, params)
    assert_same_outputs(got, expected)
    assert all(c[0][1] == "stop" for c in got)
    assert async_.stats.num_generated_tokens - before == sum(len(c[0][0]) for c in got), \
        "discarded tokens count as generated"


def test_eos_stops_a_request_on_the_token_that_matches_it(engines, monkeypatch):
    """EOS (the model's ``eos_token_id``, unless ``ignore_eos``) ends a request on its first occurrence, with
    reason "stop", through the record's short path for plain decode rows (no stop ids, strings or
    logprobs), synchronous and async (where the step run past it is discarded)."""
    prompts = random_prompts((7, 19, 4, 30), seed=5)
    greedy = dict(temperature=0.0, max_tokens=12)
    free = [o.outputs[0].token_ids for o in engines[0].generate(prompts, SamplingParams(**greedy, ignore_eos=True))]
    eos = free[0][3]  # some request's 4th token; the others stop where they first meet it, if they do
    want = [toks[: toks.index(eos) + 1] if eos in toks else toks for toks in free]
    for llm in engines:
        monkeypatch.setattr(llm.engine_core.step_loop, "cfg", dataclasses.replace(llm.cfg, eos_token_id=(eos,)))
        got = engine_outputs(llm, prompts, SamplingParams(**greedy))
        assert [c[0][0] for c in got] == want
        assert [c[0][1] for c in got] == ["stop" if eos in toks else "length" for toks in free]
        assert [c[0][0] for c in engine_outputs(llm, prompts, SamplingParams(**greedy, ignore_eos=True))] == free


def test_steps_overlap_the_host(ckpt, monkeypatch):
    """The engine dispatches step N+1 before it reads step N back (for a steady batch of decodes),
    and the rows of step N+1 take their last token from step N's device output."""
    llm = LLM(ckpt, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, async_scheduling=True)
    events = []
    runner = llm.runner
    real_dispatch, real_collect = runner.dispatch, runner.collect

    def dispatch(sched):
        step = real_dispatch(sched)
        events.append(("dispatch", id(step)))
        return step

    def collect(step):
        events.append(("collect", id(step)))
        return real_collect(step)

    monkeypatch.setattr(runner, "dispatch", dispatch)
    monkeypatch.setattr(runner, "collect", collect)
    prompts = random_prompts((5, 9, 3, 12), seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    kinds = [k for k, _ in events]
    # Every collect but the last comes right after the next step's dispatch.
    collected = [i for i, k in enumerate(kinds) if k == "collect"]
    assert all(kinds[i - 1] == "dispatch" and events[i - 1][1] != events[i][1] for i in collected[:-1])
    assert kinds.count("dispatch") == kinds.count("collect") == 8


def test_fallbacks_run_synchronously(ckpt):
    """Speculative decoding (acceptance moves a request by an unknown count) and prefix caching
    (commits feed the next schedule) run each step to completion."""
    for args in (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                 dict(enable_prefix_caching=True)):
        llm = LLM(ckpt, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, async_scheduling=True, **args)
        llm.add_request(random_prompts((9,))[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while llm.has_unfinished_requests():
            llm.step()
            assert llm._inflight is None
        llm.check_invariants()


def test_abort_while_a_step_is_in_flight(ckpt):
    llm = LLM(ckpt, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(random_prompts((5, 8, 11))):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(3):
        engine.step()
    assert llm._inflight is not None
    engine.abort_request("r1")
    seen: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = out.outputs[0].token_ids
    assert "r1" not in seen and all(len(seen[r]) == 10 for r in ("r0", "r2"))
    llm.check_invariants()
    s = llm.stats
    assert s.slots_in_use == 0 and s.blocks_in_use == 0


def _engine_with_reference(ckpt, async_dispatch: str = "auto"):
    """An async engine, three prompts, greedy params and the tokens the engine gives them undisturbed."""
    llm = LLM(ckpt, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, async_scheduling=True,
              async_dispatch=async_dispatch)
    prompts = random_prompts((5, 9, 3))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return llm, prompts, greedy, [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]


def _third_call(fn, fault, *, before: bool):
    """``fn`` with ``fault()`` (which raises or signals) run at its third call, ``before`` or after ``fn`` runs."""
    calls = []

    def call(*args, **kwargs):
        calls.append(1)
        if before and len(calls) == 3:
            fault()
        out = fn(*args, **kwargs)
        if not before and len(calls) == 3:
            fault()
        return out

    return call


@pytest.mark.parametrize("where", ["read-back", "inline enqueue"])
def test_a_failed_read_back_or_enqueue_fails_its_requests_and_the_engine_goes_on(ckpt, monkeypatch, where):
    """A step whose read-back (``collect``) or, with ``async_dispatch="inline"``, whose enqueue on the engine
    thread (``CompiledSteps.dispatch``) raises fails its requests; the engine then serves on to the same tokens."""
    llm, prompts, greedy, reference = _engine_with_reference(ckpt, "inline" if where == "inline enqueue" else "auto")
    owner, name = (llm.runner, "collect") if where == "read-back" else (llm.runner.steps, "dispatch")

    def fall_over():
        raise RuntimeError(f"{where} fell over")

    monkeypatch.setattr(owner, name, _third_call(getattr(owner, name), fall_over, before=True))
    outs = llm.generate(prompts, greedy)
    monkeypatch.undo()
    assert all(o.finished and f"{where} fell over" in o.error for o in outs)
    llm.check_invariants()
    assert not llm.has_unfinished_requests() and llm.stats.blocks_in_use == 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == reference


def test_keyboard_interrupt_leaves_nothing_in_flight(ckpt, monkeypatch):
    llm, prompts, greedy, reference = _engine_with_reference(ckpt)
    real = llm.runner.dispatch
    calls = []

    def dispatch(sched):
        step = real(sched)
        calls.append(1)
        if len(calls) == 3:
            llm.runner.interrupted = True  # what a held-back Ctrl-C sets
        return step

    monkeypatch.setattr(llm.runner, "dispatch", dispatch)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy)
    monkeypatch.undo()
    assert llm._inflight is None
    llm.check_invariants()
    assert not llm.scheduler.has_work, "generate aborts its requests when interrupted"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == reference


def test_recording_a_step_says_whether_the_requests_already_advanced():
    """``StepLoop._record`` applies a step synchronously (advanced=False) or one step late under async
    scheduling (advanced=True: computed counts already include it); no default can pick the wrong one."""
    from jaxmamba.engine.step_loop import StepLoop

    with pytest.raises(TypeError, match="advanced"):
        StepLoop._record(None, None, [])


def test_every_host_pass_of_an_async_step_is_timed_in_a_phase(engines, monkeypatch):
    """The host profile's CPU per output token sums its phases: the pass that advances the dispatched rows'
    counts ran outside all of them (uncounted) until it was timed as the schedule phase."""
    from jaxmamba.engine.step_loop import StepLoop
    from jaxmamba.host_profile import HostProfile, _Phase

    _, async_ = engines
    open_phases: list[str] = []
    enter, leave = _Phase.__enter__, _Phase.__exit__
    monkeypatch.setattr(_Phase, "__enter__", lambda self: (open_phases.append(self.name), enter(self))[1])
    monkeypatch.setattr(_Phase, "__exit__", lambda self, *exc: (open_phases.pop(), leave(self, *exc))[1])
    seen = []
    advance = StepLoop._advance_dispatched
    monkeypatch.setattr(StepLoop, "_advance_dispatched",
                        staticmethod(lambda rows: (seen.append(tuple(open_phases)), advance(rows))[1]))
    async_.host_profile = HostProfile()
    try:
        async_.generate(random_prompts((5, 9)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    finally:
        async_.host_profile = None
    assert seen and set(seen) == {("schedule",)}, seen


def test_a_read_back_steps_device_arrays_are_freed_on_the_dispatch_thread(ckpt, monkeypatch):
    """Freeing a step's device outputs cost the engine thread ~60 us a step; the next job drops them on the
    dispatch thread instead (ModelRunner.dispatch); only the steps read back after the last dispatch (the last
    two of the eight) wait for a next one."""
    import threading
    import weakref

    llm = LLM(ckpt, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, async_scheduling=True)
    runner, freed_on = llm.runner, []
    real_dispatch = runner.dispatch

    def dispatch(sched):
        step = real_dispatch(sched)
        weakref.finalize(step.future, lambda: freed_on.append(threading.current_thread().name))
        return step

    monkeypatch.setattr(runner, "dispatch", dispatch)
    llm.generate(random_prompts((5, 9, 3, 12), seed=2), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(freed_on) == 6 and len(runner._retired) == 2
    assert all(name.startswith("jaxmamba-dispatch") for name in freed_on), freed_on


# ------------------------------------------------------------------------------ async_dispatch="inline"
def test_inline_dispatch_enqueues_on_the_engine_thread_and_auto_picks_the_thread_on_a_cpu(ckpt, monkeypatch):
    import threading

    from jaxmamba.errors import ConfigError

    llm = LLM(ckpt, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, async_dispatch="inline")
    assert llm.config.async_dispatch == "inline" and llm.runner.dispatch_inline
    ran_on = []
    real = llm.runner.steps.dispatch
    monkeypatch.setattr(llm.runner.steps, "dispatch",
                        lambda *a, **k: (ran_on.append(threading.current_thread().name), real(*a, **k))[1])
    llm.generate(random_prompts((5, 9, 3)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert ran_on and set(ran_on) == {threading.current_thread().name} and llm.runner._dispatcher is None
    # "auto": XLA's CPU client runs a step on the calling thread, so a CPU device keeps the dispatch thread.
    auto = LLM(ckpt, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    assert auto.config.async_dispatch == "thread" and not auto.runner.dispatch_inline
    with pytest.raises(ConfigError, match="async_dispatch='gpu'"):
        LLM(ckpt, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, async_dispatch="gpu")


def test_sigint_during_an_inline_dispatch_is_raised_once_the_step_is_recorded(ckpt, monkeypatch):
    """Ctrl-C while the engine thread enqueues a step (the step has the caches, donated) is held back as in a
    synchronous step: raised once the step's results are recorded, nothing lost, the requests carry on."""
    import signal

    llm, prompts, greedy, reference = _engine_with_reference(ckpt, "inline")
    monkeypatch.setattr(llm.runner.steps, "dispatch",
                        _third_call(llm.runner.steps.dispatch, lambda: signal.raise_signal(signal.SIGINT), before=False))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy)
    monkeypatch.undo()
    assert not llm.runner.caches_lost(), "the step was enqueued whole: nothing was lost"
    llm.check_invariants()
    assert not llm.scheduler.has_work, "generate aborts its requests when interrupted"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == reference
