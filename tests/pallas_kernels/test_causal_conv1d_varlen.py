"""causal_conv1d_varlen (prefill, DS layout): kernel vs reference, initial-state masking, snapshots, lowering."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.errors import MetadataError, SlotError
from pallas_kernels._lowering import lower_for_gpu
from pallas_kernels.causal_conv1d_varlen import causal_conv1d_varlen
from pallas_kernels.reference import causal_conv1d_varlen_reference


def make_case(seed, *, batch, dim, K, max_len, dtype, num_spec=0, bounds=0, dst=False, with_bias=True):
    rng = np.random.default_rng(seed)
    R = K - 1 + num_spec
    per_req = 1 + bounds + (1 if dst else 0)
    num_slots = batch * per_req + 3
    slots = rng.permutation(np.arange(1, num_slots)).astype(np.int32)
    lens = rng.integers(0, max_len + 1, size=batch)
    lens[rng.random(batch) < 0.3] = rng.integers(1, K, size=1)[0]  # shorter than the history
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = max(1, int(qsl[-1]) + int(rng.integers(0, 4)))
    idx = slots[:batch].copy()
    kinds = rng.choice(["live", "pad", "null"], size=batch, p=[0.75, 0.125, 0.125])
    idx[kinds == "pad"] = -1
    idx[kinds == "null"] = 0
    kw = dict(query_start_loc=qsl, cache_indices=idx, has_initial_state=rng.random(batch) < 0.6, activation="silu")
    used = batch
    if dst:
        d = slots[used : used + batch].copy()
        d[kinds == "pad"] = -1
        kw["dst_cache_indices"] = d
        used += batch
    if bounds:
        bpos = rng.integers(-1, max_len + 2, size=(batch, bounds)).astype(np.int32)
        bpos[:, 0] = np.minimum(lens, rng.integers(1, K + 1, size=batch))  # short snapshots reach into history
        bsl = slots[used : used + batch * bounds].reshape(batch, bounds).copy()
        bsl[rng.random((batch, bounds)) < 0.2] = -1
        kw.update(block_boundary_indices=bpos, block_boundary_slots=bsl)
    f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)  # noqa: E731
    args = (f(T, dim).astype(dtype), f(num_slots, dim, R).astype(dtype), f(dim, K, sc=K**-0.5).astype(dtype),
            f(dim).astype(dtype) if with_bias else None)
    return args, kw


def check(kt, args, kw, dtype, interpret, **blocks):
    state = args[1]
    out, new = causal_conv1d_varlen(*args, **kw, interpret=interpret, **blocks)
    ref_out, ref_new = causal_conv1d_varlen_reference(*args, **kw)
    assert out.dtype == args[0].dtype and new.dtype == state.dtype
    kt.assert_close(out, ref_out, dtype, "out")
    kt.assert_close(new, ref_new, dtype, "conv_state")
    named = kt.named_slots(kw["cache_indices"], kw.get("dst_cache_indices"), kw.get("block_boundary_slots"),
                           num_slots=state.shape[0])
    kt.assert_unnamed_untouched(state, new, named, "conv_state")
    K = args[2].shape[1]
    kt.assert_bitwise(new[:, :, K - 1 :], state[:, :, K - 1 :], "rows >= K-1 (spec rows) of every slot")
    return out, new


SWEEP = [  # (batch, dim, K, max_len, dtype)
    (1, 16, 4, 40, jnp.float32),
    (5, 100, 2, 20, jnp.bfloat16),
    (9, 48, 3, 37, jnp.float32),
    (33, 24, 4, 9, jnp.bfloat16),
]


@pytest.mark.parametrize("batch,dim,K,max_len,dtype", SWEEP)
def test_matches_reference(kt, interpret, batch, dim, K, max_len, dtype):
    args, kw = make_case(batch * 3 + K, batch=batch, dim=dim, K=K, max_len=max_len, dtype=dtype, num_spec=K % 2)
    check(kt, args, kw, dtype, interpret, block_t=8, block_d=32)


@pytest.mark.parametrize("variant", ["snapshots", "dst_and_no_bias", "default_blocks"])
def test_argument_forms(kt, interpret, variant):
    opts = dict(batch=6, dim=40, K=4, max_len=30, dtype=jnp.float32)
    if variant == "snapshots":
        opts["bounds"] = 3
    elif variant == "dst_and_no_bias":
        opts.update(dst=True, with_bias=False, bounds=1)
    args, kw = make_case(13, **opts)
    blocks = {} if variant == "default_blocks" else dict(block_t=8, block_d=16)
    check(kt, args, kw, jnp.float32, interpret, **blocks)


def test_garbage_without_initial_state_changes_nothing(kt, interpret):
    """Slots with has_initial_state=False are never read: NaN there gives bitwise the zero-history result."""
    args, kw = make_case(17, batch=6, dim=32, K=4, max_len=12, dtype=jnp.float32)
    x, state = args[0], args[1]
    idx, has = np.asarray(kw["cache_indices"]), np.asarray(kw["has_initial_state"])
    clean = state
    garbage = state
    for b in range(len(idx)):
        if not has[b] and idx[b] > 0:
            clean = clean.at[idx[b]].set(0.0)
            garbage = garbage.at[idx[b]].set(jnp.nan)
    garbage = garbage.at[0].set(jnp.nan)  # the null slot
    out0, st0 = causal_conv1d_varlen(x, clean, *args[2:], **kw, interpret=interpret, block_t=8, block_d=16)
    out1, st1 = causal_conv1d_varlen(x, garbage, *args[2:], **kw, interpret=interpret, block_t=8, block_d=16)
    kt.assert_bitwise(out1, out0, "outputs")
    K = args[2].shape[1]
    for b in range(len(idx)):
        if idx[b] > 0 and kw["query_start_loc"][b + 1] > kw["query_start_loc"][b]:
            kt.assert_bitwise(st1[idx[b], :, : K - 1], st0[idx[b], :, : K - 1], f"final state of request {b}")


def test_validation_names_the_argument():
    args, kw = make_case(1, batch=4, dim=16, K=4, max_len=6, dtype=jnp.float32, bounds=1)
    n = args[1].shape[0]
    with pytest.raises(SlotError, match="cache_indices"):
        causal_conv1d_varlen(*args, **{**kw, "cache_indices": np.array([1, 2, n, 3], np.int32)}, interpret=True)
    with pytest.raises(SlotError, match="block_boundary_slots"):
        causal_conv1d_varlen(*args, **{**kw, "block_boundary_slots": np.full((4, 1), n, np.int32)}, interpret=True)
    with pytest.raises(MetadataError, match="query_start_loc"):
        bad = np.array(kw["query_start_loc"])
        bad[-1] = args[0].shape[0] + 1
        causal_conv1d_varlen(*args, **{**kw, "query_start_loc": bad}, interpret=True)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_h100(dtype):
    dim, K, batch, T, slots = 1000, 4, 8, 640, 40

    def f(x, state, w, b, qsl, idx, has, bpos, bslots):
        return causal_conv1d_varlen(x, state, w, b, query_start_loc=qsl, cache_indices=idx, has_initial_state=has,
                                    block_boundary_indices=bpos, block_boundary_slots=bslots, interpret=False)

    text = lower_for_gpu(f, S((T, dim), dtype), S((slots, dim, K + 1), dtype), S((dim, K), dtype), S((dim,), dtype),
                         S((batch + 1,), jnp.int32), S((batch,), jnp.int32), S((batch,), jnp.bool_),
                         S((batch, 3), jnp.int32), S((batch, 3), jnp.int32))
    assert "triton" in text


@pytest.mark.slow
@pytest.mark.parametrize(
    "batch,dim,K,max_len,dtype",
    list(itertools.product([1, 8, 33], [32, 200], [2, 3, 4], [5, 70], [jnp.float32, jnp.bfloat16])),
)
def test_matches_reference_full_sweep(kt, interpret, batch, dim, K, max_len, dtype):
    args, kw = make_case(batch + K + max_len, batch=batch, dim=dim, K=K, max_len=max_len, dtype=dtype, bounds=2)
    check(kt, args, kw, dtype, interpret)
