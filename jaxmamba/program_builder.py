"""Build a set of step programs fast: restore what the executable cache holds, trace and lower the rest on
one thread, and compile them on a thread pool (``default_workers``: the host's cores, one thread in a process
whose threads share one malloc arena).

Tracing and lowering are Python (they hold the GIL), so they run one program at a time, each handed to the
pool as soon as it is lowered; XLA's backend compile runs outside the GIL, so the pool compiles while the next
program is traced. Waiting is done in short slices on the calling thread, so a
Ctrl-C (``KeyboardInterrupt``) stops the build promptly: programs not yet compiling are cancelled, and
those already in XLA finish on their threads (their results are dropped).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from jaxmamba import cpu_heap

# Re-exported: the counter and the one-program build live with the cache (layer 2), which the caches' allocator
# and the device tables use too.
from jaxmamba.compile_cache import (JAX_BACKEND_COMPILE_EVENT, JAX_CACHE_HIT_EVENT, JAX_LOWERING_EVENT,  # noqa: F401
                                    CompileCounter, build_one, compile_and_store)


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_workers(compiles_for_cpu: bool) -> int:
    """The pool's size: the host's cores, but one for programs compiled for the CPU (``compiles_for_cpu``) in a
    process whose threads share one malloc arena (``cpu_heap.shares_one_arena``). There two of XLA's CPU compiles
    side by side wait on that arena's lock: a 21M engine's 15 programs built cold in 170 s on two threads against
    112 s on one (2-core host), and restored in 5.4 s against 4.2. A GPU target's compiles keep the pool (ptxas
    runs in its own process: an 8B-widths plan of 6 programs took 65 s on two threads, 74 s on one)."""
    return 1 if compiles_for_cpu and cpu_heap.shares_one_arena() else host_cores()


class OwnerGone(Exception):
    """A ``WeakCallback`` was called after its owner was collected: the work it belongs to is for nobody."""


class WeakCallback:
    """``method`` (a bound method) held weakly: a background build or restore then does not keep its owner (an
    engine's ``CompiledSteps``, with its executables and caches) alive. Called once the owner is gone it raises
    ``OwnerGone``, which ``ProgramBuilder.build`` lets through and the background threads stop on."""

    __slots__ = ("_method",)

    def __init__(self, method):
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args, **kwargs):
        method = self._method()
        if method is None:
            raise OwnerGone
        return method(*args, **kwargs)


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

    def count_restore(self, seconds: float, restored: bool) -> None:
        """A cache entry's deserialisation took ``seconds``; ``restored``: it gave an executable."""
        self.restore_s += seconds
        self.num_restored += restored

    def count_compile(self, seconds: float, from_cache: bool) -> None:
        """A backend compile took ``seconds``; ``from_cache``: JAX's caches answered it."""
        self.backend_compile_s += seconds
        self.num_compiled += 1
        self.num_jax_cache_hits += from_cache


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

    def read_cached(self, programs: list[Program]) -> tuple[list[tuple[Program, tuple]], list[Program]]:
        """``(entries, rest)``: the programs whose cache entries read back whole, each with its entry (for
        ``BackgroundRestore``), and the others (not cached, or an entry rejected: to compile)."""
        entries, rest = [], []
        for program in programs:
            entry = self.cache.read(program.cache_key) if self.cached(program) else None
            if entry is None:
                rest.append(program)
            else:
                entries.append((program, entry))
        return entries, rest

    def build(self, programs: list[Program], stop: threading.Event | None = None) -> BuildStats:
        """Build ``programs``; returns early (the rest unbuilt) once ``stop`` is set. Cached programs are
        restored on the pool while the others are lowered; an entry the cache rejects is lowered last. A
        callback's ``OwnerGone`` (a ``WeakCallback`` whose owner was collected) propagates, like any error."""
        stats = BuildStats()
        start = time.perf_counter()
        pending: dict[Future, tuple[str, Program]] = {}
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="jaxmamba-compile")
        cached = [program for program in programs if self.cached(program)]
        try:
            # Largest entry first: the threads then finish together. (As many threads as cores: restoring is
            # XLA's CPU work, and 4 threads on 2 cores restored a 21M engine's 21 programs ~10% slower.)
            for program in sorted(cached, key=lambda p: self.cache.entry_size(p.cache_key), reverse=True):
                pending[pool.submit(self._restore_one, program)] = ("restore", program)
            restoring = {id(program) for program in cached}
            to_lower = [program for program in programs if id(program) not in restoring]
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
        return compile_and_store(self._compile, lowered, self.cache, program.cache_key)

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
                stats.count_restore(seconds, hit is not None)
                if hit is None:
                    rejected.append(program)
                    continue
                (executable, extra), from_cache = hit, True
            else:
                # A compile error surfaces here, on the caller.
                executable, extra, seconds, from_cache = future.result()
                stats.count_compile(seconds, from_cache)
            if self.on_ready is not None:
                self.on_ready(program, executable, extra, from_cache)
        return rejected


