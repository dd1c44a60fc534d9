"""Draft proposers for speculative decoding.

``NgramProposer`` is vLLM's prompt-lookup method: find the most recent earlier
occurrence of the sequence's last ``n`` tokens (``n`` from ``prompt_lookup_max``
down to ``prompt_lookup_min``) and propose the tokens that followed it.

``DraftModelProposer`` runs a smaller model of the same vocabulary greedily for
``k`` tokens. It keeps no cache of its own: every proposal re-reads the whole
sequence through the draft model's cache-free forward (right-padded to a
power-of-2 length; causal layers make the padding invisible), batched over the
running requests. That costs ``k`` draft forwards over the sequence per step --
fine for the small drafts this is for, and it means the draft has no state that
rejected tokens could corrupt. Its programs (one per length bucket) are
compiled when the engine starts, like the target's steps.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from jaxmamba.errors import ConfigError
from jaxmamba.weights import load_pretrained, with_dt_clamp


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]: ...


class BatchProposer(Protocol):
    def propose_batch(self, token_ids: Sequence[Sequence[int]], max_drafts: Sequence[int]) -> list[list[int]]: ...


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


class DraftModelProposer:
    """Greedy drafts from ``model`` (a ``HybridForCausalLM``) for up to ``max_num_seqs`` requests at once."""

    def __init__(self, model, num_speculative_tokens: int, *, max_num_seqs: int, max_model_len: int):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        self.k = num_speculative_tokens
        self.rows = max_num_seqs
        self.cfg = model.cfg  # the draft's config (its dt clamp included)
        # Room for the sequence plus the k-1 drafts fed back in; powers of two from 16.
        longest = max_model_len + self.k
        lengths, n = [], 16
        while n < longest:
            lengths.append(n)
            n *= 2
        self.lengths = tuple(lengths) + (longest,)
        graphdef, state = nnx.split(model)
        k = self.k

        def draft(state, ids, lens):
            """ids int32[rows, L] right-padded, lens int32[rows] -> drafts int32[rows, k]."""
            net = nnx.merge(graphdef, state)
            rows = jnp.arange(ids.shape[0])

            def one(i, carry):
                ids, out = carry
                pos = jnp.clip(lens - 1 + i, 0, ids.shape[1] - 1)
                tok = jnp.argmax(net(ids)[rows, pos], axis=-1).astype(jnp.int32)
                ids = ids.at[rows, jnp.clip(pos + 1, 0, ids.shape[1] - 1)].set(tok)
                return ids, out.at[:, i].set(tok)

            return jax.lax.fori_loop(0, k, one, (ids, jnp.zeros((ids.shape[0], k), jnp.int32)))[1]

        self._state = state
        self._compiled = {
            n: jax.jit(draft).lower(state, jax.ShapeDtypeStruct((self.rows, n), jnp.int32),
                                    jax.ShapeDtypeStruct((self.rows,), jnp.int32)).compile()
            for n in self.lengths
        }

    def propose_batch(self, token_ids: Sequence[Sequence[int]], max_drafts: Sequence[int]) -> list[list[int]]:
        if not token_ids:
            return []
        if len(token_ids) > self.rows:
            raise ConfigError(f"{len(token_ids)} sequences exceed the draft model's {self.rows} rows")
        need = max(len(t) for t in token_ids) + self.k
        n = next((n for n in self.lengths if n >= need), None)
        if n is None:
            raise ConfigError(f"a {need - self.k}-token sequence exceeds the draft model's length buckets")
        ids = np.zeros((self.rows, n), np.int32)
        lens = np.ones(self.rows, np.int32)
        for i, t in enumerate(token_ids):
            ids[i, : len(t)] = t
            lens[i] = len(t)
        drafts = np.asarray(self._compiled[n](self._state, ids, lens))
        return [drafts[i, : max(0, min(self.k, m))].tolist() for i, m in enumerate(max_drafts)]

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        return self.propose_batch([token_ids], [max_drafts])[0]


def make_proposer(speculative_config: dict, *, target_cfg=None, max_num_seqs: int = 1, max_model_len: int = 2048,
                  dtype: str = "float32", dt_clamp: str = "checkpoint") -> tuple[Proposer, int]:
    """``(proposer, num_speculative_tokens)`` from vLLM-style ``speculative_config``.

    ``draft_model`` needs ``"model"``: a checkpoint directory or a loaded ``HybridForCausalLM`` whose
    vocabulary matches ``target_cfg``'s. ``dt_clamp``: the draft's dt clamp, as the target's
    (``jaxmamba.weights.with_dt_clamp``): vLLM runs its draft through the same ``MambaMixer2``.
    """
    cfg = dict(speculative_config)
    method = cfg.pop("method", None)
    k = cfg.pop("num_speculative_tokens", None)
    if not isinstance(k, int) or k < 1:
        raise ConfigError(f"speculative_config.num_speculative_tokens={k!r} must be a positive integer")
    if method == "ngram":
        proposer = NgramProposer(k, cfg.pop("prompt_lookup_min", 1), cfg.pop("prompt_lookup_max", 4))
    elif method == "draft_model":
        draft = cfg.pop("model", None)
        if draft is None:
            raise ConfigError("speculative_config.method='draft_model' needs 'model' (a checkpoint path or model)")
        if cfg:
            raise ConfigError(f"speculative_config has unknown keys {sorted(cfg)}")
        if not hasattr(draft, "cfg"):
            draft = load_pretrained(draft, dtype=dtype)
        draft = with_dt_clamp(draft, dt_clamp)
        if target_cfg is not None and draft.cfg.vocab_size != target_cfg.vocab_size:
            raise ConfigError(f"speculative_config.model has vocab_size={draft.cfg.vocab_size}, the target "
                              f"{target_cfg.vocab_size}: draft and target must share a vocabulary")
        proposer = DraftModelProposer(draft, k, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    else:
        raise ConfigError(f"speculative_config.method={method!r} must be 'ngram' or 'draft_model'")
    if cfg:
        raise ConfigError(f"speculative_config has unknown keys {sorted(cfg)}")
    return proposer, k
