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
# # 04 · P/D disaggregation: what a decode rank reads from a prefill engine of another TP size
#
# A prefill (P) engine computes a prompt's state; a decode (D) engine with a different tensor-parallel
# size pulls it over NIXL and continues. Each D rank READs byte ranges of the P ranks' pages:
#
# * **Mamba slot page** (DS conv `[x | B | C]` then SSM `(H_local, P, N)`): with `tp_ratio = D_TP/P_TP ≥ 1`
#   a D rank reads *its slice* of each sub-projection of one P page (3 conv reads + 1 SSM read); with
#   `tp_ratio = -(P_TP/D_TP) < 0` it reads *whole* sub-projections of several smaller P pages and
#   places them side by side (vLLM's signed ratio, `MambaConvSplitInfo`).
# * **Attention KV block** `(block_size, kv_heads_local, head_dim)`: the D rank's KV heads
#   (`physical_head_range`, GQA replication when TP > num_kv_heads).
#
# `transfer.hetero_tp.TransferPlan` computes the ranges; here we draw them per rank at two TP ratios
# and check them against `transfer.pages`, an independent numpy sharding of random states that knows
# nothing of the plan. No NIXL needed (the bytes are copied with numpy).

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
from jaxmamba import HybridConfig
from jaxmamba.layout import page_size_bytes
from jaxmamba.random_checkpoint import random_config_dict

T0 = time.time()




OUT = notebook_out()

from transfer import TransferPlan, TransferShape
from transfer.pages import apply_ranges, kv_block_bytes, random_logical_state, shard_kv, shard_mamba_pages

# %% [markdown]
# ## The model and its cache dtypes
#
# The `small` NemotronH shape (4 B/C groups, 2 KV heads) so both TP 1→2 and TP 4→2 are valid: conv
# state in bfloat16, SSM state in float32 (as vLLM's `mamba_ssm_cache_dtype=float32`), KV in bfloat16.

# %%
cfg = HybridConfig.from_hf(random_config_dict("nemotron_h", "small"))
CONV_DT, SSM_DT, KV_DT = jnp.bfloat16, jnp.float32, jnp.bfloat16
shape = TransferShape.from_config(cfg, conv_dtype=CONV_DT, ssm_dtype=SSM_DT, kv_dtype=KV_DT, block_size=16)
print(shape)
SCENARIOS = [(1, 2), (4, 2)]  # (P_TP, D_TP): tp_ratio +2 (D reads a slice) and -2 (D gathers from 2 P ranks)
NUM_SLOTS, NUM_BLOCKS = 3, 2
state = random_logical_state(shape, num_slots=NUM_SLOTS, num_blocks=NUM_BLOCKS, seed=0)

# %% [markdown]
# ## Plans, checked
#
# For every D rank: the Mamba reads tile the D page exactly (no gap, no overlap), every read lies inside
# a P page, and executing the reads on the independently sharded P pages rebuilds exactly the page the D
# rank's own sharding holds (likewise for K and V blocks). Across all D ranks, every byte of every P page
# is read exactly once (B/C groups shard here; with one replicated group they would be read whole).

# %%
def tiles(ranges, size):
    pos = 0
    for r in sorted(ranges, key=lambda r: r.dst_offset):
        if r.dst_offset != pos:
            return False
        pos += r.length
    return pos == size


