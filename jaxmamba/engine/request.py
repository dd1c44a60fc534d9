"""Requests and outputs, shaped like vLLM's (``SamplingParams``, ``RequestOutput``, ``Logprob``).

``SamplingParams`` validates every field's type and range when it is made, so a
request that reaches the scheduler can never fail inside a step because of its
parameters (a seed that does not fit the device's integers, a stop id that is
not an int, a NaN temperature). Fields vLLM has that need sampling inputs the
compiled step does not take yet are refused by name, never ignored.
"""

from __future__ import annotations

import collections.abc
import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

from jaxmamba.errors import RequestError
from jaxmamba.sampling import MAX_LOGPROBS

#: vLLM's OpenAI server takes seeds in torch.long's range; ``SamplingParams`` itself takes any int.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: vLLM's ``VLLM_MAX_N_SEQUENCES`` default.
MAX_N = 16384


def device_seed(seed: int) -> int:
    """A request seed (any int64, as vLLM takes) as the int32 the compiled step keys its sampler with.

    Seeds in ``[0, 2**32)`` keep their value (reinterpreted as int32; the step reads it back as uint32),
    so they sample as they always did; others are mixed down to 32 bits (splitmix64), which keeps
    distinct seeds distinct with probability ``1 - 2**-32``."""
    if not 0 <= seed < 2**32:
        z = (seed + 0x9E3779B97F4A7C15) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        seed = (z ^ (z >> 31)) % 2**32
    return seed - 2**32 if seed >= 2**31 else seed


