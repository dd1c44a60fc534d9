"""ConvSplit offsets, read targets and head offsets compared with vLLM 0.33's own code.

One oracle run (vLLM's import costs ~9 s) evaluates every case in vLLM's venv:
``derive_mamba_conv_split`` from a real ``MambaSpec`` (shapes from vLLM's
``MambaStateShapeCalculator``), ``MambaConvSplitInfo.local/remote_conv_offsets``, the real
``NixlBaseConnectorWorker._build_mamba_remote`` (called unbound on a minimal stand-in ``self``, so
the SSM read address and size are vLLM's, not a re-derivation), ``TransferTopology`` and
``compute_tp_mapping`` / ``compute_head_offset``.
"""

from __future__ import annotations

import json

import pytest

from jaxmamba.errors import TransferError
from transfer.conv_split import CONV_PARTS, ConvSplit
from transfer.hetero_tp import TransferPlan, TransferShape, physical_head_range

pytestmark = pytest.mark.vllm

RATIOS = [(1, 2), (1, 4), (2, 4), (2, 1), (4, 2), (4, 1), (1, 1), (2, 8), (8, 2)]


def _cases():
    out = []
    for p_tp, d_tp in RATIOS:
        for g in (1, 2, 4, 8):
            if not all(g % tp == 0 or g == 1 for tp in (p_tp, d_tp)):
                continue
            for kv in (1, 2, 4, 8):
                for num_spec, cds in ((0, 2), (2, 4)):
                    for d_rank in range(d_tp):
                        out.append(dict(p_tp=p_tp, d_tp=d_tp, d_rank=d_rank, G=g, K=kv, spec=num_spec, cds=cds))
    return out


CASES = _cases()
DIMS = dict(I=48, H=16, P=3, N=5, kernel=4, sds=4)

