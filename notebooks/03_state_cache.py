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
# # 03 · The state cache: vLLM-layout pages, and the slot/block pools under a workload
#
# * **Page layout.** One Mamba state slot per layer is a page: the conv state in DS layout
#   `(conv_dim_local, K-1)`, channels `[x | B | C]`, then the SSM state `(H_local, P, N)` — vLLM's
#   `MambaSpec` page, so pages can be exchanged with a vLLM engine byte for byte.
# * **Page contents.** After a prefill we read one request's slot back from the device cache and
#   rebuild it independently in numpy: the conv page holds the last `K-1` pre-conv `xBC` inputs,
#   channel-major; the SSM page holds the recurrence state `h` after the last prompt token.
# * **Pools.** Slot-pool and KV-block-pool usage, and who holds which slot / block, step by step over a
#   workload that overfills the KV pool (preemption by recompute).
#
# * **Speculative decoding** (when the engine has it): the `1 + k` state slots each request holds.
#
# * **Prefix caching** (`mamba_cache_mode` align/all): requests that share a prompt prefix resume from
#   the cached KV blocks and the Mamba state slot at the prefix's last block end; hits per request,
#   and the tokens checked against the cache-free model.

# %%
import os
import time
from pathlib import Path

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from jaxmamba.report import notebook_out
import jaxmamba
from jaxmamba import LLM, ConfigError, SamplingParams, random_model
from jaxmamba.engine.scheduler import cdiv
from jaxmamba.layout import conv_channel_split, page_size_bytes, state_shapes

T0 = time.time()




OUT = notebook_out()
path = random_model("nemotron_h", size="tiny", seed=0, path=OUT / "checkpoints" / "nemotron_h")
MAX_SEQS, BLOCK, NUM_BLOCKS = 4, 16, 9  # 8 usable KV blocks (block 0 is null): too few for 4 long requests
# async_scheduling=False: each llm.step() below runs and records one step, so what the pools hold after it
# is what that step left. (Async scheduling frees a finished request's blocks when its last step is read
# back, one step later, so this small pool then admits the next request later and never preempts.)
llm = LLM(path, max_num_seqs=MAX_SEQS, max_num_batched_tokens=32, max_model_len=64, block_size=BLOCK,
          num_blocks=NUM_BLOCKS, buckets=[(4, 16), (4, 32)], async_scheduling=False)
cfg = llm.cfg
caches = llm.runner.caches
print(f"{len(caches.conv)} Mamba layers: conv {caches.conv[0].shape} {caches.conv[0].dtype}, "
      f"ssm {caches.ssm[0].shape}; {len(caches.kv)} attention layers: kv {caches.kv[0].shape}")

# %% [markdown]
# ## Page layout per TP rank
#
# Byte ranges of one slot's page on one rank, from `jaxmamba.layout` (the mirror of vLLM's
# `MambaStateShapeCalculator`). Each sub-projection of the conv state is one contiguous run, which is
# what lets a decode engine of another TP size read its share with one READ per part (notebook 04).

# %%
def page_parts(tp, conv_dtype, ssm_dtype):
    conv_shape, ssm_shape = state_shapes(cfg, tp)
    split = conv_channel_split(cfg, tp)
    rows = conv_shape[1]
    ci, si = np.dtype(conv_dtype).itemsize, np.dtype(ssm_dtype).itemsize
    parts = [("x", split.x_local * rows * ci), ("B", split.b_local * rows * ci), ("C", split.b_local * rows * ci),
             ("ssm", int(np.prod(ssm_shape)) * si)]
    assert split.conv_dim_local == conv_shape[0]
    return parts, conv_shape, ssm_shape


variants = [(1, "float32", "float32"), (2, "float32", "float32"), (1, jnp.bfloat16, "float32"),
            (2, jnp.bfloat16, "float32")]
