"""The serving loops' heap kept out of the cyclic garbage collector's full collections (``frozen_heap``).

A full (oldest-generation) collection walks every tracked object in the process: the model's modules, JAX's
and the tokenizer's tables, a notebook's own objects. In an engine loop that is 5-50 ms, a few dozen times a
run, on the engine thread, and it leaves the step's code and data out of the CPU caches afterwards (measured on
``bench serve``: 105 ms of the engine thread's CPU a run, 6 ms with the heap frozen; docs/architecture.md,
"2. The data path of one step"). vLLM freezes its engine's start-up heap for the same reason.

``gc.freeze`` moves every object alive now to a permanent generation that collections skip; ``gc.unfreeze``
puts them back, so nothing frozen for a loop's length is kept past it (a cycle that became garbage meanwhile is
collected by the next full collection). Objects the loop creates are collected as usual.
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0  # loops inside frozen_heap now: the heap is unfrozen when the last one leaves
#: Objects frozen before this module was imported: the interpreter's own (375 on CPython 3.12, none on 3.11),
#: or a freeze the caller made before importing jaxmamba. More than these on entry is a caller's freeze.
startup_frozen = gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap():
    """Freeze the heap for the block (nested and concurrent blocks share one freeze, lifted by the last to
    leave). A heap the caller froze since jaxmamba was imported (more than ``startup_frozen`` objects frozen
    on entry) is left as the caller set it: neither refrozen nor unfrozen here."""
    global _depth
    with _lock:
        ours = _depth > 0 or gc.get_freeze_count() <= startup_frozen
        if ours:
            if _depth == 0:
                gc.freeze()
            _depth += 1
    try:
        yield
    finally:
        if ours:
            with _lock:
                _depth -= 1
                if _depth == 0:
                    gc.unfreeze()
