"""Engine-level P/D disaggregation: a prefill ``LLM`` and a decode ``LLM`` of any two TP sizes.

The prefill (P) engine computes a prompt's first ``N-1`` tokens. The decode (D) engine READs that
request's attention KV blocks and Mamba state (conv + SSM, the state after token ``N-1``) over NIXL,
then computes token ``N`` from it as a one-token extend with prior state, which the metadata
classifies as a decode (seed 000), and keeps decoding. The TP re-sharding lives entirely in the
READ byte ranges (``transfer.hetero_tp.TransferPlan``, one per D rank): nothing is permuted on
either side, and the bytes each D rank receives are exactly the pages its own sharding would hold.

Flow (``Handoff`` is what travels from P to D besides NIXL's own traffic)::

    P  PrefillEngine.prefill(prompts)
         LLM computes prompt[:N-1]; the request is held on finish (Scheduler.hold_on_finish)
         stage: copy its state slot and KV blocks, per P rank, into the registered staging pool
         release the engine's blocks/slots; Handoff(prompt, N-1, RequestPages of staging ids)
    D  DecodeEngine.add_request(handoff, params)
         every D rank: PageImporter.read_request into D's registered staging pool (plan ranges)
         all READs done: Scheduler.admit_computed(req, N-1), one AOT-compiled scatter copies the
         staged pages into the JAX caches, D staging freed; the next step decodes token N
    P  PrefillEngine.poll(): once every D rank that reads a P rank has notified it (NIXL
         notification "<request id>|<readers>"), the P staging pages are freed

Why host staging on the P side. The jitted step donates the caches: after every step they are new
``jax.Array``s, and XLA may give them new buffers (donation allows reuse, it does not promise
it). A NIXL registration of a live cache buffer is therefore valid only while the engine does not
step. The two correct options are (a) register the live caches after the prefill and keep the
engine idle until every reader is done (zero copy; but the P engine stalls for each transfer, and
registrations, remote keys and directories change every round, so D reconnects every round), or
(b) copy each request's pages into host arrays registered once at start-up. This module does (b):
the P engine keeps prefilling while D engines read, agents and directories are set up once, and
the copy is only the request's own pages (one state slot and ``cdiv(N-1, block_size)`` KV blocks
per layer and rank, read through zero-copy numpy views of the CPU device buffers; on a GPU the
view would be a device-to-host copy of the whole cache shard, and a device-side gather of the
request's pages the thing to add).
``Scheduler.hold_on_finish`` keeps the request's blocks and slot allocated from its finish until
the copy: nothing can reuse them in between, and while the staging pool is full (D has not read
yet) finished prefills simply stay held in the engine (backpressure, no loss).

Why staging on the D side. The D caches are donated JAX arrays too, so they cannot be READ
targets; READs land in host pages registered once per connected P engine, and only when every
D rank's READ has completed is the request admitted and the data installed into the caches. A
failed READ leaves nothing but staging pages to drop: no partially written state is ever used,
and admission after the READs means there are no engine blocks or slots to take back.

Faults (each recorded in ``DecodeEngine.transfers[request_id].error``; the request then computes
its whole prompt on the D engine, which gives the same tokens, and its handoff id lands in
``DecodeEngine.abandoned`` so the caller can ``PrefillEngine.release`` it on P):

* plan / page-size mismatch (another model, dtype, block size, speculative rows, or a TP pair
  without a rank mapping): ``connect`` raises ``TransferError`` and remembers why; handoffs from
  that engine fall back. A handoff whose pages do not fit this model falls back as well.
* dead peer, failed READ, READ timeout: ``ReadFailed`` from the bridge (which then drops that P
  rank: later handoffs from the engine fall back at once until ``connect`` is called again). The
  request's D staging pages are freed, or kept out of use for good if NIXL could not cancel a
  READ into them.

``prefill_process_main`` / ``decode_process_main`` run the two engines in spawned processes
(commands over a multiprocessing pipe, as ``transfer.pages.synthetic_prefill_main``) and
``EngineProcess`` drives them; the tests and ``python -m jaxmamba.bench transfer --engine`` use them.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import multiprocessing as mp
import os
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from jaxmamba import errors
from jaxmamba.engine.llm import LLM
from jaxmamba.engine.request import CompletionOutput, Request, RequestOutput, SamplingParams
from jaxmamba.engine.scheduler import cdiv
from jaxmamba.errors import ConfigError, RequestError, SlotError, TransferError
from transfer.hetero_tp import TransferPlan, TransferShape
from transfer.nixl_bridge import PageDirectory, PageExporter, PageImporter, RequestPages

#: What the P engine runs for a prompt: its first N-1 tokens; the one token it samples is dropped.
_PREFILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def layer_names(cfg) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(mamba layer names, attention layer names)`` as both engines name them in directories and pages."""
    return (tuple(f"layers.{i}.mixer" for i in cfg.mamba_layer_ids),
            tuple(f"layers.{i}.attn" for i in cfg.attention_layer_ids))


