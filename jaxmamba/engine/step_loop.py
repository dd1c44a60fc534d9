"""The engine's step loop: schedule -> run -> record, synchronous or async (vLLM's async scheduling).

``StepLoop`` turns queued requests into tokens, one ``step()`` at a time; ``EngineCore``
(jaxmamba.engine.core) builds the parts it drives and hands them to it. A synchronous step
schedules, runs the step's bucket, reads its samples back and records them. Under async scheduling
(``EngineConfig.async_scheduling``, the default, used when there is no speculative decoding and no prefix
caching) the host schedules and dispatches step N+1 before it reads step N back, so its own work runs
while the device computes:

* step N's requests count its tokens as soon as it is dispatched (``num_computed_tokens``); each token it
  samples is a placeholder (``Request.num_output_placeholders``) until read back, and step N+1 takes it
  from step N's device output (``InFlightStep``, ``int_buf``'s ``prev_token_rows``);
* a stop that needs the token's value (EOS, a stop id or string) is seen one step late: the row the
  request had in step N+1 is discarded, as vLLM does; a ``length`` stop is known ahead and never
  scheduled past;
* a step that would preempt is scheduled only once step N is recorded, so preemption sees what a
  synchronous engine sees.

Tokens equal the synchronous engine's (tests/jaxmamba/test_async_scheduling.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import jax

from jaxmamba.engine.outputs import logprob_entry, match_stop_string
from jaxmamba.engine.prefix_cache import PrefixCacheManager
from jaxmamba.engine.request import Logprob, Request, Status
from jaxmamba.engine.runner import ModelRunner
from jaxmamba.engine.scheduler import Scheduler
from jaxmamba.engine.step_rows import StepRows
from jaxmamba.engine.stats import EngineStats
from jaxmamba.host_profile import HostProfile, maybe_phase
from jaxmamba.metadata import CacheMode

logger = logging.getLogger(__name__)


class StepLoop:
    """``step()`` and what it needs. Its collaborators come in explicitly (``EngineCore`` builds them):
    the ``scheduler``, the ``runner`` (its ``profile`` is the host profile), the prefix-cache manager ``kv``,
    the model's ``cfg`` (EOS ids), the ``tokenizer`` (stop strings, logprob text), the speculative
    ``proposer``/``num_spec``, ``stats`` (counters it adds to) and the scheduling options. Its own state:
    the requests finished outside a step's return (``_unreported``), those that got tokens or finished in
    the last step (``last_step``) and, under async scheduling, the step not yet read back (``inflight``)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv: PrefixCacheManager, *, cfg, tokenizer,
                 stats: EngineStats, proposer=None, num_spec: int = 0, async_scheduling: bool = True,
                 num_scheduler_steps: int = 1):
        self.scheduler, self.runner, self.kv = scheduler, runner, kv
        self.cfg, self.tokenizer = cfg, tokenizer
        self._stop_rules: dict[tuple, tuple] = {}  # _stop_rule's rules and their stop ids, one object each
        self._stats = stats
        self.proposer, self.num_spec = proposer, num_spec
        self.async_scheduling, self.num_scheduler_steps = async_scheduling, num_scheduler_steps
        self._unreported: list[Request] = []  # finished outside a step's return (a fault, an interrupt)
        self._last_step: list[Request] = []  # requests that got tokens or finished in the last step
        self._inflight = None  # async scheduling: the dispatched step not yet read back (runner.InFlightStep)
        # Called with a failed step's exception before the recovery below; raising ends the step loop instead
        # (the multi-process engine: EngineCore sets it, as a process cannot recover alone).
        self.on_step_failure: Callable[[BaseException], None] | None = None

    @property
    def host_profile(self) -> HostProfile | None:
        return self.runner.profile

    @property
    def last_step(self) -> list[Request]:
        """The requests that got tokens or finished in the last ``step()``."""
        return self._last_step

    @property
    def inflight(self):
        """Async scheduling: the dispatched step not yet read back, or None."""
        return self._inflight

    def has_pending(self) -> bool:
        """Work the loop still owes: a step in flight, or requests finished but not yet returned."""
        return bool(self._unreported) or self._inflight is not None

    def forget(self, request_ids) -> None:
        """Drop aborted requests from the finished-but-unreported list."""
        gone = set(request_ids)
        self._unreported = [r for r in self._unreported if r.request_id not in gone]

    def _fail(self, req: Request, error: str) -> None:
        """Finish ``req`` with ``finish_reason="error"`` (its blocks and slots go back to the pools)."""
        req.error = error
        self.scheduler.hold_on_finish.discard(req.request_id)  # its state is not to be handed on
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        self.scheduler.finish(req, "error")

    def _propose_drafts(self) -> None:
        decoding = [r for r in self.scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
        room = [r.max_outputs - len(r.output_token_ids) - 1 for r in decoding]
        if hasattr(self.proposer, "propose_batch"):
            drafts = self.proposer.propose_batch([r.all_token_ids for r in decoding], room)
        else:
            drafts = [self.proposer.propose(r.all_token_ids, min(n, self.num_spec)) for r, n in zip(decoding, room, strict=True)]
        for req, d in zip(decoding, drafts, strict=True):
            req.draft_token_ids = d

    def step(self) -> list[Request]:
        """One engine iteration; returns the engine requests that finished in it (and any a fault or an
        interrupt finished since the last call).

        With ``async_scheduling`` (and no speculative decoding, prefix caching or held requests) the
        iteration schedules and dispatches step N+1 before it reads step N back: see ``_async_step``.

        Exception safety: a failure while scheduling or proposing propagates (nothing was computed, the
        scheduler is consistent). A failure once the step is built (running it, recording its results)
        finishes the step's requests with ``finish_reason="error"``, re-allocates the caches when the step
        took them and never gave them back (then every other running request is preempted, to recompute
        its lost state, and the prefix cache is emptied), and returns them; ``KeyboardInterrupt`` and other
        ``BaseException``s are re-raised after the same recovery. Ctrl-C while a step runs is held back
        until its results are recorded, then raised.
        """
        self._last_step = []
        if self._async_eligible():
            return self._async_step()
        finished = self._drain() if self._inflight is not None else []
        return finished + self._sync_step()

    def _async_eligible(self) -> bool:
        # Speculative decoding needs the acceptance count to know where a request stands; prefix caching
        # commits states that the next schedule reads; a held request's state must not run an extra step.
        return (self.async_scheduling and self.proposer is None and self.kv.cache_mode == CacheMode.NONE
                and not self.scheduler.hold_on_finish)

    def _sync_step(self) -> list[Request]:
        prof = self.host_profile
        try:
            with maybe_phase(prof, "schedule"):
                if self.proposer is not None:
                    self._propose_drafts()
                sched = self.scheduler.schedule()
                self.scheduler.extend_decode_window(sched, self.num_scheduler_steps)
        except BaseException:
            for req in self.scheduler.running:
                req.draft_token_ids = ()
            raise
        finished, self._unreported = self._unreported, []
        if not sched.requests:
            return finished + self._fail_unschedulable()
        done: list[Request] = []
        try:
            result = self.runner.execute(sched)
            self._record_step(result, done, advanced=False)
        except BaseException as exc:
            finished += done + self._recover(sched.requests, exc)
            if not isinstance(exc, Exception):
                self._unreported, finished = finished, []
                raise
            return finished
        if self.runner.interrupted:
            self.runner.interrupted = False
            self._unreported = finished + done
            raise KeyboardInterrupt
        return finished + done

    def _fail_unschedulable(self) -> list[Request]:
        if self.scheduler.waiting and not self.scheduler.running:
            # Nothing holds the pools, so the head request can never be admitted: fail it, not the loop.
            req = self.scheduler.waiting[0]
            self._fail(req, "no request can be scheduled: the KV block or state slot pool is too small")
            return [req]
        return []

    def _async_step(self) -> list[Request]:
        """vLLM's async scheduling: schedule and dispatch step N+1 while step N runs, then read step N
        back and record it. Step N's requests already count its tokens (``num_computed_tokens`` moves at
        dispatch; a sampled token is a ``num_output_placeholders`` until read back, and step N+1 reads
        it on the device). A request that step N finishes may have a row in step N+1: that row's
        results are discarded (as vLLM). A step that would preempt is scheduled only after step N is
        recorded, so preemption sees what a synchronous engine sees."""
        prof = self.host_profile
        prev = self._inflight
        with maybe_phase(prof, "schedule"):
            sched = self.scheduler.schedule(allow_preemption=prev is None)
        finished, self._unreported = self._unreported, []
        if sched is None:  # it must preempt: read the step in flight back first
            finished += self._drain()
            prev = None
            with maybe_phase(prof, "schedule"):
                sched = self.scheduler.schedule()
        if not sched.requests:
            if prev is not None:
                return finished + self._drain()
            return finished + self._fail_unschedulable()
        with maybe_phase(prof, "schedule"):
            self.scheduler.extend_decode_window(sched, self.num_scheduler_steps)
        try:
            step = self.runner.dispatch(sched)
        except BaseException as exc:
            finished += self._drain(reraise=False)
            finished += self._recover(sched.requests, exc)
            if not isinstance(exc, Exception):
                self._unreported, finished = finished, []
                raise
            return finished
        with maybe_phase(prof, "schedule"):  # scheduler bookkeeping (uncounted outside every phase)
            self._advance_dispatched(step.rows)
        self._inflight = step
        if prev is not None:
            finished += self._collect(prev)
        if self.runner.interrupted:
            finished += self._drain(reraise=False)
            self.runner.interrupted = False
            self._unreported = finished
            raise KeyboardInterrupt
        return finished

    @staticmethod
    def _advance_dispatched(rows: StepRows) -> None:
        """A dispatched step's tokens count from now on (a window's: one per step); a sampled token is a
        placeholder until read back."""
        _, scheduled, _, _, _, _, steps, samples = rows.column_lists()
        for req, num_tokens, num_steps, sampled in zip(rows.reqs, scheduled, steps, samples, strict=True):
            req.num_computed_tokens += num_tokens + num_steps - 1
            if sampled:
                req.num_output_placeholders += num_steps

    def _collect(self, step) -> list[Request]:
        """Read a dispatched step back and record it (async scheduling). A failure fails its requests and
        those of the step dispatched after it, which read its tokens and caches."""
        done: list[Request] = []
        try:
            result = self.runner.collect(step)
            self._record_step(result, done, advanced=True)
        except BaseException as exc:
            reqs = list(step.sched.requests)
            after, self._inflight = self._inflight, None
            self.runner.forget_dispatched()
            if after is not None and after is not step:
                reqs += after.sched.requests
                # It read the failed step's outputs: it failed too.
                with contextlib.suppress(Exception):
                    jax.block_until_ready(after.future.result()[0])
            failed = done + self._recover(reqs, exc)
            if not isinstance(exc, Exception):
                self._unreported += failed
                raise
            return failed
        if self._inflight is step:
            self._inflight = None
        elif self._inflight is not None and all(r.finished for r in self._inflight.sched.requests):
            # Every row of the step in flight belongs to a request that has finished: nothing will read
            # it (the caches it returns are already the runner's).
            self._inflight = None
            self.runner.forget_dispatched()
        return done

    def _drain(self, reraise: bool = True) -> list[Request]:
        """Read back and record the step in flight, if any (``reraise=False``: a failure is recorded as
        the requests' error and not raised, for paths that are already handling one)."""
        step = self._inflight
        if step is None:
            return []
        try:
            return self._collect(step)
        except BaseException:
            if reraise:
                raise
            out, self._unreported = self._unreported, []
            return out

    def _record_step(self, result, done: list[Request], *, advanced: bool) -> None:
        prof = self.host_profile
        generated = self._stats.num_generated_tokens
        with maybe_phase(prof, "record"):
            self._record(result, done, advanced=advanced)
        if prof is not None:
            prof.num_steps += 1
            prof.num_rows += len(result.rows.reqs)
            prof.num_output_tokens += self._stats.num_generated_tokens - generated
        self._stats.num_steps += 1

    def _recover(self, reqs: list[Request], exc: BaseException) -> list[Request]:
        """Fail the requests of a step that failed (``reqs``: its rows', a request may be there twice) and, when
        the step lost the caches, start over from the requests' tokens."""
        if self.on_step_failure is not None:
            self.on_step_failure(exc)
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, Exception):
            logger.exception("engine step failed; its requests finish with an error")
        failed = list(dict.fromkeys(req for req in reqs if not req.finished))  # a row in two steps (async)
        for req in failed:
            self._fail(req, f"the engine step failed: {error}")
        if self.runner.caches_lost():
            self.runner.reallocate_caches()
            for req in sorted(self.scheduler.running, key=lambda r: r.arrival, reverse=True):
                self.scheduler.preempt(req)  # recomputes from its tokens: its state is gone
            for rid in list(self.scheduler.held):
                held = self.scheduler.held[rid]
                self.scheduler.release_held(rid)
                held.error = f"its state was lost when a step failed: {error}"
                held.finish_reason = "error"
                failed.append(held)
            self.kv.reset_cache()
        for req in self.scheduler.running:
            req.draft_token_ids = ()
        self._last_step = failed
        return failed

    def _record(self, result, finished: list[Request], *, advanced: bool) -> None:
        """Apply a step's results to its requests (tokens, logprobs, stops, commits); ``finished`` collects
        those that finish, as they finish, so that a failure part-way loses none. ``advanced``: the
        requests' ``num_computed_tokens`` already count the step (async scheduling), and its sampled
        tokens are placeholders; rows of requests that finished since the step was scheduled are
        discarded.

        This loop runs once per row per step, so a one-token decode row whose request needs no logprobs
        and no stop ids or strings (most rows of a serving step) is recorded inline: its token appended,
        its counters moved, its stop rule (``_stop_rule``, worked out once per request) tested with two
        comparisons and its prefix-cache commit taken through ``commit_decode(s)``. Every other row goes
        through ``_record_row``."""
        now = time.monotonic()
        stats, kv, last_step, finish = self._stats, self.kv, self._last_step, self.scheduler.finish
        stop_rule, caching, plain, finished_status = self._stop_rule, kv.caching, kv.plain, Status.FINISHED
        commit_ids: list[str] = []  # plain manager: the one-token rows' commits, made together
        commit_counts: list[int] = []
        num_accepted = None
        rows, num_decodes = result.rows, result.num_decodes
        # Python lists once a step (a numpy call per row, or per column, costs more than the rest of a row's record).
        computed_l, scheduled_l, prompt_l, _, _, _, steps_l, samples_l = rows.column_lists()
        counts = [0, 0]  # _record_row's prompt and generated tokens (summed locally, added to stats once)
        generated = 0  # tokens of the rows recorded inline, one each
        try:
            for batch_row, (req, c, num_tokens, prompt, num_steps, samples, token) in enumerate(zip(
                    rows.reqs, computed_l, scheduled_l, prompt_l, steps_l, samples_l, result.tokens[:, 0].tolist(),
                    strict=True)):
                if req.status is finished_status:  # stopped by the previous step or aborted: ran past its end
                    continue
                stop_ids, max_outputs, general = req.stop_rule or stop_rule(req)
                # num_tokens == num_steps == 1 (both at least 1), tested as one sum
                if num_tokens + num_steps != 2 or c < prompt or not samples or general:
                    if num_accepted is None:
                        num_accepted = result.num_accepted.tolist()
                    self._record_row(rows.row(batch_row), batch_row, result.tokens[batch_row].tolist(),
                                     num_accepted[batch_row], result, batch_row < num_decodes, advanced, now, counts,
                                     finished)
                    continue
                computed = c + 1
                if advanced:
                    req.num_output_placeholders -= 1
                else:
                    req.num_computed_tokens = computed
                if req.draft_token_ids:  # proposed, but the budget left no room to verify them
                    req.draft_token_ids = ()
                if req.first_token_time is None:
                    req.first_token_time = now
                outputs = req.output_token_ids
                outputs.append(token)
                generated += 1
                last_step.append(req)
                # Commit what the step computed (see _record_row) before finishing (which frees); a plain
                # manager's commits are independent, so a step's go together after the loop. A one-token decode has
                # now computed exactly its known tokens less the one it sampled (its input was its last known
                # token and the steps before it are recorded): _record_row's clamp to them cannot bite here.
                if token in stop_ids or len(outputs) >= max_outputs:
                    reason = self._stop_reason(req, token)
                    if reason:
                        kv.commit_decode(req.request_id, computed, req.token_view if caching else None)
                        finish(req, reason)
                        finished.append(req)
                        continue
                if plain:
                    commit_ids.append(req.request_id)
                    commit_counts.append(computed)
                else:
                    kv.commit_decode(req.request_id, computed, req.token_view if caching else None)
            if commit_ids:
                kv.commit_decodes(commit_ids, commit_counts)
        finally:
            stats.num_prompt_tokens += counts[0]
            stats.num_generated_tokens += counts[1] + generated

    def _record_row(self, row, batch_row: int, row_tokens: list[int], accepted: int, result, in_decodes: bool,
                    advanced: bool, now: float, counts: list[int], finished: list[Request]) -> None:
        """``_record`` of one row in general: a prompt chunk, a row that verified drafts or ran a window of
        steps, or a request that wants logprobs or has stop ids or strings."""
        req, stats, kv = row.request, self._stats, self.kv
        drafts, num_tokens = row.num_drafts, row.num_tokens
        if row.is_prefill or num_tokens > 1 + drafts:
            counts[0] += num_tokens - drafts
        multi_token_decode = in_decodes and num_tokens > 1
        token_view = req.token_view if kv.caching else None
        if not row.samples:
            computed = row.num_computed_tokens + num_tokens
            if not advanced:
                req.num_computed_tokens = computed
            kv.commit(req.request_id, computed, token_view, num_scheduled_tokens=num_tokens,
                      multi_token_decode=multi_token_decode)
            return
        # Rejected drafts leave no trace: their KV slots are overwritten later and the next step
        # reads the Mamba state of the last accepted token (the manager's num_accepted_tokens).
        computed = row.num_computed_tokens + num_tokens - (drafts - accepted)
        if advanced:
            req.num_output_placeholders -= row.num_steps
        else:
            req.num_computed_tokens = computed
        if req.draft_token_ids:
            req.draft_token_ids = ()
        if drafts:  # a window's row (num_steps > 1) reports its extra steps as accepted: not drafts
            stats.num_draft_tokens += drafts
            stats.num_accepted_draft_tokens += accepted
        if req.first_token_time is None:
            req.first_token_time = now
        reason, appended = self._append_tokens(req, row_tokens, accepted + 1, result, batch_row)
        counts[1] += appended
        self._last_step.append(req)
        # Before finishing (which frees): full blocks computed in this step enter the prefix cache.
        # A stop inside the accepted drafts leaves tokens that are not outputs; cache only known ones.
        # A window's row computed one token per step (fewer if it stopped inside the window).
        known = len(req.prompt_token_ids) + len(req.output_token_ids) - 1
        kv.commit(req.request_id, computed if computed < known else known, token_view,
                  num_scheduled_tokens=num_tokens if row.num_steps == 1 else None,
                  multi_token_decode=multi_token_decode)
        if reason:
            self.scheduler.finish(req, reason)
            finished.append(req)

    def _stop_rule(self, req: Request) -> tuple[tuple[int, ...], int, bool]:
        """``req.stop_rule``, worked out on first use: ``(ids, length, general)``, a cheap form of
        ``_stop_reason``'s rules that is False only when it would say None: a token in ``ids`` (EOS unless
        ``ignore_eos``) or an output count reaching ``length`` (``Request.max_outputs``) may
        stop; ``general``: every token needs ``_stop_reason`` (stop ids or strings) or logprobs, so its
        rows take ``_record_row``."""
        p = req.params
        shared = self._stop_rules.setdefault
        ids = () if p.ignore_eos else tuple(self.cfg.eos_token_id)
        ids = shared(ids, ids)
        # Requests with equal rules share one tuple (bounded: max_outputs <= max_model_len), as they share their
        # stop ids: _record reads both for every row, and a shared object stays in the host's caches (beside a
        # CPU device's step) where one per request would not.
        rule = (ids, req.max_outputs, bool(p.stop_token_ids or p.stop) or p.logprobs is not None)
        rule = req.stop_rule = shared(rule, rule)
        return rule

    def _append_tokens(self, req: Request, row_tokens: list[int], num: int, result, batch_row: int
                       ) -> tuple[str | None, int]:
        """Append the first ``num`` of ``row_tokens`` (and their logprobs) to ``req``'s outputs, up to the
        first that stops it; returns the stop reason (or None) and how many were appended."""
        p, outputs = req.params, req.output_token_ids
        stop_ids, length_limit, _ = req.stop_rule or self._stop_rule(req)
        checks_stops = bool(p.stop_token_ids or p.stop)  # _stop_reason's rules that need every token
        for j in range(num):
            token = row_tokens[j]
            outputs.append(token)
            if p.logprobs is not None:
                req.output_logprobs.append(self._logprobs(req, result, batch_row, j, token))
            if checks_stops or token in stop_ids or len(outputs) >= length_limit:
                reason = self._stop_reason(req, token)
                if reason:
                    return reason, j + 1
        return None, num

    def _logprobs(self, req: Request, result, b: int, j: int, token: int) -> dict[int, Logprob]:
        return logprob_entry(self.tokenizer, req, result.top_ids[b, j], result.top_logprobs[b, j], token,
                             float(result.token_logprobs[b, j]), int(result.token_ranks[b, j]))

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if not p.ignore_eos and token in self.cfg.eos_token_id:
            return "stop"
        if token in p.stop_token_ids:
            req.stop_reason = token
            return "stop"
        if p.stop and self._match_stop_string(req):
            return "stop"
        if len(req.output_token_ids) >= req.max_outputs:
            return "length"
        return None

    def _match_stop_string(self, req: Request) -> bool:
        return match_stop_string(self.tokenizer, req)
