"""One step's rows in batch order, read off the scheduler's columns in one call (``StepRows.of``).

The model runner (``ModelRunner._inputs``) reads every per-row count it needs from here, and the step loop
advances and records the step from it: the batch's order and its decode/prefill split are worked out once
(``metadata.classify.split_batch``), not again by each consumer.
"""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass, field

import numpy as np

from jaxmamba.engine.scheduler import NUM_ROW_FIELDS, ROW_FIELDS, ScheduledRow, SchedulerOutput
from jaxmamba.errors import MetadataError
from jaxmamba.metadata.classify import all_decode_rows, draft_counts, split_batch, split_rows


def _bad_count(sched: SchedulerOutput) -> MetadataError:
    """The error naming the first scheduled count that is not an int in ``[0, 2**32)`` (negative, past 32 bits, or
    no int at all), its row and its request."""
    k = next(k for k, v in enumerate(sched.counts) if not _fits_u32(v))
    row, field = divmod(k, NUM_ROW_FIELDS)
    return MetadataError(f"scheduled row {row} (request {sched.requests[row].request_id!r}): "
                         f"{ROW_FIELDS[field]}={sched.counts[k]!r} is negative, past 32 bits or not an int")


def _fits_u32(value) -> bool:
    try:
        return 0 <= operator.index(value) < 2**32
    except TypeError:
        return False


@dataclass
class StepRows:
    """The requests, their ids, and per row (``int32[n]``) the computed tokens, the tokens scheduled, the
    prompt tokens of this run (``Request.num_prefill_tokens``), the drafts verified, the tokens the host knows
    (prompt + read-back outputs), the outputs counting those still on the device, the decode steps of its
    window and whether it samples (0/1: the step reaches its last token), all views of ``columns``
    (``int32[NUM_ROW_FIELDS, n]``, ``scheduler.ROW_FIELDS``); then the batch's split: ``num_prefills`` (rows
    from the first one the Mamba builder runs as a prefill on; 0 for a decode-only batch) and ``decode_only``
    (a pure-decode bucket may run it); with spec decode, ``draft_counts`` (``classify.draft_counts`` of
    ``drafts``: the builders' per-row draft counts)."""

    scheduler_rows: list[int] | None  # the scheduler row of each batch row; None: the same row (``order``)
    reqs: list
    ids: list[str]
    computed: np.ndarray
    scheduled: np.ndarray
    prompt: np.ndarray
    drafts: np.ndarray
    num_known: np.ndarray
    num_outputs: np.ndarray
    num_steps: np.ndarray
    samples: np.ndarray
    num_tokens: int  # scheduled tokens in all
    decode_only: bool
    num_prefills: int
    draft_counts: np.ndarray | None = None  # int32[n]: None without spec decode
    columns: np.ndarray | None = field(default=None, repr=False)  # int32[NUM_ROW_FIELDS, n]: the counts above
    _lists: list[list[int]] | None = field(default=None, repr=False)  # column_lists, once read
    # The scheduler's flat counts (SchedulerOutput.counts) while the batch keeps its order and its counts
    # (column_lists slices them: no int is converted), else None.
    _flat: list[int] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, sched: SchedulerOutput, num_spec: int) -> StepRows:
        reqs = sched.requests
        n = len(reqs)
        # Every count as the scheduler wrote it (ROW_FIELDS), packed in one call: 2-3x faster than np.fromiter's
        # conversion (np.array's is slower still); read-only, as each column below is copied or only read. As
        # unsigned ints, so that a negative count fails the pack itself: the check costs no extra pass (a numpy
        # min here cost 30-40 us a step, its code cold inside a step). A count past int32 (never: max_model_len
        # bounds them) would read negative and fail the builders' checks.
        try:
            packed = struct.pack(f"={NUM_ROW_FIELDS * n}I", *sched.counts)
        except struct.error:
            raise _bad_count(sched) from None
        columns = np.frombuffer(packed, np.int32).reshape(n, NUM_ROW_FIELDS).T
        decode_only, num_prefills, order, drafts = True, 0, None, None
        flat = sched.counts
        if not num_spec:
            # Classified on the scheduler's own lists (each column a slice, no numpy call): split_rows.
            split = split_rows(flat[0::NUM_ROW_FIELDS], flat[1::NUM_ROW_FIELDS], flat[2::NUM_ROW_FIELDS], 1)
            decode_only, order = split.decode_only, split.order
            num_prefills = 0 if decode_only else n - split.num_decodes
        else:
            computed, scheduled, prompt = columns[0], columns[1], columns[2]
            # The steady state, every row a decode, in a few numpy calls: any order is then the builders'.
            if not all_decode_rows(scheduled, computed, computed < prompt, 1 + num_spec):
                split = split_batch(computed, scheduled, prompt, columns[3], 1 + num_spec)
                decode_only, drafts = split.decode_only, split.draft_counts
                order = None if split.order is None else split.order.tolist()
                num_prefills = 0 if decode_only else n - split.num_decodes
            else:
                drafts = draft_counts(columns[3])
        if order is None:
            columns = np.ascontiguousarray(columns)
        else:
            flat = None  # column_lists reads the reordered columns
            reqs = [reqs[i] for i in order]
            columns = np.ascontiguousarray(columns[:, order])
        return cls(order, reqs, [req.request_id for req in reqs], *columns, num_tokens=sched.num_tokens,
                   decode_only=decode_only, num_prefills=num_prefills, draft_counts=drafts, columns=columns,
                   _flat=flat)

    @property
    def order(self) -> np.ndarray:
        """int64[n]: the scheduler row of each batch row (read off the hot path: tests, ``bench host-inputs``)."""
        return np.arange(len(self.reqs)) if self.scheduler_rows is None else np.array(self.scheduler_rows)

    def column_lists(self) -> list[list[int]]:
        """The ``ROW_FIELDS`` columns as Python lists, read once a step for the step loop's per-row passes
        (a numpy call per row, or per column, costs more there than the rest of a row's work)."""
        if self._lists is None:
            flat = self._flat
            self._lists = self.columns.tolist() if flat is None else [
                flat[k::NUM_ROW_FIELDS] for k in range(NUM_ROW_FIELDS)]
        return self._lists

    def run_single_steps(self) -> None:
        """Every row runs one step (the runner found no window program for the batch's bucket)."""
        self.num_steps[:] = 1
        self._lists = self._flat = None

    def row(self, i: int) -> ScheduledRow:
        """Batch row ``i`` as a ``ScheduledRow`` copy (for the step loop's general path, off the hot one)."""
        c, t, prefill, drafts, known, outputs, steps, samples = self.column_lists()
        return ScheduledRow(self.reqs[i], c[i], t[i], prefill[i], drafts[i], known[i], outputs[i], steps[i],
                            bool(samples[i]))
