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
# # 01 · Quickstart: load, generate, look inside one step
#
# 1. Load the embedded default checkpoint (a deterministic random NemotronH written on first use).
# 2. Generate with `jaxmamba.LLM` (vLLM's offline API) and check the serving path (state caches,
#    paged KV, chunked prefill) against the cache-free whole-sequence model.
# 3. Catch the metadata pytrees of a **mixed** step (decodes + a prefill) and pretty-print them.
# 4. Show which bucket (static padded shape, compiled once) each batch lands in.
#
# Runs on CPU in well under a minute. Figures go to `$JAXMAMBA_NOTEBOOK_OUT` (default `notebooks/_out`).

# %%
import os
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from jaxmamba.report import notebook_out
import jaxmamba
from jaxmamba import LLM, SamplingParams
from jaxmamba.cli import default_checkpoint
from jaxmamba.layout import PAD_SLOT_ID
from jaxmamba.model.greedy import greedy_generate
from jaxmamba.steps import default_buckets, select_bucket

T0 = time.time()




OUT = notebook_out()
print("figures ->", OUT)

# %% [markdown]
# ## Load the embedded default

# %%
path = default_checkpoint()  # ~/.cache/jaxmamba/random-nemotron_h-tiny-seed0 (HF format: config.json + safetensors)
model = jaxmamba.load_pretrained(path, dtype="float32")  # Flax NNX HybridForCausalLM
cfg = model.cfg
print(path)
print(f"family {cfg.family}: {cfg.num_hidden_layers} layers {cfg.layer_types}")
print(f"hidden {cfg.hidden_size}, mamba heads {cfg.mamba_num_heads} x {cfg.mamba_head_dim}, "
      f"d_state {cfg.mamba_d_state}, groups {cfg.mamba_n_groups}, conv K {cfg.mamba_conv_kernel}, "
      f"vocab {cfg.vocab_size}")

# %% [markdown]
# ## Generate
#
# Two explicit buckets keep start-up short: every bucket is compiled ahead of time, and serving never
# compiles again (`llm.stats.backend_compiles_since_warmup` counts any XLA compilation after warm-up).

# %%
BUCKETS = [(4, 16), (4, 32)]  # (num_reqs_padded, num_tokens_padded)
# async_scheduling=False: each llm.step() below runs one step and records it before returning (the async
# engine, the default, reads a step back during the next call, while the next step runs).
llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=16, buckets=BUCKETS,
          async_scheduling=False)
prompts = [[1, 17, 42, 7, 99, 3], [5, 6, 7], [300, 2, 44, 19]]
greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
outputs = llm.generate(prompts, greedy)
for out in outputs:
    print(f"{out.prompt_token_ids} -> {out.outputs[0].token_ids} ({out.outputs[0].finish_reason})")

# The serving path (state slots, paged KV, packed varlen steps) must give the tokens that the
# cache-free whole-sequence model gives when it recomputes every prefix.
reference_tokens, _ = greedy_generate(model, prompts, 8)
assert [o.outputs[0].token_ids for o in outputs] == reference_tokens, (outputs, reference_tokens)
print("serving path == whole-sequence greedy:", reference_tokens == [o.outputs[0].token_ids for o in outputs])

# %% [markdown]
# ## The metadata of a mixed step
#
# We wrap the runner's metadata step to keep what it wrote, start two requests, let them reach
# decode, then add a third: the next step is *mixed* — two decode rows, then one prefill row, then
# padding up to the bucket. Batch order is decodes first (as vLLM's reorder). Serving writes a step's
# packed buffer straight from the rows (`metadata.mixed_step`); beside it we run the metadata builders on
# the same rows to see the buffer as pytrees, and check that they pack to the very same buffer.

# %%
captured = []
runner = llm.runner
_metadata, _execute = runner._metadata, runner.execute


def metadata_and_keep(bucket, rows, row_map, draft_counts):
    buffer, num_decodes = _metadata(bucket, rows, row_map, draft_counts)
    packed, common, mamba = runner._build(bucket, rows.computed, rows.scheduled, rows.prompt,
                                          runner.block_table.mirror, runner.state_table.mirror, None, None,
                                          block_table_rows=row_map)
    assert (packed.buffer == buffer).all() and int(mamba.num_decodes) == num_decodes
    captured.append((common, mamba))
    return buffer, num_decodes


