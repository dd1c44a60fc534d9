"""Batch classification: which rows are decodes, which are prefills, and in what order.

Host-side numpy only (no JAX). Semantics follow vLLM 0.33:

* ``split_decodes_and_prefills`` -- ``vllm.v1.attention.backends.utils`` of the
  same name, on plain arrays instead of a ``CommonAttentionMetadata``.
* ``reorder_batch`` -- the permutation that ``reorder_batch_to_split_decodes_and_prefills``
  realises with swaps (decode -> short extend -> long extend -> prefill).
* ``mamba_is_prefilling`` -- Rule 1 of docs/architecture.md, as ``BaseMambaAttentionMetadataBuilder`` applies it.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass

import numpy as np

from jaxmamba.errors import MetadataError
from jaxmamba.metadata.checks import INT_OR_BOOL_KINDS, check_non_negative

# Regions of vLLM's reorder, in the order the batch must list them.
REGION_DECODE = 0  # not prefilling, query_len <= threshold, has context
REGION_SHORT_EXTEND = 1  # still prefilling, query_len <= threshold, has context
REGION_LONG_EXTEND = 2  # has context, query_len > threshold
REGION_PREFILL = 3  # no context yet (num_computed_tokens == 0): a first chunk
REGION_NAMES = ("decode", "short extend", "long extend", "prefill")


def _int_vector(name: str, values, length: int | None = None) -> np.ndarray:
    """``values`` as a 1-D int64 array (int64 so sums never overflow on the host)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise MetadataError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in INT_OR_BOOL_KINDS:
        raise MetadataError(f"{name} must hold integers, got dtype {arr.dtype}")
    if length is not None and arr.shape[0] != length:
        raise MetadataError(f"{name} has {arr.shape[0]} rows, expected {length}")
    return arr.astype(np.int64)


