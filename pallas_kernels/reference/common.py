"""Shared slot conventions, numeric helpers and argument validation of the reference kernels.

Plain ``jnp`` only: the Pallas kernels call ``softplus``, ``silu`` and ``next_pow2``
inside their bodies, and every reference and kernel wrapper validates concrete
index arrays with the ``check_*`` functions (no-ops on tracers under ``jit``).
``segment_sum`` serves the SSD reference and the model's whole-sequence SSD
(``jaxmamba.model.ops`` imports it from here: the model may depend on the
kernels, never the reverse).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.errors import JaxMambaError, MetadataError, SlotError
from jaxmamba.layout import NULL_SLOT, PAD_SLOT_ID

_F32 = jnp.float32


# ----------------------------------------------------------------------------
# Small numeric helpers (also used inside the Pallas kernels: plain jnp only)
# ----------------------------------------------------------------------------


def softplus(v):
    """torch/vLLM softplus with threshold 20: ``v`` above 20, else ``log1p(exp(v))``."""
    return jnp.where(v > 20.0, v, jnp.log1p(jnp.exp(jnp.minimum(v, 20.0))))


def silu(v):
    return v / (1.0 + jnp.exp(-v))


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def process_dt(dt, dt_bias, dt_softplus: bool, dt_limit=(0.0, math.inf)):
    """``dt (+ dt_bias)``, softplus, clamp to ``dt_limit`` (float32)."""
    dt = dt.astype(_F32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(_F32)
    if dt_softplus:
        dt = softplus(dt)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    if lo > 0.0 or hi < math.inf:
        dt = jnp.clip(dt, lo, hi)
    return dt


def slot_usable(index, num_slots: int, pad_slot_id: int = PAD_SLOT_ID):
    """True where ``index`` names a real slot (not PAD, not the null slot, in range)."""
    index = jnp.asarray(index)
    return (index != pad_slot_id) & (index > NULL_SLOT) & (index < num_slots)


def take_rows(a, index):
    """``a[index]`` along axis 0, for an integer ``index`` array that is in ``[0, a.shape[0])`` by construction
    (clipped, or a slot mapped to a usable one). jnp's ``a[index]`` also wraps negative entries and masks the
    gather, a handful of HLO instructions more per use, in every layer of every step program: a restore
    costs ~37 us per instruction (docs/architecture.md, "What a restore costs"). Same values for such indices."""
    return jnp.take(a, index, axis=0, mode="clip")


def take_along(a, index, axis: int):
    """``jnp.take_along_axis`` for an ``index`` in range by construction, without the default mode's bounds
    masks (20 HLO instructions fewer per use); same values for such indices."""
    return jnp.take_along_axis(a, index, axis=axis, mode="promise_in_bounds")


def kernel_slots(index, num_slots: int, pad_slot_id: int = PAD_SLOT_ID):
    """Map an index array to the kernels' convention: a usable slot, or -1 (skip)."""
    index = jnp.asarray(index, jnp.int32)
    return jnp.where(slot_usable(index, num_slots, pad_slot_id), index, -1).astype(jnp.int32)


def segment_sum(x: jax.Array) -> jax.Array:
    """``out[..., i, j] = sum(x[..., j+1 : i+1])`` for ``i >= j``, ``-inf`` above the diagonal.

    ``x (..., q)`` -> ``(..., q, q)``, in ``x.dtype``. Built by a masked cumsum (no
    difference of cumsums, which cancels catastrophically).
    """
    q = x.shape[-1]
    rep = jnp.broadcast_to(x[..., None], (*x.shape, q))  # [..., i(src), j] = x[i]
    strictly_lower = jnp.tril(jnp.ones((q, q), bool), -1)
    rep = jnp.where(strictly_lower, rep, 0.0)
    seg = jnp.cumsum(rep, axis=-2)
    return jnp.where(jnp.tril(jnp.ones((q, q), bool), 0), seg, -jnp.inf)


# ----------------------------------------------------------------------------
# Validation of concrete index arrays (skipped under jit: the caller validates)
# ----------------------------------------------------------------------------


def concrete(a):
    """``a`` as a numpy array when its value is known now, else None (traced under jit)."""
    if a is None or isinstance(a, getattr(jax.core, "Tracer", ())):
        return None
    try:
        return np.asarray(a)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_slots(name: str, index, num_slots: int, pad_slot_id: int) -> None:
    """Raise ``SlotError`` if a concrete index array has an entry outside
    ``[0, num_slots)`` that is not ``pad_slot_id`` (the null slot 0 is allowed)."""
    a = concrete(index)
    if a is None:
        return
    bad = (a != pad_slot_id) & ((a < 0) | (a >= num_slots))
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise SlotError(
            f"{name}{list(pos)} = {int(a[pos])} is out of range: slots are [0, {num_slots}) "
            f"and pad_slot_id={pad_slot_id}"
        )


def check_query_start_loc(name: str, qsl, num_tokens: int) -> None:
    """Raise ``MetadataError`` unless a concrete ``qsl`` is non-decreasing within ``[0, num_tokens]``."""
    a = concrete(qsl)
    if a is None:
        return
    if a.ndim != 1 or a.shape[0] < 1:
        raise MetadataError(f"{name} must be 1-D with batch+1 entries, got shape {a.shape}")
    if (a < 0).any() or (a > num_tokens).any():
        raise MetadataError(f"{name}={a.tolist()} has entries outside [0, {num_tokens}] (num_tokens)")
    if (np.diff(a) < 0).any():
        raise MetadataError(f"{name}={a.tolist()} is not non-decreasing")


def check_range(name: str, values, lo: int, hi: int, where=None) -> None:
    """Raise ``MetadataError`` if a concrete array has entries outside ``[lo, hi]`` (where ``where``)."""
    a = concrete(values)
    if a is None:
        return
    bad = (a < lo) | (a > hi)
    w = concrete(where)
    if w is not None:
        bad &= w.astype(bool)
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise MetadataError(f"{name}{list(i)} = {int(a[i])} is outside [{lo}, {hi}]")


def shape_error(msg: str) -> JaxMambaError:
    return JaxMambaError(msg)


def expand_groups(v, H):
    """(..., G, N) -> (..., H, N): head h uses group h // (H // G) (as vLLM)."""
    G = v.shape[-2]
    return jnp.repeat(v, H // G, axis=-2)
