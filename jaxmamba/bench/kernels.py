"""``python -m jaxmamba.bench kernels``: the four Pallas kernels against their XLA references.

For every kernel and shape it prints the wall time per jitted call (caches
donated, so in-place kernels run in place), the bytes the op must move and the
achieved bytes/s, the fraction of the roofline -- the bandwidth of a same-size
XLA copy measured in the same run (docs/architecture.md, "Kernels and their roofline") -- FLOP/s for the SSD
scan, and the ratio of the plain-JAX reference's time to the kernel's, measured
in the same run (> 1: the kernel is faster).

``--tune`` also times each decode kernel (state and conv updates) at every launch configuration of a
small grid (``block_p``/``block_d`` x ``num_warps``) on the serving shapes it reports against the
roofline, and prints the best next to the default launch table's choice: one call on a lent
GPU answers which table entries to change (a benchmark with throwaway state, never an autotuner: the
kernels update state in place).

On a CPU-only machine the kernels run in the Pallas interpreter on tiny shapes:
that checks the benchmark end to end but the numbers say nothing about
performance, and the output says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

KERNELS = ("selective_state_update", "causal_conv1d_update", "causal_conv1d_varlen", "ssd_chunk_scan_varlen")


@dataclasses.dataclass
class Case:
    kernel: str
    label: str
    dtype: str
    make: Callable[[], tuple]  # -> (args tuple, index of the donated state or None)
    pallas: Callable  # jitted; same args
    reference: Callable
    bytes_moved: int
    flops: int = 0
    #: ``--tune``: builds the jitted Pallas call at given launch parameters, and the grid to try.
    with_launch: Callable[[dict], Callable] | None = None
    launch_grid: tuple[dict, ...] = ()


def _rand(key, shape, dtype, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _launcher(call, kernel, interpret) -> Callable[[dict], Callable]:
    """``--tune``: ``launch -> `` the jitted Pallas call at those launch parameters (the state donated)."""
    return lambda launch: jax.jit(call(kernel, dict(interpret=interpret, **launch)), donate_argnums=(0,))


def _jit_pair(pallas_fn, reference_fn, donate):
    kw = dict(donate_argnums=(donate,)) if donate is not None else {}
    return jax.jit(pallas_fn, **kw), jax.jit(reference_fn, **kw)


# ----------------------------------------------------------------------------- cases


def ssu_case(batch, H, P, N, G, num_spec, state_dtype, x_dtype, interpret):
    from pallas_kernels import reference
    from pallas_kernels.selective_state_update import selective_state_update

    ncols = 1 + num_spec
    slots = batch * ncols + 1
    T = batch * ncols

    def make():
        k = jax.random.split(jax.random.PRNGKey(0), 8)
        state = _rand(k[0], (slots, H, P, N), state_dtype, 0.5)
        x = _rand(k[1], (T, H, P), x_dtype)
        dt = _rand(k[2], (T, H), x_dtype, 0.5) - 1.0
        A = -jnp.exp(_rand(k[3], (H,), jnp.float32, 0.5))
        B = _rand(k[4], (T, G, N), x_dtype, N**-0.5)
        C = _rand(k[5], (T, G, N), x_dtype, N**-0.5)
        D = _rand(k[6], (H,), jnp.float32)
        dt_bias = _rand(k[7], (H,), jnp.float32, 0.5)
        idx = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, slots))[:T].reshape(batch, ncols),
                          jnp.int32)
        if num_spec:
            na = jnp.full((batch,), ncols, jnp.int32)
            cu = jnp.arange(batch + 1, dtype=jnp.int32) * ncols
            return (state, x, dt, A, B, C, D, dt_bias, idx, na, cu), 0
        return (state, x, dt, A, B, C, D, dt_bias, idx[:, 0]), 0

    def call(fn, extra):
        def step(state, x, dt, A, B, C, D, dt_bias, idx, *spec):
            kw = dict(num_accepted_tokens=spec[0], cu_seqlens=spec[1]) if spec else {}
            return fn(state, x, dt, A, B, C, D, None, dt_bias, dt_softplus=True, state_batch_indices=idx, **kw,
                      **extra)
        return step

    p, r = _jit_pair(call(selective_state_update, dict(interpret=interpret)),
                     call(reference.selective_state_update_reference, {}), 0)
    with_launch = _launcher(call, selective_state_update, interpret)
    grid = tuple(dict(block_p=bp, num_warps=w) for bp in (8, 16, 32, 64) if bp <= P for w in (1, 2, 4, 8))
    s_item, x_item = jnp.dtype(state_dtype).itemsize, jnp.dtype(x_dtype).itemsize
    state_bytes = batch * H * P * N * s_item * (1 + ncols)  # read the source once, write 1 (or 1+spec) slots
    token_bytes = T * (2 * H * P + H + 2 * G * N) * x_item
    label = f"B={batch} H={H} P={P} N={N} G={G}" + (f" spec={num_spec}" if num_spec else "")
    dt_name = f"state={jnp.dtype(state_dtype).name} x={jnp.dtype(x_dtype).name}"
    return Case("selective_state_update", label, dt_name, make, p, r, state_bytes + token_bytes,
                flops=T * H * P * N * 6, with_launch=with_launch, launch_grid=grid if batch >= 128 else ())


def conv_update_case(batch, dim, K, num_spec, dtype, interpret):
    from pallas_kernels import reference
    from pallas_kernels.causal_conv1d_update import causal_conv1d_update

    R = K - 1 + num_spec
    q = 1 + num_spec
    slots, T = batch + 1, batch * q

    def make():
        k = jax.random.split(jax.random.PRNGKey(1), 4)
        x = _rand(k[0], (T, dim), dtype)
        state = _rand(k[1], (slots, dim, R), dtype)
        w = _rand(k[2], (dim, K), dtype, K**-0.5)
        b = _rand(k[3], (dim,), dtype)
        idx = jnp.asarray(np.random.default_rng(1).permutation(np.arange(1, slots))[:batch], jnp.int32)
        if num_spec:
            na = jnp.full((batch,), q, jnp.int32)
            return (state, x, w, b, idx, na, jnp.arange(batch + 1, dtype=jnp.int32) * q), 0
        return (state, x, w, b, idx), 0

    def call(fn, extra):
        def step(state, x, w, b, idx, *spec):
            kw = dict(num_accepted_tokens=spec[0], query_start_loc=spec[1]) if spec else {}
            out, state = fn(x, state, w, b, activation="silu", conv_state_indices=idx, **kw, **extra)
            return out, state
        return step

    p, r = _jit_pair(call(causal_conv1d_update, dict(interpret=interpret)),
                     call(reference.causal_conv1d_update_reference, {}), 0)
    with_launch = _launcher(call, causal_conv1d_update, interpret)
    grid = tuple(dict(block_d=bd, num_warps=w) for bd in (64, 128, 256, 512, 1024) for w in (1, 2, 4, 8))
    item = jnp.dtype(dtype).itemsize
    moved = (2 * batch * dim * R + 2 * T * dim + dim * (K + 1)) * item
    label = f"B={batch} dim={dim} K={K}" + (f" spec={num_spec}" if num_spec else "")
    return Case("causal_conv1d_update", label, jnp.dtype(dtype).name, make, p, r, moved, flops=2 * T * dim * K,
                with_launch=with_launch, launch_grid=grid if batch >= 128 else ())


def _packed(num_reqs, req_len):
    return jnp.arange(num_reqs + 1, dtype=jnp.int32) * req_len, num_reqs * req_len


def conv_varlen_case(num_reqs, req_len, dim, K, dtype, interpret):
    from pallas_kernels import reference
    from pallas_kernels.causal_conv1d_varlen import causal_conv1d_varlen

    cu, T = _packed(num_reqs, req_len)
    slots = num_reqs + 1

    def make():
        k = jax.random.split(jax.random.PRNGKey(2), 4)
        x = _rand(k[0], (T, dim), dtype)
        state = _rand(k[1], (slots, dim, K - 1), dtype)
        w = _rand(k[2], (dim, K), dtype, K**-0.5)
        b = _rand(k[3], (dim,), dtype)
        idx = jnp.arange(1, slots, dtype=jnp.int32)
        has = jnp.arange(num_reqs) % 2 == 0
        return (state, x, w, b, cu, idx, has), 0

    def call(fn, extra):
        def step(state, x, w, b, cu, idx, has):
            return fn(x, state, w, b, query_start_loc=cu, cache_indices=idx, has_initial_state=has,
                      activation="silu", **extra)
        return step

    p, r = _jit_pair(call(causal_conv1d_varlen, dict(interpret=interpret)),
                     call(reference.causal_conv1d_varlen_reference, {}), 0)
    item = jnp.dtype(dtype).itemsize
    moved = (2 * T * dim + 2 * num_reqs * dim * (K - 1)) * item
    return Case("causal_conv1d_varlen", f"reqs={num_reqs}x{req_len} dim={dim} K={K}", jnp.dtype(dtype).name, make,
                p, r, moved, flops=2 * T * dim * K)


def ssd_case(num_reqs, req_len, H, P, N, G, chunk_size, dtype, interpret):
    from pallas_kernels import reference
    from pallas_kernels.ssd_chunk_scan_varlen import ssd_chunk_scan_varlen

    cu, T = _packed(num_reqs, req_len)

    def make():
        k = jax.random.split(jax.random.PRNGKey(3), 8)
        x = _rand(k[0], (T, H, P), dtype)
        dt = _rand(k[1], (T, H), dtype, 0.5) - 1.0
        A = -jnp.exp(_rand(k[2], (H,), jnp.float32, 0.5))
        B = _rand(k[3], (T, G, N), dtype, N**-0.5)
        C = _rand(k[4], (T, G, N), dtype, N**-0.5)
        D = _rand(k[5], (H,), jnp.float32)
        dt_bias = _rand(k[6], (H,), jnp.float32, 0.5)
        init = _rand(k[7], (num_reqs, H, P, N), jnp.float32, 0.5)
        return (x, dt, A, B, C, D, dt_bias, cu, init), None

    def call(fn, extra):
        def step(x, dt, A, B, C, D, dt_bias, cu, init):
            return fn(x, dt, A, B, C, D, None, dt_bias, chunk_size=chunk_size, cu_seqlens=cu, initial_states=init,
                      return_intermediate_states=True, **extra)
        return step

    p, r = _jit_pair(call(ssd_chunk_scan_varlen, dict(interpret=interpret)),
                     call(reference.ssd_chunk_scan_varlen_reference, {}), None)
    item = jnp.dtype(dtype).itemsize
    nchunks = T // chunk_size + num_reqs
    moved = T * (2 * H * P + H + 2 * G * N) * item + (num_reqs + 2 * nchunks) * H * P * N * 4
    # causal intra-chunk (C B^T: cs*N, (.)x: cs*P, halved) + chunk states + state-to-output, 2 flops per MAC
    flops = 2 * T * H * (chunk_size * (N + P) // 2 + 2 * P * N)
    label = f"reqs={num_reqs}x{req_len} H={H} P={P} N={N} G={G} cs={chunk_size}"
    return Case("ssd_chunk_scan_varlen", label, jnp.dtype(dtype).name, make, p, r, moved, flops=flops)


def cases(full: bool, interpret: bool) -> list[Case]:
    f32, bf16 = jnp.float32, jnp.bfloat16
    if not full:  # tiny shapes: the interpreter runs every program sequentially
        quick = [
            ssu_case(4, 4, 16, 16, 2, 0, f32, f32, interpret),
            ssu_case(2, 2, 16, 16, 1, 2, bf16, bf16, interpret),
            conv_update_case(4, 64, 4, 0, f32, interpret),
            conv_update_case(2, 64, 4, 2, bf16, interpret),
            conv_varlen_case(2, 16, 64, 4, f32, interpret),
            ssd_case(2, 16, 2, 16, 16, 1, 16, f32, interpret),
        ]
        for c in quick[0], quick[2]:  # two launches each: --tune runs end to end in the interpreter
            key = "block_p" if c.kernel == "selective_state_update" else "block_d"
            c.launch_grid = ({key: 8, "num_warps": 1}, {key: 16, "num_warps": 4})
        return quick
    out = []
    for batch in (1, 64, 128, 256):  # Mamba2-2.7B decode
        out.append(ssu_case(batch, 80, 64, 128, 1, 0, f32, bf16, interpret))
    for batch in (128, 256):
        out.append(ssu_case(batch, 80, 64, 128, 1, 0, bf16, bf16, interpret))
    out.append(ssu_case(128, 128, 64, 128, 8, 0, f32, bf16, interpret))  # Nemotron-H-8B
    out.append(ssu_case(128, 80, 64, 128, 1, 3, f32, bf16, interpret))  # spec decode, 4 slots written
    out.append(conv_update_case(256, 5376, 4, 0, bf16, interpret))
    out.append(conv_update_case(128, 5376, 4, 3, bf16, interpret))
    out.append(conv_varlen_case(4, 2048, 5376, 4, bf16, interpret))
    out.append(ssd_case(4, 2048, 80, 64, 128, 1, 256, bf16, interpret))
    out.append(ssd_case(4, 2048, 80, 64, 128, 1, 256, f32, interpret))
    out.append(ssd_case(1, 8192, 128, 64, 128, 8, 128, bf16, interpret))
    return out


# ----------------------------------------------------------------------------- timing


def _time(fn, args, donate, iters, warmup) -> float:
    """Seconds per call; the donated state of each call is fed to the next."""
    args = list(args)
    out = None
    for i in range(warmup + iters):
        if i == warmup:
            jax.block_until_ready((out, args))
            t0 = time.perf_counter()
        out = fn(*args)
        if donate is not None:
            args[donate] = out[1]
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


@functools.lru_cache(maxsize=None)
def copy_bandwidth(num_bytes: int, iters: int, warmup: int) -> float:
    """Bytes/s of an XLA elementwise copy that reads and writes ``num_bytes`` in total."""
    n = max(1, num_bytes // 8)
    copy = jax.jit(lambda a: a * 2.0, donate_argnums=0)
    a = jnp.ones((n,), jnp.float32)
    t = _time(lambda a: (None, copy(a)), (a,), 0, iters, warmup)
    return 8 * n / t


def run(full: bool, interpret: bool, only=None, iters=None, warmup=None, log=print, tune: bool = False) -> list[dict]:
    iters = iters if iters is not None else (20 if full else 2)
    warmup = warmup if warmup is not None else (3 if full else 1)
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters={iters} must be >= 1 and warmup={warmup} >= 0")
    rows = []
    for case in cases(full, interpret):
        if only and case.kernel not in only:
            continue
        row = dict(kernel=case.kernel, shape=case.label, dtype=case.dtype, bytes=case.bytes_moved, flops=case.flops)
        try:
            args, donate = case.make()
            t_pallas = _time(case.pallas, args, donate, iters, warmup)
            args, donate = case.make()  # fresh buffers: the previous ones were donated
            t_ref = _time(case.reference, args, donate, iters, warmup)
            bw = copy_bandwidth(case.bytes_moved, iters, warmup)
            row.update(pallas_us=t_pallas * 1e6, reference_us=t_ref * 1e6, speedup_vs_reference=t_ref / t_pallas,
                       achieved_GBps=case.bytes_moved / t_pallas / 1e9, copy_GBps=bw / 1e9,
                       roofline_fraction=case.bytes_moved / t_pallas / bw,
                       achieved_TFLOPs=case.flops / t_pallas / 1e12)
        except Exception as e:  # noqa: BLE001 - report and go on with the other kernels
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        log(_format_row(row))
        if tune and case.launch_grid and "error" not in row:
            row["launches"] = _tune(case, iters, warmup, row, log)
    return rows


def _tune(case: Case, iters: int, warmup: int, row: dict, log) -> list[dict]:
    """Time ``case`` at every launch of its grid; log each, then the best against the default table's."""
    bw = row["copy_GBps"] * 1e9
    results = []
    for launch in case.launch_grid:
        res = dict(launch)
        try:
            args, donate = case.make()
            t = _time(case.with_launch(launch), args, donate, iters, warmup)
            res.update(us=t * 1e6, roofline_fraction=case.bytes_moved / t / bw)
        except Exception as e:  # noqa: BLE001 - a launch Triton rejects is a result too
            res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        results.append(res)
        shown = " ".join(f"{k}={v}" for k, v in launch.items())
        log(f"  launch {shown:<28}" + (f"ERROR {res['error']}" if "error" in res else
                                       f"{res['us']:>9.1f} us {res['roofline_fraction']:>7.1%}"))
    timed = [r for r in results if "error" not in r]
    if timed:
        best = min(timed, key=lambda r: r["us"])
        shown = " ".join(f"{k}={v}" for k, v in best.items() if k not in ("us", "roofline_fraction"))
        log(f"  best   {shown:<28}{best['us']:>9.1f} us {best['roofline_fraction']:>7.1%}   "
            f"(default launch {row['pallas_us']:.1f} us {row['roofline_fraction']:.1%})")
    return results