def execute_and_keep(sched):
    result = _execute(sched)
    captured[-1] = (*captured[-1], result.bucket, [r.num_tokens for r in sched.rows])
    return result


runner._metadata, runner.execute = metadata_and_keep, execute_and_keep
# Process-wide XLA compilations so far (the greedy reference above compiled its own program).
compiles_before = llm.stats.backend_compiles_since_warmup
long_params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
llm.add_request([11, 12, 13, 14, 15], long_params)
llm.add_request([21, 22, 23], long_params)
llm.step()  # both prefill
llm.step()  # both decode
third_prompt = [31, 32, 33, 34, 35, 36, 37, 38, 39]
llm.add_request(third_prompt, long_params)
llm.step()  # mixed: 2 decodes + 1 prefill of 9 tokens
common, mamba, mixed_bucket, _ = captured[-1]
while llm.scheduler.has_work:
    llm.step()
runner._metadata, runner.execute = _metadata, _execute


def show(md, max_items=12):
    """One line per field: data leaves with shape and values (padding included), then static meta."""
    import dataclasses

    meta = []
    print(f"{type(md).__name__}")
    for f in dataclasses.fields(md):
        v = getattr(md, f.name)
        if isinstance(v, np.ndarray):
            flat = v.reshape(-1)
            vals = np.array2string(flat[:max_items], separator=",", max_line_width=10_000)
            more = f" ... (+{flat.size - max_items})" if flat.size > max_items else ""
            print(f"  {f.name:<42} {v.dtype.name:<6} {str(v.shape):<10} {vals}{more}")
        else:
            meta.append(f"{f.name}={v!r}")
    print("  static:", ", ".join(meta))


show(common)
print()
show(mamba)

# %%
n_dec, n_pre = int(mamba.num_decodes), int(mamba.num_prefills)
R = common.num_reqs_padded
qsl = common.query_start_loc
print(f"bucket: {mixed_bucket}  real rows {int(common.num_reqs)} of {R}, "
      f"real tokens {int(common.num_actual_tokens)} of {common.num_tokens_padded}")
assert (n_dec, n_pre) == (2, 1), "two decode rows then one prefill row"
assert list(common.is_prefilling[:3]) == [False, False, True]
assert list(np.diff(qsl)[:3]) == [1, 1, len(third_prompt)]
# docs/architecture.md, Rule 3: padded rows are never prefilling, schedule nothing, and point at no slot
assert not common.is_prefilling[3:].any() and (np.diff(qsl)[3:] == 0).all()
assert (mamba.state_indices_decode[n_dec:] == PAD_SLOT_ID).all()
assert (mamba.state_indices_prefill[n_pre:] == PAD_SLOT_ID).all()
assert (mamba.state_indices_decode[:n_dec] > 0).all() and mamba.state_indices_prefill[0] > 0
# docs/architecture.md, Rule 4: max_seq_len is the real batch maximum, not max_model_len
assert int(common.max_seq_len) == int(common.seq_lens[:3].max()) < common.max_model_len
# the bucket is the smallest that holds 3 rows / 11 tokens
assert mixed_bucket == select_bucket(llm.runner.steps.buckets, 3, 2 + len(third_prompt), decode_only=False)
# ...and nothing compiled while serving these steps: one executable per bucket and sampling variant, all built at start-up
stats = llm.stats
print(stats)
assert stats.num_buckets == len(BUCKETS)
assert stats.num_compilations == stats.num_step_programs  # decode buckets: a greedy-only and a full sampling tail
assert stats.backend_compiles_since_warmup == compiles_before, "a serving step compiled"

# %% [markdown]
# ### Packed token layout of that step
#
# One row per request slot of the bucket; tokens are packed back to back (`query_start_loc`), the tail
# up to `num_tokens_padded` is padding (`slot_mapping = -1`: never written to the KV cache).

# %%
fig, ax = plt.subplots(figsize=(9, 2.4))
T = common.num_tokens_padded
colors = {"decode": "#1f77b4", "prefill": "#ff7f0e", "padding": "#dddddd"}
for row in range(R):
    start, end = int(qsl[row]), int(qsl[row + 1])
    kind = "padding" if row >= int(common.num_reqs) else ("decode" if row < n_dec else "prefill")
    if end > start:
        ax.barh(0, end - start, left=start, color=colors[kind], edgecolor="black")
        ax.text((start + end) / 2, 0, f"row {row}\n{kind}\n{end - start} tok", ha="center", va="center", fontsize=7)
