"""The persistent input batch: per-request step inputs kept in numpy arrays indexed by row, written once.

vLLM's ``InputBatch`` idea: what a request feeds every step and that never changes while it runs (its
sampling parameters, its seed, the ids ``min_tokens`` bans) lives in arrays indexed by the request's row
of the persistent device tables (``DeviceBlockTable``'s rows, ``row_map``), written when the request takes
the row, so a step gathers them with one fancy index each instead of walking its requests' objects.
``NULL_ROW`` (the row padding batch rows read) is never assigned and keeps each array's fill value, so a
gather at a padded ``row_map`` pads the step's buffers as the compiled step expects.

``StepInputs`` is what the runner hands the compiled step for one step (see ``ModelRunner._inputs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from jaxmamba.engine.block_table import NULL_ROW
from jaxmamba.errors import SlotError
from jaxmamba.sampling import MAX_BANNED_IDS

if TYPE_CHECKING:
    from jaxmamba.engine.request import Request
    from jaxmamba.engine.step_rows import StepRows
    from jaxmamba.sampling import SamplingVariant
    from jaxmamba.steps import Bucket


@dataclass
class StepInputs:
    """One step's host inputs, rows in batch order (``ModelRunner._inputs``)."""

    bucket: "Bucket"
    rows: "StepRows"  # the step's rows in batch order
    int_buf: np.ndarray  # int32[...]: the packed metadata, then the per-row and per-token step inputs
    float_buf: np.ndarray  # float32[3 * bucket.num_reqs]: temperature, top_p, min_p per batch row
    tickets: tuple[int, int]  # how far ``ModelRunner._flush`` writes the block table and the state table
    num_decodes: int  # leading batch rows the Mamba layers run through the decode path
    # The dispatched step whose sampled tokens some rows read on the device, or None.
    prev: object  # runner.InFlightStep or None (not imported: the runner imports this module)
    variant: "SamplingVariant"  # the sampling tail that serves the batch
    multi: bool  # some row runs a window of decode steps (the bucket's multi-step program)
    wants_logprobs: bool  # some row asked for logprobs: read them back (else only the sampled ids)

    @property
    def order(self) -> np.ndarray:
        """int64[num_reqs]: the scheduler row of each batch row."""
        return self.rows.order


@dataclass(frozen=True)
class GatheredInputs:
    """A step's per-row inputs gathered from the batch at its rows, padded to the bucket's ``R`` rows (padding
    reads ``NULL_ROW``); read-only arrays (``InputBatch.gather`` may hand the same ones to the next step)."""

    row_maps: np.ndarray  # int32[R]: each batch row's table row, NULL_ROW past the real rows
    ints: np.ndarray  # int32[4, R]: top_k, seed, min_tokens and wants_logprobs (0/1)
    ban_ids: np.ndarray  # int32[R * MAX_BANNED_IDS]: each row's banned ids, flat
    floats: np.ndarray  # float32[3, R]: temperature, top_p and min_p
    random: bool  # some real row samples (temperature > 0)
    wants_logprobs: bool  # some real row asked for logprobs