def tp_size_of(llm: LLM) -> int:
    """The engine's ``tensor_parallel_size``."""
    if llm.mesh is None:
        return 1
    from jaxmamba.parallel import mesh_tp_size

    return mesh_tp_size(llm.mesh)


# ============================================================================ staging pages
class StagingPool:
    """Host pages in one engine's per-rank cache layout, registered with NIXL (both sides use one).

    Per TP rank ``r``: ``conv[r][i]`` ``(num_slots, conv_dim_local, R)``, ``ssm[r][i]``
    ``(num_slots, H_local, P, N)`` per Mamba layer ``i`` and ``kv[r][j]`` ``(2, num_blocks,
    block_size, kv_heads_local, head_dim)`` per attention layer ``j``: rank ``r``'s shard of the
    engine's caches (``jaxmamba.parallel.rank_pages``), same dtypes. Slot 0 and block 0 are null and
    never handed out, as in the engine, so the bridge's null-page checks hold unchanged. Every array
    sits on its own anonymous mapping: page aligned for registration, and ``unmap`` really gives the
    memory back (a READ of it afterwards fails; used to inject that fault).
    """

    def __init__(self, caches, tp: int, num_slots: int, num_blocks: int):
        if num_slots < 2 or num_blocks < 2:
            raise SlotError(f"a staging pool needs >= 2 slots and blocks (0 is null), got {num_slots}, {num_blocks}")
        self.tp, self.num_slots, self.num_blocks = tp, num_slots, num_blocks
        self._maps: list[mmap.mmap] = []

        def local(a, n: int, index_axis: int, tp_axis: int) -> tuple[tuple[int, ...], np.dtype]:
            shape = list(a.shape)
            shape[index_axis], shape[tp_axis] = n, shape[tp_axis] // tp
            return tuple(shape), np.dtype(a.dtype)

        self.conv = [[self._array(*local(c, num_slots, 0, 1)) for c in caches.conv] for _ in range(tp)]
        self.ssm = [[self._array(*local(s, num_slots, 0, 1)) for s in caches.ssm] for _ in range(tp)]
        self.kv = [[self._array(*local(k, num_blocks, 1, 3)) for k in caches.kv] for _ in range(tp)]
        self._free_slots = deque(range(1, num_slots))
        self._free_blocks = deque(range(1, num_blocks))
        self.num_quarantined = 0  # pages a READ NIXL could not cancel may still write

    def _array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        mm = mmap.mmap(-1, max(nbytes, 1))
        self._maps.append(mm)
        return np.frombuffer(mm, dtype=dtype, count=int(np.prod(shape))).reshape(shape)

    # ids ---------------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - 1 - len(self._free_slots) - self.num_quarantined

    def allocate(self, num_blocks: int) -> tuple[int, list[int]] | None:
        """One slot and ``num_blocks`` blocks, or None (nothing taken) when the pool cannot hold them."""
        if not self._free_slots or num_blocks > len(self._free_blocks):
            return None
        return self._free_slots.popleft(), [self._free_blocks.popleft() for _ in range(num_blocks)]

    def free(self, slot: int, blocks: Iterable[int]) -> None:
        self._free_slots.append(slot)
        self._free_blocks.extend(blocks)

    def quarantine(self, slot: int, blocks: Iterable[int]) -> None:
        """Keep an allocated slot and its blocks out of use for good: a READ into them could not be cancelled."""
        self.num_quarantined += 1

    # NIXL ----------------------------------------------------------------------------------------
    def register(self, agent, rank: int, mamba_layers: Sequence[str], kv_layers: Sequence[str]) -> None:
        """Register rank ``rank``'s pages with ``agent`` (a ``PageExporter`` or ``PageImporter``)."""
        for layer, conv, ssm in zip(mamba_layers, self.conv[rank], self.ssm[rank], strict=True):
            agent.register_mamba_layer(layer, conv=conv, ssm=ssm)
        for layer, kv in zip(kv_layers, self.kv[rank], strict=True):
            agent.register_kv_layer(layer, kv, kv_layout="NHD")

    def unmap(self) -> None:
        """Give the memory back to the OS (deregister it first). The pool is unusable afterwards."""
        self.conv = self.ssm = self.kv = []
        for mm in self._maps:
            mm.close()
        self._maps.clear()