HEADER = (f"{'kernel':<24}{'shape':<44}{'dtype':<28}{'pallas us':>11}{'ref us':>11}{'ref/pallas':>11}"
          f"{'GB/s':>9}{'copy GB/s':>11}{'roofline':>10}{'TFLOP/s':>9}")


def _format_row(r: dict) -> str:
    head = f"{r['kernel']:<24}{r['shape']:<44}{r['dtype']:<28}"
    if "error" in r:
        return head + "ERROR " + r["error"]
    return head + (f"{r['pallas_us']:>11.1f}{r['reference_us']:>11.1f}{r['speedup_vs_reference']:>11.2f}"
                   f"{r['achieved_GBps']:>9.1f}{r['copy_GBps']:>11.1f}{r['roofline_fraction']:>10.1%}"
                   f"{r['achieved_TFLOPs']:>9.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxmamba.bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="serving shapes (default on GPU)")
    size.add_argument("--quick", action="store_true", help="tiny shapes (default on CPU)")
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(KERNELS)}")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--interpret", action="store_true", help="force the Pallas interpreter")
    p.add_argument("--tune", action="store_true",
                   help="also time the decode kernels over a grid of launch parameters (block size x num_warps)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    interpret = args.interpret or on_cpu
    full = args.full or (not args.quick and not on_cpu)
    only = {k.strip() for k in args.only.split(",") if k.strip()}
    unknown = only - set(KERNELS)
    if unknown:
        p.error(f"unknown kernels {sorted(unknown)}; choose from {KERNELS}")
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"mode: {'Pallas interpreter' if interpret else 'compiled (Triton)'}, shapes: {'full' if full else 'quick'}")
    if interpret:
        print("NOTE: interpret mode on CPU -- these timings are NOT meaningful for performance; "
              "they only show that the benchmark runs end to end.")
    print("roofline = bandwidth of a same-size XLA elementwise copy measured in this run; "
          "ref/pallas > 1 means the Pallas kernel is faster than the plain-JAX reference.")
    print(HEADER)
    rows = run(full, interpret, only, args.iters, args.warmup, tune=args.tune)
    if args.json:
        meta = dict(device=dev.device_kind, backend=jax.default_backend(), jax=jax.__version__, interpret=interpret,
                    full=full, date=time.strftime("%Y-%m-%d"))
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
