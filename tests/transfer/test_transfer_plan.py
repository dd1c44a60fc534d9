"""Transfer plans checked byte-for-byte against an independent sharding of logical states.

For every P_TP/D_TP ratio, n_groups, num_kv_heads, num_spec and dtype size: shard random TP=1
states into P-rank pages (``transfer.pages``, which knows nothing of the plan), execute the
plan's byte copies with numpy into a sentinel-filled D page, and require the result to equal
the page the D rank's own sharding holds -- including that padding is never written and
every byte is written exactly once.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxmamba.errors import ConfigError, TransferError
from transfer.conv_split import ConvSplit, ssm_slice
from transfer.hetero_tp import (
    ByteRange,
    TransferPlan,
    TransferShape,
    coalesce,
    mamba_read_targets,
    physical_head_range,
    signed_tp_ratio,
)
from transfer.pages import apply_ranges, kv_block_bytes, random_logical_state, shard_kv, shard_mamba_pages

# (P_TP, D_TP), written P/D as elsewhere in this project.
RATIOS = [(1, 2), (1, 4), (2, 4), (2, 1), (4, 2), (4, 1), (1, 1), (2, 8), (8, 2)]
GROUPS = [1, 2, 4, 8]
KV_HEADS = [1, 2, 4, 8]
NUM_SLOTS, NUM_BLOCKS = 3, 3
P_PAD, D_PAD = 24, 40  # unequal vLLM-style page padding on the two engines


def make_shape(
    n_groups: int,
    num_kv_heads: int,
    *,
    num_spec: int = 0,
    conv_dsize: int = 2,
    kv_layout: str = "NHD",
    ssm_dsize: int = 4,
) -> TransferShape:
    # Odd sizes (head_dim 3, d_state 5) so a slice off by one element cannot line up by accident.
    return TransferShape(
        intermediate_size=16 * 3,
        n_groups=n_groups,
        d_state=5,
        num_heads=16,
        head_dim=3,
        conv_kernel=4,
        num_spec=num_spec,
        conv_dtype_size=conv_dsize,
        ssm_dtype_size=ssm_dsize,
        num_kv_heads=num_kv_heads,
        attn_head_dim=3,
        kv_dtype_size=2,
        block_size=4,
        kv_layout=kv_layout,
    )


def valid_groups(g: int, *tps: int) -> bool:
    return all(g % tp == 0 or g == 1 for tp in tps)


def check_plan(plan: TransferPlan, state, *, coalesced: bool) -> None:
    """Execute ``plan`` on the independent P pages; assert the D rank's own pages come out."""
    shape, p_tp, d_tp, d = plan.shape, plan.p_tp, plan.d_tp, plan.d_rank
    # Mamba: remote slot s lands in local slot perm[s] (a permutation catches slot mix-ups).
    p_pages = {
        r: shard_mamba_pages(shape, state, p_tp, r, page_stride=plan.p_mamba.page_bytes + P_PAD, pad_byte=0xEE)
        for r in range(p_tp)
    }
    want = shard_mamba_pages(shape, state, d_tp, d, page_stride=plan.d_mamba.page_bytes + D_PAD, pad_byte=0xAB)
    perm = np.roll(np.arange(NUM_SLOTS), 1)
    got = np.full_like(want, 0xAB)
    apply_ranges(plan.ranges("mamba", coalesced=coalesced), p_pages, got, list(zip(range(NUM_SLOTS), perm)))
    np.testing.assert_array_equal(got[perm], want, err_msg=f"mamba page mismatch for {plan_id(plan)}")
    if not shape.has_attention:
        return
    p_kv = {r: kv_block_bytes(shard_kv(shape, state, p_tp, r)) for r in range(p_tp)}
    want_kv = kv_block_bytes(shard_kv(shape, state, d_tp, d))
    got_kv = np.full_like(want_kv, 0xAB)
    bperm = np.roll(np.arange(NUM_BLOCKS), -1)
    for idx, region in enumerate(("k", "v")):
        apply_ranges(
            plan.ranges(region, coalesced=coalesced),
            {r: a[idx] for r, a in p_kv.items()},
            got_kv[idx],
            list(zip(range(NUM_BLOCKS), bperm)),
        )
    np.testing.assert_array_equal(got_kv[:, bperm], want_kv, err_msg=f"KV mismatch for {plan_id(plan)}")


def check_exactly_once(ranges, size: int) -> None:
    """The ranges' destinations tile ``[0, size)`` with no overlap and no gap."""
    pos = 0
    for r in sorted(ranges, key=lambda r: r.dst_offset):
        assert r.dst_offset == pos, f"gap/overlap at {pos}: {r}"
        pos += r.length
    assert pos == size