# ============================================================================ P -> D handoff
@dataclass(frozen=True)
class Handoff:
    """What a prefill engine gives a decode engine for one prompt (JSON on the wire, never pickle).

    ``pages`` (the request's staging pages on P, ``RequestPages.request_id`` = the handoff id) is
    None when nothing was prefilled: a one-token prompt (``error`` None), or a prompt the P engine
    refused (``error`` says why). ``num_computed_tokens`` is ``N-1`` otherwise.
    """

    engine_id: str
    prompt_token_ids: tuple[int, ...]
    num_computed_tokens: int = 0
    pages: RequestPages | None = None
    error: str | None = None

    @property
    def handoff_id(self) -> str | None:
        return self.pages.request_id if self.pages is not None else None

    def to_bytes(self) -> bytes:
        return json.dumps({"engine_id": self.engine_id, "prompt_token_ids": list(self.prompt_token_ids),
                           "num_computed_tokens": self.num_computed_tokens, "error": self.error,
                           "pages": None if self.pages is None else json.loads(self.pages.to_bytes())}).encode()

    @classmethod
    def from_bytes(cls, data: bytes | str) -> "Handoff":
        try:
            d = json.loads(data)
            pages = None if d["pages"] is None else RequestPages.from_bytes(json.dumps(d["pages"]))
            return cls(str(d["engine_id"]), tuple(int(t) for t in d["prompt_token_ids"]),
                       int(d["num_computed_tokens"]), pages, None if d["error"] is None else str(d["error"]))
        except (KeyError, TypeError, ValueError) as err:
            raise TransferError(f"malformed handoff: {err!r}") from None


@dataclass
class _Staged:
    """A handoff's P staging pages and which D agents have notified each P rank that they read them."""

    slot: int
    blocks: list[int]
    heard: list[set[str]]  # per P rank
    readers: int = 0  # D ranks reading each P rank (from the notifications), 0 = none heard yet


