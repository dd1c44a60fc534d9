"""Metadata pytrees and the one-transfer packing of their int32 leaves.

``CommonAttentionMetadata`` (what every layer reads) and ``MambaMetadata`` (what the Mamba2 mixers read on
top) are frozen dataclasses whose only static fields are the bucket and the configuration; ``pack`` lays
their leaves into one int32 buffer with a static ``PackLayout`` and ``unpack`` slices it back inside the
step. Shape legend and packing: docs/architecture.md, "Step metadata: pytrees and packing".
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmamba.errors import MetadataError


def _register(data_fields: list[str], meta_fields: list[str]):
    def wrap(cls):
        return jax.tree_util.register_dataclass(cls, data_fields=data_fields, meta_fields=meta_fields)

    return wrap


_COMMON_DATA = [
    "query_start_loc",
    "seq_lens",
    "is_prefilling",
    "block_table",
    "slot_mapping",
    "positions",
    "num_reqs",
    "num_actual_tokens",
    "max_query_len",
    "max_seq_len",
    "distribution",
]
_COMMON_META = ["num_reqs_padded", "num_tokens_padded", "block_size", "max_model_len"]


@_register(_COMMON_DATA, _COMMON_META)
@dataclasses.dataclass(frozen=True, eq=False)
class CommonAttentionMetadata:
    """Per-step metadata shared by every layer (as vLLM's ``CommonAttentionMetadata``).

    Padded rows (``num_reqs <= i < R``) have query length 0, ``seq_lens`` 0,
    ``is_prefilling`` False and an all-null (0) block-table row; padded tokens
    have ``slot_mapping`` ``PAD_SLOT_ID`` (-1: "do not write") and position 0.
    """

    # --- data leaves (per batch) ---
    query_start_loc: Any  # int32[R+1]: token offset of each row; padded rows repeat the total
    seq_lens: Any  # int32[R]: num_computed + num_scheduled (0 for padded rows)
    is_prefilling: Any  # bool[R]: num_computed < num_prompt (False for padded rows, Rule 3)
    block_table: Any  # int32[R, B]: attention KV block ids; columns past a row's last block are 0
    slot_mapping: Any  # int32[T]: KV slot (block * block_size + offset) per token; -1 for padding
    positions: Any  # int32[T]: absolute position of each token; 0 for padding
    num_reqs: Any  # int32[]: real rows
    num_actual_tokens: Any  # int32[]: real tokens
    max_query_len: Any  # int32[]: longest real query
    max_seq_len: Any  # int32[]: seq_lens[:num_reqs].max() (max_model_len only when warming up, Rule 4)
    distribution: Any  # int32[3]: (decode_end, prefill_end, total) = (num_decodes, num_reqs, R)
    # --- meta (static: bucket + config) ---
    num_reqs_padded: int  # R
    num_tokens_padded: int  # T
    block_size: int  # attention KV block size (tokens)
    max_model_len: int

    def pack(self) -> "PackedMetadata":
        """``pack(self)``: this metadata alone as one int32 buffer and its layout."""
        return pack(self)


_MAMBA_DATA = [
    "num_reqs",
    "num_decodes",
    "num_prefills",
    "num_decode_tokens",
    "num_prefill_tokens",
    "distribution",
    "query_start_loc_decode",
    "state_indices_decode",
    "state_indices_decode_dst",
    "num_accepted_tokens",
    "query_start_loc_prefill",
    "state_indices_prefill",
    "state_indices_prefill_initial",
    "has_initial_state",
    "block_idx_last_computed_token",
    "block_idx_first_scheduled_token",
    "block_idx_last_scheduled_token",
    "block_idx_last_scheduled_token_prev_step",
    "cu_chunk_seqlens",
    "last_chunk_indices",
    "seq_idx",
    "state_indices_chunk_checkpoint",
]
class CacheMode(enum.StrEnum):
    """vLLM's ``mamba_cache_mode``: how the Mamba states of a prefix are kept (docs/architecture.md, Rule 2).
    ``NONE``: one running slot a request, no prefix caching; ``ALIGN``: a state at each block end the
    scheduler aligns chunks to; ``ALL``: a state at every block end. A ``str``: each member equals, hashes and
    prints as its value, so ``"none"``/``"align"``/``"all"`` from users, configs and tests keep working."""

    NONE = "none"
    ALIGN = "align"
    ALL = "all"

    def __repr__(self) -> str:
        return repr(self.value)  # reprs (error messages, executable-cache keys) read as the plain string


_MAMBA_META = [
    "num_reqs_padded",
    "num_tokens_padded",
    "num_prefills_padded",
    "num_chunks_padded",
    "chunk_size",
    "block_size",
    "num_spec",
    "cache_mode",
]


@_register(_MAMBA_DATA, _MAMBA_META)
@dataclasses.dataclass(frozen=True, eq=False)
class MambaMetadata:
    """What the Mamba2 mixers need (as vLLM's ``Mamba2AttentionMetadata``), padded to a bucket.

    Rows: decodes ``[0, num_decodes)``, prefills ``[num_decodes, num_reqs)`` (docs/architecture.md, Rule 1).
    *Decode-indexed* arrays have one row per batch row (``R``), *prefill-indexed* arrays
    ``P = num_prefills_padded`` rows (row ``j`` is batch row ``num_decodes + j``), *batch-row* arrays
    (``block_idx_*``) follow the batch rows; padding rows point at no slot. Slot arrays hold state-pool
    slots: ``[1, num_slots)`` is real, ``PAD_SLOT_ID`` (-1) or the null slot 0 mean "skip". Decode slots
    have ``K = 1 + num_spec`` columns (source window ``state_indices_decode``, destinations
    ``state_indices_decode_dst``); SSD chunks (``NC`` of them, the last always empty) never cross a
    ``chunk_size`` boundary or a row. The full layout: docs/architecture.md, "MambaMetadata: rows, slots
    and chunks".
    """

    # --- data leaves: counts ---
    num_reqs: Any  # int32[]
    num_decodes: Any  # int32[]: rows [0, num_decodes) take the decode path
    num_prefills: Any  # int32[]: rows [num_decodes, num_reqs) take the prefill (SSD) path
    num_decode_tokens: Any  # int32[]: tokens of the decode rows (they come first)
    num_prefill_tokens: Any  # int32[]
    distribution: Any  # int32[3]: (decode_end, prefill_end, total) = (num_decodes, num_reqs, R)
    # --- decode-indexed ---
    query_start_loc_decode: Any  # int32[R+1]: token offsets of decode rows; repeats num_decode_tokens after
    state_indices_decode: Any  # int32[R, K]: source window (read slot = column num_accepted - 1)
    state_indices_decode_dst: Any  # int32[R, K]: token t's state goes to column t
    num_accepted_tokens: Any  # int32[R]: tokens accepted last step (1 without spec decode; 1 for padding)
    # --- prefill-indexed ---
    query_start_loc_prefill: Any  # int32[P+1]: offsets into the packed prefill tokens (from 0)
    state_indices_prefill: Any  # int32[P]: slot the final state is written to
    state_indices_prefill_initial: Any  # int32[P]: slot the initial state is read from (PAD if none)
    has_initial_state: Any  # bool[P]: num_computed_tokens > 0
    # --- batch-row-indexed Mamba block-table columns (0 in mode none and for padding) ---
    block_idx_last_computed_token: Any  # int32[R]: cdiv(num_computed, block_size) - 1, clamped at 0
    block_idx_first_scheduled_token: Any  # int32[R]: num_computed // block_size
    block_idx_last_scheduled_token: Any  # int32[R]: cdiv(seq_len, block_size) - 1
    block_idx_last_scheduled_token_prev_step: Any  # int32[R]: mode all, decode rows: source window start
    # --- SSD chunks over the packed prefill tokens ---
    cu_chunk_seqlens: Any  # int32[NC+1]: token offset where each chunk starts (last = end)
    last_chunk_indices: Any  # int32[P] (prefill-indexed): each row's last chunk; NC-1 for padding
    seq_idx: Any  # int32[NC]: prefill row of each chunk; P-1 for unused chunks
    state_indices_chunk_checkpoint: Any  # int32[NC]: slot for the state at a block-ending chunk, else -1
    # --- meta (static: bucket + config) ---
    num_reqs_padded: int  # R
    num_tokens_padded: int  # T
    num_prefills_padded: int  # P: rows of the prefill-indexed arrays (<= R)
    num_chunks_padded: int  # NC
    chunk_size: int
    block_size: int  # Mamba block size (tokens per state slot in modes align/all)
    num_spec: int  # speculative tokens per step (num_speculative_blocks)
    cache_mode: CacheMode  # or its value, "none" | "align" | "all"

    @property
    def num_decodes_padded(self) -> int:
        """Rows of the decode-indexed arrays: every request row of the bucket can be a decode."""
        return self.num_reqs_padded

    def pack(self) -> "PackedMetadata":
        """``pack(self)``: this metadata alone as one int32 buffer and its layout."""
        return pack(self)


METADATA_CLASSES = (CommonAttentionMetadata, MambaMetadata)
_DATA_FIELDS = {CommonAttentionMetadata: tuple(_COMMON_DATA), MambaMetadata: tuple(_MAMBA_DATA)}
_META_FIELDS = {CommonAttentionMetadata: tuple(_COMMON_META), MambaMetadata: tuple(_MAMBA_META)}


@dataclasses.dataclass(frozen=True)
class FieldSlot:
    """Where one leaf lives in the packed buffer."""

    name: str
    offset: int
    shape: tuple[int, ...]
    is_bool: bool

    @functools.cached_property
    def size(self) -> int:
        # Cached: ``unpack`` reads it for every leaf of every trace, ``pack`` for every leaf it lays out.
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Static description of a packed buffer: hashable, usable as a jit static argument.

    ``entries`` holds, per packed metadata object, its class, its meta
    (static) field values, and where each data leaf lives. ``separate`` names
    the leaves that travel outside the buffer, with their shapes.
    """

    entries: tuple[tuple[type, tuple[tuple[str, Any], ...], tuple[FieldSlot, ...]], ...]
    size: int
    separate: tuple[tuple[str, tuple[int, ...]], ...] = ()


class PackedMetadata(NamedTuple):
    buffer: np.ndarray  # int32[layout.size]: every leaf, flattened, back to back
    layout: PackLayout
    separate: dict[str, np.ndarray] = {}  # int32 leaves left out of the buffer, by name


class _PackPlan(NamedTuple):
    """What ``pack`` derives from the classes, meta values, leaf shapes/dtypes and ``separate`` names alone."""

    layout: PackLayout
    packed: tuple[int, ...]  # indices (into the flat leaf list) of the leaves in the buffer, in buffer order
    apart: tuple[tuple[str, int], ...]  # (name, flat leaf index) of each separate leaf


# Plans by signature: a serving engine packs a handful of buckets' shapes, so this stays small (bounded anyway).
_PACK_PLANS: dict[tuple, _PackPlan] = {}
_MAX_PACK_PLANS = 1024


def _pack_plan(metadatas, values: list[np.ndarray], separate: tuple[str, ...]) -> _PackPlan:
    """Check the leaves' dtypes and the ``separate`` names, and lay the buffer out (once per signature)."""
    entries = []
    packed: list[int] = []
    apart: dict[str, int] = {}
    offset = 0
    index = 0
    for md in metadatas:
        cls = type(md)
        slots = []
        for name in _DATA_FIELDS[cls]:
            value = values[index]
            if name in separate:
                if name in apart:
                    raise MetadataError(f"pack: separate leaf {name!r} is in more than one metadata object")
                if value.dtype.kind not in "iu":
                    raise MetadataError(f"pack: separate leaf {name!r} must be an integer array, got {value.dtype}")
                apart[name] = index
            else:
                is_bool = value.dtype == np.bool_
                if not is_bool and value.dtype.kind not in "iu":
                    raise MetadataError(f"pack: {cls.__name__}.{name} has dtype {value.dtype}, expected int32/bool")
                slot = FieldSlot(name, offset, tuple(int(d) for d in value.shape), bool(is_bool))
                slots.append(slot)
                packed.append(index)
                offset += slot.size
            index += 1
        meta = tuple((name, getattr(md, name)) for name in _META_FIELDS[cls])
        entries.append((cls, meta, tuple(slots)))
    missing = set(separate) - set(apart)
    if missing:
        raise MetadataError(f"pack: separate leaves {sorted(missing)} are not data leaves of the given metadata")
    shapes = tuple((name, tuple(int(d) for d in values[i].shape)) for name, i in apart.items())
    return _PackPlan(PackLayout(tuple(entries), offset, shapes), tuple(packed), tuple(apart.items()))


def pack(*metadatas, separate: tuple[str, ...] = ()) -> PackedMetadata:
    """Flatten the leaves of ``metadatas`` into one int32 host buffer (bools as 0/1); the leaves named in
    ``separate`` are returned apart, as int32 arrays (each name must be a data leaf of exactly one object).

    The layout (and the dtype checks) depend only on the classes, meta values, leaf shapes and dtypes, and
    ``separate``: they are worked out once per such signature; a call then only copies the leaves."""
    if not metadatas:
        raise MetadataError("pack needs at least one metadata object")
    values = []
    for md in metadatas:
        fields = _DATA_FIELDS.get(type(md))
        if fields is None:
            raise MetadataError(f"pack: {type(md).__name__} is not a metadata pytree")
        values.extend(np.asarray(getattr(md, name)) for name in fields)
    separate = tuple(separate)
    # Meta values with their types: 4, np.int64(4) and 4.0 are equal keys but must keep their own layouts.
    meta = tuple((type(md), *((type(v), v) for v in (getattr(md, name) for name in _META_FIELDS[type(md)])))
                 for md in metadatas)
    key = (meta, tuple((v.shape, v.dtype) for v in values), separate)
    try:
        plan = _PACK_PLANS.get(key)
    except TypeError:  # an unhashable meta value: lay out without caching
        key, plan = None, None
    if plan is None:
        plan = _pack_plan(metadatas, values, separate)
        if key is not None:
            if len(_PACK_PLANS) >= _MAX_PACK_PLANS:
                _PACK_PLANS.clear()
            _PACK_PLANS[key] = plan
    if plan.packed:
        # One copy; bools become 0/1 and integers wrap to int32 exactly as ``astype(np.int32)``.
        buffer = np.concatenate([values[i].reshape(-1) for i in plan.packed], dtype=np.int32, casting="unsafe")
    else:
        buffer = np.zeros((0,), np.int32)
    apart = {name: values[i].astype(np.int32, copy=False) for name, i in plan.apart}
    return PackedMetadata(buffer, plan.layout, apart)


def unpack(buffer, layout: PackLayout, **separate) -> tuple:
    """Inverse of ``pack``: slice ``buffer`` (numpy or jax, int32[layout.size]) back into pytrees.

    Inside ``jax.jit`` pass ``layout`` as a static argument; the slices are
    static, so this costs no gathers. The leaves packed apart are given by name
    (``block_table=...``). Returns a tuple, one object per packed one.
    """
    if tuple(buffer.shape) != (layout.size,):
        raise MetadataError(f"unpack: buffer has shape {tuple(buffer.shape)}, layout expects ({layout.size},)")
    expected = dict(layout.separate)
    if set(separate) != set(expected):
        raise MetadataError(f"unpack: the layout's separate leaves are {sorted(expected)}, got {sorted(separate)}")
    for name, value in separate.items():
        if tuple(value.shape) != expected[name]:
            raise MetadataError(f"unpack: {name} has shape {tuple(value.shape)}, layout expects {expected[name]}")
    out = []
    for cls, meta, slots in layout.entries:
        kwargs = dict(meta)
        for slot in slots:
            value = buffer[slot.offset : slot.offset + slot.size].reshape(slot.shape)
            kwargs[slot.name] = value != 0 if slot.is_bool else value
        for name in _DATA_FIELDS[cls]:
            if name in separate:
                kwargs[name] = separate[name]
        out.append(cls(**kwargs))
    return tuple(out)


def to_numpy(md):
    """A copy of ``md`` whose leaves are host numpy arrays (e.g. after a device round trip)."""
    return jax.tree_util.tree_map(np.asarray, md)
