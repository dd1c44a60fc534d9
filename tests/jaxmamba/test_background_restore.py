"""Restoring in the background (docs/architecture.md, "Restoring in the background"): an eager engine whose
executable cache holds its programs returns before deserialising them, serves meanwhile (a step waits for its
own program, which is restored next), computes what a cold engine computes, and compiles nothing; an entry the
runtime refuses is compiled on the restore thread, not on the serving path."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

import jaxmamba
from jaxmamba.compile_cache import ExecutableCache
from jaxmamba.errors import ConfigError
from jaxmamba.program_builder import BackgroundRestore, BuildStats, Program, ProgramBuilder
from warm_engines import executables_in, greedy_tokens, small_engine



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return jaxmamba.random_model("nemotron_h", path=tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def filled(tiny, tmp_path_factory):
    """``(cache directory, tokens)``: a cold engine's executables and its greedy tokens for ``PROMPTS``."""
    directory = tmp_path_factory.mktemp("steps")
    with pytest.MonkeyPatch.context() as mp:
        _cache_in(mp, directory)
        cold = _engine(tiny)
        assert cold.startup_times.num_compiled == cold.stats.num_step_programs
        return directory, _tokens(cold)


_engine, _tokens, _cache_in = small_engine, greedy_tokens, executables_in


# ------------------------------------------------------------------------------ BackgroundRestore alone
class _Cache:
    """A cache whose entries deserialise to ``("exe", key)``; ``refuse``: keys the runtime refuses."""

    def __init__(self, refuse=(), fail=()):
        self.refuse, self.fail, self.rejected, self.order = set(refuse), set(fail), [], []

    def deserialize(self, key, entry):
        self.order.append(key)
        if key in self.fail:
            raise MemoryError(f"deserialising {key}")
        return None if key in self.refuse else (("exe", key), {"entry": entry})


class _Builder:
    def __init__(self, cache):
        self.cache, self.ready, self.compiled = cache, [], []
        self.on_ready = lambda program, exe, extra, from_cache: self.ready.append((program.key, exe, from_cache))

    def _compile_one(self, program, lowered):
        self.compiled.append(program.key)
        return ("compiled", lowered), None, 0.5, False


def _entries(keys):
    return [(Program(key, lambda key=key: f"lowered {key}", f"k{key}"), ("entry", key)) for key in keys]


def test_the_restore_thread_takes_its_queue_in_order_and_a_waited_program_first():
    cache = _Cache()
    builder = _Builder(cache)
    gate = threading.Event()
    stop = threading.Event()
    run = BackgroundRestore._run
    BackgroundRestore._run = lambda self: (gate.wait(30), run(self))[1]  # hold the thread until the test says
    try:
        restore = BackgroundRestore(builder, _entries([0, 1, 2, 3]), stop)
    finally:
        BackgroundRestore._run = run
    restore.want(2)  # as a step that needs program 2 would, before the thread starts
    gate.set()
    assert restore.join(30)
    assert cache.order == ["k2", "k0", "k1", "k3"]
    assert [key for key, _, _ in builder.ready] == [2, 0, 1, 3]
    assert all(from_cache for _, _, from_cache in builder.ready) and not builder.compiled
    assert (restore.stats.num_restored, restore.stats.num_compiled) == (4, 0)
    restore.wait(3)  # already in: returns at once


def test_an_entry_the_runtime_refuses_is_lowered_and_compiled_on_the_restore_thread():
    cache = _Cache(refuse={"k1"})
    builder = _Builder(cache)
    restore = BackgroundRestore(builder, _entries([0, 1]), threading.Event())
    restore.wait(1)
    assert restore.join(30)
    assert builder.compiled == [1]
    assert builder.ready[1] == (1, ("compiled", "lowered 1"), False)
    assert (restore.stats.num_restored, restore.stats.num_compiled) == (1, 1)


def test_a_restore_that_fails_or_stops_raises_in_whoever_waits_for_its_programs():
    restore = BackgroundRestore(_Builder(_Cache(fail={"k1"})), _entries([0, 1, 2]), threading.Event())
    with pytest.raises(RuntimeError, match="ended without program 2") as err:
        restore.wait(2)  # program 2 is moved ahead of 1, but 1 may already be deserialising; either way it fails
    if not isinstance(err.value.__cause__, MemoryError):  # 2 went first and came in; then 1 failed
        pytest.fail(f"expected the MemoryError as the cause, got {err.value.__cause__!r}")

    stop = threading.Event()
    stop.set()
    stopped = BackgroundRestore(_Builder(_Cache()), _entries([0]), stop)
    with pytest.raises(RuntimeError, match="ended without program 0"):
        stopped.wait(0)