# ============================================================================ prefill side
class PrefillEngine:
    """The P side: ``prefill(prompts)`` -> one ``Handoff`` per prompt; ``poll`` frees what D has read.

    ``llm`` may run at any TP size and must use ``mamba_cache_mode='none'`` (the state after the
    last computed token is then column 0 of the request's Mamba table). ``staging_requests``
    (default ``max_num_seqs``) handoffs can wait to be read at once. One ``PageExporter`` (NIXL
    agent) per TP rank registers that rank's staging pages; ``directories()`` is what decode
    engines ``connect`` to. ``progress_thread=False`` saves the core NIXL's progress thread spins;
    the owner then calls ``poll`` every millisecond or so while idle (it drives READs and
    notifications), and READs wait while the engine computes. A handoff stays staged until every
    reader has notified or ``release`` is called: there is no lease, so pages a dead decode engine
    never read stay staged until the caller releases them (freeing them on a timer instead could
    hand a slow reader another request's bytes).
    """

    def __init__(self, llm: LLM, *, engine_id: str, staging_requests: int | None = None,
                 progress_thread: bool = True):
        if llm.kv.cache_mode != "none":
            raise ConfigError(f"a prefill engine exports the state after a request's last token, which needs "
                              f"mamba_cache_mode='none' (got {llm.kv.cache_mode!r})")
        if "|" in engine_id or "/" in engine_id:
            raise ConfigError(f"engine_id={engine_id!r} must not contain '|' or '/' (they delimit handoff ids)")
        self.llm, self.engine_id = llm, engine_id
        self.tp = tp_size_of(llm)
        self.mamba_layers, self.kv_layers = layer_names(llm.cfg)
        n = staging_requests or llm.scheduler.max_num_seqs
        blocks_per_request = cdiv(llm.max_model_len, llm.block_size) if self.kv_layers else 0
        self.staging = StagingPool(llm.runner.caches, self.tp, n + 1, n * blocks_per_request + 1)
        self._staged: dict[str, _Staged] = {}
        self.exporters: list[PageExporter] = []
        try:
            for rank in range(self.tp):
                exporter = PageExporter(f"{engine_id}-p{rank}", engine_id=engine_id, tp_size=self.tp, rank=rank,
                                        progress_thread=progress_thread)
                self.exporters.append(exporter)
                self.staging.register(exporter, rank, self.mamba_layers, self.kv_layers)
        except BaseException:
            self.close()
            raise

    def directories(self) -> list[bytes]:
        """One ``PageDirectory`` per P rank (agent metadata and staging page layout), serialised."""
        return [exporter.directory().to_bytes() for exporter in self.exporters]

    @property
    def num_staged(self) -> int:
        """Handoffs whose staging pages are still waiting to be read."""
        return len(self._staged)

    def prefill(self, prompts: Sequence[Any], *, staging_wait_s: float = 30.0) -> list[Handoff]:
        """Compute every prompt's first ``N-1`` tokens and stage their pages; one ``Handoff`` per prompt, in order.

        A prompt the engine refuses (``RequestError``), or one that finds the staging pool full for
        ``staging_wait_s`` (decode engines not reading), gets a handoff with ``error`` set and no
        pages: the decode engine computes it itself.
        """
        llm, sched = self.llm, self.llm.scheduler
        handoffs: list[Handoff | None] = []
        computing: dict[str, tuple[int, list[int]]] = {}  # engine request id -> (index, full prompt)
        for prompt in prompts:
            ids = llm.prompt_token_ids(prompt)
            if len(ids) < 2:  # nothing before the last token: the decode engine starts from scratch
                handoffs.append(Handoff(self.engine_id, tuple(ids)))
                continue
            try:
                req = llm.add_request(ids[:-1], _PREFILL_PARAMS)
            except RequestError as err:
                handoffs.append(Handoff(self.engine_id, tuple(ids), error=f"prefill engine {self.engine_id!r}: {err}"))
                continue
            sched.hold_on_finish.add(req.request_id)
            computing[req.request_id] = (len(handoffs), ids)
            handoffs.append(None)
        idle_since: float | None = None
        while computing:
            progressed = sched.has_work
            if progressed:
                llm.step()
            self.poll()
            for rid in [r for r in computing if r in sched.held]:
                index, ids = computing[rid]
                handoff = self._stage(sched.held[rid], ids)
                if handoff is None:  # staging full: stays held in the engine until D reads something
                    break
                handoffs[index] = handoff
                del computing[rid]
                progressed = True
            if progressed or not computing:
                idle_since = None
                continue
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > staging_wait_s:
                for rid, (index, ids) in computing.items():
                    sched.release_held(rid)
                    handoffs[index] = Handoff(self.engine_id, tuple(ids), error=(
                        f"prefill engine {self.engine_id!r}: staging pool full for {staging_wait_s:g} s "
                        f"({self.num_staged} handoffs not read yet)"))
                break
            time.sleep(0.001)
        return handoffs

    def _stage(self, req: Request, prompt_ids: list[int]) -> Handoff | None:
        """Copy a held request's pages (every rank) to staging, release it; None if staging is full."""
        from jaxmamba.parallel import rank_pages

        rid, n = req.request_id, req.num_prompt_tokens
        num_blocks = cdiv(n, self.llm.block_size) if self.kv_layers else 0
        got = self.staging.allocate(num_blocks)
        if got is None:
            return None
        s_slot, s_blocks = got
        kv = self.llm.kv
        slot = kv.state_table(rid)[0] if self.mamba_layers else 0  # mode none: the state after token n
        blocks = kv.kv_block_ids(rid)[:num_blocks]
        for rank in range(self.tp):
            # Zero-copy views of the device buffers on CPU; dropped before the engine steps again.
            pages = rank_pages(self.llm.runner.caches, rank)
            for i in range(len(self.mamba_layers)):
                self.staging.conv[rank][i][s_slot] = pages.conv[i][slot]
                self.staging.ssm[rank][i][s_slot] = pages.ssm[i][slot]
            for j in range(len(self.kv_layers)):
                self.staging.kv[rank][j][:, s_blocks] = pages.kv[j][:, blocks]
            del pages
        self.llm.scheduler.release_held(rid)
        handoff_id = f"{self.engine_id}/{rid}"
        self._staged[handoff_id] = _Staged(s_slot, s_blocks, [set() for _ in range(self.tp)])
        request_pages = RequestPages(handoff_id, mamba={layer: (s_slot,) for layer in self.mamba_layers},
                                     kv={layer: tuple(s_blocks) for layer in self.kv_layers})
        return Handoff(self.engine_id, tuple(prompt_ids), n, request_pages)

    def poll(self) -> list[str]:
        """Take READ-completion notifications; free the staging of every handoff all its readers have read.

        A D rank's notification says how many D ranks read each P rank (``"<handoff id>|<readers>"``);
        a handoff is done when every P rank has heard from that many distinct D agents. Returns the
        freed handoff ids. Notifications for unknown (already released) handoffs are ignored.
        """
        for rank, exporter in enumerate(self.exporters):
            for agent, messages in exporter.poll_notifications().items():
                for message in messages:
                    handoff_id, _, readers = message.decode(errors="replace").rpartition("|")
                    staged = self._staged.get(handoff_id)
                    if staged is None or not readers.isdigit():
                        continue
                    staged.readers = int(readers)
                    staged.heard[rank].add(agent)
        done = [h for h, s in self._staged.items() if s.readers and all(len(a) >= s.readers for a in s.heard)]
        for handoff_id in done:
            self.release(handoff_id)
        return done

    def release(self, handoff_id: str) -> None:
        """Free a handoff's staging pages now (a decode engine gave up on it). Unknown ids are ignored."""
        staged = self._staged.pop(handoff_id, None)
        if staged is not None:
            self.staging.free(staged.slot, staged.blocks)

    def close(self) -> None:
        """Deregister the staging pages and destroy the agents (idempotent); pending handoffs become unreadable."""
        exporters, self.exporters = self.exporters, []
        for handoff_id in list(self._staged):
            self.release(handoff_id)
        _close_agents(exporters)