def plan_id(plan: TransferPlan) -> str:
    s = plan.shape
    return (
        f"P_TP={plan.p_tp} D_TP={plan.d_tp} d_rank={plan.d_rank} G={s.n_groups} K={s.num_kv_heads} "
        f"spec={s.num_spec} conv_dsize={s.conv_dtype_size} {s.kv_layout}"
    )


@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("n_groups", GROUPS)
@pytest.mark.parametrize("p_tp,d_tp", RATIOS, ids=[f"P{p}D{d}" for p, d in RATIOS])
def test_plan_rebuilds_d_pages_exactly(p_tp, d_tp, n_groups, kv_heads):
    if not valid_groups(n_groups, p_tp, d_tp):
        # Neither vLLM nor jaxmamba can shard this model at one of the TPs; the plan says so.
        with pytest.raises(ConfigError, match="n_groups"):
            TransferPlan(make_shape(n_groups, kv_heads), p_tp, d_tp, 0)
        return
    for num_spec in (0, 2):
        for conv_dsize in (2, 4):
            for kv_layout in ("NHD", "HND"):
                shape = make_shape(n_groups, kv_heads, num_spec=num_spec, conv_dsize=conv_dsize, kv_layout=kv_layout)
                state = random_logical_state(
                    shape,
                    num_slots=NUM_SLOTS,
                    num_blocks=NUM_BLOCKS,
                    seed=hash((p_tp, d_tp, n_groups, kv_heads, num_spec, conv_dsize)) % 2**32,
                )
                for d_rank in range(d_tp):
                    plan = TransferPlan(shape, p_tp, d_tp, d_rank)
                    check_exactly_once(plan.mamba_ranges, plan.d_mamba.page_bytes)
                    for region in ("k", "v"):
                        check_exactly_once(plan.ranges(region), plan.d_kv.block_bytes)
                    assert plan.bytes_per_slot() == plan.d_mamba.page_bytes
                    check_plan(plan, state, coalesced=False)
                    check_plan(plan, state, coalesced=True)


def test_mamba_only_model_has_no_kv_ranges():
    shape = make_shape(2, 0)
    plan = TransferPlan(shape, 2, 1, 0)
    assert plan.kv_ranges == () and plan.fa_read_targets == () and plan.p_kv is None
    check_plan(plan, random_logical_state(shape, num_slots=NUM_SLOTS, seed=1), coalesced=True)


def test_checker_catches_a_wrong_plan():
    """The checker is not vacuous: shifting one range by one element, or dropping one, fails it."""
    shape = make_shape(2, 4)
    state = random_logical_state(shape, num_slots=NUM_SLOTS, num_blocks=NUM_BLOCKS, seed=7)
    plan = TransferPlan(shape, 1, 2, 1)
    check_plan(plan, state, coalesced=False)
    for victim in range(len(plan.mamba_ranges)):
        r = plan.mamba_ranges[victim]
        for bad in (dataclasses.replace(r, src_offset=r.src_offset + 2), None):
            ranges = list(plan.mamba_ranges)
            if bad is None:
                del ranges[victim]
            else:
                ranges[victim] = bad
            broken = dataclasses.replace(plan)  # re-runs __post_init__; then swap the ranges in
            object.__setattr__(broken, "mamba_ranges", tuple(ranges))
            with pytest.raises(AssertionError):
                check_plan(broken, state, coalesced=False)


def test_vllm_formula_alone_breaks_replicated_groups():
    """vLLM 0.33's remote_conv_offsets applied to B/C with n_groups=1 reads the wrong bytes.

    This is why the plan reads the replicated group whole: built only from ConvSplit offsets
    (vLLM's formula), the D page does not come out.
    """
    for p_tp, d_tp in [(1, 2), (2, 1), (1, 4), (4, 2)]:
        shape = make_shape(1, 2)
        state = random_logical_state(shape, num_slots=NUM_SLOTS, num_blocks=NUM_BLOCKS, seed=3)
        plan = TransferPlan(shape, p_tp, d_tp, d_tp - 1)
        check_plan(plan, state, coalesced=True)  # the real plan is right
        ratio = plan.tp_ratio
        naive = []
        for j, p_rank in enumerate(plan.mamba_read_targets):
            lro = plan.d_rank % ratio if ratio >= 1 else 0
            remote = plan.d_mamba.conv.remote_offsets(lro, ratio)
            local = plan.d_mamba.conv.local_offsets_for_source(j, ratio)
            for part, (so, n), (do, _) in zip(("conv_x", "conv_B", "conv_C"), remote, local):
                naive.append(ByteRange("mamba", part, p_rank, so, do, n))
        naive += [r for r in plan.mamba_ranges if r.part == "ssm"]
        broken = dataclasses.replace(plan)
        object.__setattr__(broken, "mamba_ranges", tuple(naive))
        with pytest.raises(AssertionError):
            check_plan(broken, state, coalesced=False)


