"""Transfer plans between a prefill (P) engine and one decode (D) rank of a different TP size.

``TransferPlan``: which P ranks a D rank READs and the exact ``ByteRange``s per Mamba state slot and per
KV block; ``physical_head_range`` (vLLM's KV head mapping). Page layouts, topology and where this
deliberately differs from vLLM: docs/architecture.md, "Transfer plans across TP sizes".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from jaxmamba.errors import ConfigError, TransferError
from jaxmamba.layout import extra_groups_for_head_shards, kv_cache_shape, mamba2_state_shape
from transfer.conv_split import CONV_PARTS, ConvSplit, ssm_slice

KV_LAYOUTS = ("NHD", "HND")
MAMBA = "mamba"
KV_REGIONS = ("k", "v")


def signed_tp_ratio(p_tp: int, d_tp: int) -> int:
    """vLLM's signed ratio: ``D_TP // P_TP`` when ``D_TP >= P_TP``, else ``-(P_TP // D_TP)``.

    Raises ``TransferError`` naming both sizes when the larger is not a multiple of the smaller
    (no rank mapping exists then).
    """
    for name, tp in (("P_TP", p_tp), ("D_TP", d_tp)):
        if not isinstance(tp, (int, np.integer)) or tp <= 0:
            raise ConfigError(f"{name}={tp!r} must be a positive int")
    if d_tp >= p_tp:
        if d_tp % p_tp:
            raise TransferError(f"TP ratio D_TP={d_tp} / P_TP={p_tp} does not divide: D_TP must be a multiple of P_TP")
        return d_tp // p_tp
    if p_tp % d_tp:
        raise TransferError(f"TP ratio P_TP={p_tp} / D_TP={d_tp} does not divide: P_TP must be a multiple of D_TP")
    return -(p_tp // d_tp)


def physical_head_range(tp_size: int, num_kv_heads: int, rank: int) -> range:
    """Global KV heads stored in rank ``rank``'s KV cache (as vLLM).

    ``tp_size <= num_kv_heads``: ``num_kv_heads / tp_size`` contiguous heads per rank.
    ``tp_size > num_kv_heads`` (GQA replication): one head per rank, ``rank * num_kv_heads //
    tp_size``, so consecutive ranks share a head (vLLM's weight loader gives rank ``r`` head
    ``r // (tp_size / num_kv_heads)``, the same number).
    """
    if tp_size <= 0 or num_kv_heads <= 0:
        raise ConfigError(f"tensor_parallel_size={tp_size} and num_kv_heads={num_kv_heads} must be positive")
    if not 0 <= rank < tp_size:
        raise ConfigError(f"rank={rank} is outside [0, tensor_parallel_size={tp_size})")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ConfigError(f"num_kv_heads={num_kv_heads} is not divisible by tensor_parallel_size={tp_size}")
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % num_kv_heads:
        raise ConfigError(f"tensor_parallel_size={tp_size} is not a multiple of num_kv_heads={num_kv_heads}")
    head = rank * num_kv_heads // tp_size
    return range(head, head + 1)


def mamba_read_targets(p_tp: int, d_tp: int, d_rank: int) -> tuple[int, ...]:
    """P ranks a D rank reads Mamba state from, in source order (as vLLM's ``target_remote_ranks``)."""
    ratio = signed_tp_ratio(p_tp, d_tp)
    if not 0 <= d_rank < d_tp:
        raise ConfigError(f"d_rank={d_rank} is outside [0, D_TP={d_tp})")
    if ratio >= 1:
        return (d_rank // ratio,)
    return tuple(d_rank * -ratio + j for j in range(-ratio))


def _itemsize(dtype: Any) -> int:
    if isinstance(dtype, (int, np.integer)):
        return int(dtype)
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        return 2
    if hasattr(dtype, "itemsize") and isinstance(dtype.itemsize, int):
        return int(dtype.itemsize)
    return np.dtype(dtype).itemsize


@dataclass(frozen=True)
class TransferShape:
    """The model and cache facts a transfer plan depends on (identical on both engines).

    Mamba2: ``intermediate_size = num_heads * head_dim``, ``n_groups``, ``d_state``,
    ``conv_kernel``; ``num_spec`` speculative tokens (conv rows ``conv_kernel - 1 + num_spec``).
    Attention: ``num_kv_heads`` (0 = no attention layers), ``attn_head_dim``, ``block_size``
    tokens per KV block, ``kv_layout`` "NHD" or "HND". Dtype sizes are bytes per element.
    """

    intermediate_size: int
    n_groups: int
    d_state: int
    num_heads: int
    head_dim: int
    conv_kernel: int
    num_spec: int = 0
    conv_dtype_size: int = 2
    ssm_dtype_size: int = 4
    num_kv_heads: int = 0
    attn_head_dim: int = 0
    kv_dtype_size: int = 2
    block_size: int = 16
    kv_layout: str = "NHD"
    conv_layout: str = "DS"

    def __post_init__(self) -> None:
        if self.conv_layout != "DS":
            raise TransferError(
                f"conv_layout={self.conv_layout!r}: NIXL transfer needs the DS conv layout "
                "(x, B, C contiguous; vLLM asserts VLLM_SSM_CONV_STATE_LAYOUT=DS for the same reason)"
            )
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"kv_layout={self.kv_layout!r} must be one of {KV_LAYOUTS}")
        if self.intermediate_size != self.num_heads * self.head_dim:
            raise ConfigError(
                f"intermediate_size={self.intermediate_size} != num_heads={self.num_heads} * head_dim={self.head_dim}"
            )
        for name in ("conv_dtype_size", "ssm_dtype_size", "kv_dtype_size", "block_size", "d_state"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        if self.num_kv_heads < 0 or (self.num_kv_heads and self.attn_head_dim <= 0):
            raise ConfigError(f"num_kv_heads={self.num_kv_heads} needs a positive attn_head_dim={self.attn_head_dim}")

    @property
    def conv_rows(self) -> int:
        return self.conv_kernel - 1 + self.num_spec

    @property
    def has_attention(self) -> bool:
        return self.num_kv_heads > 0

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        conv_dtype: Any,
        ssm_dtype: Any,
        kv_dtype: Any = 2,
        block_size: int = 16,
        num_spec: int = 0,
        kv_layout: str = "NHD",
    ) -> "TransferShape":
        """From a ``jaxmamba.config.HybridConfig`` (dtypes as numpy/jax dtypes, names or byte sizes)."""
        has_attn = bool(getattr(config, "attention_layer_ids", ())) or any(
            kind in ("attention", "hybrid") for kind in getattr(config, "layer_types", ())
        )
        return cls(
            intermediate_size=config.mamba_intermediate_size,
            n_groups=config.mamba_n_groups,
            d_state=config.mamba_d_state,
            num_heads=config.mamba_num_heads,
            head_dim=config.mamba_head_dim,
            conv_kernel=config.mamba_conv_kernel,
            num_spec=num_spec,
            conv_dtype_size=_itemsize(conv_dtype),
            ssm_dtype_size=_itemsize(ssm_dtype),
            num_kv_heads=config.num_key_value_heads if has_attn else 0,
            attn_head_dim=config.head_dim if has_attn else 0,
            kv_dtype_size=_itemsize(kv_dtype),
            block_size=block_size,
            kv_layout=kv_layout,
        )


@dataclass(frozen=True)
class MambaGeometry:
    """One engine rank's Mamba slot page: ``conv_bytes`` of DS conv state, then ``ssm_bytes``."""

    tp_size: int
    conv: ConvSplit
    heads_local: int
    ssm_bytes: int

    @property
    def conv_bytes(self) -> int:
        return self.conv.conv_bytes

    @property
    def page_bytes(self) -> int:
        """Unpadded page: conv + ssm (vLLM's ``MambaSpec.page_size_bytes``)."""
        return self.conv_bytes + self.ssm_bytes

    @classmethod
    def for_tp(cls, shape: TransferShape, tp_size: int) -> "MambaGeometry":
        # The shapes come from jaxmamba.layout (vLLM's MambaStateShapeCalculator mirror), so an
        # invalid (n_groups, TP) or non-dividing head count raises ConfigError naming the field.
        conv_shape, ssm_shape = mamba2_state_shape(
            tp_size,
            shape.intermediate_size,
            shape.n_groups,
            shape.num_heads,
            shape.head_dim,
            shape.d_state,
            shape.conv_kernel,
            num_spec=shape.num_spec,
            conv_layout="DS",
        )
        groups = shape.n_groups + extra_groups_for_head_shards(shape.n_groups, tp_size)
        x_local = shape.intermediate_size // tp_size
        b_local = groups * shape.d_state // tp_size
        conv = ConvSplit(shape.conv_rows, x_local, b_local, shape.conv_dtype_size)
        assert conv.conv_dim_local == conv_shape[0] and conv.conv_rows == conv_shape[1]
        return cls(tp_size, conv, ssm_shape[0], math.prod(ssm_shape) * shape.ssm_dtype_size)


@dataclass(frozen=True)
class KVGeometry:
    """One engine rank's attention KV block: ``block_bytes`` for K (and as many for V)."""

    tp_size: int
    heads_local: int
    block_bytes: int

    @classmethod
    def for_tp(cls, shape: TransferShape, tp_size: int) -> "KVGeometry":
        _, _, bs, heads, hd = kv_cache_shape(1, shape.block_size, shape.num_kv_heads, shape.attn_head_dim, tp_size)
        return cls(tp_size, heads, bs * heads * hd * shape.kv_dtype_size)


@dataclass(frozen=True)
class ByteRange:
    """One READ: ``length`` bytes at ``src_offset`` of P rank ``src_rank``'s page/block to ``dst_offset``.

    ``region``: "mamba" (offsets within a slot page) or "k"/"v" (within one K/V block).
    ``part``: "conv_x", "conv_B", "conv_C", "ssm", "k", "v"; coalesced ranges join parts with "+".
    """

    region: str
    part: str
    src_rank: int
    src_offset: int
    dst_offset: int
    length: int


def coalesce(ranges: Iterable[ByteRange]) -> tuple[ByteRange, ...]:
    """Merge ranges that are contiguous on both sides (same region and source rank).

    Fewer, larger descriptors: with equal TP a whole Mamba page is one READ; an NHD KV block
    whose head count is unchanged is one READ instead of one per token.
    """
    by_key: dict[tuple[str, int], list[ByteRange]] = {}
    for r in ranges:
        by_key.setdefault((r.region, r.src_rank), []).append(r)
    out: list[ByteRange] = []
    for key in by_key:
        cur: ByteRange | None = None
        for r in sorted(by_key[key], key=lambda r: r.dst_offset):
            if (
                cur is not None
                and cur.src_offset + cur.length == r.src_offset
                and cur.dst_offset + cur.length == r.dst_offset
            ):
                parts = cur.part if cur.part.split("+")[-1] == r.part else f"{cur.part}+{r.part}"
                cur = ByteRange(cur.region, parts, cur.src_rank, cur.src_offset, cur.dst_offset, cur.length + r.length)
            else:
                if cur is not None:
                    out.append(cur)
                cur = r
        if cur is not None:
            out.append(cur)
    return tuple(out)


@dataclass(frozen=True)
class TransferPlan:
    """What D rank ``d_rank`` (of ``d_tp``) reads from a P engine of ``p_tp`` ranks, per slot / block.

    Derived fields: ``tp_ratio`` (signed, as vLLM), ``p_mamba``/``d_mamba`` (page geometry of a
    P rank / this D rank), ``p_kv``/``d_kv`` (KV block geometry, None without attention),
    ``mamba_read_targets``, ``fa_read_targets``, ``mamba_ranges`` and ``kv_ranges`` (uncoalesced,
    one entry per sub-projection / head run; see ``ranges(coalesced=True)`` for descriptors).
    """

    shape: TransferShape
    p_tp: int
    d_tp: int
    d_rank: int
    tp_ratio: int = field(init=False)
    p_mamba: MambaGeometry = field(init=False)
    d_mamba: MambaGeometry = field(init=False)
    p_kv: KVGeometry | None = field(init=False)
    d_kv: KVGeometry | None = field(init=False)
    mamba_read_targets: tuple[int, ...] = field(init=False)
    fa_read_targets: tuple[int, ...] = field(init=False)
    mamba_ranges: tuple[ByteRange, ...] = field(init=False)
    kv_ranges: tuple[ByteRange, ...] = field(init=False)

    def __post_init__(self) -> None:
        ratio = signed_tp_ratio(self.p_tp, self.d_tp)
        targets = mamba_read_targets(self.p_tp, self.d_tp, self.d_rank)
        p_mamba = MambaGeometry.for_tp(self.shape, self.p_tp)
        d_mamba = MambaGeometry.for_tp(self.shape, self.d_tp)
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen dataclass)
        set_("tp_ratio", ratio)
        set_("p_mamba", p_mamba)
        set_("d_mamba", d_mamba)
        set_("mamba_read_targets", targets)
        set_("mamba_ranges", self._build_mamba_ranges())
        if self.shape.has_attention:
            set_("p_kv", KVGeometry.for_tp(self.shape, self.p_tp))
            set_("d_kv", KVGeometry.for_tp(self.shape, self.d_tp))
            fa_targets, kv_ranges = self._build_kv_ranges()
        else:
            set_("p_kv", None)
            set_("d_kv", None)
            fa_targets, kv_ranges = (), ()
        set_("fa_read_targets", fa_targets)
        set_("kv_ranges", kv_ranges)

    # -- Mamba -------------------------------------------------------------------------------
    @property
    def groups_sharded(self) -> bool:
        """True when B/C groups shard with TP on both engines (else the one group is replicated)."""
        g = self.shape.n_groups
        return g % self.p_tp == 0 and g % self.d_tp == 0

    def _build_mamba_ranges(self) -> tuple[ByteRange, ...]:
        ratio, d, p = self.tp_ratio, self.d_mamba, self.p_mamba
        out: list[ByteRange] = []
        sources = list(enumerate(self.mamba_read_targets))
        for j, p_rank in sources:
            lro = self.d_rank % ratio if ratio >= 1 else 0
            # With n_groups == 1 replicated on some side, every rank of both engines holds the
            # whole group (b_local == d_state), so B and C are not split by the ratio: they are
            # one whole-section read each, from the first source, P's section to D's section.
            parts = CONV_PARTS if self.groups_sharded else ("conv_x",)
            remote = d.conv.remote_offsets(lro, ratio, parts)
            local = d.conv.local_offsets_for_source(j, ratio, parts)
            for part, (src_off, size), (dst_off, dsize) in zip(parts, remote, local, strict=True):
                assert size == dsize
                out.append(ByteRange(MAMBA, part, p_rank, src_off, dst_off, size))
            if not self.groups_sharded and j == 0:
                assert p.conv.b_bytes == d.conv.b_bytes
                for k in (1, 2):
                    src_off, size = p.conv.local_offsets()[k]
                    dst_off, _ = d.conv.local_offsets()[k]
                    out.append(ByteRange(MAMBA, CONV_PARTS[k], p_rank, src_off, dst_off, size))
            src_rel, dst_rel, size = ssm_slice(d.ssm_bytes, lro if ratio >= 1 else j, ratio)
            out.append(ByteRange(MAMBA, "ssm", p_rank, p.conv_bytes + src_rel, d.conv_bytes + dst_rel, size))
        return tuple(out)

    # -- attention ---------------------------------------------------------------------------
    def _build_kv_ranges(self) -> tuple[tuple[int, ...], tuple[ByteRange, ...]]:
        shape, p_kv, d_kv = self.shape, self.p_kv, self.d_kv
        assert p_kv is not None and d_kv is not None
        K = shape.num_kv_heads
        d_heads = physical_head_range(self.d_tp, K, self.d_rank)
        head_bytes = shape.attn_head_dim * shape.kv_dtype_size
        bs = shape.block_size
        # Candidate sources: the Mamba targets first (fewer peers), then any P rank, so the
        # plan stays correct even for a head the Mamba targets do not hold.
        candidates = list(self.mamba_read_targets) + [r for r in range(self.p_tp) if r not in self.mamba_read_targets]
        p_ranges = {r: physical_head_range(self.p_tp, K, r) for r in candidates}
        runs: list[ByteRange] = []
        used: list[int] = []
        for i, head in enumerate(d_heads):
            p_rank = next(r for r in candidates if head in p_ranges[r])
            if p_rank not in used:
                used.append(p_rank)
            j = head - p_ranges[p_rank].start
            if shape.kv_layout == "HND":
                runs.append(ByteRange("k", "k", p_rank, j * bs * head_bytes, i * bs * head_bytes, bs * head_bytes))
            else:
                for t in range(bs):
                    src = (t * p_kv.heads_local + j) * head_bytes
                    dst = (t * d_kv.heads_local + i) * head_bytes
                    runs.append(ByteRange("k", "k", p_rank, src, dst, head_bytes))
        k_ranges = coalesce(runs)
        v_ranges = tuple(ByteRange("v", "v", r.src_rank, r.src_offset, r.dst_offset, r.length) for r in k_ranges)
        return tuple(sorted(used)), k_ranges + v_ranges

    # -- queries -----------------------------------------------------------------------------
    @property
    def read_targets(self) -> tuple[int, ...]:
        """Every P rank this D rank reads from (Mamba or attention)."""
        return tuple(sorted(set(self.mamba_read_targets) | set(self.fa_read_targets)))

    def ranges(
        self, region: str | None = None, *, src_rank: int | None = None, coalesced: bool = False
    ) -> tuple[ByteRange, ...]:
        """The plan's ranges, optionally for one region ("mamba", "k", "v") and one P rank, merged."""
        rs = [
            r
            for r in self.mamba_ranges + self.kv_ranges
            if (region is None or r.region == region) and (src_rank is None or r.src_rank == src_rank)
        ]
        return coalesce(rs) if coalesced else tuple(rs)

    def bytes_per_slot(self) -> int:
        """Bytes read per Mamba slot (always the D page's unpadded size: every byte exactly once)."""
        return sum(r.length for r in self.mamba_ranges)

    def bytes_per_block(self) -> int:
        """Bytes read per attention block id (K and V)."""
        return sum(r.length for r in self.kv_ranges)

    def check_remote_mamba(
        self, p_rank: int, layer: Any, *, conv_bytes: int, ssm_bytes: int, page_stride: int | None = None
    ) -> None:
        """Raise ``TransferError`` unless a P rank's advertised Mamba page matches this plan."""
        self._check_geometry(f"P rank {p_rank} mamba layer {layer!r}", self.p_mamba, conv_bytes, ssm_bytes, page_stride)

    def check_local_mamba(self, layer: Any, *, conv_bytes: int, ssm_bytes: int, page_stride: int | None = None) -> None:
        """Raise ``TransferError`` unless this D rank's own Mamba page matches this plan."""
        self._check_geometry(
            f"D rank {self.d_rank} mamba layer {layer!r}", self.d_mamba, conv_bytes, ssm_bytes, page_stride
        )

    @staticmethod
    def _check_geometry(
        who: str, want: MambaGeometry, conv_bytes: int, ssm_bytes: int, page_stride: int | None
    ) -> None:
        if conv_bytes != want.conv_bytes or ssm_bytes != want.ssm_bytes:
            raise TransferError(
                f"{who}: page size mismatch, conv_bytes={conv_bytes} ssm_bytes={ssm_bytes} but the plan "
                f"(TP={want.tp_size}) expects conv_bytes={want.conv_bytes} ssm_bytes={want.ssm_bytes}"
            )
        if page_stride is not None and page_stride < want.page_bytes:
            raise TransferError(f"{who}: page stride {page_stride} is smaller than the page ({want.page_bytes} bytes)")

    def check_remote_kv(self, p_rank: int, layer: Any, *, block_bytes: int, kv_layout: str) -> None:
        """Raise ``TransferError`` unless a P rank's advertised KV block matches this plan."""
        self._check_kv(f"P rank {p_rank} attention layer {layer!r}", self.p_kv, block_bytes, kv_layout)

    def check_local_kv(self, layer: Any, *, block_bytes: int, kv_layout: str) -> None:
        self._check_kv(f"D rank {self.d_rank} attention layer {layer!r}", self.d_kv, block_bytes, kv_layout)

    def _check_kv(self, who: str, want: KVGeometry | None, block_bytes: int, kv_layout: str) -> None:
        if want is None:
            raise TransferError(f"{who}: the plan's model has no attention layers (num_kv_heads=0)")
        if kv_layout != self.shape.kv_layout:
            raise TransferError(f"{who}: kv_layout={kv_layout!r} but the plan uses {self.shape.kv_layout!r}")
        if block_bytes != want.block_bytes:
            raise TransferError(
                f"{who}: KV block size mismatch, block_bytes={block_bytes} but the plan "
                f"(TP={want.tp_size}) expects {want.block_bytes}"
            )
