"""Pallas (Triton backend) kernels for Mamba2 state updates and paged attention, with plain-JAX references.

One kernel per module (``selective_state_update``, ``causal_conv1d_update``,
``causal_conv1d_varlen``, ``ssd_chunk_scan_varlen``, which composes the five
SSD passes of the ``pallas_kernels.ssd`` package, one kernel per module, ``paged_attention_decode``,
``paged_attention_varlen``, and ``grouped_matmul`` for MoE experts), references in the
``pallas_kernels.reference`` package (one module per kernel family plus
``common``), and ``pallas_kernels.dispatch`` with the
``backend="pallas" | "reference"`` entry points the model uses. The model
depends on this package, never the reverse: nothing here imports
``jaxmamba.model`` (``jaxmamba.errors`` and ``jaxmamba.layout`` are shared contracts).

Each kernel module shares its name with its public function. So that every
spelling works -- ``from pallas_kernels import selective_state_update`` then
calling it, ``pallas_kernels.selective_state_update.selective_state_update(...)``
and ``import pallas_kernels.selective_state_update as m`` -- the package
attribute is the module, made callable (calling it calls the function).
"""

import types

from pallas_kernels import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    grouped_matmul,
    paged_attention_decode,
    paged_attention_varlen,
    selective_state_update,
    ssd_chunk_scan_varlen,
)
from pallas_kernels.dispatch import BACKENDS, default_interpret
from pallas_kernels.reference import (
    causal_conv1d_update_reference,
    causal_conv1d_varlen_reference,
    paged_attention_reference,
    selective_state_update_reference,
    ssd_chunk_metadata,
    ssd_chunk_scan_varlen_reference,
)
from pallas_kernels.reference.grouped_matmul import grouped_matmul_reference


class _OpModule(types.ModuleType):
    """A kernel module that can be called like its public function."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rsplit(".", 1)[1])(*args, **kwargs)


for _m in (causal_conv1d_update, causal_conv1d_varlen, grouped_matmul, paged_attention_decode, paged_attention_varlen,
           selective_state_update, ssd_chunk_scan_varlen):
    _m.__class__ = _OpModule
del _m

__all__ = [
    "BACKENDS",
    "causal_conv1d_update",
    "causal_conv1d_update_reference",
    "causal_conv1d_varlen",
    "causal_conv1d_varlen_reference",
    "default_interpret",
    "grouped_matmul",
    "grouped_matmul_reference",
    "paged_attention_decode",
    "paged_attention_reference",
    "paged_attention_varlen",
    "selective_state_update",
    "selective_state_update_reference",
    "ssd_chunk_metadata",
    "ssd_chunk_scan_varlen",
    "ssd_chunk_scan_varlen_reference",
]
