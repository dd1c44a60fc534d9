"""The serving engine against transformers' generate, and its static-shape guarantees.

Greedy comparisons allow a divergence only right after a near-tie in the
reference (top-2 logit gap < 1e-4, ``hf_reference.NEAR_TIE``).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams, load_pretrained, random_model
from jaxmamba.config import FAMILIES
from jaxmamba.errors import ConfigError
from jaxmamba.model.greedy import greedy_generate

PROMPT_LENS = (5, 23, 1, 40, 9, 17)
MAX_TOKENS = 6


def _prompts(seed=0, lens=PROMPT_LENS):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=n).tolist() for n in lens]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# (engine args, what the configuration forces)
CONFIGS = {
    # Whole prompts in one step; 6 requests over 4 rows -> mixed decode+prefill batches, padded buckets.
    "whole_prompt": dict(max_num_seqs=4, max_num_batched_tokens=64),
    # 8-token budget: long prompts are chunked across steps; 7 usable KV blocks of 8 tokens hold the
    # longest request (46 tokens) but not three at once, so requests get preempted and recomputed.
    "chunked_preempting": dict(max_num_seqs=3, max_num_batched_tokens=8, block_size=8, num_blocks=8),
}


@pytest.fixture(scope="module")
def hf_refs(tmp_path_factory):
    """transformers' greedy tokens+logits per family (computed once for all configurations)."""
    pytest.importorskip("transformers")
    from hf_reference import hf_greedy

    out = {}
    for family in FAMILIES:
        path = random_model(family, path=tmp_path_factory.mktemp(family) / "ckpt")
        out[family] = (path, [hf_greedy(path, p, MAX_TOKENS) for p in _prompts()])
    return out


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(hf_refs, family, config):
    from hf_reference import assert_greedy_match

    path, refs = hf_refs[family]
    llm = LLM(path, max_model_len=128, **CONFIGS[config])
    outs = llm.generate(_prompts(), GREEDY)
    for i, (out, (tokens, logits)) in enumerate(zip(outs, refs)):
        assert out.error is None and out.finished
        assert_greedy_match(out.outputs[0].token_ids, tokens, logits, f"{family}/{config}/prompt {i}")
    s = llm.stats
    if config == "chunked_preempting" and llm.cfg.attention_layer_ids:
        # (a pure Mamba2 model holds no KV blocks: one state slot per request, so nothing to preempt for)
        assert s.num_preemptions > 0, "the tiny pool must force at least one preemption"
        assert s.num_prompt_tokens > sum(PROMPT_LENS), "preempted requests recompute their tokens"
    assert s.slots_in_use == 0 and s.blocks_in_use == 0, "every slot and block returns to the pool"
    llm.check_invariants()


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return random_model("nemotron_h", path=tmp_path_factory.mktemp("n") / "ckpt")