def _close_agents(agents) -> None:
    """Close every agent even if some fail; then raise one ``TransferError`` naming all failures."""
    problems = []
    for agent in agents:
        try:
            agent.close()
        except TransferError as err:
            problems.append(str(err))
    if problems:
        raise TransferError("; ".join(problems))


# ============================================================================ decode side
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


class DecodeEngine:
    """The D side: ``connect(directories)`` to P engines, then ``add_request(handoff, params)`` / ``step``
    (or ``generate(handoffs, params)``).

    ``llm`` may run at any TP size and must use ``mamba_cache_mode='none'`` (``admit_computed``).
    ``staging_requests`` (default ``max_num_seqs``) requests can sit READ but not yet admitted.
    ``timeout_s`` bounds each D rank's READ. The scatter that installs staged pages into the caches
    is compiled here, as part of the engine's warm-up (``llm.stats.backend_compiles_since_warmup``
    stays 0 while serving).
    """

    def __init__(self, llm: LLM, *, name: str = "decode", staging_requests: int | None = None,
                 timeout_s: float = 10.0):
        if llm.kv.cache_mode != "none":
            raise ConfigError(f"a decode engine imports computed tokens, which needs mamba_cache_mode='none' "
                              f"(got {llm.kv.cache_mode!r})")
        self.llm, self.name, self.timeout_s = llm, name, timeout_s
        self.tp = tp_size_of(llm)
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
        try:
            peer = self._peers.get(engine_id)
            if peer is not None:
                for importer in peer.importers:
                    importer.connect(dirs)
                return engine_id
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
                    importer = PageImporter(f"{self.name}-{engine_id}-d{plan.d_rank}", plan)
                    importers.append(importer)
                    self.staging.register(importer, plan.d_rank, self.mamba_layers, self.kv_layers)
                    importer.connect(dirs)
            except BaseException:
                for importer in importers:
                    importer.close()
                raise
        except (TransferError, ConfigError, SlotError) as err:
            self.peer_errors[engine_id] = str(err)
            raise TransferError(f"decode engine {self.name!r} cannot read from prefill engine {engine_id!r}: "
                                f"{err}") from err
        self._peers[engine_id] = _Peer(engine_id, p_tp, importers, readers[0])
        self.peer_errors.pop(engine_id, None)
        return engine_id

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
    def add_request(self, handoff: Handoff | bytes, params: SamplingParams) -> Request:
        """Queue a request that continues a P engine's prefill (or computes its prompt here when it cannot).

        Raises ``RequestError`` for a prompt this engine cannot serve at all (as ``LLM.add_request``).
        """
        h = handoff if isinstance(handoff, Handoff) else Handoff.from_bytes(handoff)
        req = self.llm.new_request(list(h.prompt_token_ids), params)
        problem = self._check_handoff(h)
        if problem is None:
            self._incoming.append(_Incoming(req, h))
        elif h.pages is None and h.error is None:
            self.transfers[req.request_id] = TransferRecord(None, "local")
            self.llm.scheduler.add(req)
        else:
            self._fall_back(req, h, problem)
        return req

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
        """READ a handoff's pages into D staging on every rank; False if staging is full (retry later)."""
        h = item.handoff
        assert h.pages is not None
        num_blocks = len(next(iter(h.pages.kv.values()))) if self.kv_layers else 0
        got = self.staging.allocate(num_blocks)
        if got is None:
            return False
        slot, blocks = got
        peer = self._peers.get(h.engine_id)
        if peer is None:  # disconnected since add_request
            self.staging.free(slot, blocks)
            item.failed = True
            self._fall_back(item.request, h, f"prefill engine {h.engine_id!r} was disconnected")
            return True
        record = TransferRecord(h.handoff_id, "imported")
        notif = f"{h.handoff_id}|{peer.readers}".encode()
        stuck_before = sum(importer.num_stuck_reads for importer in peer.importers)
        try:
            for importer in peer.importers:
                result = importer.read_request(h.pages, mamba_slots=[slot], kv_blocks=blocks,
                                               timeout_s=self.timeout_s, notif=notif)
                record.bytes_read += result.bytes_read
                record.read_seconds += result.seconds
                record.num_descriptors += result.num_descriptors
        except (TransferError, SlotError) as err:
            if sum(importer.num_stuck_reads for importer in peer.importers) > stuck_before:
                self.staging.quarantine(slot, blocks)
            else:
                self.staging.free(slot, blocks)
            item.failed = True
            self._fall_back(item.request, h, f"READ from prefill engine {h.engine_id!r} failed: {err}")
            return True
        item.staged, item.record = (slot, blocks), record
        return True

    def _install(self, item: _Incoming) -> None:
        """Copy a request's staged pages into the caches at the slot and blocks ``admit_computed`` gave it."""
        import jax

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
            args = jax.device_put(args, self._install_shardings)
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
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxmamba.cache import StateCaches

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
    def generate(self, handoffs: Sequence[Handoff | bytes], sampling_params: SamplingParams) -> list[RequestOutput]:
        """Serve every handoff to completion; outputs in order (a rejected prompt gets ``error`` set)."""
        slots: list[Request | RequestOutput] = []
        for handoff in handoffs:
            try:
                slots.append(self.add_request(handoff, sampling_params))
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


