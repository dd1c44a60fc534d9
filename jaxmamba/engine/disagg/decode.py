"""The D side of P/D disaggregation: ``DecodeEngine`` READs a handoff's pages from the prefill engine into host
staging, admits the request as computed and installs the pages into its caches, or falls back to computing
the prompt itself (see the package docstring)."""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxmamba.cache import StateCaches
from jaxmamba.engine.disagg.handoff import (Handoff, StagingPool, _close_agents, agree, layer_names, local_ranks,
                                            named_failures, side_gather, tp_size_of)
from jaxmamba.engine.llm import LLM
from jaxmamba.engine.request import CompletionOutput, Request, RequestOutput, SamplingParams
from jaxmamba.engine.scheduler import cdiv
from jaxmamba.errors import ConfigError, RequestError, SlotError, TransferError
from jaxmamba.metadata import CacheMode
from jaxmamba.parallel.distributed import device_put_global
from transfer.hetero_tp import TransferPlan, TransferShape
from transfer.nixl_bridge import PageDirectory, PageImporter


@dataclass
class TransferRecord:
    """How a D request got its prompt state: ``status`` "imported" (READ from P), "fallback" (a fault,
    ``error`` says which; the prompt was computed here) or "local" (nothing to import: a one-token prompt)."""

    handoff_id: str | None
    status: str
    error: str | None = None
    bytes_read: int = 0  # summed over D ranks
    read_seconds: float = 0.0  # all D ranks' READs, posted one rank after another
    num_descriptors: int = 0


@dataclass
class _Peer:
    """A connected P engine: one importer per D rank, and how many D ranks read each P rank."""

    engine_id: str
    p_tp: int
    importers: list[PageImporter]
    readers: int


@dataclass
class _Incoming:
    request: Request
    handoff: Handoff
    staged: tuple[int, list[int]] | None = None  # D staging (slot, blocks) once READ
    record: TransferRecord | None = None
    failed: bool = False  # the READ failed: the request computes its prompt here
    read_by: float | None = None  # time.monotonic() after which no READ may start (the handoff's lease)


