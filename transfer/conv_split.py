"""Byte geometry of one rank's Mamba2 conv state page, and where a D rank's slices sit in a P page.

``ConvSplit`` mirrors vLLM 0.33's ``MambaConvSplitInfo`` (local and remote x/B/C offsets for vLLM's signed
TP ratio). The page layout and the "3-read": docs/architecture.md, "The conv state split".
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxmamba.errors import TransferError

#: Names of the conv sub-projections in page order.
CONV_PARTS = ("conv_x", "conv_B", "conv_C")


def _check_ratio(tp_ratio: int) -> None:
    # vLLM never produces 0 or -1 (equal TP is +1); refusing them keeps one spelling per case.
    if not isinstance(tp_ratio, int) or tp_ratio == 0 or tp_ratio == -1:
        raise TransferError(
            f"tp_ratio={tp_ratio!r} is not a signed TP ratio: use D_TP/P_TP >= 1, or -(P_TP/D_TP) <= -2"
        )


@dataclass(frozen=True)
class ConvSplit:
    """Per-rank byte sizes of the conv sub-projections x, B, C (all LOCAL to one engine's TP).

    Args:
        conv_rows: ``R = conv_kernel - 1 + num_spec`` history values per channel.
        x_local: x channels on this rank, ``intermediate_size / tp``.
        b_local: B channels on this rank (C has as many), ``(n_groups + extra) * d_state / tp``.
        dtype_size: bytes per conv-state element.
    """

    conv_rows: int
    x_local: int
    b_local: int
    dtype_size: int

    def __post_init__(self) -> None:
        for name in ("conv_rows", "x_local", "b_local", "dtype_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise TransferError(f"ConvSplit.{name}={value!r} must be a positive int")

    @property
    def conv_dim_local(self) -> int:
        """Conv channels on this rank: ``x_local + 2 * b_local``."""
        return self.x_local + 2 * self.b_local

    @property
    def x_bytes(self) -> int:
        """Bytes of this rank's x sub-projection: ``x_local * R * dtype_size``."""
        return self.x_local * self.conv_rows * self.dtype_size

    @property
    def b_bytes(self) -> int:
        """Bytes of this rank's B sub-projection (C is the same size)."""
        return self.b_local * self.conv_rows * self.dtype_size

    @property
    def conv_bytes(self) -> int:
        """Bytes of the whole conv state of one slot: ``x_bytes + 2 * b_bytes``."""
        return self.x_bytes + 2 * self.b_bytes

    def local_offsets(self) -> list[tuple[int, int]]:
        """``(byte_offset, byte_size)`` of x, B, C inside this engine's page (as vLLM's ``local_conv_offsets``)."""
        xb, bb = self.x_bytes, self.b_bytes
        return [(0, xb), (xb, bb), (xb + bb, bb)]

    def remote_offsets(
        self, local_rank_offset: int, tp_ratio: int, parts: tuple[str, ...] = CONV_PARTS
    ) -> list[tuple[int, int]]:
        """``(byte_offset, byte_size)`` of this D rank's x, B, C reads inside one P page.

        ``self`` describes the D rank (as in vLLM, where the D side computes remote offsets
        from its own split). For ``tp_ratio >= 1`` the P page's sub-projections are
        ``tp_ratio`` times larger and this rank reads slice ``local_rank_offset`` of each;
        for ``tp_ratio < 0`` the P page is ``|tp_ratio|`` times smaller and every
        sub-projection is read whole (``local_rank_offset`` is then ignored, as in vLLM).
        ``parts`` selects entries (default all three, vLLM's return value).
        """
        _check_ratio(tp_ratio)
        sizes = (self.x_bytes, self.b_bytes, self.b_bytes)
        unknown = set(parts) - set(CONV_PARTS)
        if unknown:
            raise TransferError(f"unknown conv parts {sorted(unknown)}; expected some of {CONV_PARTS}")
        out: list[tuple[int, int]] = []
        if tp_ratio >= 1:
            if not 0 <= local_rank_offset < tp_ratio:
                raise TransferError(f"local_rank_offset={local_rank_offset} is outside [0, tp_ratio={tp_ratio})")
            remote_base = 0
            for size in sizes:
                out.append((remote_base + local_rank_offset * size, size))
                remote_base += size * tp_ratio
            return [o for o, part in zip(out, CONV_PARTS, strict=True) if part in parts]
        ratio = -tp_ratio
        remote_base = 0
        for size, part in zip(sizes, CONV_PARTS, strict=True):
            # vLLM floors here; a remainder would mean the engines' shapes disagree, which
            # must not silently truncate a read. (A part not asked for, such as a replicated
            # B/C group that is read whole instead, need not split.)
            if size % ratio and part in parts:
                raise TransferError(
                    f"conv sub-projection of {size} bytes does not split into |tp_ratio|={ratio} P pages"
                )
            out.append((remote_base, size // ratio))
            remote_base += size // ratio
        return [o for o, part in zip(out, CONV_PARTS, strict=True) if part in parts]

    def local_offsets_for_source(
        self, source_index: int, tp_ratio: int, parts: tuple[str, ...] = CONV_PARTS
    ) -> list[tuple[int, int]]:
        """``(byte_offset, byte_size)`` in THIS (D) page where the reads of :meth:`remote_offsets` land.

        ``tp_ratio >= 1``: the local sub-projections themselves. ``tp_ratio < 0``: the
        ``source_index``-th of the D rank's ``|tp_ratio|`` P ranks fills the
        ``source_index``-th ``size/|tp_ratio|`` chunk of each sub-projection.
        """
        _check_ratio(tp_ratio)
        if tp_ratio >= 1:
            if source_index != 0:
                raise TransferError(f"source_index={source_index} but tp_ratio={tp_ratio} has one source")
            return [o for o, part in zip(self.local_offsets(), CONV_PARTS, strict=True) if part in parts]
        ratio = -tp_ratio
        if not 0 <= source_index < ratio:
            raise TransferError(f"source_index={source_index} is outside [0, |tp_ratio|={ratio})")
        local = [o for o, part in zip(self.local_offsets(), CONV_PARTS, strict=True) if part in parts]
        remote = self.remote_offsets(0, tp_ratio, parts)
        return [(off + source_index * rsize, rsize) for (off, _), (_, rsize) in zip(local, remote, strict=True)]


def ssm_slice(ssm_bytes_local: int, local_rank_offset: int, tp_ratio: int) -> tuple[int, int, int]:
    """``(remote_offset, local_offset, size)`` of one SSM read, relative to the SSM sections.

    The SSM state ``(H_local, head_dim, d_state)`` is head-major, so a rank's heads are one
    contiguous run. ``tp_ratio >= 1``: the D rank's heads are slice ``local_rank_offset`` of the
    P rank's. ``tp_ratio < 0``: the P rank's whole SSM section (``ssm_bytes_local / |r|``) lands at
    chunk ``local_rank_offset`` (the source index) of the D rank's.
    """
    _check_ratio(tp_ratio)
    if tp_ratio >= 1:
        if not 0 <= local_rank_offset < tp_ratio:
            raise TransferError(f"local_rank_offset={local_rank_offset} is outside [0, tp_ratio={tp_ratio})")
        return local_rank_offset * ssm_bytes_local, 0, ssm_bytes_local
    ratio = -tp_ratio
    if ssm_bytes_local % ratio:
        raise TransferError(f"ssm state of {ssm_bytes_local} bytes does not split into |tp_ratio|={ratio} P pages")
    if not 0 <= local_rank_offset < ratio:
        raise TransferError(f"source index {local_rank_offset} is outside [0, |tp_ratio|={ratio})")
    size = ssm_bytes_local // ratio
    return 0, local_rank_offset * size, size
