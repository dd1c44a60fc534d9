"""Start-up (docs/architecture.md, "Compilation caches"): a short bucket ladder, executables restored
whole from the cache (a warm start compiles nothing; a corrupt or foreign entry is recompiled, never
loaded), lazy compilation, and plan's Ctrl-C."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import jaxmamba
from jaxmamba import LLM, SamplingParams
from jaxmamba import compile_cache, cpu_heap
from jaxmamba.compile_cache import ExecutableCache
from jaxmamba.compile_progress import CompileProgress
from jaxmamba.program_builder import ProgramBuilder, default_workers, host_cores
from jaxmamba.sampling import GREEDY
from jaxmamba.steps import Bucket, bucket_sampling_variants, default_buckets, ladder, select_bucket
from stand_in_gpu import StandInH100
from warm_engines import executables_in, greedy_tokens, small_engine

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return jaxmamba.random_model("nemotron_h", path=tmp_path_factory.mktemp("tiny") / "ckpt")


def _programs(buckets) -> int:
    return sum(len(bucket_sampling_variants(b)) for b in buckets)


def test_the_default_ladder_at_vllms_serving_defaults_is_at_most_24_programs():
    buckets = default_buckets(256, 8192)
    assert _programs(buckets) <= 24, (len(buckets), _programs(buckets))
    assert ladder(1, 256) == [1, 4, 16, 64, 128, 256]  # coarse, with the top half: loaded engines run there
    assert ladder(16, 256) == [16, 32, 64, 128, 256]  # few rungs: every one kept (bench serve's defaults)
    # Every batch an engine can schedule has a bucket; a loaded engine's steady steps pad at most 2x in rows.
    for rows in (1, 3, 65, 129, 200, 256):
        decode = select_bucket(buckets, rows, rows, decode_only=True)
        assert decode.decode_only and rows <= decode.num_reqs <= max(4, 2 * rows)
    assert select_bucket(buckets, 250, 254, decode_only=False, num_prefills=2) == Bucket(256, 256, False, 4)
    assert select_bucket(buckets, 256, 8192, decode_only=False) == Bucket(8192, 256, False, 256)


def test_the_executable_cache_rejects_truncated_and_foreign_entries(tmp_path):
    import jax
    import jax.numpy as jnp

    from jaxmamba.compile_cache import _entry_is_for, persistent_cache_reads

    cache = ExecutableCache(tmp_path)
    compiled = {}
    # Compiled, or returned by JAX's persistent cache (then stored from its entry, as compile_and_store does).
    ones = jnp.ones(3)
    for k in (2, 3):
        lowered = jax.jit(lambda x, k=k: x * k - 0.8125).lower(ones)
        with persistent_cache_reads() as reads:
            compiled[k] = lowered.compile(), reads.serialized if _entry_is_for(reads, lowered) else None
    k2, k3 = cache.key({"program": "double"}), cache.key({"program": "triple"})
    assert k2 != k3 and cache.key({"program": "double"}) == k2
    assert cache.store(k2, compiled[2][0], "extra", serialized_executable=compiled[2][1]), cache.rejected
    assert cache.store(k3, compiled[3][0], serialized_executable=compiled[3][1]), cache.rejected
    executable, extra = cache.load(k2)
    assert extra == "extra" and float(executable(ones)[0]) == 2.0 - 0.8125
    (tmp_path / f"{k3}.exe").write_bytes((tmp_path / f"{k2}.exe").read_bytes())  # double's, under triple's key
    assert cache.load(k3) is None and "written for key" in cache.rejected[-1]
    data = (tmp_path / f"{k2}.exe").read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # one byte of the serialised executable
    (tmp_path / f"{k2}.exe").write_bytes(bytes(flipped))
    assert cache.load(k2) is None and "digest" in cache.rejected[-1]
    (tmp_path / f"{k2}.exe").write_bytes(data[:-100])
    assert cache.load(k2) is None and "truncated" in cache.rejected[-1]
    (tmp_path / f"{k2}.exe").write_bytes(data[:40])
    assert cache.load(k2) is None and "truncated" in cache.rejected[-1]
    (tmp_path / f"{k2}.exe").write_bytes(data.replace(b"jaxmamba-executable-v2", b"jaxmamba-executable-v1", 1))
    assert cache.load(k2) is None and "version" in cache.rejected[-1]  # an older file format
    assert cache.load(cache.key({"program": "absent"})) is None


def test_a_persistent_cache_entry_of_another_program_is_never_stored_as_this_one():
    """A compile that also ran another program (``jnp.ones`` made inside it) read that program's cache entry:
    stored under the compiled program's key it restored the wrong executable (``RuntimeProgramInputMismatch``)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.serialize_executable import serialize

    from jaxmamba.compile_cache import _entry_is_for, persistent_cache_reads

    def scaled(x):
        return x * 5 - 0.375

    def other_program(x):
        return jnp.sin(x) + 0.625

    x = jnp.ones(3)
    this, other = jax.jit(scaled).lower(x), jax.jit(other_program).lower(x)
    entry = {name: serialize(lowered.compile())[0] for name, lowered in (("this", this), ("other", other))}
    with persistent_cache_reads() as reads:
        pass
    assert not _entry_is_for(reads, this)  # nothing read
    reads.serialized, reads.count = entry["this"], 1
    assert _entry_is_for(reads, this)
    reads.serialized = entry["other"]  # what the compile of `this` read was the other program's entry
    assert not _entry_is_for(reads, this)
    reads.serialized, reads.count = entry["this"], 2  # two entries read: which is whose cannot be told
    assert not _entry_is_for(reads, this)


