"""NIXL agents and what they exchange: loading NIXL, the registered ``Buffer``, each layer's page regions,
the ``PageDirectory`` a P rank publishes and the ``RequestPages`` of one request, and ``PageExporter`` (the P
side, which registers its pages). The D side is ``transfer.nixl_import``; ``transfer.nixl_bridge`` names both.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import json
import os
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from jaxmamba.errors import TransferError

_NIXL_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")
_nixl_cache: tuple[Any, Any] | None = None


def load_nixl() -> tuple[Any, Any] | None:
    """``(nixl_agent, nixl_agent_config)`` or None.

    Tries the concrete wheels before the ``nixl`` meta package: the meta package picks a CUDA
    variant by importing torch (+2 s, and a CUDA probe), which a CPU test run does not need.
    """
    global _nixl_cache
    if _nixl_cache is None:
        for name in _NIXL_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            _nixl_cache = (mod.nixl_agent, mod.nixl_agent_config)
            break
    return _nixl_cache


def nixl_available() -> bool:
    return load_nixl() is not None


def _require_nixl() -> tuple[Any, Any]:
    api = load_nixl()
    if api is None:
        raise TransferError(f"NIXL is not installed (tried {', '.join(_NIXL_MODULES)}); install the 'nixl' extra")
    return api


# ---- buffers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Buffer:
    """A registrable memory region: ``nbytes`` at ``addr`` of ``mem_type`` ("DRAM"/"VRAM") on ``device_id``."""

    addr: int
    nbytes: int
    mem_type: str = "DRAM"
    device_id: int = 0


def buffer_of(obj: Any) -> Buffer:
    """Where a numpy / JAX / torch-like buffer lives. Must be C-contiguous (pages are strided views)."""
    if isinstance(obj, Buffer):
        return obj
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise TransferError("a registered numpy buffer must be C-contiguous")
        return Buffer(int(obj.ctypes.data), int(obj.nbytes))
    if hasattr(obj, "unsafe_buffer_pointer"):  # a single-device JAX array
        devices = list(obj.devices())
        if len(devices) != 1:
            raise TransferError(f"a registered JAX array must live on one device, not {len(devices)}")
        dev = devices[0]
        # The one line that differs between host and GPU memory: NIXL/UCX registers VRAM
        # (CUDA pointers) as VRAM_SEG on the device's ordinal.
        mem_type = "VRAM" if dev.platform == "gpu" else "DRAM"
        device_id = int(getattr(dev, "local_hardware_id", None) or 0) if mem_type == "VRAM" else 0
        return Buffer(int(obj.unsafe_buffer_pointer()), int(obj.nbytes), mem_type, device_id)
    if hasattr(obj, "data_ptr"):  # torch tensors, without importing torch
        if not obj.is_contiguous():
            raise TransferError("a registered tensor must be contiguous")
        is_cuda = bool(getattr(obj, "is_cuda", False))
        return Buffer(
            int(obj.data_ptr()),
            int(obj.numel() * obj.element_size()),
            "VRAM" if is_cuda else "DRAM",
            int(obj.device.index or 0) if is_cuda else 0,
        )
    raise TransferError(f"cannot register a {type(obj).__name__}: need a numpy array, a JAX array or a tensor")


# ---- directory ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MambaRegion:
    """``num_pages`` Mamba slots of one layer: slot ``s``'s conv state (``conv_bytes``) at
    ``conv_addr + s * conv_stride``, its SSM state (``ssm_bytes``) at ``ssm_addr + s * ssm_stride``.

    vLLM's unified page (conv then SSM in one page of stride ``page_stride``) has
    ``ssm_addr = conv_addr + conv_bytes`` and both strides ``page_stride``; jaxmamba's cache keeps
    two arrays ``conv (num_slots, conv_dim, R)`` and ``ssm (num_slots, H, P, N)``, strides
    ``conv_bytes`` and ``ssm_bytes``. Either side may use either form.
    """

    layer: str
    num_pages: int
    conv_bytes: int
    ssm_bytes: int
    conv_addr: int
    conv_stride: int
    ssm_addr: int
    ssm_stride: int
    mem_type: str = "DRAM"
    device_id: int = 0

    @property
    def unified(self) -> bool:
        """Conv and SSM state of a slot are one contiguous page (so one READ can span both)."""
        return self.ssm_addr == self.conv_addr + self.conv_bytes and self.ssm_stride == self.conv_stride


@dataclass(frozen=True)
class KVRegion:
    """One attention layer's ``(2, num_blocks, ...)`` cache: K block ``b`` at ``addr + b*block_stride``,
    V block ``b`` at ``addr + v_offset + b*block_stride``; each block ``block_bytes`` long."""

    layer: str
    addr: int
    block_stride: int
    num_blocks: int
    block_bytes: int
    v_offset: int
    kv_layout: str = "NHD"
    mem_type: str = "DRAM"
    device_id: int = 0


@dataclass(frozen=True)
class PageDirectory:
    """What a P rank publishes: its NIXL agent metadata and the layout of its registered pages.

    Serialised as JSON (``to_bytes``/``from_bytes``), never pickle: it crosses a process (and in
    production a host) boundary, and a directory must not be able to run code.
    """

    engine_id: str
    agent_name: str
    tp_size: int
    rank: int
    agent_metadata: bytes
    mamba: tuple[MambaRegion, ...] = ()
    kv: tuple[KVRegion, ...] = ()

    def to_bytes(self) -> bytes:
        d = asdict(self)
        d["agent_metadata"] = base64.b64encode(self.agent_metadata).decode()
        return json.dumps(d).encode()

    @classmethod
    def from_bytes(cls, data: bytes | str) -> "PageDirectory":
        try:
            d = json.loads(data)
            return cls(
                engine_id=str(d["engine_id"]),
                agent_name=str(d["agent_name"]),
                tp_size=int(d["tp_size"]),
                rank=int(d["rank"]),
                agent_metadata=base64.b64decode(d["agent_metadata"]),
                mamba=tuple(MambaRegion(**r) for r in d["mamba"]),
                kv=tuple(KVRegion(**r) for r in d["kv"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise TransferError(f"malformed page directory: {err}") from None


@dataclass(frozen=True)
class RequestPages:
    """Where one request's state sits on the P engine, as its scheduler hands it to D.

    ``mamba``: ``{layer: slot ids}`` (one slot per request, or more with speculative slots);
    ``kv``: ``{layer: block ids}`` in token order. The ids are the same on every P rank (TP
    ranks share the block table), so one ``RequestPages`` serves every D rank.
    """

    request_id: str
    mamba: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    kv: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "request_id": self.request_id,
                "mamba": {k: list(v) for k, v in self.mamba.items()},
                "kv": {k: list(v) for k, v in self.kv.items()},
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes | str) -> "RequestPages":
        try:
            d = json.loads(data)
            return cls(
                str(d["request_id"]),
                {str(k): tuple(int(i) for i in v) for k, v in d["mamba"].items()},
                {str(k): tuple(int(i) for i in v) for k, v in d["kv"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise TransferError(f"malformed request pages: {err}") from None


# ---- agents -------------------------------------------------------------------------------------

_live_lock = threading.Lock()
_live_registrations = 0


def live_registrations() -> int:
    """Memory regions registered by bridges in this process and not yet deregistered."""
    return _live_registrations


def _count(delta: int) -> None:
    global _live_registrations
    with _live_lock:
        _live_registrations += delta


@contextlib.contextmanager
def _ucx_net_devices(devices: str | None):
    """``UCX_NET_DEVICES=devices`` while the UCX backend creates its context (where UCX reads it), then as before.

    The environment, not NIXL's ``ucx_devices`` backend parameter: with NIXL 1.5.1 that parameter
    is accepted but UCX still picked ``tcp/lo`` when told ``eth0``; the variable restricts it
    (``UCX_LOG_LEVEL=info`` shows the transports each endpoint uses).
    """
    if devices is None:
        yield
        return
    before = os.environ.get("UCX_NET_DEVICES")
    os.environ["UCX_NET_DEVICES"] = devices
    try:
        yield
    finally:
        if before is None:
            del os.environ["UCX_NET_DEVICES"]
        else:
            os.environ["UCX_NET_DEVICES"] = before


class _PageAgent:
    """One NIXL agent plus the page regions registered with it."""

    #: Whether the agent runs NIXL's background progress thread. The exporter needs it (its side of a
    #: READ, notifications included, progresses without any call from its owner); the importer drives
    #: progress itself while it waits, and a spinning progress thread there measurably slowed READs.
    progress_thread = True

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), progress_thread: bool | None = None,
                 ucx_devices: str | None = None) -> None:
        """``ucx_devices``: the network devices UCX may use (its ``UCX_NET_DEVICES`` syntax, e.g.
        ``"mlx5_0:1"`` or ``"eth0"``; None: UCX's own choice, every usable device). The agent metadata
        a peer loads carries this agent's worker addresses on exactly those devices."""
        nixl_agent, nixl_agent_config = _require_nixl()
        self.name = name
        if progress_thread is not None:  # this agent's choice over the class default
            self.progress_thread = progress_thread
        backends = list(backends)
        if ucx_devices is not None and "UCX" not in backends:
            raise TransferError(f"agent {name!r}: ucx_devices={ucx_devices!r} needs the UCX backend, not {backends}")
        try:
            with _ucx_net_devices(ucx_devices):
                self._agent = nixl_agent(
                    name, nixl_agent_config(enable_prog_thread=self.progress_thread, backends=backends))
        except Exception as err:  # NIXL raises its own binding errors
            raise TransferError(f"could not create NIXL agent {name!r} with backends {backends}"
                                f"{f' on UCX devices {ucx_devices!r}' if ucx_devices is not None else ''}: {err}") from err
        self._regs: dict[Buffer, Any] = {}
        self._mamba: dict[str, MambaRegion] = {}
        self._kv: dict[str, KVRegion] = {}
        self._stuck: list[Any] = []  # transfer handles NIXL could not cancel
        self._closed = False

    # registration ------------------------------------------------------------------------
    def _register(self, buf: Buffer) -> None:
        if buf in self._regs:  # vLLM-style shared pools: one region, several layer views
            return
        descs = np.array([[buf.addr, buf.nbytes, buf.device_id]], dtype=np.uint64)
        try:
            self._regs[buf] = self._agent.register_memory(descs, buf.mem_type)
        except Exception as err:
            raise TransferError(
                f"agent {self.name!r}: registering {buf.nbytes} bytes of {buf.mem_type} failed: {err}"
            ) from err
        _count(+1)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self.name!r} is closed")

    def register_mamba_layer(
        self,
        layer: Any,
        pages: Any = None,
        *,
        conv: Any = None,
        ssm: Any = None,
        conv_bytes: int | None = None,
        ssm_bytes: int | None = None,
        num_pages: int | None = None,
        page_stride: int | None = None,
    ) -> MambaRegion:
        """Register one Mamba layer's slots, as one page array or as two state arrays.

        * ``pages`` (vLLM's form): ``(num_pages, page_stride)`` bytes, each page ``conv_bytes`` of
          DS conv state, then ``ssm_bytes`` of SSM state, then padding. ``conv_bytes`` and
          ``ssm_bytes`` are required; ``num_pages`` defaults to ``pages.shape[0]``,
          ``page_stride`` to ``nbytes / num_pages``.
        * ``conv`` + ``ssm`` (jaxmamba.cache's form): ``(num_slots, conv_dim, R)`` and
          ``(num_slots, H, P, N)``; sizes follow from the arrays (``num_pages`` is needed only
          for raw ``Buffer``s).
        """
        self._check_open()
        layer = str(layer)
        if layer in self._mamba:
            raise TransferError(f"agent {self.name!r}: mamba layer {layer!r} registered twice")
        who = f"agent {self.name!r}: mamba layer {layer!r}"
        if pages is not None and conv is None and ssm is None:
            if conv_bytes is None or ssm_bytes is None:
                raise TransferError(f"{who}: a page array needs conv_bytes and ssm_bytes")
            buf = buffer_of(pages)
            num_pages = int(num_pages if num_pages is not None else pages.shape[0])
            stride = int(page_stride if page_stride is not None else buf.nbytes // max(num_pages, 1))
            if num_pages <= 0 or stride * num_pages > buf.nbytes or conv_bytes + ssm_bytes > stride:
                raise TransferError(
                    f"{who}: {num_pages} pages of stride {stride} holding "
                    f"{conv_bytes}+{ssm_bytes} bytes do not fit a {buf.nbytes}-byte buffer"
                )
            bufs = [buf]
            region = MambaRegion(
                layer,
                num_pages,
                int(conv_bytes),
                int(ssm_bytes),
                buf.addr,
                stride,
                buf.addr + int(conv_bytes),
                stride,
                buf.mem_type,
                buf.device_id,
            )
        elif pages is None and conv is not None and ssm is not None:
            cbuf, sbuf = buffer_of(conv), buffer_of(ssm)
            num_pages = int(num_pages if num_pages is not None else conv.shape[0])
            if num_pages <= 0 or cbuf.nbytes % num_pages or sbuf.nbytes % num_pages:
                raise TransferError(
                    f"{who}: conv ({cbuf.nbytes} B) and ssm ({sbuf.nbytes} B) are not {num_pages} slots"
                )
            if (cbuf.mem_type, cbuf.device_id) != (sbuf.mem_type, sbuf.device_id):
                raise TransferError(f"{who}: conv and ssm state live in different memories")
            cb, sb = cbuf.nbytes // num_pages, sbuf.nbytes // num_pages
            if (conv_bytes is not None and conv_bytes != cb) or (ssm_bytes is not None and ssm_bytes != sb):
                raise TransferError(f"{who}: arrays hold {cb}+{sb} bytes per slot, not {conv_bytes}+{ssm_bytes}")
            bufs = [cbuf, sbuf]
            region = MambaRegion(layer, num_pages, cb, sb, cbuf.addr, cb, sbuf.addr, sb, cbuf.mem_type, cbuf.device_id)
        else:
            raise TransferError(f"{who}: pass either pages, or both conv and ssm")
        self._on_register_mamba(region)
        for buf in bufs:
            self._register(buf)
        self._mamba[layer] = region
        return region

    def register_kv_layer(
        self, layer: Any, kv: Any, *, kv_layout: str = "NHD", num_blocks: int | None = None
    ) -> KVRegion:
        """Register one attention layer's cache ``(2, num_blocks, ...)`` (K then V, C-contiguous).

        ``num_blocks`` defaults to ``kv.shape[1]`` (required when ``kv`` is a raw ``Buffer``).
        """
        self._check_open()
        layer = str(layer)
        if layer in self._kv:
            raise TransferError(f"agent {self.name!r}: attention layer {layer!r} registered twice")
        buf = buffer_of(kv)
        if num_blocks is None:
            shape = tuple(getattr(kv, "shape", ()))
            if len(shape) < 3 or shape[0] != 2:
                raise TransferError(
                    f"agent {self.name!r}: attention layer {layer!r}: want (2, num_blocks, ...), got {shape}"
                )
            num_blocks = shape[1]
        num_blocks = int(num_blocks)
        if num_blocks <= 0 or buf.nbytes % (2 * num_blocks):
            raise TransferError(
                f"agent {self.name!r}: attention layer {layer!r}: {buf.nbytes} bytes are not 2 x {num_blocks} blocks"
            )
        block_bytes = buf.nbytes // (2 * num_blocks)
        region = KVRegion(
            layer,
            buf.addr,
            block_bytes,
            num_blocks,
            block_bytes,
            num_blocks * block_bytes,
            kv_layout,
            buf.mem_type,
            buf.device_id,
        )
        self._on_register_kv(region)
        self._register(buf)
        self._kv[layer] = region
        return region

    def _on_register_mamba(self, region: MambaRegion) -> None:  # hook: the importer checks its plan
        pass

    def _on_register_kv(self, region: KVRegion) -> None:
        pass

    @property
    def num_registrations(self) -> int:
        return len(self._regs)

    @property
    def num_stuck_reads(self) -> int:
        """READs NIXL could not cancel: their destination pages may still be written, so they must stay
        allocated and unused (``close`` keeps them registered)."""
        return len(self._stuck)

    def registered_buffers(self) -> tuple[Buffer, ...]:
        return tuple(self._regs)

    def holds_registration(self, buf: Buffer) -> bool:
        """Ask the NIXL agent itself whether ``buf`` is registered (preparing a local descriptor
        list for unregistered memory fails with NIXL_ERR_NOT_FOUND)."""
        if self._closed:
            return False
        return self._agent_holds(buf)

    def _agent_holds(self, buf: Buffer) -> bool:
        descs = np.array([[buf.addr, buf.nbytes, buf.device_id]], dtype=np.uint64)
        try:
            handle = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, buf.mem_type)
        except Exception:
            return False
        self._agent.release_dlist_handle(handle)
        return True

    # teardown ------------------------------------------------------------------------------
    def _release(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception:
            return False

    def _before_close(self) -> None:
        pass

    def close(self, *, verify: bool = False) -> None:
        """Release handles, unload remote agents, deregister memory, destroy the agent. Idempotent.

        ``verify``: afterwards ask the agent itself that no region is still registered (NIXL logs
        an error line per probe, so this is for tests and debugging).

        Raises ``TransferError`` (after releasing everything else) if a READ NIXL could not
        cancel is still outstanding: its destination stays registered on purpose.
        """
        if self._closed:
            return
        self._stuck = [h for h in self._stuck if not self._release(h)]
        self._before_close()
        if self._stuck:
            self._closed = True
            raise TransferError(
                f"agent {self.name!r}: {len(self._stuck)} READ(s) could not be cancelled; their "
                "destination memory stays registered (and must stay allocated) until the process exits"
            )
        errors = []
        for buf, reg in list(self._regs.items()):
            try:
                self._agent.deregister_memory(reg)
            except Exception as err:
                errors.append(f"{buf}: {err}")
            del self._regs[buf]
            _count(-1)
            # Ask NIXL, not our bookkeeping, that the region is really gone.
            if verify and self._agent_holds(buf):
                errors.append(f"{buf}: still registered after deregister_memory")
        self._mamba.clear()
        self._kv.clear()
        self._closed = True
        self._agent = None  # nixl_agent.__del__ tears the backend down
        if errors:
            raise TransferError(f"agent {self.name!r}: deregistration failed: {'; '.join(errors)}")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PageExporter(_PageAgent):
    """P side: registers one P rank's pages and publishes them (see the module docstring)."""

    def __init__(
        self,
        name: str,
        *,
        engine_id: str,
        tp_size: int,
        rank: int,
        backends: Sequence[str] = ("UCX",),
        progress_thread: bool = True,
        ucx_devices: str | None = None,
    ) -> None:
        """``progress_thread=False``: no background thread (NIXL's spins a core); the owner must then call
        ``poll_notifications`` regularly, which drives this agent's side of READs and notifications."""
        super().__init__(name, backends=backends, progress_thread=progress_thread, ucx_devices=ucx_devices)
        self.engine_id, self.tp_size, self.rank = engine_id, int(tp_size), int(rank)

    def directory(self) -> PageDirectory:
        """Directory of everything registered so far (call after the last registration: the
        agent metadata carries the registrations' remote keys)."""
        self._check_open()
        return PageDirectory(
            engine_id=self.engine_id,
            agent_name=self.name,
            tp_size=self.tp_size,
            rank=self.rank,
            agent_metadata=bytes(self._agent.get_agent_metadata()),
            mamba=tuple(self._mamba.values()),
            kv=tuple(self._kv.values()),
        )

    def poll_notifications(self) -> dict[str, list[bytes]]:
        """READ-completion notifications from D agents since the last call (``{agent: [msg]}``):
        a D rank's ``notif`` arrives once its READ from this rank is complete, so the P engine
        may free the request's pages after hearing from every reader."""
        self._check_open()
        return {k: list(v) for k, v in self._agent.get_new_notifs().items()}
