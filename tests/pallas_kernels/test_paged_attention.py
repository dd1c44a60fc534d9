"""Paged attention: the block-by-block reference against a float64 oracle, both kernels against the reference.

Batches are built like the serving step's: rows packed by ``query_start_loc``
(decodes, spec-decode rows, chunked-prefill rows with earlier chunks and prefix
hits in the cache), padded rows with an all-null block table, padding tokens
past the last row. The null block, the stale tail of every row's last block and
every block no row owns hold NaN: no output may see them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.errors import ConfigError, JaxMambaError, MetadataError
from pallas_kernels import dispatch
from pallas_kernels._lowering import lower_for_gpu
from pallas_kernels.paged_attention_decode import paged_attention_decode
from pallas_kernels.paged_attention_varlen import paged_attention_varlen, query_block_plan
from pallas_kernels.reference.paged_attention import paged_attention_reference


def make_batch(rows, *, hq, hkv, d, block_size, dtype, pad_rows=1, pad_tokens=2, blocks_per_row=None, seed=0):
    """A packed batch: ``rows`` = [(query_len, context_len)], context counting this step's tokens.

    Returns ``(q, kv, block_table, query_start_loc, positions)`` as numpy/jax arrays.
    """
    rng = np.random.default_rng(seed)
    need = [-(-ctx // block_size) for _, ctx in rows]
    b = blocks_per_row or max(max(need), 1) + 1
    num_blocks = sum(need) + 3
    r = len(rows) + pad_rows
    qlens = [ql for ql, _ in rows] + [0] * pad_rows
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    t = int(qsl[-1]) + pad_tokens
    owned = rng.permutation(np.arange(1, num_blocks))  # block 0 is the null block
    table = np.zeros((r, b), np.int32)
    positions = np.zeros(t, np.int32)
    kv = rng.standard_normal((2, num_blocks, block_size, hkv, d)).astype(np.float32)
    stale = np.ones((num_blocks, block_size), bool)  # slots no token may see
    k = 0
    for i, (ql, ctx) in enumerate(rows):
        table[i, :need[i]] = owned[k:k + need[i]]
        k += need[i]
        for j in range(ctx):
            stale[table[i, j // block_size], j % block_size] = False
        positions[qsl[i]:qsl[i] + ql] = np.arange(ctx - ql, ctx)
    kv[:, stale] = np.nan
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    return jnp.asarray(q, dtype), jnp.asarray(kv, dtype), table, qsl, positions


def oracle(q, kv, table, qsl, positions, scale):
    """Float64, token by token, reading only the keys each token may see."""
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    t, hq, d = q.shape
    bs, hkv = kv.shape[2], kv.shape[3]
    out = np.zeros((t, hq, d))
    for row in range(len(qsl) - 1):
        for tok in range(qsl[row], qsl[row + 1]):
            js = np.arange(positions[tok] + 1)
            keys = kv[0, table[row, js // bs], js % bs]  # [n, Hkv, d]
            vals = kv[1, table[row, js // bs], js % bs]
            kh = np.arange(hq) // (hq // hkv)
            s = np.einsum("hd,nhd->hn", q[tok], keys[:, kh]) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[tok] = np.einsum("hn,nhd->hd", p / p.sum(-1, keepdims=True), vals[:, kh])
    return out


TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 3e-2}


def assert_matches(actual, expected, dtype, what):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    assert np.isfinite(actual).all(), f"{what}: non-finite output (a masked NaN leaked)"
    np.testing.assert_allclose(actual, np.asarray(expected, np.float32), atol=TOL[jnp.dtype(dtype)],
                               rtol=TOL[jnp.dtype(dtype)], err_msg=what)


DECODE_ROWS = [(1, 1), (1, 17), (1, 95), (1, 40), (1, 64)]
SPEC_ROWS = [(3, 3), (3, 50), (3, 33)]
MIXED_ROWS = [(1, 30), (1, 2), (37, 37), (20, 70), (5, 5), (16, 48)]  # decodes, whole prompts, later chunks / hits


@pytest.mark.parametrize("rows", [DECODE_ROWS, SPEC_ROWS, MIXED_ROWS], ids=["decode", "spec", "mixed"])
@pytest.mark.parametrize("hq,hkv,d,bs", [(4, 4, 16, 16), (8, 2, 32, 32), (4, 1, 16, 5)])
def test_reference_matches_oracle(rows, hq, hkv, d, bs):
    q, kv, table, qsl, pos = make_batch(rows, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=jnp.float32)
    expected = oracle(q, kv, table, qsl, pos, d ** -0.5)
    for step in (1, 16, 48):  # one block per step .. several blocks per step
        out = paged_attention_reference(q, kv, table, qsl, pos, scale=d ** -0.5, kv_tokens_per_step=step)
        assert_matches(out, expected, jnp.float32, f"kv_tokens_per_step={step}")
        assert not np.asarray(out)[qsl[-1]:].any(), "padding tokens get 0"


# (GQA ratio via hq/hkv, head_dim, block_size, dtype, kernel block sizes)
SWEEP = [
    (8, 8, 64, 16, jnp.float32, {}),
    (8, 2, 64, 32, jnp.float32, dict(block_k=16, block_q=4)),
    (8, 1, 128, 16, jnp.bfloat16, {}),
    (16, 2, 128, 32, jnp.bfloat16, dict(block_k=64)),
    (4, 2, 16, 8, jnp.float32, dict(block_k=32, block_q=16)),
]
SWEEP_IDS = ["mha-d64-bs16-f32", "gqa4-d64-bs32-f32", "gqa8-d128-bs16-bf16", "gqa8-d128-bs32-bf16", "tiny-bs8"]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,kw", SWEEP, ids=SWEEP_IDS)
@pytest.mark.parametrize("rows", [DECODE_ROWS, SPEC_ROWS], ids=["decode", "spec"])
def test_decode_kernel_matches_reference(interpret, rows, hq, hkv, d, bs, dtype, kw):
    q, kv, table, qsl, pos = make_batch(rows, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype)
    ref = paged_attention_reference(q, kv, table, qsl, pos, scale=d ** -0.5)
    for splits in (1, 3):
        out = paged_attention_decode(q, kv, table, qsl, pos, scale=d ** -0.5, num_splits=splits, interpret=interpret,
                                     **{k: v for k, v in kw.items() if k != "block_q"})
        assert out.shape == q.shape and out.dtype == q.dtype
        assert_matches(out, ref, dtype, f"num_splits={splits}")


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,kw", SWEEP, ids=SWEEP_IDS)
@pytest.mark.parametrize("rows", [MIXED_ROWS, DECODE_ROWS[:2]], ids=["mixed", "decode"])
def test_varlen_kernel_matches_reference(interpret, rows, hq, hkv, d, bs, dtype, kw):
    q, kv, table, qsl, pos = make_batch(rows, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype, pad_tokens=5)
    ref = paged_attention_reference(q, kv, table, qsl, pos, scale=d ** -0.5)
    out = paged_attention_varlen(q, kv, table, qsl, pos, scale=d ** -0.5, interpret=interpret, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, ref, dtype, "varlen")
    assert not np.asarray(jnp.asarray(out, jnp.float32))[qsl[-1]:].any(), "padding tokens get 0"


@pytest.mark.parametrize("rows", [MIXED_ROWS, DECODE_ROWS], ids=["mixed", "decode"])
def test_row_map_reads_rows_of_a_larger_table_in_place(interpret, rows):
    """The engine's persistent table: batch row r reads row row_map[r] of a table with other rows around
    (padding rows read the all-null row 0); every op equals the same call on the gathered table."""
    q, kv, table, qsl, pos = make_batch(rows, hq=4, hkv=2, d=16, block_size=8, dtype=jnp.float32, pad_tokens=3)
    rng = np.random.default_rng(1)
    n = len(rows)
    persistent = rng.integers(1, kv.shape[1], size=(2 * n + 3, table.shape[1])).astype(np.int32)  # other requests
    persistent[0] = 0
    row_map = np.zeros(table.shape[0], np.int32)  # the padding row reads the null row
    row_map[:n] = rng.permutation(np.arange(1, persistent.shape[0]))[:n]
    persistent[row_map[:n]] = table[:n]
    ref = paged_attention_reference(q, kv, table, qsl, pos, scale=0.25)
    ops = [functools.partial(paged_attention_reference)]
    ops += [functools.partial(op, interpret=interpret) for op in (paged_attention_varlen, paged_attention_decode)]
    for op in ops:
        assert_matches(op(q, kv, persistent, qsl, pos, scale=0.25, row_map=row_map), ref, jnp.float32, str(op))
    with pytest.raises(JaxMambaError, match="query_start_loc"):
        paged_attention_reference(q, kv, persistent, qsl, pos, scale=0.25, row_map=row_map[:-1])


def test_query_blocks_cover_every_token_once():
    qsl = np.array([0, 1, 18, 18, 50, 50], np.int32)
    t, block_q = 57, 16
    row, start, length = (np.asarray(a) for a in query_block_plan(qsl, t, block_q))
    assert row.shape == (t // block_q + 5 + 1,)
    covered = np.zeros(t, int)
    for r, s, n in zip(row, start, length):
        covered[s:s + n] += 1
        if n and s < qsl[-1]:
            assert qsl[r] <= s and s + n <= qsl[r + 1], "a block stays inside its row"
    assert (covered == 1).all()


def test_backends_agree_through_dispatch():
    q, kv, table, qsl, pos = make_batch(MIXED_ROWS[:3], hq=4, hkv=2, d=16, block_size=16, dtype=jnp.float32)
    ref = dispatch.paged_attention_varlen(q, kv, table, qsl, pos, scale=0.25, backend="reference")
    for op in (dispatch.paged_attention_varlen, dispatch.paged_attention_decode):
        assert_matches(op(q, kv, table, qsl, pos, scale=0.25, backend="pallas"), ref, jnp.float32, op.__name__)
    with pytest.raises(ConfigError, match="backend"):
        dispatch.paged_attention_decode(q, kv, table, qsl, pos, scale=0.25, backend="cuda")


def test_bad_inputs_are_named_errors():
    q, kv, table, qsl, pos = make_batch(DECODE_ROWS[:2], hq=4, hkv=2, d=16, block_size=16, dtype=jnp.float32)
    bad_table = table.copy()
    bad_table[0, 0] = kv.shape[1]
    for fn in (paged_attention_reference, paged_attention_decode, paged_attention_varlen):
        with pytest.raises(MetadataError, match="block_table"):
            fn(q, kv, bad_table, qsl, pos, scale=0.25)
        with pytest.raises(MetadataError, match="positions"):
            fn(q, kv, table, qsl, pos + table.shape[1] * 16, scale=0.25)
    with pytest.raises(ConfigError, match="block_k"):
        paged_attention_decode(q, kv, table, qsl, pos, scale=0.25, block_k=24, interpret=True)
    with pytest.raises(ConfigError, match="block_q"):
        paged_attention_varlen(q, kv, table, qsl, pos, scale=0.25, block_q=4, interpret=True)  # 4 x 2 heads < 16
    with pytest.raises(ConfigError, match="head_dim"):
        paged_attention_varlen(q[..., :12], kv[..., :12], table, qsl, pos, scale=0.25, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_for_h100(dtype):
    """The Triton lowering (where Triton-only errors show) for both kernels at a serving shape."""
    S = jax.ShapeDtypeStruct
    t, r, hq, hkv, d, bs = 64, 8, 32, 8, 128, 16
    args = (S((t, hq, d), dtype), S((2, 1024, bs, hkv, d), dtype), S((r, 512), jnp.int32), S((r + 1,), jnp.int32),
            S((t,), jnp.int32))
    for fn in (paged_attention_decode, paged_attention_varlen):
        text = lower_for_gpu(fn, *args, scale=d ** -0.5, interpret=False)
        assert "triton_kernel_call" in text or "__gpu$xla.gpu.triton" in text, fn.__name__


def _temp_bytes(fn, max_model_len, *, t=32, r=8, hq=8, hkv=2, d=64, bs=16, num_blocks=512):
    """XLA's temporary bytes for ``fn`` compiled (CPU) for a fixed batch at a ``max_model_len``-wide block table."""
    S = jax.ShapeDtypeStruct
    args = (S((t, hq, d), jnp.bfloat16), S((2, num_blocks, bs, hkv, d), jnp.bfloat16),
            S((r, max_model_len // bs), jnp.int32), S((r + 1,), jnp.int32), S((t,), jnp.int32))
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("op", ["reference", "decode", "varlen"])
def test_temporaries_do_not_grow_with_max_model_len(op):
    """A fixed batch's temporaries at max_model_len 131,072 are within 10% of those at 8,192.

    The gather-the-whole-table attention this replaces needed ``[T, max_model_len, Hkv, d]``.
    """
    fn = {
        "reference": functools.partial(paged_attention_reference, scale=0.125),
        "decode": functools.partial(paged_attention_decode, scale=0.125, interpret=True),
        "varlen": functools.partial(paged_attention_varlen, scale=0.125, interpret=True),
    }[op]
    small, large = _temp_bytes(fn, 8192), _temp_bytes(fn, 131072)
    assert large <= 1.1 * small and small <= 1.1 * large, f"{op}: temp bytes {small} at 8192, {large} at 131072"
    whole_table = 32 * 8192 * 2 * 64 * 2  # [T, L, Hkv, d] bf16 at 8192, what the old gather held per operand
    assert small < whole_table, f"{op}: {small} temp bytes"


@pytest.mark.aot
@pytest.mark.parametrize("op", ["decode", "varlen"])
def test_kernels_compile_for_h100_without_spills_and_with_flat_temporaries(op):
    """Through ptxas for sm_90a (compile-only device): no register spill, and a serving-sized batch's
    temporaries are the same at max_model_len 8,192 and 131,072 (bf16, 8 KV heads, head_dim 128)."""
    from jaxmamba import aot

    fn, t, r = {"decode": (paged_attention_decode, 128, 128), "varlen": (paged_attention_varlen, 512, 32)}[op]
    S = jax.ShapeDtypeStruct
    hq, hkv, d, bs, num_blocks = 32, 8, 128, 16, 4096
    temps = []
    for max_model_len in (8192, 131072):
        args = (S((t, hq, d), jnp.bfloat16), S((2, num_blocks, bs, hkv, d), jnp.bfloat16),
                S((r, max_model_len // bs), jnp.int32), S((r + 1,), jnp.int32), S((t,), jnp.int32))
        result = aot.compile_for_target(functools.partial(fn, scale=d ** -0.5, interpret=False), *args, target="h100",
                                        fail_on_spill=True)
        assert any(k.pallas and k.name.startswith(f"paged_attention_{op}") for k in result.kernels), result.kernels
        assert not aot.check_kernels_fit(result.kernels, "h100")
        temps.append(result.memory.temp_bytes)
    assert temps[1] <= 1.1 * temps[0] and temps[0] <= 1.1 * temps[1], temps


def test_decode_splits_only_while_the_programs_are_too_few():
    """A split writes a float32 partial whatever its context: a wide batch (128 tokens x 8 KV heads, 1,024
    programs) runs unsplit; one token over 8 KV heads still spreads its context over 8 splits."""
    from pallas_kernels.paged_attention_decode import MAX_SPLITS, default_block_sizes

    splits = lambda t, hkv: default_block_sizes(128, 16, t, hkv)["num_splits"]  # noqa: E731
    assert splits(128, 8) == 1 and splits(32, 8) == 1 and splits(16, 8) == 2 and splits(4, 8) == 8
    assert splits(1, 8) == MAX_SPLITS and splits(3, 1) == MAX_SPLITS and splits(48, 2) == 2
    assert default_block_sizes(128, 16)["num_splits"] == MAX_SPLITS  # no batch given: as before
