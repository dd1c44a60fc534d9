"""A step costs what its batch needs: XLA's memory analysis of the compiled steps on this CPU.

The H100 target has its own check (``test_aot.py``) where the ``aot`` extra is installed.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxmamba
from jaxmamba.plan import compile_buckets, probe_pools
from jaxmamba.steps import default_buckets


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return jaxmamba.random_model("nemotron_h", path=tmp_path_factory.mktemp("tiny") / "ckpt")


def _temps(model, max_model_len: int, buckets, block_size: int = 16) -> dict:
    sizing = dict(max_num_seqs=8, max_model_len=max_model_len, block_size=block_size)
    steps = compile_buckets(model, probe_pools(model.cfg, **sizing), buckets, block_size=block_size,
                            max_model_len=max_model_len, cache_mode="none", num_spec=0, enable_caching=False,
                            ssm_dtype=jnp.float32, backend="reference")
    return {b: m.temp_bytes for b, m in steps.memory.items()}


def test_step_temporaries_do_not_follow_max_model_len(tiny):
    """Raising max_model_len 16x (8,192 -> 131,072) changes no bucket's temporaries by more than 10%: attention
    walks each row's real blocks, and the block table is a step argument read in place (sliced out of the
    packed metadata, it was copied into an [R, max_model_len / block_size] temporary)."""
    model = jaxmamba.load_pretrained(tiny)
    buckets = default_buckets(8, 64)
    short, long = _temps(model, 8192, buckets), _temps(model, 131072, buckets)
    for bucket in buckets:
        assert long[bucket] <= 1.10 * short[bucket], (bucket, short[bucket], long[bucket])


def test_writing_the_kv_cache_updates_it_in_place():
    """The step's K/V write must not copy the layer's cache (it did through a reshaped view: a temporary
    the size of the whole pool, kept by jax 0.11 inside the compiled step)."""
    import jax

    from jaxmamba.model.paged_attention import write_kv

    # One KV head, as the tiny model: with a unit head axis the old reshaped view was not a free bitcast.
    kv = jax.ShapeDtypeStruct((2, 8192, 16, 1, 64), jnp.float32)  # 64 MiB
    k = jax.ShapeDtypeStruct((8, 1, 64), jnp.float32)
    slots = jax.ShapeDtypeStruct((8,), jnp.int32)
    memory = jax.jit(write_kv, donate_argnums=0).lower(kv, k, k, slots).compile().memory_analysis()
    assert memory.temp_size_in_bytes < 1 << 20
    cache = jnp.zeros((2, 3, 4, 1, 2))
    new = write_kv(cache, jnp.ones((3, 1, 2)), 2 * jnp.ones((3, 1, 2)), jnp.array([5, -1, 11], jnp.int32))
    assert float(new[0, 1, 1].sum()) == 2 and float(new[1, 2, 3].sum()) == 4  # slots 5 and 11
    assert float(new.sum()) == 2 * (2 + 4)  # the -1 slot wrote nothing
