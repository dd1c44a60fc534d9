"""Every Pallas kernel compiles for an H100 (sm_90a) without a GPU, over its supported range: no register
spill, shared memory within the opt-in limit, and the SSD chunk scan well below the 255-register ceiling.

The compiles run in a subprocess (this file run as a script): ptxas' register report needs the
``jaxmamba.aot.ptxas_environment()`` wrapper on the CUDA path jax reads when it loads its CUDA plugin,
before jax is imported. Supported range: chunk sizes 16..256, head_dim 32..128, d_state 16..256,
float32/bfloat16. The default test compiles the corners; the full cross product is ``slow``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

#: the repository root: the worker imports this checkout's kernels whatever pytest's cwd
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: chunk_scan's registers must stay well below the 255 ceiling (it sat at 248-255 in one kernel before the split).
SCAN_REGISTER_LIMIT = 200

DTYPES = ("float32", "bfloat16")


def _ssd(cs, P, N, dtype):
    return ("ssd", dict(chunk_size=cs, P=P, N=N, dtype=dtype))


def _ssu(P, N, dtype, spec):
    return ("ssu", dict(P=P, N=N, dtype=dtype, spec=spec))


def _conv_update(dim, K, num_spec, dtype):
    return ("conv_update", dict(dim=dim, K=K, num_spec=num_spec, dtype=dtype))


def _conv_varlen(dim, K, dtype):
    return ("conv_varlen", dict(dim=dim, K=K, dtype=dtype))


CORNERS = (
    [_ssd(cs, P, N, d) for cs, (P, N), d in itertools.product((16, 256), ((32, 16), (128, 256)), DTYPES)]
    + [_ssd(cs, 64, 128, "bfloat16") for cs in (64, 128)]  # Mamba2 / Nemotron-H shapes
    + [_ssd(64, 64, 64, "float32")]  # a single 64x64 state tile: ptxas spilled it over 4 warps
    + [_ssu(P, N, d, spec) for (P, N), d, spec in itertools.product(((32, 16), (128, 256)), DTYPES, (0, 1))]
    + [_conv_update(dim, K, s, d) for (dim, K, s), d in itertools.product(((256, 2, 0), (10240, 4, 3)), DTYPES)]
    + [_conv_varlen(dim, K, d) for (dim, K), d in itertools.product(((256, 2), (10240, 4)), DTYPES)]
)

FULL = (
    [_ssd(*c) for c in itertools.product((16, 32, 64, 128, 256), (32, 64, 128), (16, 64, 128, 256), DTYPES)]
    + [_ssu(*c) for c in itertools.product((32, 64, 128), (16, 64, 128, 256), DTYPES, (0, 1))]
    + [_conv_update(*c) for c in itertools.product((256, 10240), (2, 3, 4), (0, 1, 3), DTYPES)]
    + [_conv_varlen(*c) for c in itertools.product((256, 10240), (2, 3, 4), DTYPES)]
)


# ------------------------------------------------------------------------------------ worker (subprocess)
def _abstract_call(kind, p):
    """``(fn, abstract args)`` of one kernel call at the shapes of ``p``."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.causal_conv1d_update import causal_conv1d_update
    from pallas_kernels.causal_conv1d_varlen import causal_conv1d_varlen
    from pallas_kernels.selective_state_update import selective_state_update
    from pallas_kernels.ssd_chunk_scan_varlen import ssd_chunk_scan_varlen

    S, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
    dt = jnp.dtype(p["dtype"])
    if kind == "ssd":
        cs, P, N = p["chunk_size"], p["P"], p["N"]
        T, H, G, batch = 1024, 8, 2, 4
        nc = T // cs + 2 * batch + 1

        def fn(x, dt_, A, B, C, D, z, dt_bias, cu, init, has, cc, sidx, last):
            return ssd_chunk_scan_varlen(x, dt_, A, B, C, D, z, dt_bias, chunk_size=cs, cu_seqlens=cu,
                                         initial_states=init, has_initial_state=has, return_intermediate_states=True,
                                         cu_chunk_seqlens=cc, seq_idx=sidx, last_chunk_indices=last)

        return fn, (S((T, H, P), dt), S((T, H), dt), S((H,), f32), S((T, G, N), dt), S((T, G, N), dt), S((H,), f32),
                    S((T, H, P), dt), S((H,), f32), S((batch + 1,), i32), S((batch, H, P, N), f32),
                    S((batch,), jnp.bool_), S((nc + 1,), i32), S((nc,), i32), S((batch,), i32))
    if kind == "ssu":
        P, N, spec = p["P"], p["N"], p["spec"]
        H, G, batch, slots = 8, 2, 4, 64
        T = batch * 4 if spec else batch
        idx = S((batch, 4), i32) if spec else S((batch,), i32)
        extra = (S((batch,), i32), S((batch + 1,), i32)) if spec else ()

        def fn(state, x, dt_, A, B, C, D, z, dt_bias, idx, *extra):
            kw = dict(num_accepted_tokens=extra[0], cu_seqlens=extra[1]) if spec else {}
            return selective_state_update(state, x, dt_, A, B, C, D, z, dt_bias, dt_softplus=True,
                                          state_batch_indices=idx, **kw)

        return fn, (S((slots, H, P, N), dt), S((T, H, P), dt), S((T, H), dt), S((H,), f32), S((T, G, N), dt),
                    S((T, G, N), dt), S((H,), f32), S((T, H, P), dt), S((H,), f32), idx, *extra)
    if kind == "conv_update":
        dim, K, ns = p["dim"], p["K"], p["num_spec"]
        batch, slots = 16, 40
        R, T = K - 1 + ns, batch * (1 + ns)
        extra = (S((batch,), i32), S((batch + 1,), i32)) if ns else ()

        def fn(x, state, w, b, idx, *extra):
            kw = dict(num_accepted_tokens=extra[0], query_start_loc=extra[1]) if ns else {}
            return causal_conv1d_update(x, state, w, b, activation="silu", conv_state_indices=idx, **kw)

        return fn, (S((T, dim), dt), S((slots, dim, R), dt), S((dim, K), dt), S((dim,), dt), S((batch,), i32), *extra)
    dim, K = p["dim"], p["K"]
    batch, T, slots = 8, 640, 40

    def fn(x, state, w, b, qsl, idx, has, bpos, bslots):
        return causal_conv1d_varlen(x, state, w, b, query_start_loc=qsl, cache_indices=idx, has_initial_state=has,
                                    block_boundary_indices=bpos, block_boundary_slots=bslots)

    return fn, (S((T, dim), dt), S((slots, dim, K + 1), dt), S((dim, K), dt), S((dim,), dt), S((batch + 1,), i32),
                S((batch,), i32), S((batch,), jnp.bool_), S((batch, 3), i32), S((batch, 3), i32))


