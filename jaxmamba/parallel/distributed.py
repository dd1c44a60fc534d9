"""The engine on JAX's multi-controller runtime: several processes (one per host, say), each calling
``jax.distributed.initialize``, then building the same engine over one global ``tp`` mesh and issuing the same
step programs in the same order. docs/architecture.md, "Multi-host: the engine on jax.distributed".

What lives here: checking and starting the runtime (``check_distributed_args``, ``initialize``), choosing each
process's share of the ``tp`` mesh (``tp_devices``, used by ``ranks.make_mesh``), and the control-plane channel a
leader process uses to send its step commands to the followers (``StepChannel``, over the runtime's
coordination key-value store).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import threading
import time
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from jaxmamba.errors import ConfigError

#: The likely cause, added to every DistributedError.
PEER_TIMEOUT_HINT = ("a peer process died or hangs (jax.distributed's heartbeat aborts the survivors once "
                     "distributed_timeout_s passes without one)")


class DistributedError(RuntimeError):
    """The multi-process engine cannot go on: a step failed on this process (a peer died, so its collectives
    broke; or anything else, which leaves this process a step behind the others), or a peer stopped answering.
    Raised instead of carrying on out of step with the other processes or waiting forever. Once raised, the
    process exits without the runtime's shutdown barrier (``exit_without_shutdown_barrier``)."""

    def __init__(self, message: str):
        super().__init__(message)
        exit_without_shutdown_barrier(message)


#: Exit status of a process that leaves the multi-process runtime after a ``DistributedError``.
PEER_LOST_EXIT_CODE = 1
_lost: list[str] = []  # the first DistributedError's message, once one was raised


def exit_without_shutdown_barrier(reason: str) -> None:
    """Make this process, when it exits, leave with status ``PEER_LOST_EXIT_CODE`` and ``reason`` on stderr,
    before JAX's own exit hook runs ``jax.distributed.shutdown``: that waits at a barrier for every process,
    and with a peer gone the barrier fails and the runtime aborts the process (status -6, SIGABRT), burying
    the error that ended it. Registered once, at the first ``DistributedError``; exit hooks run last
    registered first, so this one precedes JAX's (registered when JAX was imported). Nothing without the
    runtime (one process: there is no barrier to skip)."""
    if _lost or not runtime_is_initialized():
        return
    _lost.append(reason)
    atexit.register(_exit_now)


def _exit_now() -> None:
    print(f"jaxmamba: DistributedError: {_lost[0]}\njaxmamba: exiting with status {PEER_LOST_EXIT_CODE} "
          "without jax.distributed's shutdown barrier (a peer is gone or out of step)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(PEER_LOST_EXIT_CODE)


_ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>\d+)$")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


def check_distributed_args(coordinator_address: str | None, num_processes: int | None,
                           process_id: int | None) -> None:
    """``ConfigError`` naming the argument unless the three describe a runtime: all None (one process, or a
    runtime the caller started with ``jax.distributed.initialize``), or an address ``host:port``, a process
    count >= 1 and ``0 <= process_id < num_processes``. Imports nothing of JAX's backends."""
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    if all(v is None for v in given.values()):
        return
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)} must be given with the other multi-process arguments "
                          f"({', '.join(k for k in given if k not in missing)}): every process names the "
                          "coordinator, the process count and its own id")
    if not isinstance(coordinator_address, str) or not _ADDRESS.match(coordinator_address):
        raise ConfigError(f"coordinator_address={coordinator_address!r} must be 'host:port' (process 0's "
                          "address as the other processes reach it, e.g. '10.0.0.1:1234')")
    port = int(_ADDRESS.match(coordinator_address)["port"])
    if not 0 < port < 65536:
        raise ConfigError(f"coordinator_address={coordinator_address!r}: port {port} is outside 1-65535")
    n = _check_int("num_processes", num_processes, 1)
    pid = _check_int("process_id", process_id, 0)
    if pid >= n:
        raise ConfigError(f"process_id={pid} is out of range for num_processes={n} (ids are 0..{n - 1})")


