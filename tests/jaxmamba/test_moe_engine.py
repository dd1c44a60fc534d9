"""MoE hybrids through the serving engine: greedy tokens equal transformers' (cache-free ``generate``).

Plain (whole prompts), chunked prefill with preemption, prefix caching (mode ``all``) and
speculative decoding, for NemotronH with ``E`` blocks and GraniteMoeHybrid with experts. A
divergence is allowed only right after a near-tie (top-2 gap < 1e-4, ``assert_greedy_match``).
One explicit bucket per engine keeps compilation (the slow part on CPU) short.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.random_checkpoint import MOE_VARIANTS

pytest.importorskip("torch")
pytest.importorskip("transformers")

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

_rng = np.random.default_rng(5)
SHARED = _rng.integers(3, 500, 40).tolist()
# Lengths 5..52: single tokens, prompts crossing the 16-token SSD chunk, two sharing 32 tokens of prefix,
# and a repetitive one the ngram proposer drafts from.
PROMPTS = [
    _rng.integers(3, 500, 5).tolist(),
    SHARED + _rng.integers(3, 500, 12).tolist(),
    [7],
    SHARED[:32] + [9, 9],
    (_rng.integers(3, 500, 6).tolist() * 4)[:23],
]

CONFIGS = {
    "plain": dict(max_num_seqs=4, max_num_batched_tokens=64, buckets=[(4, 64)]),
    # 8-token budget: prompts are chunked across steps; 8 usable KV blocks of 8 tokens hold the longest
    # request (58 tokens) but not three at once,
    # so requests are preempted and recomputed.
    "chunked": dict(max_num_seqs=3, max_num_batched_tokens=8, block_size=8, num_blocks=9, buckets=[(3, 8)]),
    "prefix_caching": dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=16, buckets=[(4, 32)],
                           enable_prefix_caching=True, mamba_cache_mode="all"),
    # The Pallas kernels (interpreted on CPU), the MoE experts through the Pallas grouped GEMM with them.
    "pallas_kernels": dict(max_num_seqs=4, max_num_batched_tokens=32, buckets=[(4, 32)], kernel_backend="pallas"),
    "spec_decode": dict(max_num_seqs=4, max_num_batched_tokens=32, buckets=[(4, 32)],
                        speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
}


class ReferenceProposer:
    """Drafts transformers' greedy continuation with every third draft made wrong, so verification both
    accepts and rejects (an ngram proposer rarely drafts a right token on a random model)."""

    def __init__(self, prompts, continuations, vocab: int):
        self.pairs, self.vocab = list(zip(prompts, continuations)), vocab

    def propose(self, token_ids, max_drafts):
        for prompt, cont in self.pairs:
            done = len(token_ids) - len(prompt)
            if token_ids[: len(prompt)] == prompt and token_ids[len(prompt):] == cont[:done]:
                drafts = cont[done: done + max_drafts]
                return [(t + 1) % self.vocab if (done + i) % 3 == 2 else t for i, t in enumerate(drafts)]
        return []


@pytest.fixture(scope="module", params=sorted(MOE_VARIANTS))
def reference(request, tmp_path_factory):
    """A checkpoint transformers wrote itself, and its greedy tokens + logits for every prompt."""
    from hf_reference import hf_checkpoint, hf_greedy

    path = hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    return request.param, path, [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_greedy_matches_transformers(reference, config):
    from hf_reference import assert_greedy_match

    variant, path, refs = reference
    llm = LLM(path, max_model_len=96, **CONFIGS[config])
    if config == "spec_decode":
        llm.proposer = ReferenceProposer(PROMPTS, [tokens for tokens, _ in refs], llm.cfg.vocab_size)
    if config == "prefix_caching":
        # The first prompt's blocks are cached before the rest arrive, so the later ones resume from hits.
        first = llm.generate(PROMPTS[1:2], GREEDY)
        outs = first + llm.generate(PROMPTS[:1] + PROMPTS[2:], GREEDY)
        order = [1, 0, 2, 3, 4]
    else:
        outs = llm.generate(PROMPTS, GREEDY)
        order = list(range(len(PROMPTS)))
    for out, i in zip(outs, order):
        assert out.error is None and out.finished
        tokens, logits = refs[i]
        assert_greedy_match(out.outputs[0].token_ids, tokens, logits, f"{variant}/{config}/prompt {i}")
    s = llm.stats
    if config == "chunked":
        assert s.num_preemptions > 0, "the tiny pool must force at least one preemption"
    if config == "prefix_caching":
        assert s.num_prefix_hit_tokens >= 32, "the shared 32-token prefix is served from the cache"
    if config == "spec_decode":
        assert 0 < s.num_accepted_draft_tokens < s.num_draft_tokens
    assert s.num_compilations == s.num_step_programs and s.backend_compiles_since_warmup == 0
    assert s.slots_in_use == 0 and s.blocks_in_use == 0
    llm.check_invariants()