def test_the_key_names_jax_the_code_and_the_host(monkeypatch):
    """Another jax (or jaxlib, flax), another source tree, other XLA flags or another CPU: another key, so an
    entry written under them is never looked up."""
    import jax

    description = {"program": "double"}
    key = ExecutableCache.key(description)
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    assert ExecutableCache.key(description) != key
    monkeypatch.undo()
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    assert ExecutableCache.key(description) != key
    monkeypatch.undo()
    monkeypatch.setattr(compile_cache, "source_digest", lambda: "an edited package")
    assert ExecutableCache.key(description) != key
    monkeypatch.undo()
    if jax.default_backend() == "cpu":
        monkeypatch.setattr(compile_cache, "_host_cpu", lambda: "another instruction set")
        assert ExecutableCache.key(description) != key
    monkeypatch.undo()
    assert ExecutableCache.key(description) == key


def test_an_executable_jaxs_persistent_cache_returned_is_stored_with_its_code(tmp_path):
    """The root of the restored executables that failed to run ("Function ... not found", jax 0.10.2 CPU): an
    executable JAX's persistent cache returned is a deserialised one, and XLA's CPU client serialises that
    without its machine code. Stored from the bytes of its cache entry it runs; stored as it serialises it is
    refused (at store, and at load for a file written without the check), never kept to fail later."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.serialize_executable import serialize

    from jaxmamba.compile_cache import _lacks_object_code, persistent_cache_reads

    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("needs the test session's JAX persistent cache (tests/conftest.py)")
    x = jnp.arange(4.0)
    jax.jit(lambda x: jnp.sin(x) * 7 + 1).lower(x).compile()  # compiled (and written), or already there
    jax.clear_caches()
    with persistent_cache_reads() as reads:
        hit = jax.jit(lambda x: jnp.sin(x) * 7 + 1).lower(x).compile()
    assert reads.serialized is not None, "the second compile was not answered by the persistent cache"
    expected = jnp.sin(x) * 7 + 1
    cache = ExecutableCache(tmp_path)
    key = cache.key({"program": "sin7"})
    code_less = _lacks_object_code(serialize(hit)[0])
    if code_less:  # jax 0.10.2's CPU client: refused, not stored to fail at its first run
        assert not cache.store(key, hit) and "no object code" in cache.rejected[-1]
        assert not cache.contains(key)
    assert cache.store(key, hit, serialized_executable=reads.serialized)
    restored, _ = cache.load(key)
    assert jnp.allclose(restored(x), expected)
    if code_less:  # a file holding the code-less serialisation (as the old guard wrote them) is not loaded
        import hashlib
        import pickle

        from jaxmamba.compile_cache import _MAGIC

        payload = pickle.dumps((*serialize(hit), None))
        cache._path(key).write_bytes(_MAGIC + key.encode() + hashlib.sha256(payload).hexdigest().encode() + payload)
        assert cache.load(key) is None and "no object code" in cache.rejected[-1]


def test_the_executable_cache_is_on_by_default_and_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.delenv(compile_cache.EXECUTABLE_CACHE_ENV_VAR, raising=False)
    assert isinstance(compile_cache.executable_cache_for(tmp_path), ExecutableCache)
    assert compile_cache.executable_cache_for(tmp_path, False) is None
    assert compile_cache.executable_cache_for(None) is None  # no compilation cache directory: nowhere to keep it
    for off in ("0", "off", "none", "false"):
        monkeypatch.setenv(compile_cache.EXECUTABLE_CACHE_ENV_VAR, off)
        assert compile_cache.executable_cache_for(tmp_path) is None
        assert isinstance(compile_cache.executable_cache_for(tmp_path, True), ExecutableCache)  # the argument wins
    monkeypatch.setenv(compile_cache.EXECUTABLE_CACHE_ENV_VAR, "1")
    assert isinstance(compile_cache.executable_cache_for(tmp_path), ExecutableCache)


_engine, _tokens, _cache_in = small_engine, greedy_tokens, executables_in


def test_cpu_programs_build_one_at_a_time_where_threads_share_one_malloc_arena(monkeypatch):
    """Under ``cpu_heap``'s one arena two XLA CPU compiles side by side ran 3x slower each (program_builder):
    the CPU's programs build on one thread there; elsewhere, and for a GPU target's programs, on the cores."""
    monkeypatch.setattr("jaxmamba.program_builder.host_cores", lambda: 6)
    monkeypatch.setitem(cpu_heap._state, "applied", True)
    assert cpu_heap.shares_one_arena()
    assert (default_workers(compiles_for_cpu=True), default_workers(compiles_for_cpu=False)) == (1, 6)
    monkeypatch.setitem(cpu_heap._state, "applied", False)
    assert (default_workers(compiles_for_cpu=True), default_workers(compiles_for_cpu=False)) == (6, 6)


def test_an_engine_on_the_cpu_builds_its_programs_on_one_thread(tiny):
    """The engine's steps take ``default_workers``' answer for its CPU programs in this process (one thread on
    this CPU host, whose threads share one arena unless ``JAXMAMBA_CPU_HEAP=0``)."""
    engine = LLM(tiny, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, buckets=[(2, 16)],
                 compile_cache=None, compile_progress=False)
    assert engine.runner.steps.build_workers == (1 if cpu_heap.shares_one_arena() else host_cores())
    assert engine.startup_times.build_threads == engine.runner.steps.build_workers  # bench startup's "threads"


def test_bench_startup_prints_the_build_threads_under_their_heading():
    """A baseline checkout without ``build_threads`` shows a dash in that column."""
    from jaxmamba.bench.startup import format_row, header
    from jaxmamba.engine.stats import StartupTimes

    base = dict(construct_s=4.2, first_token_s=0.1, load_before="1", load_after="1", import_s=1.0)
    ours = format_row("this warm", {**base, "phases": dataclasses.asdict(StartupTimes(num_restored=15, build_threads=1))})
    old = {k: v for k, v in dataclasses.asdict(StartupTimes(num_restored=15)).items() if k != "build_threads"}
    theirs = format_row("baseline warm", {**base, "phases": old})
    column = header().index("threads") + len("threads")
    assert ours[column - 1] == "1" and theirs[column - 1] == "-"
    assert ours[column:].split()[0] == theirs[column:].split()[0] == "0/15"


def test_a_warm_start_lowers_and_compiles_nothing(tiny, tmp_path, monkeypatch):
    """Default on, in a process whose JAX persistent cache already holds the programs (the case that failed):
    the first engine with the executable cache gets them from JAX's cache and stores them with their code; the
    next restores every one, with no lowering and no backend compile, and computes the same tokens."""
    cache_dir = tmp_path / "steps"
    _cache_in(monkeypatch, cache_dir)
    small = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, buckets=[(2, 16), (16, 16)],
                 sampling_variants="full", compile_progress=False)
    without = LLM(tiny, executable_cache=False, **small)  # fills JAX's persistent cache (if a run has not)
    planned = without.stats.num_step_programs
    assert planned == 2 and not cache_dir.exists()
    expected = _tokens(without)

    filling = LLM(tiny, **small)
    assert filling.runner.steps.build_stats.num_jax_cache_hits == planned
    assert all((cache_dir / f"{key}.exe").exists() for key in filling.runner.steps.cache_keys.values())

    warm = LLM(tiny, **small)
    t = warm.startup_times
    assert (t.num_restored, t.num_compiled, t.lowering_s) == (planned, 0, 0.0)
    assert (t.backend_compiles, t.lowerings) == (0, 0)  # nothing traced, lowered or compiled to build the steps
    # ... nor anywhere in the construction: the pools' allocator and the device tables' scatters are restored too.
    assert (t.total_backend_compiles, t.total_lowerings) == (0, 0)
    assert _tokens(warm) == expected
    assert warm.stats.backend_compiles_since_warmup == 0


def test_a_warm_start_on_a_gpu_sizes_its_pools_as_the_cold_one(tiny, tmp_path, monkeypatch):
    """The engine's GPU choices on the CPU: ``jax.default_backend()`` says "gpu" (greedy tails for buckets of 16
    rows, steps enqueued on the engine thread, compiles on a thread pool, the pools sized from a compiled probe
    of the largest bucket: ``gpu_cache_budget``) and the sizing module sees a stand-in H100 (a device with a
    memory limit). A warm start restores the probe through the executable cache (it raised KeyError when the
    probe's memory was read before its background restore was in) and gets the cold start's pools; both give
    a CPU engine's tokens, greedy and sampled."""
    import jax

    from jaxmamba.engine import sizing

    class GpuDevice:  # the budget's device memory; everything else as jax has it
        def __getattr__(self, name):
            return getattr(jax, name)

        def devices(self, *a):
            return [StandInH100(1 << 30)]

    engine = dict(max_num_seqs=16, max_num_batched_tokens=32, max_model_len=64, buckets=[(16, 16, 4), (16, 32)],
                  kernel_backend="reference", compile_progress=False)
    prompts = [[1 + i, 2, 3 + i] for i in range(16)]

    def tokens(llm):
        return [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for params in (
            SamplingParams(temperature=0.0, max_tokens=6),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=6))]

    executables_in(monkeypatch, tmp_path / "steps")
    with monkeypatch.context() as gpu:
        gpu.setattr(jax, "default_backend", lambda: "gpu")
        gpu.setattr(sizing, "jax", GpuDevice())
        probes = []
        probe = sizing.largest_bucket_temp_bytes
        gpu.setattr(sizing, "largest_bucket_temp_bytes", lambda *a, **kw: probe(*a, builds=probes, **kw))
        cold = LLM(tiny, **engine)
        assert cold.runner.dispatch_inline and any(GREEDY in v for v in cold.runner.steps.sampling_variants.values())
        cold_tokens = tokens(cold)
        warm = LLM(tiny, **engine)
        assert [(b.num_compiled, b.num_restored) for b in probes] == [(1, 0), (0, 1)]  # the warm probe restored
        assert warm.engine_core.pools == cold.engine_core.pools
        steps = warm.runner.steps
        assert steps.wait_ready(300) and steps.programs_restored == warm.stats.num_step_programs  # the engine's too
        assert tokens(warm) == cold_tokens
    assert tokens(LLM(tiny, **engine)) == cold_tokens


