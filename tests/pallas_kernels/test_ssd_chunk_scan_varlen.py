"""ssd_chunk_scan_varlen (chunked SSD prefill): kernel vs reference, chunk tables, initial-state masking, lowering."""

from __future__ import annotations

import itertools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.errors import MetadataError
from pallas_kernels._lowering import lower_for_gpu
from pallas_kernels.reference import naive_ssm_recurrence, ssd_chunk_metadata, ssd_chunk_scan_varlen_reference
from pallas_kernels.ssd_chunk_scan_varlen import ssd_chunk_scan_varlen


def make_case(seed, *, batch, H, G, P, N, max_len, chunk_size, dtype, aligned=False, optional=True, init=True):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, max_len + 1, size=batch)
    lens[0] = max(lens[0], 1)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1]) + int(rng.integers(0, 5))
    f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)  # noqa: E731
    args = (
        f(T, H, P).astype(dtype),
        (f(T, H) * 0.5 - 1.0).astype(dtype),
        -jnp.exp(f(H, sc=0.5)),
        f(T, G, N, sc=N**-0.5).astype(dtype),
        f(T, G, N, sc=N**-0.5).astype(dtype),
        f(H) if optional else None,
        f(T, H, P).astype(dtype) if optional else None,
        f(H, sc=0.5) if optional else None,
    )
    kw = dict(chunk_size=chunk_size, cu_seqlens=cu, return_intermediate_states=True)
    if init:
        kw.update(initial_states=f(batch, H, P, N, sc=0.5), has_initial_state=rng.random(batch) < 0.7)
    if aligned:  # the metadata's table: first chunk ends at the next multiple of chunk_size
        computed = rng.integers(0, 3 * chunk_size, size=batch)
        plan = ssd_chunk_metadata(cu, chunk_size, T // chunk_size + 2 * batch, num_computed_tokens=computed)
        kw.update(cu_chunk_seqlens=plan.cu_chunk_seqlens, seq_idx=plan.seq_idx,
                  last_chunk_indices=plan.last_chunk_indices)
    return args, kw


def check(kt, args, kw, dtype, interpret, **blocks):
    out, final, chunks = ssd_chunk_scan_varlen(*args, **kw, interpret=interpret, **blocks)
    r_out, r_final, r_chunks = ssd_chunk_scan_varlen_reference(*args, **kw)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    kt.assert_close(out, r_out, dtype, "out")
    kt.assert_close(final, r_final, dtype, "final_states")
    if kw.get("return_intermediate_states"):
        kt.assert_close(chunks, r_chunks, dtype, "chunk_states")
    else:
        assert chunks is None
    cu = np.asarray(kw["cu_seqlens"])
    kt.assert_bitwise(out[cu[-1] :], jnp.zeros_like(out[cu[-1] :]), "tokens outside every request")
    return out, final, chunks


SWEEP = [  # (batch, H, G, P, N, max_len, chunk_size, dtype)
    (1, 2, 1, 16, 16, 70, 16, jnp.float32),
    (4, 4, 2, 64, 128, 40, 32, jnp.float32),
    (3, 8, 8, 32, 64, 50, 16, jnp.bfloat16),
    (7, 4, 2, 24, 48, 20, 32, jnp.float32),
    (2, 2, 1, 128, 32, 50, 64, jnp.bfloat16),
]


@pytest.mark.parametrize("batch,H,G,P,N,max_len,chunk_size,dtype", SWEEP)
def test_matches_reference(kt, interpret, batch, H, G, P, N, max_len, chunk_size, dtype):
    args, kw = make_case(batch * 7 + P, batch=batch, H=H, G=G, P=P, N=N, max_len=max_len, chunk_size=chunk_size,
                         dtype=dtype, aligned=batch % 2 == 0)
    check(kt, args, kw, dtype, interpret, block_l=16 if chunk_size < 64 else None)


@pytest.mark.parametrize("variant", ["no_optional_no_init_default_blocks", "dt_limit_final_only"])
def test_argument_forms(kt, interpret, variant):
    opts = dict(batch=3, H=2, G=1, P=16, N=16, max_len=40, chunk_size=32, dtype=jnp.float32)
    blocks = {}
    if variant == "no_optional_no_init_default_blocks":
        opts.update(optional=False, init=False)
    args, kw = make_case(23, **opts)
    if variant == "dt_limit_final_only":
        kw.update(dt_limit=(0.05, 0.3), return_intermediate_states=False)
        blocks = dict(block_l=16, block_p=16, num_warps=2)
    check(kt, args, kw, jnp.float32, interpret, **blocks)


def test_chunk_states_at_aligned_block_ends(interpret):
    """With the metadata's aligned table, chunk ends sit on multiples of chunk_size of each request's
    token count, and the chunk state there equals a scan of exactly that prefix (what prefix caching stores)."""
    cs = 16
    args, kw = make_case(31, batch=2, H=2, G=1, P=16, N=16, max_len=50, chunk_size=cs, dtype=jnp.float32,
                         aligned=True, init=False)
    computed = np.array([5, 20])
    cu = np.asarray(kw["cu_seqlens"])
    plan = ssd_chunk_metadata(cu, cs, args[0].shape[0] // cs + 4, num_computed_tokens=computed)
    kw.update(cu_chunk_seqlens=plan.cu_chunk_seqlens, seq_idx=plan.seq_idx, last_chunk_indices=plan.last_chunk_indices)
    _, _, chunks = ssd_chunk_scan_varlen(*args, **kw, interpret=interpret)
    cc, sidx = np.asarray(plan.cu_chunk_seqlens), np.asarray(plan.seq_idx)
    x, dt, A, B, C, D, z, dt_bias = (None if a is None else np.asarray(a, np.float64) for a in args)
    dtp = np.log1p(np.exp(dt + dt_bias))
    checked = 0
    for c in range(len(sidx)):
        b, end = sidx[c], cc[c + 1]
        if cc[c + 1] > cc[c] and end < cu[b + 1]:
            assert (computed[b] + end - cu[b]) % cs == 0
            sl = slice(cu[b], end)
            _, hs = naive_ssm_recurrence(np.zeros((2, 16, 16)), x[sl], dtp[sl], A, B[sl], C[sl])
            np.testing.assert_allclose(np.asarray(chunks[c]), hs[-1], atol=1e-5)
            checked += 1
    assert checked >= 2


def test_garbage_without_initial_state_changes_nothing(kt, interpret):
    args, kw = make_case(41, batch=4, H=2, G=2, P=16, N=16, max_len=30, chunk_size=16, dtype=jnp.float32)
    has = np.asarray(kw["has_initial_state"]).copy()
    has[1] = False
    init = kw["initial_states"]
    clean = jnp.where(jnp.asarray(has)[:, None, None, None], init, 0.0)
    garbage = jnp.where(jnp.asarray(has)[:, None, None, None], init, jnp.nan)
    r0 = ssd_chunk_scan_varlen(*args, **{**kw, "has_initial_state": has, "initial_states": clean},
                               interpret=interpret)
    r1 = ssd_chunk_scan_varlen(*args, **{**kw, "has_initial_state": has, "initial_states": garbage},
                               interpret=interpret)
    for a, b, what in zip(r1, r0, ("out", "final_states", "chunk_states")):
        kt.assert_bitwise(a, b, what)


def test_nan_in_another_request_is_isolated(kt, interpret):
    args, kw = make_case(43, batch=3, H=2, G=1, P=16, N=16, max_len=30, chunk_size=16, dtype=jnp.float32)
    kw["has_initial_state"] = np.ones(3, bool)
    o0, f0, _ = ssd_chunk_scan_varlen(*args, **kw, interpret=interpret)
    poisoned = kw["initial_states"].at[1].set(jnp.nan)
    o1, f1, _ = ssd_chunk_scan_varlen(*args, **{**kw, "initial_states": poisoned}, interpret=interpret)
    cu = np.asarray(kw["cu_seqlens"])
    for b in (0, 2):
        kt.assert_bitwise(o1[cu[b] : cu[b + 1]], o0[cu[b] : cu[b + 1]], f"out of request {b}")
        kt.assert_bitwise(f1[b], f0[b], f"final state of request {b}")


def test_validation():
    args, kw = make_case(5, batch=2, H=2, G=1, P=16, N=16, max_len=20, chunk_size=16, dtype=jnp.float32)
    T = args[0].shape[0]
    with pytest.raises(MetadataError, match="cu_seqlens"):
        ssd_chunk_scan_varlen(*args, **{**kw, "cu_seqlens": np.array([0, T + 1, T + 2], np.int32)}, interpret=True)
    with pytest.raises(MetadataError, match="chunk length"):
        ssd_chunk_scan_varlen(*args, **kw, cu_chunk_seqlens=np.array([0, 17, T], np.int32), interpret=True)
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunk_scan_varlen(*args, **{**kw, "chunk_size": 24}, interpret=True)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype,chunk_size", [(jnp.float32, 128), (jnp.bfloat16, 256)])
def test_lowers_for_h100(dtype, chunk_size):
    T, H, P, N, G, batch = 1024, 8, 64, 128, 2, 4
    nchunks = T // chunk_size + 2 * batch

    def f(x, dt, A, B, C, D, z, dt_bias, cu, init, has, cc, sidx, last):
        return ssd_chunk_scan_varlen(x, dt, A, B, C, D, z, dt_bias, chunk_size=chunk_size, cu_seqlens=cu,
                                     initial_states=init, has_initial_state=has, return_intermediate_states=True,
                                     cu_chunk_seqlens=cc, seq_idx=sidx, last_chunk_indices=last, interpret=False)

    text = lower_for_gpu(
        f, S((T, H, P), dtype), S((T, H), dtype), S((H,), jnp.float32), S((T, G, N), dtype), S((T, G, N), dtype),
        S((H,), jnp.float32), S((T, H, P), dtype), S((H,), jnp.float32), S((batch + 1,), jnp.int32),
        S((batch, H, P, N), jnp.float32), S((batch,), jnp.bool_), S((nchunks + 1,), jnp.int32),
        S((nchunks,), jnp.int32), S((batch,), jnp.int32),
    )
    assert text.count("triton") >= 3


@pytest.mark.slow
@pytest.mark.parametrize(
    "batch,G,P,N,chunk_size,dtype",
    list(itertools.product([1, 5, 33], [1, 2, 8], [16, 64, 128], [16, 128], [16, 64], [jnp.float32, jnp.bfloat16])),
)
def test_matches_reference_full_sweep(kt, interpret, batch, G, P, N, chunk_size, dtype):
    args, kw = make_case(batch + P + N, batch=batch, H=8, G=G, P=P, N=N, max_len=3 * chunk_size,
                         chunk_size=chunk_size, dtype=dtype, aligned=True)
    check(kt, args, kw, dtype, interpret)



def _kernel_dot_precisions(fn, *args, **kw):
    """(operand dtype, precision) of every dot_general inside the pallas_calls that ``fn`` traces to."""
    found = []

    def walk(jaxpr, in_kernel):
        for eqn in jaxpr.eqns:
            if in_kernel and eqn.primitive.name == "dot_general":
                found.append((eqn.invars[0].aval.dtype, eqn.params["precision"]))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub, in_kernel or eqn.primitive.name == "pallas_call")

    walk(jax.make_jaxpr(lambda *a: fn(*a, **kw))(*args).jaxpr, False)
    return found


@pytest.mark.parametrize("interpret", [False, True], ids=["triton", "interpret"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_float32_matmuls_are_not_tf32(dtype, interpret):
    """Triton lowers a float32 ``dot`` as TF32 unless told otherwise: on an H100 every float32 SSD test
    missed its reference by 1e-4..1e-3 (2026-11-27). A float32 scan asks for 3xTF32 on every product when
    compiled (IEEE took chunk_scan to 255 registers) and HIGHEST in the interpreter (XLA's CPU has no
    3xTF32); a bf16 scan keeps its one float32 product (C·state) on TF32, which cost 2.4x as IEEE."""
    args, kw = make_case(0, batch=2, H=2, G=1, P=16, N=16, max_len=20, chunk_size=16, dtype=dtype)
    dots = _kernel_dot_precisions(lambda *a, **k: ssd_chunk_scan_varlen(*a, **k, interpret=interpret), *args, **kw)
    assert len(dots) >= 4, dots  # bmm, chunk state, and the scan's two products at least
    if interpret:
        f32 = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    else:
        f32 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    for operand_dtype, precision in dots:
        if dtype == jnp.float32:
            assert precision == f32, (operand_dtype, precision)
        else:
            assert precision is None, (operand_dtype, precision)
    if dtype == jnp.bfloat16:
        assert any(d == jnp.float32 for d, _ in dots), "the C·state product runs in float32"


def test_short_rows_take_shorter_row_blocks():
    """The passes run whole ``block_l``-row tiles of every chunk: a launch of one-token rows (a mixed bucket
    with T = R) takes 16-row tiles, one of long prompts keeps the default."""
    from pallas_kernels.ssd_chunk_scan_varlen import default_block_sizes

    blocks = lambda n, dtype=jnp.bfloat16: default_block_sizes(dtype, 128, 64, 128, tokens_per_row=n)  # noqa: E731
    assert default_block_sizes(jnp.bfloat16, 128, 64, 128)["block_l"] == 64
    assert [blocks(n)["block_l"] for n in (1, 8, 16, 17, 40, 512)] == [16, 16, 16, 32, 64, 64]
    assert blocks(1000, jnp.float32)["block_l"] == 32 and blocks(2, jnp.float32)["block_l"] == 16
    assert blocks(1)["scan_num_warps"] == 4  # 16 x 64 tiles: the smaller warp count


def test_one_token_rows_match_the_reference(kt, interpret):
    """Eight rows of one or two tokens: the launch picks 16-row tiles by itself."""
    args, kw = make_case(3, batch=8, H=2, G=1, P=16, N=16, max_len=2, chunk_size=64, dtype=jnp.float32)
    check(kt, args, kw, jnp.float32, interpret)
