# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Kernels: Pallas vs the plain-JAX (XLA) reference
#
# The four Mamba2 state kernels (`pallas_kernels/`) against their references, with the numbers
# `python -m jaxmamba.bench kernels` reports: time per call, bytes moved, fraction of the roofline (the
# bandwidth of a same-size XLA copy measured in the same run) and reference-time / kernel-time.
#
# Where the numbers come from, in order:
# 1. **recorded results**: a JSON file written by `python -m jaxmamba.bench kernels --json FILE` — the
#    file named by `$JAXMAMBA_KERNEL_BENCH_JSON`, else the newest `benchmarks/kernels*.json` of the repo;
# 2. **live on a GPU**: the benchmark's serving shapes, compiled (Triton), run here;
# 3. **CPU fallback**: the benchmark's tiny cases, one per kernel, in the Pallas *interpreter*. Those
#    timings are **not performance numbers** (the interpreter runs every program instance one after
#    another); they show the pipeline works, and each kernel's output is checked against its reference.

# %%
import json
import os
import time
from pathlib import Path

import jax
import matplotlib.pyplot as plt
import numpy as np

from jaxmamba.report import notebook_out
import jaxmamba
from jaxmamba.bench import kernels as kbench

T0 = time.time()
ROOT = Path(jaxmamba.__file__).resolve().parents[1]




OUT = notebook_out()