def test_a_warm_start_restores_every_program_and_compiles_nothing(tiny, tmp_path, monkeypatch, capfd):
    cache_dir = tmp_path / "steps"
    monkeypatch.setattr(compile_cache, "executable_cache_for", lambda *_: ExecutableCache(cache_dir))
    cold = _engine(tiny)
    planned = cold.stats.num_step_programs
    assert cold.startup_times.num_compiled == planned
    expected = _tokens(cold)
    files = [cache_dir / f"{key}.exe" for key in cold.runner.steps.cache_keys.values()]
    assert len(files) == planned and all(f.exists() for f in files)

    warm = LLM(tiny, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, compile_progress=True)
    t = warm.startup_times
    assert (t.num_restored, t.num_compiled, t.lowering_s) == (planned, 0, 0.0)
    assert (t.backend_compiles, t.lowerings) == (0, 0)  # not one lowering or XLA compile building the steps
    assert (t.total_backend_compiles, t.total_lowerings) == (0, 0)  # nor in the whole construction
    assert f"loading {planned} programs from the cache" in capfd.readouterr().err
    assert warm.runner.steps.wait_ready(300)  # the stats count a background restore's programs once they are in
    assert warm.stats.num_programs_restored == planned
    assert _tokens(warm) == expected
    assert warm.stats.backend_compiles_since_warmup == 0

    # A truncated entry and an entry written for another key are rejected and recompiled, never loaded.
    files[0].write_bytes(files[0].read_bytes()[:1000])
    files[2].write_bytes(files[1].read_bytes())
    again = _engine(tiny)
    assert again.startup_times.num_compiled == 2 and again.startup_times.num_restored == planned - 2
    rejected = again.runner.steps.build_stats.rejected
    assert any("truncated" in r for r in rejected) and any("written for key" in r for r in rejected), rejected
    assert _tokens(again) == expected
    assert _engine(tiny).startup_times.num_restored == planned  # rewritten whole

    # Another shape (max_model_len: the block table's width) is another key: compiled, not loaded.
    other = LLM(tiny, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, compile_progress=False)
    assert other.startup_times.num_restored == 0 and other.startup_times.num_compiled == planned
    assert _tokens(other) == expected


