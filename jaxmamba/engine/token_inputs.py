"""The tokens a step reads: each row's known tokens and drafts (``token_inputs``) and the positions whose
logits verify them (``draft_inputs``), as ``ModelRunner._inputs`` packs them into the step's int buffer."""

from __future__ import annotations

import operator

import numpy as np

from jaxmamba.buckets import Bucket
from jaxmamba.engine.step_rows import StepRows
from jaxmamba.errors import SlotError

#: ``draft_inputs``' draft buffer without spec decode (int32[0]: read, never written).
_NO_DRAFTS = np.zeros(0, np.int32)
_NO_DRAFTS.setflags(write=False)


def token_inputs(bucket: Bucket, rows: StepRows, prev) -> tuple[np.ndarray, np.ndarray, object]:
    """``(token_ids, prev_token_rows, prev)``: the step's input tokens (``int32[bucket.num_tokens]``, each row's
    known tokens then its drafts), and for rows whose last token a dispatched step sampled and the host has
    not read back (a placeholder: 0 in ``token_ids``), that step (``prev``: the last dispatched step, a
    ``runner.InFlightStep``, or None) and the row it sampled it in (``prev_token_rows``,
    ``int32[bucket.num_reqs]``, -1 elsewhere); ``prev`` comes back None when no row reads it."""
    token_ids = np.zeros(bucket.num_tokens, np.int32)
    n, reqs = len(rows.ids), rows.reqs
    computed, scheduled, _, drafts, num_known = rows.column_lists()[:5]
    # (All Python: a numpy comparison here runs cold beside a CPU device's step, BENCHMARKS.md "Session 30".)
    if rows.num_tokens == n and prev is not None and rows.ids == prev.rows.ids and \
            all(map(operator.le, num_known, computed)):
        # Async decoding's steady state: one token a row, none known on the host, each sampled in the same row of
        # the last dispatched step (the same requests in the same order; list equality tests identity first).
        prev_token_rows = np.empty(bucket.num_reqs, np.int32)
        prev_token_rows.fill(-1)
        prev_token_rows[:n] = np.arange(n, dtype=np.int32)
        return token_ids, prev_token_rows, prev
    # One pass over the rows' counts as Python lists: a mixed step's rows are mostly decodes whose one token is
    # still on the device, and a dozen numpy calls on arrays this small cost more than the pass (their code
    # runs cold inside a step).
    row_in_prev = ({} if prev is None else prev.batch_rows).get
    ids = rows.ids
    tokens: list[int] = []
    sampled_in = [-1] * bucket.num_reqs
    reads_prev = False
    for i, req in enumerate(reqs):
        c, d = computed[i], drafts[i]
        known = scheduled[i] - d
        # Tokens of the row's known span the host holds: past a multi-step window the row starts beyond the
        # tokens read back, and only its last token may still be on the device.
        host = num_known[i] - c
        if host >= known:
            tokens += req.token_ids(c, c + known)
        else:
            if host < 0:
                host = 0
            row = row_in_prev(ids[i])
            if known - host > 1 or row is None:
                raise SlotError(f"request {ids[i]!r}: {known - host} of its scheduled tokens are not known and "
                                "the last dispatched step did not sample them")
            if host:
                tokens += req.token_ids(c, c + host)
            tokens.append(0)
            sampled_in[i] = row
            reads_prev = True
        if d:
            tokens += req.draft_token_ids[:d]
    token_ids[: len(tokens)] = tokens
    return token_ids, np.array(sampled_in, np.int32), prev if reads_prev else None


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
