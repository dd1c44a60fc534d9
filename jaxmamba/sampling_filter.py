"""Top-k / top-p / min-p thresholds and per-token Gumbel noise without sorting the vocabulary.

The filtered distribution of ``jaxmamba.sampling`` keeps, per row, the tokens whose scaled logit is
``>= t`` for one threshold ``t`` (the largest of the min-p floor, the k-th largest logit and the
top-p cut), so the filter is a threshold per row, not an order. Thresholds come from a candidate set:

* Candidates: the vocabulary in groups of ``group`` tokens, the top ``per_group`` of each group
  (``lax.top_k``; XLA's GPU TopK kernel serves k <= 16, larger k lowers to a sort of the whole row),
  then those ``V / group * per_group`` values ordered. Every token whose logit is above
  ``tau`` (the largest of the groups' ``per_group``-th values) is among them, so a threshold
  ``t > tau`` read off the candidates is exact, and its kept tokens are all candidates.
* Otherwise (a flat distribution, a top_k past the candidates, a cut at ``tau``): the exact threshold
  by bisection over the float order of the logits (``exact_thresholds``: 32 masked counts for top-k,
  32 masked sums for top-p over the vocabulary), no sort. The caller runs it under a ``lax.cond``, only
  for batches that need it.

``gumbel_at(key, ids)`` is ``jax.random.gumbel(key, (V,))[ids]`` computed for ``ids`` alone (the
partitionable threefry layout: token ``i``'s bits depend on ``key`` and ``i`` only), so a Gumbel-max
draw over the candidates picks the token a draw over the whole vocabulary picks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

#: Tokens per candidate group and candidates kept per group (XLA GPU's TopK kernel handles k <= 16).
CANDIDATE_GROUP = 1024
CANDIDATES_PER_GROUP = 16

_SIGN = np.uint32(0x80000000)


def candidates(x: jax.Array, group: int = CANDIDATE_GROUP, per_group: int = CANDIDATES_PER_GROUP,
               first: int | None = None):
    """``(values float32[N, C], ids int32[N, C], tau float32[N])`` for ``x`` ``float32[N, V]``: candidates in
    descending order (ties: lower id first), ``C = ceil(V / group) * per_group`` (or only the ``first`` of
    them: a TopK, not a sort of all of them, on XLA CPU); every token of ``x`` with a value ``> tau`` is a
    candidate (``tau = -inf``: all are)."""
    n, vocab = x.shape
    group = min(group, vocab)
    per_group = min(per_group, group)
    groups = -(-vocab // group)
    padded = jnp.pad(x, ((0, 0), (0, groups * group - vocab)), constant_values=-jnp.inf)
    vals, ids = lax.top_k(padded.reshape(n, groups, group), per_group)  # [N, G, per_group]
    # The groups' last values as a min, not a slice at [..., -1]: XLA CPU keeps lax.top_k a TopK call only
    # while every use of it reads from its first value on (else it sorts each whole group).
    tau = jnp.max(jnp.min(vals, axis=-1), axis=-1) if per_group < group else jnp.full((n,), -jnp.inf, x.dtype)
    ids = ids + (jnp.arange(groups, dtype=ids.dtype) * group)[None, :, None]
    total = groups * per_group
    vals, order = lax.top_k(vals.reshape(n, total), min(first or total, total))
    ids = jnp.take_along_axis(ids.reshape(n, total), order, axis=-1)
    return vals, ids.astype(jnp.int32), tau


def kept_mass(x: jax.Array, m: jax.Array, t: jax.Array) -> jax.Array:
    """``float32[N]``: ``sum(exp(x - m))`` over the tokens ``x >= t`` (``x`` ``[N, V]``, ``m``/``t`` ``[N]``)."""
    return jnp.sum(jnp.where(x >= t[:, None], jnp.exp(x - m[:, None]), 0.0), axis=-1)


def fast_thresholds(x, m, floor, top_k, top_p, group: int = CANDIDATE_GROUP,
                    per_group: int = CANDIDATES_PER_GROUP):
    """The filter's threshold per row from the candidates: ``(t, exact, (vals, ids, tau))``.

    ``x`` ``float32[N, V]``: scaled logits; ``m`` their row max; ``floor`` the min-p floor (``-inf``: off);
    ``top_k`` ``int32[N]`` (``<= 0`` or ``>= V``: off); ``top_p`` ``float32[N]`` (``>= 1``: off). Rows keep
    ``x >= t``. ``exact`` (``bool[N]``) marks the rows whose ``t`` is ``exact_thresholds``'s; the others
    need it."""
    vocab = x.shape[-1]
    vals, ids, tau = candidates(x, group, per_group)
    c = vals.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)
    kth = jnp.take_along_axis(vals, jnp.clip(top_k - 1, 0, c - 1)[:, None], axis=-1)[:, 0]
    # kth == tau is exact too: fewer than k tokens are above tau and k candidates are >= tau, so the k-th is tau.
    k_exact = ~k_on | ((top_k <= c) & (kth >= tau))
    t1 = jnp.maximum(floor, jnp.where(k_on, kth, -jnp.inf))
    # top-p among the tokens top-k and min-p keep: the smallest prefix (by probability) whose mass reaches
    # top_p; the top token always stays. The normaliser is over the whole vocabulary (ties at t1 beyond C).
    probs = jnp.where(vals >= t1[:, None], jnp.exp(vals - m[:, None]), 0.0) / kept_mass(x, m, t1)[:, None]
    mass = jnp.cumsum(probs, axis=-1)
    keep = (mass - probs) < top_p[:, None]
    tp = jnp.min(jnp.where(keep, vals, jnp.inf), axis=-1)
    # Exact when the kept prefix ends inside the candidates and above tau (below it a token may be missing).
    p_on = top_p < 1
    p_exact = ~p_on | ((mass[:, -1] >= top_p) & (tp > tau))
    t = jnp.maximum(t1, jnp.where(p_on, tp, -jnp.inf))
    return t, k_exact & p_exact, (vals, ids, tau)


def exact_thresholds(x, m, floor, top_k, top_p):
    """``fast_thresholds``'s ``t`` for every row (same arguments), by bisection over the vocabulary: 32
    masked counts for top-k, 32 masked sums for top-p, no sort."""
    vocab = x.shape[-1]
    x = jnp.where(x >= floor[:, None], x, -jnp.inf)  # min-p first: its dropped tokens rank last for top-k
    k_on = (top_k > 0) & (top_k < vocab)
    # The k-th largest value is the smallest v with fewer than k tokens above it.
    kth = _smallest_passing(m, lambda v: jnp.sum(x > v[:, None], axis=-1) < top_k)
    t1 = jnp.maximum(floor, jnp.where(k_on, kth, -jnp.inf))
    probs = jnp.where(x >= t1[:, None], jnp.exp(x - m[:, None]), 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    # A token is kept when the mass strictly above it is < top_p: the cut is the smallest such value.
    tp = _smallest_passing(m, lambda v: jnp.sum(jnp.where(x > v[:, None], probs, 0.0), axis=-1) < top_p)
    return jnp.maximum(t1, jnp.where(top_p < 1, tp, -jnp.inf))


def _order_key(v: jax.Array) -> jax.Array:
    """``uint32`` keys in the order of the ``float32`` values (``-inf`` lowest), for bisection."""
    bits = lax.bitcast_convert_type(v, jnp.uint32)
    return jnp.where(bits >= _SIGN, ~bits, bits | _SIGN)


def _from_order_key(k: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(jnp.where(k >= _SIGN, k ^ _SIGN, ~k), jnp.float32)


def _smallest_passing(m: jax.Array, passes) -> jax.Array:
    """``float32[N]``: per row, the smallest float ``v`` in ``(-inf, m]`` with ``passes(v)`` (``bool[N]``, false
    below some value and true from it on, true at ``m``); ``-inf`` when it passes everywhere."""
    lo = _order_key(jnp.full_like(m, -jnp.inf)) - 1  # below every float: never evaluated
    hi = _order_key(m)

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = passes(_from_order_key(mid))
        move = hi - lo > 1
        return jnp.where(move & ~ok, mid, lo), jnp.where(move & ok, mid, hi)

    _, hi = lax.fori_loop(0, 32, step, (lo, hi))
    return _from_order_key(hi)


def gumbel_at(key: jax.Array, ids: jax.Array) -> jax.Array:
    """``jax.random.gumbel(key, (V,))[ids]`` (float32, the default low-precision mode) for a scalar ``key``
    and ``ids`` (int32, any shape, ``0 <= ids < V``), computing only those entries."""
    counts = ids.astype(jnp.uint32)
    zeros = jnp.zeros_like(counts)
    # Every operand shaped (and, under vmap, batched) like the counts: the primitive's batching needs it.
    k1, k2 = (zeros + k for k in jax.random.key_data(key))
    # The partitionable threefry layout: entry i of a flat shape counts (hi, lo) = (0, i) for sizes < 2**32.
    bits1, bits2 = threefry2x32_p.bind(k1, k2, zeros, counts)
    bits = bits1 ^ bits2
    # jax.random.uniform(minval=tiny, maxval=1): 23 random mantissa bits in [1, 2), minus 1, then scaled.
    one = np.float32(1.0)
    tiny = np.float32(np.finfo(np.float32).tiny)
    floats = lax.bitcast_convert_type((bits >> np.uint32(9)) | np.uint32(0x3F800000), jnp.float32) - one
    u = lax.max(tiny, floats * (one - tiny) + tiny)
    return -jnp.log(-jnp.log(u))