def recorded_results() -> Path | None:
    env = os.environ.get("JAXMAMBA_KERNEL_BENCH_JSON")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"JAXMAMBA_KERNEL_BENCH_JSON={env} does not exist")
        return Path(env)
    found = sorted((ROOT / "benchmarks").glob("kernels*.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


source = recorded_results()
on_gpu = jax.default_backend() == "gpu"
mode = "recorded" if source else ("live-gpu" if on_gpu else "cpu-interpret")
print(f"mode: {mode}" + (f" ({source})" if source else f" (jax backend {jax.default_backend()})"))

# %% [markdown]
# ## Measure (or load)
#
# Live runs use the benchmark's own cases (`jaxmamba.bench.kernels.cases`), so the shapes, inputs and
# byte counts are the ones `python -m jaxmamba.bench kernels` uses. Each case is compiled once per
# implementation; the first call's outputs (same inputs for both) are compared, then calls are timed
# with the donated state fed from one call to the next, as the benchmark does.

# %%
# Max |pallas - reference| / (1 + |reference|) allowed. In the interpreter both sides run the same f32
# math on the CPU; compiled on a GPU, XLA's f32 matmuls may use TF32, so the bound is looser there.
TOL = {"float32": 1e-4, "bfloat16": 5e-2} if mode == "cpu-interpret" else {"float32": 2e-2, "bfloat16": 1e-1}


def timed(fn, args, donate, iters):
    args = list(args)
    out = fn(*args)
    first = jax.device_get(out)
    if donate is not None:
        args[donate] = out[1]
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
        if donate is not None:
            args[donate] = out[1]
    jax.block_until_ready(out)
    return first, (time.perf_counter() - t0) / iters


def measure(case_list, iters, warmup):
    rows = []
    for case in case_list:
        args, donate = case.make()
        got, t_pallas = timed(case.pallas, args, donate, iters)
        args, donate = case.make()
        want, t_ref = timed(case.reference, args, donate, iters)
        tol = TOL["bfloat16" if "bfloat16" in case.dtype else "float32"]
        err = 0.0
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            err = max(err, float(np.max(np.abs(a - b) / (1 + np.abs(b)))))
        assert err < tol, f"{case.kernel} {case.label}: Pallas output differs from the reference by {err:.2e}"
        bw = kbench.copy_bandwidth(case.bytes_moved, iters, warmup)
        rows.append(dict(kernel=case.kernel, shape=case.label, dtype=case.dtype, bytes=case.bytes_moved,
                         flops=case.flops, pallas_us=t_pallas * 1e6, reference_us=t_ref * 1e6,
                         speedup_vs_reference=t_ref / t_pallas, achieved_GBps=case.bytes_moved / t_pallas / 1e9,
                         copy_GBps=bw / 1e9, roofline_fraction=case.bytes_moved / t_pallas / bw,
                         achieved_TFLOPs=case.flops / t_pallas / 1e12, max_rel_err_vs_reference=err))
        print(f"{case.kernel:<24}{case.label:<40}{case.dtype:<30} pallas {t_pallas * 1e6:9.1f} us   "
              f"reference {t_ref * 1e6:9.1f} us   max rel err vs reference {err:.1e}")
    return rows


if mode == "recorded":
    data = json.loads(source.read_text())
    meta, rows = data["meta"], data["rows"]
elif mode == "live-gpu":
    rows = measure(kbench.cases(full=True, interpret=False), iters=20, warmup=3)
    meta = dict(device=jax.devices()[0].device_kind, backend="gpu", jax=jax.__version__, interpret=False, full=True,
                date=time.strftime("%Y-%m-%d"))
else:
    one_per_kernel = {}
    for case in kbench.cases(full=False, interpret=True):
        one_per_kernel.setdefault(case.kernel, case)
    rows = measure(list(one_per_kernel.values()), iters=2, warmup=1)
    meta = dict(device=jax.devices()[0].device_kind, backend="cpu", jax=jax.__version__, interpret=True, full=False,
                date=time.strftime("%Y-%m-%d"))
    print("\nNOTE: Pallas interpreter on CPU -- these timings are NOT performance numbers.")
print(meta)

# %% [markdown]
# ## Checks on the numbers
#
# Whatever the source: every kernel is present, no case failed, and the derived columns agree with the
# measured ones (ratio = reference / kernel time; roofline fraction = achieved / copy bandwidth).

# %%
good = [r for r in rows if "error" not in r]
failed = [r for r in rows if "error" in r]
assert not failed, f"benchmark cases failed: {failed}"
assert {r["kernel"] for r in good} == set(kbench.KERNELS), {r["kernel"] for r in good}
for r in good:
    assert r["pallas_us"] > 0 and r["reference_us"] > 0
    assert np.isclose(r["speedup_vs_reference"], r["reference_us"] / r["pallas_us"], rtol=1e-6), r
    assert np.isclose(r["achieved_GBps"], r["bytes"] / r["pallas_us"] / 1e3, rtol=1e-6), r
    assert np.isclose(r["roofline_fraction"], r["achieved_GBps"] / r["copy_GBps"], rtol=1e-6), r

# %%
interp = bool(meta.get("interpret"))
labels = [f"{r['kernel']}\n{r['shape']}\n{r['dtype']}" for r in good]
y = np.arange(len(good))
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 0.75 * len(good) + 1.8), sharey=True)
ax0.barh(y - 0.2, [r["pallas_us"] for r in good], height=0.4, label="Pallas" + (" (interpreter)" if interp else ""))
ax0.barh(y + 0.2, [r["reference_us"] for r in good], height=0.4, label="plain-JAX reference (XLA)")
ax0.set_xscale("log")
ax0.set_xlabel("time per call (us)")
ax0.set_yticks(y)
ax0.set_yticklabels(labels, fontsize=6)
ax0.invert_yaxis()
ax0.legend(fontsize=7)
ax1.barh(y, [100 * r["roofline_fraction"] for r in good], color="#2ca02c")
for yi, r in zip(y, good):
    ax1.text(100 * r["roofline_fraction"], yi,
             f" {r['roofline_fraction']:.0%}, ref/pallas {r['speedup_vs_reference']:.2f}", va="center", fontsize=6)
ax1.set_xlabel("% of roofline (same-size XLA copy bandwidth)")
ax1.set_xlim(0, max(110, 100 * max(r["roofline_fraction"] for r in good) * 1.5))
title = f"{meta.get('device')} ({mode}, jax {meta.get('jax')}, {meta.get('date', '')})"
if interp:
    title += "\nPALLAS INTERPRETER ON CPU: NOT PERFORMANCE NUMBERS (pipeline check only)"
fig.suptitle(title, fontsize=9, color="#b00000" if interp else "black")
fig.tight_layout()
fig.savefig(OUT / "05_kernels.png", dpi=110)
plt.show()
print(f"notebook ran in {time.time() - T0:.1f} s")
