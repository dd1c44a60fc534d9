"""selective_state_update: Pallas kernel vs the plain-JAX reference, slot isolation, validation, lowering."""

from __future__ import annotations

import itertools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.errors import JaxMambaError, MetadataError, SlotError
from pallas_kernels._lowering import lower_for_gpu
from pallas_kernels.reference import selective_state_update_reference, selective_state_update_rows
from pallas_kernels.selective_state_update import selective_state_update


def make_case(seed, *, batch, H, G, P, N, num_spec, dtype, varlen=None, tied=True, optional=True, separate_dst=False):
    """A decode (num_spec=0) or spec-decode step with PAD rows, null-slot rows and shuffled slots."""
    rng = np.random.default_rng(seed)
    varlen = num_spec > 0 if varlen is None else varlen
    ncols = 1 + num_spec
    num_slots = batch * ncols * (2 if separate_dst else 1) + 3  # a few slots nobody names
    slots = rng.permutation(np.arange(1, num_slots)).astype(np.int32)
    sbi = slots[: batch * ncols].reshape(batch, ncols)
    kinds = rng.choice(["live", "pad", "null"], size=batch, p=[0.7, 0.15, 0.15])
    if batch > 1:
        kinds[0] = "live"
    sbi[kinds == "pad"] = -1
    sbi[kinds == "null"] = 0
    kw = {}
    if varlen:
        lens = rng.integers(1, (ncols if num_spec else 3) + 1, size=batch)
        lens[rng.random(batch) < 0.15] = 0  # empty requests
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        T = max(1, int(cu[-1]) + int(rng.integers(0, 3)))  # padding tokens after the last request
        kw["cu_seqlens"] = cu
    else:
        T = batch
    if num_spec:
        if batch > 1:  # a live row that writes only some of its destinations
            sbi[0, rng.integers(0, ncols)] = rng.choice([-1, 0])
        kw["num_accepted_tokens"] = rng.integers(1, ncols + 1, size=batch).astype(np.int32)
        kw["state_batch_indices"] = sbi
    else:
        kw["state_batch_indices"] = sbi[:, 0] if not varlen else sbi
    if separate_dst:
        dst = slots[batch * ncols : 2 * batch * ncols].reshape(batch, ncols)
        dst[kinds == "pad"] = -1
        kw["dst_state_batch_indices"] = dst if (num_spec or varlen) else dst[:, 0]

    def n(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    state = n(num_slots, H, P, N, scale=0.5).astype(dtype)
    x = n(T, H, P).astype(dtype)
    dt = (n(T, H) * 0.5 - 1.0).astype(dtype)
    A = -jnp.exp(n(H, scale=0.5))
    B = n(T, G, N, scale=N**-0.5).astype(dtype)
    C = n(T, G, N, scale=N**-0.5).astype(dtype)
    D = n(H) if optional else None
    z = n(T, H, P).astype(dtype) if optional else None
    dt_bias = n(H, scale=0.5) if optional else None
    if not tied:
        A = jnp.broadcast_to(A[:, None, None], (H, P, N)) * (1.0 + 0.1 * n(H, P, N))
        dt = jnp.broadcast_to(dt[:, :, None], (T, H, P)) + (0.1 * n(T, H, P)).astype(dtype)
        D = None if D is None else jnp.broadcast_to(D[:, None], (H, P)) + 0.1 * n(H, P)
        dt_bias = None if dt_bias is None else jnp.broadcast_to(dt_bias[:, None], (H, P)) + 0.1 * n(H, P)
    args = (state, x, dt, A, B, C, D, z, dt_bias)
    return args, dict(dt_softplus=True, **kw)


def check_against_reference(kt, args, kw, dtype, interpret, **block_sizes):
    state = args[0]
    out, new_state = selective_state_update(*args, **kw, interpret=interpret, **block_sizes)
    ref_out, ref_state = selective_state_update_reference(*args, **kw)
    assert out.dtype == args[1].dtype and new_state.dtype == state.dtype
    kt.assert_close(out, ref_out, dtype, "out")
    kt.assert_close(new_state, ref_state, dtype, "ssm_state")
    named = kt.named_slots(kw["state_batch_indices"], kw.get("dst_state_batch_indices"), num_slots=state.shape[0])
    kt.assert_unnamed_untouched(state, new_state, named)
    kt.assert_unnamed_untouched(state, ref_state, named, "reference state")
    return out, new_state


# (batch, H, G, P, N, num_spec, dtype): every value of each swept range appears at least once.
SWEEP = [
    (1, 2, 1, 16, 16, 0, jnp.float32),
    (7, 8, 2, 64, 128, 0, jnp.float32),
    (33, 8, 8, 16, 32, 0, jnp.bfloat16),
    (5, 4, 2, 128, 64, 1, jnp.float32),
    (9, 8, 8, 32, 16, 2, jnp.bfloat16),
    (6, 4, 1, 48, 128, 3, jnp.float32),
    (17, 2, 2, 24, 48, 3, jnp.bfloat16),
]


@pytest.mark.parametrize("batch,H,G,P,N,num_spec,dtype", SWEEP)
def test_matches_reference(kt, interpret, batch, H, G, P, N, num_spec, dtype):
    args, kw = make_case(batch * 100 + num_spec, batch=batch, H=H, G=G, P=P, N=N, num_spec=num_spec, dtype=dtype)
    check_against_reference(kt, args, kw, dtype, interpret)


@pytest.mark.parametrize(
    "variant",
    ["untied", "no_optional", "separate_dst", "varlen_no_spec", "small_block_p"],
)
def test_argument_forms(kt, interpret, variant):
    """vLLM's full (H,P,N)/(T,H,P) forms, absent D/z/dt_bias, explicit destinations, varlen without spec."""
    opts = dict(batch=6, H=4, G=2, P=24, N=16, num_spec=2, dtype=jnp.float32)
    blocks = {}
    if variant == "untied":
        opts["tied"] = False
    elif variant == "no_optional":
        opts["optional"] = False
    elif variant == "separate_dst":
        opts.update(separate_dst=True, num_spec=0)
    elif variant == "varlen_no_spec":
        opts.update(num_spec=0, varlen=True)
    else:
        blocks = dict(block_p=8, num_warps=2)
    args, kw = make_case(7, **opts)
    check_against_reference(kt, args, kw, jnp.float32, interpret, **blocks)


def test_spec_semantics_by_hand(interpret):
    """Source = column num_accepted-1; token t's state lands in column t (vLLM)."""
    H, P, N, slots = 1, 16, 16, 8
    state = jnp.zeros((slots, H, P, N)).at[3].set(1.0).at[5].set(2.0)
    x = jnp.ones((3, H, P))
    dt = jnp.zeros((3, H)) + 1.0
    A = jnp.zeros((H,))  # decay 1: h_t = h_{t-1} + x B
    B = jnp.ones((3, 1, N))
    C = jnp.ones((3, 1, N))
    sbi = np.array([[3, 5, 6]], np.int32)
    out, new = selective_state_update(
        state, x, dt, A, B, C, state_batch_indices=sbi, num_accepted_tokens=np.array([2], np.int32),
        cu_seqlens=np.array([0, 3], np.int32), interpret=interpret,
    )
    # starts from slot 5 (= 2.0); states 3, 4, 5 go to slots 3, 5, 6.
    np.testing.assert_allclose(np.asarray(new[3, 0, 0, 0]), 3.0)
    np.testing.assert_allclose(np.asarray(new[5, 0, 0, 0]), 4.0)
    np.testing.assert_allclose(np.asarray(new[6, 0, 0, 0]), 5.0)
    np.testing.assert_allclose(np.asarray(out[:, 0, 0]), [3.0 * N, 4.0 * N, 5.0 * N])


@pytest.mark.parametrize("columns", [1, 3])
def test_varlen_without_num_accepted(interpret, columns):
    """cu_seqlens, no num_accepted_tokens: one column -> final state only (vLLM's in-place varlen update);
    several columns -> token t's state to column t (the multi-column contract of docs/architecture.md,
    "selective_state_update")."""
    H, P, N, slots = 1, 16, 16, 8
    state = jnp.zeros((slots, H, P, N)).at[3].set(1.0)
    x, dt, A = jnp.ones((3, H, P)), jnp.ones((3, H)), jnp.zeros((H,))
    B = C = jnp.ones((3, 1, N))
    sbi = np.array([[3, 5, 6][:columns]], np.int32)
    _, new = selective_state_update(state, x, dt, A, B, C, state_batch_indices=sbi,
                                    cu_seqlens=np.array([0, 3], np.int32), interpret=interpret)
    got = np.asarray(new[:, 0, 0, 0])
    np.testing.assert_allclose(got[[3, 5, 6]], [4.0, 0.0, 0.0] if columns == 1 else [2.0, 3.0, 4.0])


def test_nan_in_other_slots_is_isolated(kt, interpret):
    """NaN in another request's slot and in unnamed slots leaves a request's out/state bitwise unchanged."""
    args, kw = make_case(11, batch=6, H=4, G=2, P=16, N=16, num_spec=2, dtype=jnp.float32)
    state = args[0]
    out0, st0 = selective_state_update(*args, **kw, interpret=interpret)
    sbi = np.asarray(kw["state_batch_indices"])
    na = np.asarray(kw["num_accepted_tokens"])
    victim = next(b for b in range(1, 6) if sbi[b, na[b] - 1] > 0)
    src = sbi[victim, na[victim] - 1]
    named = kt.named_slots(sbi, num_slots=state.shape[0])
    poisoned = state.at[src].set(jnp.nan)
    for slot in range(state.shape[0]):
        if slot not in named:
            poisoned = poisoned.at[slot].set(jnp.nan)  # includes the null slot 0
    out1, st1 = selective_state_update(poisoned, *args[1:], **kw, interpret=interpret)
    cu = np.asarray(kw["cu_seqlens"])
    for b in range(6):
        if b == victim:
            continue
        kt.assert_bitwise(out1[cu[b] : cu[b + 1]], out0[cu[b] : cu[b + 1]], f"out of request {b}")
        for slot in sbi[b]:
            if slot > 0 and slot != src:
                kt.assert_bitwise(st1[slot], st0[slot], f"slot {slot} of request {b}")
    assert np.isnan(np.asarray(out1[cu[victim] : cu[victim + 1]])).all() or cu[victim] == cu[victim + 1]


def test_validation_names_the_argument():
    args, kw = make_case(3, batch=4, H=2, G=1, P=16, N=16, num_spec=1, dtype=jnp.float32)
    num_slots = args[0].shape[0]
    bad = np.array(kw["state_batch_indices"])
    bad[1, 0] = num_slots
    with pytest.raises(SlotError, match=r"state_batch_indices\[1, 0\]"):
        selective_state_update(*args, **{**kw, "state_batch_indices": bad}, interpret=True)
    with pytest.raises(SlotError, match="dst_state_batch_indices"):
        selective_state_update(*args, **{**kw, "dst_state_batch_indices": bad - 2 * num_slots}, interpret=True)
    with pytest.raises(MetadataError, match="cu_seqlens"):
        cu = np.array(kw["cu_seqlens"])
        cu[-1] = args[1].shape[0] + 1
        selective_state_update(*args, **{**kw, "cu_seqlens": cu}, interpret=True)
    with pytest.raises(MetadataError, match="num_accepted_tokens"):
        selective_state_update(*args, **{**kw, "num_accepted_tokens": np.full(4, 3, np.int32)}, interpret=True)
    with pytest.raises(SlotError):
        selective_state_update_reference(*args, **{**kw, "state_batch_indices": bad})


def test_out_of_range_index_under_jit_is_skipped(kt):
    """Under jit nothing is validated, but an out-of-range slot is never dereferenced."""
    state = jnp.arange(4 * 2 * 16 * 16, dtype=jnp.float32).reshape(4, 2, 16, 16)
    x = jnp.ones((2, 2, 16))
    dt, A = jnp.ones((2, 2)), -jnp.ones((2,))
    B = C = jnp.ones((2, 1, 16))

    @jax.jit
    def f(state, idx):
        return selective_state_update(state, x, dt, A, B, C, state_batch_indices=idx, interpret=True)

    out, new = f(state, jnp.array([2, 9], jnp.int32))
    kt.assert_bitwise(new[3], state[3])  # slot 9 would clamp to 3 in interpret mode
    ref_out, _ = selective_state_update_reference(state, x, dt, A, B, C, state_batch_indices=np.array([2, -1]))
    kt.assert_close(out, ref_out, jnp.float32)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype,spec,tied", [(jnp.float32, False, True), (jnp.bfloat16, True, False)])
def test_lowers_for_h100(dtype, spec, tied):
    """Triton lowering for an abstract H100 (catches non power-of-2 blocks, unsupported primitives)."""
    slots, H, P, N, G, batch = 64, 8, 48, 128, 2, 4
    T = batch * 4 if spec else batch
    dt = S((T, H), dtype) if tied else S((T, H, P), dtype)
    A = S((H,), jnp.float32) if tied else S((H, P, N), jnp.float32)
    pb = S((H,), jnp.float32) if tied else S((H, P), jnp.float32)
    idx = S((batch, 4), jnp.int32) if spec else S((batch,), jnp.int32)

    def f(state, x, dt, A, B, C, D, z, dt_bias, idx, *extra):
        kw = dict(num_accepted_tokens=extra[0], cu_seqlens=extra[1]) if spec else {}
        return selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=True,
                                      state_batch_indices=idx, interpret=False, **kw)

    extra = (S((batch,), jnp.int32), S((batch + 1,), jnp.int32)) if spec else ()
    text = lower_for_gpu(f, S((slots, H, P, N), dtype), S((T, H, P), dtype), dt, A, S((T, G, N), dtype),
                         S((T, G, N), dtype), pb, S((T, H, P), dtype), pb, idx, *extra)
    assert "triton" in text


