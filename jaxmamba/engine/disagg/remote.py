"""P/D across hosts: a prefill engine serving decode engines that dial it over the network control channel
(``transfer.control``), the pages themselves moving over NIXL/UCX as on one host.

``PrefillServer`` (P's host) answers ``hello`` (its page directories), ``prefill`` (token-id prompts ->
handoffs), ``release`` (handoff ids a decode engine gave up on) and ``state``. ``RemotePrefill`` is one
decode engine's connection to it, and ``RemoteDisaggregation`` (D's host) runs requests through both with
the same fall-backs as on one host. The decode side dials, as in vLLM's NIXL connector. Either side may
span several jax.distributed processes: process 0 holds the control channel and publishes what it does to
the engine to the others (``follow_prefill_server`` on P's, ``RemoteDisaggregation`` itself on D's). The
protocol, its lease and its limits: docs/architecture.md, "P/D across hosts".
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import json
import time
from typing import Any, Callable, Sequence

import jax

from jaxmamba.engine.disagg.decode import DecodeEngine
from jaxmamba.engine.disagg.handoff import Handoff
from jaxmamba.engine.disagg.prefill import PrefillEngine
from jaxmamba.engine.request import RequestOutput, SamplingParams
from jaxmamba.errors import ConfigError, RequestError, TransferError
from jaxmamba.parallel.distributed import DistributedError, ProcessesDisagree, StepChannel
from transfer.control import ControlClient, ControlServer

#: Version of the message set below; both sides must speak the same.
PROTOCOL = 1
_channels = itertools.count()  # StepChannel names of multi-process P and D sides, in construction order


class PrefillServer:
    """A ``PrefillEngine`` behind a ``ControlServer`` listening on ``listen`` (``"host:port"``, port 0: any free).

    ``address`` is what decode engines pass as their peer (``advertise_host`` and the bound port). Each
    decode engine declares in ``hello`` its lease (no READ of a handoff starts later than ``lease_s``
    after it got it) and its READ timeout; when its connection ends, the handoffs it was given and has
    neither read nor released are freed once both have run out: any READ it could still have posted
    is over by then, so the freed pages cannot land in a request of another reader. Single-threaded:
    call ``poll`` (or ``serve_forever``) often; it drives the engine's READ notifications too.
    With ``engine`` over several processes this runs on process 0, and the others run
    ``follow_prefill_server(engine)``.
    """

    def __init__(self, engine: PrefillEngine, listen: str, *, advertise_host: str | None = None):
        self.engine = engine
        self._channel: StepChannel | None = None  # to the engine's other processes, when it spans several
        self._sent = 0
        if len(engine.local_ranks) < engine.tp:
            if jax.process_index() != 0:
                raise ConfigError(f"process {jax.process_index()} of prefill engine {engine.engine_id!r} follows "
                                  "process 0's server: follow_prefill_server(engine)")
            self._channel = StepChannel(f"pd-prefill{next(_channels)}")
            atexit.register(self._publish, "abandoned")
        self.control = ControlServer(listen, self._handle, advertise_host=advertise_host,
                                     on_disconnect=self._dropped)
        self._issued: dict[int, set[str]] = {}  # connection -> handoff ids still staged for it
        self._grace_s: dict[int, float] = {}  # connection -> its lease + READ timeout
        self._expiring: list[tuple[float, list[str]]] = []  # (free at time.monotonic(), handoff ids)

    @property
    def address(self) -> str:
        return self.control.address

    # ---------------------------------------------------------------- messages
    def _handle(self, conn_id: int, message: dict) -> dict:
        op = message.get("op")
        if op == "hello":
            return self._hello(conn_id, message)
        if conn_id not in self._issued:
            raise TransferError(f"{op!r} before 'hello'")
        if op == "prefill":
            prompts = message.get("prompts")
            if not isinstance(prompts, list) or not all(
                    isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompts):
                raise RequestError("'prompts' must be a list of non-empty lists of token ids")
            self._publish("prefill", prompts)
            handoffs = self.engine.prefill(prompts)
            self._issued[conn_id].update(h.handoff_id for h in handoffs if h.handoff_id is not None)
            return {"handoffs": [h.to_bytes().decode() for h in handoffs]}
        if op == "release":
            handoff_ids = _strings(message.get("handoff_ids"), "handoff_ids")
            self._publish("release", handoff_ids)
            for handoff_id in handoff_ids:
                self.engine.release(handoff_id)
                self._issued[conn_id].discard(handoff_id)
            return {"staged": self.engine.num_staged}
        if op == "state":
            self.engine.poll()
            stats = self.engine.llm.stats
            return {"staged": self.engine.num_staged, "slots_in_use": stats.slots_in_use,
                    "blocks_in_use": stats.blocks_in_use, "held": len(self.engine.llm.scheduler.held),
                    "connections": self.control.num_connections, "expiring": sum(len(i) for _, i in self._expiring)}
        raise TransferError(f"unknown operation {op!r}")

    def _hello(self, conn_id: int, message: dict) -> dict:
        if message.get("protocol") != PROTOCOL:
            raise TransferError(f"protocol {message.get('protocol')!r} is not this prefill engine's {PROTOCOL}")
        grace = [message.get("lease_s"), message.get("read_timeout_s")]
        if not all(isinstance(v, (int, float)) and 0 < v < 86400 for v in grace):
            raise TransferError(f"lease_s and read_timeout_s must be seconds in (0, 86400), got {grace}")
        self._issued.setdefault(conn_id, set())
        self._grace_s[conn_id] = float(sum(grace))
        return {"engine_id": self.engine.engine_id, "tp_size": self.engine.tp,
                "directories": [d.decode() for d in self.engine.directories()]}

    def _dropped(self, conn_id: int) -> None:
        issued = self._issued.pop(conn_id, set())
        grace = self._grace_s.pop(conn_id, 0.0)
        issued = {h for h in issued if self.engine.is_staged(h)}
        if issued:
            self._expiring.append((time.monotonic() + grace, sorted(issued)))

    # ---------------------------------------------------------------- loop
    def poll(self, timeout_s: float = 0.001) -> None:
        """Answer what arrived within ``timeout_s``, take READ notifications, free what lost readers held."""
        self.control.poll(timeout_s)
        freed = set(self.engine.poll())
        if freed:
            for issued in self._issued.values():
                issued -= freed
        now = time.monotonic()
        for deadline, handoff_ids in [e for e in self._expiring if e[0] <= now]:
            self._publish("release", handoff_ids)
            for handoff_id in handoff_ids:
                self.engine.release(handoff_id)
            self._expiring.remove((deadline, handoff_ids))

    def serve_forever(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        while not should_stop():
            self.poll()

    def close(self) -> None:
        """Close the connections and the listener (the engine stays the caller's); the engine's other
        processes return from ``follow_prefill_server``."""
        self.control.close()
        if self._channel is not None:
            self._publish("stop")
            atexit.unregister(self._publish)
            self._channel = None

    def _publish(self, op: str, *args: Any) -> None:
        """Process 0 of a prefill engine over several processes: what every process must do, before doing it."""
        if self._channel is not None:
            self._channel.publish(self._sent, json.dumps([op, *args]).encode())
            self._sent += 1


def follow_prefill_server(engine: PrefillEngine, should_stop: Callable[[], bool] = lambda: False) -> int:
    """On process ``k > 0`` of a prefill engine over several processes: replay what process 0's
    ``PrefillServer`` does to the engine (prefills, releases) until it closes, driving this process's
    READ notifications in between (``engine.poll``). Returns the messages replayed. ``DistributedError``
    when process 0 exited without closing its server."""
    if len(engine.local_ranks) == engine.tp or jax.process_index() == 0:
        raise ConfigError("follow_prefill_server runs on the processes after the first of a multi-process engine")
    channel, n = StepChannel(f"pd-prefill{next(_channels)}"), 0
    while not should_stop():
        data = channel.try_receive(n, 2)
        if data is None:
            engine.poll()
            continue
        n += 1
        op, *args = json.loads(data)
        if op == "prefill":
            engine.prefill(args[0])
        elif op == "release":
            for handoff_id in args[0]:
                engine.release(handoff_id)
        elif op == "stop":
            break
        elif op == "abandoned":
            raise DistributedError(f"process {jax.process_index()}: process 0 of prefill engine "
                                   f"{engine.engine_id!r} exited without closing its server (see its log)")
    return n


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RequestError(f"{what!r} must be a list of strings")
    return value


class RemotePrefill:
    """One decode engine's connection to a ``PrefillServer`` at ``address`` (``"host:port"``).

    Dials and says ``hello`` within ``connect_timeout_s``; ``engine_id`` and ``directories`` (one
    ``PageDirectory`` per P rank, bytes) come from the answer. Every failure is a ``TransferError``
    naming the address (``transfer.control.ControlClient``).
    """

    def __init__(self, address: str, *, lease_s: float, read_timeout_s: float, connect_timeout_s: float = 10.0,
                 timeout_s: float = 600.0):
        self.client = ControlClient(address, connect_timeout_s=connect_timeout_s, timeout_s=timeout_s)
        self.address = self.client.address
        try:
            reply = self.client.call("hello", protocol=PROTOCOL, lease_s=lease_s, read_timeout_s=read_timeout_s,
                                     timeout_s=connect_timeout_s)
            self.engine_id = str(reply["engine_id"])
            self.directories = [str(d).encode() for d in reply["directories"]]
        except (KeyError, TypeError) as err:
            self.close()
            raise TransferError(f"the peer at {self.address} answered 'hello' without {err}") from None
        except BaseException:
            self.close()
            raise

    def prefill(self, prompts: Sequence[Sequence[int]]) -> list[Handoff]:
        """One handoff per token-id prompt, in order (as ``PrefillEngine.prefill``)."""
        reply = self.client.call("prefill", prompts=[list(map(int, p)) for p in prompts])
        handoffs = [Handoff.from_bytes(h) for h in reply.get("handoffs", ())]
        if len(handoffs) != len(prompts):
            raise TransferError(f"the peer at {self.address} answered {len(handoffs)} handoffs for "
                                f"{len(prompts)} prompts")
        return handoffs

    def release(self, handoff_ids: Sequence[str]) -> int:
        """Free handoffs this decode engine will never read; returns how many P still stages."""
        return int(self.client.call("release", handoff_ids=list(handoff_ids))["staged"])

    def state(self) -> dict:
        return self.client.call("state")

    def close(self) -> None:
        self.client.close()


class RemoteDisaggregation:
    """A ``DecodeEngine`` whose prompts a prefill engine at ``peer_address`` computes.

    ``generate(prompts, params)`` sends the prompts' token ids to P, READs the handoffs' pages and
    decodes. Any fault computes the prompts here instead (their ``TransferRecord`` says why): P
    unreachable or gone (its connection is then closed and the decode engine disconnected from its
    pages, so nothing more is READ from it; the next ``generate`` dials again), a failed READ, pages
    that do not fit. ``lease_s``: the longest a handoff waits for its READ before falling back.

    A decode engine over several processes (jax.distributed): every process builds this object and
    calls ``generate`` with the same prompts (the SPMD idiom). Process 0 leads: it alone holds the
    control channel, and it publishes every change of the decode engine (connect, disconnect, the
    handoffs of each ``generate``) over the runtime's key-value store (``StepChannel``) before making
    it; the others replay them, so every process READs its own ranks of the same handoffs. A follower
    given other prompts than the leader's raises ``ProcessesDisagree``.
    """

    def __init__(self, decode: DecodeEngine, peer_address: str, *, lease_s: float = 60.0,
                 connect_timeout_s: float = 10.0, timeout_s: float = 600.0):
        for name, value in (("lease_s", lease_s), ("connect_timeout_s", connect_timeout_s), ("timeout_s", timeout_s)):
            if not 0 < value < 86400:
                raise ConfigError(f"{name}={value!r} must be seconds in (0, 86400)")
        self.decode, self.peer_address, self.lease_s = decode, peer_address, lease_s
        self.connect_timeout_s, self.timeout_s = connect_timeout_s, timeout_s
        self.peer: RemotePrefill | None = None
        self.peer_error: str | None = None  # why the last dial or call failed
        self._channel: StepChannel | None = None
        self._sent = 0  # messages published (leader) or replayed (follower)
        if len(decode.local_ranks) < decode.tp:
            self._channel = StepChannel(f"pd-remote{next(_channels)}")
            if not self.leads:
                self._follow("ready")
                return
            atexit.register(self._abandon)
        self._dial()
        if self.peer is None:
            self._publish("failed", self.peer_error)
            raise TransferError(f"decode engine {decode.name!r}: {self.peer_error}")
        self._publish("ready")

    @property
    def leads(self) -> bool:
        """Whether this process owns the control channel (one process, or process 0 of several)."""
        return self._channel is None or jax.process_index() == 0

    # ---------------------------------------------------------------- the decode engine's processes
    def _publish(self, op: str, *args: Any) -> None:
        if self._channel is not None:
            self._channel.publish(self._sent, json.dumps([op, *args]).encode())
            self._sent += 1

    def _follow(self, until: str) -> list:
        """A follower: replay the leader's messages up to the next ``until`` one, which is returned."""
        while True:
            op, *args = json.loads(self._channel.receive(self._sent))
            self._sent += 1
            if op == "connect":
                with contextlib.suppress(TransferError):  # raised on every process alike: handoffs fall back
                    self.decode.connect(args[0])
            elif op == "disconnect":
                self.decode.disconnect(args[0])
            elif op == "failed":
                raise TransferError(f"decode engine {self.decode.name!r}: {args[0]}")
            elif op == "abandoned":
                raise DistributedError(f"process {jax.process_index()}: process 0 of decode engine "
                                       f"{self.decode.name!r} exited without closing it (see its log)")
            if op == until:
                return args

    def _abandon(self) -> None:
        self._publish("abandoned")

    def _connect(self, directories: list[bytes]) -> None:
        self._publish("connect", [d.decode() for d in directories])
        self.decode.connect(directories)

    def _disconnect(self, engine_id: str) -> None:
        self._publish("disconnect", engine_id)
        self.decode.disconnect(engine_id)

    # ---------------------------------------------------------------- the prefill engine
    def _dial(self) -> None:
        try:
            peer = RemotePrefill(self.peer_address, lease_s=self.lease_s, read_timeout_s=self.decode.timeout_s,
                                 connect_timeout_s=self.connect_timeout_s, timeout_s=self.timeout_s)
        except TransferError as err:
            self.peer_error = str(err)
            return
        try:
            self._connect(peer.directories)
        except TransferError as err:  # pages that do not fit: every handoff from it falls back
            self.peer_error = str(err)
        self.peer = peer

    def _lost(self, err: TransferError) -> None:
        """Stop reading from a peer whose channel failed: its unread pages may be freed by its lease."""
        self.peer_error = str(err)
        if self.peer is not None:
            self._disconnect(self.peer.engine_id)
            self.peer.close()
            self.peer = None

    def _prefill(self, prompt_ids: list[list[int]]) -> list[Handoff]:
        if self.peer is None:
            self._dial()
        if self.peer is not None:
            try:
                return self.peer.prefill(prompt_ids)
            except TransferError as err:
                self._lost(err)
        why = f"no prefill engine at {self.peer_address}: {self.peer_error}"
        return [Handoff("", tuple(ids), error=why) for ids in prompt_ids]

    def generate(self, prompts: Sequence[Any], sampling_params: SamplingParams) -> list[RequestOutput]:
        """Outputs in prompt order, as ``DecodeEngine.generate``; ``decode.transfers`` records each import."""
        prompt_ids = [self.decode.llm.prompt_token_ids(p) for p in prompts]
        work = hashlib.sha1(repr((prompt_ids, sampling_params)).encode()).hexdigest()
        if not self.leads:
            leader_work, wire = self._follow("generate")
            if leader_work != work:
                raise ProcessesDisagree(f"process {jax.process_index()} of decode engine {self.decode.name!r} "
                                        "was given other prompts or sampling parameters than process 0")
            return self.decode.generate([Handoff.from_bytes(h) for h in wire], sampling_params,
                                        lease_s=self.lease_s)
        handoffs = self._prefill(prompt_ids)
        self._publish("generate", work, [h.to_bytes().decode() for h in handoffs])
        first = len(self.decode.abandoned)
        outputs = self.decode.generate(handoffs, sampling_params, lease_s=self.lease_s)
        abandoned = self.decode.abandoned[first:]
        if abandoned and self.peer is not None:
            try:
                self.peer.release(abandoned)
            except TransferError as err:
                self._lost(err)
        return outputs

    def close(self) -> None:
        """Disconnect (on every process of the decode engine: followers wait here for the leader's close)."""
        if not self.leads:
            self._follow("close")
            return
        if self.peer is not None:
            self._disconnect(self.peer.engine_id)
            self.peer.close()
            self.peer = None
        self._publish("close")
        if self._channel is not None:
            atexit.unregister(self._abandon)
