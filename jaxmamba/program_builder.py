"""Build a set of step programs fast: restore what the executable cache holds, trace and lower the rest on
one thread, and compile them concurrently on a thread pool sized to the host's cores.

Tracing and lowering are Python (they hold the GIL), so they run one program at a time, each handed to the
pool as soon as it is lowered; XLA's backend compile runs outside the GIL, so the pool's threads compile
side by side while the next program is traced. Waiting is done in short slices on the calling thread, so a
Ctrl-C (``KeyboardInterrupt``) stops the build promptly: programs not yet compiling are cancelled, and
those already in XLA finish on their threads (their results are dropped).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import jax

from jaxmamba.compile_cache import persistent_cache_reads


def host_cores() -> int:
    """Cores this process may run on (the pool's size)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class Program:
    """One program to build: ``lower()`` traces and lowers it (a ``jax.stages.Lowered``); ``cache_key`` names
    it in the executable cache (None: never cached)."""

    key: object
    lower: Callable[[], object]
    cache_key: str | None = None


@dataclass
class BuildStats:
    """Where a build's time went (seconds) and how its programs were obtained."""

    lowering_s: float = 0.0  # tracing and lowering, summed (one thread)
    backend_compile_s: float = 0.0  # XLA's compiles, summed over the pool's threads (overlapping)
    restore_s: float = 0.0  # reading and deserialising cached executables, summed over the pool's threads
    wall_s: float = 0.0  # the build from start to the last program ready
    num_compiled: int = 0
    num_restored: int = 0
    num_jax_cache_hits: int = 0  # of num_compiled: no XLA compile ran, JAX's caches (persistent or in-memory) had it
    rejected: list[str] = field(default_factory=list)  # cache entries found unusable (then recompiled)

    def add(self, other: "BuildStats") -> None:
        for name in ("lowering_s", "backend_compile_s", "restore_s", "wall_s", "num_compiled", "num_restored",
                     "num_jax_cache_hits"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.rejected += other.rejected


class ProgramBuilder:
    """``build(programs)`` calls ``on_ready(program, executable, extra, from_cache)`` on the calling thread for
    each program as it becomes ready (in completion order; ``from_cache``: restored from the executable cache,
    or compiled by JAX's persistent cache returning it without an XLA compile). ``compile(lowered)`` returns ``(executable,
    extra)`` and runs on the pool (``extra``: what the caller keeps beside the executable, e.g. its memory
    statistics; stored with it in the cache, so it must pickle). ``cache``: a
    ``compile_cache.ExecutableCache`` or None."""

    def __init__(self, compile: Callable[[object], tuple[object, object]], *, cache=None,
                 workers: int | None = None, on_ready: Callable | None = None):
        self._compile = compile
        self.cache = cache
        self.workers = max(1, workers or host_cores())
        self.on_ready = on_ready

    def cached(self, program: Program) -> bool:
        return self.cache is not None and program.cache_key is not None and self.cache.contains(program.cache_key)

    def build(self, programs: list[Program], stop: threading.Event | None = None) -> BuildStats:
        """Build ``programs``; returns early (the rest unbuilt) once ``stop`` is set. Cached programs are
        restored on the pool while the others are lowered; an entry the cache rejects is lowered last."""
        stats = BuildStats()
        start = time.perf_counter()
        pending: dict[Future, tuple[str, Program]] = {}
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="jaxmamba-compile")
        try:
            to_lower = []
            for program in programs:
                if self.cached(program):
                    pending[pool.submit(self._restore_one, program)] = ("restore", program)
                else:
                    to_lower.append(program)
            while to_lower or pending:
                if stop is not None and stop.is_set():
                    break
                if to_lower:
                    program = to_lower.pop(0)
                    t0 = time.perf_counter()
                    lowered = program.lower()
                    stats.lowering_s += time.perf_counter() - t0
                    pending[pool.submit(self._compile_one, program, lowered)] = ("compile", program)
                to_lower += self._collect(pending, stats, timeout=0 if to_lower else 0.2)
        finally:
            # Queued work is dropped; compiles XLA is running finish on their threads (a C++ call cannot be
            # stopped) and their results are discarded.
            pool.shutdown(wait=False, cancel_futures=True)
        stats.wall_s = time.perf_counter() - start
        if self.cache is not None:
            stats.rejected = list(self.cache.rejected)
        return stats

    def _restore_one(self, program: Program):
        t0 = time.perf_counter()
        hit = self.cache.load(program.cache_key)
        return hit, time.perf_counter() - t0

    def _compile_one(self, program: Program, lowered) -> tuple[object, object, float, bool]:
        t0 = time.perf_counter()
        compiles_before = CompileCounter.on_this_thread()
        hits_before = CompileCounter.jax_cache_hits_on_this_thread()
        with persistent_cache_reads() as reads:
            executable, extra = self._compile(lowered)
        seconds = time.perf_counter() - t0
        # jax reports a compile its persistent cache answered as a backend compile too (the event wraps the
        # cache lookup) plus a cache hit; one its in-memory cache answered reports nothing.
        jax_cache_hit = CompileCounter.jax_cache_hits_on_this_thread() > hits_before
        from_cache = jax_cache_hit or CompileCounter.on_this_thread() == compiles_before
        if self.cache is not None and program.cache_key is not None:
            # What a cache returned is a deserialised executable, which XLA's CPU client (jax 0.10.2) serialises
            # without its machine code ("Function ... not found" when the restored copy runs): a persistent-
            # cache hit is stored from its entry's bytes, an in-memory hit (whose origin is unknown) not at all.
            if not from_cache:
                self.cache.store(program.cache_key, executable, extra)
            elif jax_cache_hit and reads.serialized is not None:
                self.cache.store(program.cache_key, executable, extra, serialized_executable=reads.serialized)
        return executable, extra, seconds, from_cache

    def _collect(self, pending: dict[Future, tuple[str, Program]], stats: BuildStats,
                 timeout: float) -> list[Program]:
        """Hand finished work to ``on_ready``, waiting up to ``timeout`` seconds for some (short waits: a
        Ctrl-C lands between them); returns the programs whose cache entries were rejected (to compile)."""
        done, _ = wait(list(pending), timeout=timeout, return_when=FIRST_COMPLETED)
        rejected = []
        for future in done:
            kind, program = pending.pop(future)
            if kind == "restore":
                hit, seconds = future.result()
                stats.restore_s += seconds
                if hit is None:
                    rejected.append(program)
                    continue
                (executable, extra), from_cache = hit, True
                stats.num_restored += 1
            else:
                # A compile error surfaces here, on the caller.
                executable, extra, seconds, from_cache = future.result()
                stats.backend_compile_s += seconds
                stats.num_compiled += 1
                stats.num_jax_cache_hits += from_cache
            if self.on_ready is not None:
                self.on_ready(program, executable, extra, from_cache)
        return rejected


#: jax.monitoring's event for a compile that JAX's persistent compilation cache answered (jax 0.10, 0.11).
JAX_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


#: jax.monitoring's duration events of a lowering (jaxpr -> StableHLO) and of a backend compile (jax 0.10, 0.11).
JAX_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
JAX_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts backend compilations and lowerings process-wide through jax.monitoring; ``background`` counts the
    compiles made on the program builder's threads (``jaxmamba-*``: a lazy build's compiles run beside serving);
    per thread, the compiles and JAX's persistent-cache hits (jax reports both on the thread that asked for the
    compile)."""

    _lock = threading.Lock()
    count = 0
    background = 0
    lowerings = 0
    _installed = False
    _thread = threading.local()  # this thread's backend compilations (jax reports a compile on its thread)

    @classmethod
    def on_this_thread(cls) -> int:
        return getattr(cls._thread, "count", 0)

    @classmethod
    def jax_cache_hits_on_this_thread(cls) -> int:
        return getattr(cls._thread, "jax_cache_hits", 0)

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return

            def listener(event: str, duration: float, **kwargs) -> None:
                if event == JAX_BACKEND_COMPILE_EVENT:
                    cls._thread.count = cls.on_this_thread() + 1
                    with cls._lock:
                        cls.count += 1
                        if threading.current_thread().name.startswith("jaxmamba-"):
                            cls.background += 1
                elif event == JAX_LOWERING_EVENT:
                    with cls._lock:
                        cls.lowerings += 1

            def hit_listener(event: str, **kwargs) -> None:
                if event == JAX_CACHE_HIT_EVENT:
                    cls._thread.jax_cache_hits = cls.jax_cache_hits_on_this_thread() + 1

            jax.monitoring.register_event_duration_secs_listener(listener)
            jax.monitoring.register_event_listener(hit_listener)
            cls._installed = True


def stop_at_exit(stop: threading.Event) -> None:
    """Set ``stop`` when the interpreter begins to exit, before it joins the threads still running (a lazy
    build must not keep a finished program alive, nor trace while the interpreter tears down)."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(stop.set)