ORACLE = r"""
import json, types, torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc
from vllm.v1.kv_cache_interface import MambaSpec, FullAttentionSpec
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split
from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology, EngineTransferInfo
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping, compute_head_offset
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

DIMS = json.loads('__DIMS__'); CASES = json.loads('__CASES__')
DT = {2: torch.float16, 4: torch.float32}

def split(tp, c):
    conv, ssm = Calc.mamba2_state_shape(tp, DIMS['I'], c['G'], DIMS['H'], DIMS['P'], DIMS['N'], DIMS['kernel'],
                                        c['spec'])
    spec = MambaSpec(block_size=16, shapes=(conv, ssm), dtypes=(DT[c['cds']], DT[DIMS['sds']]),
                     mamba_type=MambaAttentionBackendEnum.MAMBA2)
    return derive_mamba_conv_split(spec, tp)

out = []
for c in CASES:
    d, p = split(c['d_tp'], c), split(c['p_tp'], c)
    topo = TransferTopology(tp_rank=c['d_rank'], tp_size=c['d_tp'], block_size=16, engine_id='D', is_mla=False,
                            is_mamba=True, total_num_kv_heads=c['K'], attn_backends=[])
    ratio = topo.tp_ratio(c['p_tp'])
    lro = c['d_rank'] % max(ratio, 1)
    # vLLM's real remote-descriptor builder, on a stand-in self with what it reads.
    me = types.SimpleNamespace(_conv_decomp=d, tp_rank=c['d_rank'], _mamba_ssm_size=d.ssm_sizes,
                               _ssm_region_indices=[], _ple_region_index=None,
                               _pack_strided_descs=NixlBaseConnectorWorker._pack_strided_descs)
    meta = types.SimpleNamespace(kv_caches_base_addr=[0], ssm_sizes=p.ssm_sizes, num_blocks=4, device_id=0,
                                 block_strides=[100000])
    info = EngineTransferInfo(remote_tp_size=c['p_tp'], remote_block_len=1, remote_block_size=16,
                              remote_physical_blocks_per_logical=1)
    descs = NixlBaseConnectorWorker._build_mamba_remote(me, meta, ratio, info)
    m = compute_tp_mapping(topo, c['p_tp'], (FullAttentionSpec, MambaSpec))
    out.append(dict(
        ratio=ratio, local=d.local_conv_offsets, remote=d.remote_conv_offsets(lro, ratio),
        desc=[[int(x) for x in row[:2]] for row in descs],
        proj=list(d.local_proj_dims), rows=d.conv_rows, dsize=d.conv_dtype_size, ssm_sizes=list(d.ssm_sizes),
        p_ssm_sizes=list(p.ssm_sizes),
        fa=list(m.source_ranks_per_group[0]), ssm_ranks=list(m.source_ranks_per_group[1]),
        head_offset=compute_head_offset(c['d_rank'], c['d_tp'], c['p_tp'], c['K']),
        local_heads=topo.local_physical_heads,
    ))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_results(vllm_oracle):
    code = ORACLE.replace("__DIMS__", json.dumps(DIMS)).replace("__CASES__", json.dumps(CASES))
    res = vllm_oracle(code)
    assert len(res) == len(CASES)
    return res


def _plan(c) -> TransferPlan:
    shape = TransferShape(
        intermediate_size=DIMS["I"],
        n_groups=c["G"],
        d_state=DIMS["N"],
        num_heads=DIMS["H"],
        head_dim=DIMS["P"],
        conv_kernel=DIMS["kernel"],
        num_spec=c["spec"],
        conv_dtype_size=c["cds"],
        ssm_dtype_size=DIMS["sds"],
        num_kv_heads=c["K"],
        attn_head_dim=4,
        block_size=16,
        kv_layout="HND",
    )
    return TransferPlan(shape, c["p_tp"], c["d_tp"], c["d_rank"])


def test_conv_split_matches_vllm(vllm_results):
    for c, v in zip(CASES, vllm_results):
        plan = _plan(c)
        cs = plan.d_mamba.conv
        # Same decomposition as vLLM derives from its own MambaSpec ...
        assert (cs.conv_rows, cs.dtype_size, [cs.x_local, cs.b_local, cs.b_local]) == (
            v["rows"],
            v["dsize"],
            v["proj"],
        ), c
        assert [cs.conv_bytes, plan.d_mamba.ssm_bytes] == v["ssm_sizes"], c
        assert [plan.p_mamba.conv_bytes, plan.p_mamba.ssm_bytes] == v["p_ssm_sizes"], c
        # ... and the same offsets from ConvSplit (vLLM's formula, signed ratio included).
        assert plan.tp_ratio == v["ratio"], c
        lro = c["d_rank"] % max(plan.tp_ratio, 1)
        assert [list(o) for o in cs.local_offsets()] == v["local"], c
        if plan.tp_ratio >= 1 or cs.b_bytes % -plan.tp_ratio == 0:
            assert [list(o) for o in cs.remote_offsets(lro, plan.tp_ratio)] == v["remote"], c
        else:
            # Replicated n_groups=1 whose B section does not split |tp_ratio| ways: vLLM floors
            # (a truncated read), ConvSplit refuses; the plan never asks (it reads B/C whole).
            with pytest.raises(TransferError, match="does not split"):
                cs.remote_offsets(lro, plan.tp_ratio)
            assert [list(o) for o in cs.remote_offsets(lro, plan.tp_ratio, ("conv_x",))] == v["remote"][:1], c
            assert v["remote"][1][1] * -plan.tp_ratio != cs.b_bytes, c


def test_plan_reads_match_vllm_where_groups_shard(vllm_results):
    """x, B, C and SSM reads equal vLLM's real descriptors for the first source; where
    n_groups=1 is replicated under hetero TP the plan deliberately differs (B/C read whole)."""
    diverged = 0
    for c, v in zip(CASES, vllm_results):
        plan = _plan(c)
        first = plan.mamba_read_targets[0]
        mine = {r.part: [r.src_offset, r.length] for r in plan.mamba_ranges if r.src_rank == first}
        vllm = dict(zip(CONV_PARTS + ("ssm",), v["desc"]))
        assert mine["conv_x"] == vllm["conv_x"] and mine["ssm"] == vllm["ssm"], c
        if plan.groups_sharded or plan.tp_ratio == 1:
            assert mine["conv_B"] == vllm["conv_B"] and mine["conv_C"] == vllm["conv_C"], c
        else:
            # vLLM 0.33 scales the replicated group like x: the reads differ from the
            # (checker-verified) plan -- see test_vllm_formula_alone_breaks_replicated_groups.
            assert (mine["conv_B"], mine["conv_C"]) != (vllm["conv_B"], vllm["conv_C"]), c
            diverged += 1
    assert diverged > 0


def test_topology_matches_vllm(vllm_results):
    for c, v in zip(CASES, vllm_results):
        plan = _plan(c)
        assert list(plan.mamba_read_targets) == v["ssm_ranks"], c
        assert list(plan.fa_read_targets) == v["fa"], c
        d_heads = physical_head_range(c["d_tp"], c["K"], c["d_rank"])
        assert len(d_heads) == v["local_heads"], c
        if plan.tp_ratio >= 1:
            # vLLM's rank_offset_factor: where this D rank's heads start inside the P block,
            # in units of D blocks (HND: one D block = this rank's heads).
            p_heads = physical_head_range(c["p_tp"], c["K"], plan.fa_read_targets[0])
            assert d_heads.start - p_heads.start == v["head_offset"] * len(d_heads), c
            k = plan.ranges("k", coalesced=True)
            assert len(k) == 1 and k[0].src_offset == v["head_offset"] * plan.d_kv.block_bytes, c


def test_vllm_uses_conv_split_signature_we_mirror(vllm_results):
    # A tiny hand example through the same oracle results: the D_TP=2, P_TP=1 rank-1 case.
    c = next(
        i for i, c in enumerate(CASES) if (c["p_tp"], c["d_tp"], c["d_rank"], c["G"], c["spec"]) == (1, 2, 1, 2, 0)
    )
    v = vllm_results[c]
    cs = ConvSplit(v["rows"], v["proj"][0], v["proj"][1], v["dsize"])
    xb, bb = cs.x_bytes, cs.b_bytes
    assert v["remote"] == [[xb, xb], [2 * xb + bb, bb], [2 * xb + 3 * bb, bb]]
