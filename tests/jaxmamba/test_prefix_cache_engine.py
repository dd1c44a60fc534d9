"""Prefix caching in the engine: hits skip computation and change no token.

The host-side manager has its own tests (test_prefix_cache.py); here the whole
engine runs: a hit restores the attention KV blocks and the Mamba (conv, SSM)
slot at the last cached block end, and the rest of the prompt runs on top of it.
Every token is checked against the cache-free whole-sequence model
(``greedy_generate``); on these random tiny models a greedy divergence is
allowed only after a near-tie (top-2 logit gap < 1e-4, ``assert_greedy_match``).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams, load_pretrained, random_model
from jaxmamba.errors import ConfigError
from jaxmamba.metadata import mamba_block_table_columns
from jaxmamba.model.greedy import greedy_generate

BLOCK = 16  # the tiny models' SSD chunk is 16: block ends are chunk ends
MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, block_size=BLOCK, buckets=[(4, 32)])

_rng = np.random.default_rng(11)
SHARED = _rng.integers(3, 500, 40).tolist()  # 2.5 blocks
P0 = SHARED + _rng.integers(3, 500, 5).tolist()  # 45 tokens
P1 = SHARED + _rng.integers(3, 500, 12).tolist()  # 52: shares blocks 0-1 with P0
WAVES = [
    [P0],
    [
        P1,
        SHARED[:32] + [7],  # whole blocks plus one token: the hit leaves a 1-token extend (decode path)
        SHARED[:32],  # exactly two blocks: the hit must stop before the last token
        list(P0),  # a repeat: its third block was never full, so blocks 0-1
    ],
    [P1 + _rng.integers(3, 500, 18).tolist()],  # extends P1: block 2 was computed in P1's second step
]
# Tokens served from the cache per request, by mode. align keeps a state only where a step ends on a
# block end (P0's first chunk ends at 32, so block 0 has KV but no state); all keeps every block end.
EXPECTED_HITS = {
    "align": [[0], [32, 32, 0, 32], [48]],
    "all": [[0], [32, 32, 16, 32], [48]],
}


def _run_waves(llm, waves):
    """Each wave is added once the previous one has finished; returns the requests per wave."""
    out = []
    for wave in waves:
        reqs = [llm.add_request(p, GREEDY) for p in wave]
        while llm.scheduler.has_work:
            llm.step()
            llm.check_invariants()
        out.append(reqs)
    return out


def _check_tokens(model, reqs, what):
    from hf_reference import assert_greedy_match

    want, logits = greedy_generate(model, [r.prompt_token_ids for r in reqs], MAX_TOKENS)
    for i, (r, w, lg) in enumerate(zip(reqs, want, logits)):
        assert_greedy_match(r.output_token_ids, w, lg, f"{what}: request {i}")


@pytest.mark.parametrize(
    "family,mode",
    [("nemotron_h", "align"), ("nemotron_h", "all"), ("bamba", "all"), ("mamba2", "align")],
)
def test_hits_are_token_identical(tmp_path, family, mode):
    path = random_model(family, path=tmp_path / "ckpt")
    llm = LLM(path, enable_prefix_caching=True, mamba_cache_mode=mode, **ENGINE)
    first_step_decodes = {}  # request id -> did its first step run through the Mamba decode path?
    execute = llm.runner.execute

    def spy(sched):
        result = execute(sched)
        for batch_row, i in enumerate(result.row_order):
            first_step_decodes.setdefault(sched.rows[i].request.request_id, batch_row < result.num_decodes)
        return result

    llm.runner.execute = spy
    waves = _run_waves(llm, WAVES)
    reqs = [r for wave in waves for r in wave]
    _check_tokens(llm.model, reqs, f"{family}/{mode}")
    # Rule 1 (docs/architecture.md): the hit that leaves one prompt token computes it as a decode from the cached state.
    one_token_extend = waves[1][1]
    assert first_step_decodes[one_token_extend.request_id] is True
    assert first_step_decodes[waves[1][0].request_id] is False
    hits = [[r.num_cached_tokens for r in wave] for wave in waves]
    assert hits == EXPECTED_HITS[mode]
    s = llm.stats
    assert s.num_prefix_hit_tokens == sum(map(sum, hits))
    assert s.prefix_cache_hit_rate == pytest.approx(s.num_prefix_hit_tokens / sum(len(r.prompt_token_ids) for r in reqs))
    assert s.slots_in_use == 0 and s.blocks_in_use == 0, "finished requests hold nothing (cached ids are evictable)"
    assert s.num_cached_blocks > 0


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_hit_resumes_from_a_checkpoint_inside_a_prefill_chunk(tmp_path, backend):
    """Mode all: a 64-token prompt in one chunk leaves states at 16, 32, 48; a hit on 48 resumes there.

    The (conv, SSM) pair at 48 was written mid-chunk (block-boundary conv snapshot + chunk state); a
    stale or zero conv history there would change the first tokens of the extension. ``pallas`` runs
    the Pallas kernels (interpret mode on CPU), boundary snapshots included.
    """
    path = random_model("nemotron_h", path=tmp_path / "ckpt")
    llm = LLM(path, enable_prefix_caching=True, mamba_cache_mode="all", kernel_backend=backend,
              **{**ENGINE, "max_num_batched_tokens": 64, "buckets": [(4, 64)]})
    base = np.random.default_rng(5).integers(3, 500, 64).tolist()
    tails = [np.random.default_rng(6 + i).integers(3, 500, n).tolist() for i, n in enumerate((1, 3, 9))]
    waves = _run_waves(llm, [[base], [base[:48] + t for t in tails]])
    assert [r.num_cached_tokens for r in waves[1]] == [48, 48, 48]
    _check_tokens(llm.model, waves[0] + waves[1], "mid-chunk checkpoint")


def test_eviction_under_pressure_keeps_tokens_and_pools_consistent(tmp_path):
    """A KV pool far smaller than the workload: cached blocks are evicted, requests preempted, tokens unchanged."""
    path = random_model("nemotron_h", path=tmp_path / "ckpt")
    llm = LLM(path, enable_prefix_caching=True, mamba_cache_mode="all", num_blocks=12, **ENGINE)
    rng = np.random.default_rng(3)
    systems = [rng.integers(3, 500, n).tolist() for n in (20, 33, 48)]
    prompts = [systems[i % 3] + rng.integers(3, 500, int(rng.integers(1, 20))).tolist() for i in range(12)]
    waves = _run_waves(llm, [prompts[:4], prompts[4:8], prompts[8:]])
    reqs = [r for wave in waves for r in wave]
    _check_tokens(llm.model, reqs, "eviction")
    pc = llm.kv.stats
    assert pc.num_kv_evictions > 0, "the pool was meant to force evictions"
    assert pc.num_hit_tokens > 0
    assert llm.stats.slots_in_use == 0 and llm.stats.blocks_in_use == 0


class _EverySecondDraftWrong:
    """The target's own greedy drafts with every second one made wrong: each step accepts some, rejects some."""

    def __init__(self, inner, vocab: int):
        self.inner, self.vocab = inner, vocab

    def propose_batch(self, token_ids, max_drafts):
        drafts = self.inner.propose_batch(token_ids, max_drafts)
        return [[t if j % 2 == 0 else (t + 1) % self.vocab for j, t in enumerate(d)] for d in drafts]