# ---- ConvSplit ----------------------------------------------------------------------------


def test_conv_split_offsets_match_design_formulas():
    cs = ConvSplit(conv_rows=3, x_local=8, b_local=4, dtype_size=2)
    xb, bb = 8 * 3 * 2, 4 * 3 * 2
    assert (cs.conv_dim_local, cs.x_bytes, cs.b_bytes, cs.conv_bytes) == (16, xb, bb, xb + 2 * bb)
    assert cs.local_offsets() == [(0, xb), (xb, bb), (xb + bb, bb)]
    # D_TP/P_TP = 2: slice 1 of each sub-projection of a P page twice as large.
    assert cs.remote_offsets(1, 2) == [(xb, xb), (2 * xb + bb, bb), (2 * xb + 2 * bb + bb, bb)]
    assert cs.remote_offsets(0, 4) == [(0, xb), (4 * xb, bb), (4 * xb + 4 * bb, bb)]
    # P_TP/D_TP = 2: each sub-projection of a half-size P page read whole ...
    assert cs.remote_offsets(0, -2) == [(0, xb // 2), (xb // 2, bb // 2), (xb // 2 + bb // 2, bb // 2)]
    # ... and the second source lands in the second half of each local sub-projection.
    assert cs.local_offsets_for_source(1, -2) == [
        (xb // 2, xb // 2),
        (xb + bb // 2, bb // 2),
        (xb + bb + bb // 2, bb // 2),
    ]
    assert ssm_slice(120, 1, 2) == (120, 0, 120)
    assert ssm_slice(120, 1, -4) == (0, 30, 30)


@pytest.mark.parametrize("bad", [0, -1])
def test_conv_split_rejects_non_ratios(bad):
    with pytest.raises(TransferError, match="tp_ratio"):
        ConvSplit(3, 8, 4, 2).remote_offsets(0, bad)


def test_conv_split_rejects_bad_slice_and_uneven_split():
    cs = ConvSplit(3, 8, 4, 2)
    with pytest.raises(TransferError, match="local_rank_offset=2"):
        cs.remote_offsets(2, 2)
    with pytest.raises(TransferError, match="does not split"):
        ConvSplit(1, 3, 1, 1).remote_offsets(0, -2)
    with pytest.raises(TransferError, match="x_local"):
        ConvSplit(3, 0, 4, 2)


# ---- topology ------------------------------------------------------------------------------


def test_physical_head_range_table():
    assert [physical_head_range(4, 8, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [physical_head_range(8, 2, r) for r in range(8)] == [range(0, 1)] * 4 + [range(1, 2)] * 4
    assert [physical_head_range(4, 1, r) for r in range(4)] == [range(0, 1)] * 4
    with pytest.raises(ConfigError, match="num_kv_heads=6"):
        physical_head_range(4, 6, 0)
    with pytest.raises(ConfigError, match="rank=4"):
        physical_head_range(4, 8, 4)


def test_read_targets():
    assert signed_tp_ratio(1, 4) == 4 and signed_tp_ratio(4, 2) == -2 and signed_tp_ratio(2, 2) == 1
    assert mamba_read_targets(2, 4, 3) == (1,)
    assert mamba_read_targets(4, 2, 1) == (2, 3)
    assert mamba_read_targets(8, 2, 1) == (4, 5, 6, 7)
    # GQA replication on P (K=2 < P_TP=4): D (TP 1) reads each head once, from ranks 0 and 2,
    # but the Mamba state (always sharded) from all four.
    plan = TransferPlan(make_shape(4, 2), 4, 1, 0)
    assert plan.mamba_read_targets == (0, 1, 2, 3) and plan.fa_read_targets == (0, 2)
    # K=1 everywhere: D rank 3 of 4 reads its (replicated) head from its own Mamba source.
    plan = TransferPlan(make_shape(1, 1), 2, 4, 3)
    assert plan.mamba_read_targets == (1,) and plan.fa_read_targets == (1,)


def test_descriptor_counts_are_minimal():
    # Equal TP: a whole page is one READ; a KV block one READ for K and one for V.
    plan = TransferPlan(make_shape(2, 4), 2, 2, 1)
    assert len(plan.ranges("mamba", coalesced=True)) == 1
    assert len(plan.ranges("k", coalesced=True)) == len(plan.ranges("v", coalesced=True)) == 1
    # D_TP > P_TP: the 3-read plus one SSM read from one P page; HND keeps the head slice one READ.
    plan = TransferPlan(make_shape(2, 4, kv_layout="HND"), 1, 2, 1)
    assert [r.part for r in plan.mamba_ranges] == ["conv_x", "conv_B", "conv_C", "ssm"]
    assert len(plan.ranges("k", coalesced=True)) == 1
    # NHD: the same head slice is strided, one READ per token.
    plan = TransferPlan(make_shape(2, 4), 1, 2, 1)
    assert len(plan.ranges("k", coalesced=True)) == plan.shape.block_size


# ---- rejections ----------------------------------------------------------------------------


@pytest.mark.parametrize("p_tp,d_tp", [(3, 2), (2, 3), (4, 6)])
def test_non_dividing_tp_ratio_is_rejected(p_tp, d_tp):
    with pytest.raises(TransferError, match=f"P_TP={p_tp}") as err:
        TransferPlan(make_shape(1, 1), p_tp, d_tp, 0)
    assert f"D_TP={d_tp}" in str(err.value)


def test_bad_rank_and_groups_are_rejected():
    with pytest.raises(ConfigError, match="d_rank=2"):
        TransferPlan(make_shape(2, 2), 1, 2, 2)
    with pytest.raises(ConfigError, match="n_groups=2"):
        TransferPlan(make_shape(2, 2), 4, 1, 0)
    with pytest.raises(TransferError, match="conv_layout='SD'"):
        dataclasses.replace(make_shape(2, 2), conv_layout="SD")


def test_page_size_mismatch_is_rejected():
    plan = TransferPlan(make_shape(2, 2), 2, 1, 0)
    p = plan.p_mamba
    plan.check_remote_mamba(1, 0, conv_bytes=p.conv_bytes, ssm_bytes=p.ssm_bytes, page_stride=p.page_bytes + 64)
    with pytest.raises(TransferError, match="page size mismatch"):
        # P engine built with num_spec=2: two more conv rows per channel.
        other = TransferPlan(make_shape(2, 2, num_spec=2), 2, 1, 0).p_mamba
        plan.check_remote_mamba(1, 0, conv_bytes=other.conv_bytes, ssm_bytes=other.ssm_bytes, page_stride=10**6)
    with pytest.raises(TransferError, match="stride"):
        plan.check_remote_mamba(1, 0, conv_bytes=p.conv_bytes, ssm_bytes=p.ssm_bytes, page_stride=p.page_bytes - 1)
    with pytest.raises(TransferError, match="ssm_bytes=.*expects"):
        plan.check_local_mamba(
            0, conv_bytes=plan.d_mamba.conv_bytes, ssm_bytes=plan.d_mamba.ssm_bytes // 2, page_stride=10**6
        )
    with pytest.raises(TransferError, match="KV block size mismatch"):
        plan.check_remote_kv(0, 1, block_bytes=plan.p_kv.block_bytes * 2, kv_layout="NHD")
    with pytest.raises(TransferError, match="kv_layout='HND'"):
        plan.check_remote_kv(0, 1, block_bytes=plan.p_kv.block_bytes, kv_layout="HND")


def test_coalesce_only_merges_contiguous_runs():
    rs = [
        ByteRange("mamba", "conv_x", 0, 0, 0, 4),
        ByteRange("mamba", "conv_B", 0, 4, 4, 4),
        ByteRange("mamba", "conv_C", 0, 9, 8, 4),
        ByteRange("mamba", "ssm", 1, 13, 12, 4),
    ]
    assert coalesce(rs) == (ByteRange("mamba", "conv_x+conv_B", 0, 0, 0, 8), rs[2], rs[3])


def test_shape_from_hybrid_config_matches_layout_page_size():
    """TransferShape.from_config reads a HybridConfig; page sizes agree with jaxmamba.layout."""
    from jaxmamba.config import HybridConfig
    from jaxmamba.layout import page_size_bytes

    common = dict(
        vocab_size=64,
        hidden_size=32,
        ffn_after_mixer=False,
        rms_norm_eps=1e-5,
        mamba_intermediate_size=48,
        mamba_num_heads=16,
        mamba_head_dim=3,
        mamba_n_groups=2,
        mamba_d_state=5,
        mamba_conv_kernel=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    hybrid = HybridConfig(family="nemotron_h", layer_types=("mamba", "attention", "mlp"), **common)
    shape = TransferShape.from_config(
        hybrid, conv_dtype="bfloat16", ssm_dtype=np.float32, kv_dtype=np.float16, block_size=16, num_spec=2
    )
    assert (shape.num_kv_heads, shape.attn_head_dim, shape.conv_rows) == (2, 8, 5)
    for p_tp, d_tp in [(1, 2), (2, 1)]:
        plan = TransferPlan(shape, p_tp, d_tp, 0)
        for tp, geo in ((p_tp, plan.p_mamba), (d_tp, plan.d_mamba)):
            assert geo.page_bytes == page_size_bytes(
                hybrid, tp, conv_dtype=np.float16, ssm_dtype=np.float32, num_spec=2
            )
    mamba_only = HybridConfig(family="mamba2", layer_types=("mamba", "mamba"), **common)
    assert not TransferShape.from_config(mamba_only, conv_dtype=2, ssm_dtype=4).has_attention