colors = {"x": "#1f77b4", "B": "#2ca02c", "C": "#98df8a", "ssm": "#ff7f0e"}
fig, ax = plt.subplots(figsize=(10, 3.6))
for row, (tp, cdt, sdt) in enumerate(variants):
    parts, conv_shape, ssm_shape = page_parts(tp, cdt, sdt)
    total = sum(size for _, size in parts)
    # the page size from the parts equals vLLM's MambaSpec.page_size_bytes as jaxmamba.layout computes it
    assert total == page_size_bytes(cfg, tp, conv_dtype=cdt, ssm_dtype=sdt), (tp, cdt, total)
    left = 0
    for name, size in parts:
        ax.barh(row, size, left=left, color=colors[name], edgecolor="black", height=0.6)
        left += size
    ax.text(left + 80, row, " | ".join(f"{name} {size}" for name, size in parts) + f"  = {left} B", va="center",
            fontsize=7)
    print(f"TP={tp} conv {np.dtype(cdt).name:>8} {conv_shape} + ssm {np.dtype(sdt).name} {ssm_shape}: "
          f"{dict(parts)} = {total} bytes")
ax.set_yticks(range(len(variants)))
ax.set_yticklabels([f"TP={tp}, conv {np.dtype(c).name}\nssm {np.dtype(s).name}" for tp, c, s in variants], fontsize=7)
ax.invert_yaxis()
ax.set_xlabel("byte offset within one slot's page (one Mamba layer, one rank)")
ax.set_xlim(0, 16500)
ax.legend(handles=[Patch(color=c, label=n if n == "ssm" else f"conv {n}") for n, c in colors.items()], fontsize=7,
          loc="lower right")
ax.set_title(f"{cfg.family} tiny: DS conv page [x | B | C] (K-1={cfg.mamba_conv_kernel - 1} history values per "
             "channel, channel-major) + SSM page (H_local, P, N)", fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "03_page_layout.png", dpi=110)
plt.show()

# The device cache the engine allocated has exactly that page per slot.
slot_bytes = caches.conv[0][0].nbytes + caches.ssm[0][0].nbytes
assert slot_bytes == page_size_bytes(cfg, 1, conv_dtype=caches.conv[0].dtype, ssm_dtype=caches.ssm[0].dtype)
print("device page per slot per Mamba layer:", slot_bytes, "bytes")

# %% [markdown]
# ## What one slot holds after a prefill
#
# Prefill a 13-token prompt (one step), then read its slot of the first Mamba layer back and rebuild
# both pages from the checkpoint's weights with numpy alone.

# %%
prompt = [5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 33, 8, 401]
req = llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
llm.step()
slot, layer = llm.kv.state_table(req.request_id)[0], cfg.mamba_layer_ids[0]
conv_page = np.asarray(llm.runner.caches.conv[0][slot])  # (conv_dim, K-1), DS
ssm_page = np.asarray(llm.runner.caches.ssm[0][slot])  # (H, P, N)
print(f"request holds slot {slot}; conv page {conv_page.shape}, ssm page {ssm_page.shape}")

mixer = llm.model.layers[layer].mamba
normed = llm.model.layers[layer].input_norm(llm.model.embed_tokens(jnp.asarray(prompt)))
z, xbc, dt_raw = (np.asarray(a, np.float64) for a in mixer.project_in(normed))
K, R = cfg.mamba_conv_kernel, cfg.mamba_conv_kernel - 1
I, G, N = cfg.mamba_intermediate_size, cfg.mamba_n_groups, cfg.mamba_d_state
H, P = cfg.mamba_num_heads, cfg.mamba_head_dim

# Conv page: the last K-1 inputs of every channel, oldest first (DS: channel-major).
expected_conv = xbc[-R:].T
# SSM page: causal depthwise conv + SiLU, then h <- exp(dt*A) h + dt * x (outer) B, token by token, with
# dt = clamp(softplus(dt_raw + dt_bias), time_step_limit) (NemotronH clamps dt at time_step_min).
w = np.asarray(mixer.conv_weight[...], np.float64)
b = np.asarray(mixer.conv_bias[...], np.float64)
padded = np.concatenate([np.zeros((K - 1, xbc.shape[1])), xbc])
conv_out = np.stack([(padded[t : t + K] * w.T).sum(0) + b for t in range(len(prompt))])
act = conv_out / (1 + np.exp(-conv_out))
x = act[:, :I].reshape(-1, H, P)
Bm = act[:, I : I + G * N].reshape(-1, G, N)
dt = np.clip(np.log1p(np.exp(dt_raw + np.asarray(mixer.dt_bias[...], np.float64))), *cfg.mamba_time_step_limit)
A = -np.exp(np.asarray(mixer.A_log[...], np.float64))
h = np.zeros((H, P, N))
group_of_head = np.arange(H) // (H // G)
for t in range(len(prompt)):
    x_outer_b = x[t][:, :, None] * Bm[t][group_of_head][:, None, :]  # (H, P, N)
    h = np.exp(dt[t] * A)[:, None, None] * h + dt[t][:, None, None] * x_outer_b

