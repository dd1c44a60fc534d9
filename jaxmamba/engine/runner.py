"""Model runner: turns a ``SchedulerOutput`` into step metadata, runs the bucket's executable, returns samples."""

from __future__ import annotations

import contextlib
import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.buckets import Bucket, rank_buckets, select_bucket
from jaxmamba.cache import StateCaches
from jaxmamba.compile_progress import CompileProgress
from jaxmamba.engine.block_table import (DeviceBlockTable, DeviceTable, block_table_rows,
                                        default_update_capacity)
from jaxmamba.engine.input_batch import InputBatch, StepInputs
from jaxmamba.engine.prefix_cache import PrefixCacheManager
from jaxmamba.engine.scheduler import SchedulerOutput, cdiv
from jaxmamba.engine.sigint import deferred_sigint
from jaxmamba.engine.step_rows import StepRows
from jaxmamba.engine.token_inputs import draft_inputs, token_inputs
from jaxmamba.errors import SlotError
from jaxmamba.host_profile import HostProfile, maybe_phase
from jaxmamba.metadata import (
    CacheMode,
    build_common_metadata,
    build_mamba_metadata,
    pack,
)
from jaxmamba.metadata.mixed_step import MixedStepWriter
from jaxmamba.metadata.device_slots import DEVICE_SLOT_FIELDS
from jaxmamba.sampling import sampling_variant
from jaxmamba.steps import CompiledSteps, resolve_async_dispatch


#: Batch shapes whose bucket ``ModelRunner._select_bucket`` remembers before it starts afresh.
_MAX_REMEMBERED_SHAPES = 4096


@dataclass
class StepResult:
    """Per batch row (``S = 1 + num_spec`` positions, or ``num_scheduler_steps`` for a multi-step window): the
    row's new tokens are ``tokens[b, :num_accepted[b] + 1]`` (a window's row: one token per step it ran)."""

    rows: StepRows  # the step's rows in batch order (as the runner built its inputs)
    tokens: np.ndarray  # int32[num_reqs, S]
    num_accepted: np.ndarray  # int32[num_reqs]: drafts accepted
    # The logprob outputs are None when no request of the batch asked for logprobs (GREEDY variant).
    token_logprobs: np.ndarray | None  # float32[num_reqs, S]
    top_ids: np.ndarray | None  # int32[num_reqs, S, L]
    top_logprobs: np.ndarray | None  # float32[num_reqs, S, L]
    token_ranks: np.ndarray | None  # int32[num_reqs, S]: vLLM's rank of each token (1 = most likely)
    bucket: Bucket
    num_decodes: int  # leading batch rows the Mamba layers ran through the decode path

    @property
    def row_order(self) -> list[int]:
        """The scheduler row of each batch row."""
        return self.rows.order.tolist()


@dataclass
class InFlightStep:
    """A dispatched step whose outputs are still on the device (async scheduling reads them one step late)."""

    sched: SchedulerOutput
    rows: StepRows  # its rows in batch order
    bucket: Bucket
    num_decodes: int
    # -> (outputs, caches): the step's device arrays (verify_and_sample's six outputs, then last_tokens,
    # int32[max_rows]) and the caches it returns, once the dispatch thread has enqueued it.
    future: Future
    wants_logprobs: bool = True  # some row asked for logprobs (else only the sampled ids are read back)

    @functools.cached_property
    def batch_rows(self) -> dict[str, int]:
        """Request id -> its batch row (where its last sampled token sits); built when a next step's rows are
        not this step's in the same order (``token_inputs``)."""
        ids = self.rows.ids
        return dict(zip(ids, range(len(ids)), strict=True))


