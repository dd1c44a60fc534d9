"""Requests and outputs, shaped like vLLM's (``SamplingParams``, ``RequestOutput``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

from jaxmamba.errors import RequestError
from jaxmamba.sampling import MAX_LOGPROBS


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's names and defaults; ``temperature=0`` is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled (vLLM uses -1 or 0)
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    logprobs: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise RequestError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise RequestError(f"top_k={self.top_k} must be -1, 0 (disabled) or positive")
        if self.max_tokens is None or self.max_tokens <= 0:
            raise RequestError(f"max_tokens={self.max_tokens} must be > 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs={self.logprobs} must be in [0, {MAX_LOGPROBS}]")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """A request's host-side state as the scheduler sees it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # per-request sampling seed (params.seed or drawn by the engine)
    arrival: int  # order of arrival, for FCFS and preemption order
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step, not yet verified
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # tokens served by the prefix cache at the last admission
    prefill_until: int = 0  # tokens known at the last admission: all of them run as prompt

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed as prompt in this run: the prompt, plus the outputs a preempted request recomputes."""
        return max(self.num_prompt_tokens, self.prefill_until)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when the request was rejected; the rest of the batch still ran
