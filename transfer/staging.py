"""What crosses between a prefill engine and a decode engine of any framework: the ``Handoff`` (JSON) and
the host ``StagingPool`` both sides register with NIXL.

numpy only (no JAX): the vLLM side (``transfer.vllm_pages``), which runs in vLLM's own venv, stages and
hands off through these as jaxmamba's ``PrefillEngine`` does (docs/architecture.md, "P/D across
frameworks").
"""

from __future__ import annotations

import json
import mmap
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from jaxmamba.errors import SlotError, TransferError
from transfer.nixl_agent import PageExporter, RequestPages


def close_agents(agents) -> None:
    """Close every agent even if some fail; then raise one ``TransferError`` naming all failures."""
    problems = []
    for agent in agents:
        try:
            agent.close()
        except TransferError as err:
            problems.append(str(err))
    if problems:
        raise TransferError("; ".join(problems))


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
        if num_slots < 2 or (caches.kv and num_blocks < 2):  # a model without attention stages no blocks
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


# ============================================================================ the P side's exports
@dataclass
class _Staged:
    """A handoff's P staging pages and which D agents have notified each P rank that they read them."""

    slot: int
    blocks: list[int]
    heard: list[set[str]] = field(default_factory=list)  # per exporter (P rank registered here)
    readers: int = 0  # D ranks reading each P rank (from the notifications), 0 = none heard yet


class StagingExporter:
    """A prefill side's ``StagingPool``, one ``PageExporter`` per TP rank registering it, and the handoffs
    staged in it until every decode rank that reads them has said so (jaxmamba's ``PrefillEngine`` and
    ``transfer.vllm_pages.VllmPrefill`` both are one).

    A subclass calls ``_export`` once its pool exists; ``_track`` records each staged handoff.
    """

    staging: StagingPool
    exporters: list[PageExporter]

    def _export(self, engine_id: str, staging: StagingPool, mamba_layers: Sequence[str], kv_layers: Sequence[str],
                *, progress_thread: bool = True, ucx_devices: str | None = None,
                ranks: Sequence[int] | None = None) -> None:
        """Register ``staging``'s pages of every rank (or of ``ranks``: those this process holds, when the
        engine spans several) with a fresh ``PageExporter`` (closing all on failure); ``ucx_devices`` as
        ``PageExporter``'s (the network devices D's READs reach these pages over)."""
        self.staging, self.exporters = staging, []
        self._staged: dict[str, _Staged] = {}
        try:
            for rank in range(staging.tp) if ranks is None else ranks:
                exporter = PageExporter(f"{engine_id}-p{rank}", engine_id=engine_id, tp_size=staging.tp, rank=rank,
                                        progress_thread=progress_thread, ucx_devices=ucx_devices)
                self.exporters.append(exporter)
                staging.register(exporter, rank, mamba_layers, kv_layers)
        except BaseException:
            self.close()
            raise

    def _track(self, handoff_id: str, slot: int, blocks: list[int]) -> None:
        self._staged[handoff_id] = _Staged(slot, blocks, [set() for _ in self.exporters])

    def directories(self) -> list[bytes]:
        """One ``PageDirectory`` per P rank (agent metadata and staging page layout), serialised."""
        return [exporter.directory().to_bytes() for exporter in self.exporters]

    @property
    def num_staged(self) -> int:
        """Handoffs whose staging pages are still waiting to be read."""
        return len(self._staged)

    def is_staged(self, handoff_id: str) -> bool:
        """Whether the handoff's staging pages are still waiting to be read (nor released)."""
        return handoff_id in self._staged

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
        for handoff_id in list(getattr(self, "_staged", {})):
            self.release(handoff_id)
        close_agents(exporters)
