"""Data parallelism: ``data_parallel_size`` engine replicas behind one ``AsyncLLM``-shaped front.

Each replica is a whole engine (``EngineCore``, its own pools, scheduler and prefix cache; tensor parallel
over its own ``tensor_parallel_size`` devices when that is > 1), driven by its own ``AsyncLLM`` engine thread,
on a device set disjoint from every other replica's (``replica_devices``). The replicas live in this one
process: why threads rather than processes, docs/architecture.md, "Data parallelism".

``DataParallelAsyncLLM.generate`` routes each request to one replica (``Router``): with prefix caching on, to
the replica that last served the request's longest known run of leading full blocks (prefix affinity: its
prefix cache may hold them), unless that replica is a whole batch (``max_num_seqs``) busier than the least
loaded one; otherwise to the least loaded replica, by outstanding tokens (prompt + tokens still allowed),
then outstanding requests. The request stays on its replica until it finishes or is aborted, and an abort
returns its blocks and slots to that replica's pools.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

import jax

from jaxmamba.engine.async_engine import AsyncLLM
from jaxmamba.engine.core import EngineCore
from jaxmamba.engine.engine_args import EngineConfig
from jaxmamba.engine.llm_engine import LLMEngine
from jaxmamba.engine.request import RequestOutput, SamplingParams, is_int
from jaxmamba.engine.stats import EngineStats
from jaxmamba.errors import ConfigError, RequestError

#: How many block hashes the router remembers for prefix affinity (oldest forgotten first): 64 Ki blocks is
#: a few MB of host memory, and more than the prefix caches of the replicas hold between them at CPU sizes.
AFFINITY_CAPACITY = 1 << 16


def replica_devices(data_parallel_size: int, tensor_parallel_size: int = 1,
                    devices: Sequence[jax.Device] | None = None) -> list[list[jax.Device]]:
    """Disjoint device sets, one per replica: replica ``i`` gets devices ``[i * tp, (i + 1) * tp)`` of
    ``devices`` (default ``jax.devices()``). ``ConfigError`` when ``data_parallel_size *
    tensor_parallel_size`` exceeds the devices, or under the multi-process runtime (not supported)."""
    for name, value in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if not is_int(value) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive int")
    check_one_process(data_parallel_size, jax.process_count())
    devs = list(jax.devices() if devices is None else devices)
    need = data_parallel_size * tensor_parallel_size
    if need > len(devs):
        raise ConfigError(
            f"data_parallel_size={data_parallel_size} * tensor_parallel_size={tensor_parallel_size} = {need} "
            f"devices, but only {len(devs)} {'is' if len(devs) == 1 else 'are'} available (on CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before jax starts)")
    return [devs[i * tensor_parallel_size:(i + 1) * tensor_parallel_size] for i in range(data_parallel_size)]


def check_one_process(data_parallel_size: int, num_processes: int | None) -> None:
    """``ConfigError`` for data parallelism over the multi-process runtime: its replicas run in one process
    (docs/architecture.md, "Data parallelism")."""
    if data_parallel_size != 1 and num_processes not in (None, 1):
        raise ConfigError(f"data_parallel_size={data_parallel_size} with num_processes={num_processes}: "
                          "data-parallel replicas run in one process (multi-host runs one TP engine)")


def leading_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block of ``token_ids``, each chained on the previous (so equal hashes at position
    ``i`` mean equal first ``i + 1`` blocks, as the prefix cache's own keys)."""
    hashes, h = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start:start + block_size])))
        hashes.append(h)
    return hashes


@dataclass
class ReplicaLoad:
    """What one replica has been given and not yet finished (the router's view, kept by the front)."""

    requests: int = 0
    tokens: int = 0  # prompt tokens + tokens each sample may still generate
    routed: int = 0  # requests routed here, ever
    affinity_routed: int = 0  # of which by prefix affinity


class Router:
    """Chooses a replica for each request (see the module docstring for the policy). Not thread-safe: the
    front calls it from one event loop."""

    def __init__(self, num_replicas: int, *, prefix_affinity: bool, affinity_slack: int,
                 capacity: int = AFFINITY_CAPACITY):
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self.prefix_affinity = prefix_affinity
        self.affinity_slack = affinity_slack
        self.capacity = capacity
        self._owner: OrderedDict[int, int] = OrderedDict()  # block hash -> the replica that last served it

    def least_loaded(self) -> int:
        return min(range(len(self.loads)), key=lambda i: (self.loads[i].tokens, self.loads[i].requests, i))

    def _affine(self, hashes: list[int]) -> int | None:
        """The replica that served the longest run of these leading blocks, if any remembers one."""
        for h in reversed(hashes):
            replica = self._owner.get(h)
            if replica is not None:
                return replica
        return None

    def route(self, hashes: list[int], cost: int) -> int:
        """The replica for a request whose leading full blocks hash to ``hashes`` (``leading_block_hashes``)
        and which may hold ``cost`` tokens; its load counts the request until ``release``."""
        least = self.least_loaded()
        chosen, by_affinity = least, False
        if self.prefix_affinity:
            affine = self._affine(hashes)
            if affine is not None and (self.loads[affine].requests - self.loads[least].requests
                                       < self.affinity_slack):
                chosen, by_affinity = affine, True
            for h in hashes:
                self._owner[h] = chosen
                self._owner.move_to_end(h)
            while len(self._owner) > self.capacity:
                self._owner.popitem(last=False)
        load = self.loads[chosen]
        load.requests, load.tokens, load.routed = load.requests + 1, load.tokens + cost, load.routed + 1
        load.affinity_routed += by_affinity
        return chosen

    def release(self, replica: int, cost: int) -> None:
        """The request ``route`` placed on ``replica`` finished or was aborted."""
        load = self.loads[replica]
        load.requests, load.tokens = load.requests - 1, load.tokens - cost