class StepWatchdog:
    """Ends this process when one engine step runs longer than ``timeout_s``: a peer that hangs while its
    heartbeat thread lives (a deadlock in Python, a stuck host thread) is never declared dead by the runtime,
    and this process would wait in the collective it owes for ever. A collective cannot be interrupted from
    Python, so on expiry the watchdog thread prints the ``DistributedError`` and exits with
    ``PEER_LOST_EXIT_CODE`` (``_exit_now``): every process that waits on the hung one does the same.

    ``with watchdog.watch("step 12"):`` around the wait for a step's outputs; one daemon thread serves every
    step (arming is a lock and an assignment, so a step pays no thread start)."""

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r} must be > 0")
        self.timeout_s = float(timeout_s)
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        threading.Thread(target=self._run, name="jaxmamba-step-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        with self._cond:
            self._deadline, self._what = time.monotonic() + self.timeout_s, what
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._deadline = None

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                break
        if not _lost:
            _lost.append(f"process {jax.process_index()}: {self._what} did not complete within {self.timeout_s:g} s "
                         f"(distributed_timeout_s): a peer process hangs in or before its collectives")
        _exit_now()


def runtime_is_initialized() -> bool:
    return bool(jax.distributed.is_initialized())


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_s: int = 100,
               initialization_timeout_s: int = 300) -> bool:
    """Start JAX's multi-controller runtime (``jax.distributed.initialize``) unless it runs already; returns
    whether the engine is multi-process.

    With no arguments, nothing starts: one process, or a runtime the caller started itself. With them, a
    runtime already started must agree (else ``ConfigError``); a process whose backends are already up (it ran
    a JAX computation first) gets ``ConfigError`` saying so, as JAX cannot join such a process to a runtime.
    On the CPU the cross-process collectives are gloo's (``jax_cpu_collectives_implementation``, JAX's default
    in 0.10 and 0.11, set here where it was switched off). ``heartbeat_timeout_s``: a process that sends no
    heartbeat for that long is declared dead, and the runtime aborts the others with "The following tasks are
    unhealthy (stopped sending heartbeats)" rather than let them wait in a collective forever; it also bounds
    how long an exiting process waits at the runtime's shutdown barrier for the others.
    """
    check_distributed_args(coordinator_address, num_processes, process_id)
    if coordinator_address is None:
        return jax.process_count() > 1
    if runtime_is_initialized():
        if (jax.process_count(), jax.process_index()) != (num_processes, process_id):
            raise ConfigError(f"num_processes={num_processes}, process_id={process_id} disagree with the runtime "
                              f"already started in this process ({jax.process_count()} processes, this one "
                              f"{jax.process_index()})")
        return num_processes > 1
    _check_int("heartbeat_timeout_s", heartbeat_timeout_s, 1)
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=initialization_timeout_s,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s,
                                   shutdown_timeout_seconds=heartbeat_timeout_s)
    except RuntimeError as e:
        if "before any JAX" in str(e):
            raise ConfigError(f"coordinator_address={coordinator_address!r}: this process already ran a JAX "
                              "computation, so it cannot join the multi-process runtime; build the engine (or "
                              "call jax.distributed.initialize) before anything else touches JAX") from e
        raise
    return num_processes > 1


