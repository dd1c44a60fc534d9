"""``PageImporter``, the D side of the NIXL bridge: checks P ranks' directories against its ``TransferPlan``
and posts the planned READs; ``ReadFailed`` names every page a failed READ could have written. The agents and
the pages they exchange are ``transfer.nixl_agent``'s.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from jaxmamba.errors import SlotError, TransferError
from jaxmamba.layout import NULL_SLOT, PAD_SLOT_ID
from transfer.hetero_tp import ByteRange, TransferPlan, coalesce
from transfer.nixl_agent import KVRegion, MambaRegion, PageDirectory, RequestPages, _PageAgent


@dataclass(frozen=True)
class ReadResult:
    """A completed read: bytes moved, READ descriptors posted, wall seconds, per P rank bytes."""

    bytes_read: int
    num_descriptors: int
    seconds: float
    bytes_per_rank: dict[int, int] = field(default_factory=dict)

    @property
    def gib_per_s(self) -> float:
        return self.bytes_read / max(self.seconds, 1e-9) / 2**30


class ReadFailed(TransferError):
    """READs were posted (or may have been) and did not all complete.

    ``invalid_slots`` / ``invalid_blocks``: ``{layer: [local page ids]}`` that may hold partial
    data and must be freed/recomputed, never used. ``may_have_written`` is False only when no
    READ was posted. ``failed_ranks``: P ranks whose agents were dropped.
    """

    def __init__(
        self,
        message: str,
        *,
        invalid_slots: dict[str, list[int]],
        invalid_blocks: dict[str, list[int]],
        may_have_written: bool,
        failed_ranks: tuple[int, ...],
    ) -> None:
        super().__init__(message)
        self.invalid_slots = invalid_slots
        self.invalid_blocks = invalid_blocks
        self.may_have_written = may_have_written
        self.failed_ranks = failed_ranks


Pairs = Sequence[tuple[int, int]]


def _destinations(pairs_by_layer: Mapping[str, np.ndarray]) -> dict[str, list[int]]:
    """``{layer: sorted local page ids}`` of ``{layer: (n, 2) [remote, local] pairs}``."""
    return {layer: sorted(int(i) for i in pairs[:, 1]) for layer, pairs in pairs_by_layer.items()}


@dataclass(frozen=True)
class _Peer:
    """A connected P rank: its agent name, directory, and regions by layer."""

    name: str
    directory: PageDirectory
    mamba: dict[str, MambaRegion]
    kv: dict[str, KVRegion]


class PageImporter(_PageAgent):
    """D side: one decode rank reading from one P engine according to ``plan``."""

    progress_thread = False

    def __init__(self, name: str, plan: TransferPlan, *, backends: Sequence[str] = ("UCX",),
                 ucx_devices: str | None = None) -> None:
        super().__init__(name, backends=backends, ucx_devices=ucx_devices)
        self.plan = plan
        self._remote: dict[int, _Peer] = {}
        self._engine_id: str | None = None

    def _on_register_mamba(self, region: MambaRegion) -> None:
        self.plan.check_local_mamba(region.layer, conv_bytes=region.conv_bytes, ssm_bytes=region.ssm_bytes)

    def _on_register_kv(self, region: KVRegion) -> None:
        self.plan.check_local_kv(region.layer, block_bytes=region.block_bytes, kv_layout=region.kv_layout)

    # connection ------------------------------------------------------------------------------
    def connect(self, directories: Iterable[PageDirectory | bytes]) -> None:
        """Check P ranks' directories against the plan and load their agents' metadata.

        Every directory is checked before any is loaded, so a mismatch leaves the importer as
        it was. Directories of P ranks this D rank does not read from are ignored.
        """
        self._check_open()
        dirs = [d if isinstance(d, PageDirectory) else PageDirectory.from_bytes(d) for d in directories]
        plan = self.plan
        needed = set(plan.read_targets)
        engines = {d.engine_id for d in dirs} | ({self._engine_id} if self._engine_id else set())
        if len(engines) > 1:
            raise TransferError(f"directories from several P engines {sorted(engines)}; one importer reads one engine")
        for d in dirs:
            if d.tp_size != plan.p_tp:
                raise TransferError(
                    f"P rank {d.rank} of engine {d.engine_id!r} reports TP={d.tp_size}, the plan has P_TP={plan.p_tp}"
                )
            if not 0 <= d.rank < d.tp_size:
                raise TransferError(f"directory rank {d.rank} is outside [0, {d.tp_size})")
            if d.rank not in needed:
                continue
            self._check_directory(d)
        for d in dirs:
            if d.rank not in needed:
                continue
            if d.rank in self._remote:  # reconnect (e.g. after a failure): unload the old metadata
                self._drop_rank(d.rank)
            try:
                remote_name = self._agent.add_remote_agent(d.agent_metadata)
            except Exception as err:
                raise TransferError(
                    f"loading NIXL metadata of P rank {d.rank} ({d.agent_name!r}) failed: {err}"
                ) from err
            remote_name = remote_name.decode() if isinstance(remote_name, bytes) else str(remote_name)
            if remote_name != d.agent_name:
                self._agent.remove_remote_agent(remote_name)
                raise TransferError(
                    f"P rank {d.rank}: directory names agent {d.agent_name!r} but its metadata is {remote_name!r}"
                )
            self._remote[d.rank] = _Peer(remote_name, d, {r.layer: r for r in d.mamba}, {r.layer: r for r in d.kv})
            self._engine_id = d.engine_id

    def _check_directory(self, d: PageDirectory) -> None:
        plan = self.plan
        remote_mamba = {r.layer: r for r in d.mamba}
        remote_kv = {r.layer: r for r in d.kv}
        for layer in self._mamba:
            if layer not in remote_mamba:
                raise TransferError(f"P rank {d.rank} has no mamba layer {layer!r} (it has {sorted(remote_mamba)})")
            r = remote_mamba[layer]
            plan.check_remote_mamba(d.rank, layer, conv_bytes=r.conv_bytes, ssm_bytes=r.ssm_bytes)
            if r.conv_stride < r.conv_bytes or r.ssm_stride < r.ssm_bytes:
                raise TransferError(f"P rank {d.rank} mamba layer {layer!r}: strides smaller than the states")
        for layer in self._kv:
            if layer not in remote_kv:
                raise TransferError(f"P rank {d.rank} has no attention layer {layer!r} (it has {sorted(remote_kv)})")
            r = remote_kv[layer]
            plan.check_remote_kv(d.rank, layer, block_bytes=r.block_bytes, kv_layout=r.kv_layout)

    def _drop_rank(self, rank: int) -> None:
        peer = self._remote.pop(rank)
        with contextlib.suppress(Exception):  # already gone on NIXL's side; nothing else holds it
            self._agent.remove_remote_agent(peer.name)

    @property
    def connected_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._remote))

    # reading -----------------------------------------------------------------------------------
    def _pairs_by_layer(
        self, spec: Pairs | Mapping[Any, Pairs], layers: Mapping[str, Any], what: str
    ) -> dict[str, np.ndarray]:
        if isinstance(spec, Mapping):
            out = {}
            for layer, pairs in spec.items():
                if str(layer) not in layers:
                    raise TransferError(f"no local {what} layer {str(layer)!r} is registered")
                arr = np.asarray(list(pairs), dtype=np.int64).reshape(-1, 2)
                if len(arr):
                    out[str(layer)] = arr
            return out
        arr = np.asarray(list(spec), dtype=np.int64).reshape(-1, 2)
        return {layer: arr for layer in layers} if len(arr) else {}

    @staticmethod
    def _check_ids(ids: np.ndarray, limit: int, who: str, *, null_forbidden: bool, unique: bool) -> None:
        bad = (ids < 0) | (ids >= limit)
        if bad.any():
            v = int(ids[bad][0])
            what = "PAD_SLOT_ID" if v == PAD_SLOT_ID else "out of range"
            raise SlotError(f"{who} id {v} is {what} (valid 0..{limit - 1})")
        if null_forbidden and (ids == NULL_SLOT).any():
            raise SlotError(f"{who} id {NULL_SLOT} is the null slot/block and never holds a request's state")
        if unique and len(np.unique(ids)) != len(ids):
            raise SlotError(f"{who} ids {ids.tolist()} alias: a destination page appears twice")

    def read(
        self,
        *,
        mamba: Pairs | Mapping[Any, Pairs] = (),
        kv: Pairs | Mapping[Any, Pairs] = (),
        timeout_s: float = 10.0,
        notif: bytes = b"",
    ) -> ReadResult:
        """READ the plan's byte ranges for ``(remote page, local page)`` pairs; block until done.

        ``mamba``/``kv``: pairs applied to every registered layer of that kind, or a
        ``{layer: pairs}`` mapping. ``notif`` (optional) is delivered to each P rank's agent
        when its READ completes; a READ with a notification completes only once the P agent
        has taken it, so a hung P engine shows up as a timeout instead of a silent success.

        Raises ``TransferError``/``SlotError`` before posting anything if a check fails
        (destination untouched), ``ReadFailed`` if a posted READ fails or the deadline passes.
        """
        self._check_open()
        plan = self.plan
        t0 = time.perf_counter()
        m_pairs = self._pairs_by_layer(mamba, self._mamba, "mamba")
        k_pairs = self._pairs_by_layer(kv, self._kv, "attention")
        if not m_pairs and not k_pairs:
            raise TransferError("read() got no pages to transfer")
        if k_pairs and not self.plan.shape.has_attention:
            raise TransferError("the plan's model has no attention layers")

        # All checks first: nothing below may fail once the first READ is posted, except NIXL.
        self._check_read(m_pairs, k_pairs)
        per_rank = self._descriptors(m_pairs, k_pairs)
        local_mem, remote_mem_type = self._memory_types()

        handles: dict[int, Any] = {}
        failed: list[int] = []
        try:
            problem, posted = self._post(per_rank, handles, failed, (local_mem, remote_mem_type), notif)
            if not problem:
                problem = self._wait(handles, t0 + timeout_s, failed, timeout_s)
        except Exception as err:  # anything unforeseen gets the same cleanup as a NIXL failure
            problem, posted = f"unexpected {type(err).__name__}: {err}", bool(handles)
        # Release every handle (NIXL cancels in-flight requests); one it cannot cancel is kept
        # so that close() leaves its destination registered.
        self._stuck += [h for h in handles.values() if not self._release(h)]
        if problem:
            for rank in failed:
                if rank in self._remote:
                    self._drop_rank(rank)
            raise ReadFailed(
                f"D rank {plan.d_rank}: {problem}; "
                + ("destination pages are invalid and must be recomputed" if posted else "nothing was posted"),
                invalid_slots=_destinations(m_pairs) if posted else {},
                invalid_blocks=_destinations(k_pairs) if posted else {},
                may_have_written=posted,
                failed_ranks=tuple(failed),
            )
        per_rank_bytes = {rank: int(sum(int(d[:, 1].sum()) for d in lists[0])) for rank, lists in per_rank.items()}
        n_desc = sum(len(d) for lists in per_rank.values() for d in lists[0])
        return ReadResult(sum(per_rank_bytes.values()), n_desc, time.perf_counter() - t0, per_rank_bytes)

    def _check_read(self, m_pairs: dict[str, np.ndarray], k_pairs: dict[str, np.ndarray]) -> None:
        """Every P rank the read needs is connected and every page id, local and remote, is valid."""
        plan = self.plan
        ranks_needed = set(plan.mamba_read_targets) if m_pairs else set()
        if k_pairs:
            ranks_needed |= set(plan.fa_read_targets)
        missing = sorted(ranks_needed - set(self._remote))
        if missing:
            raise TransferError(
                f"D rank {plan.d_rank}: not connected to P rank(s) {missing} (dead, or never connected)"
            )
        # Mamba slots and KV blocks are checked alike: local ids unique and real, each target P rank's ids real.
        for pairs_by_layer, local, targets, remote_of, size, unit in (
                (m_pairs, self._mamba, plan.mamba_read_targets, lambda r: r.mamba, "num_pages", ("mamba", "slot")),
                (k_pairs, self._kv, plan.fa_read_targets, lambda r: r.kv, "num_blocks", ("attention", "block"))):
            for layer, pairs in pairs_by_layer.items():
                what = f"{unit[0]} layer {layer!r} {unit[1]}"
                self._check_ids(pairs[:, 1], getattr(local[layer], size), f"local {what}", null_forbidden=True,
                                unique=True)
                for rank in targets:
                    self._check_ids(pairs[:, 0], getattr(remote_of(self._remote[rank])[layer], size),
                                    f"P rank {rank} {what}", null_forbidden=True, unique=False)

    def _descriptors(self, m_pairs: dict[str, np.ndarray], k_pairs: dict[str, np.ndarray]):
        """``{P rank: (local descriptor lists, remote descriptor lists)}``: one READ per P rank (a NIXL request
        targets one remote agent)."""
        plan = self.plan
        per_rank: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for layer, pairs in m_pairs.items():
            loc = self._mamba[layer]
            for rank in plan.mamba_read_targets:
                rem = self._remote[rank].mamba[layer]
                for ranges, local, remote in self._mamba_sections(plan.ranges("mamba", src_rank=rank), loc, rem):
                    self._add_descs(per_rank.setdefault(rank, ([], [])), ranges, pairs, local, remote)
        for layer, pairs in k_pairs.items():
            loc = self._kv[layer]
            for rank in plan.fa_read_targets:
                rem = self._remote[rank].kv[layer]
                for region, l_off, r_off in (("k", 0, 0), ("v", loc.v_offset, rem.v_offset)):
                    ranges = plan.ranges(region, src_rank=rank, coalesced=True)
                    self._add_descs(
                        per_rank.setdefault(rank, ([], [])),
                        ranges,
                        pairs,
                        (loc.addr + l_off, loc.block_stride, loc.device_id),
                        (rem.addr + r_off, rem.block_stride, rem.device_id),
                    )
        return per_rank

    def _memory_types(self) -> tuple[str, str]:
        """``(local, remote)`` NIXL memory type: one of each per read."""
        mem_types = {r.mem_type for r in self._mamba.values()} | {r.mem_type for r in self._kv.values()}
        remote_mem = {r.mem_type for p in self._remote.values() for r in p.directory.mamba + p.directory.kv}
        if len(mem_types) != 1 or len(remote_mem) != 1:
            raise TransferError(
                f"mixed memory types in one read (local {sorted(mem_types)}, remote {sorted(remote_mem)})"
            )
        return mem_types.pop(), remote_mem.pop()

    def _post(self, per_rank, handles: dict[int, Any], failed: list[int], mem: tuple[str, str], notif: bytes):
        """Create and post one READ per P rank; return (problem or "", whether any was posted)."""
        posted = False
        for rank, (local_lists, remote_lists) in sorted(per_rank.items()):
            name = self._remote[rank].name
            local, remote = np.concatenate(local_lists), np.concatenate(remote_lists)
            try:
                handles[rank] = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local, mem[0]),
                    self._agent.get_xfer_descs(remote, mem[1]),
                    name,
                    notif,
                )
            except Exception as err:
                failed.append(rank)
                return f"preparing the READ from P rank {rank} ({name!r}) failed: {type(err).__name__}: {err}", posted
            posted = True
            try:
                state = self._agent.transfer(handles[rank])
            except Exception as err:
                state = f"ERR ({type(err).__name__}: {err})"
            if state.startswith("ERR"):
                failed.append(rank)
                return f"posting the READ from P rank {rank} ({name!r}) failed: {state}", posted
        return "", posted

    def read_request(
        self,
        request: RequestPages,
        *,
        mamba_slots: Mapping[Any, Sequence[int]] | Sequence[int] = (),
        kv_blocks: Mapping[Any, Sequence[int]] | Sequence[int] = (),
        timeout_s: float = 10.0,
        notif: bytes | None = None,
    ) -> ReadResult:
        """READ one request's pages into the local pages the D engine allocated for it.

        ``mamba_slots`` / ``kv_blocks``: local ids per layer, or one list for every layer of
        that kind (as the D block table gives them), paired in order with the request's remote
        ids. ``notif`` is the completion notification sent to each P rank (default: the request id).
        """

        def pairs(remote: Mapping[str, tuple[int, ...]], local, what: str) -> dict[str, list[tuple[int, int]]]:
            by_layer = {str(k): v for k, v in local.items()} if isinstance(local, Mapping) else None
            out = {}
            for layer, ids in remote.items():
                mine = list(by_layer.get(layer, ()) if by_layer is not None else local)
                if len(mine) != len(ids):
                    raise TransferError(
                        f"request {request.request_id!r} {what} layer {layer!r}: {len(ids)} remote pages "
                        f"but {len(mine)} local pages"
                    )
                out[layer] = list(zip(ids, mine, strict=True))
            return out

        return self.read(
            mamba=pairs(request.mamba, mamba_slots, "mamba"),
            kv=pairs(request.kv, kv_blocks, "attention"),
            timeout_s=timeout_s,
            notif=request.request_id.encode() if notif is None else notif,
        )

    def _mamba_sections(self, ranges: Sequence[ByteRange], loc: MambaRegion, rem: MambaRegion):
        """Split page-relative Mamba ranges into what each memory form can address.

        Both sides unified: the ranges as they are, coalesced (equal TP: one READ per page).
        Otherwise conv ranges address the conv state and SSM ranges the SSM state (offsets
        rebased to it), each coalesced on its own so no READ spans the two.
        """
        dev = loc.device_id, rem.device_id
        if loc.unified and rem.unified:
            return [
                (coalesce(ranges), (loc.conv_addr, loc.conv_stride, dev[0]), (rem.conv_addr, rem.conv_stride, dev[1]))
            ]
        conv = coalesce([r for r in ranges if r.part != "ssm"])
        ssm = coalesce(
            [
                replace(r, src_offset=r.src_offset - rem.conv_bytes, dst_offset=r.dst_offset - loc.conv_bytes)
                for r in ranges
                if r.part == "ssm"
            ]
        )
        return [
            (conv, (loc.conv_addr, loc.conv_stride, dev[0]), (rem.conv_addr, rem.conv_stride, dev[1])),
            (ssm, (loc.ssm_addr, loc.ssm_stride, dev[0]), (rem.ssm_addr, rem.ssm_stride, dev[1])),
        ]

    @staticmethod
    def _add_descs(
        acc, ranges: Sequence[ByteRange], pairs: np.ndarray, local: tuple[int, int, int], remote: tuple[int, int, int]
    ) -> None:
        """Append ``(addr, len, dev)`` rows for every (range, pair): one NIXL descriptor each."""
        if not ranges:
            return
        src_off = np.array([r.src_offset for r in ranges], dtype=np.uint64)
        dst_off = np.array([r.dst_offset for r in ranges], dtype=np.uint64)
        length = np.array([r.length for r in ranges], dtype=np.uint64)
        src_page = pairs[:, 0].astype(np.uint64)[:, None]
        dst_page = pairs[:, 1].astype(np.uint64)[:, None]
        n = len(pairs) * len(ranges)
        l_addr = (np.uint64(local[0]) + dst_page * np.uint64(local[1]) + dst_off[None, :]).reshape(-1)
        r_addr = (np.uint64(remote[0]) + src_page * np.uint64(remote[1]) + src_off[None, :]).reshape(-1)
        lens = np.broadcast_to(length[None, :], (len(pairs), len(ranges))).reshape(-1)
        acc[0].append(np.stack([l_addr, lens, np.full(n, local[2], np.uint64)], axis=1))
        acc[1].append(np.stack([r_addr, lens, np.full(n, remote[2], np.uint64)], axis=1))

    def _wait(self, handles: dict[int, Any], deadline: float, failed: list[int], timeout_s: float) -> str:
        """Poll until every handle is DONE; return "" or what went wrong (and fill ``failed``)."""
        pending = dict(handles)
        nap = 1e-5
        while pending:
            for rank, handle in list(pending.items()):
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception as err:
                    state = f"ERR ({type(err).__name__}: {err})"
                if state == "DONE":
                    del pending[rank]
                elif state.startswith("ERR"):
                    failed.append(rank)
                    return f"the READ from P rank {rank} ({self._remote[rank].name!r}) failed: {state}"
            if not pending:
                return ""
            if time.perf_counter() > deadline:
                failed.extend(sorted(pending))
                return (
                    f"the READ from P rank(s) {sorted(pending)} did not complete within {timeout_s:g} s "
                    "(peer hung or unreachable)"
                )
            # Back off to a 1 ms poll: small reads finish in microseconds, a hung peer should
            # not burn a core that the engines share.
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)
        return ""

    def _before_close(self) -> None:
        for rank in list(self._remote):
            self._drop_rank(rank)