plans = {}
for p_tp, d_tp in SCENARIOS:
    plans[p_tp, d_tp] = [TransferPlan(shape, p_tp, d_tp, d) for d in range(d_tp)]
    p_pages = {r: shard_mamba_pages(shape, state, p_tp, r) for r in range(p_tp)}
    p_kv = {r: kv_block_bytes(shard_kv(shape, state, p_tp, r)) for r in range(p_tp)}
    read_count = {r: np.zeros(p_pages[r].shape[1], int) for r in range(p_tp)}
    for plan in plans[p_tp, d_tp]:
        d_page = plan.d_mamba.page_bytes
        # page sizes are vLLM's MambaSpec.page_size_bytes for each engine's TP
        assert d_page == page_size_bytes(cfg, d_tp, conv_dtype=CONV_DT, ssm_dtype=SSM_DT)
        assert plan.p_mamba.page_bytes == page_size_bytes(cfg, p_tp, conv_dtype=CONV_DT, ssm_dtype=SSM_DT)
        assert tiles(plan.ranges("mamba"), d_page) and plan.bytes_per_slot() == d_page
        for r in plan.ranges("mamba"):
            assert 0 <= r.src_offset and r.src_offset + r.length <= plan.p_mamba.page_bytes
            read_count[r.src_rank][r.src_offset : r.src_offset + r.length] += 1
        want = shard_mamba_pages(shape, state, d_tp, plan.d_rank)
        got = np.full_like(want, 0xAB)
        apply_ranges(plan.ranges("mamba", coalesced=True), p_pages, got, [(s, s) for s in range(NUM_SLOTS)])
        np.testing.assert_array_equal(got, want)
        want_kv = kv_block_bytes(shard_kv(shape, state, d_tp, plan.d_rank))
        got_kv = np.full_like(want_kv, 0xAB)
        for i, region in enumerate("kv"):
            assert tiles(plan.ranges(region), plan.d_kv.block_bytes)
            apply_ranges(plan.ranges(region, coalesced=True), {r: a[i] for r, a in p_kv.items()}, got_kv[i],
                         [(b, b) for b in range(NUM_BLOCKS)])
        np.testing.assert_array_equal(got_kv, want_kv)
        print(f"P_TP={p_tp} -> D_TP={d_tp} (tp_ratio {plan.tp_ratio:+d}) D rank {plan.d_rank}: Mamba from P ranks "
              f"{plan.mamba_read_targets}, KV from {plan.fa_read_targets}; {len(plan.ranges('mamba'))} Mamba reads "
              f"({len(plan.ranges('mamba', coalesced=True))} after coalescing) = {plan.bytes_per_slot()} B/slot, "
              f"{plan.bytes_per_block()} B/KV block")
    for r, counts in read_count.items():
        assert (counts == 1).all(), f"P rank {r}: bytes read {np.bincount(counts)} times"

# %% [markdown]
# ## The byte ranges, drawn per rank
#
# Top rows: each P rank's page, coloured by the D rank that reads each byte range (grey: not read).
# Bottom rows: each D rank's page, coloured by the P rank each range comes from. The conv section
# (left) and the SSM section (middle) of the slot page are drawn on their own axes (the SSM state is
# ~20x larger); right: one K block in NHD layout, where a head subset is one short run per token.

# %%
D_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
P_COLORS = ["#9467bd", "#8c564b", "#e377c2", "#17becf"]


def draw_section(ax, plans_, select, p_size, d_size, p_base, d_base, title):
    """Draw the ranges ``select`` keeps; offsets are shown relative to each side's section start."""
    p_tp, d_tp = plans_[0].p_tp, plans_[0].d_tp
    rows = [f"P rank {r}" for r in range(p_tp)] + [f"D rank {d}" for d in range(d_tp)]
    for y in range(len(rows)):
        ax.barh(y, p_size if y < p_tp else d_size, color="#eeeeee", edgecolor="black", height=0.7)
    for plan in plans_:
        for r in filter(select, plan.ranges()):
            part = r.part.replace("conv_", "")
            src, dst = r.src_offset - p_base, r.dst_offset - d_base
            ax.barh(r.src_rank, r.length, left=src, color=D_COLORS[plan.d_rank], edgecolor="black", height=0.7, lw=0.5)
            ax.barh(p_tp + plan.d_rank, r.length, left=dst, color=P_COLORS[r.src_rank], edgecolor="black",
                    height=0.7, lw=0.5)
            if r.length > 0.05 * max(p_size, d_size):
                ax.text(src + r.length / 2, r.src_rank, part, ha="center", va="center", fontsize=7)
                ax.text(dst + r.length / 2, p_tp + plan.d_rank, part, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=7)
    ax.invert_yaxis()
    ax.axhline(p_tp - 0.5, color="black", lw=1.5)
    ax.set_title(title, fontsize=8)
    ax.set_xlabel("byte offset in section", fontsize=7)
    ax.tick_params(axis="x", labelsize=6)


fig, axes = plt.subplots(len(SCENARIOS), 3, figsize=(13, 3.3 * len(SCENARIOS)),
                         gridspec_kw={"width_ratios": [2, 1.3, 1]})
