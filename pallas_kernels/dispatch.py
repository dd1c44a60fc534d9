"""Backend dispatch for the four Mamba2 state ops and paged attention: the entry points the model calls.

``backend="pallas"`` runs the Triton-Pallas kernels (compiled on GPU, in the
Pallas interpreter when ``interpret`` is true); ``backend="reference"`` runs the
plain-JAX references. ``interpret=None`` means "interpret when the default JAX
backend is the CPU". Keyword arguments (including block sizes, which the
references ignore) are passed through unchanged, so both backends share one
calling convention.

Index arguments are validated (``SlotError``/``MetadataError``) only when they
are concrete; inside the model's jitted step the metadata builders validate.
"""

from __future__ import annotations

import importlib
from typing import Callable

import jax

from jaxmamba.errors import ConfigError
from pallas_kernels import reference

__all__ = [
    "BACKENDS",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "default_interpret",
    "paged_attention_decode",
    "paged_attention_varlen",
    "selective_state_update",
    "ssd_chunk_scan_varlen",
]

BACKENDS = ("pallas", "reference")


def default_interpret() -> bool:
    """True when Pallas kernels must run in the interpreter (no GPU backend)."""
    return jax.default_backend() == "cpu"


def _pick(backend: str, interpret, op: str, reference_fn: Callable):
    """The function implementing ``op`` on ``backend`` and the extra keyword arguments it takes.

    Kernel modules are imported on first use: ``jaxmamba`` imports this module
    while it initializes, and the kernel modules import ``jaxmamba.layout``.
    """
    if backend == "reference":
        return reference_fn, {}
    if backend == "pallas":
        fn = getattr(importlib.import_module(f"pallas_kernels.{op}"), op)
        return fn, {"interpret": default_interpret() if interpret is None else bool(interpret)}
    raise ConfigError(f"kernel backend={backend!r} must be one of {BACKENDS}")


def selective_state_update(ssm_state, x, dt, A, B, C, D=None, z=None, dt_bias=None, *, backend="pallas",
                           interpret=None, **kwargs):
    """``selective_state_update`` (decode / spec decode); see ``pallas_kernels.selective_state_update``."""
    fn, extra = _pick(backend, interpret, "selective_state_update", reference.selective_state_update_reference)
    return fn(ssm_state, x, dt, A, B, C, D, z, dt_bias, **kwargs, **extra)


def causal_conv1d_update(x, conv_state, weight, bias=None, *, backend="pallas", interpret=None, **kwargs):
    """``causal_conv1d_update`` (decode / spec decode); see ``pallas_kernels.causal_conv1d_update``."""
    fn, extra = _pick(backend, interpret, "causal_conv1d_update", reference.causal_conv1d_update_reference)
    return fn(x, conv_state, weight, bias, **kwargs, **extra)


def causal_conv1d_varlen(x, conv_state, weight, bias=None, *, backend="pallas", interpret=None, **kwargs):
    """``causal_conv1d_varlen`` (prefill); see ``pallas_kernels.causal_conv1d_varlen``."""
    fn, extra = _pick(backend, interpret, "causal_conv1d_varlen", reference.causal_conv1d_varlen_reference)
    return fn(x, conv_state, weight, bias, **kwargs, **extra)


def ssd_chunk_scan_varlen(x, dt, A, B, C, D=None, z=None, dt_bias=None, *, backend="pallas", interpret=None,
                          **kwargs):
    """``ssd_chunk_scan_varlen`` (prefill); see ``pallas_kernels.ssd_chunk_scan_varlen``."""
    fn, extra = _pick(backend, interpret, "ssd_chunk_scan_varlen", reference.ssd_chunk_scan_varlen_reference)
    return fn(x, dt, A, B, C, D, z, dt_bias, **kwargs, **extra)


def paged_attention_decode(q, kv, block_table, query_start_loc, positions, *, scale, backend="pallas",
                           interpret=None, **kwargs):
    """Paged attention for decode steps (flash-decoding); see ``pallas_kernels.paged_attention_decode``."""
    fn, extra = _pick(backend, interpret, "paged_attention_decode", reference.paged_attention_reference)
    return fn(q, kv, block_table, query_start_loc, positions, scale=scale, **kwargs, **extra)


def paged_attention_varlen(q, kv, block_table, query_start_loc, positions, *, scale, backend="pallas",
                           interpret=None, **kwargs):
    """Paged attention for prefill / mixed steps; see ``pallas_kernels.paged_attention_varlen``."""
    fn, extra = _pick(backend, interpret, "paged_attention_varlen", reference.paged_attention_reference)
    return fn(q, kv, block_table, query_start_loc, positions, scale=scale, **kwargs, **extra)