def test_a_lazy_engine_serves_from_its_first_buckets_while_the_rest_compile(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "executable_cache_for", lambda *_: None)
    expected = _tokens(_engine(tiny))
    gate = threading.Event()
    build = ProgramBuilder.build

    def held_build(self, programs, stop=None):  # the background part waits until the test lets it go
        if threading.current_thread().name == "jaxmamba-lazy-compile":
            gate.wait(300)
        return build(self, programs, stop)

    monkeypatch.setattr(ProgramBuilder, "build", held_build)
    llm = _engine(tiny, compile="lazy")
    steps = llm.runner.steps
    mixed = [b for b in steps.all_buckets if not b.decode_only]
    dispatched = []
    dispatch = steps.dispatch
    steps.dispatch = lambda bucket, *a, **kw: dispatched.append(bucket) or dispatch(bucket, *a, **kw)
    assert steps.buckets == tuple(sorted([b for b in steps.all_buckets if b.decode_only] + [max(mixed)]))
    ready = llm.stats.num_programs_ready
    assert ready < llm.stats.num_step_programs
    # A small mixed batch takes the largest mixed bucket (the only one built), and nothing compiles to serve it.
    assert select_bucket(steps.buckets, 2, 14, decode_only=False) == max(mixed)
    assert _tokens(llm) == expected
    assert max(mixed) in dispatched
    assert llm.stats.backend_compiles_since_warmup == 0
    gate.set()
    assert steps.wait_ready(300)
    assert llm.stats.num_programs_ready == llm.stats.num_step_programs
    assert steps.buckets == steps.all_buckets
    dispatched.clear()
    assert _tokens(llm) == expected
    # The same batches now take the smallest buckets that hold them (the runner's remembered choices, made
    # while only the largest mixed bucket was built, are dropped when more are).
    assert max(mixed) not in dispatched and any(not b.decode_only for b in dispatched), dispatched
    assert llm.stats.backend_compiles_since_warmup == 0  # the background's compiles are not serving's


