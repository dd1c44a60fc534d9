"""A numpy model of per-rank cache pages, built from full (TP=1) logical states.

This is the *independent* side of the transfer checks: it knows nothing of ``ConvSplit`` or
``TransferPlan``. It shards logical states the way the model's weights are sharded (vLLM's
``mamba_v2_sharded_weight_loader`` and ``QKVParallelLinear``) and lays each rank's state out as
its cache bytes. A plan is right when executing its byte copies on P-rank pages rebuilds
exactly the page this module builds for the D rank.

Logical (TP=1) state for ``num_slots`` slots and ``num_blocks`` KV blocks:

* ``conv``: ``(num_slots, I + 2*G*N, R)``, channels ``[x (I) | B (G*N) | C (G*N)]``, DS layout.
* ``ssm``: ``(num_slots, H, P, N)``.
* ``kv``: ``(2, num_blocks, block_size, K, head_dim)`` (K then V).

Rank ``r`` of ``tp`` holds x channels ``[r*I/tp, (r+1)*I/tp)``; B (and C) of groups
``[r*G/tp, (r+1)*G/tp)`` when ``tp`` divides ``G``, else (``G == 1``) a full copy of group 0;
heads ``[r*H/tp, (r+1)*H/tp)``; KV heads ``[r*K/tp, (r+1)*K/tp)`` when ``tp <= K``, else the one
head ``r // (tp / K)`` (GQA replication).

Elements are random unsigned integers of the dtype's width: the checks are about bytes, and
integer bit patterns compare exactly (no NaN) while every byte position is distinct w.h.p.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from jaxmamba.errors import ConfigError
from jaxmamba.layout import kv_cache_shape, mamba2_state_shape
from transfer.hetero_tp import ByteRange, TransferShape

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def uint_dtype(nbytes: int) -> np.dtype:
    """Unsigned integer dtype of ``nbytes`` bytes, standing in for a float dtype of that width."""
    try:
        return np.dtype(_UINT[nbytes])
    except KeyError:
        raise ConfigError(f"dtype size {nbytes} has no unsigned integer stand-in") from None


@dataclass
class LogicalState:
    """Full (TP=1) Mamba and KV state: see the module docstring for shapes."""

    conv: np.ndarray
    ssm: np.ndarray
    kv: np.ndarray | None


def random_logical_state(shape: "TransferShape", *, num_slots: int, num_blocks: int = 0, seed: int = 0) -> LogicalState:
    rng = np.random.default_rng(seed)
    I, G, N = shape.intermediate_size, shape.n_groups, shape.d_state

    def draw(size: tuple[int, ...], nbytes: int) -> np.ndarray:
        dt = uint_dtype(nbytes)
        return rng.integers(0, np.iinfo(dt).max, size=size, dtype=dt, endpoint=True)

    conv = draw((num_slots, I + 2 * G * N, shape.conv_rows), shape.conv_dtype_size)
    ssm = draw((num_slots, shape.num_heads, shape.head_dim, N), shape.ssm_dtype_size)
    kv = None
    if shape.num_kv_heads:
        kv = draw((2, num_blocks, shape.block_size, shape.num_kv_heads, shape.attn_head_dim), shape.kv_dtype_size)
    return LogicalState(conv, ssm, kv)


def rank_conv_channels(shape: "TransferShape", tp: int, rank: int) -> np.ndarray:
    """Global conv channel indices rank ``rank`` holds, in its page order ``[x | B | C]``."""
    I, G, N = shape.intermediate_size, shape.n_groups, shape.d_state
    if I % tp:
        raise ConfigError(f"intermediate_size={I} is not divisible by tensor_parallel_size={tp}")
    if G % tp == 0:
        groups = range(rank * G // tp, (rank + 1) * G // tp)
    elif G == 1:
        groups = range(0, 1)  # the single group, replicated on every rank
    else:
        raise ConfigError(f"n_groups={G} is neither divisible by tensor_parallel_size={tp} nor 1")
    x = np.arange(rank * I // tp, (rank + 1) * I // tp)
    b = np.concatenate([I + g * N + np.arange(N) for g in groups])
    c = b + G * N
    return np.concatenate([x, b, c])


def rank_kv_heads(num_kv_heads: int, tp: int, rank: int) -> list[int]:
    """Global KV heads of rank ``rank`` as the QKV weight loader assigns them."""
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    replicas = tp // num_kv_heads
    return [rank // replicas]


def shard_mamba_pages(
    shape: "TransferShape",
    state: LogicalState,
    tp: int,
    rank: int,
    *,
    page_stride: int | None = None,
    pad_byte: int = 0,
) -> np.ndarray:
    """Rank ``rank``'s Mamba pages, ``(num_slots, page_stride)`` uint8: conv DS bytes, ssm bytes, padding."""
    chans = rank_conv_channels(shape, tp, rank)
    H = shape.num_heads
    heads = np.arange(rank * H // tp, (rank + 1) * H // tp)
    conv = np.ascontiguousarray(state.conv[:, chans, :])
    ssm = np.ascontiguousarray(state.ssm[:, heads])
    # Cross-check against the shared layout contract (vLLM's shape calculator mirror).
    conv_shape, ssm_shape = mamba2_state_shape(
        tp,
        shape.intermediate_size,
        shape.n_groups,
        H,
        shape.head_dim,
        shape.d_state,
        shape.conv_kernel,
        num_spec=shape.num_spec,
    )
    assert conv.shape[1:] == conv_shape and ssm.shape[1:] == ssm_shape, (conv.shape, conv_shape, ssm.shape, ssm_shape)
    slots = conv.shape[0]
    body = np.concatenate([conv.view(np.uint8).reshape(slots, -1), ssm.view(np.uint8).reshape(slots, -1)], axis=1)
    stride = body.shape[1] if page_stride is None else page_stride
    if stride < body.shape[1]:
        raise ConfigError(f"page_stride={stride} is smaller than the page ({body.shape[1]} bytes)")
    pages = np.full((slots, stride), pad_byte, np.uint8)
    pages[:, : body.shape[1]] = body
    return pages


def shard_kv(shape: "TransferShape", state: LogicalState, tp: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s KV cache, ``(2, num_blocks, block_size, heads_local, head_dim)`` (NHD) or
    ``(2, num_blocks, heads_local, block_size, head_dim)`` (HND), in the stand-in dtype."""
    assert state.kv is not None
    heads = rank_kv_heads(shape.num_kv_heads, tp, rank)
    kv = state.kv[:, :, :, heads, :]
    want = kv_cache_shape(kv.shape[1], shape.block_size, shape.num_kv_heads, shape.attn_head_dim, tp)
    assert kv.shape == want, (kv.shape, want)
    if shape.kv_layout == "HND":
        kv = kv.transpose(0, 1, 3, 2, 4)
    return np.ascontiguousarray(kv)


def kv_block_bytes(kv: np.ndarray) -> np.ndarray:
    """View a rank's KV cache as ``(2, num_blocks, block_bytes)`` uint8 (index 0 = K, 1 = V)."""
    return kv.view(np.uint8).reshape(kv.shape[0], kv.shape[1], -1)


def apply_ranges(
    ranges: Iterable["ByteRange"],
    src: Mapping[int, np.ndarray],
    dst: np.ndarray,
    pairs: Sequence[tuple[int, int]],
) -> None:
    """Execute byte copies with plain numpy.

    ``src[p_rank]`` and ``dst`` are ``(num_pages, stride)`` uint8 for one region (Mamba pages of
    one layer, or the K or V blocks of one layer); ``pairs`` lists ``(src_page, dst_page)``.
    """
    for r in ranges:
        s = src[r.src_rank]
        for sp, dp in pairs:
            if r.src_offset + r.length > s.shape[1] or r.dst_offset + r.length > dst.shape[1]:
                raise IndexError(f"{r} runs past a page ({s.shape[1]} / {dst.shape[1]} bytes)")
            dst[dp, r.dst_offset : r.dst_offset + r.length] = s[sp, r.src_offset : r.src_offset + r.length]


# ---- a stand-in prefill engine in its own process (tests, transfer benchmark) ---------------------


def layer_state(spec: Mapping, layer_index: int) -> tuple["TransferShape", LogicalState]:
    """The logical state of layer ``layer_index`` of a synthetic engine ``spec`` (deterministic:
    the D side rebuilds it to know what the P pages hold)."""
    shape = TransferShape(**spec["shape"])
    state = random_logical_state(
        shape, num_slots=spec["num_slots"], num_blocks=spec["num_blocks"], seed=int(spec["seed"]) * 1009 + layer_index
    )
    return shape, state


class _MappedArray:
    """A numpy array on its own anonymous mapping, so that ``unmap`` really returns the memory
    to the OS (a READ of it afterwards faults instead of reading stale bytes from the heap)."""

    def __init__(self, data: np.ndarray) -> None:
        import mmap

        self._mm = mmap.mmap(-1, max(data.nbytes, 1))
        view = np.frombuffer(self._mm, dtype=data.dtype, count=data.size).reshape(data.shape)
        view[...] = data
        self.addr, self.nbytes = int(view.ctypes.data), int(data.nbytes)
        del view  # no exported buffer may outlive the mapping

    def unmap(self) -> None:
        self._mm.close()


def synthetic_prefill_main(conn, spec: Mapping) -> None:
    """Run a synthetic P engine of ``spec["p_tp"]`` ranks (one NIXL agent each) in this process.

    Pages hold ``layer_state(spec, i)`` sharded for each P rank (``shard_mamba_pages`` with
    ``spec["p_pad"]`` padding bytes per page, ``shard_kv``). Protocol over ``conn``: sends
    ``("dirs", [directory bytes per rank])`` once ready, then answers ``("notifs",)`` with
    ``{rank: {agent: [msgs]}}``, ``("unmap",)`` (deregister and unmap every page: later READs
    fault) with ``"unmapped"``, ``("close",)`` with ``("closed", live registrations)``; returns
    on ``("exit",)`` or when the pipe closes. ``spec["env"]`` is applied before NIXL loads.
    """
    import os

    os.environ.update(spec.get("env", {}))
    # After the environment: this is a spawned process's entry point, and its NIXL settings come first.
    from transfer.nixl_bridge import Buffer, PageExporter, live_registrations

    p_tp = int(spec["p_tp"])
    mamba_states = [layer_state(spec, i) for i in range(len(spec["mamba_layers"]))]
    kv_states = [layer_state(spec, 1000 + j) for j in range(len(spec["kv_layers"]))]
    exporters, mapped = [], []
    try:
        for rank in range(p_tp):
            exp = PageExporter(f"{spec['engine_id']}-r{rank}", engine_id=spec["engine_id"], tp_size=p_tp, rank=rank)
            exporters.append(exp)
            for layer, (shape, state) in zip(spec["mamba_layers"], mamba_states, strict=True):
                conv_bytes, ssm_bytes = _conv_ssm_bytes(shape, p_tp)
                pages = shard_mamba_pages(
                    shape,
                    state,
                    p_tp,
                    rank,
                    pad_byte=0xEE,
                    page_stride=conv_bytes + ssm_bytes + int(spec.get("p_pad", 0)),
                )
                m = _MappedArray(pages)
                mapped.append(m)
                exp.register_mamba_layer(
                    layer,
                    Buffer(m.addr, m.nbytes),
                    conv_bytes=conv_bytes,
                    ssm_bytes=ssm_bytes,
                    num_pages=pages.shape[0],
                    page_stride=pages.shape[1],
                )
            for layer, (shape, state) in zip(spec["kv_layers"], kv_states, strict=True):
                kv = shard_kv(shape, state, p_tp, rank)
                m = _MappedArray(kv)
                mapped.append(m)
                exp.register_kv_layer(
                    layer, Buffer(m.addr, m.nbytes), kv_layout=shape.kv_layout, num_blocks=kv.shape[1]
                )
        conn.send(("dirs", [exp.directory().to_bytes() for exp in exporters]))
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                return
            if cmd[0] == "notifs":
                conn.send({exp.rank: exp.poll_notifications() for exp in exporters})
            elif cmd[0] == "unmap":
                for exp in exporters:
                    exp.close()
                for m in mapped:
                    m.unmap()
                mapped.clear()
                conn.send("unmapped")
            elif cmd[0] == "close":
                for exp in exporters:
                    exp.close()
                conn.send(("closed", live_registrations()))
            elif cmd[0] == "exit":
                return
    finally:
        for exp in exporters:
            with contextlib.suppress(Exception):
                exp.close()


def _conv_ssm_bytes(shape: "TransferShape", tp: int) -> tuple[int, int]:
    conv_shape, ssm_shape = mamba2_state_shape(
        tp,
        shape.intermediate_size,
        shape.n_groups,
        shape.num_heads,
        shape.head_dim,
        shape.d_state,
        shape.conv_kernel,
        num_spec=shape.num_spec,
    )
    return (int(np.prod(conv_shape)) * shape.conv_dtype_size, int(np.prod(ssm_shape)) * shape.ssm_dtype_size)
