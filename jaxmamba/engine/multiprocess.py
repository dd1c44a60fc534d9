"""Serving across processes: process 0 owns request intake and scheduling, the others replay its steps.

Under JAX's multi-controller runtime every process must issue the same step programs in the same order, so
every process runs a full ``EngineCore`` (scheduler, prefix cache, step loop) over the one global mesh. Offline
(``LLM.generate`` on every process with the same prompts) that holds by construction. Serving, requests arrive
at process 0 alone, so process 0 *leads*: before each step it publishes what changed the engine since the last
one (requests queued, with the seed and arrival number it gave them; aborts) over the runtime's key-value store
(``parallel.distributed.StepChannel``), and every other process *follows*: it applies the same commands to its
own core and steps. The scheduler is deterministic given its commands (no clocks, no randomness of its own;
``compile="eager"``, so no bucket depends on a background compile's progress), so every process schedules the
same batch and issues the same programs. Each message also carries a digest of the leader's previous step
(which requests advanced, by how many tokens); a follower whose own differs raises ``DistributedError``
instead of running a program the others do not. docs/architecture.md, "Multi-host: the engine on
jax.distributed".

Usage: ``lead(core)`` on process 0 (``AsyncLLM`` and the server do it), ``follow(core)`` on the others (runs
until the leader calls ``Leader.stop``).
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import pickle
import time

import jax

from jaxmamba.engine.core import EngineCore
from jaxmamba.engine.gc_heap import frozen_heap
from jaxmamba.engine.request import Request
from jaxmamba.errors import ConfigError
from jaxmamba.parallel.distributed import DistributedError, StepChannel

_channels = itertools.count()  # one channel name per leader/follower pair, in construction order


def _step_digest(core: EngineCore) -> str:
    """What the last step did: each request it advanced and how far (identical on every process)."""
    rows = sorted((r.request_id, r.num_computed_tokens, len(r.output_token_ids), r.finish_reason or "")
                  for r in core.last_step)
    return hashlib.sha1(repr(rows).encode()).hexdigest()


def _channel() -> StepChannel:
    if jax.process_count() == 1:
        raise ConfigError("leading or following needs the multi-process runtime (num_processes > 1)")
    return StepChannel(f"engine{next(_channels)}")


class Leader:
    """Process 0's side, installed as ``core.replicator``: it records the commands and publishes them before
    each step (``EngineCore.queue``, ``abort_request`` and ``step`` call it)."""

    def __init__(self, core: EngineCore):
        if jax.process_index() != 0:
            raise ConfigError(f"process {jax.process_index()} cannot lead: process 0 owns intake and scheduling")
        if core.mesh is None:
            raise ConfigError("a multi-process engine needs tensor_parallel_size > 1 over every process's devices")
        self.core, self.channel = core, _channel()
        self.commands: list[tuple] = []
        self.num_steps = 0
        self.digest = ""
        # A leader that exits without stop() (an exception, sys.exit) tells the followers, which would otherwise
        # wait for its next step while JAX's own exit waits for them at its shutdown barrier.
        atexit.register(self._abandon)

    def queued(self, req: Request) -> None:
        self.commands.append(("add", req.request_id, list(req.prompt_token_ids), req.params, req.seed,
                              req.arrival, req.min_tokens_ban))

    def aborted(self, request_ids: list[str]) -> None:
        self.commands.append(("abort", list(request_ids)))

    def _publish(self, stop: bool = False, error: str | None = None) -> None:
        message = {"commands": self.commands, "digest": self.digest, "stop": stop, "error": error}
        self.channel.publish(self.num_steps, pickle.dumps(message))
        self.commands = []
        self.num_steps += 1

    def before_step(self) -> None:
        self._publish()

    def after_step(self) -> None:
        self.digest = _step_digest(self.core)

    def stop(self) -> None:
        """Tell the followers to return from ``follow`` (their engines stay built)."""
        atexit.unregister(self._abandon)
        self._publish(stop=True)
        self.core.replicator = None

    def _abandon(self) -> None:
        self._publish(stop=True, error="process 0 exited without stopping its followers (see its log)")


def spans_processes(core: EngineCore) -> bool:
    """Whether ``core``'s mesh holds devices of several processes (then they must step together)."""
    mesh = core.mesh
    return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


def lead_if_spanning(core: EngineCore) -> Leader | None:
    """``lead(core)`` where the engine spans processes (``AsyncLLM`` on process 0); None otherwise.
    ``ConfigError`` on another process: it must ``follow``."""
    if not spans_processes(core):
        return None
    if jax.process_index() != 0:
        raise ConfigError(f"AsyncLLM (and the server) run on process 0 of a multi-process engine; process "
                          f"{jax.process_index()} must follow its steps: jaxmamba.engine.multiprocess.follow(core) "
                          "(python -m jaxmamba serve --process-id N does)")
    return lead(core)


def lead(core: EngineCore) -> Leader:
    """Make ``core`` (on process 0) publish its steps to the followers; returns the ``Leader``."""
    leader = Leader(core)
    core.replicator = leader
    return leader


def follow(core: EngineCore) -> int:
    """Replay process 0's steps on this process's ``core`` until the leader stops; returns the steps run.

    Blocks while the leader is idle. ``DistributedError`` when the leader's store is unreachable, or when
    this process's last step differs from the leader's (a divergence would otherwise deadlock the
    collectives)."""
    if jax.process_index() == 0:
        raise ConfigError("process 0 leads; follow() runs on the other processes")
    with frozen_heap():  # the start-up heap out of the loop's full collections (engine.gc_heap)
        return _replay(core, _channel())


def _replay(core: EngineCore, channel) -> int:
    """``follow``'s loop: each message's commands, then the step, until the leader says stop."""
    digest, n = "", 0
    while True:
        message = pickle.loads(channel.receive(n))
        if message["error"]:
            raise DistributedError(f"process {jax.process_index()}: {message['error']}")
        if message["digest"] != digest:
            raise DistributedError(f"process {jax.process_index()}: step {n - 1} differs from the leader's "
                                   "(the same commands scheduled another batch); stopping before the collectives "
                                   "of a different program deadlock")
        for command in message["commands"]:
            if command[0] == "add":
                _, rid, ids, params, seed, arrival, ban = command
                core.queue(Request(rid, ids, params, seed=seed, arrival=arrival, min_tokens_ban=ban,
                                   arrival_time=time.monotonic()))
            else:
                core.abort_request(command[1])
        if message["stop"]:
            return n
        core.step()
        digest = _step_digest(core)
        n += 1