err_conv, err_ssm = np.abs(conv_page - expected_conv).max(), np.abs(ssm_page - h).max()
print(f"conv page vs numpy: max |Δ| {err_conv:.1e};  ssm page vs numpy recurrence: max |Δ| {err_ssm:.1e}")
assert err_conv < 1e-5 and err_ssm < 1e-5, (err_conv, err_ssm)
assert np.abs(h).max() > 1e-2  # a non-trivial state, so the check above could fail

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [1, 2.2]})
lim = np.abs(conv_page).max()
im = ax0.imshow(conv_page, aspect="auto", cmap="RdBu_r", interpolation="nearest", vmin=-lim, vmax=lim)
for boundary, name in [(I, "x | B"), (I + G * N, "B | C")]:
    ax0.axhline(boundary - 0.5, color="black", lw=1)
    ax0.text(R - 0.45, boundary - 1, name, fontsize=7, ha="right", va="bottom")
ax0.set_xticks(range(R))
ax0.set_xticklabels([f"t-{R - 1 - j}" for j in range(R)], fontsize=7)
ax0.set_ylabel("conv channel (x: 0..%d, B, C)" % (I - 1))
ax0.set_title(f"conv page of slot {slot}\n({conv_page.shape[0]} ch x {R} history)", fontsize=8)
fig.colorbar(im, ax=ax0)
lim = np.abs(ssm_page).max()
im = ax1.imshow(ssm_page.reshape(H, P * N), aspect="auto", cmap="RdBu_r", interpolation="nearest", vmin=-lim, vmax=lim)
for hd in range(1, H):
    ax1.axhline(hd - 0.5, color="white", lw=0.3)
ax1.set_xlabel("P x N (head_dim x d_state), row-major")
ax1.set_ylabel("head")
ax1.set_title(f"ssm page of slot {slot}: h after token {len(prompt) - 1} (matches numpy to {err_ssm:.0e})",
              fontsize=8)
fig.colorbar(im, ax=ax1)
fig.tight_layout()
fig.savefig(OUT / "03_slot_contents.png", dpi=110)
plt.show()

# %% [markdown]
# ## Slot and block pools over a workload
#
# Ten requests with different prompt and output lengths through `max_num_seqs=4` and only 8 usable KV
# blocks of 16 tokens: running requests outgrow the KV pool and the newest is preempted (its slot and
# blocks go back; it recomputes later). After every step: the pools' invariants, and every running
# request holds one slot and exactly the KV blocks covering its computed tokens.

# %%
rng = np.random.default_rng(3)
workload = [(rng.integers(3, 500, size=int(rng.integers(3, 30))).tolist(), int(rng.integers(4, 24))) for _ in range(10)]
for p, n in workload:
    llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))

ids = {}
history = []  # per step: slots used, blocks used, preemptions, {slot: req}, {block: req}, tokens
while llm.scheduler.has_work:
    llm.step()
    llm.check_invariants()
    running = llm.scheduler.running
    slots_of = {r.request_id: llm.kv.state_table(r.request_id) for r in running}
    blocks_of = {r.request_id: llm.kv.kv_block_ids(r.request_id) for r in running}
    for r in running:
        assert len(blocks_of[r.request_id]) == cdiv(r.num_computed_tokens, BLOCK), (r.request_id, blocks_of)
    s = llm.stats
    assert s.slots_in_use == sum(len(v) for v in slots_of.values()) == len(running) <= MAX_SEQS
    assert s.blocks_in_use == sum(len(v) for v in blocks_of.values())
    for r in running:
        ids.setdefault(r.request_id, len(ids))
    history.append(dict(slots=s.slots_in_use, blocks=s.blocks_in_use, preempt=s.num_preemptions,
                        slot_owner={slot: ids[rid] for rid, v in slots_of.items() for slot in v},
                        block_owner={blk: ids[rid] for rid, v in blocks_of.items() for blk in v}))
