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
# # 02 · Cross-framework: jaxmamba vs transformers, and the kernel backend
#
# **Part 1.** The same checkpoint and token ids through transformers (torch, CPU) and jaxmamba, for
# several families, in float32 and bfloat16: the max |Δ| at every residual-stream position
# (`jaxmamba.compare.compare_with_transformers`, the engine of `python -m jaxmamba compare`).
#
# **Part 2.** The serving engine (`jaxmamba.LLM`: state caches, paged KV, chunked prefill, decode) with
# the plain-JAX reference kernels vs the Pallas kernels (run by the Pallas interpreter on CPU), against
# the cache-free whole-sequence model.
#
# Needs the `torch` extra (transformers). Runs on CPU in under a minute.

# %%
import os
import time
from pathlib import Path

import jax
import matplotlib.pyplot as plt
from matplotlib.patches import Patch
import numpy as np

from jaxmamba.report import notebook_out
import jaxmamba
from jaxmamba import LLM, SamplingParams, load_pretrained, random_model
from jaxmamba.compare import compare_with_transformers, format_report
from jaxmamba.report import KIND_COLORS  # the colours `python -m jaxmamba compare --report` uses

T0 = time.time()




OUT = notebook_out()
CKPTS = OUT / "checkpoints"

# %% [markdown]
# ## Part 1 · per-layer |Δ| against transformers

# %%
FAMILIES = ["nemotron_h", "bamba", "falcon_h1"]
DTYPES = ["float32", "bfloat16"]
results = {}
for family in FAMILIES:
    path = random_model(family, size="tiny", seed=0, path=CKPTS / family)
    for dtype in DTYPES:
        results[family, dtype] = compare_with_transformers(path, batch=2, seq_len=16, dtype=dtype, seed=0)
print(format_report(results["bamba", "bfloat16"]))
print(f"part 1 compared {len(results)} runs in {time.time() - T0:.1f} s")

# %%
fig, axes = plt.subplots(1, len(FAMILIES), figsize=(4.2 * len(FAMILIES), 3.6), sharey=True)
floor = 1e-8  # exact zeros (the embedding lookup) are drawn as stubs at the floor, labelled "0"
for ax, family in zip(axes, FAMILIES):
    for k, (dtype, hatch) in enumerate(zip(DTYPES, ["", "//"])):
        r = results[family, dtype]
        x = np.arange(len(r.rows)) + (k - 0.5) * 0.4
        vals = [max(d, floor * 1.5) for _, _, d in r.rows]
        ax.bar(x, vals, width=0.4, color=[KIND_COLORS.get(kind, "#bbb") for _, kind, _ in r.rows], hatch=hatch,
               edgecolor="black", linewidth=0.5)
        for xi, (_, _, d), v in zip(x, r.rows, vals):
            ax.text(xi, v * 1.3, "0" if d == 0 else f"{d:.0e}", ha="center", fontsize=5.5, rotation=90)
    rows = results[family, "float32"].rows
    ax.set_xticks(np.arange(len(rows)))
    ax.set_xticklabels([f"{n}\n({kind})" for n, kind, _ in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(floor, 10)
    ax.set_title(family, fontsize=9)
axes[0].set_ylabel("max |Δ| vs transformers")
axes[0].legend(handles=[Patch(facecolor="white", edgecolor="black", label="float32 (plain)"),
                        Patch(facecolor="white", edgecolor="black", hatch="//", label="bfloat16 (hatched)")],
               fontsize=7, loc="upper left")
fig.suptitle("jaxmamba vs transformers, max |Δ| per residual-stream position (batch 2 x 16 tokens; "
             "colour = layer kind)", fontsize=9)
fig.tight_layout()
fig.savefig(OUT / "02_layer_deltas.png", dpi=110)
plt.show()

# %% [markdown]
# What must hold: float32 agrees to ~1e-6 at every layer (well under 1e-4) and the greedy tokens agree
# everywhere; bfloat16 differs by rounding only (logits within 5% of their scale) and is visibly
# coarser than float32 at every layer (proof that the bf16 run really ran in bf16).

# %%
for family in FAMILIES:
    f32, bf16 = results[family, "float32"], results[family, "bfloat16"]
    worst32 = max(d for _, _, d in f32.rows)
    print(f"{family:<11} f32 worst layer |Δ| {worst32:.2e}, logits rel {f32.logits_rel:.1e}, "
          f"argmax {f32.argmax_agreement:.0%} | bf16 logits rel {bf16.logits_rel:.1e}, "
          f"argmax {bf16.argmax_agreement:.0%}")
    assert f32.ok and worst32 < 1e-4 and f32.argmax_agreement == 1.0, format_report(f32)
    assert bf16.ok and bf16.argmax_agreement >= 0.8, format_report(bf16)
    # every position past the (exact) embedding lookup is coarser in bf16 than in f32
    assert all(b > a for (_, _, a), (_, _, b) in zip(f32.rows, bf16.rows) if a > 0), (f32.rows, bf16.rows)

# %% [markdown]
# ## Part 2 · kernel backend: reference vs Pallas (interpret) in the serving engine
#
# The same greedy generation through `jaxmamba.LLM` with `kernel_backend="reference"` and
# `kernel_backend="pallas"` (on CPU the Pallas kernels run in the interpreter). A token budget of 16 per
# step forces chunked prefill, so the varlen conv + chunked SSD scan kernels run with initial states,
# and the decode steps run the conv/SSM state-update kernels. Each engine returns the top-20 log-probs
# of every generated token; we compare them between backends and against `log_softmax` of the
# cache-free whole-sequence model over the same tokens.

# %%
family = "nemotron_h"
path = CKPTS / family
prompts = [[3, 14, 15, 92, 65, 35, 89], [27, 18, 28, 18, 28, 45, 90, 45, 23, 53, 60, 28, 74, 71, 35, 26, 62, 49, 77],
           [11, 4, 7, 300, 2]]
params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=20)
outs, timings = {}, {}
for backend in ["reference", "pallas"]:
    t = time.time()
    llm = LLM(path, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=16, buckets=[(4, 16)],
              kernel_backend=backend)
    outs[backend] = llm.generate(prompts, params)
    timings[backend] = time.time() - t
    print(f"{backend:<9} engine start (compile) + generate: {timings[backend]:.1f} s, {llm.stats.num_steps} steps")
print(f"part 2 engines done at {time.time() - T0:.1f} s")

# The cache-free whole-sequence model over prompt + generated tokens, one batched call (the model is
# causal: padding after a sequence changes none of its logits).
model = load_pretrained(path, dtype="float32")
seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs["reference"])]
batch = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
for i, seq in enumerate(seqs):
    batch[i, : len(seq)] = seq
