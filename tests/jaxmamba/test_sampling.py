"""The sort-free sampling filter and draw against a plain full-sort reference (the tail as it was before).

The reference below sorts each row's vocabulary, cuts top-k/top-p on the sorted order and draws with
``jax.random.categorical`` over the whole vocabulary. One deliberate difference is folded into it:
``top_p >= 1`` keeps every token (the sorted cumulative sum could reach 1.0 early by rounding and drop
the last tokens of a row).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba import sampling_filter
from jaxmamba.sampling import FULL, filtered_log_probs, verify_and_sample


def reference_filtered_log_probs(logits, temperature, top_k, top_p, min_p):
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None, None]
    floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(min_p)[:, None, None]
    scaled = jnp.where(scaled >= floor, scaled, -jnp.inf)
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None, None].repeat(scaled.shape[1], 1), axis=-1)
    scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    probs_sorted = jax.nn.softmax(jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep_sorted = (mass_before < top_p[:, None, None]) | (top_p[:, None, None] >= 1)
    threshold = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    return jax.nn.log_softmax(scaled, axis=-1)


def reference_tokens(logits, drafts, num_drafts, temperature, top_k, top_p, seeds, steps, min_p):
    """The sampled tail before: ``(tokens int32[R, S], num_accepted int32[R])``, every row sampled."""
    r, s, vocab = logits.shape
    pos = jnp.arange(s)
    logp = reference_filtered_log_probs(logits, temperature, top_k, top_p, min_p)
    keys = jax.vmap(lambda seed, step: jax.vmap(lambda j: jax.random.fold_in(
        jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), step), j))(pos))(seeds, steps)
    rows = jnp.arange(r)
    num_accepted = jnp.zeros((r,), jnp.int32)
    bonus_logp = logp[:, 0]
    if s > 1:
        p_draft = jnp.exp(jnp.take_along_axis(logp[:, : s - 1], drafts[..., None], axis=-1)[..., 0])
        u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1))))(keys[:, : s - 1])
        ok = (u < p_draft) & (pos[None, : s - 1] < num_drafts[:, None])
        num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        rejected = num_accepted < num_drafts
        rejected_tok = drafts[rows, jnp.minimum(num_accepted, s - 2)]
        bonus_logp = jnp.where(rejected[:, None] & (jnp.arange(vocab)[None] == rejected_tok[:, None]), -jnp.inf,
                               logp[rows, num_accepted])
    bonus = jax.vmap(lambda k, lp: jax.random.categorical(jax.random.fold_in(k, 2), lp))(
        keys[rows, num_accepted], bonus_logp)
    return bonus.astype(jnp.int32), num_accepted


def edge_case_inputs(seed: int, r: int, s: int, vocab: int):
    """Rows covering the filter's edge cases; integer logits (``ties``) make ties at the k-th logit."""
    rng = np.random.default_rng(seed)
    scale = rng.choice([0.3, 1.0, 4.0, 12.0], size=(r, 1, 1))
    logits = rng.standard_normal((r, s, vocab)) * scale
    ties = rng.random(r) < 0.3
    logits[ties] = np.round(logits[ties])
    logits[rng.random((r, s, vocab)) < 0.05] = -np.inf  # banned tokens
    top_k = rng.choice([0, 1, 2, 5, 17, 40, vocab - 1, vocab, vocab + 5], size=r)
    top_p = rng.choice([1.0, 0.999, 0.9, 0.5, 0.05], size=r)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.5, 1.0], size=r)
    temperature = rng.choice([0.3, 0.8, 1.0, 2.5], size=r)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return dict(logits=f32(logits), temperature=f32(temperature), top_k=jnp.asarray(top_k, jnp.int32),
                top_p=f32(top_p), min_p=f32(min_p))


def _kept_sets_and_values_agree(got, want):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=1e-5)  # XLA CPU fusions round exp differently


@pytest.mark.parametrize("vocab", [97, 5000])
def test_filter_keeps_the_tokens_the_full_sort_keeps(vocab):
    args = edge_case_inputs(vocab, r=48, s=2, vocab=vocab)
    _kept_sets_and_values_agree(jax.jit(filtered_log_probs)(**args), jax.jit(reference_filtered_log_probs)(**args))
    # Both of the filter's paths ran: rows the candidates serve and rows they cannot.
    x = args["logits"] / args["temperature"][:, None, None]
    flat = x.reshape(-1, vocab)
    m = jnp.max(flat, axis=-1)
    floor = m + jnp.log(jnp.repeat(args["min_p"], 2))
    _, exact, _ = sampling_filter.fast_thresholds(flat, m, floor, jnp.repeat(args["top_k"], 2),
                                                  jnp.repeat(args["top_p"], 2))
    assert 0 < int(exact.sum()) < exact.size


