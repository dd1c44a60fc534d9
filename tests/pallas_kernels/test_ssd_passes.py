"""The five SSD passes (pallas_kernels.ssd), each kernel against its plain-JAX reference (reference.ssd_passes)."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels.reference import ssd_chunk_metadata, ssd_chunk_scan_varlen_reference
from pallas_kernels.reference.ssd_passes import (
    chunk_bmm_reference,
    chunk_cumsum_reference,
    chunk_scan_reference,
    chunk_state_reference,
    state_passing_reference,
)
from pallas_kernels.ssd import chunk_bmm, chunk_cumsum, chunk_scan, chunk_state, state_passing


def make_case(seed, *, batch, H, G, P, N, max_len, chunk_size, dtype, aligned):
    """Raw inputs plus every pass's reference output, chained (each pass fed the reference of the one before)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, max_len + 1, size=batch)
    lens[0] = max(lens[0], 1)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1]) + 3
    f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)  # noqa: E731
    computed = rng.integers(0, 3 * chunk_size, size=batch) if aligned else None
    plan = ssd_chunk_metadata(cu, chunk_size, T // chunk_size + 2 * batch + 1, num_computed_tokens=computed)
    c = dict(
        x=f(T, H, P).astype(dtype), dt=(f(T, H) * 0.5 - 1.0).astype(dtype), A=-jnp.exp(f(H, sc=0.5)),
        B=f(T, G, N, sc=N**-0.5).astype(dtype), C=f(T, G, N, sc=N**-0.5).astype(dtype), D=f(H, P), z=f(T, H, P).astype(dtype),
        dt_bias=f(H, sc=0.5), init=jnp.where(jnp.asarray(rng.random(batch) < 0.7)[:, None, None, None],
                                              f(batch, H, P, N, sc=0.5), 0.0),
        cc=plan.cu_chunk_seqlens, sidx=plan.seq_idx, cs=chunk_size, cu=cu, last=plan.last_chunk_indices,
    )
    cc = np.asarray(plan.cu_chunk_seqlens)
    c["nonempty"] = cc[1:] > cc[:-1]
    c["num_real"] = jnp.asarray([int(np.max(np.nonzero(c["nonempty"])[0])) + 1], jnp.int32)
    c["dt_c"], c["da_cs"], c["suffix"] = chunk_cumsum_reference(c["dt"], c["A"], c["dt_bias"], c["cc"],
                                                                chunk_size=chunk_size, block_l=16)
    c["cb"] = chunk_bmm_reference(c["C"], c["B"], c["cc"], chunk_size=chunk_size)
    c["contrib"] = chunk_state_reference(c["x"], c["B"], c["dt_c"], c["A"], c["cc"], chunk_size=chunk_size)
    c["states"] = state_passing_reference(c["da_cs"], c["init"], c["contrib"], c["cc"], c["sidx"])
    return c


CASES = [  # (batch, H, G, P, N, max_len, chunk_size, dtype, aligned)
    (3, 4, 2, 32, 64, 70, 16, jnp.float32, True),
    (4, 4, 1, 24, 48, 50, 32, jnp.bfloat16, False),
    (2, 2, 2, 64, 128, 90, 64, jnp.float32, False),
]
IDS = [f"cs{c[6]}-P{c[3]}-N{c[4]}-{jnp.dtype(c[7]).name}" for c in CASES]


@pytest.fixture(params=CASES, ids=IDS)
def case(request):
    batch, H, G, P, N, max_len, cs, dtype, aligned = request.param
    return make_case(batch + P, batch=batch, H=H, G=G, P=P, N=N, max_len=max_len, chunk_size=cs, dtype=dtype,
                     aligned=aligned)


def test_chunk_cumsum(kt, interpret, case):
    dt_c, da_cs, suffix = chunk_cumsum(case["dt"], case["A"], case["dt_bias"], case["cc"], chunk_size=case["cs"],
                                       dt_softplus=True, dt_limit=(0.0, float("inf")), block_l=16, block_h=2,
                                       interpret=interpret)
    kt.assert_close(dt_c, case["dt_c"], jnp.float32, "dt_chunks")
    kt.assert_close(da_cs, case["da_cs"], jnp.float32, "da_cumsum")
    kt.assert_close(suffix, case["suffix"], jnp.float32, "da_suffix")
    # without a bias, with a dt clamp, another suffix block
    cs = case["cs"]
    got = chunk_cumsum(case["dt"], case["A"], None, case["cc"], chunk_size=cs, dt_softplus=True,
                       dt_limit=(0.1, 0.5), block_l=cs, block_h=4, interpret=interpret)
    ref = chunk_cumsum_reference(case["dt"], case["A"], None, case["cc"], chunk_size=cs, block_l=cs,
                                 dt_limit=(0.1, 0.5))
    for g, r, what in zip(got, ref, ("dt_chunks", "da_cumsum", "da_suffix")):
        kt.assert_close(g, r, jnp.float32, what + " (clamped, no bias, block_l=chunk_size)")


def test_chunk_bmm_lower_tiles(kt, interpret, case):
    cs = case["cs"]
    cb = chunk_bmm(case["C"], case["B"], case["cc"], chunk_size=cs, block_m=16, block_n=16, interpret=interpret)
    cc = np.asarray(case["cc"])
    clen = np.clip(cc[1:] - cc[:-1], 0, cs)
    i = np.arange(cs)
    # what the chunk scan reads: j <= i, both inside the chunk
    read = (i[None, :, None] < clen[:, None, None]) & (i[None, None, :] <= i[None, :, None])
    got = np.where(read[:, None], np.asarray(cb), 0.0)
    want = np.where(read[:, None], np.asarray(case["cb"]), 0.0)
    kt.assert_close(got, want, case["x"].dtype, "C B^T")


def test_chunk_state(kt, interpret, case):
    contrib = chunk_state(case["x"], case["B"], case["dt_c"], case["suffix"], case["A"], case["cc"], chunk_size=case["cs"],
                          block_l=16, block_p=16, block_n=32, interpret=interpret)
    ne = case["nonempty"]
    kt.assert_close(np.asarray(contrib)[ne], np.asarray(case["contrib"])[ne], case["x"].dtype, "contrib")


@pytest.mark.parametrize("write_tail", [True, False])
def test_state_passing(kt, interpret, case, write_tail):
    # garbage in the contributions of empty chunks must not be read
    contrib = jnp.where(jnp.asarray(case["nonempty"])[:, None, None, None], case["contrib"], jnp.nan)
    states = state_passing(case["da_cs"], case["init"], contrib, case["cc"], case["sidx"], case["num_real"],
                           chunk_size=case["cs"], block_p=16, block_n=16, write_tail=write_tail, interpret=interpret)
    n = int(case["num_real"][0]) if not write_tail else states.shape[0]
    assert n < states.shape[0] or write_tail  # the table has a padded tail
    kt.assert_close(states[:n], case["states"][:n], jnp.float32, "chunk states")


@pytest.mark.parametrize("optional", [True, False])
def test_chunk_scan(kt, interpret, case, optional):
    D, z = (case["D"], case["z"]) if optional else (None, None)
    # garbage above the diagonal of C B^T (never written by chunk_bmm) must not be read
    cs = case["cs"]
    upper = jnp.triu(jnp.ones((cs, cs), bool), 1)
    cb = jnp.where(upper, jnp.nan, case["cb"])
    args = (case["x"], case["C"], cb, case["dt_c"], case["da_cs"], case["suffix"], case["A"], case["init"], case["states"],
            case["cc"], case["sidx"], D, z)
    out = chunk_scan(*args, chunk_size=cs, block_l=16, block_p=16, block_n=16, interpret=interpret)
    ref = chunk_scan_reference(*args[:2], case["cb"], *args[3:5], *args[6:], chunk_size=cs)
    assert out.dtype == case["x"].dtype
    kt.assert_close(out, ref, case["x"].dtype, "out")


def test_pass_references_compose_to_the_scan_reference(kt, case):
    """The five pass references chained give ssd_chunk_scan_varlen_reference's outputs (the contract)."""
    out = chunk_scan_reference(case["x"], case["C"], case["cb"], case["dt_c"], case["da_cs"], case["A"], case["init"],
                               case["states"], case["cc"], case["sidx"], case["D"], case["z"], chunk_size=case["cs"])
    args = (case["x"], case["dt"], case["A"], case["B"], case["C"], case["D"], case["z"], case["dt_bias"])
    r_out, _, r_states = ssd_chunk_scan_varlen_reference(
        *args, chunk_size=case["cs"], cu_seqlens=case["cu"], initial_states=case["init"],
        return_intermediate_states=True, cu_chunk_seqlens=case["cc"], seq_idx=case["sidx"],
        last_chunk_indices=case["last"])
    kt.assert_close(out, r_out, case["x"].dtype, "out")
    kt.assert_close(case["states"], r_states, jnp.float32, "chunk states")
