"""Shared helpers for the kernel tests (exposed as fixtures: --import-mode=importlib)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

@pytest.fixture(autouse=True)
def _drop_compiled_programs():
    """Free every compiled program after each kernel test.

    Each CPU executable keeps ~3-4 memory mappings alive for as long as a jit cache holds it; the
    slow sweeps compile tens of thousands of one-off programs (each shape, plus the eager ops of
    interpret mode), and a long pytest process ran into the kernel's 65,530-mapping limit: LLVM
    segfaulted mid-compile (CI exit 139 in the slow tier, reproduced locally). Recompiling the few
    shared helpers per test costs little.
    """
    yield
    jax.clear_caches()


#: f32: atol 1e-5 (inputs are scaled so outputs are O(1)); bf16: atol 2e-2.
TOLERANCES = {jnp.dtype(jnp.float32): dict(atol=1e-5, rtol=1e-5), jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2)}


def assert_close(actual, expected, dtype, what=""):
    tol = TOLERANCES[jnp.dtype(dtype)]
    np.testing.assert_allclose(
        np.asarray(jnp.asarray(actual, jnp.float32)), np.asarray(jnp.asarray(expected, jnp.float32)),
        err_msg=what, **tol,
    )


def bits(a):
    """Bit pattern of an array (so NaN == NaN and -0.0 != 0.0)."""
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bitwise(actual, expected, what=""):
    a, e = bits(actual), bits(expected)
    if a.shape != e.shape or not np.array_equal(a, e):
        bad = np.argwhere(a != e)
        raise AssertionError(f"{what}: not bitwise equal at {bad[:5].tolist()} ({len(bad)} elements)")


def named_slots(*index_arrays, num_slots):
    """Set of usable slots named by any of the index arrays."""
    s = set()
    for a in index_arrays:
        if a is None:
            continue
        a = np.asarray(a).reshape(-1)
        s |= {int(v) for v in a if 0 < v < num_slots}
    return s


def assert_unnamed_untouched(before, after, named, what="state"):
    """Every slot not named by an index (including the null slot 0) is bit-identical."""
    before, after = np.asarray(before), np.asarray(after)
    for slot in range(before.shape[0]):
        if slot not in named:
            assert_bitwise(after[slot], before[slot], f"{what}[{slot}] (not named by any index)")


def ragged_cu(rng, batch, max_len, min_len=0, extra_tokens=0):
    lens = rng.integers(min_len, max_len + 1, size=batch)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return cu, int(cu[-1]) + extra_tokens


def distinct_slots(rng, n, num_slots):
    """``n`` distinct usable slots (1..num_slots-1) in random order."""
    return rng.permutation(np.arange(1, num_slots))[:n].astype(np.int32)


@pytest.fixture
def kt():
    return types.SimpleNamespace(
        assert_close=assert_close, assert_bitwise=assert_bitwise, named_slots=named_slots,
        assert_unnamed_untouched=assert_unnamed_untouched, ragged_cu=ragged_cu, distinct_slots=distinct_slots,
        bits=bits,
    )


#: Kernel execution modes: the Pallas interpreter (CPU, every run) and compiled (GPU only).
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]


@pytest.fixture(params=MODES)
def interpret(request):
    return request.param