@pytest.mark.parametrize("vocab", [97, 5000])
def test_bisection_thresholds_keep_the_tokens_the_full_sort_keeps(vocab):
    args = edge_case_inputs(vocab + 1, r=48, s=1, vocab=vocab)
    x = (args["logits"] / args["temperature"][:, None, None])[:, 0]
    m = jnp.max(x, axis=-1)
    t = jax.jit(sampling_filter.exact_thresholds)(x, m, m + jnp.log(args["min_p"]), args["top_k"], args["top_p"])
    want = np.isfinite(np.asarray(jax.jit(reference_filtered_log_probs)(**args))[:, 0])
    np.testing.assert_array_equal(np.asarray(x >= t[:, None]) & np.isfinite(np.asarray(x)), want)


@pytest.mark.parametrize("s", [1, 4])
def test_sampled_tokens_equal_the_full_sort_draw_for_the_same_seeds(s):
    r, vocab = 64, 5000
    args = edge_case_inputs(100 + s, r=r, s=s, vocab=vocab)
    rng = np.random.default_rng(s)
    # Drafts: the most likely token or a random one, so acceptance and rejection both happen.
    best = np.asarray(jnp.argmax(args["logits"], axis=-1))
    drafts = np.where(rng.random((r, s)) < 0.6, best, rng.integers(0, vocab, (r, s)))[:, : s - 1]
    extra = dict(drafts=jnp.asarray(drafts, jnp.int32), num_drafts=jnp.asarray(rng.integers(0, s, r), jnp.int32),
                 seeds=jnp.asarray(rng.integers(0, 2**31 - 1, r), jnp.int32),
                 steps=jnp.asarray(rng.integers(0, 50, r), jnp.int32))
    tokens, accepted = jax.jit(lambda a: verify_and_sample(**a, num_logprobs=3, variant=FULL))(args | extra)[:2]
    want_bonus, want_accepted = jax.jit(reference_tokens)(**args, **extra)
    np.testing.assert_array_equal(np.asarray(accepted), np.asarray(want_accepted))
    np.testing.assert_array_equal(np.asarray(tokens)[np.arange(r), np.asarray(accepted)], np.asarray(want_bonus))
    if s > 1:
        assert 0 < int(accepted.sum()) < int(extra["num_drafts"].sum()), "drafts are both accepted and rejected"


def test_a_crowded_group_sends_rows_past_the_candidates():
    # Group 0 (the first 1024 tokens) holds the 20 most likely tokens, tied: its top 16 are candidates, the
    # other 4 are not. top_k=16 keeps all 20 (ties at the 16th stay); the top_p rows need the 20 and more.
    vocab, n = 5000, 400
    row = np.full(vocab, -10.0, np.float32)
    row[:20] = 5.0
    for g in range(1, 5):  # each other group's top 16: likely, less so
        row[g * 1024 : g * 1024 + 16] = 2.5 - 0.01 * np.arange(16)
    full = lambda v, dt=jnp.float32: jnp.full(n, v, dt)  # noqa: E731
    # top_p=0.8: the candidates' mass passes 0.8 only 13 levels below 2.5, the vocabulary's at 2.5.
    for top_k, top_p in [(16, 1.0), (0, 0.95), (0, 0.8), (17, 1.0)]:
        args = dict(logits=jnp.asarray(np.broadcast_to(row, (n, 1, vocab))), temperature=full(1.0),
                    top_k=full(top_k, jnp.int32), top_p=full(top_p), min_p=full(0.0))
        _kept_sets_and_values_agree(jax.jit(filtered_log_probs)(**args),
                                    jax.jit(reference_filtered_log_probs)(**args))
        extra = dict(drafts=jnp.zeros((n, 0), jnp.int32), num_drafts=jnp.zeros(n, jnp.int32),
                     seeds=jnp.arange(n, dtype=jnp.int32), steps=jnp.zeros(n, jnp.int32))
        tokens = jax.jit(lambda a: verify_and_sample(**a, num_logprobs=1))(args | extra)[0][:, 0]
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(jax.jit(reference_tokens)(**args, **extra)[0]))
        assert set(np.asarray(tokens).tolist()) >= set(range(16, 20)), "tokens beyond the candidates are drawn"


def test_a_rows_draw_does_not_depend_on_the_rest_of_its_batch():
    # Row 0 alone is drawn from its candidates; beside a row with no top-k/top-p the batch draws over the
    # whole vocabulary; beside a greedy row it is the batch's only sampled row. The token must be the same.
    rng = np.random.default_rng(7)
    vocab = 5000
    logits = jnp.asarray(rng.standard_normal((2, 1, vocab)) * 3, jnp.float32)
    common = dict(drafts=jnp.zeros((2, 0), jnp.int32), num_drafts=jnp.zeros(2, jnp.int32),
                  top_p=jnp.ones(2, jnp.float32), min_p=jnp.zeros(2, jnp.float32), steps=jnp.zeros(2, jnp.int32),
                  num_logprobs=1)
    run = jax.jit(lambda a: verify_and_sample(**a, **common)[0][:, 0])
    hot, greedy_beside = jnp.ones(2, jnp.float32), jnp.asarray([1.0, 0.0], jnp.float32)
    drawn = set()
    for seed in range(20):
        seeds = jnp.asarray([seed, 1000 + seed], jnp.int32)
        alone = run(dict(logits=logits, top_k=jnp.asarray([8, 8], jnp.int32), seeds=seeds, temperature=hot))
        beside = run(dict(logits=logits, top_k=jnp.asarray([8, 0], jnp.int32), seeds=seeds, temperature=hot))
        with_greedy = run(dict(logits=logits, top_k=jnp.asarray([8, 8], jnp.int32), seeds=seeds,
                               temperature=greedy_beside))
        assert int(alone[0]) == int(beside[0]) == int(with_greedy[0]), f"seed {seed}"
        assert int(with_greedy[1]) == int(jnp.argmax(logits[1, 0]))
        drawn.add(int(alone[0]))
    assert len(drawn) > 1, "row 0 is sampled, not its argmax every time"


