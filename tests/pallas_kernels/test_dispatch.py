"""The model-facing dispatch: both backends give the same results; names and defaults."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.errors import ConfigError
from pallas_kernels import dispatch


def small_decode(seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)  # noqa: E731
    slots, H, P, N, dim, K, batch = 6, 2, 16, 16, 40, 4, 3
    idx = np.array([2, -1, 5], np.int32)
    conv_args = (f(batch, dim), f(slots, dim, K - 1), f(dim, K, sc=0.5), f(dim))
    ssu_args = (f(slots, H, P, N, sc=0.5), f(batch, H, P), f(batch, H) - 1, -jnp.exp(f(H)), f(batch, 1, N, sc=0.25),
                f(batch, 1, N, sc=0.25), f(H), None, f(H))
    return idx, conv_args, ssu_args


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="backend"):
        dispatch.causal_conv1d_update(*small_decode()[1], conv_state_indices=np.zeros(3, np.int32), backend="cuda")


def test_interpret_defaults_to_cpu_backend():
    assert dispatch.default_interpret() == (jax.default_backend() == "cpu")


def test_backends_agree_inside_one_jitted_decode_step():
    """A conv + SSM decode step, jitted with the caches donated, on both backends."""
    idx, conv_args, ssu_args = small_decode()

    @functools.partial(jax.jit, static_argnames="backend", donate_argnums=(0, 1))
    def step(conv_state, ssm_state, backend):
        x, _, w, b = conv_args
        xc, conv_state = dispatch.causal_conv1d_update(x, conv_state, w, b, activation="silu", conv_state_indices=idx,
                                                       backend=backend)
        y, ssm_state = dispatch.selective_state_update(ssm_state, xc[:, :32].reshape(3, 2, 16), *ssu_args[2:],
                                                       dt_softplus=True, state_batch_indices=idx, backend=backend)
        return y, conv_state, ssm_state

    results = [step(jnp.array(conv_args[1]), jnp.array(ssu_args[0]), backend=b) for b in ("reference", "pallas")]
    for r, p in zip(*results):
        np.testing.assert_allclose(np.asarray(p), np.asarray(r), atol=1e-5, rtol=1e-5)


def test_backends_agree_on_prefill():
    rng = np.random.default_rng(1)
    f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)  # noqa: E731
    T, H, P, N, dim, K = 20, 1, 16, 16, 24, 4
    cu = np.array([0, 7, 20], np.int32)
    conv = (f(T, dim), f(4, dim, K - 1), f(dim, K, sc=0.5), None)
    conv_kw = dict(query_start_loc=cu, cache_indices=np.array([1, 3], np.int32),
                   has_initial_state=np.array([True, False]))
    ssd = (f(T, H, P), f(T, H) - 1, -jnp.exp(f(H)), f(T, 1, N, sc=0.25), f(T, 1, N, sc=0.25), f(H))
    ssd_kw = dict(chunk_size=16, cu_seqlens=cu, initial_states=f(2, H, P, N), has_initial_state=np.array([1, 0], bool))
    for op, args, kw in ((dispatch.causal_conv1d_varlen, conv, conv_kw), (dispatch.ssd_chunk_scan_varlen, ssd, ssd_kw)):
        ref = op(*args, **kw, backend="reference")
        pal = op(*args, **kw, backend="pallas")
        assert len(ref) == len(pal)
        for r, p in zip(ref, pal):
            if r is None:
                assert p is None
                continue
            np.testing.assert_allclose(np.asarray(p), np.asarray(r), atol=1e-5, rtol=1e-5)