@pytest.mark.slow
@pytest.mark.parametrize(
    "batch,G,P,N,num_spec,dtype",
    list(itertools.product([1, 4, 33], [1, 2, 8], [16, 64, 128], [16, 128], [0, 1, 3], [jnp.float32, jnp.bfloat16])),
)
def test_matches_reference_full_sweep(kt, interpret, batch, G, P, N, num_spec, dtype):
    args, kw = make_case(batch + 7 * num_spec, batch=batch, H=8, G=G, P=P, N=N, num_spec=num_spec, dtype=dtype)
    check_against_reference(kt, args, kw, dtype, interpret)


def test_max_query_len_bounds_the_token_loop(kt, interpret):
    """A mixed step's decode rows have 1 + num_spec tokens at most, in a bucket of many more tokens: with
    ``max_query_len`` the results are unchanged, the reference's token loop runs that many times (not
    ``T - batch + 1``), and a longer request is refused while the offsets are concrete."""
    args, kw = make_case(5, batch=6, H=4, G=2, P=16, N=16, num_spec=0, dtype=jnp.float32, varlen=True)
    cu = np.asarray(kw["cu_seqlens"])
    # The decode rows sit in a bucket of 64 tokens: pad every token-indexed argument.
    T = 64
    state, x, dt, A, B, C, D, z, dt_bias = args
    pad = lambda a: jnp.concatenate([a, jnp.zeros((T - a.shape[0],) + a.shape[1:], a.dtype)])  # noqa: E731
    args = (state, pad(x), pad(dt), A, pad(B), pad(C), D, pad(z), dt_bias)
    longest = int(np.diff(cu).max())
    out, new = selective_state_update_reference(*args, **kw)
    out_b, new_b = selective_state_update_reference(*args, **kw, max_query_len=longest)
    np.testing.assert_array_equal(np.asarray(out_b), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(new_b), np.asarray(new))
    check_against_reference(kt, args, dict(kw, max_query_len=longest), jnp.float32, interpret)

    def loop_lengths(**extra):
        jaxpr = jax.make_jaxpr(lambda *a: selective_state_update_reference(*a, **kw, **extra))(*args)
        found = []

        def walk(jx):
            for eqn in jx.eqns:
                if eqn.primitive.name == "scan":
                    found.append(eqn.params["length"])
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)

        walk(jaxpr.jaxpr)
        return found

    assert loop_lengths(max_query_len=longest) == [longest]
    assert loop_lengths() == [T - 6 + 1]
    with pytest.raises(MetadataError, match="request length"):
        selective_state_update_reference(*args, **kw, max_query_len=longest - 1)