class DataParallelAsyncLLM:
    """``DataParallelAsyncLLM(model, data_parallel_size=N, **engine_args)``: ``N`` replicas of the engine
    ``AsyncLLM(model, **engine_args)`` would build, each on its own ``tensor_parallel_size`` devices, behind
    ``AsyncLLM``'s API (``generate``, ``abort``, ``abort_all``, ``call``, ``shutdown``). ``replicas`` are the
    ``AsyncLLM``s; ``stats()`` returns one ``EngineStats`` per replica."""

    def __init__(self, model, *, data_parallel_size: int = 2, **engine_args):
        check_one_process(data_parallel_size, engine_args.get("num_processes"))  # before the config joins it
        config = EngineConfig(**engine_args)
        device_sets = replica_devices(data_parallel_size, config.tensor_parallel_size)
        self.config = config
        self.replicas: list[AsyncLLM] = []
        try:
            for devices in device_sets:  # one at a time: their compiles share the host's cores anyway
                self.replicas.append(AsyncLLM(LLMEngine(EngineCore(model, config, devices=devices))))
        except BaseException:
            self.shutdown()
            raise
        self.router = Router(len(self.replicas), prefix_affinity=config.enable_prefix_caching,
                             affinity_slack=config.max_num_seqs)
        self._owner: dict[str, int] = {}  # request id -> its replica, while it runs
        self._ids = itertools.count()

    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    @property
    def engine_core(self):
        """Replica 0's ``EngineCore``: what every replica shares (tokenizer, limits, checkpoint) reads here."""
        return self.replicas[0].engine_core

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """``fn()`` on replica 0's engine thread (``AsyncLLM.call``): for what touches ``engine_core``."""
        return self.replicas[0].call(fn)

    def call_with_core(self, fn: Callable) -> concurrent.futures.Future:
        """``fn(core)`` on the least loaded replica's engine thread, with that replica's core, for what any
        replica can answer (the server validates requests this way): intake does not wait behind the busiest
        replica's step, and a core is only touched by its own thread."""
        return self.replicas[self.router.least_loaded()].call_with_core(fn)

    def _cost(self, token_ids: list[int], params: SamplingParams | None) -> int:
        params = SamplingParams() if params is None else params
        room = self.engine_core.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return len(token_ids) + params.n * max(max_tokens, 0)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """``AsyncLLM.generate`` on the replica the router picks; the request's load counts there until its
        stream ends (finished, failed or aborted)."""
        request_id = request_id if request_id is not None else f"dp-async-{next(self._ids)}"
        if request_id in self._owner:
            raise RequestError(f"request_id={request_id!r} is already in use")
        token_ids = self.engine_core.prompt_token_ids(prompt)  # pure: no engine state
        hashes = leading_block_hashes(token_ids, self.config.block_size) if self.router.prefix_affinity else []
        cost = self._cost(token_ids, sampling_params)
        index = self.router.route(hashes, cost)
        self._owner[request_id] = index
        try:
            async for out in self.replicas[index].generate(prompt, sampling_params, request_id):
                yield out
        finally:
            self._owner.pop(request_id, None)
            self.router.release(index, cost)

    def replica_of(self, request_id: str) -> int | None:
        """The replica running ``request_id`` (None once it ended, or if unknown)."""
        return self._owner.get(request_id)

    def running(self) -> dict[str, int]:
        """Every request routed and not yet ended -> its replica."""
        return dict(self._owner)

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Abort a request on its replica (its blocks and slots return to that replica's pools)."""
        index = self._owner.get(request_id)
        if index is None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)  # unknown or finished: nothing to abort, as AsyncLLM.abort
            return done
        return self.replicas[index].abort(request_id)

    def abort_all(self, reason: str) -> concurrent.futures.Future:
        """``AsyncLLM.abort_all`` on every replica; the future is done when all are."""
        return _all_of([r.abort_all(reason) for r in self.replicas])

    def _query_all(self, name: str) -> list:
        return [getattr(r, name)() for r in self.replicas]

    def stats(self) -> list[EngineStats]:
        """Each replica's ``EngineStats``, in replica order."""
        return self._query_all("stats")

    def num_unfinished_requests(self) -> int:
        return sum(self._query_all("num_unfinished_requests"))

    def check_invariants(self) -> None:
        self._query_all("check_invariants")

    def shutdown(self) -> None:
        """Shut every replica down (``AsyncLLM.shutdown``)."""
        for replica in self.replicas:
            replica.shutdown()


def _all_of(futures: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """A future done when every one of ``futures`` is: the first exception among them, else None."""
    combined: concurrent.futures.Future = concurrent.futures.Future()
    remaining = [len(futures)]

    def one_done(_):
        remaining[0] -= 1
        if remaining[0] == 0:
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                combined.set_exception(errors[0])
            else:
                combined.set_result(None)

    if not futures:
        combined.set_result(None)
    for f in futures:
        f.add_done_callback(one_done)
    return combined
