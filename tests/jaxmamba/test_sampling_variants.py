"""Sampling variants: a greedy-only batch runs the argmax tail, with the same tokens as the full tail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams, random_model
from jaxmamba.errors import ConfigError
from jaxmamba.sampling import (FULL, GREEDY, MAX_BANNED_IDS, SamplingVariant, first_argmax, sampling_variant,
                               verify_and_sample)
from jaxmamba.steps import GREEDY_TAIL_MIN_ROWS, Bucket, bucket_sampling_variants


def _inputs(seed: int, r: int, s: int, vocab: int):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((r, s, vocab)).astype(np.float32)
    greedy = logits.argmax(-1)
    # Drafts: the argmax for a random prefix, then a wrong token, so acceptance stops at varied places.
    drafts = greedy[:, : s - 1].copy()
    cut = rng.integers(0, s, size=r)
    for i, c in enumerate(cut):
        if c < s - 1:
            drafts[i, c] = (drafts[i, c] + 1) % vocab
    num_drafts = rng.integers(0, s, size=r).astype(np.int32)
    ban_ids = np.full((r, MAX_BANNED_IDS), -1, np.int32)
    ban_ids[:, 0] = greedy[:, 0]  # banning the argmax changes the greedy token while min_tokens holds
    min_tokens = rng.integers(0, 3, size=r).astype(np.int32)
    steps = rng.integers(0, 3, size=r).astype(np.int32)
    return dict(logits=jnp.asarray(logits), drafts=jnp.asarray(drafts.astype(np.int32)),
                num_drafts=jnp.asarray(num_drafts), temperature=jnp.zeros(r, jnp.float32),
                top_k=jnp.asarray(rng.integers(0, 5, size=r).astype(np.int32)),
                top_p=jnp.full(r, 0.9, jnp.float32), seeds=jnp.arange(r, dtype=jnp.int32), steps=jnp.asarray(steps),
                min_p=jnp.zeros(r, jnp.float32), min_tokens=jnp.asarray(min_tokens), ban_ids=jnp.asarray(ban_ids))


@pytest.mark.parametrize("s", [1, 4])
def test_greedy_variant_tokens_and_verification_equal_the_full_tail(s):
    args = _inputs(s, r=16, s=s, vocab=97)

    def run(variant):
        return jax.jit(lambda a: verify_and_sample(num_logprobs=5, variant=variant, **a))(args)

    full, greedy = run(FULL), run(GREEDY)
    np.testing.assert_array_equal(np.asarray(greedy[0]), np.asarray(full[0]))  # tokens
    np.testing.assert_array_equal(np.asarray(greedy[1]), np.asarray(full[1]))  # accepted drafts
    assert greedy[2:] == (None, None, None, None)
    if s > 1:
        assert 0 < int(full[1].sum()) < 16 * (s - 1), "the drafts exercise partial acceptance"


def test_first_argmax_is_jnp_argmax_on_ties_infinities_and_nans():
    rng = np.random.default_rng(0)
    rows = rng.integers(-2, 3, size=(12, 3, 40)).astype(np.float32)  # many ties
    rows[0, 0] = -np.inf  # every entry -inf
    rows[1, 1, 7] = np.inf
    rows[1, 2, [5, 9]] = np.inf
    rows[2, 0, 11] = np.nan  # a NaN wins over larger values
    rows[2, 1, [3, 30]] = np.nan
    rows[3, 2] = 0.0
    rows[3, 2, 4] = -0.0  # -0.0 == 0.0: the first of them
    logits = jnp.asarray(rows)
    got = jax.jit(first_argmax)(logits)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(logits, axis=-1)))
    assert int(got[2, 0]) == 11 and int(got[2, 1]) == 3 and int(got[1, 2]) == 5


def test_the_host_picks_the_cheapest_compiled_variant_that_serves_the_batch():
    """``sampling_variant(random, logprobs, compiled)``: the runner's two flags (some row samples, some row asks
    for logprobs; ``InputBatch.gather`` works them out)."""
    both = (GREEDY, FULL)
    assert sampling_variant(False, False, both) == GREEDY
    assert sampling_variant(True, False, both) == FULL
    assert sampling_variant(False, True, both) == FULL
    assert sampling_variant(False, False, (FULL,)) == FULL
    # With the two partial variants compiled as well, each need picks its own: random rows without logprobs,
    # greedy rows with them.
    random_only, logprobs_only = SamplingVariant(random=True, logprobs=False), SamplingVariant(random=False, logprobs=True)
    all_four = (GREEDY, random_only, logprobs_only, FULL)
    assert sampling_variant(True, False, all_four) == random_only
    assert sampling_variant(False, True, all_four) == logprobs_only
    assert sampling_variant(True, True, all_four) == FULL
    with pytest.raises(ValueError, match="no compiled sampling variant"):
        sampling_variant(True, False, (GREEDY,))


def test_bucket_policies():
    decode, mixed = Bucket(GREEDY_TAIL_MIN_ROWS, GREEDY_TAIL_MIN_ROWS, True), Bucket(16, 4, False)
    assert bucket_sampling_variants(decode) == (GREEDY, FULL)
    assert bucket_sampling_variants(mixed) == (FULL,)
    assert bucket_sampling_variants(mixed, "all") == (GREEDY, FULL)
    assert bucket_sampling_variants(decode, "full") == (FULL,)
    # "auto" (the default): where the per-row tail weighs most beside the forward pass: at least
    # GREEDY_TAIL_MIN_ROWS rows of about a token each, decodes or mostly-decode mixed steps.
    small = Bucket(GREEDY_TAIL_MIN_ROWS - 1, GREEDY_TAIL_MIN_ROWS - 1, True)
    assert bucket_sampling_variants(small) == (FULL,)
    assert bucket_sampling_variants(small, "decode") == (GREEDY, FULL)
    steady = Bucket(64, 64, False, 4)
    assert bucket_sampling_variants(steady) == (GREEDY, FULL)
    assert bucket_sampling_variants(steady, "decode") == (FULL,)
    assert bucket_sampling_variants(Bucket(64, 64, False, 64)) == (FULL,)  # all prefills
    assert bucket_sampling_variants(Bucket(256, 64, False, 4)) == (FULL,)  # 4 tokens a row: the forward weighs
    with pytest.raises(ConfigError, match="sampling_variants"):
        bucket_sampling_variants(decode, "fast")
    # On the CPU the full tail costs what the argmax does, so "auto" compiles no second program there;
    # the explicit policies mean the same on every platform.
    for bucket in (decode, steady, mixed, small):
        assert bucket_sampling_variants(bucket, "auto", "cpu") == (FULL,)
        for policy in ("decode", "all", "full"):
            assert bucket_sampling_variants(bucket, policy, "cpu") == bucket_sampling_variants(bucket, policy)


def test_cpu_engine_compiles_one_program_per_bucket_by_default(tmp_path):
    path = random_model("nemotron_h", path=tmp_path / "ckpt")
    # A bucket of 16 rows of a token each, 4 of them prefills (where a GPU's "auto" adds the greedy tail), beside the
    # all-prefill one an engine needs: the default policy's choice on the CPU, without compiling a whole default
    # ladder (8 buckets, ~50 s cold on 2 cores).
    llm = LLM(path, max_num_seqs=16, max_num_batched_tokens=16, max_model_len=64, buckets=[(16, 16, 4), (16, 16)])
    steps = llm.runner.steps
    assert any(len(bucket_sampling_variants(b)) > 1 for b in steps.buckets), "a GPU would compile greedy tails"
    assert set(steps.sampling_variants.values()) == {(FULL,)}
    assert llm.stats.num_step_programs == llm.stats.num_buckets == llm.stats.num_compilations


def test_engine_uses_the_greedy_tail_only_where_it_serves_and_tokens_do_not_change(tmp_path):
    path = random_model("nemotron_h", path=tmp_path / "ckpt")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, size=int(rng.integers(2, 30))).tolist() for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    mixed = [greedy] * 4 + [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
                            SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=5)]
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)  # every request in every step
    with pytest.raises(ConfigError, match="sampling_variants"):
        LLM(path, sampling_variants="fast", **args)
    # Both are checked before anything loads: a typo must not cost a model load (no such checkpoint here).
    with pytest.raises(ConfigError, match="sampling_variants='fast'"):
        LLM(tmp_path / "no-such-checkpoint", sampling_variants="fast", **args)
    with pytest.raises(ConfigError, match="dt_clamp='torch'"):
        LLM(tmp_path / "no-such-checkpoint", dt_clamp="torch", **args)
    full = LLM(path, sampling_variants="full", **args)
    assert full.stats.num_compilations == full.stats.num_step_programs == full.stats.num_buckets
    llm = LLM(path, sampling_variants="decode", **args)  # "auto" gives 8-row buckets no greedy tail
    s = llm.stats
    num_decode = sum(b.decode_only for b in llm.runner.steps.buckets)
    assert s.num_compilations == s.num_step_programs == s.num_buckets + num_decode

    used = []
    real = llm.runner.steps.dispatch  # synchronous and async steps both go through it

    def dispatch(*args):
        used.append(args[8])  # (bucket, caches, int_buf, float_buf, tables x2, prev, profile, variant, multi_step)
        return real(*args)

    llm.runner.steps.dispatch = dispatch
    real_inputs, seen = llm.runner._inputs, []

    def inputs(sched):
        # The variant is read off the temperatures the step's float input carries (one gather per step).
        out = real_inputs(sched)
        n, logprobs = len(out.order), any(row.request.params.logprobs is not None for row in sched.rows)
        random = bool((out.float_buf[:n] > 0).any())  # the float buffer's first part: the rows' temperatures
        assert out.variant == sampling_variant(random, logprobs, llm.runner.steps.sampling_variants[out.bucket])
        seen.append(out.variant)
        return out

    llm.runner._inputs = inputs
    outs = llm.generate(prompts, greedy)
    assert GREEDY in used
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in full.generate(prompts, greedy)]
    used.clear()
    outs = llm.generate(prompts, mixed)
    ref = full.generate(prompts, mixed)
    assert set(used) == {FULL}, "a batch with a logprobs or a sampled request runs the full tail"
    assert GREEDY in seen and FULL in seen
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert outs[4].outputs[0].logprobs == ref[4].outputs[0].logprobs
    assert llm.stats.backend_compiles_since_warmup == 0


def test_full_tail_computes_logprobs_only_when_a_row_asked():
    """FULL computed the log-softmax over the vocabulary and its top-k on every step, asked for or not (most of
    its cost over GREEDY on the CPU); now a batch without a logprob request skips them, same tokens."""
    args = _inputs(3, r=8, s=1, vocab=97)
    args = args | dict(temperature=jnp.full(8, 0.7, jnp.float32))
    run = jax.jit(lambda a, w: verify_and_sample(num_logprobs=5, variant=FULL, wants_logprobs=w, **a))
    every = jax.jit(lambda a: verify_and_sample(num_logprobs=5, variant=FULL, **a))(args)
    one = run(args, jnp.arange(8) == 5)
    none = run(args, jnp.zeros(8, bool))
    for out in (one, none):
        np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(every[0]))  # the same draws
    for got, want in zip(one[2:], every[2:], strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert all(not np.asarray(x).any() for x in none[2:])
    assert np.asarray(every[2]).all()  # (the logprobs are real numbers, not zeros, when computed)