class BackgroundRestore:
    """Deserialises checked executable-cache entries on one background thread (``jaxmamba-restore``), in the
    order given, except that a program a caller waits for (``wait``) goes first: an engine that serves while
    its programs restore waits for the one program a step needs (docs/architecture.md, "Restoring in the
    background"). An entry the runtime refuses is lowered and compiled on that thread instead (counted as a
    background compile). ``builder.on_ready`` is called on that thread, as ``ProgramBuilder.build`` calls it.

    ``entries``: ``(program, entry)`` pairs, ``entry`` from ``ExecutableCache.read``. ``stop``: set to end the
    thread after the program it is restoring (``stop_at_exit`` sets it as the interpreter exits, a
    ``weakref.finalize`` of ``CompiledSteps`` when the engine is dropped). A callback raising ``OwnerGone`` ends
    the thread as ``stop`` does."""

    def __init__(self, builder: ProgramBuilder, entries: list[tuple[Program, tuple]], stop: threading.Event):
        self._builder = builder
        self._queue = list(entries)
        self._stop = stop
        self._cv = threading.Condition()
        self._built: set = set()  # keys of the programs ready
        self._failure: BaseException | None = None
        self._finished = False
        self.stats = BuildStats()
        self._thread = threading.Thread(target=self._run, name="jaxmamba-restore")
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            while not self._stop.is_set():
                with self._cv:
                    if not self._queue:
                        break
                    program, entry = self._queue.pop(0)
                self._restore_or_compile(program, entry)
                with self._cv:
                    self._built.add(program.key)
                    self._cv.notify_all()
        except OwnerGone:
            pass  # the engine was dropped while its programs restored: nobody waits for the rest
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits (wait raises it)
            self._failure = e
        finally:
            self.stats.wall_s = time.perf_counter() - start
            # The engine keeps this restore after the thread ends: what the builder holds (its cache, callbacks
            # that a caller may not have made weak) must not live on with it.
            self._builder = None
            with self._cv:
                self._finished = True
                self._cv.notify_all()

    def _restore_or_compile(self, program: Program, entry: tuple) -> None:
        builder, stats = self._builder, self.stats
        t0 = time.perf_counter()
        hit = builder.cache.deserialize(program.cache_key, entry)
        stats.count_restore(time.perf_counter() - t0, hit is not None)
        if hit is not None:
            (executable, extra), from_cache = hit, True
        else:
            t0 = time.perf_counter()
            lowered = program.lower()
            stats.lowering_s += time.perf_counter() - t0
            executable, extra, seconds, from_cache = builder._compile_one(program, lowered)
            stats.count_compile(seconds, from_cache)
            stats.rejected = list(builder.cache.rejected)
        if builder.on_ready is not None:
            builder.on_ready(program, executable, extra, from_cache)

    def want(self, key) -> None:
        """Move the program ``key`` (a ``Program.key``) to the head of the queue, if it is queued."""
        with self._cv:
            self._queue.sort(key=lambda item: item[0].key != key)  # stable: the rest keep their order

    def wait(self, key) -> None:
        """Block until the program ``key`` is ready, restored next (``want``) if it is still queued; in short
        slices, so that a Ctrl-C lands. ``RuntimeError`` if the thread ended without it (a failure, whose
        exception it chains, or ``stop``)."""
        if key in self._built:
            return
        self.want(key)
        with self._cv:
            while key not in self._built:
                if self._finished:
                    raise RuntimeError(f"the background restore ended without program {key}") from self._failure
                self._cv.wait(0.2)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (every program ready, or ``stop``); False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def stop_at_exit(stop: threading.Event) -> None:
    """Set ``stop`` when the interpreter begins to exit, before it joins the threads still running (a lazy
    build must not keep a finished program alive, nor trace while the interpreter tears down)."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(stop.set)