def _decode_inputs(rng, batch, H=4, P=8, N=16, num_slots=8):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    state = f(num_slots, H, P, N)
    return state, (f(batch, H, P), jnp.asarray(rng.random((batch, H)), jnp.float32), -jnp.exp(f(H)), f(batch, 1, N),
                   f(batch, 1, N))


def test_decode_rows_match_each_row_run_alone():
    """A decode batch gives each row, bit for bit, the output and state it gets run alone on the state
    before the step; the null slot, PAD rows and slots nobody names are left untouched."""
    rng = np.random.default_rng(0)
    state, args = _decode_inputs(rng, batch=4)
    src = jnp.asarray([5, 0, -1, 2], jnp.int32)  # a live row, the null slot, a PAD row, another live row
    out, new = selective_state_update_reference(jnp.array(state), *args, state_batch_indices=src)
    for b in range(4):
        row_args = tuple(a[b : b + 1] for a in args[:2]) + (args[2],) + tuple(a[b : b + 1] for a in args[3:])
        o, s = selective_state_update_reference(jnp.array(state), *row_args, state_batch_indices=src[b : b + 1])
        np.testing.assert_array_equal(np.asarray(out[b]), np.asarray(o[0]))
        if int(src[b]) > 0:
            np.testing.assert_array_equal(np.asarray(new[int(src[b])]), np.asarray(s[int(src[b])]))
    untouched = [i for i in range(state.shape[0]) if i not in (5, 2)]
    np.testing.assert_array_equal(np.asarray(new[jnp.asarray(untouched)]), np.asarray(state[jnp.asarray(untouched)]))