final = llm.stats
print(final)
assert final.slots_in_use == 0 and final.blocks_in_use == 0, "every slot and block returned at the end"
assert max(h["slots"] for h in history) == MAX_SEQS and max(h["blocks"] for h in history) == NUM_BLOCKS - 1
assert final.num_preemptions > 0, "the workload was meant to overfill the KV pool"

# %%
steps = np.arange(1, len(history) + 1)
fig, axes = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [1.2, 1, 1.6]})
ax = axes[0]
ax.step(steps, [h["slots"] for h in history], where="mid", label=f"Mamba slots in use (of {MAX_SEQS})")
ax.step(steps, [h["blocks"] for h in history], where="mid", label=f"KV blocks in use (of {NUM_BLOCKS - 1})")
pre = [i + 1 for i in range(len(history)) if history[i]["preempt"] > (history[i - 1]["preempt"] if i else 0)]
ax.vlines(pre, 0, NUM_BLOCKS - 1, color="red", lw=0.8, ls=":", label="preemption")
ax.set_ylabel("in use")
ax.legend(fontsize=7, loc="upper right", ncol=3)
ax.set_title("pool usage per engine step (slot 0 / block 0 are null, never handed out)", fontsize=9)
cmap = plt.get_cmap("tab20", len(ids))


def owner_map(key, size):
    grid = np.full((size, len(history)), np.nan)
    for j, h in enumerate(history):
        for unit, owner in h[key].items():
            grid[unit, j] = owner
    return grid


for ax, key, size, name in [(axes[1], "slot_owner", MAX_SEQS + 1, "Mamba slot"),
                            (axes[2], "block_owner", NUM_BLOCKS, "KV block")]:
    ax.imshow(owner_map(key, size), aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(ids) - 0.5, interpolation="nearest",
              origin="lower", extent=(0.5, len(history) + 0.5, -0.5, size - 0.5))
    ax.set_ylabel(name)
    ax.set_yticks(range(size))
    ax.axhline(0.5, color="black", lw=0.8)
axes[2].set_xlabel("engine step")
axes[1].set_title("who holds which slot (colour = request); row 0 is the null slot", fontsize=8)
axes[2].set_title("who holds which KV block", fontsize=8)
axes[2].legend(handles=[Patch(color=cmap(i), label=f"req {i}") for i in range(len(ids))], fontsize=6, ncol=11,
               loc="upper center", bbox_to_anchor=(0.5, -0.28))
fig.tight_layout()
fig.savefig(OUT / "03_pool_usage.png", dpi=110)
plt.show()

# %% [markdown]
# ## Speculative decoding: 1 + k state slots per request
#
# With `speculative_config={"method": "ngram", "num_speculative_tokens": k}` (prompt lookup) a decode
# step verifies up to k drafts, and each Mamba layer writes the state after each of the `1 + k` tokens
# into its own slot; the next step reads the slot of the last accepted token. So every running request
# holds `1 + k` slots. Outputs must stay token-identical to plain greedy decoding.
#
# This section runs only when the engine accepts a speculative config (the feature is being finished
# alongside this notebook); otherwise it says so and shows nothing.

# %%
from jaxmamba.model.greedy import greedy_generate  # noqa: E402

K_SPEC = 2
try:
    spec_llm = LLM(path, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=BLOCK,
                   buckets=[(2, 16)], speculative_config={"method": "ngram", "num_speculative_tokens": K_SPEC})
except ConfigError as e:
    spec_llm = None
    print(f"speculative decoding: not available in this engine yet ({e})")