def test_plan_stops_at_the_first_ctrl_c_with_status_130(tiny):
    """The first Ctrl-C was ignored while compiling went on; the second killed the process with SIGSEGV."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "jaxmamba", "plan", str(tiny / "config.json"), "--target", "cpu",
                             "--max-num-seqs", "64", "--max-num-batched-tokens", "1024", "--max-model-len", "128"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = []
    reader = threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not any("compiling" in line for line in err) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, "".join(err)[-2000:]
    time.sleep(2)  # inside the build: lowering on the main thread, compiles on the pool
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=60)
    waited = time.monotonic() - sent
    reader.join(5)
    text = "".join(err)
    assert rc == 130, text[-2000:]
    assert waited < 30, waited
    assert "interrupted" in text and "KeyboardInterrupt" not in text


def test_plan_reports_its_programs_and_compile_wall(tiny, tmp_path):
    from jaxmamba.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", str(tiny / "config.json"), "--target", "cpu", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "32", "--max-model-len", "64", "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["num_programs"] == len(data["buckets"]) and data["compile_wall_s"] > 0
    assert data["lowering_s"] > 0 and data["backend_compile_s"] > 0
    # CPU programs in this process (one malloc arena on this CPU host): one build thread (program_builder).
    assert (data["build_threads"], data["one_malloc_arena"]) == ((1, True) if cpu_heap.shares_one_arena()
                                                                else (host_cores(), False))


def test_plan_exits_at_ctrl_c_even_when_the_main_thread_swallows_keyboard_interrupt():
    """On a loaded CI machine a Ctrl-C during the build was lost (a ``KeyboardInterrupt`` raised where Python
    swallows it) and the plan compiled on; the wake-up pipe's watcher ends the process whatever the main
    thread does. Here Python's handler is replaced by one that ignores the signal, as a swallowed one would."""
    code = ("import signal, sys, time\n"
            "from jaxmamba import cli_interrupts as cli\n"
            "stop = cli.exit_at_sigint_from_any_thread(None)\n"
            "stop()\n"  # a watcher stopped puts the previous descriptor back: a second one is installed below
            "cli.exit_at_sigint_from_any_thread(None)\n"
            "signal.signal(signal.SIGINT, lambda *a: None)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n"
            "sys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=30)
    assert rc == 130, proc.stderr.read()[-2000:]
    assert time.monotonic() - sent < 10
    assert "interrupted" in proc.stderr.read()


def test_a_warm_start_that_jaxs_persistent_cache_serves_says_loading(tiny, monkeypatch, capfd):
    """A warm start whose programs JAX's persistent cache answered said "compiling N programs" (the label knew
    only the executable cache). The test session's JAX cache is on (tests/conftest.py), so the second engine's
    compiles are all answered there."""
    monkeypatch.setattr(compile_cache, "executable_cache_for", lambda *_: None)
    _engine(tiny)  # fills JAX's cache (if an earlier run has not)
    capfd.readouterr()
    warm = LLM(tiny, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, compile_progress=True)
    planned = warm.stats.num_step_programs
    err = capfd.readouterr().err
    assert warm.runner.steps.build_stats.num_jax_cache_hits == planned
    assert f"loading {planned} programs from the cache" in err and "compiling" not in err, err[-1000:]


def test_the_progress_label_follows_what_each_program_came_from():
    import io

    progress = CompileProgress(file=io.StringIO())
    progress.begin(3, may_hit_jax_cache=True)
    assert progress.label() == "building 3 programs"  # JAX's cache can only be asked by compiling
    progress.update(from_cache=True)
    assert progress.label() == "loading 3 programs from the cache"
    progress.update(from_cache=False)
    assert progress.label() == "compiling 2 programs (1 from the cache)"
    progress.close()
    cold = CompileProgress(file=io.StringIO())
    cold.begin(4)
    assert cold.label() == "compiling 4 programs"
    restoring = CompileProgress(file=io.StringIO())
    restoring.begin(2, cached=2)
    assert restoring.label() == "loading 2 programs from the cache"


def test_bench_startup_checks_its_baseline_before_any_start(tmp_path, monkeypatch, capsys):
    """``--baseline-python`` names the caller's interpreter: a relative path is made absolute (the baseline's
    starts run in its own checkout, where it named nothing: the bench failed after our cold start), and one that
    is not there, or a baseline checkout that is not a directory or holds no jaxmamba package (its starts would
    import an installed one: this tree's, under an editable install), is an error before any start."""
    from jaxmamba.bench import startup

    started = []
    monkeypatch.setattr(startup, "_run", lambda args, *rest: started.append(args) or 0)
    with pytest.raises(SystemExit):
        startup.main(["--baseline-repo", str(tmp_path)])
    assert "holds no jaxmamba package" in capsys.readouterr().err
    (tmp_path / "jaxmamba").mkdir()
    (tmp_path / "jaxmamba" / "__init__.py").write_text("")
    with pytest.raises(SystemExit):
        startup.main(["--baseline-repo", str(tmp_path), "--baseline-python", "no/such/python"])
    assert "--baseline-python='no/such/python': no such interpreter" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        startup.main(["--baseline-repo", str(tmp_path / "absent")])
    assert "is not a directory" in capsys.readouterr().err
    assert not started

    link = tmp_path / "bin" / "python"
    link.parent.mkdir()
    link.symlink_to(sys.executable)  # as a venv's interpreter is: a link
    monkeypatch.chdir(tmp_path)
    assert startup.main(["--baseline-repo", str(tmp_path), "--baseline-python", "bin/python"]) == 0
    (args,) = started
    assert args.baseline_python == str(link)  # absolute, the link itself (not its target)
