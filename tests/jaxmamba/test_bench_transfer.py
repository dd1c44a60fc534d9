"""``python -m jaxmamba.bench transfer`` end to end on small settings (real NIXL READs between processes).

Expected bytes come from ``jaxmamba.layout`` (vLLM's page-size and KV-cache-shape mirrors), not from
``TransferPlan``: every D rank reads its whole unpadded Mamba page per Mamba layer, and its K and V
blocks (its own KV heads) per attention layer.
"""

from __future__ import annotations

import json
import math

import pytest

from jaxmamba.bench import transfer as bench
from jaxmamba.config import HybridConfig
from jaxmamba.layout import kv_cache_shape, page_size_bytes
from jaxmamba.random_checkpoint import random_config_dict
from transfer.nixl_bridge import nixl_available

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not importable (install the 'nixl' extra)"),
]

REQUESTS, PROMPT_LEN, BLOCK = 3, 40, 16  # 3 KV blocks per request, the last one partly filled
RATIOS = [(1, 2), (4, 2)]  # a 3-read split and a gather with GQA-replicated KV heads on P


def expected_bytes(cfg: HybridConfig, d_tp: int) -> tuple[int, int]:
    """(Mamba, KV) bytes per request summed over the D_TP decode ranks, float32 caches."""
    mamba = len(cfg.mamba_layer_ids) * d_tp * page_size_bytes(cfg, d_tp, conv_dtype="float32", ssm_dtype="float32")
    _, _, bs, kv_local, hd = kv_cache_shape(1, BLOCK, cfg.num_key_value_heads, cfg.head_dim, d_tp)
    blocks = math.ceil(PROMPT_LEN / BLOCK)
    kv = len(cfg.attention_layer_ids) * d_tp * blocks * 2 * bs * kv_local * hd * 4  # K and V
    return mamba, kv


def test_transfer_bench_rows(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    argv = ["--ratios", ",".join(f"{p}/{d}" for p, d in RATIOS), "--requests", str(REQUESTS),
            "--prompt-len", str(PROMPT_LEN), "--block-size", str(BLOCK), "--repeats", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "nixl 1.5" in text and "command: python -m jaxmamba.bench transfer --ratios 1/2,4/2" in text

    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["p_tp"], r["d_tp"]) for r in rows] == RATIOS
    cfg = HybridConfig.from_hf(random_config_dict("nemotron_h", "small"))
    table = [line for line in text.splitlines() if line.strip().startswith(("1/2 ", "4/2 "))]
    assert len(table) == len(RATIOS), text
    for row, line in zip(rows, table):
        mamba, kv = expected_bytes(cfg, row["d_tp"])
        assert kv > 0 and mamba > 0
        assert (row["mamba_bytes_per_request"], row["kv_bytes_per_request"]) == (mamba, kv)
        assert row["bytes_per_request"] == row["measured_bytes_per_request"] == mamba + kv
        assert f"{mamba + kv:,d}" in line and line.rstrip().endswith("yes")
        assert row["verified"] is True and row["problems"] == []
        assert row["descriptors_per_request"] >= len(cfg.mamba_layer_ids) * row["d_tp"]
        assert row["gb_per_s"] > 0 and row["wall_s"] > 0
        assert len(row["pass_wall_s"]) == 2
    # 4/2: each D rank gathers from two P ranks; 1/2: one source each.
    assert [r["sources_per_d_rank"] for r in rows] == [1, 2]


@pytest.mark.slow
def test_transfer_bench_engine_flow(tmp_path, capsys):
    """``--engine``: prefill and decode LLMs in two processes; bytes per request as jaxmamba.layout says
    for N-1 = 39 prefilled tokens (5 KV blocks of 8), every request imported and verified."""
    out = tmp_path / "engine.json"
    argv = ["--engine", "--size", "tiny", "--ratios", "1/2,2/1", "--requests", "2", "--prompt-len", "40",
            "--block-size", "8", "--max-num-batched-tokens", "32", "--json", str(out)]
    assert bench.main(argv) == 0
    assert "transfer benchmark, engine flow" in capsys.readouterr().out
    cfg = HybridConfig.from_hf(random_config_dict("nemotron_h", "tiny"))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["p_tp"], r["d_tp"]) for r in rows] == [(1, 2), (2, 1)]
    for row in rows:
        d_tp = row["d_tp"]
        mamba = len(cfg.mamba_layer_ids) * d_tp * page_size_bytes(cfg, d_tp, conv_dtype="float32", ssm_dtype="float32")
        _, _, bs, kv_local, hd = kv_cache_shape(1, 8, cfg.num_key_value_heads, cfg.head_dim, d_tp)
        kv = len(cfg.attention_layer_ids) * d_tp * 5 * 2 * bs * kv_local * hd * 4
        assert row["verified"] is True and row["problems"] == [], row
        assert row["imported"] == row["requests"] == 2
        assert row["bytes_per_request"] == mamba + kv
        assert row["gb_per_s"] > 0 and row["read_ms_per_request"] > 0