def _worker(cases):
    """Compile each case for the H100 target; one JSON line per Pallas kernel."""
    from jaxmamba import aot

    for kind, p in cases:
        fn, args = _abstract_call(kind, p)
        try:
            result = aot.compile_for_target(fn, *args, target="h100")
        except Exception as e:  # a Triton error or a shared-memory overflow at compile time
            print(json.dumps(dict(case=[kind, p], error=f"{type(e).__name__}: {str(e)[:400]}")), flush=True)
            continue
        for k in result.kernels:
            if k.pallas:
                print(json.dumps(dict(case=[kind, p], name=k.name, registers=k.registers, spill_bytes=k.spill_bytes,
                                      shared_bytes=k.shared_bytes)), flush=True)


# ------------------------------------------------------------------------------------ tests
def _compile_all(cases, tmp_path):
    pytest.importorskip("jax_cuda12_plugin")  # the aot extra (the marker skips too, via tests/conftest.py)
    from jaxmamba import aot

    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_ROOT", "XLA_FLAGS")}
    env.update(aot.ptxas_environment(tmp_path / "ptxas"), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__, json.dumps(cases)], capture_output=True, text=True, env=env,
                          timeout=3000, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _check(rows, cases):
    from jaxmamba import aot

    limit = aot.get_target("h100").shared_memory_per_block_optin
    problems = [f"{r['case']}: {r['error']}" for r in rows if "error" in r]
    kernels = [r for r in rows if "error" not in r]
    compiled = {json.dumps(r["case"]) for r in kernels}
    problems += [f"{c}: no Pallas kernel compiled" for c in map(list, cases) if json.dumps(c) not in compiled]
    for r in kernels:
        if r["registers"] is None:
            problems.append(f"{r['case']} {r['name']}: no ptxas report")
        elif r["spill_bytes"]:
            problems.append(f"{r['case']} {r['name']}: {r['spill_bytes']} bytes spilled ({r['registers']} registers)")
        if r["shared_bytes"] > limit:
            problems.append(f"{r['case']} {r['name']}: {r['shared_bytes']} bytes of shared memory > {limit}")
        if r["name"].startswith("ssd_chunk_scan") and (r["registers"] or 0) > SCAN_REGISTER_LIMIT:
            problems.append(f"{r['case']} {r['name']}: {r['registers']} registers > {SCAN_REGISTER_LIMIT}")
    assert not problems, "\n".join(problems)
    names = {r["name"].split("_cs")[0] for r in kernels if r["name"].startswith("ssd_")}
    if any(kind == "ssd" for kind, _ in cases):  # the five passes, each its own kernel
        assert names == {"ssd_chunk_cumsum", "ssd_bmm", "ssd_chunk_state", "ssd_state_passing", "ssd_chunk_scan"}


@pytest.mark.aot
def test_kernels_fit_h100_at_the_corners(tmp_path):
    _check(_compile_all(CORNERS, tmp_path), CORNERS)


@pytest.mark.aot
@pytest.mark.slow
def test_kernels_fit_h100_over_the_whole_range(tmp_path):
    _check(_compile_all(FULL, tmp_path), FULL)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    _worker([tuple(c) for c in json.loads(sys.argv[1])])
