"""glibc's allocator kept from mapping XLA CPU's per-call buffers afresh at every call.

XLA's CPU client allocates an executable's temporary buffer when the executable runs and frees it when it
returns. glibc serves an allocation above its mmap threshold (adjusted at run time, at most 32 MiB) with a new
``mmap`` and unmaps it on ``free``, so a program whose temporaries pass 32 MiB page-faults every page it
touches on every call. The engine's step programs do: the full sampling tail's temporaries at 32 rows of a
32768-token vocabulary are 50 MiB (the greedy tail's 13 MiB), and on this project's CPU that tail ran 5-6x
the greedy one's time for the same greedy rows, almost all of it in page faults (BENCHMARKS.md, "XLA CPU: page
faults of large per-call temporaries"). Raising the threshold (and the trim threshold, so that the freed heap top is
kept) makes those allocations reuse the same heap memory: no faults after the first call. XLA runs programs on
its own threads, and a thread's arena other than the main one cannot grow past 64 MiB, so every thread is also
kept on the main arena; that holds only for threads started afterwards, hence before JAX's CPU client starts.

``import jaxmamba`` calls ``keep_large_buffers_on_heap()`` on a host without an NVIDIA driver (or with
``JAX_PLATFORMS=cpu``), where the step programs run on XLA's CPU client; ``JAXMAMBA_CPU_HEAP=0`` leaves the
allocator as it is. It changes the whole process's allocator (freed memory up to ``HEAP_LIMIT`` is kept rather
than returned to the system; one arena for all threads), which a serving process with a steady working set
wants; it does nothing off glibc/Linux. The heap grows over a program's first calls (XLA's threads allocate and
free in varying order, so a freed block is not always where the next call looks) and then stops: a program with
136 MiB of buffers settled at 0.4-1 GiB of heap after about 12 calls, and faulted no page from then on
(tests/jaxmamba/test_cpu_heap.py measures exactly that).

The one arena has a price: threads that allocate heavily at the same time wait on its lock. XLA's compiles and
the executable cache's restores do; two side by side ran about 3x slower each, so ``program_builder`` builds a
CPU engine's programs on one thread (``shares_one_arena``), and ``plan`` for a GPU target, which runs no large
CPU program, starts its process with ``JAXMAMBA_CPU_HEAP=0``. glibc gives a thread its arena at its first
allocation and deals arenas to later threads in turn, so the compile threads cannot keep arenas of their own
while XLA's threads share the main one (measured: the large tail then page-faults again in some runs).

Restoring a cached executable is allocation-heavy in another way: XLA rebuilds the program's HLO module, buffer
assignment and thunks from protos, millions of small blocks allocated and freed, with larger requests between them
that make glibc sweep its fastbins back into the free lists (``malloc_consolidate``) each time. ``fastbins_off``
turns fastbins off while executables are restored (``compile_cache.ExecutableCache.load``): a 21M engine's
programs restored 13-29% faster (BENCHMARKS.md, "Session 16"), while XLA's compiles ran ~13% slower without them,
so they are back on for compiling and serving.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import platform
import threading

#: Allocations up to this size come from the heap, and up to this much freed memory stays there (bytes).
HEAP_LIMIT = 1 << 30

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_M_MXFAST = 1
_ENV = "JAXMAMBA_CPU_HEAP"

_state: dict[str, bool] = {}


def keep_large_buffers_on_heap() -> bool:
    """Set glibc's mmap and trim thresholds to ``HEAP_LIMIT`` and its arenas to one (once per process); True
    when they are set (now or by an earlier call), False off glibc or when ``$JAXMAMBA_CPU_HEAP`` is ``0``."""
    if "applied" not in _state:
        _state["applied"] = _apply()
    return _state["applied"]


@functools.cache
def _glibc_mallopt():
    """glibc's ``mallopt(param, value) -> int`` (1 on success), or None off glibc/Linux (looked up once:
    ``find_library`` runs ``ldconfig``)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def _tunable_mallopt():
    """``_glibc_mallopt``, or None when ``$JAXMAMBA_CPU_HEAP`` is ``0`` (leave the allocator as it is)."""
    return _glibc_mallopt() if os.environ.get(_ENV, "1") != "0" else None


def _apply() -> bool:
    mallopt = _tunable_mallopt()
    if mallopt is None:
        return False
    # mallopt returns 1 on success; the mmap threshold first: setting either turns off glibc's own adjustment.
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, HEAP_LIMIT), (_M_TRIM_THRESHOLD, HEAP_LIMIT)))


def shares_one_arena() -> bool:
    """Whether every thread of this process allocates from glibc's one arena (``keep_large_buffers_on_heap``
    applied). Threads that allocate heavily at the same time then wait on that arena's lock: two XLA compiles
    side by side took 3x as long each as one alone
    (docs/architecture.md, "Compiled steps"), so ``program_builder`` builds one program
    at a time in such a process."""
    return _state.get("applied", False)


def runs_on_the_cpu() -> bool:
    """Whether this process's JAX will run on the CPU: ``JAX_PLATFORMS`` is ``cpu``, or unset on a host without
    an NVIDIA driver."""
    platforms = os.environ.get("JAX_PLATFORMS")
    if platforms is not None:
        return platforms == "cpu"
    return not os.path.exists("/proc/driver/nvidia/version")


def default_fastbin_limit() -> int:
    """glibc's fastbin size limit when the process started (bytes): ``glibc.malloc.mxfast`` from
    ``$GLIBC_TUNABLES`` where set, else malloc.c's ``DEFAULT_MXFAST`` (``64 * sizeof(size_t) / 4``)."""
    for tunable in os.environ.get("GLIBC_TUNABLES", "").replace(",", ":").split(":"):
        name, _, value = tunable.partition("=")
        if name == "glibc.malloc.mxfast" and value.isdigit():
            return int(value)
    return 64 * ctypes.sizeof(ctypes.c_size_t) // 4


class _FastbinScopes:
    """How many ``fastbins_off`` blocks are running, process-wide (the setting is the process's)."""

    lock = threading.Lock()
    depth = 0


@contextlib.contextmanager
def fastbins_off():
    """glibc's fastbins off (``M_MXFAST`` 0) while the block runs, on any thread; back at
    ``default_fastbin_limit`` when the last such block ends (blocks on several threads overlap). Off
    glibc/Linux, or with ``$JAXMAMBA_CPU_HEAP`` ``0``, it changes nothing. See the module's docstring for why."""
    mallopt = _tunable_mallopt()
    if mallopt is None:
        yield
        return
    with _FastbinScopes.lock:
        if _FastbinScopes.depth == 0:
            mallopt(_M_MXFAST, 0)
        _FastbinScopes.depth += 1
    try:
        yield
    finally:
        with _FastbinScopes.lock:
            _FastbinScopes.depth -= 1
            if _FastbinScopes.depth == 0:
                mallopt(_M_MXFAST, default_fastbin_limit())
