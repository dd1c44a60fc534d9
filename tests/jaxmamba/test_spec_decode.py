"""Speculative decoding: multi-slot Mamba state, verification, and rejected tokens leaving no trace."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams, load_pretrained, random_model
from jaxmamba.engine.spec_decode import NgramProposer, make_proposer
from jaxmamba.errors import ConfigError
from jaxmamba.model.greedy import greedy_generate

MAX_TOKENS = 10


class OracleProposer:
    """Proposes the known greedy continuation, with every ``corrupt_every``-th draft made wrong.

    ``corrupt_every=0`` -> every draft is accepted; 1 -> none is.
    """

    def __init__(self, prompts, continuations, corrupt_every: int, vocab: int):
        self.pairs = list(zip(prompts, continuations))
        self.corrupt_every, self.vocab = corrupt_every, vocab

    def propose(self, token_ids, max_drafts):
        for prompt, cont in self.pairs:
            done = len(token_ids) - len(prompt)
            if token_ids[: len(prompt)] == prompt and token_ids[len(prompt):] == cont[:done]:
                drafts = cont[done : done + max_drafts]
                c = self.corrupt_every
                return [(t + 1) % self.vocab if c and i % c == c - 1 else t for i, t in enumerate(drafts)]
        return []


@pytest.fixture(scope="module", params=["nemotron_h", "bamba"])
def setup(request, tmp_path_factory):
    path = random_model(request.param, path=tmp_path_factory.mktemp(request.param) / "ckpt")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (5, 23, 1, 17, 9)]
    ref, _ = greedy_generate(load_pretrained(path), prompts, MAX_TOKENS)
    return path, prompts, ref


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# One mixed bucket per engine keeps compilation (the slow part on CPU) to one program.
ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, buckets=[(4, 32)])


@pytest.fixture(scope="module")
def engines(setup):
    """One engine per k for the module (engines are reused across acceptance levels)."""
    path = setup[0]
    cache = {}

    def get(k):
        if k not in cache:
            cache[k] = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": k}, **ENGINE_ARGS)
        return cache[k]

    return get


def _stats_delta(llm, before):
    after = llm.stats
    return {f: getattr(after, f) - before[f] for f in before}


@pytest.mark.parametrize("k,corrupt_every", [(1, 0), (2, 1), (3, 2), (4, 0), (4, 3)])
def test_greedy_spec_decoding_is_token_identical(setup, engines, k, corrupt_every):
    path, prompts, ref = setup
    llm = engines(k)
    llm.proposer = OracleProposer(prompts, ref, corrupt_every, llm.cfg.vocab_size)
    fields = ("num_draft_tokens", "num_accepted_draft_tokens", "num_steps")
    before = {f: getattr(llm.stats, f) for f in fields}
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    d = _stats_delta(llm, before)
    s = llm.stats
    assert d["num_draft_tokens"] > 0
    if corrupt_every == 0:
        assert d["num_accepted_draft_tokens"] == d["num_draft_tokens"], "every correct draft is accepted"
        assert d["num_steps"] < len(prompts) * MAX_TOKENS / 2, "accepting drafts takes fewer steps"
    elif corrupt_every == 1:
        assert d["num_accepted_draft_tokens"] == 0, "every wrong draft is rejected"
    else:
        assert 0 < d["num_accepted_draft_tokens"] < d["num_draft_tokens"]
    assert s.slots_in_use == 0 and s.blocks_in_use == 0
    assert s.num_compilations == s.num_step_programs and s.backend_compiles_since_warmup == 0


def test_cache_holds_the_speculative_slots(engines):
    llm = engines(3)
    conv, ssm = llm.runner.caches.conv[0], llm.runner.caches.ssm[0]
    cfg = llm.cfg
    assert conv.shape == (4 * 4 + 1, cfg.mamba_conv_dim, cfg.mamba_conv_kernel - 1 + 3)  # K-1+num_spec rows
    assert ssm.shape[0] == 4 * 4 + 1  # (1 + num_spec) slots per request, plus the null slot
    assert llm.runner.mamba_columns == 1 + 3  # Rule 2: mode none has 1 + num_speculative_blocks columns


def test_sampled_spec_decoding_is_reproducible_and_accepts(setup, engines):
    path, prompts, ref = setup
    llm = engines(2)
    llm.proposer = OracleProposer(prompts, ref, 0, llm.cfg.vocab_size)
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=MAX_TOKENS, seed=11, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert a == b
    assert all(len(t) == MAX_TOKENS for t in a)
    assert a != ref, "temperature 0.7 should not reproduce greedy everywhere"
    assert llm.stats.num_accepted_draft_tokens > 0


@pytest.mark.parametrize("draft,k", [("target", 4), ("unrelated", 2)])
def test_draft_model_spec_decoding_is_token_identical(setup, tmp_path, draft, k):
    """A draft model proposes greedily; the target's verification keeps the output exactly greedy.

    The target as its own draft agrees on (nearly) every token; an unrelated random model almost never.
    """
    path, prompts, ref = setup
    draft_path = path if draft == "target" else random_model("nemotron_h", seed=7, path=tmp_path / "draft")
    llm = LLM(path, speculative_config={"method": "draft_model", "num_speculative_tokens": k, "model": str(draft_path)},
              **ENGINE_ARGS)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    s = llm.stats
    assert s.num_draft_tokens > 0
    if draft == "target":
        assert s.acceptance_rate > 0.9
        assert s.num_steps < len(prompts) * MAX_TOKENS / 2
    else:
        assert s.acceptance_rate < 0.5
    assert s.backend_compiles_since_warmup == 0, "the draft's programs are compiled at start-up too"
    assert s.slots_in_use == 0


def test_draft_model_must_share_the_vocabulary(setup, tmp_path):
    path = setup[0]
    small_vocab = random_model("nemotron_h", path=tmp_path / "v256", vocab_size=256)
    with pytest.raises(ConfigError, match="vocab"):
        LLM(path, speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": str(small_vocab)},
            **ENGINE_ARGS)
    with pytest.raises(ConfigError, match="needs 'model'"):
        make_proposer({"method": "draft_model", "num_speculative_tokens": 2})


def test_ngram_proposer_finds_the_latest_match():
    p = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert p.propose([5, 6, 7], 3) == []
    assert p.propose([4, 4, 4, 4], 2) == [4]  # the only earlier match is one position back
    assert p.propose([1, 2, 1, 2], 0) == []


def test_bad_speculative_configs_name_the_field():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        make_proposer({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="method"):
        make_proposer({"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="unknown keys"):
        make_proposer({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1})