class InputBatch:
    """Per-row sampling inputs of the requests holding the persistent table rows (``num_rows`` rows,
    ``NULL_ROW`` included, as ``DeviceBlockTable``).

    Arrays (indexed by table row): ``temperature``, ``top_p``, ``min_p`` (float32[num_rows], the rows of
    ``floats``); ``top_k``, ``seed``, ``min_tokens`` (int32[num_rows], rows of ``ints``, whose last row is
    ``wants_logprobs`` as 0/1); ``ban_ids`` (int32[num_rows, MAX_BANNED_IDS], -1 past a request's banned ids). ``assign`` writes a row when a request
    (another ``Request`` object than its last one) takes it; rows are never cleared, as a row is always
    re-assigned before a step reads it."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        # Field-major: one gather of ``floats``/``ints`` at a step's rows serves all of their fields
        # (``gather``); the named arrays are views of their rows.
        self.floats = np.zeros((3, num_rows), np.float32)
        self.temperature, self.top_p, self.min_p = self.floats
        self.top_p[:] = 1.0
        self.ints = np.zeros((4, num_rows), np.int32)
        self.top_k, self.seed, self.min_tokens, self._wants_logprobs = self.ints
        self.ban_ids = np.full((num_rows, MAX_BANNED_IDS), -1, np.int32)
        self._owner: list[Request | None] = [None] * num_rows  # the request each row was written for
        self.num_assigned = 0  # rows written over the batch's life
        # gather's last answer, the row_map it was for and num_assigned then.
        self._last_gather: GatheredInputs | None = None
        self._last_row_map: np.ndarray | None = None
        self._last_assigned = -1

    def assign(self, row_map: np.ndarray, reqs: Sequence["Request"]) -> None:
        """Make rows ``row_map`` (int[len(reqs)], never ``NULL_ROW``) hold ``reqs``' inputs, writing only the
        rows whose request changed. ``SlotError`` when a row is ``NULL_ROW`` or outside the batch."""
        owner = self._owner
        rows = row_map.tolist()
        if rows and (min(rows) <= NULL_ROW or max(rows) >= self.num_rows):
            i = next(i for i, row in enumerate(rows) if not NULL_ROW < row < self.num_rows)
            raise SlotError(f"request {reqs[i].request_id!r}: input-batch row {rows[i]} is the null row or outside "
                            f"the {self.num_rows} rows")
        for row, req in zip(rows, reqs, strict=True):
            if owner[row] is req:
                continue
            p = req.params
            self.temperature[row], self.top_p[row], self.min_p[row] = p.temperature, p.top_p, p.min_p
            self.top_k[row], self.seed[row], self.min_tokens[row] = p.top_k, req.seed, p.min_tokens
            ban = req.min_tokens_ban
            self.ban_ids[row] = -1
            self.ban_ids[row, : len(ban)] = ban
            self._wants_logprobs[row] = p.logprobs is not None
            owner[row] = req
            self.num_assigned += 1

    def holds(self, row: int, req: "Request") -> bool:
        """Row ``row`` was last written for ``req`` (the same ``Request`` object)."""
        return self._owner[row] is req

    @property
    def wants_logprobs(self) -> np.ndarray:
        """bool[num_rows]: the row's request asked for logprobs."""
        return self._wants_logprobs.astype(bool)

    def gather(self, row_map: np.ndarray, num_reqs_padded: int) -> GatheredInputs:
        """The inputs at ``row_map`` (int[n], a step's table rows), padded to ``num_reqs_padded`` rows.

        Decoding's steady state runs the same rows step after step: when ``row_map`` is the very read-only
        array of the last call (``DeviceBlockTable.sync_changed`` returns the same one for the same requests
        in the same order) at the same padding and no row was written since, the last call's arrays are
        returned again instead of gathered anew."""
        last = self._last_gather
        if (row_map is self._last_row_map and self.num_assigned == self._last_assigned and last is not None
                and len(last.row_maps) == num_reqs_padded):
            return last
        n = len(row_map)
        row_maps = np.empty(num_reqs_padded, np.int32)  # np.full is a Python wrapper (~1 us a call on this path)
        row_maps[:n], row_maps[n:] = row_map, NULL_ROW
        ints, floats = self.ints[:, row_maps], self.floats[:, row_maps]
        ban_ids = self.ban_ids[row_maps].reshape(-1)
        for array in (row_maps, ints, floats, ban_ids):
            array.flags.writeable = False
        gathered = GatheredInputs(row_maps, ints, ban_ids, floats, random=bool((floats[0, :n] > 0).any()),
                                  wants_logprobs=bool(ints[3, :n].any()))
        if not row_map.flags.writeable:  # a caller's own (writable) array may change before its next call
            self._last_gather, self._last_row_map, self._last_assigned = gathered, row_map, self.num_assigned
        return gathered

    def forget(self) -> None:
        """Every row is re-written at its next ``assign`` (after the tables were reset)."""
        self._owner = [None] * self.num_rows
