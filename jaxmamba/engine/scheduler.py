"""Continuous batching with chunked prefill, prefix caching and recompute preemption (vLLM V1's policy, simplified).

Each step: running requests first (a decode takes one token plus its drafts;
an unfinished prompt takes what is left of the token budget), then waiting
requests in arrival order while rows, tokens, KV blocks and state slots last.
When a running request cannot get the blocks or slots of its next step, the
most recently arrived running request is preempted: everything it holds goes
back to the pools and it restarts later (recompute), keeping the tokens it has
generated, which it then recomputes as prompt.

All KV blocks and Mamba state slots come from one ``PrefixCacheManager``
(``self.kv``): in cache mode ``none`` every request owns ``1 + num_spec`` state
slots for its life; in modes ``align``/``all`` slots follow Mamba blocks and
admission starts a request after its longest cached prefix (``PrefixHit``).
In mode ``align`` prefill chunks are cut to block ends so that every state the
cache keeps is taken exactly at a block end.
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from dataclasses import dataclass

from operator import attrgetter

from jaxmamba.engine.prefix_cache import PrefixCacheManager, cdiv  # noqa: F401  (cdiv: re-exported)
from jaxmamba.engine.request import Request, Status
from jaxmamba.errors import ConfigError, RequestError
from jaxmamba.metadata import CacheMode


_arrival = attrgetter("arrival")


# A scheduled row's counts, in the order SchedulerOutput.counts holds them (NUM_ROW_FIELDS ints a row, flat).
ROW_FIELDS = ("num_computed_tokens", "num_tokens", "num_prefill_tokens", "num_drafts", "num_known", "num_outputs",
              "num_steps", "samples")
NUM_ROW_FIELDS = len(ROW_FIELDS)
_STEPS = ROW_FIELDS.index("num_steps")


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a call per field, on every prefill row
class ScheduledRow:
    """One request's share of a step, as it stood when scheduled (under async scheduling the request moves on
    before the step's results are read back): a copy of one row of a ``SchedulerOutput`` or a ``StepRows``,
    built on demand (``SchedulerOutput.row``, ``StepRows.row``; writing it changes neither), never per row on
    the hot path."""

    request: Request
    num_computed_tokens: int  # the request's computed tokens before this step
    num_tokens: int  # tokens computed for this request in this step
    num_prefill_tokens: int  # the request's Request.num_prefill_tokens when scheduled
    num_drafts: int  # draft tokens verified in this row (its tokens past the last known one)
    num_known: int  # tokens the host held when scheduled: the prompt and the outputs read back
    num_outputs: int  # outputs when scheduled, those still on the device (placeholders) included
    num_steps: int  # decode steps the row runs in this step's window (extend_decode_window), one token each
    samples: bool  # this step reaches the request's last token, so its logits pick the next one

    @property
    def is_prefill(self) -> bool:
        """The row runs (part of) the request's prompt."""
        return self.num_computed_tokens < self.num_prefill_tokens


def row_counts(req: Request, num_tokens: int) -> tuple[int, ...]:
    """The ``ROW_FIELDS`` of a one-step row computing ``num_tokens`` of ``req`` from where it stands now."""
    c = req.num_computed_tokens
    end = c + num_tokens
    num_prompt, num_read = len(req.prompt_token_ids), len(req.output_token_ids)
    num_known = num_prompt + num_read
    known = num_known + req.num_output_placeholders
    return (c, num_tokens, req.num_prefill_tokens, end - known if end > known else 0, num_known,
            num_read + req.num_output_placeholders, 1, int(end >= known))