def test_long_mixed_workload_never_compiles(nemotron):
    llm = LLM(nemotron, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96)
    assert llm.stats.num_compilations == llm.stats.num_step_programs
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 500, size=int(rng.integers(1, 60))).tolist() for _ in range(200)]
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 20])),
                             max_tokens=int(rng.integers(1, 12)), seed=i, ignore_eos=True) for i in range(200)]
    outs = llm.generate(prompts, params)
    assert all(o.error is None and o.finished for o in outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    s = llm.stats
    assert s.num_compilations == s.num_step_programs
    assert s.backend_compiles_since_warmup == 0, "serving must not compile anything"
    assert s.slots_in_use == 0 and s.blocks_in_use == 0


def _poison_free_state(llm):
    """NaN into every cache entry no running request owns, the null slot and block included."""
    import jax.numpy as jnp
    from jaxmamba.cache import StateCaches

    c = llm.runner.caches
    llm.runner.caches = StateCaches(
        conv=tuple(jnp.full_like(a, jnp.nan) for a in c.conv),
        ssm=tuple(jnp.full_like(a, jnp.nan) for a in c.ssm),
        kv=tuple(jnp.full_like(a, jnp.nan) for a in c.kv),
    )


def test_padded_rows_and_garbage_state_change_nothing(nemotron):
    """Rule 3's bug class (docs/architecture.md): one request alone vs. inside a padded bucket full of garbage state."""
    prompt = _prompts(3, (13,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    alone = LLM(nemotron, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64)
    ref = alone.generate([prompt], params)[0].outputs[0]

    crowded = LLM(nemotron, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    _poison_free_state(crowded)  # fresh slots are never read before being written: NaN must not leak
    others = _prompts(4, (3, 30, 1))
    outs = crowded.generate([prompt] + others, [params] + [GREEDY] * 3)
    got = outs[0].outputs[0]
    assert got.token_ids == ref.token_ids
    for a, b in zip(got.logprobs, ref.logprobs):
        assert a.keys() == b.keys()
        np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=0, atol=1e-5)
    assert all(np.isfinite(v) for step in got.logprobs for v in step.values())


def test_engine_matches_cache_free_reference_with_sampling_off(nemotron):
    prompts = _prompts(5)
    ref, _ = greedy_generate(load_pretrained(nemotron), prompts, 4)
    outs = LLM(nemotron, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=96).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_mostly_decode_steps_take_buckets_sized_for_their_prefills(nemotron):
    """With 32 rows, steps of many decodes and one or two prompt chunks run buckets of 4 prefill rows (SSD
    arrays for 4 rows, not 32); tokens equal the cache-free reference, logprobs equal an engine whose
    mixed buckets hold every row as a prefill (the old shapes), and nothing compiles while serving."""
    rng = np.random.default_rng(11)
    lens = [int(n) for n in rng.integers(1, 40, size=24)]
    prompts = _prompts(6, lens)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    ref, _ = greedy_generate(load_pretrained(nemotron), prompts, 8)
    llm = LLM(nemotron, max_num_seqs=32, max_num_batched_tokens=64, max_model_len=96)
    used = []
    dispatch = llm.runner.steps.dispatch  # synchronous and async steps both go through it

    def spy(bucket, *args, **kwargs):
        used.append(bucket)
        return dispatch(bucket, *args, **kwargs)

    llm.runner.steps.dispatch = spy
    # 24 prompts over 16 rows and a 64-token budget: prompts are admitted a few at a time beside running decodes.
    outs = llm.generate(prompts, params)
    narrow = [b for b in used if not b.decode_only and b.num_prefills < b.num_reqs]
    assert narrow, f"no step used a narrow prefill bucket: {sorted(set(used))}"
    assert llm.stats.backend_compiles_since_warmup == 0
    wide = LLM(nemotron, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=96,
               buckets=[(16, 16), (16, 32), (16, 64)])
    wide_outs = wide.generate(prompts, params)
    for i, (a, b, tokens) in enumerate(zip(outs, wide_outs, ref)):
        assert a.outputs[0].token_ids == tokens, f"prompt {i}"
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            np.testing.assert_allclose([v.logprob for v in x.values()], [v.logprob for v in y.values()],
                                       rtol=0, atol=1e-5)


def test_sampling_is_reproducible_per_request_seed(nemotron):
    llm = LLM(nemotron, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    p = _prompts(6, (7,))[0]
    hot = SamplingParams(temperature=1.5, top_p=0.9, max_tokens=8, seed=123, ignore_eos=True)
    a = llm.generate([p], hot)[0].outputs[0].token_ids
    # Same seed inside a different batch composition: same tokens.
    b = llm.generate([_prompts(7, (20,))[0], p, [5, 6]], [GREEDY, hot, GREEDY])[1].outputs[0].token_ids
    c = llm.generate([p], SamplingParams(temperature=1.5, top_p=0.9, max_tokens=8, seed=124, ignore_eos=True))
    assert a == b
    assert c[0].outputs[0].token_ids != a
    top1 = llm.generate([p], SamplingParams(temperature=2.0, top_k=1, max_tokens=8, seed=5, ignore_eos=True))
    greedy = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_stop_conditions(nemotron):
    llm = LLM(nemotron, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=24)
    p = _prompts(8, (6,))[0]
    first = llm.generate([p], GREEDY)[0].outputs[0].token_ids
    stopped = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[first[2]],
                                               ignore_eos=True))[0].outputs[0]
    assert stopped.token_ids == first[:3] and stopped.finish_reason == "stop"
    capped = llm.generate([_prompts(9, (20,))[0]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert len(capped[0].outputs[0].token_ids) == 4 and capped[0].outputs[0].finish_reason == "length"


def test_bad_requests_are_rejected_and_the_rest_run(nemotron):
    llm = LLM(nemotron, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    good = _prompts(10, (4,))[0]
    outs = llm.generate([[], good, list(range(40)), [1, 99999], good],
                        [GREEDY, GREEDY, GREEDY, GREEDY, GREEDY])
    assert "empty" in outs[0].error
    assert "max_model_len" in outs[2].error
    assert "99999" in outs[3].error and "vocabulary" in outs[3].error
    assert outs[1].error is None and outs[4].error is None
    assert outs[1].outputs[0].token_ids == outs[4].outputs[0].token_ids and len(outs[1].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)


def test_tensor_parallel_without_enough_devices_says_so(nemotron):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM(nemotron, tensor_parallel_size=2)


def test_string_prompts_with_a_checkpoint_tokenizer(tmp_path):
    """A checkpoint directory with tokenizer.json takes string prompts and returns text."""
    pytest.importorskip("tokenizers")  # a core dependency, but absent from JAX-only environments
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = random_model("nemotron_h", path=tmp_path / "ckpt")
    vocab = {f"w{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    llm = LLM(path, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, buckets=[(2, 16)])
    text_out = llm.generate("w5 w17 w42", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    ids_out = llm.generate([[5, 17, 42]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert text_out.prompt_token_ids == [5, 17, 42]
    assert text_out.outputs[0].token_ids == ids_out.outputs[0].token_ids
    assert text_out.outputs[0].text.split() == [f"w{i}" for i in ids_out.outputs[0].token_ids]
    (path / "tokenizer.json").unlink()
    no_tok = LLM(path, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, buckets=[(2, 16)])
    assert "tokenizer" in no_tok.generate("w5 w17", SamplingParams(max_tokens=2))[0].error