whole_lp = np.asarray(jax.nn.log_softmax(model(batch), axis=-1))

# %%
labels, d_backend, d_ref, d_pallas = [], [], [], []
for i, prompt in enumerate(prompts):
    ref, pal = outs["reference"][i].outputs[0], outs["pallas"][i].outputs[0]
    assert ref.token_ids == pal.token_ids, (i, ref.token_ids, pal.token_ids)
    for j, (lp_ref, lp_pal) in enumerate(zip(ref.logprobs, pal.logprobs)):
        assert lp_ref.keys() == lp_pal.keys()
        whole = whole_lp[i, len(prompt) - 1 + j]
        assert ref.token_ids[j] == int(whole.argmax()), "greedy token differs from the whole-sequence model"
        labels.append(f"r{i}\nt{j}")
        d_backend.append(max(abs(lp_pal[k] - lp_ref[k]) for k in lp_ref))
        d_ref.append(max(abs(lp_ref[k] - whole[k]) for k in lp_ref))
        d_pallas.append(max(abs(lp_pal[k] - whole[k]) for k in lp_pal))

fig, ax = plt.subplots(figsize=(11, 3.4))
x = np.arange(len(labels))
floor = 1e-9
for k, (vals, name) in enumerate([(d_backend, "pallas(interpret) vs reference"),
                                  (d_ref, "reference vs whole-sequence model"),
                                  (d_pallas, "pallas(interpret) vs whole-sequence model")]):
    ax.bar(x + (k - 1) * 0.27, np.maximum(vals, floor * 1.5), width=0.27, label=name)
    for xi, v in zip(x + (k - 1) * 0.27, vals):
        if v == 0:
            ax.text(xi, floor * 2, "0", ha="center", fontsize=5)
ax.axhline(1e-4, color="black", ls="--", lw=1, label="tolerance 1e-4")
ax.set_yscale("log")
ax.set_ylim(floor, 1e1)
ax.set_xticks(x)
ax.set_xticklabels(labels, fontsize=6)
ax.set_xlabel("request r, generated token t (t0 comes from the (chunked) prefill, the rest from decode steps)",
              fontsize=7)
ax.set_ylabel("max |Δ log-prob| over top-20")
ax.set_title(f"{family}: kernel backend effect in the serving engine (float32). Engine start + generate "
             f"{timings['pallas']:.0f} s pallas-interpret vs {timings['reference']:.0f} s reference on CPU: "
             "not performance numbers", fontsize=8)
ax.legend(fontsize=7, loc="upper left", ncol=2)
fig.tight_layout()
fig.savefig(OUT / "02_kernel_backend.png", dpi=110)
plt.show()

# The two backends agree, and both reproduce the whole-sequence model through chunked prefill and decode.
print(f"max |Δ|: pallas vs reference {max(d_backend):.1e}, reference vs whole {max(d_ref):.1e}, "
      f"pallas vs whole {max(d_pallas):.1e}")
assert max(d_backend) < 1e-4 and max(d_ref) < 1e-4 and max(d_pallas) < 1e-4, (d_backend, d_ref, d_pallas)
print(f"notebook ran in {time.time() - T0:.1f} s")