def test_decode_row_reading_a_slot_an_earlier_row_writes_sees_the_old_state():
    """Row 1 reads slot 3, which row 0 writes in the same step: the reference reads every row's state as
    it was before the step (a row-by-row in-place update would hand row 1 row 0's new state)."""
    rng = np.random.default_rng(1)
    state, args = _decode_inputs(rng, batch=2)
    src, dst = jnp.asarray([[1], [3]], jnp.int32), jnp.asarray([[3], [4]], jnp.int32)
    out, new = selective_state_update_reference(jnp.array(state), *args, state_batch_indices=src,
                                                dst_state_batch_indices=dst)
    for b in range(2):
        row_args = tuple(a[b : b + 1] for a in args[:2]) + (args[2],) + tuple(a[b : b + 1] for a in args[3:])
        o, s = selective_state_update_reference(jnp.array(state), *row_args, state_batch_indices=src[b : b + 1],
                                                dst_state_batch_indices=dst[b : b + 1])
        np.testing.assert_array_equal(np.asarray(out[b]), np.asarray(o[0]), err_msg=f"row {b} output")
        np.testing.assert_array_equal(np.asarray(new[int(dst[b, 0])]), np.asarray(s[int(dst[b, 0])]))


@pytest.mark.parametrize("G, per_head_dt, extras, state_dtype", [
    (1, False, False, jnp.float32), (2, True, True, jnp.float32), (4, False, True, jnp.bfloat16)])