@pytest.mark.parametrize("family,mode", [("nemotron_h", "align"), ("nemotron_h", "all"), ("bamba", "all")])
def test_prefix_caching_with_speculative_decoding(tmp_path, family, mode):
    """k=3 drafts, partly accepted every step: multi-token decodes write one state per token, hits stay exact.

    Mode all + spec decoding is Rule 2's combination (docs/architecture.md): the block table has the speculative columns
    (``mamba_block_table_columns``) and the next step reads the previous step's last written block.
    """
    path = random_model(family, path=tmp_path / "ckpt")
    llm = LLM(path, enable_prefix_caching=True, mamba_cache_mode=mode,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": str(path)}, **ENGINE)
    assert llm.runner.mamba_columns == mamba_block_table_columns(mode, ENGINE["max_model_len"], BLOCK, 3)
    llm.proposer = _EverySecondDraftWrong(llm.proposer, llm.cfg.vocab_size)
    base = np.random.default_rng(8).integers(3, 500, 35).tolist()
    # base[:33]: the hit leaves the prompt's last token, which carries drafts (a speculative decode row).
    waves = _run_waves(llm, [[base], [base + [9, 10, 11], base[:33], base[:20] + [5] * 6]])
    reqs = [r for wave in waves for r in wave]
    _check_tokens(llm.model, reqs, f"{family}/spec/{mode}")
    s = llm.stats
    assert 0 < s.num_accepted_draft_tokens < s.num_draft_tokens
    assert s.num_prefix_hit_tokens > 0


def test_preempted_speculative_requests_recompute_outputs_as_prompt(tmp_path):
    """Preemption with drafts on: recomputed outputs resume from the right state column, tokens unchanged."""
    path = random_model("nemotron_h", path=tmp_path / "ckpt")
    # A 6-token budget leaves recompute chunks of 2 tokens past the original prompt (a draft-less
    # multi-token row): the next step must read the state of that chunk's last token, not its first.
    llm = LLM(path, max_num_seqs=3, max_num_batched_tokens=6, block_size=8, num_blocks=7, max_model_len=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2}, buckets=[(3, 6)])
    rng = np.random.default_rng(4)
    motif = rng.integers(3, 500, 4).tolist()
    prompts = [(motif * 5)[:n] + rng.integers(3, 500, 2).tolist() for n in (9, 14, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reqs = [llm.add_request(p, params) for p in prompts]
    while llm.scheduler.has_work:
        llm.step()
        llm.check_invariants()
    assert llm.stats.num_preemptions > 0, "the pool was meant to force preemption"
    from hf_reference import assert_greedy_match

    want, logits = greedy_generate(llm.model, prompts, 16)
    for i, (r, w, lg) in enumerate(zip(reqs, want, logits)):
        assert_greedy_match(r.output_token_ids, w, lg, f"preempted spec request {i}")


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(enable_prefix_caching=True, mamba_cache_mode="none"), "mamba_cache_mode='none'"),
        (dict(mamba_cache_mode="all"), "enable_prefix_caching=False"),
        (dict(enable_prefix_caching=True, mamba_cache_mode="sometimes"), "mamba_cache_mode='sometimes'"),
        (dict(enable_prefix_caching=True, block_size=24), "block_size=24"),
    ],
)
def test_bad_prefix_cache_configs_are_refused(kwargs, needle):
    model = load_pretrained(random_model("nemotron_h"))
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        LLM(model, **{"max_model_len": 64, **kwargs})