# ============================================================================ engines in processes
def _start_process(spec: dict) -> None:
    """Apply ``spec["env"]`` before JAX starts its backend (device count), and the compile cache."""
    os.environ.update(spec.get("env", {}))
    if spec.get("compile_cache"):
        import jax

        jax.config.update("jax_compilation_cache_dir", spec["compile_cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _serve_commands(conn, handlers: dict[str, Callable], idle: Callable[[], None], idle_s: float) -> None:
    """Answer ``(name, *args)`` commands until ``("exit",)`` or a closed pipe; ``idle()`` every ``idle_s``."""
    while True:
        try:
            if not conn.poll(idle_s):
                idle()
                continue
            name, *args = conn.recv()
        except (EOFError, OSError):
            return
        if name == "exit":
            return
        try:
            reply = handlers[name](*args)
        except Exception as err:  # the driver re-raises it with its class name
            reply = ("error", type(err).__name__, str(err))
        conn.send(reply)


def _invariant_violation(llm: LLM) -> str:
    """``""`` when ``llm.check_invariants()`` passes, else its ``SlotError`` message (sent over the pipe)."""
    try:
        llm.check_invariants()
    except SlotError as err:
        return str(err)
    return ""


def prefill_process_main(conn, spec: dict) -> None:
    """Prefill engines in this (spawned) process, one per ``spec["engines"][key]``.

    ``spec``: ``env`` (applied first: ``XLA_FLAGS`` for the device count), ``compile_cache``,
    ``engines`` ``{key: {"model": path, "engine_id", "engine_args": LLM kwargs, "staging_requests"}}``.
    Sends ``("ready", {key: [directory bytes per rank]})``, then answers:
    ``("prefill", key, prompts)`` -> ``[handoff bytes]``; ``("poll",)`` -> ``{key: handoffs still
    staged}``; ``("release", key, handoff ids)`` -> the same, after freeing those; ``("state",)`` ->
    ``{key: engine slots and blocks in use, requests held, handoffs staged, invariants ("" or the
    error)}``; ``("unmap", key)`` -> ``"unmapped"`` (deregister and unmap the staging pages: later
    READs fail; for fault tests); ``("close",)`` -> ``("closed", live registrations)``;
    returns on ``("exit",)``. Unless ``spec["progress_thread"]``, the agents run without NIXL's
    progress thread (it spins a core, too much on a small machine): notifications and READs then
    progress from this loop, every millisecond while idle.
    """
    _start_process(spec)
    from transfer.nixl_bridge import live_registrations

    engines: dict[str, PrefillEngine] = {}
    try:
        for key, e in spec["engines"].items():
            llm = LLM(e["model"], **e.get("engine_args", {}))
            engines[key] = PrefillEngine(llm, engine_id=e["engine_id"], staging_requests=e.get("staging_requests"),
                                         progress_thread=spec.get("progress_thread", False))
        conn.send(("ready", {key: eng.directories() for key, eng in engines.items()}))

        def staged() -> dict[str, int]:
            for eng in engines.values():
                eng.poll()
            return {key: eng.num_staged for key, eng in engines.items()}

        def state() -> dict[str, dict]:
            out = {}
            for key, eng in engines.items():
                stats = eng.llm.stats
                out[key] = {"slots_in_use": stats.slots_in_use, "blocks_in_use": stats.blocks_in_use,
                            "held": len(eng.llm.scheduler.held), "staged": eng.num_staged,
                            "invariants": _invariant_violation(eng.llm)}
            return out

        def release(key: str, handoff_ids: list[str]) -> dict[str, int]:
            for handoff_id in handoff_ids:
                engines[key].release(handoff_id)
            return staged()

        def unmap(key: str) -> str:
            engines[key].close()
            engines[key].staging.unmap()
            del engines[key]
            return "unmapped"

        def close() -> tuple[str, int]:
            for key in list(engines):
                engines.pop(key).close()
            return ("closed", live_registrations())

        _serve_commands(conn, {
            "prefill": lambda key, prompts: [h.to_bytes() for h in engines[key].prefill(prompts)],
            "poll": staged, "state": state, "release": release, "unmap": unmap, "close": close,
        }, idle=lambda: [eng.poll() for eng in engines.values()], idle_s=0.001)
    finally:
        for eng in engines.values():
            with contextlib.suppress(TransferError):
                eng.close()


def decode_process_main(conn, spec: dict) -> None:
    """Decode engines in this (spawned) process, one per ``spec["engines"][key]``.

    ``spec`` as ``prefill_process_main``, engines ``{key: {"model", "name", "engine_args",
    "staging_requests", "timeout_s"}}``. Sends ``("ready", None)``, then answers:
    ``("connect", key, directories)`` -> None, or the error text (recorded: that engine's handoffs
    fall back); ``("generate", key, handoffs, sampling params dict[, timeout_s])`` -> a dict with
    ``outputs`` (token ids per request), ``logprobs``, ``errors``, ``transfers`` (``TransferRecord``
    dicts), ``abandoned`` (handoff ids to release on P), ``invariants`` ("" or the ``SlotError``),
    slots, blocks and staging pages still in use, and ``compiles_while_serving`` (XLA compilations
    during the call); ``("disconnect", key, engine id)`` and ``("registrations",)`` -> live
    registrations.
    """
    _start_process(spec)
    from transfer.nixl_bridge import live_registrations

    engines: dict[str, DecodeEngine] = {}
    try:
        for key, e in spec["engines"].items():
            llm = LLM(e["model"], **e.get("engine_args", {}))
            engines[key] = DecodeEngine(llm, name=e.get("name", f"decode-{key}"),
                                        staging_requests=e.get("staging_requests"), timeout_s=e.get("timeout_s", 10.0))
        conn.send(("ready", None))

        def connect(key: str, directories: list[bytes]) -> str | None:
            try:
                engines[key].connect(directories)
            except TransferError as err:
                return str(err)
            return None

        def generate(key: str, handoffs: list[bytes], params: dict, timeout_s: float | None = None) -> dict:
            eng = engines[key]
            if timeout_s is not None:
                eng.timeout_s = timeout_s
            first, compiles_before = len(eng.abandoned), eng.llm.stats.backend_compiles_since_warmup
            outs = eng.generate([Handoff.from_bytes(h) for h in handoffs], SamplingParams(**params))
            invariants = _invariant_violation(eng.llm)
            stats = eng.llm.stats
            return {
                "outputs": [o.outputs[0].token_ids for o in outs],
                "logprobs": [[{int(t): float(p) for t, p in step.items()} for step in o.outputs[0].logprobs or []]
                             for o in outs],
                "errors": [o.error for o in outs],
                "transfers": [asdict(eng.transfers[o.request_id]) if o.request_id in eng.transfers else None
                              for o in outs],
                "abandoned": eng.abandoned[first:],
                "invariants": invariants,
                "slots_in_use": stats.slots_in_use, "blocks_in_use": stats.blocks_in_use,
                "staging_in_use": eng.staging.num_used_slots, "staging_quarantined": eng.staging.num_quarantined,
                # The counter is process-wide: count what this call compiled (other engines warm up too).
                "compiles_while_serving": stats.backend_compiles_since_warmup - compiles_before,
            }

        def disconnect(key: str, engine_id: str) -> int:
            engines[key].disconnect(engine_id)
            return live_registrations()

        _serve_commands(conn, {"connect": connect, "generate": generate, "disconnect": disconnect,
                               "registrations": live_registrations}, idle=lambda: None, idle_s=1.0)
    finally:
        for eng in engines.values():
            with contextlib.suppress(TransferError):
                eng.close()


class EngineProcess:
    """One engine process (``prefill_process_main`` or ``decode_process_main``), spawned, driven over a pipe.

    ``ready`` is its first message's payload; ``call(name, *args)`` sends one command and returns the
    answer, re-raising a failure inside the process as the ``jaxmamba.errors`` class it had (else
    ``RuntimeError``). A process that dies or stays silent past the timeout raises ``TransferError``.
    """

    def __init__(self, target: Callable, spec: dict, *, start_timeout_s: float = 600.0):
        ctx = mp.get_context("spawn")  # never fork a process that holds JAX or NIXL/UCX threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        self.name = target.__name__
        try:
            tag, self.ready = self._receive(start_timeout_s)
            if tag != "ready":
                raise TransferError(f"{self.name} answered {tag!r} instead of 'ready'")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _receive(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TransferError(f"{self.name} (pid {self.proc.pid}) did not answer within {timeout_s:g} s")
        try:
            reply = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise TransferError(f"{self.name} (pid {self.proc.pid}) exited (code {self.proc.exitcode})") from None
        if isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "error":
            cls = getattr(errors, reply[1], None)
            raise (cls if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError)(
                f"in {self.name}: {reply[2]}")
        return reply

    def call(self, *command, timeout_s: float = 600.0):
        self.conn.send(command)
        return self._receive(timeout_s)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self.conn.send(("exit",))
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


__all__ = [
    "DecodeEngine",
    "EngineProcess",
    "Handoff",
    "PrefillEngine",
    "StagingPool",
    "TransferRecord",
    "decode_process_main",
    "layer_names",
    "prefill_process_main",
    "tp_size_of",
]
