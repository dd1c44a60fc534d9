"""On-device sampling and speculative-draft verification inside the jitted step.

Every row carries ``S = 1 + num_spec`` logit positions: a decode row with ``n`` drafts verifies them at
its first ``n`` and samples a bonus token after the last accepted one; rows without drafts use position 0
(plain sampling is the ``n = 0`` case). Greedy rows accept a draft while it equals the argmax; sampled
rows use rejection sampling against the filtered distribution ``p`` (temperature, top-k, top-p), which
keeps the output distribution exactly ``p``. Row ``r``'s key at position ``j`` is
``fold_in(fold_in(key(seed_r), num_generated_r), j)``: a request's draws never depend on its batch. No
sort (a threshold filter, ``jaxmamba.sampling_filter``). Each bucket compiles the sampling variants it
has (``SamplingVariant``): ``GREEDY`` (an argmax, bit-identical to ``FULL``'s greedy rows) and ``FULL``;
the host picks one per batch (``sampling_variant``). Details: docs/architecture.md, "Sampling on the
device".
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from jaxmamba import sampling_filter
from jaxmamba.hlo_traffic import RARE_BRANCH

#: Logprobs returned per token are at most this many (a static size of the compiled step).
MAX_LOGPROBS = 20
#: Token ids a row bans until it has ``min_tokens`` outputs (its EOS and stop ids): a static width of the step.
MAX_BANNED_IDS = 16


@dataclass(frozen=True)
class SamplingVariant:
    """What a compiled step's sampling tail computes: a static part of the executable.

    ``random``: temperature / top-k / top-p / min-p rows (the filter and the random draws);
    without it every row is greedy. ``logprobs``: the token logprobs, top ``MAX_LOGPROBS`` and ranks;
    without them those outputs are ``None``."""

    random: bool
    logprobs: bool

    def covers(self, other: "SamplingVariant") -> bool:
        return (self.random or not other.random) and (self.logprobs or not other.logprobs)


GREEDY = SamplingVariant(random=False, logprobs=False)
FULL = SamplingVariant(random=True, logprobs=True)
# Every variant by (random, logprobs): sampling_variant runs once a step, and a frozen dataclass costs more to
# build than to look up.
_NEEDS = {(r, lp): SamplingVariant(random=r, logprobs=lp) for r in (False, True) for lp in (False, True)}


def sampling_variant(random: bool, logprobs: bool, compiled) -> SamplingVariant:
    """The cheapest of the ``compiled`` variants (ordered cheapest first, ``FULL`` among them) that serves a
    batch in which some row samples (``random``: a temperature > 0) and some row asks for logprobs
    (``logprobs``), as said."""
    need = _NEEDS[random, logprobs]
    for variant in compiled:
        if variant.covers(need):
            return variant
    raise ValueError(f"no compiled sampling variant in {compiled} serves {need}")


def filtered_log_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                       min_p: jax.Array | None = None) -> jax.Array:
    """Log-probabilities after temperature, min-p, top-k and top-p (``-inf`` outside): ``[R, S, V]``.

    min-p (vLLM's order: after temperature, before top-k/top-p) keeps the tokens whose probability is at
    least ``min_p`` times the most likely one's; 0 disables it. top-k keeps the tokens at or above the k-th
    largest logit (ties there all stay); top-p then keeps the smallest prefix (by probability) whose mass
    reaches ``top_p`` (ties at its last token all stay), ``top_p >= 1`` keeps everything."""
    r, s, vocab = logits.shape
    f = _filter(logits, temperature, top_k, top_p, min_p, jnp.ones((r, s), bool))
    return jnp.where(f.x >= f.t[..., None], (f.x - f.m[..., None]) - f.lse[..., None], -jnp.inf)


@dataclass(frozen=True)
class _Filtered:
    """The filtered distribution at every row and position, as thresholds (``[R, S]`` unless noted): token
    ``i`` is kept iff ``x[..., i] >= t``, with log-probability ``(x - m) - lse`` (``jax.nn.log_softmax``'s
    arithmetic, so the values match a log_softmax of the masked logits)."""

    x: jax.Array  # float32[R, S, V]: logits / temperature
    m: jax.Array  # the max of x
    t: jax.Array  # the threshold
    lse: jax.Array  # log of the kept tokens' sum(exp(x - m))
    vals: jax.Array  # float32[R, S, C]: the candidates' x, descending (``sampling_filter.candidates``)
    ids: jax.Array  # int32[R, S, C]: their token ids
    tau: jax.Array  # every token with x > tau is a candidate


def _filter(logits, temperature, top_k, top_p, min_p, needed) -> _Filtered:
    """The filter's thresholds; exact (``sampling_filter.exact_thresholds``) for every ``needed`` (``bool[R, S]``)
    row, the others may be approximate (greedy rows, whose tokens do not use them)."""
    r, s, vocab = logits.shape
    x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None, None]
    flat = x.reshape(r * s, vocab)
    per_row = lambda a: jnp.repeat(a, s)  # noqa: E731 - [R] -> [R * S], row-major like flat
    m = jnp.max(flat, axis=-1)
    # p_i >= min_p * p_max  <=>  x_i - max >= log(min_p); log(0) = -inf keeps everything.
    floor = jnp.full_like(m, -jnp.inf) if min_p is None else m + jnp.log(per_row(min_p))
    k, p = per_row(top_k), per_row(top_p)
    t, exact, (vals, ids, tau) = sampling_filter.fast_thresholds(flat, m, floor, k, p)
    t = lax.cond(jnp.any(needed.reshape(-1) & ~exact),
                 _rare(lambda: jnp.where(exact, t, sampling_filter.exact_thresholds(flat, m, floor, k, p))),
                 lambda: t)
    lse = jnp.log(sampling_filter.kept_mass(flat, m, t))
    shape = lambda a: a.reshape(r, s, *a.shape[1:])  # noqa: E731
    return _Filtered(x, shape(m), shape(t), shape(lse), shape(vals), shape(ids), shape(tau))


def verify_and_sample(
    logits: jax.Array,  # float32[R, S, V] at each row's S logit positions
    drafts: jax.Array,  # int32[R, S-1] draft tokens (ignored past num_drafts)
    num_drafts: jax.Array,  # int32[R]
    temperature: jax.Array,  # float32[R]; 0 = greedy
    top_k: jax.Array,  # int32[R]; <= 0 disabled
    top_p: jax.Array,  # float32[R]; 1 disabled
    seeds: jax.Array,  # int32[R]
    steps: jax.Array,  # int32[R]: tokens generated so far
    num_logprobs: int,
    min_p: jax.Array | None = None,  # float32[R]; 0 disabled
    min_tokens: jax.Array | None = None,  # int32[R]: ban_ids are banned while steps + position < min_tokens
    ban_ids: jax.Array | None = None,  # int32[R, MAX_BANNED_IDS]: EOS and stop ids, -1 padded
    variant: SamplingVariant = FULL,
    wants_logprobs: jax.Array | None = None,  # bool[R]: rows that asked for logprobs (None: every row)
):
    """Returns ``(tokens int32[R, S], num_accepted int32[R], token_logprobs float32[R, S],
    top_ids int32[R, S, L], top_logprobs float32[R, S, L], token_ranks int32[R, S])``; a row's output
    tokens are ``tokens[r, : num_accepted[r] + 1]`` (accepted drafts, then the bonus token).
    ``token_ranks`` is vLLM's rank of each output token in the unfiltered distribution: 1 + the number
    of tokens with a strictly higher log-probability.

    ``variant``: ``GREEDY`` treats every row as greedy (the caller guarantees ``temperature == 0``)
    and returns ``None`` for the four logprob outputs; without ``variant.logprobs`` those are ``None``
    too. With ``wants_logprobs``, a step none of whose rows asked for logprobs skips computing them (the four
    outputs are zeros: the host reads them only for rows that asked). A greedy row's tokens are the same in
    every variant."""
    r, s, vocab = logits.shape
    pos = jnp.arange(s)
    raw_logits = logits
    if ban_ids is not None:
        # vLLM's min_tokens: EOS and stop ids cannot be picked (greedy or sampled) before min_tokens outputs.
        banned = jnp.zeros((r, vocab), bool).at[jnp.arange(r)[:, None], jnp.where(ban_ids >= 0, ban_ids, vocab)].set(
            True, mode="drop")
        active = (steps[:, None] + pos[None, :]) < min_tokens[:, None]  # [R, S]
        logits = jnp.where(active[..., None] & banned[:, None, :], -jnp.inf, logits)
    greedy = first_argmax(logits)  # [R, S]
    if not variant.random:
        tokens, num_accepted = _greedy_tokens(greedy, drafts, num_drafts)
    else:
        # A batch without a sampled row (FULL serves greedy batches that ask for logprobs) skips the filter
        # and the draws: its tokens are the greedy ones either way.
        tokens, num_accepted = lax.cond(
            jnp.any(temperature > 0),
            lambda: _sampled_tokens(logits, greedy, drafts, num_drafts, temperature, top_k, top_p, seeds, steps,
                                    min_p),
            lambda: _greedy_tokens(greedy, drafts, num_drafts))
    if not variant.logprobs:
        return tokens, num_accepted, None, None, None, None
    if wants_logprobs is None:
        return (tokens, num_accepted, *_logprob_outputs(raw_logits, tokens, num_logprobs))
    # A sampled batch without a logprob request costs about what a greedy one does: the log-softmax over
    # the vocabulary and its top-k are skipped (on the CPU they were most of the FULL tail).
    none_asked = lambda: (jnp.zeros((r, s), jnp.float32), jnp.zeros((r, s, num_logprobs), jnp.int32),  # noqa: E731
                          jnp.zeros((r, s, num_logprobs), jnp.float32), jnp.zeros((r, s), jnp.int32))
    outputs = lax.cond(jnp.any(wants_logprobs), lambda: _logprob_outputs(raw_logits, tokens, num_logprobs),
                       none_asked)
    return (tokens, num_accepted, *outputs)


def _logprob_outputs(raw_logits, tokens, num_logprobs: int):
    """``(token_logprobs float32[R, S], top_ids int32[R, S, L], top_logprobs float32[R, S, L], token_ranks
    int32[R, S])``: returned logprobs are the model's own (vLLM's raw_logprobs), before min_tokens bans any
    token."""
    logprobs = jax.nn.log_softmax(raw_logits, axis=-1)
    token_logprobs = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
    top_logprobs, top_ids = _top_logprobs(logprobs, num_logprobs)
    token_ranks = 1 + jnp.sum(logprobs > token_logprobs[..., None], axis=-1).astype(jnp.int32)
    return token_logprobs, top_ids.astype(jnp.int32), top_logprobs, token_ranks


def _top_logprobs(logprobs: jax.Array, num: int):
    """``lax.top_k(logprobs, num)`` over ``[R, S, V]``, read off the candidates when they hold the top ``num``
    of every row (XLA's GPU TopK kernel serves k <= 16: a larger k sorts the whole vocabulary)."""
    r, s, vocab = logprobs.shape
    vals, ids, tau = sampling_filter.candidates(logprobs.reshape(r * s, vocab), first=num)
    if vals.shape[-1] < num:
        return lax.top_k(logprobs, num)
    # vals holds num columns; their min is the num-th (a min, not a slice: see sampling_filter.candidates).
    fits = jnp.all(jnp.min(vals, axis=-1) > tau)
    top = lax.cond(fits, lambda: (vals, ids),
                   _rare(lambda: tuple(a.reshape(r * s, num) for a in lax.top_k(logprobs, num))))
    return top[0].reshape(r, s, num), top[1].reshape(r, s, num)


def _rare(branch):
    """``branch`` traced under ``hlo_traffic.RARE_BRANCH``'s scope: an exact fallback that the traffic report
    (``plan``'s bytes moved) does not count as the step's usual work."""
    def scoped():
        with jax.named_scope(RARE_BRANCH):
            return branch()
    return scoped


def first_argmax(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` as ``int32``: the first maximal index, the first NaN if any.

    A max and a masked min-index: XLA CPU lowers ``argmax``'s (value, index) pair reduction to a
    scalar loop (~49 us for ``[8, 512]`` against ~7 us for these two vectorised reductions)."""
    best = jnp.max(logits, axis=-1, keepdims=True)  # NaN when any entry is NaN
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == best) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def _accept_count(ok: jax.Array) -> jax.Array:
    """Drafts accepted per row: the leading run of ``ok`` (``bool[R, S-1]``)."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _place(accepted_drafts: jax.Array, num_accepted: jax.Array, bonus: jax.Array) -> jax.Array:
    """``tokens int32[R, S]``: the accepted drafts, then the bonus token, then zeros."""
    r, s = accepted_drafts.shape[0], accepted_drafts.shape[1] + 1
    pos = jnp.arange(s)
    padded = jnp.concatenate([accepted_drafts, jnp.zeros((r, 1), jnp.int32)], axis=1)
    return jnp.where(pos[None] < num_accepted[:, None], padded,
                     jnp.where(pos[None] == num_accepted[:, None], bonus[:, None], 0)).astype(jnp.int32)


def _greedy_tokens(greedy: jax.Array, drafts: jax.Array, num_drafts: jax.Array):
    """Every row greedy: accept drafts while they equal the argmax, then the argmax after them."""
    r, s = greedy.shape
    if s > 1:
        ok = (greedy[:, : s - 1] == drafts) & (jnp.arange(s - 1)[None, :] < num_drafts[:, None])
        num_accepted = _accept_count(ok)
    else:
        num_accepted = jnp.zeros((r,), jnp.int32)
    bonus = greedy[jnp.arange(r), num_accepted]
    return _place(drafts, num_accepted, bonus), num_accepted


def _sampled_tokens(logits, greedy, drafts, num_drafts, temperature, top_k, top_p, seeds, steps, min_p):
    """Greedy and sampled rows (see the module docstring); ``logits`` already carry the min_tokens bans."""
    r, s, vocab = logits.shape
    pos = jnp.arange(s)
    sampling = temperature > 0
    f = _filter(logits, temperature, top_k, top_p, min_p, jnp.broadcast_to(sampling[:, None], (r, s)))

    def keys_for(seed, step):
        base = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), step)
        return jax.vmap(lambda j: jax.random.fold_in(base, j))(pos)

    keys = jax.vmap(keys_for)(seeds, steps)  # [R, S] keys
    has_draft = pos[None, : s - 1] < num_drafts[:, None]  # [R, S-1]
    if s > 1:
        x_draft = jnp.take_along_axis(f.x[:, : s - 1], drafts[..., None], axis=-1)[..., 0]
        logp_draft = jnp.where(x_draft >= f.t[:, : s - 1], (x_draft - f.m[:, : s - 1]) - f.lse[:, : s - 1], -jnp.inf)
        u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1))))(keys[:, : s - 1])
        ok = jnp.where(sampling[:, None], u < jnp.exp(logp_draft), greedy[:, : s - 1] == drafts) & has_draft
        num_accepted = _accept_count(ok)
        rejected = num_accepted < num_drafts
        rejected_tok = jnp.where(rejected, drafts[jnp.arange(r), jnp.minimum(num_accepted, s - 2)], -1)
    else:
        num_accepted = jnp.zeros((r,), jnp.int32)
        rejected_tok = jnp.full((r,), -1, jnp.int32)

    # Bonus token at position a = num_accepted: from p, minus the rejected draft if there was one.
    rows = jnp.arange(r)
    at = lambda a: a[rows, num_accepted]  # noqa: E731 - [R, S, ...] -> [R, ...] at the bonus position
    bonus_key = jax.vmap(lambda k: jax.random.fold_in(k, 2))(at(keys))
    t, m, lse = at(f.t), at(f.m), at(f.lse)

    def draw(x, ids):
        """Gumbel-max over ``ids`` (``int32[R, n]``, scaled logits ``x``): ``jax.random.categorical`` over the
        whole vocabulary's log-probabilities, for any ``ids`` that hold every kept token."""
        logp = jnp.where((x >= t[:, None]) & (ids != rejected_tok[:, None]), (x - m[:, None]) - lse[:, None],
                         -jnp.inf)
        score = jax.vmap(sampling_filter.gumbel_at)(bonus_key, ids) + logp
        best = jnp.max(score, axis=-1, keepdims=True)
        return jnp.min(jnp.where(score == best, ids, vocab), axis=-1)  # the first maximum, as argmax's

    # Candidates hold every kept token of a row whose threshold is above tau: draw among them (C Gumbel
    # numbers a row, not V); the same token a draw over the vocabulary gives, since token i's noise is fixed.
    on_candidates = jnp.all(~sampling | (t > at(f.tau)))
    sampled = lax.cond(on_candidates, lambda: draw(at(f.vals), at(f.ids)),
                       lambda: draw(at(f.x), jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), (r, vocab))))
    bonus = jnp.where(sampling, sampled.astype(jnp.int32), greedy[rows, num_accepted])
    return _place(drafts, num_accepted, bonus), num_accepted