class ModelRunner:
    """Block-table rows, state-slot rows and the read window of every request come from ``kv``."""

    def __init__(self, model, caches: StateCaches, kv: PrefixCacheManager, *, buckets: tuple[Bucket, ...],
                 max_model_len: int, num_slots: int, num_blocks: int, backend: str, mesh=None,
                 target: str | None = None, on_compiled=None, compile_progress: bool = False,
                 sampling_variants: str = "auto", num_scheduler_steps: int = 1, compile: str = "eager",
                 executable_cache=None, progress=None, matmul_precision: str = "auto", restore: str = "background",
                 async_dispatch: str = "auto"):
        """``target``/``on_compiled``: see ``CompiledSteps`` (a GPU target compiles without running: ``plan``).
        ``compile_progress``: a progress bar (``compile_progress.CompileProgress``) counting the step programs
        as they are built; ``progress``: such a bar of the caller's instead. ``compile`` ("eager" or "lazy"),
        ``restore`` and ``executable_cache``: see ``CompiledSteps``.
        ``sampling_variants``: which buckets also get the greedy-only sampling tail (``steps.bucket_sampling_variants``).
        ``num_scheduler_steps``: pure-decode buckets also compile a window of that many decode steps (rows
        whose ``ScheduledRow.num_steps`` > 1 run in it). ``async_dispatch``: ``resolve_async_dispatch``'s mode."""
        self.cfg = model.cfg
        self.kv = kv
        self.block_size = kv.block_size
        self.cache_mode = kv.cache_mode
        self.max_model_len = max_model_len
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.blocks_per_req = cdiv(max_model_len, self.block_size)
        self.num_spec = num_spec = kv.num_spec
        self.mamba_columns = kv.num_state_columns  # the builder's rule, via the manager (docs/architecture.md, Rule 2)
        self._caches = caches
        self._pending: Future | None = None  # the last async dispatch (see dispatch); caches come from it
        self._dispatcher: ThreadPoolExecutor | None = None
        #: Async scheduling enqueues steps on the engine thread (``async_dispatch``; see ``_run_job``).
        self.dispatch_inline = resolve_async_dispatch(async_dispatch) == "inline"
        # Async scheduling: the last dispatched step, whose sampled tokens the next step may read on device.
        self._prev_step: InFlightStep | None = None
        # Async scheduling: steps read back (collect), which the next job drops on the dispatch thread: freeing
        # a step's device arrays cost the engine thread ~60 us a step (CPU client), its rows ~10 us more.
        self._retired: list[InFlightStep] = []
        self.profile: HostProfile | None = None  # the engine's host_profile
        self.interrupted = False  # Ctrl-C arrived during the last step (held back until it was recorded)
        # Multi-process: a StepWatchdog that ends the process when a step's outputs never come (a hung peer).
        self.watchdog = None
        # Shapes, dtypes and placements of the caches, to re-allocate them when a step that was given
        # them (donated) never returned its new ones (an exception or Ctrl-C while waiting for it).
        leaves, self._cache_treedef = jax.tree_util.tree_flatten(caches)
        self._cache_specs = [(a.shape, a.dtype, a.sharding) for a in leaves]
        layouts = {b: self._build(b, *self._warmup_batch(b), warmup=True)[0].layout for b in buckets}
        # Decode steps and mixed ones write their metadata straight into the buffer (metadata.decode_step,
        # metadata.mixed_step) in mode none without spec decode; any other batch runs the builders.
        self._writers = {b: self._step_writer(b, layouts[b]) for b in buckets}
        self._bucket_of: dict[tuple[int, int, bool, int], Bucket] = {}  # _select_bucket's answers
        self._bucket_of_among: tuple[Bucket, ...] | None = None  # ... among these built buckets
        self._ranked_buckets: tuple[Bucket, ...] = ()  # ... searched in this order (buckets.rank_buckets)
        # One persistent row per request a step can hold, plus the null row padding reads (_block_table).
        table_rows = block_table_rows(max(b.num_reqs for b in buckets))
        self.block_table: DeviceBlockTable | None = None  # a GPU target never runs a step
        # The Mamba state slots of each row, on the block table's rows (_state_indices).
        self.state_table: DeviceTable | None = None
        # The requests' sampling inputs, on the same rows as both tables (row_map).
        self.input_batch = InputBatch(table_rows)
        if target is None:
            from jax.sharding import NamedSharding, PartitionSpec

            replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
            capacity = default_update_capacity(max(b.num_tokens for b in buckets), table_rows - 1, self.block_size)
            self.block_table = DeviceBlockTable(table_rows, self.blocks_per_req, update_capacity=capacity,
                                                sharding=replicated, holds=kv.has_request,
                                                executable_cache=executable_cache)
            # A step changes at most what it allocates and releases: about twice the block table's entries.
            self.state_table = DeviceTable(table_rows, self.mamba_columns, update_capacity=2 * capacity,
                                           sharding=replicated, value_limit=num_slots, entry_name="state slots",
                                           executable_cache=executable_cache)
        if progress is None and compile_progress:
            progress = CompileProgress()
        try:
            self.steps = CompiledSteps(model, caches, buckets, layouts, backend=backend, num_spec=num_spec, mesh=mesh,
                                       target=target, on_compiled=on_compiled, sampling_variants=sampling_variants,
                                       block_table_rows=table_rows, state_table_columns=self.mamba_columns,
                                       num_scheduler_steps=num_scheduler_steps, compile=compile,
                                       executable_cache=executable_cache, progress=progress,
                                       matmul_precision=matmul_precision, restore=restore)
        except BaseException:
            if progress is not None:
                progress.close()
            raise

    # ------------------------------------------------------------------ metadata
    def _warmup_batch(self, bucket: Bucket):
        """A one-row batch of the bucket's kind: metadata layouts depend only on the bucket."""
        computed = np.array([1 if bucket.decode_only else 0], np.int32)
        return computed, np.array([1], np.int32), np.array([1], np.int32), np.ones((1, self.blocks_per_req), np.int32), \
            np.ones((1, self.mamba_columns), np.int32), np.ones(1, np.int32), np.full(1, -1, np.int32)

    def _build(self, bucket: Bucket, computed, scheduled, prompt, block_table, state_indices, accepted, prev_block,
               draft_counts=None, warmup=False, block_table_rows=None):
        """``block_table``/``state_indices``: the batch rows' tables (``int32[n, blocks_per_req]``,
        ``int32[n, mamba_columns]``), or with ``block_table_rows`` (``int32[n]``) the persistent tables' host
        mirrors and each batch row's row in them (the same rows in both): the builders then read only the
        entries the step uses (``build_common_metadata``, ``build_mamba_metadata``)."""
        common = build_common_metadata(
            num_reqs=len(computed), num_computed_tokens=computed, num_scheduled_tokens=scheduled,
            num_prompt_tokens=prompt, block_table=block_table, block_table_rows=block_table_rows,
            block_size=self.block_size,
            num_reqs_padded=bucket.num_reqs, num_tokens_padded=bucket.num_tokens, max_model_len=self.max_model_len,
            warmup=warmup, num_blocks=self.num_blocks, decode_threshold=1 + self.num_spec,
        )
        mamba = build_mamba_metadata(
            common, state_indices=state_indices, cache_mode=self.cache_mode, block_size=self.block_size,
            num_speculative_blocks=self.num_spec, num_accepted_tokens=accepted if self.num_spec else None,
            prev_step_last_block=prev_block if self.num_spec and self.cache_mode == CacheMode.ALL else None,
            chunk_size=self.cfg.mamba_chunk_size, num_slots=self.num_slots, num_decode_draft_tokens=draft_counts,
            num_prefills_padded=max(1, bucket.num_prefills),  # decode buckets carry one (unused) prefill row
            state_indices_rows=block_table_rows,
        )
        # Kept apart: the block table and the Mamba slot arrays are read on the device from the persistent tables.
        return pack(common, mamba, separate=("block_table", *DEVICE_SLOT_FIELDS)), common, mamba

    def _step_writer(self, bucket: Bucket, layout) -> MixedStepWriter | None:
        return MixedStepWriter.for_bucket(
            layout, num_reqs_padded=bucket.num_reqs, num_tokens_padded=bucket.num_tokens,
            num_prefills_padded=max(1, bucket.num_prefills), separate=("block_table", *DEVICE_SLOT_FIELDS),
            block_size=self.block_size, max_model_len=self.max_model_len, num_blocks=self.num_blocks,
            num_slots=self.num_slots, chunk_size=self.cfg.mamba_chunk_size, block_table_columns=self.blocks_per_req,
            cache_mode=self.cache_mode, num_spec=self.num_spec)

    # ------------------------------------------------------------------ execution
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Build the step's inputs, run its bucket, return its samples (synchronous: every token the step
        reads is known on the host); ``self.profile`` (a ``HostProfile``, or None) times the phases."""
        profile = self.profile
        with maybe_phase(profile, "metadata"):
            step = self._inputs(sched)
        if step.prev is not None:
            raise SlotError("a synchronous step cannot read tokens that a dispatched step has not returned")
        with deferred_sigint() as interrupts:
            with maybe_phase(profile, "transfer"):  # the tables' updates (under async scheduling: the dispatch thread's)
                tables = self._flush(step.tickets)
            outputs, self.caches = self.steps.run(step.bucket, self.caches, step.int_buf, step.float_buf, *tables,
                                                  profile, step.variant, step.multi, read_logprobs=step.wants_logprobs)
        # The engine raises KeyboardInterrupt once it has recorded this step's results.
        self.interrupted = bool(interrupts)
        return self._result(step.rows, outputs, step.bucket, step.num_decodes)

    def dispatch(self, sched: SchedulerOutput) -> InFlightStep:
        """Build the step's inputs and enqueue the step without waiting for it (async scheduling). Rows whose
        last token the previous dispatched step sampled read it on the device; ``collect`` returns the samples.

        With ``dispatch_inline`` False the executable is called on one dispatch thread, in order: XLA's CPU
        client runs a step on the calling thread when its inputs are fresh host buffers, which would serialise
        the host's work with the device's; the thread releases the GIL while the step runs. Each job takes
        its caches and ``prev_last_tokens`` from the job before it, and frees the steps ``collect`` read back
        since then (``_run_job``)."""
        profile = self.profile
        with maybe_phase(profile, "metadata"):
            inputs = self._inputs(sched)
        bucket, int_buf, float_buf, tickets, prev = (inputs.bucket, inputs.int_buf, inputs.float_buf, inputs.tickets,
                                                     inputs.prev)
        variant, multi, wants_logprobs = inputs.variant, inputs.multi, inputs.wants_logprobs
        before, caches = self._pending, self._caches
        steps, flush = self.steps, self._flush
        retired, self._retired = self._retired, []

        on_thread = profile is not None and not self.dispatch_inline  # inline, the engine's phases count it

        def job():
            nonlocal caches
            if on_thread:
                cpu_start = time.thread_time()
            try:
                if before is not None:
                    caches = before.result()[1]  # raises when that step failed: this one fails with it
                prev_tokens = None if prev is None else prev.future.result()[0][-1]
                outputs, new_caches = steps.dispatch(bucket, caches, int_buf, float_buf, *flush(tickets),
                                                     prev_tokens, None, variant, multi)
                # Start the copies ``collect`` reads now: on a GPU they then run as soon as the step ends, not
                # when the host asks (a no-op where the device is the host's memory).
                for out in outputs[: 6 if wants_logprobs else 2]:
                    if out is not None:
                        out.copy_to_host_async()
                if profile is not None:
                    profile.track_device(outputs[-1], submitted_at)
            finally:
                retired.clear()  # the last references to steps read back: their rows and arrays are freed here
                if on_thread:
                    profile.dispatch_thread_cpu_seconds += time.thread_time() - cpu_start
            return outputs, new_caches

        with maybe_phase(profile, "dispatch"):
            submitted_at = time.perf_counter()  # the job counts the step's device time from here
            future = self._run_job(job)
        self._pending = future
        step = InFlightStep(sched, inputs.rows, bucket, inputs.num_decodes, future, inputs.wants_logprobs)
        self._prev_step = step
        return step

    def _run_job(self, job) -> Future:
        """``job``'s future: run on the dispatch thread, or here where ``dispatch_inline`` (the device enqueues
        a step and returns, so the host goes on at once; then the engine's Python runs on one thread, whose
        caches another thread's interpreter work does not disturb). A Ctrl-C during an inline job is held back
        as in ``execute``: the engine raises it once it has recorded the step."""
        if not self.dispatch_inline:
            if self._dispatcher is None:
                self._dispatcher = ThreadPoolExecutor(1, thread_name_prefix="jaxmamba-dispatch")
            return self._dispatcher.submit(job)
        future: Future = Future()
        with deferred_sigint() as interrupts:
            try:
                future.set_result(job())
            except BaseException as e:  # noqa: BLE001 - collect raises it, as it raises a dispatch thread's
                future.set_exception(e)
        self.interrupted = self.interrupted or bool(interrupts)
        return future

    def collect(self, step: InFlightStep) -> StepResult:
        """Wait for a dispatched step and return its samples (raises what the step raised)."""
        watch = self.watchdog.watch(f"an engine step ({step.bucket})") if self.watchdog else contextlib.nullcontext()
        with deferred_sigint() as interrupts, watch:
            with maybe_phase(self.profile, "wait"):
                outputs = step.future.result()[0]
            outputs = self.steps.read(outputs, self.profile, step.wants_logprobs)
        self.interrupted = self.interrupted or bool(interrupts)
        self._retired.append(step)  # its rows and device arrays: dropped by the next job (see dispatch)
        if self._prev_step is step:
            self._prev_step = None  # every token it sampled is now known on the host
        return self._result(step.rows, outputs, step.bucket, step.num_decodes)

    @property
    def caches(self) -> StateCaches:
        """The newest caches: those the last dispatched step returns (waiting until it is enqueued)."""
        self._settle()
        return self._caches

    @caches.setter
    def caches(self, value: StateCaches) -> None:
        self._settle()
        self._caches = value

    def _settle(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            # A failed step: collect raises it; the donated caches read as lost.
            with contextlib.suppress(BaseException):
                self._caches = pending.result()[1]

    def forget_dispatched(self) -> None:
        """Drop the link to the last dispatched step (its results were discarded after a fault)."""
        self._prev_step = None
        self._settle()

    @staticmethod
    def _result(rows: StepRows, outputs, bucket: Bucket, num_decodes: int) -> StepResult:
        n = len(rows.reqs)
        tokens, num_accepted, lp, top_ids, top_lp, ranks = (None if a is None else a[:n] for a in outputs)
        return StepResult(rows, tokens, num_accepted, lp, top_ids, top_lp, ranks, bucket,
                          num_decodes)

    def _flush(self, tickets: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
        """The block table and the state table with the updates of the step of ``tickets`` written."""
        return self.block_table.flush(tickets[0]), self.state_table.flush(tickets[1])

    def _inputs(self, sched: SchedulerOutput) -> StepInputs:
        """The step's host inputs (``StepInputs``), rows in batch order, and the sampling variant that serves
        them (read off the same per-row temperatures the float buffer carries). Python work is per row, never
        per token of context (only the scheduled tokens are copied), and one pass over the rows
        (``StepRows.of``) reads what the rest needs as arrays; block-table and state-table rows are kept
        between steps (``_block_table``, ``_state_indices``), and the requests' sampling inputs sit on the same
        rows in ``self.input_batch``; ``tickets``: how far ``_flush`` writes the two device tables. ``prev``:
        the dispatched step whose sampled tokens some rows read on the device (their last token is a
        placeholder, ``Request.num_output_placeholders``), or None. ``multi``: some row runs a window of
        decode steps (``ScheduledRow.num_steps``): the bucket's multi-step program, ``int_buf`` ending with
        ``num_steps``."""
        rows = StepRows.of(sched, self.num_spec)
        drafts = rows.drafts
        row_map = self._block_table(rows.ids)
        # A prompt's last token can carry drafts (a prefix hit or an import leaves one token; a chunk
        # leaves one): as vLLM, such a row is a speculative decode, so its states land one per token.
        draft_counts = rows.draft_counts
        n = len(rows.ids)
        # A pure-decode bucket skips the prefill kernels, so it agrees with the Mamba builder's split
        # (StepRows.decode_only; docs/architecture.md, Rule 1), and a mixed one holds its prefill rows.
        decode_only, num_prefills = rows.decode_only, rows.num_prefills
        bucket = self._select_bucket(n, rows.num_tokens, decode_only, num_prefills)
        metadata, num_decodes = self._metadata(bucket, rows, row_map, draft_counts)

        r = bucket.num_reqs
        token_ids, prev_token_rows, prev = token_inputs(bucket, rows, self._prev_step)
        # Per-row counters padded to the bucket: the sampler's step counter (outputs so far, the ones still
        # on the device included), the drafts verified, the decode steps of the row's window.
        counters = np.zeros((3, r), np.int32)
        counters[0, :n], counters[1, :n], counters[2, :n] = rows.num_outputs, drafts, rows.num_steps
        draft_buf, logit_positions = draft_inputs(r, rows, self.num_spec)

        # Per-request inputs that never change while a request runs: gathered from the persistent batch at
        # the rows the tables gave the step (padding rows read NULL_ROW, which holds each array's fill).
        batch = self.input_batch
        # Only rows written from a new block list can hold another request than at their last step (a row
        # that changes hands, or a new admission, always brings a new list): the rest hold their inputs.
        fresh = self.block_table.new_lists
        if fresh:
            reqs = rows.reqs
            batch.assign(row_map[fresh], [reqs[i] for i in fresh])
        gathered = batch.gather(row_map, r)
        top_k, seed, min_tokens, wants = gathered.ints
        parts = [metadata, token_ids, top_k, seed, counters[0], counters[1], draft_buf, logit_positions, min_tokens,
                 gathered.ban_ids, prev_token_rows, gathered.row_maps, wants]
        multi = max(rows.column_lists()[6], default=1) > 1  # num_steps (a list: no numpy reduction, cold in a step)
        if multi and not self.steps.has_window(bucket):
            # No window program for this batch's bucket (buckets given by hand may have no pure-decode one):
            # one step, as scheduled before the window; the look-ahead blocks serve the next steps.
            rows.run_single_steps()
            multi = False
        if multi:
            parts.append(counters[2])
        int_buf = np.concatenate(parts, dtype=np.int32)
        float_buf = gathered.floats.reshape(-1)  # temperature, top_p, min_p: the float buffer's three parts
        wants_logprobs = gathered.wants_logprobs
        variant = sampling_variant(gathered.random, wants_logprobs, self.steps.sampling_variants[bucket])
        # The device tables are written when the step runs (DeviceTable.flush): their write numbers say how far.
        tickets = (self.block_table.ticket, self.state_table.ticket)
        return StepInputs(bucket, rows, int_buf, float_buf, tickets, num_decodes, prev, variant, multi,
                          wants_logprobs)

    def _select_bucket(self, num_reqs: int, num_tokens: int, decode_only: bool, num_prefills: int) -> Bucket:
        """``select_bucket`` over the built buckets, remembered per batch shape (a serving run meets a few
        hundred shapes; the search walks every bucket) while they stay the same: a lazy build adds buckets
        while serving, and a shape then moves to the smallest one that holds it."""
        built = self.steps.buckets
        if built is not self._bucket_of_among:
            self._bucket_of.clear()
            self._bucket_of_among = built
            self._ranked_buckets = rank_buckets(built)  # select_bucket's search order
        key = (num_reqs, num_tokens, decode_only, num_prefills)
        bucket = self._bucket_of.get(key)
        if bucket is None:
            bucket = select_bucket(self._ranked_buckets, num_reqs, num_tokens, decode_only, num_prefills, ranked=True)
            if len(self._bucket_of) >= _MAX_REMEMBERED_SHAPES:
                self._bucket_of.clear()
            self._bucket_of[key] = bucket
        return bucket

    def _metadata(self, bucket: Bucket, rows: StepRows, row_map: np.ndarray,
                  draft_counts: np.ndarray | None) -> tuple[np.ndarray, int]:
        """The packed metadata buffer (``int32[layout.size]``) and the number of leading decode rows: written
        straight into the buffer where a writer takes the batch (``DecodeStepWriter`` for a decode bucket,
        ``MixedStepWriter.write_mixed`` for a mixed one), else built and packed."""
        state_table = self._state_indices(rows.ids, row_map)
        writer = self._writers.get(bucket)
        if writer is not None and bucket.decode_only:
            buffer = writer.write(rows.computed, rows.prompt, row_map, self.block_table.mirror, state_table)
            if buffer is not None:
                return buffer, len(rows.ids)
        elif writer is not None:
            written = writer.write_mixed(rows.computed, rows.scheduled, rows.prompt, row_map, self.block_table.mirror,
                                         state_table)
            if written is not None:
                return written
        # Any other batch, or a value the writer's checks refuse (the builders then name it). Where the last
        # step left each request's state: the column of its last accepted token (spec decode), and in mode
        # all the block that step wrote. Only spec decode reads them.
        accepted = prev_block = None
        if self.num_spec:
            ids = rows.ids
            accepted = np.fromiter((self.kv.num_accepted_tokens(i) for i in ids), np.int32, len(ids))
            if self.cache_mode == CacheMode.ALL:
                prev_block = np.fromiter((self.kv.prev_step_last_block(i) for i in ids), np.int32, len(ids))
        packed, _, mamba = self._build(bucket, rows.computed, rows.scheduled, rows.prompt, self.block_table.mirror,
                                       state_table, accepted, prev_block, draft_counts, block_table_rows=row_map)
        return packed.buffer, int(mamba.num_decodes)

    def _block_table(self, ids: list[str]) -> np.ndarray:
        """``row_map``: each batch row's row in the persistent device table (``int32[len(ids)]``); the
        table's host mirror holds the same rows, which the metadata builder reads entry by entry (never a
        full-width ``[len(ids), blocks_per_req]`` copy: host work per step does not follow max_model_len).

        Each request keeps its device row between steps; a step writes only the entries that changed
        (normally the blocks allocated since the last step; a request's KV block list only grows until
        it is freed, and a new list is a new admission), and reads only the rows new to the table and those
        whose lists the cache manager made or grew since (``kv_lists_changed``), see
        ``DeviceBlockTable.sync_changed``."""
        kv = self.kv
        return self.block_table.sync_changed(ids, kv.kv_lists_changed, kv.kv_block_lists)

    def _state_indices(self, ids: list[str], row_map: np.ndarray) -> np.ndarray:
        """The state table's host mirror (``int32[rows, mamba_columns]``; batch row ``i`` is its row ``row_map[i]``,
        which the metadata builder reads entry by entry and checks), after writing the persistent device table
        at ``row_map`` where it changed.

        Mode ``none``: a request's slots are constant, written when it takes its row. Modes ``align``/``all``:
        the manager changes a request's list in place inside its window (``state_table_window``), so only
        that window is compared (``DeviceTable.write_rows``). The step gathers its slots from the device
        table (``metadata.device_slots``); the host no longer sends them."""
        kv = self.kv
        if self.cache_mode == CacheMode.NONE:
            # A request's slots are fixed at admission, when its block list is new too: only the rows the
            # block table wrote from a new list can need a write (check_tables verifies the rest).
            fresh = self.block_table.new_lists
            if fresh:
                fresh_ids = [ids[i] for i in fresh]
                # A list that never changes is a growing list that never grows (no window to read or compare).
                self.state_table.write_rows(fresh_ids, row_map[fresh], kv.state_table_lists(fresh_ids))
            return self.state_table.mirror
        windows = [kv.state_table_window(rid) for rid in ids]
        self.state_table.write_rows(ids, row_map, kv.state_table_lists(ids), windows)
        return self.state_table.mirror

    def check_tables(self, running) -> None:
        """``SlotError`` unless every running request that holds a table row finds there, on the host mirrors the
        device tables follow, its KV block list as the cache manager has it (and in mode none its state slots),
        and its own inputs in the persistent batch (``running``: the scheduler's running requests)."""
        kv_manager = self.kv
        for req in running:
            rid = req.request_id
            row = self.block_table.row_of(rid)
            if row is None or not kv_manager.has_request(rid):
                continue
            kv = kv_manager.kv_block_list(rid)
            if self.block_table.written_from(row) is not kv:
                continue  # not in a step since this admission (or its row went to another request)
            if self.block_table.mirror[row, : len(kv)].tolist() != kv:
                raise SlotError(f"request {rid!r}: block-table row {row} does not hold its KV blocks {kv}")
            # Mode none's slots are fixed at admission (the state table is written at new lists only); the prefix
            # modes' change in place after a step, and the next step's write compares their window.
            slots = kv_manager.state_table_list(rid)
            if self.cache_mode == CacheMode.NONE and self.state_table.mirror[row, : len(slots)].tolist() != slots:
                raise SlotError(f"request {rid!r}: state-table row {row} does not hold its state slots {slots}")
            if not self.input_batch.holds(row, req):
                raise SlotError(f"request {rid!r}: input-batch row {row} holds another request's inputs")

    def attach_caches(self, caches: StateCaches) -> None:
        """The caches, where the runner was built with their shapes only (``ShapeDtypeStruct`` leaves, while
        they were allocated): same shapes and dtypes, before any step."""
        leaves, treedef = jax.tree_util.tree_flatten(caches)
        if treedef != self._cache_treedef or [(a.shape, a.dtype) for a in leaves] != [
                (shape, dtype) for shape, dtype, _ in self._cache_specs]:
            raise ValueError("attach_caches: the caches differ from the shapes the runner was built with")
        self._cache_specs = [(a.shape, a.dtype, a.sharding) for a in leaves]
        self._caches = caches

    # ------------------------------------------------------------------ faults
    def caches_lost(self) -> bool:
        """True when the caches were donated to a step that never handed back new ones."""
        return any(a.is_deleted() for a in jax.tree_util.tree_leaves(self.caches))

    def reallocate_caches(self) -> None:
        """Fresh zero caches of the same shapes and placements (every state in them is lost: the
        engine re-queues or fails the requests that held state)."""
        zeros = [jnp.zeros(shape, dtype, device=sharding) for shape, dtype, sharding in self._cache_specs]
        self.caches = jax.tree_util.tree_unflatten(self._cache_treedef, zeros)
        # Every request is re-admitted from scratch (new KV block lists): start the tables afresh too.
        self.block_table.reset()
        self.state_table.reset()
        self.input_batch.forget()