# ------------------------------------------------------------------------------------- the engine
def test_a_warm_engine_serves_while_its_programs_restore_and_computes_the_cold_tokens(tiny, filled, monkeypatch):
    directory, expected = filled
    _cache_in(monkeypatch, directory)
    gate = threading.Event()
    run, want = BackgroundRestore._run, BackgroundRestore.want
    # The restore thread starts only once the first step asks for its program: that program must come first.
    monkeypatch.setattr(BackgroundRestore, "_run", lambda self: (gate.wait(300), run(self))[1])
    monkeypatch.setattr(BackgroundRestore, "want", lambda self, key: (want(self, key), gate.set())[0])
    llm = _engine(tiny)
    steps = llm.runner.steps
    planned = llm.stats.num_step_programs
    t = llm.startup_times
    assert (t.num_restored, t.num_restoring, t.num_compiled) == (planned, planned, 0)
    assert (t.total_backend_compiles, t.total_lowerings) == (0, 0)
    assert steps.programs_ready == 0 and steps.buckets == steps.all_buckets  # every bucket may be chosen
    asked = []  # the programs the steps asked for, in order
    program = steps._program
    steps._program = lambda key: (asked.append(key), program(key))[1]
    assert _tokens(llm) == expected
    assert next(iter(steps._executables)) == asked[0]  # restored first: the program the first step needed
    assert steps.wait_ready(300)
    assert steps.programs_ready == planned and llm.stats.num_programs_restored == planned
    assert (steps.build_stats.num_restored, steps.build_stats.num_compiled) == (planned, 0)
    assert llm.stats.backend_compiles_since_warmup == 0


def test_a_program_the_runtime_refuses_is_compiled_in_the_background_not_while_serving(tiny, filled, monkeypatch):
    directory, expected = filled
    _cache_in(monkeypatch, directory)
    deserialize = ExecutableCache.deserialize
    refused = []

    def refuse_the_first(self, key, entry):  # of the step programs (the device tables' scatters restore too)
        if not refused and threading.current_thread().name == "jaxmamba-restore":
            refused.append(key)
            self.rejected.append(f"{key}: refused (test)")
            return None
        return deserialize(self, key, entry)

    monkeypatch.setattr(ExecutableCache, "deserialize", refuse_the_first)
    llm = _engine(tiny)
    assert _tokens(llm) == expected
    assert llm.runner.steps.wait_ready(300)
    build = llm.runner.steps.build_stats
    assert (build.num_compiled, build.num_restored) == (1, llm.stats.num_step_programs - 1)
    assert any("refused (test)" in r for r in build.rejected)
    assert llm.stats.backend_compiles_since_warmup == 0  # the restore thread's compile is not serving's


def test_restore_eager_deserialises_every_program_before_the_constructor_returns(tiny, filled, monkeypatch):
    directory, expected = filled
    _cache_in(monkeypatch, directory)
    llm = _engine(tiny, restore="eager")
    planned = llm.stats.num_step_programs
    assert llm.runner.steps.programs_ready == planned
    assert (llm.startup_times.num_restored, llm.startup_times.num_restoring) == (planned, 0)
    assert _tokens(llm) == expected
    with pytest.raises(ConfigError, match="restore='later' must be one of"):
        _engine(tiny, restore="later")


def test_bench_startup_counts_the_background_restore_in_its_row():
    from jaxmamba.bench.startup import format_row, header

    phases = dict(weight_loading_s=0.2, cache_setup_s=0.0, lowering_s=0.0, backend_compile_s=0.0,
                  cache_restore_s=0.0, num_compiled=0, num_restored=15, num_restoring=15, build_threads=1,
                  total_backend_compiles=0, total_lowerings=0)
    row = format_row("this warm", dict(construct_s=0.5, first_token_s=0.75, all_in_s=6.0, load_before="1",
                                        load_after="1", import_s=1.0, phases=phases,
                                        build=vars(BuildStats(restore_s=5.5, num_restored=15))))

    def under(label):  # the value right-aligned under ``label``
        end = header().index(label) + len(label)
        return row[:end].split()[-1]

    assert (under("restore"), under("comp/rest"), under("to 1st"), under("all in")) == ("5.5", "0/15", "1.25", "6.0")


