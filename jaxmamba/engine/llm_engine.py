"""``LLMEngine``: vLLM's request API (caller request ids, ``n`` samples, streamed ``RequestOutput``s, abort).

A caller request (``add_request(request_id, prompt, params)``) becomes ``n`` engine requests, its samples;
with ``n > 1`` sample ``i`` is the engine request ``f"{i}_{request_id}"`` seeded ``seed + i`` (as vLLM's
parallel sampling). ``step()`` runs one engine step and returns a ``RequestOutput`` for every caller request
that made progress in it, shaped by ``SamplingParams.output_kind``: ``CUMULATIVE`` (everything so far),
``DELTA`` (only the new tokens, text and logprobs) or ``FINAL_ONLY`` (one output, when it finishes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
from tqdm import tqdm

from jaxmamba.engine.core import EngineCore
from jaxmamba.engine.engine_args import EngineConfig
from jaxmamba.engine.gc_heap import frozen_heap
from jaxmamba.engine.request import (CompletionOutput, Request, RequestOutput, RequestOutputKind, SamplingParams,
                                     is_int)
from jaxmamba.errors import RequestError
from jaxmamba.host_profile import maybe_phase


@dataclass
class _Group:
    """One caller request: its ``n`` engine requests and what has been streamed of each."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Request]
    sent_tokens: list[int] = field(default_factory=list)  # DELTA: tokens already returned, per sample
    sent_text: list[int] = field(default_factory=list)  # DELTA: characters already returned, per sample
    # generate()'s own requests: its caller sees only the final outputs, so steps build none (a cumulative
    # output per running request per step made the host cost per token grow with the batch); generate builds
    # them all when it returns.
    final_only: bool = False

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.samples)


