"""The tokens a step reads: each row's known tokens and drafts (``token_inputs``) and the positions whose
logits verify them (``draft_inputs``), as ``ModelRunner._inputs`` packs them into the step's int buffer."""

from __future__ import annotations

import itertools

import numpy as np

from jaxmamba.buckets import Bucket
from jaxmamba.engine.step_rows import StepRows
from jaxmamba.errors import SlotError

#: ``draft_inputs``' draft buffer without spec decode (int32[0]: read, never written).
_NO_DRAFTS = np.zeros(0, np.int32)
_NO_DRAFTS.setflags(write=False)


def token_inputs(bucket: Bucket, rows: StepRows, prev, num_spec: int) -> tuple[np.ndarray, np.ndarray, object]:
    """``(token_ids, prev_token_rows, prev)``: the step's input tokens (``int32[bucket.num_tokens]``, each row's
    known tokens then its drafts), and for rows whose last token a dispatched step sampled and the host has
    not read back (a placeholder: 0 in ``token_ids``), that step (``prev``: the last dispatched step, a
    ``runner.InFlightStep``, or None) and the row it sampled it in (``prev_token_rows``,
    ``int32[bucket.num_reqs]``, -1 elsewhere); ``prev`` comes back None when no row reads it."""
    token_ids = np.zeros(bucket.num_tokens, np.int32)
    prev_token_rows = np.empty(bucket.num_reqs, np.int32)
    prev_token_rows.fill(-1)
    n, reqs = len(rows.ids), rows.reqs
    if rows.num_tokens == n and prev is not None and rows.ids == prev.rows.ids and \
            (rows.num_known <= rows.computed).all():
        # Async decoding's steady state: one token a row, none known on the host, each sampled in the same row of
        # the last dispatched step (the same requests in the same order; list equality tests identity first).
        prev_token_rows[:n] = np.arange(n, dtype=np.int32)
        return token_ids, prev_token_rows, prev
    known = rows.scheduled - rows.drafts
    # Tokens of each row's known span the host does not hold yet (outputs still on the device; past a
    # multi-step window the row starts beyond the tokens read back). Only its last may be missing.
    missing = known - np.minimum(np.maximum(rows.num_known - rows.computed, 0), known)  # np.clip's wrapper costs ~10 us
    if not missing.any():
        token_ids[: rows.num_tokens] = np.fromiter(
            itertools.chain.from_iterable(
                req.token_ids(c, c + k) + req.draft_token_ids[:d]
                for req, c, k, d in zip(reqs, rows.computed.tolist(), known.tolist(), rows.drafts.tolist(),
                                        strict=True)),
            np.int32, rows.num_tokens)
        return token_ids, prev_token_rows, None
    row_in_prev = ({} if prev is None else prev.batch_rows).get
    missing_rows = np.flatnonzero(missing).tolist()
    ids = rows.ids
    sampled_in = [row_in_prev(ids[i]) for i in missing_rows]
    if None in sampled_in or missing.max() > 1:
        i = next(i for i, row in zip(missing_rows, sampled_in, strict=True) if missing[i] > 1 or row is None)
        raise SlotError(f"request {ids[i]!r}: {int(missing[i])} of its scheduled tokens are not known and "
                        "the last dispatched step did not sample them")
    prev_token_rows[missing_rows] = sampled_in
    if rows.num_tokens == n and len(missing_rows) == n:  # every token on the device, rows moved since prev
        return token_ids, prev_token_rows, prev
    # Each row's known span starts with the tokens the host holds; its missing last token stays 0. Only the
    # rows with host tokens (prompt chunks, mostly) and with drafts are visited.
    host = known - missing
    starts = np.cumsum(rows.scheduled) - rows.scheduled
    for i in np.flatnonzero(host).tolist():
        c, h, s = int(rows.computed[i]), int(host[i]), int(starts[i])
        token_ids[s : s + h] = reqs[i].token_ids(c, c + h)
    for i in np.flatnonzero(rows.drafts).tolist() if num_spec else ():
        d, s = int(rows.drafts[i]), int(starts[i] + known[i])
        token_ids[s : s + d] = reqs[i].draft_token_ids[:d]
    return token_ids, prev_token_rows, prev


def draft_inputs(r: int, rows: StepRows, num_spec: int) -> tuple[np.ndarray, np.ndarray]:
    """``(draft_buf, logit_positions)`` of a bucket of ``r`` rows: the drafts each row verifies
    (``int32[r * num_spec]``, row-major, 0 past them) and per row the ``1 + num_spec`` positions whose
    logits verify draft ``j`` (``j`` below its drafts), then pick the bonus token (``int32[r * (1 + num_spec)]``,
    row-major; each row's last scheduled token past its drafts)."""
    n, s = len(rows.ids), 1 + num_spec
    if not num_spec:  # one position a row, its last scheduled token (np.cumsum's wrapper costs ~2 us)
        logit_positions = np.zeros(r, np.int32)
        np.add.accumulate(rows.scheduled, out=logit_positions[:n])
        logit_positions[:n] -= 1
        return _NO_DRAFTS, logit_positions
    last = np.cumsum(rows.scheduled) - 1
    logit_positions = np.zeros((r, s), np.int32)
    drafts = rows.drafts
    draft_buf = np.zeros((r, num_spec), np.int32)
    for i in np.flatnonzero(drafts).tolist():
        draft_buf[i, : drafts[i]] = rows.reqs[i].draft_token_ids[: drafts[i]]
    logit_positions[:n] = np.minimum(last[:, None] - drafts[:, None] + np.arange(s)[None, :], last[:, None])
    return draft_buf.reshape(-1), logit_positions.reshape(-1)
