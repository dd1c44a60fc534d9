"""causal_conv1d_update (decode / spec decode, DS layout): kernel vs reference, isolation, validation, lowering."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.errors import MetadataError, SlotError
from pallas_kernels._lowering import lower_for_gpu
from pallas_kernels.causal_conv1d_update import causal_conv1d_update
from pallas_kernels.reference import causal_conv1d_update_reference


def make_case(seed, *, batch, dim, K, num_spec, dtype, ragged=True, with_bias=True, two_d=False, dst=False):
    rng = np.random.default_rng(seed)
    R = K - 1 + num_spec
    num_slots = batch * (2 if dst else 1) + 3
    slots = rng.permutation(np.arange(1, num_slots)).astype(np.int32)
    idx = slots[:batch].copy()
    kinds = rng.choice(["live", "pad", "null"], size=batch, p=[0.7, 0.15, 0.15])
    if batch > 1:
        kinds[0] = "live"
    idx[kinds == "pad"] = -1
    idx[kinds == "null"] = 0
    kw = dict(conv_state_indices=np.stack([idx, slots[batch - 1 :: -1][:batch]], 1) if two_d else idx)
    if num_spec:
        maxq = num_spec + 1
        lens = np.full(batch, maxq)
        if ragged:
            lens = rng.integers(0, maxq + 1, size=batch)
            lens[0] = maxq
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        T = max(1, int(qsl[-1]) + int(rng.integers(0, 3)))
        kw.update(query_start_loc=qsl, num_accepted_tokens=rng.integers(1, maxq + 1, size=batch).astype(np.int32))
    else:
        T = batch
    if dst:
        d = slots[batch : 2 * batch].copy()
        d[kinds == "pad"] = -1
        kw["dst_conv_state_indices"] = d
    f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)  # noqa: E731
    args = (f(T, dim).astype(dtype), f(num_slots, dim, R).astype(dtype), f(dim, K, sc=K**-0.5).astype(dtype),
            f(dim).astype(dtype) if with_bias else None)
    return args, dict(activation="silu", **kw)


def check(kt, args, kw, dtype, interpret, **blocks):
    x, state = args[0], args[1]
    out, new = causal_conv1d_update(*args, **kw, interpret=interpret, **blocks)
    ref_out, ref_new = causal_conv1d_update_reference(*args, **kw)
    assert out.dtype == x.dtype and new.dtype == state.dtype
    kt.assert_close(out, ref_out, dtype, "out")
    kt.assert_close(new, ref_new, dtype, "conv_state")
    idx = np.asarray(kw["conv_state_indices"])
    named = kt.named_slots(idx[:, 0] if idx.ndim == 2 else idx, kw.get("dst_conv_state_indices"),
                           num_slots=state.shape[0])
    kt.assert_unnamed_untouched(state, new, named, "conv_state")
    # skipped rows and tokens outside every request keep x
    process = np.array([0 < i < state.shape[0] for i in (idx[:, 0] if idx.ndim == 2 else idx)])
    qsl = kw.get("query_start_loc")
    for b in np.nonzero(~process)[0]:
        rows = slice(b, b + 1) if qsl is None else slice(qsl[b], qsl[b + 1])
        kt.assert_bitwise(out[rows], x[rows], f"output of skipped row {b}")


SWEEP = [  # (batch, dim, K, num_spec, dtype)
    (1, 16, 4, 0, jnp.float32),
    (33, 200, 4, 0, jnp.bfloat16),
    (7, 96, 2, 1, jnp.float32),
    (9, 40, 3, 2, jnp.bfloat16),
    (6, 300, 4, 3, jnp.float32),
    (12, 64, 2, 3, jnp.bfloat16),
]


@pytest.mark.parametrize("batch,dim,K,num_spec,dtype", SWEEP)
def test_matches_reference(kt, interpret, batch, dim, K, num_spec, dtype):
    args, kw = make_case(batch + 10 * K + num_spec, batch=batch, dim=dim, K=K, num_spec=num_spec, dtype=dtype)
    check(kt, args, kw, dtype, interpret, block_d=32 if dim < 100 else None)


@pytest.mark.parametrize("variant", ["no_bias", "index_2d", "dst", "full_length", "varlen_no_spec"])
def test_argument_forms(kt, interpret, variant):
    opts = dict(batch=5, dim=24, K=4, num_spec=2, dtype=jnp.float32)
    if variant == "no_bias":
        opts["with_bias"] = False
    elif variant == "index_2d":
        opts["two_d"] = True
    elif variant == "dst":
        opts["dst"] = True
    elif variant == "full_length":
        opts["ragged"] = False
    args, kw = make_case(5, **opts)
    if variant == "varlen_no_spec":  # query_start_loc without num_accepted_tokens: shift by the query length
        kw.pop("num_accepted_tokens")
    check(kt, args, kw, jnp.float32, interpret, block_d=16)


def test_nan_in_other_slots_is_isolated(kt, interpret):
    args, kw = make_case(21, batch=6, dim=24, K=4, num_spec=2, dtype=jnp.float32, ragged=False)
    x, state = args[0], args[1]
    out0, st0 = causal_conv1d_update(*args, **kw, interpret=interpret)
    idx = np.asarray(kw["conv_state_indices"])
    victim = next(b for b in range(1, 6) if idx[b] > 0)
    named = kt.named_slots(idx, num_slots=state.shape[0])
    poisoned = state.at[idx[victim]].set(jnp.nan)
    for slot in range(state.shape[0]):
        if slot not in named:
            poisoned = poisoned.at[slot].set(jnp.nan)
    out1, st1 = causal_conv1d_update(x, poisoned, *args[2:], **kw, interpret=interpret)
    qsl = kw["query_start_loc"]
    for b in range(6):
        if b != victim:
            kt.assert_bitwise(out1[qsl[b] : qsl[b + 1]], out0[qsl[b] : qsl[b + 1]], f"out of request {b}")
            if idx[b] > 0:
                kt.assert_bitwise(st1[idx[b]], st0[idx[b]], f"state of request {b}")


def test_validation_names_the_argument():
    args, kw = make_case(2, batch=4, dim=16, K=4, num_spec=1, dtype=jnp.float32)
    bad = np.array(kw["conv_state_indices"])
    bad[2] = args[1].shape[0] + 3
    with pytest.raises(SlotError, match=r"conv_state_indices\[2\]"):
        causal_conv1d_update(*args, **{**kw, "conv_state_indices": bad}, interpret=True)
    with pytest.raises(MetadataError, match="num_accepted_tokens"):
        na = np.array(kw["num_accepted_tokens"])
        na[0] = 3  # > max_query_len = 2 on a live row
        causal_conv1d_update(*args, **{**kw, "num_accepted_tokens": na}, interpret=True)
    with pytest.raises(MetadataError, match="query_start_loc"):
        causal_conv1d_update(*args, **{**kw, "query_start_loc": np.array([0, 3, 1, 2, 2], np.int32)},
                             interpret=True)
    with pytest.raises(SlotError, match="dst_conv_state_indices"):
        causal_conv1d_update(*args, **kw, dst_conv_state_indices=np.full(4, -5, np.int32), interpret=True)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype,spec", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_lowers_for_h100(dtype, spec):
    dim, K, num_spec, batch, slots = 1000, 4, 3 if spec else 0, 16, 40
    R = K - 1 + num_spec
    T = batch * (1 + num_spec)

    def f(x, state, w, b, idx, *extra):
        kw = dict(num_accepted_tokens=extra[0], query_start_loc=extra[1]) if spec else {}
        return causal_conv1d_update(x, state, w, b, activation="silu", conv_state_indices=idx, interpret=False, **kw)

    extra = (S((batch,), jnp.int32), S((batch + 1,), jnp.int32)) if spec else ()
    text = lower_for_gpu(f, S((T, dim), dtype), S((slots, dim, R), dtype), S((dim, K), dtype), S((dim,), dtype),
                         S((batch,), jnp.int32), *extra)
    assert "triton" in text


@pytest.mark.slow
@pytest.mark.parametrize(
    "batch,dim,K,num_spec,dtype",
    list(itertools.product([1, 8, 33], [64, 200], [2, 3, 4], [0, 1, 2, 3], [jnp.float32, jnp.bfloat16])),
)
def test_matches_reference_full_sweep(kt, interpret, batch, dim, K, num_spec, dtype):
    args, kw = make_case(batch + K + num_spec, batch=batch, dim=dim, K=K, num_spec=num_spec, dtype=dtype)
    check(kt, args, kw, dtype, interpret)