def test_an_engine_whose_restore_fails_says_which_program_it_lacks(tiny, filled, monkeypatch):
    directory, _ = filled
    _cache_in(monkeypatch, directory)
    restore_or_compile = BackgroundRestore._restore_or_compile

    def fail_on_the_second(self, program, entry):
        if self.stats.num_restored == 1:
            raise MemoryError("out of host memory (test)")
        return restore_or_compile(self, program, entry)

    monkeypatch.setattr(BackgroundRestore, "_restore_or_compile", fail_on_the_second)
    llm = _engine(tiny)
    with pytest.raises(RuntimeError, match="the background restore ended without program") as err:
        llm.runner.steps.wait_ready(300)
    assert isinstance(err.value.__cause__, MemoryError)
    assert llm.runner.steps.programs_ready == 1



def test_an_engine_dropped_after_its_restore_is_freed_without_a_garbage_collection(tiny, filled, monkeypatch):
    """The restore's builder holds the engine's bound methods and the engine holds the restore: once the thread
    is done it lets the builder go, so a dropped engine's programs (thousands of memory maps of machine code
    each; a process has 65530) are freed at once. Engines made one after another in one process (a notebook,
    a test session) ran out of maps and crashed in XLA's loader before."""
    directory, _ = filled
    _cache_in(monkeypatch, directory)
    llm = _engine(tiny)
    steps = llm.runner.steps
    assert steps.num_deferred_restores and steps._restore.join(300)
    gone = weakref.ref(steps)
    del llm, steps
    gc.disable()  # only reference counting frees it now
    try:
        assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    finally:
        gc.enable()


def _drop(engines: list) -> tuple[bool, bool]:
    """Pop the engine from ``engines``, its only reference, with the collector off: whether the engine and its
    ``CompiledSteps`` are then freed (what still holds the steps is printed if they are not)."""
    engine, steps = weakref.ref(engines[0]), weakref.ref(engines[0].runner.steps)
    gc.disable()
    try:
        engines.pop()
        if steps() is not None:
            print("CompiledSteps held by", [type(r).__name__ for r in gc.get_referrers(steps())])
        return engine() is None, steps() is None
    finally:
        gc.enable()


def test_an_engine_dropped_while_its_programs_restore_is_freed_and_its_restore_stops(tiny, filled, monkeypatch):
    """The restore thread held the engine (its builder's callbacks and its programs' lowerings were the engine's
    bound methods): a dropped engine lived on, and its restore deserialised every program, until the queue was
    done. Now the thread holds it weakly; once it is freed the restore ends after the program at hand."""
    directory, _ = filled
    _cache_in(monkeypatch, directory)
    held, gate = threading.Event(), threading.Event()
    restore_or_compile = BackgroundRestore._restore_or_compile

    def held_at_the_second(self, program, entry):  # the first program comes in, then the thread waits
        if self.stats.num_restored == 1:
            held.set()
            gate.wait(300)
        return restore_or_compile(self, program, entry)

    monkeypatch.setattr(BackgroundRestore, "_restore_or_compile", held_at_the_second)
    engines = [_engine(tiny)]
    restore, queued = engines[0].runner.steps._restore, engines[0].runner.steps.num_deferred_restores
    assert queued > 2 and held.wait(300)
    try:
        freed = _drop(engines)
    finally:
        gate.set()
    assert freed == (True, True)
    assert restore._stop.is_set()  # by the engine's finalizer, so the thread takes no further program
    assert restore.join(60)
    assert restore.stats.num_restored == 2 < queued  # the one it was restoring, not the rest of its queue


def test_a_lazy_engine_dropped_while_it_builds_is_freed_and_its_build_stops(tiny, filled, monkeypatch):
    """The same for a lazy build, whose thread's target was the engine's bound method."""
    directory, _ = filled
    _cache_in(monkeypatch, directory)  # the rest would restore: quick, if it were built
    held, gate, built = threading.Event(), threading.Event(), []
    build = ProgramBuilder.build

    def held_build(self, programs, stop=None):  # the background part waits until the test lets it go
        if threading.current_thread().name != "jaxmamba-lazy-compile":
            return build(self, programs, stop)
        held.set()
        gate.wait(300)
        stats = build(self, programs, stop)
        built.append((len(programs), stats.num_restored + stats.num_compiled))
        return stats

    monkeypatch.setattr(ProgramBuilder, "build", held_build)
    engines = [_engine(tiny, compile="lazy")]
    rest = engines[0].stats.num_step_programs - engines[0].stats.num_programs_ready
    assert rest > 0 and held.wait(300)
    thread = next(t for t in threading.enumerate() if t.name == "jaxmamba-lazy-compile")
    try:
        freed = _drop(engines)
    finally:
        gate.set()
    assert freed == (True, True)
    thread.join(60)
    assert not thread.is_alive()
    assert built == [(rest, 0)]  # stopped before its first program