def _bool_vector(name: str, values, length: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.shape[0] != length:
        raise MetadataError(f"{name} must have shape ({length},), got {arr.shape}")
    if arr.size and arr.dtype.kind not in INT_OR_BOOL_KINDS:
        raise MetadataError(f"{name} must be bool, got dtype {arr.dtype}")
    return arr.astype(bool)


def split_decodes_and_prefills(
    query_lens,
    is_prefilling=None,
    decode_threshold: int = 1,
    treat_short_extends_as_decodes: bool = True,
    require_uniform: bool = False,
) -> tuple[int, int, int, int]:
    """Boundary between the leading decode rows and the prefill rows (as vLLM).

    Args:
      query_lens: int[num_reqs], tokens scheduled per real row (no padded rows),
        rows already ordered decodes first.
      is_prefilling: bool[num_reqs] or None; required when
        ``treat_short_extends_as_decodes`` is False (rows still in their prompt
        count as prefills whatever their query length -- Mamba's choice).
      decode_threshold: the longest query that can be a decode (``1 + num_spec``
        under speculative decoding).
      require_uniform: as vLLM: decodes must all share the first row's length.

    Returns ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)``
    as Python ints. As in vLLM, every row from the first prefill on counts as a
    prefill; the order itself is checked by the builders, not here.
    """
    q = _int_vector("query_lens", query_lens)
    check_non_negative("query_lens", q)
    num_reqs = int(q.shape[0])
    num_tokens = int(q.sum())
    if num_reqs == 0:
        return 0, 0, 0, 0
    prefilling = None
    if is_prefilling is not None:
        prefilling = _bool_vector("is_prefilling", is_prefilling, num_reqs)
    if not treat_short_extends_as_decodes and prefilling is None:
        raise MetadataError("is_prefilling is required when treat_short_extends_as_decodes=False")

    # vLLM's fast path: every query is short -> all decodes (only when short
    # extends count as decodes; Mamba must look at is_prefilling).
    if (
        int(q.max()) <= decode_threshold
        and (not require_uniform or decode_threshold <= 1)
        and treat_short_extends_as_decodes
    ):
        return num_reqs, 0, num_tokens, 0
    if int(q[0]) > decode_threshold:
        return 0, num_reqs, 0, num_tokens

    if require_uniform:
        # Padded uniform batches (length-0 rows) count as all-decode, as in vLLM.
        if treat_short_extends_as_decodes and bool(np.all((q == q[0]) | (q == 0))):
            return num_reqs, 0, num_tokens, 0
        is_prefill = (q != q[0]) & (q != 0)
        if not treat_short_extends_as_decodes:
            is_prefill = is_prefill | prefilling
        first_prefill = _first_true(is_prefill)
    else:
        first_prefill = num_leading_decodes(q, None if treat_short_extends_as_decodes else prefilling,
                                            decode_threshold)
    num_decode_tokens = int(q[:first_prefill].sum())
    return first_prefill, num_reqs - first_prefill, num_decode_tokens, num_tokens - num_decode_tokens


def _first_true(mask: np.ndarray) -> int:
    """Index of the first True of a 1-D bool array; its length when there is none."""
    i = int(mask.argmax()) if mask.size else 0
    return i if mask.size and mask[i] else mask.size


def num_leading_decodes(query_lens: np.ndarray, is_prefilling: np.ndarray | None, decode_threshold: int) -> int:
    """``split_decodes_and_prefills(...)[0]`` (``require_uniform=False``) for arrays already checked.

    Rows before the first one with ``query_len > decode_threshold`` (or, when
    ``is_prefilling`` is given, still prefilling -- Mamba's split) are decodes.
    Args: int[n] (non-negative), bool[n] or None. Unchecked: the builders call it on their validated rows.
    """
    is_prefill = query_lens > decode_threshold
    if is_prefilling is not None:
        is_prefill |= is_prefilling
    return _first_true(is_prefill)


def mamba_is_prefilling(is_prefilling, query_lens, seq_lens, num_draft_tokens=None) -> np.ndarray:
    """``is_prefilling`` as the Mamba builder sees it (docs/architecture.md, Rule 1; as vLLM 0.33).

    A row that is still prefilling but has prior Mamba state (``seq_len >
    query_len``, i.e. some tokens already computed -- for a one-token row that
    is ``seq_len > 1``) and schedules exactly one token is a **decode**: the
    decode path computes token N from ``h(N-1)`` exactly as the prefill path
    would, and a uniform one-token batch must be able to run the decode-only
    program (the P/D disaggregation recompute row, or a final one-token prompt
    chunk). A one-token row with ``seq_len == 1`` has no state and stays a prefill.

    With speculative decoding, ``num_draft_tokens`` (int[num_reqs], -1 = none)
    marks prompt tails padded with placeholder drafts (``query_len ==
    num_draft + 1``): those run as speculative decodes too, as in vLLM.

    Args/returns: bool[num_reqs], int[num_reqs], int[num_reqs] (real rows only)
    -> a new bool[num_reqs] array (the input is not modified).
    """
    q = _int_vector("query_lens", query_lens)
    n = q.shape[0]
    seq = _int_vector("seq_lens", seq_lens, n)
    prefilling = _bool_vector("is_prefilling", is_prefilling, n)
    check_query_and_seq_lens(q, seq)
    drafts = None if num_draft_tokens is None else _int_vector("num_draft_tokens", num_draft_tokens, n)
    return mamba_prefilling_rows(prefilling, q, seq, drafts)


def check_query_and_seq_lens(query_lens: np.ndarray, seq_lens: np.ndarray) -> None:
    """``0 <= query_lens <= seq_lens`` (int[n] each), else ``MetadataError`` naming the first bad row."""
    check_non_negative("query_lens", query_lens)
    short = seq_lens < query_lens
    if short.any():
        i = int(np.argmax(short))
        raise MetadataError(
            f"seq_lens[{i}]={int(seq_lens[i])} is smaller than query_lens[{i}]={int(query_lens[i])}")


def mamba_prefilling_rows(is_prefilling: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray,
                          num_draft_tokens: np.ndarray | None = None) -> np.ndarray:
    """``mamba_is_prefilling`` for arrays already checked (bool[n], int[n] with ``seq_lens >= query_lens >=
    0``, int[n] or None): the builders call it on their validated rows. Returns a new bool[n] array."""
    stateful_prefill = is_prefilling & (seq_lens > query_lens)
    to_decode = query_lens == 1
    if num_draft_tokens is not None:
        to_decode |= (num_draft_tokens >= 0) & (query_lens == num_draft_tokens + 1)
    to_decode &= stateful_prefill
    return is_prefilling & ~to_decode


def batch_regions(query_lens, num_computed_tokens, is_prefilling, decode_threshold: int = 1) -> np.ndarray:
    """vLLM's reorder region of each row (int32[num_reqs], values ``REGION_*``).

    decode: has context, ``query_len <= threshold``, done prefilling;
    short extend: has context, ``query_len <= threshold``, still prefilling;
    long extend: has context, ``query_len > threshold``; prefill: no context.
    """
    q = _int_vector("query_lens", query_lens)
    n = q.shape[0]
    computed = _int_vector("num_computed_tokens", num_computed_tokens, n)
    prefilling = _bool_vector("is_prefilling", is_prefilling, n)
    return region_rows(q, computed, prefilling, decode_threshold)


def region_rows(query_lens: np.ndarray, num_computed_tokens: np.ndarray, is_prefilling: np.ndarray,
                decode_threshold: int) -> np.ndarray:
    """``batch_regions`` for arrays already checked (int[n], int[n], bool[n]): int32[n]."""
    regions = np.where(query_lens <= decode_threshold, is_prefilling.astype(np.int32), np.int32(REGION_LONG_EXTEND))
    regions[num_computed_tokens <= 0] = REGION_PREFILL
    return regions


def all_decode_rows(query_lens: np.ndarray, num_computed_tokens: np.ndarray, is_prefilling: np.ndarray,
                    decode_threshold: int) -> bool:
    """Every row is in the decode region (done prefilling, has context, ``query_len <= decode_threshold``):
    then any order is vLLM's and ``reorder_batch`` returns the identity. Arrays already checked (int[n],
    int[n], bool[n]); True for an empty batch."""
    # One pass over the rows: this runs every step (batch_order).
    return not (is_prefilling | (query_lens > decode_threshold) | (num_computed_tokens <= 0)).any()


def reorder_batch(
    query_lens, is_prefilling, seq_lens, decode_threshold: int = 1, num_draft_tokens=None
) -> np.ndarray:
    """Permutation that puts a batch in the order the builders require.

    Order: decodes, then short extends, then long extends, then first-chunk
    prefills (vLLM's four regions, with ``decode_threshold = 1 + num_spec``
    under speculative decoding). Inside the short-extend region, rows that the
    Mamba builder turns into decodes (docs/architecture.md, Rule 1: one token with prior state, or a
    draft-padded prompt tail) come first, so Mamba's decodes stay a prefix.
    Otherwise the sort is stable (rows keep their relative order).

    Args: int[n], bool[n], int[n] for the real rows (``seq_len`` = computed +
    scheduled). Returns int64[n] ``perm``: new row ``i`` is old row ``perm[i]``
    (apply as ``x_new = x_old[perm]``).
    """
    q = _int_vector("query_lens", query_lens)
    seq = _int_vector("seq_lens", seq_lens, q.shape[0])
    prefilling = _bool_vector("is_prefilling", is_prefilling, q.shape[0])
    check_query_and_seq_lens(q, seq)
    drafts = None if num_draft_tokens is None else _int_vector("num_draft_tokens", num_draft_tokens, q.shape[0])
    order = batch_order(q, seq - q, prefilling, decode_threshold, drafts)
    return np.arange(q.shape[0]) if order is None else order


def batch_order(query_lens: np.ndarray, num_computed_tokens: np.ndarray, is_prefilling: np.ndarray,
                decode_threshold: int, num_draft_tokens: np.ndarray | None = None) -> np.ndarray | None:
    """``reorder_batch`` for arrays already checked (int[n] with ``0 <= query_lens``, ``0 <=
    num_computed_tokens``, bool[n], int[n] or None), or None where its order is the identity (every row a
    decode, the steady state: one region, one sub-key, so the stable sort keeps the order; or rows already
    in the builders' order)."""
    if all_decode_rows(query_lens, num_computed_tokens, is_prefilling, decode_threshold):
        return None
    return _sorted_rows(query_lens, num_computed_tokens, is_prefilling, decode_threshold, num_draft_tokens)[0]


def _sorted_rows(query_lens: np.ndarray, num_computed_tokens: np.ndarray, is_prefilling: np.ndarray,
                 decode_threshold: int, num_draft_tokens: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray]:
    """``(order, mamba_prefill)``: ``batch_order``'s stable sort (int64[n]; None where the rows are in order
    already, which a serving step's usually are: decodes, the running prompt, then admissions) and
    ``mamba_prefilling_rows`` of the rows in scheduler order (bool[n]), which the sort keys on."""
    q, computed = query_lens, num_computed_tokens
    regions = region_rows(q, computed, is_prefilling, decode_threshold).astype(np.int64)
    mamba_prefill = mamba_prefilling_rows(is_prefilling, q, computed + q, num_draft_tokens)
    # Sub-key inside a region: 0 for rows Mamba reclassifies as decodes (prefilling, not a Mamba prefill), else 1.
    key = regions * 2 + (mamba_prefill | ~is_prefilling)
    if bool((key[1:] >= key[:-1]).all()):
        return None, mamba_prefill  # a stable sort of sorted keys is the identity
    return np.argsort(key, kind="stable"), mamba_prefill


def check_batch_order(query_lens, num_computed_tokens, is_prefilling, decode_threshold: int = 1) -> None:
    """Raise ``MetadataError`` unless rows follow vLLM's region order.

    The builders rely on decode rows being a prefix of the batch (docs/architecture.md, "Metadata");
    a decode listed after a prefill would silently run through the prefill path
    in one backend and the decode path in another.
    """
    check_region_order(batch_regions(query_lens, num_computed_tokens, is_prefilling, decode_threshold))


def check_region_order(regions: np.ndarray) -> None:
    """``check_batch_order`` on ``region_rows``' output."""
    if regions.size > 1:
        bad = np.nonzero(regions[1:] < regions[:-1])[0]
        if bad.size:
            i = int(bad[0]) + 1
            raise MetadataError(
                f"batch order: row {i} is a {REGION_NAMES[regions[i]]} after row {i - 1}, a "
                f"{REGION_NAMES[regions[i - 1]]} (rows must be decodes, short extends, long extends, "
                f"prefills; use reorder_batch)"
            )


@dataclass(frozen=True)
class BatchSplit:
    """A batch's classification, worked out once per step (``split_batch``).

    ``order``: ``reorder_batch``'s permutation (new row ``i`` is scheduler row ``order[i]``), None where it is
    the identity; ``num_decodes``: the leading rows, in that order, that the Mamba builder runs as decodes
    (``num_leading_decodes`` over ``mamba_prefilling_rows``); ``decode_only``: every row such a decode with
    context (a pure-decode bucket may run the batch); ``draft_counts``: ``draft_counts(drafts)`` in that order
    (None without drafts)."""

    order: np.ndarray | None  # int64[n]
    num_decodes: int
    decode_only: bool
    draft_counts: np.ndarray | None = None  # int32[n]


def draft_counts(drafts: np.ndarray) -> np.ndarray:
    """The builders' ``num_decode_draft_tokens`` of rows verifying ``drafts`` (int[n], 0 = none): int32[n],
    -1 where a row verifies none."""
    return np.where(drafts > 0, drafts, -1).astype(np.int32, copy=False)


def split_batch(computed: np.ndarray, scheduled: np.ndarray, prompt: np.ndarray, drafts: np.ndarray | None,
                decode_threshold: int) -> BatchSplit:
    """``BatchSplit`` of rows in scheduler order, arrays already checked (int[n] each, non-negative): computed
    tokens, tokens scheduled, prompt tokens (a row is prefilling while ``computed < prompt``), drafts verified
    (None: none; 0 = none in a row). It sorts the rows as ``batch_order`` (drafts left out of the order, as
    vLLM), then ``mamba_prefilling_rows`` (drafts in: without drafts it is the sort's own, reordered) and
    ``num_leading_decodes`` in that order, once a step. The caller checks ``all_decode_rows`` first (its
    order is then the identity)."""
    is_prefilling = computed < prompt
    order, mamba_prefill = _sorted_rows(scheduled, computed, is_prefilling, decode_threshold, None)
    if order is not None:  # else already in the builders' order: nothing to gather
        computed, scheduled, is_prefilling = computed[order], scheduled[order], is_prefilling[order]
        mamba_prefill = mamba_prefill[order]
        drafts = None if drafts is None else drafts[order]
    counts = None if drafts is None else draft_counts(drafts)
    if counts is not None:
        mamba_prefill = mamba_prefilling_rows(is_prefilling, scheduled, computed + scheduled, counts)
    num_decodes = num_leading_decodes(scheduled, mamba_prefill, decode_threshold)
    decode_only = num_decodes == len(computed) and bool(computed.min(initial=1) > 0)
    return BatchSplit(order, num_decodes, decode_only, counts)


def split_rows(computed: list[int], scheduled: list[int], prompt: list[int], decode_threshold: int) -> BatchSplit:
    """``split_batch`` without drafts, of rows given as Python lists of ints (``order`` then a list, None for the
    identity), with every decode-only batch (``all_decode_rows``) answered first.

    A step's rows are a few hundred at most, and their classification is a few comparisons each: on such
    lists Python's builtins (``max``, ``min``, ``map`` over ``operator``'s comparisons) and one comprehension cost less
    than numpy's calls on arrays this small, and stay cheap where a CPU device's step has just evicted
    numpy's code and tables from the host's caches (each numpy call then costs several microseconds;
    BENCHMARKS.md, "Session 30"). The sort key is ``_sorted_rows``': twice vLLM's region, plus one unless the
    Mamba builder turns a prefilling row into a decode (Rule 1: one token with prior state)."""
    n = len(computed)
    if not n or (max(scheduled) <= decode_threshold and min(computed) > 0 and all(map(operator.ge, computed, prompt))):
        return BatchSplit(None, n, True)
    # region * 2 + sub-key: decode 1; short extend 3, or 2 when one token with prior state (Rule 1: a decode
    # for Mamba); long extend 5; prefill (no context) 7.
    keys = [7 if c <= 0 else 5 if q > decode_threshold else 1 if c >= p else 2 if q == 1 else 3
            for c, q, p in zip(computed, scheduled, prompt, strict=True)]
    order = None
    if any(map(operator.lt, keys[1:], keys)):
        order = sorted(range(n), key=keys.__getitem__)  # stable, as _sorted_rows' argsort
        keys = [keys[i] for i in order]
    # Mamba's decodes: the rows before the first with more than decode_threshold tokens or a Mamba prefill (still
    # prefilling, unless one token with prior state). Keys 1 and 2 are decodes, 3 and 5 never; a 7 (no context)
    # is one unless done prefilling (no prompt: the builders refuse it) with few enough tokens.
    num_decodes = bisect.bisect_left(keys, 3)
    while num_decodes < n and keys[num_decodes] == 7:
        i = num_decodes if order is None else order[num_decodes]
        if scheduled[i] > decode_threshold or computed[i] < prompt[i]:
            break
        num_decodes += 1
    return BatchSplit(order, num_decodes, num_decodes == n and min(computed) > 0)
