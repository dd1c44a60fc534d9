"""What a request shows its caller: text (with stop strings and streaming hold-back), logprobs, completions.

``tokenizer`` is the checkpoint's ``tokenizers.Tokenizer`` or None (then there is no text and no stop
strings: ``LLM.new_request`` refuses stop strings without one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxmamba.engine.request import CompletionOutput, Logprob, Request


def logprob_entry(tokenizer, req: Request, top_ids: np.ndarray, top_logprobs: np.ndarray, token: int,
                  token_logprob: float, token_rank: int) -> dict[int, Logprob]:
    """One output token's logprobs as vLLM returns them: the ``params.logprobs`` most likely tokens (ranks
    1..k) and the sampled token with its rank in the whole distribution."""
    k = req.params.logprobs
    if tokenizer is not None and req.params.detokenize:
        def decode(t):
            return tokenizer.decode([t], skip_special_tokens=False)
    else:
        def decode(t):
            return None
    entry = {int(i): Logprob(float(p), rank + 1, decode(int(i)))
             for rank, (i, p) in enumerate(zip(top_ids[:k], top_logprobs[:k], strict=True))}
    entry[token] = Logprob(token_logprob, token_rank, decode(token))
    return entry


def match_stop_string(tokenizer, req: Request) -> bool:
    """A stop string in the output text ends the request; its text is cut before it (or after it with
    ``include_stop_str_in_output``), as vLLM. Sets ``req.stop_reason`` and ``req.stop_text``."""
    p = req.params
    text = running_text(tokenizer, req)
    hits = [(text.find(s), s) for s in p.stop if s in text]
    if not hits:
        return False
    at, stop = min(hits)
    req.stop_reason = stop
    req.stop_text = text[: at + len(stop)] if p.include_stop_str_in_output else text[:at]
    return True


@dataclass(slots=True)
class IncrementalText:
    """A running request's output text, decoded a few tokens at a time (vLLM's incremental detokenization),
    so that streaming a request costs per step the decode of the tokens since the last step, not of its whole
    output. ``text``: the text of ``output_token_ids[:read]``; the next decode starts at ``prefix`` (the last
    step's ``read``), whose tokens give the new ones their left context (a SentencePiece space, a word
    piece), and keeps only what follows their own text."""

    text: str = ""
    prefix: int = 0
    read: int = 0


def running_text(tokenizer, req: Request) -> str:
    """``tokenizer.decode(req.output_token_ids)``, decoding only the tokens since the last call
    (``req.text_state``): the tokens up to ``read`` are text for good once their decode ends in a whole
    character (not in a replacement character, which a later token may complete)."""
    ids, skip = req.output_token_ids, req.params.skip_special_tokens
    state = req.text_state
    if state is None or state.read > len(ids):  # outputs never shrink; a new list starts afresh
        state = req.text_state = IncrementalText()
    if state.prefix < 0:  # incremental decoding gave up on this request (below)
        return tokenizer.decode(ids, skip_special_tokens=skip)
    if state.read == len(ids):
        return state.text
    before = tokenizer.decode(ids[state.prefix : state.read], skip_special_tokens=skip) if state.read else ""
    after = tokenizer.decode(ids[state.prefix :], skip_special_tokens=skip)
    if not after.startswith(before):
        # A decoder whose text of the longer window rewrites the shorter one's: whole decodes from now on.
        state.prefix = -1
        return tokenizer.decode(ids, skip_special_tokens=skip)
    new = after[len(before) :]
    if new.endswith("\ufffd"):  # an incomplete character: not text for good yet
        return state.text + new
    state.text += new
    state.prefix, state.read = state.read, len(ids)
    return state.text


def output_text(tokenizer, req: Request, *, final: bool) -> str:
    """The request's output text; before it finishes, without a trailing incomplete character or a tail
    that may still become a stop string (vLLM's ``output_text_buffer_length``), so that streamed text
    only ever grows (decoded incrementally, ``IncrementalText``). ``""`` without a tokenizer or with
    ``detokenize=False`` (vLLM's text is always a str)."""
    p = req.params
    if tokenizer is None or not p.detokenize:
        return ""
    if req.stop_text is not None:
        return req.stop_text
    if final:  # once per request: the whole output decoded in one piece
        return tokenizer.decode(req.output_token_ids, skip_special_tokens=p.skip_special_tokens)
    text = running_text(tokenizer, req).rstrip("\ufffd")
    if p.stop and not p.include_stop_str_in_output:
        text = text[: max(0, len(text) - (max(len(s) for s in p.stop) - 1))]
    return text


def completion_output(tokenizer, req: Request, index: int = 0) -> CompletionOutput:
    """vLLM's ``CompletionOutput`` of one sample, finished or not."""
    lps = req.output_logprobs if req.params.logprobs is not None else None
    cumulative = float(sum(e[t] for e, t in zip(lps, req.output_token_ids, strict=True))) if lps is not None else None
    return CompletionOutput(index, list(req.output_token_ids), output_text(tokenizer, req, final=req.finished),
                            list(lps) if lps is not None else None, req.finish_reason, req.stop_reason, cumulative)
