"""What a request shows its caller: text (with stop strings and streaming hold-back), logprobs, completions.

``tokenizer`` is the checkpoint's ``tokenizers.Tokenizer`` or None (then there is no text and no stop
strings: ``LLM.new_request`` refuses stop strings without one).
"""

from __future__ import annotations

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
    text = tokenizer.decode(req.output_token_ids, skip_special_tokens=p.skip_special_tokens)
    hits = [(text.find(s), s) for s in p.stop if s in text]
    if not hits:
        return False
    at, stop = min(hits)
    req.stop_reason = stop
    req.stop_text = text[: at + len(stop)] if p.include_stop_str_in_output else text[:at]
    return True


def output_text(tokenizer, req: Request, *, final: bool) -> str:
    """The request's output text; before it finishes, without a trailing incomplete character or a tail
    that may still become a stop string (vLLM's ``output_text_buffer_length``), so that streamed text
    only ever grows. ``""`` without a tokenizer or with ``detokenize=False`` (vLLM's text is always a str)."""
    p = req.params
    if tokenizer is None or not p.detokenize:
        return ""
    if req.stop_text is not None:
        return req.stop_text
    text = tokenizer.decode(req.output_token_ids, skip_special_tokens=p.skip_special_tokens)
    if final:
        return text
    text = text.rstrip("\ufffd")
    if p.stop and not p.include_stop_str_in_output:
        text = text[: max(0, len(text) - (max(len(s) for s in p.stop) - 1))]
    return text


def completion_output(tokenizer, req: Request, index: int = 0) -> CompletionOutput:
    """vLLM's ``CompletionOutput`` of one sample, finished or not."""
    lps = req.output_logprobs if req.params.logprobs is not None else None
    cumulative = float(sum(e[t] for e, t in zip(lps, req.output_token_ids, strict=True))) if lps is not None else None
    return CompletionOutput(index, list(req.output_token_ids), output_text(tokenizer, req, final=req.finished),
                            list(lps) if lps is not None else None, req.finish_reason, req.stop_reason, cumulative)
