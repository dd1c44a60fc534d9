"""Continuous batching with chunked prefill and recompute preemption (vLLM V1's policy, simplified).

Each step: running requests first (a decode takes one token; an unfinished
prompt takes what is left of the token budget), then waiting requests in
arrival order while rows, tokens, state slots and KV blocks last. When a running
request needs a KV block and none is free, the most recently arrived running
request is preempted: its slot and blocks go back to the pools and it restarts
later from scratch (recompute), keeping the tokens it has generated.

Every request owns ``1 + num_spec`` Mamba state slots (cache mode ``none``: the
decode step writes one state per verified token) and the attention blocks
covering its tokens. A decode row carries its draft tokens, if any.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from jaxmamba.cache import BlockPool, SlotPool
from jaxmamba.engine.request import Request, Status


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class ScheduledRow:
    request: Request
    num_tokens: int  # tokens computed for this request in this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last known token, so its logits pick the next one."""
        return self.request.num_computed_tokens + self.num_tokens >= self.request.num_tokens

    @property
    def num_drafts(self) -> int:
        """Draft tokens verified in this row (its tokens past the last known one)."""
        return max(0, self.request.num_computed_tokens + self.num_tokens - self.request.num_tokens)


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                 slot_pool: SlotPool, block_pool: BlockPool, max_model_len: int, num_spec: int = 0):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.slots = slot_pool
        self.blocks = block_pool
        self.max_model_len = max_model_len
        self.slots_per_request = 1 + num_spec
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ allocation
    def _blocks_needed(self, req: Request, num_new: int) -> int:
        return cdiv(req.num_computed_tokens + num_new, self.block_size) - len(req.block_ids)

    def _release(self, req: Request) -> None:
        self.slots.free(req.mamba_slots)
        req.mamba_slots = []
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.draft_token_ids = []
        req.num_accepted_last = 1

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []

        for req in sorted(self.running, key=lambda r: r.arrival):
            if req not in self.running or len(rows) == self.max_num_seqs or budget == 0:
                continue
            # A decode row verifies its drafts too; a short budget trims them.
            num_new = min(req.num_tokens - req.num_computed_tokens + len(req.draft_token_ids), budget)
            need = self._blocks_needed(req, num_new)
            while not self.blocks.can_allocate(need):
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req not in self.running:
                continue
            req.block_ids += self.blocks.allocate(need)
            rows.append(ScheduledRow(req, num_new))
            budget -= num_new

        while self.waiting and len(rows) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            need = self._blocks_needed(req, num_new)
            if not (self.slots.can_allocate(self.slots_per_request) and self.blocks.can_allocate(need)):
                break
            self.waiting.popleft()
            req.mamba_slots = self.slots.allocate(self.slots_per_request)
            req.block_ids += self.blocks.allocate(need)
            req.status = Status.RUNNING
            self.running.append(req)
            rows.append(ScheduledRow(req, num_new))
            budget -= num_new
        return SchedulerOutput(rows, preempted)
