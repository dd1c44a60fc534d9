"""Ctrl-C held back while an engine step runs (``deferred_sigint``), so that a step's donated caches are never lost."""

from __future__ import annotations

import _signal  # signal's C functions (see deferred_sigint)
import threading


class deferred_sigint:
    """Hold back Ctrl-C while a step runs; ``with`` gives the list of signals held back. An interrupt while the
    host waits for the step's results would otherwise lose the caches the step was given (donated)
    along with its outputs; the engine raises it once the step's results are recorded. Only the
    main thread can handle signals, and only Python's default handler is replaced.

    Entered once per step: a plain class over ``_signal`` (the C functions ``signal`` wraps), because
    ``signal.signal``'s enum conversions and a generator-based context manager cost tens of microseconds of
    host time a step (docs/architecture.md, "2. The data path of one step")."""

    __slots__ = ("pending", "previous")

    def __enter__(self) -> list[int]:
        self.pending: list[int] = []
        self.previous = None
        if threading.current_thread() is threading.main_thread() and \
                _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
            self.previous = _signal.signal(_signal.SIGINT, self._hold)
        return self.pending

    def _hold(self, signum: int, frame) -> None:
        self.pending.append(signum)

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            _signal.signal(_signal.SIGINT, self.previous)