class RequestOutputKind(enum.Enum):
    """As vLLM: what each ``RequestOutput`` of a running request carries."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


def is_int(value) -> bool:
    """A Python or numpy integer (``bool`` is not one here: ``True`` is no token id)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_utf8(text: str, name: str) -> None:
    """``RequestError`` if ``text`` cannot be encoded as UTF-8 (a lone surrogate, e.g. from bytes decoded
    with ``errors="surrogateescape"``): no tokenizer can read it, and no response could echo it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{name} is not valid UTF-8 text: {e.reason} at character {e.start} "
                           f"({ascii(text[max(0, e.start - 8):e.end])})") from None


def _int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    if not is_int(value):
        raise RequestError(f"{name}={value!r} must be an int, not {type(value).__name__}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise RequestError(f"{name}={value} must be in {bounds}")
    return value


def _float(name: str, value) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise RequestError(f"{name}={value!r} must be a number, not {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise RequestError(f"{name}={value} must be a finite number")
    return value


def _int_list(name: str, value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple)):
        raise RequestError(f"{name}={value!r} must be a list of ints, not {type(value).__name__}")
    return tuple(dict.fromkeys(_int(f"{name}[{i}]", t, 0) for i, t in enumerate(value)))


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's names, defaults and validation; ``temperature=0`` is greedy.

    Implemented: ``n``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop`` (strings, needs the
    checkpoint's tokenizer), ``stop_token_ids``, ``include_stop_str_in_output``, ``ignore_eos``,
    ``max_tokens``, ``logprobs`` (at most ``MAX_LOGPROBS``), ``detokenize``, ``skip_special_tokens``,
    ``output_kind``, ``min_p``, ``min_tokens`` (bans EOS and stop ids on device until then; at most
    ``MAX_BANNED_IDS`` of them). Refused when set away from their defaults (``RequestError`` naming the
    field): ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` (they change the
    logits inside the compiled step, which takes no per-row inputs for them yet) and ``prompt_logprobs``
    (the step returns logits at sampled positions only).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled (vLLM uses -1 or 0)
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        put("n", _int("n", self.n, 1, MAX_N))
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = _float(name, getattr(self, name))
            if not lo <= v <= hi:
                raise RequestError(f"{name}={v} must be in [{lo}, {hi}]")
            put(name, v)
        put("repetition_penalty", _float("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty={self.repetition_penalty} must be > 0")
        put("temperature", _float("temperature", self.temperature))
        if self.temperature < 0.0:  # as vLLM: any finite temperature >= 0 (OpenAI's [0, 2] is not enforced)
            raise RequestError(f"temperature={self.temperature} must be >= 0")
        put("top_p", _float("top_p", self.top_p))
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p={self.top_p} must be in (0, 1]")
        put("top_k", _int("top_k", self.top_k))
        if self.top_k < -1:
            raise RequestError(f"top_k={self.top_k} must be -1, 0 (disabled) or positive")
        put("min_p", _float("min_p", self.min_p))
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p={self.min_p} must be in [0, 1]")
        if self.seed is not None:
            put("seed", _int("seed", self.seed, SEED_MIN, SEED_MAX))
            if self.seed == -1:  # as vLLM: -1 means "no seed"
                put("seed", None)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise RequestError(f"stop={stop!r} must be a string or a list of strings")
        if any(not s for s in stop):
            raise RequestError("stop cannot contain an empty string")
        put("stop", tuple(dict.fromkeys(stop)))
        put("stop_token_ids", _int_list("stop_token_ids", self.stop_token_ids))
        for name in ("include_stop_str_in_output", "ignore_eos", "detokenize", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.max_tokens is not None:  # None, as vLLM: until a stop or max_model_len
            put("max_tokens", _int("max_tokens", self.max_tokens, 1))
        put("min_tokens", _int("min_tokens", self.min_tokens, 0, self.max_tokens))
        if self.logprobs is not None:
            put("logprobs", _int("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        if self.prompt_logprobs is not None:
            put("prompt_logprobs", _int("prompt_logprobs", self.prompt_logprobs, -1))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise RequestError(f"output_kind={self.output_kind!r} must be a RequestOutputKind")
        if self.stop and not self.detokenize:
            raise RequestError("stop strings need detokenize=True")
        if self.temperature == 0.0 and self.n > 1:
            raise RequestError(f"n={self.n} needs sampling: greedy (temperature=0) gives n identical outputs")
        # Valid as vLLM, but not served here: refuse rather than ignore.
        for name, default, why in UNSUPPORTED:
            if getattr(self, name) != default:
                raise RequestError(f"{name}={getattr(self, name)!r} is not supported by jaxmamba yet ({why}); "
                                   f"leave it at {default!r}")


_STEP_INPUT = "it changes logits inside the compiled step, which has no per-row input for it"
#: (field, default, why) of vLLM sampling fields that are refused when set.
UNSUPPORTED = (
    ("presence_penalty", 0.0, _STEP_INPUT),
    ("frequency_penalty", 0.0, _STEP_INPUT),
    ("repetition_penalty", 1.0, _STEP_INPUT),
    ("prompt_logprobs", None, "the compiled step returns logits at sampled positions only"),
)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """A request's host-side state as the scheduler sees it (one of a caller request's ``n`` samples).

    Compared by identity (``eq=False``): it is a mutable entity, and field-wise equality made every
    ``req in running`` compare whole token lists.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # per-request sampling seed (params.seed or drawn by the engine), an int32 for the device
    arrival: int  # order of arrival, for FCFS and preemption order
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, "Logprob"]] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why it finished with "error"
    # Proposed for the next step, not yet verified; ``()`` (one shared object) when none, so that the per-row
    # test of it in every step reads no object of this request's own.
    draft_token_ids: Sequence[int] = ()
    # Async scheduling: tokens sampled by a dispatched step that the host has not read back (vLLM's name);
    # counted in num_computed_tokens and in what the next step schedules, not in output_token_ids.
    num_output_placeholders: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # tokens served by the prefix cache at the last admission
    prefill_until: int = 0  # tokens known at the last admission: all of them run as prompt
    stop_text: str | None = None  # output text cut at a stop string, once one matched
    min_tokens_ban: tuple[int, ...] = ()  # EOS and stop ids banned until params.min_tokens outputs
    arrival_time: float = 0.0  # time.monotonic() when queued (metrics)
    first_token_time: float | None = None
    # Outputs at which a length stop ends it (max_tokens, or max_model_len's room past the prompt): set at
    # admission (Scheduler._start), read by the scheduler and by StepLoop._stop_rule.
    max_outputs: int = 0
    # StepLoop._stop_rule's (stop ids, max_outputs, general) for this request, worked out on first use.
    stop_rule: tuple | None = None
    # engine.outputs.IncrementalText: the output text decoded so far, while the request streams.
    text_state: Any = field(default=None, repr=False)
    # len(prompt_token_ids), which never changes: the scheduler reads it for every running row each step, and
    # an int here costs no visit to the prompt's list.
    num_prompt_tokens: int = field(init=False, repr=False)

    def __post_init__(self):
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs: a new list of the whole sequence (``token_ids(start, stop)`` for a slice)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def token_view(self) -> "TokenView":
        """The sequence (prompt then outputs) as a read-only view: slicing it copies only the slice."""
        return TokenView(self)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without building the whole sequence (a step needs a few tokens)."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed as prompt in this run: the prompt, plus the outputs a preempted request recomputes."""
        return max(self.num_prompt_tokens, self.prefill_until)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


class TokenView(collections.abc.Sequence):
    """``Request.all_token_ids`` without the copy: the prefix cache hashes a few new blocks per step, and
    building the whole sequence for it made every step cost O(sequence length) per row."""

    __slots__ = ("_req",)

    def __init__(self, req: Request):
        self._req = req

    def __len__(self) -> int:
        return self._req.num_tokens

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self._req.all_token_ids[index]
            return self._req.token_ids(start, max(start, stop))
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError(index)
        p = len(self._req.prompt_token_ids)
        return self._req.prompt_token_ids[i] if i < p else self._req.output_token_ids[i - p]


class Logprob(float):
    """vLLM's ``Logprob`` (``logprob``, ``rank``, ``decoded_token``); also the float it holds, so code that
    reads logprobs as plain floats keeps working."""

    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, logprob)
        obj.rank, obj.decoded_token = rank, decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self):
        return (Logprob, (float(self), self.rank, self.decoded_token))


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str  # "" without a tokenizer, with detokenize=False, or for a rejected prompt (as vLLM)
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when the request was rejected or failed; the rest of the batch still ran
    prompt: str | None = None
    prompt_logprobs: Any = None  # always None: prompt_logprobs is refused
    num_cached_tokens: int = 0