def test_rows_form_matches_the_indexed_reference(G, per_head_dt, extras, state_dtype):
    """``selective_state_update_rows`` (a multi-step window's working set: state r is token r's, no index
    arrays) equals the indexed reference on the same states gathered from slots, bit for bit, for active
    rows; inactive rows keep their state (as PAD rows of the reference leave their slots) and output zeros
    (the reference runs a PAD row from a zero state; a window discards either)."""
    rng = np.random.default_rng(G)
    R, H, P, N, num_slots = 5, 4, 8, 16, 9
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    cache = f(num_slots, H, P, N).astype(state_dtype)
    x, B, C = f(R, H, P), f(R, G, N), f(R, G, N)
    dt = jnp.asarray(rng.random((R, H, P) if per_head_dt else (R, H)), jnp.float32)
    A = -jnp.exp(f(H))
    kw = dict(D=f(H), z=f(R, H, P), dt_bias=f(H) if not per_head_dt else None, dt_softplus=True) if extras else {}
    slots = jnp.asarray([3, 7, 1, 8, 5], jnp.int32)
    active = jnp.asarray([True, False, True, True, False])
    out_ref, new_cache = selective_state_update_reference(
        jnp.array(cache), x, dt, A, B, C, state_batch_indices=jnp.where(active, slots, -1), **kw)
    out, rows = selective_state_update_rows(cache[slots], x, dt, A, B, C, active=active, **kw)
    assert rows.dtype == state_dtype and out.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out[active]), np.asarray(out_ref[active]))
    np.testing.assert_array_equal(np.asarray(rows.astype(jnp.float32)),
                                  np.asarray(new_cache[slots].astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(out[~active]), 0)
    np.testing.assert_array_equal(np.asarray(rows[~active].astype(jnp.float32)),
                                  np.asarray(cache[slots][~active].astype(jnp.float32)))
    with pytest.raises(JaxMambaError, match="rows: 5 tokens, 9 states"):
        selective_state_update_rows(cache, x, dt, A, B, C, active=active)
