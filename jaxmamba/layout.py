"""vLLM-compatible state shapes and page sizes.

Mirrors vLLM's ``MambaStateShapeCalculator.mamba2_state_shape`` and
``MambaSpec.page_size_bytes`` so numbers can be compared one to one, and so a
page written by jaxmamba can be read by a vLLM engine (and back).

Per Mamba layer and per state slot:

* ``conv_state``: DS layout ``(conv_dim_local, R)`` -- each channel's ``R``
  history values contiguous, channels ordered ``[x | B | C]`` -- or SD layout
  ``(R, conv_dim_local)``. ``R = conv_kernel - 1 + num_spec``.
* ``ssm_state``: ``(num_heads / tp, head_dim, state_size)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jaxmamba.errors import ConfigError

if TYPE_CHECKING:
    from jaxmamba.config import HybridConfig

#: Host index arrays use this to mean "do not touch this row" (vLLM's PAD_SLOT_ID).
PAD_SLOT_ID = -1
#: Slot 0 of every Mamba state array is never handed to a request; padded rows
#: (and vLLM 0.33's ``null_block_id``) point here.
NULL_SLOT = 0

CONV_LAYOUTS = ("DS", "SD")


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ConfigError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def extra_groups_for_head_shards(n_groups: int, tp_size: int) -> int:
    """Groups to add so every TP rank holds the B/C groups its heads need (as vLLM).

    0 when ``tp_size`` divides ``n_groups``; otherwise the single group is
    replicated onto every rank (``tp_size - n_groups`` extra). vLLM accepts a
    non-dividing ``n_groups`` only when it is 1; anything else is a ``ConfigError``.
    """
    if n_groups <= 0 or tp_size <= 0:
        raise ConfigError(f"n_groups={n_groups} and tensor_parallel_size={tp_size} must be positive")
    if n_groups % tp_size == 0:
        return 0
    if n_groups != 1:
        raise ConfigError(
            f"n_groups={n_groups} is not divisible by tensor_parallel_size={tp_size}; "
            "only n_groups=1 may be replicated across ranks"
        )
    return tp_size - n_groups


def mamba2_state_shape(
    tp_size: int,
    intermediate_size: int,
    n_groups: int,
    num_heads: int,
    head_dim: int,
    state_size: int,
    conv_kernel: int,
    num_spec: int = 0,
    conv_layout: str = "DS",
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """``(conv_state_shape, ssm_state_shape)`` of one slot on one TP rank (as vLLM).

    ``conv_dim = intermediate_size + 2 * (n_groups + extra) * state_size``; the
    conv state has ``conv_kernel - 1 + num_spec`` history rows.
    """
    if conv_layout not in CONV_LAYOUTS:
        raise ConfigError(f"conv_layout={conv_layout!r} must be one of {CONV_LAYOUTS}")
    if conv_kernel < 2:
        raise ConfigError(f"conv_kernel={conv_kernel} must be >= 2")
    if num_spec < 0:
        raise ConfigError(f"num_spec={num_spec} must be >= 0")
    groups = n_groups + extra_groups_for_head_shards(n_groups, tp_size)
    conv_dim = intermediate_size + 2 * groups * state_size
    conv_dim_local = _divide(conv_dim, tp_size, "conv_dim")
    _divide(intermediate_size, tp_size, "mamba intermediate_size")
    rows = conv_kernel - 1 + num_spec
    conv_shape = (conv_dim_local, rows) if conv_layout == "DS" else (rows, conv_dim_local)
    ssm_shape = (_divide(num_heads, tp_size, "mamba num_heads"), head_dim, state_size)
    return conv_shape, ssm_shape


def state_shapes(
    config: "HybridConfig", tp_size: int = 1, num_spec: int = 0, conv_layout: str = "DS"
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """``mamba2_state_shape`` for a ``HybridConfig``."""
    return mamba2_state_shape(
        tp_size,
        config.mamba_intermediate_size,
        config.mamba_n_groups,
        config.mamba_num_heads,
        config.mamba_head_dim,
        config.mamba_d_state,
        config.mamba_conv_kernel,
        num_spec=num_spec,
        conv_layout=conv_layout,
    )


def _itemsize(dtype) -> int:
    """Bytes per element of a numpy/jax dtype, a dtype name, or a torch dtype."""
    if hasattr(dtype, "itemsize") and isinstance(dtype.itemsize, int):
        return dtype.itemsize  # np.dtype instances, torch dtypes
    return np.dtype(dtype).itemsize


def page_size_bytes(
    config: "HybridConfig",
    tp_size: int = 1,
    *,
    conv_dtype,
    ssm_dtype,
    num_spec: int = 0,
) -> int:
    """Bytes of one Mamba state slot (conv + ssm) on one rank, as ``MambaSpec.page_size_bytes``."""
    conv_shape, ssm_shape = state_shapes(config, tp_size, num_spec)
    return math.prod(conv_shape) * _itemsize(conv_dtype) + math.prod(ssm_shape) * _itemsize(ssm_dtype)


@dataclass(frozen=True)
class ConvChannelSplit:
    """How one rank's conv channels divide into ``[x | B | C]`` (counts, not bytes)."""

    x_local: int  # intermediate_size / tp
    b_local: int  # (n_groups + extra) * state_size / tp; C has the same size

    @property
    def conv_dim_local(self) -> int:
        return self.x_local + 2 * self.b_local


def conv_channel_split(config: "HybridConfig", tp_size: int = 1) -> ConvChannelSplit:
    groups = config.mamba_n_groups + extra_groups_for_head_shards(config.mamba_n_groups, tp_size)
    return ConvChannelSplit(
        x_local=_divide(config.mamba_intermediate_size, tp_size, "mamba intermediate_size"),
        b_local=_divide(groups * config.mamba_d_state, tp_size, "n_groups * state_size"),
    )


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, tp_size: int = 1
) -> tuple[int, int, int, int, int]:
    """Paged KV cache of one attention layer on one rank: ``(2, num_blocks, block_size, kv_heads_local, head_dim)``.

    K then V, as vLLM's FlashAttention backend. When ``tp_size > num_kv_heads``
    each rank holds one (replicated) KV head, as vLLM.
    """
    if num_kv_heads >= tp_size:
        kv_local = _divide(num_kv_heads, tp_size, "num_key_value_heads")
    else:
        _divide(tp_size, num_kv_heads, "tensor_parallel_size (as a multiple of num_key_value_heads)")
        kv_local = 1
    return (2, num_blocks, block_size, kv_local, head_dim)