@dataclass(slots=True)
class SchedulerOutput:
    """A step's rows in scheduler order, as columns: ``requests`` and, flat in ``counts``, each row's
    ``NUM_ROW_FIELDS`` ints (``ROW_FIELDS``), which ``StepRows.of`` reads in one call; no object is built per
    row (``row``/``rows`` give ``ScheduledRow`` copies for code off the hot path)."""

    requests: list[Request]
    counts: list[int]
    preempted: list[Request]
    # The first waiting request could not start: the pools cannot hold its first step (it waits for a finish).
    admission_refused: bool = False

    def __len__(self) -> int:
        return len(self.requests)

    def row(self, i: int) -> ScheduledRow:
        f = NUM_ROW_FIELDS * i
        c, t, prefill, drafts, known, outputs, steps, samples = self.counts[f : f + NUM_ROW_FIELDS]
        return ScheduledRow(self.requests[i], c, t, prefill, drafts, known, outputs, steps, bool(samples))

    @property
    def rows(self) -> list[ScheduledRow]:
        """Every row's copy, in scheduler order (``set_num_steps`` writes the columns, not these)."""
        return [self.row(i) for i in range(len(self.requests))]

    def set_num_steps(self, i: int, num_steps: int) -> None:
        self.counts[NUM_ROW_FIELDS * i + _STEPS] = num_steps

    @property
    def num_tokens(self) -> int:
        return sum(self.counts[1::NUM_ROW_FIELDS])


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, kv: PrefixCacheManager):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.waiting: deque[Request] = deque()
        # In arrival order (``Request.arrival``; a preempted request re-admitted goes back to its place), which
        # ``schedule`` walks without sorting it each step; membership through _running_ids (O(1)).
        self.running: list[Request] = []
        self._running_ids: set[str] = set()
        self.num_preemptions = 0
        # P/D disaggregation (jaxmamba.engine.disagg): requests whose blocks and slots outlive their
        # finish, so that their state can be copied out after the step that computed it.
        self.hold_on_finish: set[str] = set()
        self.held: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ life cycle
    def _release(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.draft_token_ids = ()

    def preempt(self, req: Request) -> None:
        """Back to the head of the waiting queue, holding nothing; it recomputes its tokens when re-admitted."""
        self._preempt(req)

    def _start(self, req: Request) -> None:
        req.status = Status.RUNNING
        max_len = self.kv.max_model_len
        req.max_outputs = min(req.params.max_tokens or max_len, max_len - len(req.prompt_token_ids))
        running = self.running
        if running and running[-1].arrival > req.arrival:  # a re-admitted preempted request (else: the newest)
            insort(running, req, key=_arrival)  # after equal arrivals: the order a stable sort gave
        else:
            running.append(req)
        self._running_ids.add(req.request_id)

    def _stop(self, req: Request) -> None:
        self.running.remove(req)
        self._running_ids.discard(req.request_id)

    def is_running(self, req: Request) -> bool:
        return req.request_id in self._running_ids

    def _preempt(self, req: Request) -> None:
        self._stop(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # it recomputes from its known tokens
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        req.num_output_placeholders = 0  # a token still in flight is discarded with the request
        if self.is_running(req):
            self._stop(req)
        if req.request_id in self.hold_on_finish:
            # Finished, but its KV blocks and state slots stay allocated (and, as nothing schedules a
            # finished request, unwritten) until ``release_held``.
            self.hold_on_finish.discard(req.request_id)
            self.held[req.request_id] = req
            return
        self._release(req)

    def release_held(self, request_id: str) -> None:
        """Free the blocks and slots of a request that ``finish`` kept (its id was in ``hold_on_finish``)."""
        try:
            req = self.held.pop(request_id)
        except KeyError:
            raise RequestError(f"request {request_id!r} is not held") from None
        self._release(req)

    def admit_computed(self, req: Request, num_computed_tokens: int) -> bool:
        """Start ``req`` with its first ``num_computed_tokens`` tokens already computed elsewhere.

        Allocates the KV blocks and state slots those tokens occupy (P/D
        disaggregation: the caller then fills them from the prefill engine, see
        ``jaxmamba.engine.disagg``); the next step computes the rest. Returns
        ``False`` (nothing changed) when the pools cannot hold the request now.
        """
        if not 0 < num_computed_tokens < req.num_tokens:
            raise RequestError(f"num_computed_tokens={num_computed_tokens} must be in [1, {req.num_tokens})")
        if self.kv.cache_mode != CacheMode.NONE:
            # An import brings the state at its last token only; modes align/all would offer the
            # (never written) block-end states of the imported blocks to the prefix cache.
            raise ConfigError("importing computed tokens needs mamba_cache_mode='none' on the receiving engine")
        if self.kv.allocate_for_new_request(req.request_id, req.all_token_ids, num_computed_tokens) is None:
            return False
        self.kv.commit(req.request_id, num_computed_tokens, req.all_token_ids)
        req.num_computed_tokens = num_computed_tokens
        req.prefill_until = req.num_tokens
        self._start(req)
        return True

    # ------------------------------------------------------------------ scheduling
    def schedule(self, allow_preemption: bool = True) -> SchedulerOutput | None:
        """The next step's rows. Under async scheduling (requests with ``num_output_placeholders``) a
        request whose pending token ends it by length is not scheduled again, and with
        ``allow_preemption=False`` a step that would need to preempt returns None instead (the caller
        reads the step in flight back first, then schedules again: allocations made so far are kept,
        and ``allocate_more`` is idempotent)."""
        budget = self.max_num_batched_tokens
        requests: list[Request] = []
        counts: list[int] = []  # ROW_FIELDS per row, flat (SchedulerOutput.counts)
        preempted: list[Request] = []

        # Per running row this loop is the host path's hottest: attributes are read once, Request's
        # properties spelt out, and mode align's chunk rule called only in that mode.
        kv, running_ids, max_num_seqs = self.kv, self._running_ids, self.max_num_seqs
        aligns = kv.cache_mode == CacheMode.ALIGN
        capacity = kv.token_capacity.get
        for req in list(self.running):  # a copy: preemption removes requests from it
            if len(requests) == max_num_seqs or budget == 0:
                break
            if preempted and req.request_id not in running_ids:  # preempted earlier in this loop
                continue
            c = req.num_computed_tokens
            placeholders = req.num_output_placeholders
            num_prompt = req.num_prompt_tokens
            num_outputs = len(req.output_token_ids)
            num_tokens = num_prompt + num_outputs + placeholders
            if placeholders and num_outputs + placeholders >= req.max_outputs:
                continue  # its in-flight token is its last (a length stop): the next step would be discarded
            # A decode row verifies its drafts too; a short budget trims them.
            draft_ids = req.draft_token_ids
            num_new = num_tokens - c + len(draft_ids) if draft_ids else num_tokens - c
            if num_new > budget:
                num_new = budget
            if aligns:
                num_new = kv.align_prefill_chunk(c, num_tokens, num_new)
            if num_new == 0:  # mode align: the budget does not reach the next block end
                continue
            end = c + num_new
            # Most rows end inside the blocks they hold (the manager's token_capacity; c is at least the
            # manager's computed count, so allocate_more's short path would say True): no call.
            while end > capacity(req.request_id, 0) and not kv.allocate_more(req.request_id, end):
                if not allow_preemption:
                    return None
                victim = max(self.running, key=_arrival)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if preempted and req.request_id not in running_ids:  # preempted itself
                continue
            # row_counts from the counts at hand (it would re-read them off the request). A running request's
            # prefill_until (the tokens it knew at admission) is never below its prompt.
            requests.append(req)
            counts += (c, num_new, req.prefill_until, end - num_tokens if end > num_tokens else 0,
                       num_prompt + num_outputs, num_outputs + placeholders, 1, end >= num_tokens)
            budget -= num_new

        admission_refused = False
        while self.waiting and len(requests) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            hit = self.kv.allocate_for_new_request(req.request_id, req.all_token_ids, budget)
            if hit is None:
                admission_refused = True
                break
            self.waiting.popleft()
            req.num_computed_tokens = hit.num_cached_tokens
            req.num_cached_tokens = hit.num_cached_tokens
            # Everything known at admission is prompt for this run (a preempted request recomputes
            # its outputs through the prefill path, never as draft-less multi-token decodes).
            req.prefill_until = req.num_tokens
            self._start(req)
            requests.append(req)
            counts += row_counts(req, hit.num_new_tokens)
            budget -= hit.num_new_tokens
        return SchedulerOutput(requests, counts, preempted, admission_refused)

    def extend_decode_window(self, sched: SchedulerOutput, num_steps: int) -> None:
        """vLLM's multi-step scheduling: when every row of ``sched`` is a plain one-token decode, give each
        row a window of up to ``num_steps`` decode steps (``ScheduledRow.num_steps``), run on the device in one
        call. A row's window ends where its ``length`` stop would (``max_tokens``, ``max_model_len``: never a
        step past it) and at the KV blocks the pool can give now without preempting (then it keeps its one
        step). A stop that needs a token's value (EOS, stop ids and strings) ends the request inside the
        window; the steps after it are discarded. Skipped while a waiting request could take a free row (its
        prefill would wait a whole window; with every row taken, or with the pools unable to hold its first
        step (``SchedulerOutput.admission_refused``), it waits for a finish anyway, at most a window's steps
        later, as vLLM's multi-step scheduling admits prefills between windows) and while a row holds its
        state on finish (P/D: the state must be the one after its last token)."""
        if num_steps <= 1 or not sched.requests or sched.preempted or \
                (self.waiting and len(sched.requests) < self.max_num_seqs and not sched.admission_refused):
            return
        counts, width = sched.counts, NUM_ROW_FIELDS
        for i, req in enumerate(sched.requests):
            c, t, prefill, drafts, _, _, _, samples = counts[width * i : width * i + width]
            if t != 1 or c < prefill or drafts or not samples or req.request_id in self.hold_on_finish:
                return
        for i, req in enumerate(sched.requests):
            n = min(num_steps, req.max_outputs - len(req.output_token_ids) - req.num_output_placeholders)
            if n > 1 and self.kv.allocate_more(req.request_id, counts[width * i] + n):
                sched.set_num_steps(i, n)