def test_thousand_requests_with_random_finishes_and_preemptions_leave_nothing_behind(tmp_path):
    """1,000 requests through the engine (mode all, ngram k=2, a tight pool, random stops): pools end empty."""
    path = random_model("nemotron_h", path=tmp_path / "ckpt")
    llm = LLM(path, enable_prefix_caching=True, mamba_cache_mode="all", num_blocks=14,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2},
              **{**ENGINE, "max_num_seqs": 8, "buckets": [(8, 32)]})
    rng = np.random.default_rng(12)
    systems = [rng.integers(3, 500, n).tolist() for n in (17, 32, 40)]
    vocab_stop = [int(t) for t in rng.integers(3, 500, 40)]  # random stop tokens end some requests early
    for i in range(1000):
        prompt = systems[i % 3][: int(rng.integers(1, 41))] + rng.integers(3, 500, int(rng.integers(1, 9))).tolist()
        llm.add_request(prompt, SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=i,
                                               max_tokens=int(rng.integers(1, 9)), stop_token_ids=vocab_stop))
    steps = 0
    while llm.scheduler.has_work:
        llm.step()
        steps += 1
        if steps % 25 == 0:
            llm.check_invariants()
    llm.check_invariants()
    s = llm.stats
    assert s.slots_in_use == 0 and s.blocks_in_use == 0
    assert s.num_preemptions > 0 and s.num_prefix_hit_tokens > 0 and s.num_draft_tokens > 0
    assert s.backend_compiles_since_warmup == 0


@pytest.mark.parametrize(
    "family",
    ["nemotron_h", "bamba"] + [pytest.param(f, marks=pytest.mark.slow) for f in ("mamba2", "granite_hybrid", "falcon_h1")],
)
def test_prefix_hits_match_transformers(tmp_path, family):
    """Mode all, on a checkpoint transformers wrote itself: every request after the first resumes from a hit,
    and the tokens are transformers' greedy ones (cache-free ``generate``; near-tie rule as above)."""
    pytest.importorskip("transformers")
    from hf_reference import assert_greedy_match, hf_checkpoint, hf_greedy

    path = hf_checkpoint(tmp_path, family)
    llm = LLM(path, enable_prefix_caching=True, mamba_cache_mode="all", **ENGINE)
    waves = _run_waves(llm, [[P0], [P1, SHARED[:32] + [7], list(P0)]])
    reqs = [r for wave in waves for r in wave]
    assert [r.num_cached_tokens for r in waves[1]] == [32, 32, 32]
    for i, r in enumerate(reqs):
        tokens, logits = hf_greedy(path, r.prompt_token_ids, MAX_TOKENS)
        assert_greedy_match(r.output_token_ids, tokens, logits, f"{family}: request {i}")