class LLMEngine:
    """vLLM's ``LLMEngine`` request API over an ``EngineCore`` (``engine_core``). ``LLMEngine(model,
    **engine_args)`` takes ``LLM``'s arguments and builds its core; given an ``EngineCore`` (or an ``LLM``
    or ``LLMEngine``, whose core it then drives) it builds nothing (``llm.llm_engine`` is the LLM's own)."""

    def __init__(self, model, **engine_args):
        core = model if isinstance(model, EngineCore) else getattr(model, "engine_core", None)
        if isinstance(core, EngineCore):
            if engine_args:
                raise RequestError(f"engine arguments {sorted(engine_args)} given with an already built engine")
            self.engine_core = core
        else:
            self.engine_core = EngineCore(model, EngineConfig(**engine_args))
        self._groups: dict[str, _Group] = {}  # unfinished caller requests
        self._of_sample: dict[str, _Group] = {}  # engine request id -> its caller request
        self._stash: list[RequestOutput] = []  # outputs of add_request callers that a generate call stepped past
        # Unfinished groups that stream (not final_only): while there is none, a step walks only the requests
        # that finished in it (counted here, not found by walking every group each step).
        self._num_streaming = 0
        # Ids of generate()'s groups that finished since it last looked (their outputs are built on return).
        self._finished_final: list[str] = []

    @classmethod
    def from_engine_config(cls, model, config: EngineConfig) -> LLMEngine:
        """An engine over a core built from an already validated ``EngineConfig``."""
        return cls(EngineCore(model, config))

    @property
    def tokenizer(self):
        return self.engine_core.tokenizer

    def get_tokenizer(self):
        return self.engine_core.tokenizer

    def completion(self, req: Request, index: int = 0) -> CompletionOutput:
        """The ``CompletionOutput`` of one sample so far (detokenised as far as it is final)."""
        return self.engine_core.completion(req, index)

    # ------------------------------------------------------------------ requests
    def _make_group(self, request_id: str, prompt, params: SamplingParams | None) -> _Group:
        """Validate a caller request fully and make its samples, queueing nothing (``RequestError`` if bad)."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id={request_id!r} must be a non-empty string")
        if request_id in self._groups:
            raise RequestError(f"request_id={request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        one = params if params.n == 1 else dataclasses.replace(params, n=1)  # frozen: shared as it is
        if params.n == 1:
            samples = [self.engine_core.new_request(prompt, one, request_id)]
        else:
            samples = [self.engine_core.new_request(prompt, dataclasses.replace(
                one, seed=None if params.seed is None else _wrap_int64(params.seed + i)), f"{i}_{request_id}")
                for i in range(params.n)]
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        return _Group(request_id, text, list(samples[0].prompt_token_ids), params, samples,
                      [0] * params.n, [0] * params.n)

    def _queue(self, group: _Group) -> None:
        self._groups[group.request_id] = group
        self._num_streaming += not group.final_only
        for req in group.samples:
            self._of_sample[req.request_id] = group
            self.engine_core.queue(req)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Validate and queue a caller request (all ``n`` samples or none); ``RequestError`` names the problem.
        ``prompt``: a string (needs the checkpoint's tokenizer), token ids, or vLLM's prompt dicts."""
        self._queue(self._make_group(request_id, prompt, params))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort caller requests (unknown or finished ids are ignored, as vLLM); their blocks and slots return
        to the pools at once, and no further output is returned for them."""
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            self._num_streaming -= not group.final_only
            self.engine_core.abort_request([r.request_id for r in group.samples])
            for req in group.samples:
                self._of_sample.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """One engine step; a ``RequestOutput`` per caller request that got tokens or finished in it.

        A step that fails finishes its requests with ``finish_reason="error"`` (``RequestOutput.error`` says
        why) and the engine goes on; ``KeyboardInterrupt`` propagates with the engine consistent, and the
        requests it ended are reported by the next ``step()``."""
        stashed, self._stash = self._stash, []
        try:
            finished = self.engine_core.step()
        except BaseException:
            self._stash = stashed
            raise
        with maybe_phase(self.engine_core.host_profile, "detokenize"):
            touched: dict[str, _Group] = {}
            # Only generate()'s final-only groups: nothing to show but the requests that finished (every one of
            # them is in ``finished``), so the rows that merely got a token are not walked.
            for req in [*self.engine_core.last_step, *finished] if self._num_streaming else finished:
                group = self._of_sample.get(req.request_id)
                # A final-only group has nothing to show until its samples finish (one of them is this one).
                if group is not None and not (group.final_only and not req.finished):
                    touched[group.request_id] = group
            outputs = []
            for group in touched.values():
                if group.final_only:
                    if group.finished:
                        self._forget(group)
                        self._finished_final.append(group.request_id)
                    continue
                out = self._output(group)
                if group.finished:
                    self._forget(group)
                if out is not None:
                    outputs.append(out)
        return stashed + outputs

    def _forget(self, group: _Group) -> None:
        if self._groups.pop(group.request_id, None) is not None:
            self._num_streaming -= not group.final_only
        for req in group.samples:
            self._of_sample.pop(req.request_id, None)

    def _output(self, group: _Group, kind: RequestOutputKind | None = None) -> RequestOutput | None:
        if kind is None:
            kind = RequestOutputKind.FINAL_ONLY if group.final_only else group.params.output_kind
        finished = group.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for i, req in enumerate(group.samples):
            full = self.completion(req, i)
            if kind is RequestOutputKind.DELTA:
                t0, c0 = group.sent_tokens[i], group.sent_text[i]
                if t0 < 0:  # its final delta was returned already
                    continue
                new_tokens = full.token_ids[t0:]
                text = full.text[c0:] if full.text is not None else None
                if not new_tokens and not text and not req.finished:
                    continue
                group.sent_tokens[i] = -1 if req.finished else len(full.token_ids)
                group.sent_text[i] = len(full.text) if full.text is not None else 0
                full = CompletionOutput(i, new_tokens, text, full.logprobs[t0:] if full.logprobs is not None else None,
                                        full.finish_reason, full.stop_reason, full.cumulative_logprob)
            completions.append(full)
        if not completions:
            return None
        errors = [r.error for r in group.samples if r.error]
        return RequestOutput(group.request_id, list(group.prompt_token_ids), completions, finished,
                             error=errors[0] if errors else None, prompt=group.prompt,
                             num_cached_tokens=group.samples[0].num_cached_tokens)

    # ------------------------------------------------------------------ offline generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True) -> list[RequestOutput]:
        """``LLM.generate``: validate all, queue all, step until this call's requests finish; atomic."""
        if _is_single_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        else:
            raise RequestError(f"sampling_params must be a SamplingParams or a list of them, "
                               f"not {type(sampling_params).__name__}")
        bad = [type(p).__name__ for p in params if not isinstance(p, SamplingParams)]
        if bad:
            raise RequestError(f"sampling params must be SamplingParams, got a {bad[0]}")
        slots: list[_Group | RequestOutput] = []
        for prompt, p in zip(prompts, params, strict=True):  # validate everything before queueing anything
            try:
                slots.append(self._make_group(f"gen-{self.engine_core.next_request_index()}", prompt, p))
            except RequestError as e:
                ids = prompt if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt) else []
                slots.append(RequestOutput("rejected", [int(t) for t in ids],
                                           [CompletionOutput(0, [], "", None, "error")], True, error=str(e),
                                           prompt=prompt if isinstance(prompt, str) else None))
        groups = [s for s in slots if isinstance(s, _Group)]
        for group in groups:
            group.final_only = True
        bar = None
        self._finished_final.clear()
        try:
            for group in groups:
                self._queue(group)
            bar = _progress_bar(use_tqdm, len(groups))
            pending = {g.request_id for g in groups}
            with frozen_heap():  # the start-up heap out of the loop's full collections (engine.gc_heap)
                while pending:
                    if not self.engine_core.has_unfinished_requests():
                        raise RuntimeError(f"engine idle with {len(pending)} requests of this call unfinished")
                    others = self.step()  # add_request callers' outputs (step() takes the stash: read it after)
                    self._stash += others  # their next step() returns them
                    finished = self._finished_final
                    if finished:
                        pending.difference_update(finished)
                        if bar is not None:
                            bar.update(len(finished))
                        finished.clear()
        except BaseException:
            # Nothing of this call may outlive it: a later call must not compute these requests.
            self.abort_request([g.request_id for g in groups])
            raise
        finally:
            self._finished_final.clear()
            if bar is not None:
                bar.close()
        # Every output built here, in one pass: a request's text decoded as it finished, between steps, found
        # the tokenizer's tables out of the CPU caches (~40 us a decode on the engine thread against ~5 us in
        # a row).
        with maybe_phase(self.engine_core.host_profile, "detokenize"):
            return [s if isinstance(s, RequestOutput) else self._output(s, RequestOutputKind.CUMULATIVE)
                    for s in slots]


def _progress_bar(use_tqdm, total: int):
    """vLLM's ``use_tqdm``: True, a tqdm bar shown only where stderr is a terminal (``disable=None``), so
    logs and pipes stay clean; a callable, the bar's class; False, None."""
    if not use_tqdm:
        return None
    bar_class = use_tqdm if callable(use_tqdm) else tqdm
    kwargs = {} if callable(use_tqdm) else {"disable": None}
    return bar_class(total=total, desc="Processed prompts", unit="prompt", **kwargs)


def _wrap_int64(seed: int) -> int:
    """``seed + i`` of sample ``i`` stays a valid seed at the top of the int64 range."""
    return (seed + 2**63) % 2**64 - 2**63


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, (str, dict)):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    return isinstance(prompts, (list, tuple)) and len(prompts) > 0 and is_int(prompts[0])