def test_the_draw_follows_the_filtered_distribution():
    # One row's logits under many seeds (one row per seed): the token frequencies match the reference's
    # filtered probabilities. The candidates serve the top-k setting; the flat top-p one needs the bisection
    # and a draw over the whole vocabulary.
    n, vocab = 4000, 300
    rng = np.random.default_rng(11)
    settings = [dict(t=0.7, k=12, p=0.9, mp=0.0, scale=2.0), dict(t=1.3, k=0, p=1.0, mp=0.05, scale=1.0),
                dict(t=1.0, k=0, p=0.6, mp=0.0, scale=0.3)]
    for cfg in settings:
        row = rng.standard_normal(vocab) * cfg["scale"]
        full = lambda v, dt=jnp.float32: jnp.full(n, v, dt)  # noqa: E731
        args = dict(logits=jnp.asarray(np.broadcast_to(row, (n, 1, vocab)), jnp.float32), temperature=full(cfg["t"]),
                    top_k=full(cfg["k"], jnp.int32), top_p=full(cfg["p"]), min_p=full(cfg["mp"]))
        tokens = jax.jit(lambda a: verify_and_sample(
            **a, drafts=jnp.zeros((n, 0), jnp.int32), num_drafts=jnp.zeros(n, jnp.int32),
            seeds=jnp.arange(n, dtype=jnp.int32), steps=jnp.zeros(n, jnp.int32), num_logprobs=1)[0][:, 0])(args)
        probs = np.exp(np.asarray(reference_filtered_log_probs(**{k: v[:1] for k, v in args.items()}))[0, 0])
        freq = np.bincount(np.asarray(tokens), minlength=vocab) / n
        assert np.all(freq[probs == 0] == 0), "a filtered-out token was drawn"
        sigma = np.sqrt(probs * (1 - probs) / n)
        assert np.all(np.abs(freq - probs) <= 5 * sigma + 2 / n), cfg
        assert np.count_nonzero(freq) > 3, "the row is not a point mass"


def test_gumbel_at_is_jax_random_gumbel_entry_by_entry():
    for seed in range(4):
        key = jax.random.fold_in(jax.random.key(seed), 2)
        ids = jnp.asarray(np.random.default_rng(seed).integers(0, 32768, 257), jnp.int32)
        whole = np.asarray(jax.random.gumbel(key, (32768,), jnp.float32))
        np.testing.assert_array_equal(np.asarray(jax.jit(sampling_filter.gumbel_at)(key, ids)), whole[np.asarray(ids)])


def test_top_logprobs_equal_lax_top_k_on_ties_and_infinities():
    rng = np.random.default_rng(5)
    for vocab in (97, 5000):
        x = rng.standard_normal((6, 2, vocab)).astype(np.float32) * 3
        x[0] = np.round(x[0])  # ties
        x[1, 0, rng.random(vocab) < 0.995] = -np.inf  # fewer finite tokens than asked
        x[2, 1, :] = 0.0  # all tied: the candidates cannot serve it
        logits = jnp.asarray(x)
        out = jax.jit(lambda a: verify_and_sample(
            a, drafts=jnp.zeros((6, 1), jnp.int32), num_drafts=jnp.zeros(6, jnp.int32),
            temperature=jnp.zeros(6), top_k=jnp.zeros(6, jnp.int32), top_p=jnp.ones(6), seeds=jnp.arange(6),
            steps=jnp.zeros(6, jnp.int32), num_logprobs=20))(logits)
        want_vals, want_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), 20)
        np.testing.assert_array_equal(np.asarray(out[3]), np.asarray(want_ids))
        np.testing.assert_array_equal(np.asarray(out[4]), np.asarray(want_vals))
        x[2, 1, :] = rng.standard_normal(vocab)  # now every row's top 20 are candidates
        out = jax.jit(lambda a: verify_and_sample(
            a, drafts=jnp.zeros((6, 1), jnp.int32), num_drafts=jnp.zeros(6, jnp.int32),
            temperature=jnp.zeros(6), top_k=jnp.zeros(6, jnp.int32), top_p=jnp.ones(6), seeds=jnp.arange(6),
            steps=jnp.zeros(6, jnp.int32), num_logprobs=20))(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(out[3]),
                                      np.asarray(jax.lax.top_k(jax.nn.log_softmax(jnp.asarray(x), axis=-1), 20)[1]))