for row, (p_tp, d_tp) in enumerate(SCENARIOS):
    ps = plans[p_tp, d_tp]
    pm, dm = ps[0].p_mamba, ps[0].d_mamba
    draw_section(axes[row, 0], ps, lambda r: r.part.startswith("conv"), pm.conv_bytes, dm.conv_bytes, 0, 0,
                 f"P_TP={p_tp} -> D_TP={d_tp} (tp_ratio {ps[0].tp_ratio:+d}): conv state [x|B|C], DS "
                 f"({pm.conv_bytes} B per P rank, {dm.conv_bytes} B per D rank)")
    draw_section(axes[row, 1], ps, lambda r: r.part == "ssm", pm.ssm_bytes, dm.ssm_bytes, pm.conv_bytes,
                 dm.conv_bytes, f"SSM state (H_local, P, N) ({pm.ssm_bytes} B / {dm.ssm_bytes} B)")
    draw_section(axes[row, 2], ps, lambda r: r.region == "k", ps[0].p_kv.block_bytes, ps[0].d_kv.block_bytes, 0, 0,
                 f"one K block, NHD ({ps[0].p_kv.block_bytes} B / {ps[0].d_kv.block_bytes} B; V alike)")
handles = [Patch(color=D_COLORS[d], label=f"read by D rank {d}") for d in range(2)] + \
          [Patch(color=P_COLORS[p], label=f"from P rank {p}") for p in range(4)] + \
          [Patch(facecolor="#eeeeee", edgecolor="black", label="not read (GQA replica)")]
fig.legend(handles=handles, loc="lower center", ncol=7, fontsize=7)
fig.tight_layout(rect=(0, 0.05, 1, 1))
fig.savefig(OUT / "04_transfer_ranges.png", dpi=110)
plt.show()
# %% [markdown]
# ## The engines, end to end
#
# The same flow with real engines (`jaxmamba.engine.disagg`): a `PrefillEngine` computes each
# prompt's first N-1 tokens and stages that request's pages in host memory registered with NIXL; a
# `DecodeEngine` READs them (UCX over loopback on a CPU), installs them only once every READ has
# succeeded, and decodes token N as a one-token extend (a decode row: docs/architecture.md, Rule 1). Here both engines
# share this process at TP 1 (the tests run them as separate processes at the six TP ratios). After
# the prefill engine is closed, its staging is gone: the decode engine falls back to prefilling
# the prompt itself, and the tokens do not change.

# %%
from transfer.nixl_bridge import nixl_available

if not nixl_available():
    print("NIXL is not installed (pip install -e '.[nixl]'): the engine-level flow is skipped here")
else:
    from jaxmamba import LLM, SamplingParams
    from jaxmamba.engine.disagg import DecodeEngine, PrefillEngine

    path = jaxmamba.random_model("nemotron_h", "tiny", seed=0, path=OUT / "checkpoints" / "nemotron_h")
    engine_args = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, buckets=[(2, 32)])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (9, 30)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    single = [o.outputs[0].token_ids for o in LLM(path, **engine_args).generate(prompts, greedy)]

    prefill = PrefillEngine(LLM(path, **engine_args), engine_id="P0")
    decode = DecodeEngine(LLM(path, **engine_args), name="D0")
    decode.connect(prefill.directories())
    outs = decode.generate(prefill.prefill(prompts), greedy)
    assert [o.outputs[0].token_ids for o in outs] == single, "the decode engine must continue exactly"
    for o in outs:
        rec = decode.transfers[o.request_id]
        print(f"request {o.request_id}: {rec.status}, {rec.bytes_read} B in {rec.num_descriptors} descriptors, "
              f"READ {1e3 * rec.read_seconds:.1f} ms")
        assert rec.status == "imported" and rec.bytes_read > 0

    handoffs = prefill.prefill(prompts)
    prefill.close()  # its staging pages are deregistered: every READ must now fail
    outs = decode.generate(handoffs, greedy)
    assert [o.outputs[0].token_ids for o in outs] == single, "a fallback must not change the tokens"
    for o in outs:
        rec = decode.transfers[o.request_id]
        print(f"request {o.request_id}: {rec.status} ({rec.error})")
        assert rec.status == "fallback"
    decode.llm.check_invariants()
    assert decode.llm.stats.slots_in_use == 0 and decode.llm.stats.blocks_in_use == 0
    decode.close()

print(f"notebook ran in {time.time() - T0:.1f} s")
