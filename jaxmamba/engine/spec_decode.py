"""Draft proposers for speculative decoding.

``NgramProposer`` is vLLM's prompt-lookup method: find the most recent earlier
occurrence of the sequence's last ``n`` tokens (``n`` from ``prompt_lookup_max``
down to ``prompt_lookup_min``) and propose the tokens that followed it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from jaxmamba.errors import ConfigError


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]: ...


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min={prompt_lookup_min} / prompt_lookup_max={prompt_lookup_max} "
                              "must satisfy 1 <= min <= max")
        self.k = num_speculative_tokens
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        k = min(self.k, max_drafts)
        if k <= 0:
            return []
        toks = np.asarray(token_ids)
        for n in range(min(self.n_max, len(toks) - 1), self.n_min - 1, -1):
            suffix = toks[-n:]
            # Candidate starts of an earlier occurrence (not the suffix itself), most recent first.
            windows = np.lib.stride_tricks.sliding_window_view(toks[:-1], n)
            hits = np.nonzero((windows == suffix).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n
                return toks[start : start + k].tolist()
        return []


def make_proposer(speculative_config: dict) -> tuple[Proposer, int]:
    """``(proposer, num_speculative_tokens)`` from vLLM-style ``speculative_config``."""
    cfg = dict(speculative_config)
    method = cfg.pop("method", None)
    k = cfg.pop("num_speculative_tokens", None)
    if not isinstance(k, int) or k < 1:
        raise ConfigError(f"speculative_config.num_speculative_tokens={k!r} must be a positive integer")
    if method == "ngram":
        proposer = NgramProposer(k, cfg.pop("prompt_lookup_min", 1), cfg.pop("prompt_lookup_max", 4))
    elif method == "draft_model":
        raise ConfigError("speculative_config.method='draft_model' is not implemented yet; use 'ngram'")
    else:
        raise ConfigError(f"speculative_config.method={method!r} must be 'ngram'")
    if cfg:
        raise ConfigError(f"speculative_config has unknown keys {sorted(cfg)}")
    return proposer, k