class DecodeEngine:
    """The D side: ``connect(directories)`` to P engines, then ``add_request(handoff, params)`` / ``step``
    (or ``generate(handoffs, params)``).

    ``llm`` may run at any TP size and must use ``mamba_cache_mode='none'`` (``admit_computed``).
    ``staging_requests`` (default ``max_num_seqs``) requests can sit READ but not yet admitted.
    ``timeout_s`` bounds each D rank's READ. The scatter that installs staged pages into the caches
    is compiled here, as part of the engine's warm-up (``llm.stats.backend_compiles_since_warmup``
    stays 0 while serving). ``ucx_devices``: the network devices its NIXL agents READ over
    (``PageImporter``).

    Over several processes (``llm``'s mesh spans them, jax.distributed): every process builds this engine
    and makes the same calls in the same order (the SPMD idiom; ``remote.RemoteDisaggregation`` does it
    for the followers); each reads and registers only its own ranks (``local_ranks``), and the processes
    agree on every ``connect`` and every READ (``ProcessGather``), so a fault anywhere falls back on every
    process and a request is imported everywhere or nowhere. Different handoffs or directories at the
    same point are a ``ProcessesDisagree``.
    """

    def __init__(self, llm: LLM, *, name: str = "decode", staging_requests: int | None = None,
                 timeout_s: float = 10.0, ucx_devices: str | None = None):
        if llm.kv.cache_mode != CacheMode.NONE:
            raise ConfigError(f"a decode engine imports computed tokens, which needs mamba_cache_mode='none' "
                              f"(got {llm.kv.cache_mode!r})")
        self.llm, self.name, self.timeout_s, self.ucx_devices = llm, name, timeout_s, ucx_devices
        self.tp = tp_size_of(llm)
        self.local_ranks = local_ranks(llm)
        self._gather = side_gather(llm, "decode", timeout_s * self.tp)
        self.mamba_layers, self.kv_layers = layer_names(llm.cfg)
        caches = llm.runner.caches
        dtype_of = lambda arrays: arrays[0].dtype if arrays else 4  # noqa: E731  (no such layers: size unused)
        self.shape = TransferShape.from_config(
            llm.cfg, conv_dtype=dtype_of(caches.conv), ssm_dtype=dtype_of(caches.ssm), kv_dtype=dtype_of(caches.kv),
            block_size=llm.block_size, num_spec=llm.num_spec)
        n = staging_requests or llm.scheduler.max_num_seqs
        self.max_blocks = cdiv(llm.max_model_len, llm.block_size) if self.kv_layers else 0
        self.staging = StagingPool(caches, self.tp, n + 1, n * self.max_blocks + 1)
        self._install_pages, self._install_shardings = self._compile_install()
        self._peers: dict[str, _Peer] = {}
        self.peer_errors: dict[str, str] = {}  # engine id -> why connecting to it failed
        self._incoming: deque[_Incoming] = deque()
        self.transfers: dict[str, TransferRecord] = {}  # D request id -> record
        self.abandoned: list[str] = []  # handoff ids this engine will never read: release them on P

    # ---------------------------------------------------------------- connection
    def connect(self, directories: Iterable[bytes | PageDirectory]) -> str:
        """Connect every D rank to one P engine's ranks; returns its engine id.

        Builds one ``TransferPlan`` and ``PageImporter`` per D rank (registering its staging pages),
        and checks every directory against the plans. Raises ``TransferError`` naming the problem
        (page size, TP ratio, layers...) and remembers it: handoffs from that engine then fall back.
        Connecting again to a connected engine reloads its directories (after a failure).
        """
        dirs = [d if isinstance(d, PageDirectory) else PageDirectory.from_bytes(d) for d in directories]
        engine_ids = sorted({d.engine_id for d in dirs})
        if len(engine_ids) != 1:
            raise TransferError(f"connect() takes the directories of exactly one prefill engine, got {engine_ids}")
        engine_id = engine_ids[0]
        pages = hashlib.sha1(b"".join(d.to_bytes() for d in sorted(dirs, key=lambda d: d.rank))).hexdigest()
        subject = f"connect to {engine_id!r}, directories {pages}"
        opened, failure = None, None
        try:
            opened = self._open_importers(engine_id, dirs)
        except (TransferError, ConfigError, SlotError) as err:
            failure = str(err)
        failure = named_failures([v["failure"] for v in self._agree(subject, failure=failure)])
        if failure is not None:
            if opened is not None and engine_id not in self._peers:
                _close_agents(opened.importers)
            self.peer_errors[engine_id] = failure
            raise TransferError(f"decode engine {self.name!r} cannot read from prefill engine {engine_id!r}: "
                                f"{failure}")
        self._peers[engine_id] = opened
        self.peer_errors.pop(engine_id, None)
        return engine_id

    def _open_importers(self, engine_id: str, dirs: list[PageDirectory]) -> _Peer:
        """This process's importers of one P engine (its ranks only), connected to ``dirs``; raises on a fault."""
        peer = self._peers.get(engine_id)
        if peer is not None:
            for importer in peer.importers:
                importer.connect(dirs)
            return peer
        p_tp = dirs[0].tp_size
        if sorted(d.rank for d in dirs) != list(range(p_tp)):
            raise TransferError(f"prefill engine {engine_id!r} (TP={p_tp}) sent directories for ranks "
                                f"{sorted(d.rank for d in dirs)}")
        plans = [TransferPlan(self.shape, p_tp, self.tp, rank) for rank in range(self.tp)]
        readers = {p: sum(p in plan.read_targets for plan in plans) for p in range(p_tp)}
        if len(set(readers.values())) != 1:  # every TP pair has a uniform count; guard the protocol
            raise TransferError(f"P ranks are read by different numbers of D ranks {readers}")
        importers: list[PageImporter] = []
        try:
            for plan in plans:
                if plan.d_rank not in self.local_ranks:  # another process of this engine reads it
                    continue
                importer = PageImporter(f"{self.name}-{engine_id}-d{plan.d_rank}", plan,
                                        ucx_devices=self.ucx_devices)
                importers.append(importer)
                self.staging.register(importer, plan.d_rank, self.mamba_layers, self.kv_layers)
                importer.connect(dirs)
        except BaseException:
            _close_agents(importers)
            raise
        return _Peer(engine_id, p_tp, importers, readers[0])

    def _agree(self, subject: str, **mine: Any) -> list[dict]:
        return agree(self._gather, f"decode engine {self.name!r}", subject, **mine)

    def disconnect(self, engine_id: str) -> None:
        """Close the importers of one P engine (deregistering their staging pages); unknown ids are ignored."""
        peer = self._peers.pop(engine_id, None)
        if peer is None:
            return
        _close_agents(peer.importers)

    def close(self) -> None:
        for engine_id in list(self._peers):
            self.disconnect(engine_id)

    @property
    def connected(self) -> tuple[str, ...]:
        return tuple(self._peers)

    # ---------------------------------------------------------------- requests
    def add_request(self, handoff: Handoff | bytes, params: SamplingParams, *,
                    lease_s: float | None = None) -> Request:
        """Queue a request that continues a P engine's prefill (or computes its prompt here when it cannot).

        ``lease_s``: no READ of its pages starts later than that many seconds from now (the request
        then falls back): the promise that lets a P engine free the pages of a decode engine it lost
        (``remote.PrefillServer``). Raises ``RequestError`` for a prompt this engine cannot serve at
        all (as ``LLM.add_request``).
        """
        h = handoff if isinstance(handoff, Handoff) else Handoff.from_bytes(handoff)
        req = self.llm.new_request(list(h.prompt_token_ids), params)
        problem = self._check_handoff(h)
        if problem is None:
            self._incoming.append(_Incoming(req, h, read_by=None if lease_s is None else time.monotonic() + lease_s))
        elif h.pages is None and h.error is None:
            self.transfers[req.request_id] = TransferRecord(None, "local")
            self.llm.scheduler.add(req)
        else:
            self._fall_back(req, h, problem)
        return req

    def import_now(self, handoff: Handoff | bytes, params: SamplingParams) -> Request:
        """READ one handoff's pages and install them into the caches now, without an engine step.

        The request is admitted as computed (its state slot and KV blocks hold exactly the imported
        pages; ``PrefillEngine.stage_request`` can export them again) and the next ``step`` decodes it.
        Raises ``RequestError`` when another handoff is still waiting (this one would overtake it) and
        ``TransferError`` when the pages cannot be imported now (no pages, pages that do not fit, a
        failed READ, staging or engine full); nothing is then left queued here, and a handoff with
        pages is listed in ``abandoned`` (release it on P).
        """
        if self._incoming:
            raise RequestError(f"import_now needs an empty import queue ({len(self._incoming)} handoffs wait)")
        h = handoff if isinstance(handoff, Handoff) else Handoff.from_bytes(handoff)
        problem = self._check_handoff(h)
        if problem is not None:
            if h.handoff_id is not None:
                self.abandoned.append(h.handoff_id)
            raise TransferError(f"decode engine {self.name!r} could not import handoff {h.handoff_id!r}: {problem}")
        req = self.add_request(h, params)
        self._import_incoming()
        record = self.transfers.get(req.request_id)
        if record is not None and record.status == "imported":
            return req
        if self._incoming:  # READ but not admitted, or not READ: give its staging back
            item = self._incoming.pop()
            if item.staged is not None:
                self.staging.free(*item.staged)
            self.abandoned.append(h.handoff_id)
        self.llm.abort_request([req.request_id])
        why = record.error if record is not None else "staging or engine full"
        raise TransferError(f"decode engine {self.name!r} could not import handoff {h.handoff_id!r} now: {why}")

    def _check_handoff(self, h: Handoff) -> str | None:
        """None if ``h`` can be imported, else why not (checked before any READ)."""
        if h.pages is None:
            return h.error or "nothing was prefilled"
        if h.engine_id not in self._peers:
            why = self.peer_errors.get(h.engine_id, "never connected")
            return f"not connected to prefill engine {h.engine_id!r}: {why}"
        n = h.num_computed_tokens
        if not 0 < n < len(h.prompt_token_ids):
            return f"handoff says {n} of {len(h.prompt_token_ids)} tokens were computed"
        want_blocks = cdiv(n, self.llm.block_size) if self.kv_layers else 0
        mamba, kv = h.pages.mamba, h.pages.kv
        if set(mamba) != set(self.mamba_layers) or any(len(v) != 1 for v in mamba.values()):
            return f"handoff pages do not fit this model: Mamba layers {sorted(mamba)} (one slot each expected)"
        if set(kv) != set(self.kv_layers) or any(len(v) != want_blocks for v in kv.values()):
            return (f"handoff pages do not fit this model: attention layers {sorted(kv)} with "
                    f"{sorted({len(v) for v in kv.values()})} blocks, {want_blocks} expected for {n} tokens")
        return None

    def _fall_back(self, req: Request, h: Handoff, error: str) -> None:
        self.transfers[req.request_id] = TransferRecord(h.handoff_id, "fallback", error)
        if h.handoff_id is not None:
            self.abandoned.append(h.handoff_id)
        self.llm.scheduler.add(req)  # computes its whole prompt here

    def step(self) -> list[Request]:
        """Import what can be imported (READ, admit, install), then one engine step; returns finished requests."""
        self._import_incoming()
        return self.llm.step() if self.llm.scheduler.has_work else []

    def _import_incoming(self) -> None:
        # READ ahead as far as D staging allows (so P staging drains), then admit in arrival order
        # while the engine has room; a request that fell back has already been queued for prefill.
        for item in self._incoming:
            if item.staged is None and not item.failed and not self._read(item):
                break  # D staging full
        while self._incoming:
            item = self._incoming[0]
            if not item.failed:
                if item.staged is None:
                    return
                if not self.llm.scheduler.admit_computed(item.request, item.handoff.num_computed_tokens):
                    return
                self._install(item)
            self._incoming.popleft()

    def _read(self, item: _Incoming) -> bool:
        """READ a handoff's pages into D staging on every rank; False if staging is full (retry later).

        Over several processes each READs its own ranks, and they agree twice: before (all have staging
        room, the peer connected, the lease alive) and after (every READ succeeded), so that all READ,
        import or fall back alike."""
        h = item.handoff
        assert h.pages is not None
        num_blocks = len(next(iter(h.pages.kv.values()))) if self.kv_layers else 0
        got = self.staging.allocate(num_blocks)
        peer = self._peers.get(h.engine_id)
        if got is None:
            verdict = "full"
        elif peer is None:  # disconnected since add_request
            verdict = f"prefill engine {h.engine_id!r} was disconnected"
        elif item.read_by is not None and time.monotonic() > item.read_by:
            verdict = f"the lease on handoff {h.handoff_id!r} expired before its READ"
        else:
            verdict = None
        verdicts = [v["verdict"] for v in self._agree(f"READ handoff {h.handoff_id!r}", verdict=verdict)]
        if "full" in verdicts:
            if got is not None:
                self.staging.free(*got)
            return False
        slot, blocks = got
        refused = named_failures(verdicts)
        if refused is not None:
            self.staging.free(slot, blocks)
            item.failed = True
            self._fall_back(item.request, h, refused)
            return True
        error, counts, stuck = self._read_local(item, peer, slot, blocks)
        results = self._agree(f"READ handoff {h.handoff_id!r} done", error=error, counts=counts)
        failure = named_failures([r["error"] for r in results])
        if failure is not None:
            if stuck:
                self.staging.quarantine(slot, blocks)
            else:
                self.staging.free(slot, blocks)
            item.failed = True
            self._fall_back(item.request, h, f"READ from prefill engine {h.engine_id!r} failed: {failure}")
            return True
        bytes_read, seconds, descriptors = (sum(c) for c in zip(*(r["counts"] for r in results), strict=True))
        item.staged = (slot, blocks)
        item.record = TransferRecord(h.handoff_id, "imported", None, int(bytes_read), float(seconds), int(descriptors))
        return True

    def _read_local(self, item: _Incoming, peer: _Peer, slot: int,
                    blocks: list[int]) -> tuple[str | None, list, bool]:
        """This process's ranks' READs: ``(error or None, [bytes, seconds, descriptors], a READ is stuck)``."""
        h = item.handoff
        notif = f"{h.handoff_id}|{peer.readers}".encode()
        stuck_before = sum(importer.num_stuck_reads for importer in peer.importers)
        counts = [0, 0.0, 0]
        try:
            for importer in peer.importers:
                result = importer.read_request(h.pages, mamba_slots=[slot], kv_blocks=blocks,
                                               timeout_s=self.timeout_s, notif=notif)
                counts = [counts[0] + result.bytes_read, counts[1] + result.seconds,
                          counts[2] + result.num_descriptors]
        except (TransferError, SlotError) as err:
            stuck = sum(importer.num_stuck_reads for importer in peer.importers) > stuck_before
            return str(err), counts, stuck
        return None, counts, False

    def _install(self, item: _Incoming) -> None:
        """Copy a request's staged pages into the caches at the slot and blocks ``admit_computed`` gave it."""
        req, (s_slot, s_blocks) = item.request, item.staged
        rid, tp = req.request_id, self.tp
        kv = self.llm.kv
        slot = np.int32(kv.state_table(rid)[0] if self.mamba_layers else 0)
        block_ids = np.full(self.max_blocks, self.llm.num_blocks, np.int32)  # out of range: dropped
        dst_blocks = kv.kv_block_ids(rid)[: len(s_blocks)] if self.kv_layers else []
        block_ids[: len(dst_blocks)] = dst_blocks
        # Global TP-layout rows: ranks side by side on the sharded axis, as parallel.shard_caches lays them out.
        conv = [np.concatenate([self.staging.conv[r][i][s_slot] for r in range(tp)], axis=0)
                for i in range(len(self.mamba_layers))]
        ssm = [np.concatenate([self.staging.ssm[r][i][s_slot] for r in range(tp)], axis=0)
               for i in range(len(self.mamba_layers))]
        kv_rows = []
        for j in range(len(self.kv_layers)):
            rows = np.concatenate([self.staging.kv[r][j][:, s_blocks] for r in range(tp)], axis=3)
            padded = np.zeros((2, self.max_blocks, *rows.shape[2:]), rows.dtype)
            padded[:, : len(s_blocks)] = rows
            kv_rows.append(padded)
        args = (tuple(conv), tuple(ssm), tuple(kv_rows), slot, block_ids)
        if self._install_shardings is not None:
            args = device_put_global(args, self._install_shardings)
        self.llm.runner.caches = self._install_pages(self.llm.runner.caches, *args)
        self.staging.free(s_slot, s_blocks)
        self.transfers[rid] = item.record

    def _compile_install(self) -> tuple[Callable, Any]:
        """AOT-compile ``caches, conv rows, ssm rows, kv blocks, slot, block ids -> caches`` (caches donated).

        Per Mamba layer a conv row ``(tp*conv_dim_local, R)`` and an SSM row ``(H, P, N)``; per
        attention layer ``(2, cdiv(max_model_len, block_size), block_size, tp*kv_local, head_dim)``
        with block ids padded by an out-of-range id whose writes are dropped. Fixed shapes, so
        serving never compiles; with TP every update is sharded like the cache it lands in, so each
        device writes only its own pages. Returns the executable and its argument shardings (None
        without TP) for ``jax.device_put``.
        """
        llm, caches = self.llm, self.llm.runner.caches
        mesh = llm.mesh

        def install(caches, conv_rows, ssm_rows, kv_blocks, slot, block_ids):
            return StateCaches(
                conv=tuple(c.at[slot].set(u, mode="drop") for c, u in zip(caches.conv, conv_rows, strict=True)),
                ssm=tuple(c.at[slot].set(u, mode="drop") for c, u in zip(caches.ssm, ssm_rows, strict=True)),
                kv=tuple(c.at[:, block_ids].set(u, mode="drop") for c, u in zip(caches.kv, kv_blocks, strict=True)),
            )

        def spec(shape, dtype, sharding=None):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        if mesh is None:
            row_sharding = lambda a, drop: None  # noqa: E731
            scalar = None
        else:
            def row_sharding(a, drop: bool):  # the cache's own spec, without the slot axis for a row
                axes = tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
                return NamedSharding(mesh, PartitionSpec(*(axes[1:] if drop else axes)))
            scalar = NamedSharding(mesh, PartitionSpec())
        mb = self.max_blocks
        conv_specs = tuple(spec(c.shape[1:], c.dtype, row_sharding(c, True)) for c in caches.conv)
        ssm_specs = tuple(spec(s.shape[1:], s.dtype, row_sharding(s, True)) for s in caches.ssm)
        kv_specs = tuple(spec((2, mb, *k.shape[2:]), k.dtype, row_sharding(k, False)) for k in caches.kv)
        index_specs = (spec((), np.int32, scalar), spec((mb,), np.int32, scalar))
        arg_shardings = None if mesh is None else jax.tree.map(
            lambda s: s.sharding, (conv_specs, ssm_specs, kv_specs, *index_specs))
        abstract_caches = jax.tree.map(lambda a: spec(a.shape, a.dtype, a.sharding if mesh is not None else None),
                                       caches)
        out_shardings = None if mesh is None else jax.tree.map(lambda a: a.sharding, caches)
        steps = llm.runner.steps
        compiles_before = steps.backend_compiles_since_warmup
        compiled = jax.jit(install, donate_argnums=(0,), out_shardings=out_shardings).lower(
            abstract_caches, conv_specs, ssm_specs, kv_specs, *index_specs).compile()
        # Part of this engine's warm-up: serving must still compile nothing.
        steps.backend_compiles_after_warmup_base += steps.backend_compiles_since_warmup - compiles_before
        return compiled, arg_shardings

    # ---------------------------------------------------------------- offline loop
    def generate(self, handoffs: Sequence[Handoff | bytes], sampling_params: SamplingParams, *,
                 lease_s: float | None = None) -> list[RequestOutput]:
        """Serve every handoff to completion; outputs in order (a rejected prompt gets ``error`` set).
        ``lease_s`` as ``add_request``'s."""
        slots: list[Request | RequestOutput] = []
        for handoff in handoffs:
            try:
                slots.append(self.add_request(handoff, sampling_params, lease_s=lease_s))
            except RequestError as err:
                h = handoff if isinstance(handoff, Handoff) else Handoff.from_bytes(handoff)
                slots.append(RequestOutput("rejected", list(h.prompt_token_ids),
                                           [CompletionOutput(0, [], "", None, "error")], True, error=str(err)))
                if h.handoff_id is not None:
                    self.abandoned.append(h.handoff_id)
        while self._incoming or self.llm.scheduler.has_work:
            busy, waiting = self.llm.scheduler.has_work, len(self._incoming)
            self.step()
            if not busy and len(self._incoming) == waiting and not self.llm.scheduler.has_work:
                raise RequestError("a handoff can be admitted neither now nor later: the engine is idle and "
                                   f"still cannot hold request {self._incoming[0].request.request_id!r}")
        return [s if isinstance(s, RequestOutput) else self.llm.request_output(s) for s in slots]