if spec_llm is not None:
    spec_prompts = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [40, 41, 42, 40, 41], [300, 5, 300, 5, 300]]
    for p in spec_prompts:
        spec_llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    requests = list(spec_llm.scheduler.waiting)
    spec_hist = []
    while spec_llm.scheduler.has_work:
        before = spec_llm.stats.num_draft_tokens, spec_llm.stats.num_accepted_draft_tokens
        spec_llm.step()
        spec_llm.check_invariants()
        s = spec_llm.stats
        running = spec_llm.scheduler.running
        assert all(len(spec_llm.kv.state_table(r.request_id)) == 1 + K_SPEC for r in running)
        assert s.slots_in_use == (1 + K_SPEC) * len(running), (s.slots_in_use, len(running))
        spec_hist.append(dict(slots=s.slots_in_use, running=len(running), drafts=s.num_draft_tokens - before[0],
                              accepted=s.num_accepted_draft_tokens - before[1]))
    s = spec_llm.stats
    print(s, f"acceptance rate {s.acceptance_rate:.0%}")
    assert s.slots_in_use == 0 and s.num_draft_tokens > 0
    # lossless: the same tokens as greedy decoding with the cache-free whole-sequence model
    want, _ = greedy_generate(spec_llm.model, spec_prompts, 20)
    assert [r.output_token_ids for r in requests] == want

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.0))
    st = np.arange(1, len(spec_hist) + 1)
    ax0.step(st, [h["slots"] for h in spec_hist], where="mid", label=f"slots in use (of {spec_llm.runner.num_slots - 1})")
    ax0.step(st, [h["running"] for h in spec_hist], where="mid", label="running requests")
    ax0.set_xlabel("engine step")
    ax0.set_title(f"ngram spec decode, k={K_SPEC}: {1 + K_SPEC} Mamba slots per running request", fontsize=8)
    ax0.legend(fontsize=7)
    ax1.bar(st - 0.2, [h["drafts"] for h in spec_hist], width=0.4, label="drafts verified")
    ax1.bar(st + 0.2, [h["accepted"] for h in spec_hist], width=0.4, label="drafts accepted")
    ax1.set_xlabel("engine step")
    ax1.set_title(f"acceptance {s.num_accepted_draft_tokens}/{s.num_draft_tokens} = {s.acceptance_rate:.0%} "
                  "(random tiny model)", fontsize=8)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "03_spec_decode_slots.png", dpi=110)
    plt.show()

# %% [markdown]
# ## Prefix caching
#
# Six requests share a 40-token system prompt. With `enable_prefix_caching=True` a request that
# arrives after the prefix was computed starts at the last block end that has both its KV blocks and
# a Mamba state in the cache (32 tokens here: blocks of 16, and at least one token must be computed).
# Mode `align` keeps a state only where a step ends on a block end (prefill chunks are cut there);
# mode `all` writes a state at every block end a prefill chunk crosses. Either way the tokens must be
# those of the cache-free model.

# %%
system = [int(t) for t in np.random.default_rng(7).integers(3, 500, 40)]
pc_prompts = [system + [int(t) for t in np.random.default_rng(i).integers(3, 500, 3 + 5 * i)] for i in range(6)]
want, _ = greedy_generate(llm.model, pc_prompts, 6)
hits = {}
for mode in ("align", "all"):
    pc = LLM(path, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=96, block_size=16,
             buckets=[(2, 32)], enable_prefix_caching=True, mamba_cache_mode=mode)
    outs = pc.generate(pc_prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    pc.check_invariants()
    assert [o.outputs[0].token_ids for o in outs] == want, f"mode {mode}: prefix hits changed the tokens"
    s = pc.stats
    print(f"mode {mode}: hit rate {s.prefix_cache_hit_rate:.0%} ({s.num_prefix_hit_tokens} of "
          f"{s.num_prefix_query_tokens} prompt tokens), {s.num_cached_blocks} blocks cached")
    assert s.num_prefix_hit_tokens >= 32 * 4, "the later requests must hit the shared prefix"
    hits[mode] = s.prefix_cache_hit_rate

fig, ax = plt.subplots(figsize=(4, 2.4))
ax.bar(list(hits), [100 * v for v in hits.values()])
ax.set_ylabel("prefix-cache hit rate (%)")
ax.set_title("6 requests sharing a 40-token prefix", fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "03_prefix_cache_hits.png", dpi=110)
plt.show()
print(f"notebook ran in {time.time() - T0:.1f} s")
