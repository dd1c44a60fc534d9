"""Host time of the engine loop by phase (``python -m jaxmamba.bench serve --profile-host``).

``LLM.host_profile = HostProfile()`` turns it on; ``None`` (the default) costs one attribute
test per phase. Phases, in step order:

* ``schedule``: the scheduler (and draft proposal) picks the step's rows;
* ``metadata``: the runner builds the step's metadata and input buffers on the host;
* ``transfer``: the buffers go to the device (``jax.device_put``);
* ``dispatch``: the step's executable is called (returns once the work is enqueued);
* ``wait``: the host blocks until the step's outputs are ready (device time not hidden);
* ``read_back``: the outputs come back to the host (``numpy.asarray`` of each ready output);
* ``record``: tokens, logprobs and stops are applied to the requests, blocks committed;
* ``detokenize``: ``RequestOutput``s (and their text) are built for the caller;
* ``other``: the rest of the engine thread's step (``HostProfile.step``, around ``EngineCore.step``): the
  loop's own bookkeeping between the phases above, so that the phases add up to the whole step.

``wait`` is the device time the host did not overlap with its own work; everything else is
host time. Each phase is timed twice: wall time (``seconds``) and the engine thread's CPU time
(``cpu_seconds``, ``time.thread_time``), which a loaded machine inflates far less (on a shared 2-core
host the wall figures carry the other processes' load; the CPU figures are the engine's own work). The hidden share is ``device - wait - dispatch`` over the host time: near 0 for a
synchronous engine, which waits for each step, and up to 1 under async scheduling, where the
host builds step N+1 and records step N while step N+1 runs. ``device`` is measured by a watcher
thread that blocks on each dispatched step's outputs: a step's device time runs from the later
of its dispatch and the previous step's end to its own end.
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field

PHASES = ("schedule", "metadata", "transfer", "dispatch", "wait", "read_back", "record", "detokenize", "other")
HOST_PHASES = tuple(p for p in PHASES if p != "wait")


@dataclass
class HostProfile:
    """The engine thread's phases, per step. ``device_time``: whether ``track_device`` counts device time (a
    watcher thread that wakes at each step's end). False where no device runs (``bench host-path``'s stand-in
    steps): there the watcher's wake-ups, each taking the GIL from the engine thread, raised the engine thread's
    own CPU per output token by about a quarter (BENCHMARKS.md, "Session 28");
    ``device_ms_per_step`` and ``hidden_share`` then read None."""

    device_time: bool = True
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    cpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    device_seconds: float = 0.0  # dispatch -> outputs ready, per step, summed
    # Async scheduling: the dispatch thread's CPU (the tables' updates, the executable's call; ModelRunner.dispatch),
    # host work beside the engine thread's and not in its phases.
    dispatch_thread_cpu_seconds: float = 0.0
    num_steps: int = 0
    num_rows: int = 0  # batch rows over all steps
    num_output_tokens: int = 0

    _pending: queue.Queue | None = field(default=None, repr=False)
    _last_ready: float = 0.0

    def track_device(self, outputs, dispatched_at: float) -> None:
        """Count the device time of a step dispatched at ``dispatched_at`` (``time.perf_counter()``) whose
        outputs are ``outputs``, without blocking the caller; ``summary`` waits for tracked steps."""
        if not self.device_time:
            return
        if self._pending is None:
            self._pending = queue.Queue()
            threading.Thread(target=self._watch, name="jaxmamba-device-time", daemon=True).start()
        self._pending.put((outputs, dispatched_at))

    def _watch(self) -> None:
        import jax

        while True:
            outputs, dispatched_at = self._pending.get()
            with suppress(Exception):  # a failed step: the engine reports it; its time is not device time
                jax.block_until_ready(outputs)
            ready = time.perf_counter()
            self.device_seconds += ready - max(dispatched_at, self._last_ready)
            self._last_ready = ready
            self._pending.task_done()

    def settle(self) -> None:
        """Wait until every tracked step's device time is counted."""
        if self._pending is not None:
            self._pending.join()

    def phase(self, name: str) -> "_Phase":
        """A context manager that adds its body's wall and CPU time to phase ``name``."""
        return _Phase(self, name)

    def step(self) -> "_Step":
        """A context manager around a whole engine step: what its body spends outside every phase entered
        inside it goes to ``other`` (wall and CPU), so the phases account for all of the step."""
        return _Step(self)

    @property
    def host_seconds(self) -> float:
        return sum(self.seconds[p] for p in HOST_PHASES)

    @property
    def host_cpu_seconds(self) -> float:
        return sum(self.cpu_seconds[p] for p in HOST_PHASES)

    @property
    def hidden_share(self) -> float | None:
        """Share of host time that ran while the device worked (about 0 for a synchronous engine); None
        without ``device_time``."""
        if not self.device_time:
            return None
        self.settle()
        hidden = max(0.0, self.device_seconds - self.seconds["wait"] - self.seconds["dispatch"])
        return min(1.0, hidden / self.host_seconds) if self.host_seconds else 0.0

    def summary(self) -> dict:
        self.settle()
        steps = max(self.num_steps, 1)
        out = {f"{p}_ms_per_step": 1e3 * self.seconds[p] / steps for p in PHASES}
        out.update({f"{p}_cpu_ms_per_step": 1e3 * self.cpu_seconds[p] / steps for p in HOST_PHASES})
        out.update(host_ms_per_step=1e3 * self.host_seconds / steps,
                   host_cpu_us_per_output_token=1e6 * self.host_cpu_seconds / max(self.num_output_tokens, 1),
                   device_ms_per_step=1e3 * self.device_seconds / steps if self.device_time else None,
                   host_us_per_output_token=1e6 * self.host_seconds / max(self.num_output_tokens, 1),
                   mean_batch_rows=self.num_rows / steps, hidden_share=self.hidden_share, steps=self.num_steps,
                   dispatch_thread_cpu_ms_per_step=1e3 * self.dispatch_thread_cpu_seconds / steps)
        return out