ax.barh(0, T - int(qsl[-1]), left=int(qsl[-1]), color=colors["padding"], edgecolor="black")
ax.text((T + int(qsl[-1])) / 2, 0, f"padding ({T - int(qsl[-1])} tok, slot_mapping=-1)", ha="center", va="center",
        fontsize=7)
ax.set_xlim(0, T)
ax.set_yticks([])
ax.set_xlabel("packed token position")
ax.set_title(f"mixed step in bucket (R={mixed_bucket.num_reqs}, T={mixed_bucket.num_tokens}): "
             f"rows {R - int(common.num_reqs)} padded, max_seq_len={int(common.max_seq_len)}", fontsize=9)
fig.tight_layout()
fig.savefig(OUT / "01_mixed_batch.png", dpi=110)
plt.show()

# %% [markdown]
# ## Which bucket does a batch land in?
#
# With the engine's default buckets for `max_num_seqs=8, max_num_batched_tokens=128`: pure-decode
# batches go to the small decode-only buckets (the analogue of vLLM's FULL CUDA graphs); any batch with
# a prefill goes to the smallest mixed bucket holding its tokens. (Only bucket *selection* here: nothing
# is compiled.)

# %%
defaults = default_buckets(8, 128)
print("default buckets:", [(b.num_reqs, b.num_tokens, "decode" if b.decode_only else "mixed") for b in defaults])
for n, t, dec in [(1, 1, True), (3, 3, True), (5, 5, True), (2, 7, False), (8, 40, False), (8, 128, False)]:
    b = select_bucket(defaults, n, t, dec)
    print(f"{n} reqs / {t:>3} tokens ({'decode-only' if dec else 'mixed'}) -> R={b.num_reqs}, T={b.num_tokens}"
          f"{' (decode-only bucket)' if b.decode_only else ''}")
assert select_bucket(defaults, 3, 3, True) == next(b for b in defaults if b.decode_only and b.num_reqs == 4)
assert not select_bucket(defaults, 2, 7, False).decode_only
assert select_bucket(defaults, 8, 40, False).num_tokens == 64

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.2), gridspec_kw={"width_ratios": [1, 3]})
decode_rows = np.arange(1, 9)
chosen = [select_bucket(defaults, int(n), int(n), True).num_reqs for n in decode_rows]
ax0.bar(decode_rows, chosen, color="#1f77b4")
ax0.plot(decode_rows, decode_rows, "k--", lw=1, label="no padding")
ax0.set_xlabel("decode requests")
ax0.set_ylabel("bucket rows (R)")
ax0.set_title("decode-only batches", fontsize=9)
ax0.legend(fontsize=7)
mixed = [b for b in defaults if not b.decode_only]
reqs_axis, tok_axis = np.arange(1, 9), np.arange(1, 129)
grid = np.full((len(reqs_axis), len(tok_axis)), np.nan)
for i, n in enumerate(reqs_axis):
    for j, t in enumerate(tok_axis):
        if t >= n:  # every row schedules at least one token
            grid[i, j] = mixed.index(select_bucket(defaults, int(n), int(t), False))
cmap = plt.get_cmap("viridis", len(mixed))
im = ax1.imshow(grid, aspect="auto", origin="lower", extent=(0.5, 128.5, 0.5, 8.5), cmap=cmap,
                vmin=-0.5, vmax=len(mixed) - 0.5)
cbar = fig.colorbar(im, ax=ax1, ticks=range(len(mixed)))
cbar.ax.set_yticklabels([f"R={b.num_reqs}, T={b.num_tokens}" for b in mixed], fontsize=7)
ax1.set_xlabel("scheduled tokens in the batch")
ax1.set_ylabel("requests")
ax1.set_title("batches with a prefill: the mixed bucket each lands in", fontsize=9)
fig.tight_layout()
fig.savefig(OUT / "01_buckets.png", dpi=110)
plt.show()
print(f"notebook ran in {time.time() - T0:.1f} s")
