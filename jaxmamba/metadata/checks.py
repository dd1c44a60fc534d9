"""Argument checks and padding helpers shared by the metadata builders (host-side numpy).

Builders read only the first ``num_reqs`` rows of persistent per-request buffers
(``buffer_rows``; docs/architecture.md, Rule 3), name the offending field in every error, and pad real
rows to a bucket with ``pad_rows`` / ``offsets``, so padding never changes a real row.
"""

from __future__ import annotations

import numpy as np

from jaxmamba.errors import MetadataError, SlotError
from jaxmamba.layout import NULL_SLOT, PAD_SLOT_ID


def cdiv(a, b):
    """Ceiling division of ints or integer arrays (the one the builders, the prefix cache and the planner share)."""
    return -(-a // b)


#: ``dtype.kind`` of the integer dtypes (``np.issubdtype(dtype, np.integer)``, without its per-call cost).
INT_KINDS = "iu"
#: ... and of the integer or bool dtypes.
INT_OR_BOOL_KINDS = "iub"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def scalar_arg(name: str, value, minimum: int = 0) -> int:
    """``value`` (an integer or bool, Python or numpy 0-d) as an int ``>= minimum``."""
    if type(value) is int and _INT64_MIN <= value <= _INT64_MAX:  # the common case, without np.asarray
        v = value
    else:
        arr = np.asarray(value)
        if arr.ndim != 0 or arr.dtype.kind not in INT_OR_BOOL_KINDS:
            raise MetadataError(f"{name} must be an integer, got {value!r}")
        v = int(arr)
    if v < minimum:
        raise MetadataError(f"{name}={v} must be >= {minimum}")
    return v


def buffer_rows(name: str, value, num_reqs: int, ndim: int = 1) -> np.ndarray:
    """First ``num_reqs`` rows of a persistent per-request buffer, as int64 (docs/architecture.md, Rule 3)."""
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise MetadataError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in INT_KINDS:
        raise MetadataError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.shape[0] < num_reqs:
        raise MetadataError(f"num_reqs={num_reqs} exceeds the {arr.shape[0]} rows of {name}")
    return arr[:num_reqs].astype(np.int64)


def check_slots(name: str, values: np.ndarray, rows: np.ndarray, cols, num_slots: int | None) -> None:
    """Every slot is ``PAD_SLOT_ID`` or in ``[0, num_slots)`` (interpret mode would clamp: docs/architecture.md,
    "Metadata")."""
    bad = values < PAD_SLOT_ID
    if num_slots is not None:
        bad |= values >= num_slots
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        where = f"row {int(rows[i[0]])}" + (f", column {int(cols[i])}" if cols is not None else "")
        raise SlotError(
            f"{name}[{where}]={int(values[i])} is outside the state pool [0, {num_slots}) and is not PAD_SLOT_ID"
        )


def require_real_slots(name: str, values: np.ndarray, rows: np.ndarray, what: str) -> None:
    """Slots that a real row reads or writes must be real: not PAD, not the null slot."""
    bad = values <= NULL_SLOT
    if bad.any():
        i = int(np.argmax(bad))
        raise SlotError(f"{name} for row {int(rows[i])} is {int(values[i])}, but {what} must be a real slot (>= 1)")


def parse_bucket(bucket) -> tuple[int, int, int | None]:
    """``(R, T)`` or ``(R, T, P)`` -> ``(R, T, P or None)``."""
    try:
        r, t, *rest = bucket
        if len(rest) > 1:
            raise ValueError
    except (TypeError, ValueError):
        raise MetadataError(
            f"bucket={bucket!r} must be (num_reqs_padded, num_tokens_padded[, num_prefills_padded])") from None
    p = scalar_arg("num_prefills_padded", rest[0], 1) if rest else None
    return scalar_arg("num_reqs_padded", r, 1), scalar_arg("num_tokens_padded", t, 0), p


def prefill_rows(num_prefills_padded, num_reqs_padded: int) -> int:
    """``P`` of a bucket: given, or every request row (``R``); never more than ``R``."""
    if num_prefills_padded is None:
        return num_reqs_padded
    p = scalar_arg("num_prefills_padded", num_prefills_padded, 1)
    if p > num_reqs_padded:
        raise MetadataError(f"num_prefills_padded={p} exceeds num_reqs_padded={num_reqs_padded}")
    return p


def pad_rows(values: np.ndarray, length: int, fill, what: str, dtype=None) -> np.ndarray:
    """``values`` extended along axis 0 to ``length`` rows of ``fill``, as ``dtype`` (default: theirs; a
    narrower integer dtype wraps as ``astype`` would)."""
    n = values.shape[0]
    if n > length:
        raise MetadataError(f"bucket too small: {what} needs {n} rows, bucket has {length}")
    out = np.empty((length,) + values.shape[1:], dtype=values.dtype if dtype is None else dtype)
    out[n:] = fill
    out[:n] = values
    return out


def offsets(lengths: np.ndarray, length: int) -> np.ndarray:
    """int32[length+1] exclusive prefix sum of ``lengths``, repeating the total after them."""
    n = lengths.size
    out = np.empty(length + 1, dtype=np.int32)
    out[0] = 0
    out[1 : n + 1] = np.cumsum(lengths)  # summed at the lengths' width, then narrowed (as astype)
    out[n + 1 :] = out[n]
    return out


def as_i32(v) -> np.ndarray:
    return np.asarray(v, dtype=np.int32)


def check_non_negative(name: str, arr: np.ndarray) -> None:
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise MetadataError(f"{name}[{i}]={int(arr[i])} is negative")