class _Phase:
    """``HostProfile.phase``: a plain class, not a generator-based context manager, because the time the
    context manager itself takes between its two clock reads is counted in the phase (two nested
    generators cost microseconds per phase, several phases a step)."""

    __slots__ = ("profile", "name", "start", "cpu_start")

    def __init__(self, profile: HostProfile, name: str):
        self.profile, self.name = profile, name

    def __enter__(self):
        self.start, self.cpu_start = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc):
        cpu = time.thread_time() - self.cpu_start
        wall = time.perf_counter() - self.start
        self.profile.cpu_seconds[self.name] += cpu
        self.profile.seconds[self.name] += wall


class _Step:
    """``HostProfile.step``: the body's time less the phases' time added meanwhile, as phase ``other``."""

    __slots__ = ("profile", "start", "cpu_start", "phased", "cpu_phased")

    def __init__(self, profile: HostProfile):
        self.profile = profile

    def __enter__(self):
        p = self.profile
        self.phased, self.cpu_phased = sum(p.seconds.values()), sum(p.cpu_seconds.values())
        self.start, self.cpu_start = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc):
        cpu = time.thread_time() - self.cpu_start
        wall = time.perf_counter() - self.start
        p = self.profile
        p.cpu_seconds["other"] += cpu - (sum(p.cpu_seconds.values()) - self.cpu_phased)
        p.seconds["other"] += wall - (sum(p.seconds.values()) - self.phased)


_NO_PHASE = nullcontext()


def maybe_phase(profile: HostProfile | None, name: str):
    """``profile.phase(name)``, or a no-op context manager when profiling is off."""
    return _NO_PHASE if profile is None else _Phase(profile, name)


def maybe_step(profile: HostProfile | None):
    """``profile.step()``, or a no-op context manager when profiling is off."""
    return _NO_PHASE if profile is None else _Step(profile)
