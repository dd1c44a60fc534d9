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


@dataclass(slots=True, init=False)  # built once per row per step: slots make that and every read cheaper
class ScheduledRow:
    """One request's share of a step, as it stood when scheduled (under async scheduling the request
    moves on before the step's results are read back).

    ``ScheduledRow(request, num_tokens)`` works the derived fields out from the request as it is now;
    ``Scheduler.schedule``'s hot loop, which has every count at hand already, passes them all (``samples``
    given: nothing is derived). The ``__init__`` is written out, not generated: a generated one calls a
    ``__post_init__`` on every row of every step."""

    request: Request
    num_tokens: int  # tokens computed for this request in this step
    num_computed_tokens: int  # the request's computed tokens before this step (default: as now)
    samples: bool  # this step reaches the request's last token, so its logits pick the next one
    num_drafts: int  # draft tokens verified in this row (its tokens past the last known one)
    is_prefill: bool  # the row runs (part of) the request's prompt
    num_steps: int  # decode steps the row runs in this step's window (extend_decode_window), one token each
    num_prefill_tokens: int  # the request's Request.num_prefill_tokens when scheduled
    num_known: int  # tokens the host held when scheduled: the prompt and the outputs read back
    num_outputs: int  # outputs when scheduled, those still on the device (placeholders) included

    def __init__(self, request: Request, num_tokens: int, num_computed_tokens: int = -1, samples: bool | None = None,
                 num_drafts: int = 0, is_prefill: bool = False, num_steps: int = 1, num_prefill_tokens: int = 0,
                 num_known: int = 0, num_outputs: int = 0):
        if samples is not None:  # the scheduler gave every field
            (self.request, self.num_tokens, self.num_computed_tokens, self.samples, self.num_drafts, self.is_prefill,
             self.num_steps, self.num_prefill_tokens, self.num_known, self.num_outputs) = (
                request, num_tokens, num_computed_tokens, samples, num_drafts, is_prefill, num_steps,
                num_prefill_tokens, num_known, num_outputs)
            return
        req = request
        self.request, self.num_tokens, self.num_steps = request, num_tokens, num_steps
        if num_computed_tokens < 0:
            num_computed_tokens = req.num_computed_tokens
        self.num_computed_tokens = num_computed_tokens
        end = num_computed_tokens + num_tokens
        num_prompt, num_read = len(req.prompt_token_ids), len(req.output_token_ids)
        self.num_known, self.num_outputs = num_prompt + num_read, num_read + req.num_output_placeholders
        known = self.num_known + req.num_output_placeholders
        self.samples = end >= known
        self.num_drafts = end - known if end > known else 0
        self.num_prefill_tokens = num_prompt if num_prompt > req.prefill_until else req.prefill_until
        self.is_prefill = num_computed_tokens < self.num_prefill_tokens


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


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
        req.draft_token_ids = []

    def preempt(self, req: Request) -> None:
        """Back to the head of the waiting queue, holding nothing; it recomputes its tokens when re-admitted."""
        self._preempt(req)

    def _start(self, req: Request) -> None:
        req.status = Status.RUNNING
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
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []

        # Per running row this loop is the host path's hottest: attributes are read once, Request's
        # properties spelt out, and mode align's chunk rule called only in that mode.
        kv, running_ids, max_num_seqs = self.kv, self._running_ids, self.max_num_seqs
        max_len = kv.max_model_len
        aligns = kv.cache_mode == CacheMode.ALIGN
        capacity = kv.token_capacity.get
        for req in list(self.running):  # a copy: preemption removes requests from it
            if len(rows) == max_num_seqs or budget == 0:
                break
            if preempted and req.request_id not in running_ids:  # preempted earlier in this loop
                continue
            c = req.num_computed_tokens
            placeholders = req.num_output_placeholders
            num_prompt = len(req.prompt_token_ids)
            num_outputs = len(req.output_token_ids)
            num_tokens = num_prompt + num_outputs + placeholders
            if placeholders and (num_outputs + placeholders >= (req.params.max_tokens or max_len)
                                 or num_tokens >= max_len):
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
            # ScheduledRow's derived fields from the counts at hand (its __post_init__ would re-read them).
            prefill = num_prompt if num_prompt > req.prefill_until else req.prefill_until
            rows.append(ScheduledRow(req, num_new, c, end >= num_tokens, end - num_tokens if end > num_tokens else 0,
                                     c < prefill, 1, prefill, num_prompt + num_outputs, num_outputs + placeholders))
            budget -= num_new

        while self.waiting and len(rows) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            hit = self.kv.allocate_for_new_request(req.request_id, req.all_token_ids, budget)
            if hit is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens = hit.num_cached_tokens
            req.num_cached_tokens = hit.num_cached_tokens
            # Everything known at admission is prompt for this run (a preempted request recomputes
            # its outputs through the prefill path, never as draft-less multi-token decodes).
            req.prefill_until = req.num_tokens
            self._start(req)
            rows.append(ScheduledRow(req, hit.num_new_tokens))
            budget -= hit.num_new_tokens
        return SchedulerOutput(rows, preempted)

    def extend_decode_window(self, sched: SchedulerOutput, num_steps: int) -> None:
        """vLLM's multi-step scheduling: when every row of ``sched`` is a plain one-token decode, give each
        row a window of up to ``num_steps`` decode steps (``ScheduledRow.num_steps``), run on the device in one
        call. A row's window ends where its ``length`` stop would (``max_tokens``, ``max_model_len``: never a
        step past it) and at the KV blocks the pool can give now without preempting (then it keeps its one
        step). A stop that needs a token's value (EOS, stop ids and strings) ends the request inside the
        window; the steps after it are discarded. Skipped while a waiting request could take a free row (its
        prefill would wait a whole window; with every row taken it waits for a finish anyway, at most a
        window's steps later, as vLLM's multi-step scheduling admits prefills between windows) and while a
        row holds its state on finish (P/D: the state must be the one after its last token)."""
        if num_steps <= 1 or not sched.rows or sched.preempted or \
                (self.waiting and len(sched.rows) < self.max_num_seqs):
            return
        for row in sched.rows:
            if row.num_tokens != 1 or row.is_prefill or row.num_drafts or not row.samples or \
                    row.request.request_id in self.hold_on_finish:
                return
        max_len = self.kv.max_model_len
        for row in sched.rows:
            req = row.request
            known = req.num_tokens + req.num_output_placeholders
            outputs = len(req.output_token_ids) + req.num_output_placeholders
            n = min(num_steps, (req.params.max_tokens or max_len) - outputs, max_len - known)
            if n > 1 and self.kv.allocate_more(req.request_id, row.num_computed_tokens + n):
                row.num_steps = n