def tp_devices(tp_size: int, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The devices of a ``tp_size``-rank mesh: one process, the first ``tp_size`` of ``devices``
    (default ``jax.devices()``); several, ``tp_size / P`` local devices of every process (process-major), so
    that every process holds ranks and every process can read the replicated outputs. ``ConfigError`` when
    ``tp_size`` is not a multiple of the process count or a process has too few devices."""
    devs = list(jax.devices() if devices is None else devices)
    n = jax.process_count()
    if n == 1:
        return devs[:tp_size]
    if tp_size % n:
        raise ConfigError(f"tensor_parallel_size={tp_size} is not a multiple of the process count {n} "
                          f"(global devices: {len(devs)}): every process must hold the same number of ranks")
    per = tp_size // n
    by_process: dict[int, list[jax.Device]] = {}
    for d in devs:
        by_process.setdefault(d.process_index, []).append(d)
    for p in range(n):
        have = len(by_process.get(p, []))
        if have < per:
            raise ConfigError(f"tensor_parallel_size={tp_size} over {n} processes needs {per} devices in each; "
                              f"process {p} has {have} (global devices: {len(devs)})")
    return [d for p in range(n) for d in sorted(by_process[p], key=lambda d: d.id)[:per]]


def is_multi_process() -> bool:
    return jax.process_count() > 1


def device_put_global(tree: Any, sharding: Any) -> Any:
    """``jax.device_put(tree, sharding)`` for host data (numpy arrays, scalars) that every process holds alike.

    Where the sharding spans several processes ``jax.device_put`` first checks that every process passed the
    same value, with a ``process_allgather`` of it (JAX 0.10 and 0.11): a cross-process collective, and new
    programs to compile, on every call. Here each process builds its own shards from its own copy
    (``jax.make_array_from_callback``), which is the multi-controller contract (every process feeds the same
    step). On one process, or for a sharding of this process's devices only, it is ``jax.device_put``.
    ``sharding`` is one sharding (or None) or a tree of them matching ``tree``.
    """
    from jax.sharding import Sharding

    def spans_processes(s) -> bool:
        return isinstance(s, Sharding) and not s.is_fully_addressable

    if isinstance(sharding, Sharding) or sharding is None:
        if not spans_processes(sharding):
            return jax.device_put(tree, sharding)
        return jax.tree.map(lambda x: _global_array(x, sharding), tree)
    if not any(spans_processes(s) for s in jax.tree.leaves(sharding)):
        return jax.device_put(tree, sharding)
    return jax.tree.map(_global_array, tree, sharding)


def call_arguments(tree: Any, sharding: Any) -> Any:
    """Host data (numpy arrays) to pass to a compiled executable whose inputs are placed by ``sharding``: on the
    default device (``sharding`` None) the arrays as they are, else ``device_put_global``'s arrays.

    A compiled call takes numpy arguments and places them in its C++ path; ``jax.device_put`` first walks
    them in Python (about 35 us an array on the CPU host, several per step). The arrays must not change
    after the call: the CPU device may read them in place while the step runs (each step's arrays are
    new ones)."""
    return tree if sharding is None else device_put_global(tree, sharding)


def _global_array(x, sharding) -> jax.Array:
    if isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def step_failed(exc: BaseException) -> None:
    """The multi-process engine's answer to a failed step (``StepLoop.on_step_failure``): ``DistributedError``.

    One process cannot recover alone: its recovery (re-allocating the caches, preempting every request)
    would run programs the others do not, and a failed collective usually means a peer died. So the
    engine stops here with the cause, on every process the failure reaches; the runtime's heartbeat ends
    the others. (``KeyboardInterrupt`` and other ``BaseException``s pass through unchanged.)"""
    if isinstance(exc, Exception):
        raise DistributedError(f"process {jax.process_index()} of {jax.process_count()}: an engine step failed "
                               f"({type(exc).__name__}: {exc}); the multi-process engine cannot continue out of "
                               f"step with the other processes ({PEER_TIMEOUT_HINT})") from exc


class StepChannel:
    """Process 0's step commands to the other processes, over the runtime's coordination key-value store.

    A leader ``publish``es message ``n`` (bytes) under ``jaxmamba/<name>/<n>``; a follower ``receive``s it,
    waiting as long as it takes (an idle server sends nothing), in slices of ``poll_s`` so that a dead
    coordinator surfaces as ``DistributedError`` rather than a wait without end. Why not a device broadcast
    (``multihost_utils.broadcast_one_to_all``): the message is variable-length control data (new requests,
    aborts), which a collective needs padded to a fixed shape (a program per shape, compiled while serving)
    and sent as two collectives (length, then payload) that wait in the device runtime with no timeout. The
    store has neither problem, and its traffic (one small message per step) is what it is built for. It is
    JAX's own runtime (``jax.distributed``), reached through ``jax._src.distributed.global_state.client``,
    the one private name this relies on (present in JAX 0.10 and 0.11).

    Keys older than ``KEEP`` messages are deleted by the leader: a follower cannot fall far behind, since the
    leader reads each step back (at most one step later, under async scheduling) and every step's programs
    need every process; only a step that runs no program (nothing schedulable) passes without one.
    """

    KEEP = 64

    def __init__(self, name: str, poll_s: float = 1.0):
        from jax._src import distributed as jax_distributed

        self.client = jax_distributed.global_state.client
        if self.client is None:
            raise ConfigError("a StepChannel needs the multi-process runtime (jax.distributed.initialize)")
        self.prefix = f"jaxmamba/{name}/"
        self.poll_ms = max(1, int(poll_s * 1000))

    def publish(self, n: int, payload: bytes) -> None:
        self.client.key_value_set_bytes(f"{self.prefix}{n}", payload)
        if n >= self.KEEP:
            self.client.key_value_delete(f"{self.prefix}{n - self.KEEP}")

    def try_receive(self, n: int, wait_ms: int) -> bytes | None:
        """Message ``n`` if it arrives within ``wait_ms``, else None (a loop with other work between waits)."""
        try:
            return self.client.blocking_key_value_get_bytes(f"{self.prefix}{n}", max(1, int(wait_ms)))
        except Exception as e:  # noqa: BLE001 - JAX's runtime error type differs between versions
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                return None
            raise DistributedError(f"process {jax.process_index()}: waiting for the leader's message {n} "
                                   f"failed ({type(e).__name__}: {e}); {PEER_TIMEOUT_HINT}") from e

    def receive(self, n: int) -> bytes:
        key = f"{self.prefix}{n}"
        while True:
            try:
                return self.client.blocking_key_value_get_bytes(key, self.poll_ms)
            except Exception as e:  # noqa: BLE001 - JAX's runtime error type differs between versions
                if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                    continue
                raise DistributedError(f"process {jax.process_index()}: waiting for the leader's step {n} "
                                       f"failed ({type(e).__name__}: {e}); {PEER_TIMEOUT_HINT}") from e


class ProcessesDisagree(DistributedError):
    """The processes of one multi-process engine were handed different work at the same point (other prompts,
    another handoff, another prefill engine's pages): carrying on would run different programs on them."""


class ProcessGather:
    """Every process of the runtime contributes one value per round and gets every process's value, in process
    order, over the coordination key-value store (as ``StepChannel``): how the processes of a multi-process
    decode engine agree on what each READ of its own ranks gave, so that they all import a request or all
    fall back (``engine.disagg.decode``). Construct it in the same order on every process (``name`` must
    match). A process that does not contribute within ``timeout_s`` is a ``DistributedError`` naming it.

    Each process deletes its own value of round ``n - 2`` in round ``n``: having read every value of round
    ``n - 1``, it knows that every process has finished reading round ``n - 2``."""

    def __init__(self, name: str, timeout_s: float = 300.0):
        from jax._src import distributed as jax_distributed

        self.client = jax_distributed.global_state.client
        if self.client is None:
            raise ConfigError("a ProcessGather needs the multi-process runtime (jax.distributed.initialize)")
        self.prefix, self.timeout_s, self.rounds = f"jaxmamba/{name}/", float(timeout_s), 0

    def gather(self, payload: bytes) -> list[bytes]:
        n, me = self.rounds, jax.process_index()
        self.client.key_value_set_bytes(f"{self.prefix}{n}/{me}", payload)
        deadline = time.monotonic() + self.timeout_s
        values = []
        for p in range(jax.process_count()):
            while True:
                try:
                    values.append(self.client.blocking_key_value_get_bytes(f"{self.prefix}{n}/{p}", 1000))
                    break
                except Exception as e:  # noqa: BLE001 - JAX's runtime error type differs between versions
                    late = "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower()
                    if not late or time.monotonic() > deadline:
                        raise DistributedError(f"process {me}: process {p} gave no value for round {n} of "
                                               f"{self.prefix!r} within {self.timeout_s:g} s ({type(e).__name__}: "
                                               f"{e}); {PEER_TIMEOUT_HINT}") from e
        if n >= 2:
            self.client.key_value_delete(f"{self.prefix}{n - 2}/{me}")
        self.rounds += 1
        return values
