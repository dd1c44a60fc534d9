"""grouped_matmul (MoE experts over group-padded row tiles): kernel vs reference, validation, lowering."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.errors import MetadataError
from pallas_kernels._lowering import lower_for_gpu
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.reference.grouped_matmul import grouped_matmul_reference


def make_case(seed, *, groups, n, k, tiles, used, block_m, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tiles * block_m, k)), jnp.float32).astype(dtype)
    w = jnp.asarray(rng.standard_normal((groups, n, k)) / np.sqrt(k), jnp.float32).astype(dtype)
    tile_group = np.sort(rng.integers(0, groups, tiles)).astype(np.int32)  # tiles sorted by group
    tile_group[used:] = groups + 5  # garbage past num_tiles must be ignored
    return x, w, jnp.asarray(tile_group), jnp.asarray([used], jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("groups,n,k,tiles,used,block_n,block_k", [
    (4, 32, 64, 6, 6, 16, 16),  # every tile used, several K and N blocks
    (8, 48, 40, 9, 5, 32, 16),  # N and K not multiples of the blocks (masked tails), padding tiles
    (3, 16, 16, 4, 0, 16, 16),  # nothing routed this step
    (1, 64, 128, 3, 3, 64, 64),  # one group owns every tile
])
def test_kernel_matches_reference(groups, n, k, tiles, used, block_n, block_k, dtype):
    args = make_case(0, groups=groups, n=n, k=k, tiles=tiles, used=used, block_m=16, dtype=dtype)
    got = grouped_matmul(*args, block_m=16, block_n=block_n, block_k=block_k, interpret=True)
    want = grouped_matmul_reference(*args, block_m=16)
    assert got.shape == want.shape == (tiles * 16, n) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.asarray(got[used * 16:], np.float32).any(), "padding tiles are zero"


def test_bad_shapes_name_the_argument():
    x, w, tg, nt = make_case(0, groups=2, n=16, k=16, tiles=2, used=2, block_m=16, dtype=jnp.float32)
    with pytest.raises(MetadataError, match="block_m"):
        grouped_matmul(x[:20], w, tg, nt, block_m=16, interpret=True)
    with pytest.raises(MetadataError, match="tile_group"):
        grouped_matmul(x, w, tg[:1], nt, block_m=16, interpret=True)
    with pytest.raises(MetadataError, match=r"\[G, N, K\]"):
        grouped_matmul(x, w[:, :, :8], tg, nt, block_m=16, interpret=True)


def test_lowers_for_gpu():
    x, w, tg, nt = make_case(0, groups=4, n=64, k=96, tiles=4, used=3, block_m=16, dtype=jnp.bfloat16)
    text = lower_for_gpu(lambda *a: grouped_matmul(*a, block_m=16), x, w, tg, nt)
    assert "grouped_matmul" in text
