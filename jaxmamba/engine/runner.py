"""Model runner: turns a ``SchedulerOutput`` into step metadata, runs the bucket's executable, returns samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxmamba.cache import StateCaches
from jaxmamba.engine.scheduler import SchedulerOutput, cdiv
from jaxmamba.metadata import (
    build_common_metadata,
    build_mamba_metadata,
    mamba_block_table_columns,
    pack,
    reorder_batch,
)
from jaxmamba.steps import Bucket, CompiledSteps, select_bucket


@dataclass
class StepResult:
    """Per batch row (``S = 1 + num_spec`` positions): the row's new tokens are ``tokens[b, :num_accepted[b] + 1]``."""

    row_order: list[int]  # scheduler row index of each batch row
    tokens: np.ndarray  # int32[num_reqs, S]
    num_accepted: np.ndarray  # int32[num_reqs]: drafts accepted
    token_logprobs: np.ndarray  # float32[num_reqs, S]
    top_ids: np.ndarray  # int32[num_reqs, S, L]
    top_logprobs: np.ndarray  # float32[num_reqs, S, L]
    bucket: Bucket


class ModelRunner:
    def __init__(self, model, caches: StateCaches, *, buckets: tuple[Bucket, ...], block_size: int,
                 max_model_len: int, num_slots: int, num_blocks: int, backend: str, num_spec: int = 0, mesh=None):
        self.cfg = model.cfg
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.blocks_per_req = cdiv(max_model_len, block_size)
        self.num_spec = num_spec
        self.mamba_columns = mamba_block_table_columns("none", max_model_len, block_size, num_spec)
        self.caches = caches
        layouts = {b: self._build(b, *self._warmup_batch(b), warmup=True)[0].layout for b in buckets}
        self.steps = CompiledSteps(model, caches, buckets, layouts, backend=backend, num_spec=num_spec, mesh=mesh)

    # ------------------------------------------------------------------ metadata
    def _warmup_batch(self, bucket: Bucket):
        """A one-row batch of the bucket's kind: metadata layouts depend only on the bucket."""
        computed = np.array([1 if bucket.decode_only else 0], np.int32)
        return computed, np.array([1], np.int32), np.array([1], np.int32), np.ones((1, self.blocks_per_req), np.int32), \
            np.ones((1, self.mamba_columns), np.int32), np.ones(1, np.int32)

    def _build(self, bucket: Bucket, computed, scheduled, prompt, block_table, state_indices, accepted, warmup=False):
        common = build_common_metadata(
            num_reqs=len(computed), num_computed_tokens=computed, num_scheduled_tokens=scheduled,
            num_prompt_tokens=prompt, block_table=block_table, block_size=self.block_size,
            num_reqs_padded=bucket.num_reqs, num_tokens_padded=bucket.num_tokens, max_model_len=self.max_model_len,
            warmup=warmup, num_blocks=self.num_blocks, decode_threshold=1 + self.num_spec,
        )
        mamba = build_mamba_metadata(
            common, state_indices=state_indices, cache_mode="none", block_size=self.block_size,
            num_speculative_blocks=self.num_spec, num_accepted_tokens=accepted if self.num_spec else None,
            chunk_size=self.cfg.mamba_chunk_size, num_slots=self.num_slots,
        )
        return pack(common, mamba), common, mamba

    # ------------------------------------------------------------------ execution
    def execute(self, sched: SchedulerOutput) -> StepResult:
        rows = sched.rows
        reqs = [r.request for r in rows]
        computed = np.array([r.num_computed_tokens for r in reqs], np.int32)
        scheduled = np.array([r.num_tokens for r in rows], np.int32)
        prompt = np.array([r.num_prompt_tokens for r in reqs], np.int32)
        drafts = np.array([r.num_drafts for r in rows], np.int32)
        order = np.asarray(reorder_batch(scheduled, computed < prompt, computed + scheduled,
                                         decode_threshold=1 + self.num_spec), np.int64)
        computed, scheduled, prompt, drafts = computed[order], scheduled[order], prompt[order], drafts[order]
        reqs = [reqs[i] for i in order]

        block_table = np.zeros((len(reqs), self.blocks_per_req), np.int32)
        for i, req in enumerate(reqs):
            block_table[i, : len(req.block_ids)] = req.block_ids
        state_indices = np.array([req.mamba_slots for req in reqs], np.int32)
        # The state of the last verified token was kept in column num_accepted_last - 1.
        accepted = np.array([req.num_accepted_last for req in reqs], np.int32)
        decode_only = bool(np.all((scheduled <= 1 + self.num_spec) & (computed > 0)))
        bucket = select_bucket(self.steps.buckets, len(reqs), int(scheduled.sum()), decode_only)
        packed, _, _ = self._build(bucket, computed, scheduled, prompt, block_table, state_indices, accepted)

        r, t, s = bucket.num_reqs, bucket.num_tokens, 1 + self.num_spec
        token_ids = np.zeros(t, np.int32)
        draft_buf = np.zeros((r, self.num_spec), np.int32)
        num_drafts = np.zeros(r, np.int32)
        logit_positions = np.zeros((r, s), np.int32)
        offset = 0
        for i, (req, c, n, d) in enumerate(zip(reqs, computed, scheduled, drafts)):
            known = req.all_token_ids[c : c + n - d]
            token_ids[offset : offset + n] = known + req.draft_token_ids[:d]
            draft_buf[i, :d] = req.draft_token_ids[:d]
            num_drafts[i] = d
            last = offset + n - 1
            # Position j holds the logits that verify draft j (j < d), then the bonus token's.
            logit_positions[i] = np.minimum(last - d + np.arange(s), last)
            offset += n
        top_k = np.zeros(r, np.int32)
        seeds = np.zeros(r, np.int32)
        steps = np.zeros(r, np.int32)
        temperature = np.zeros(r, np.float32)
        top_p = np.ones(r, np.float32)
        for i, req in enumerate(reqs):
            top_k[i] = req.params.top_k
            seeds[i] = req.seed
            steps[i] = len(req.output_token_ids)
            temperature[i] = req.params.temperature
            top_p[i] = req.params.top_p
        int_buf = np.concatenate([packed.buffer, token_ids, top_k, seeds, steps, num_drafts, draft_buf.reshape(-1),
                                  logit_positions.reshape(-1)]).astype(np.int32)
        float_buf = np.concatenate([temperature, top_p]).astype(np.float32)

        (tokens, num_accepted, lp, top_ids, top_lp), self.caches = self.steps.run(bucket, self.caches, int_buf, float_buf)
        n = len(reqs)
        return StepResult([int(i) for i in order], tokens[:n], num_accepted[:n], lp[:n], top_ids[:n], top_lp[:n], bucket)
