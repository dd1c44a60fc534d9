"""``python -m jaxmamba.bench kernels`` runs end to end (interpret mode on CPU, tiny shapes)."""

from __future__ import annotations

import json

import jax
import pytest

from jaxmamba.bench.__main__ import main as bench_main
from jaxmamba.bench.__main__ import subcommands


def test_dispatcher_lists_and_rejects(capsys):
    assert "kernels" in subcommands()
    assert bench_main([]) == 2
    assert bench_main(["no-such-benchmark"]) == 2
    assert "kernels" in capsys.readouterr().err


def test_kernels_subcommand_prints_and_records_every_metric(capsys, tmp_path):
    out_json = tmp_path / "kernels.json"
    rc = bench_main(["kernels", "--only", "causal_conv1d_update", "--iters", "1", "--warmup", "0",
                     "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    if jax.default_backend() == "cpu":
        assert "NOT meaningful for performance" in text
    lines = [line for line in text.splitlines() if line.startswith("causal_conv1d_update")]
    assert len(lines) == 2 and all("ERROR" not in line for line in lines)
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == 2
    for r in rows:
        assert r["pallas_us"] > 0 and r["reference_us"] > 0 and r["copy_GBps"] > 0
        assert r["speedup_vs_reference"] == pytest.approx(r["reference_us"] / r["pallas_us"])
        assert r["roofline_fraction"] == pytest.approx(r["achieved_GBps"] / r["copy_GBps"])


def test_tune_times_every_launch_of_the_grid_and_names_the_best(capsys, tmp_path):
    out_json = tmp_path / "tune.json"
    rc = bench_main(["kernels", "--only", "selective_state_update", "--iters", "1", "--warmup", "0", "--tune",
                     "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = json.loads(out_json.read_text())["rows"]
    tuned = [r for r in rows if "launches" in r]
    assert len(tuned) == 1, "the quick shapes tune one state-update case"
    launches = tuned[0]["launches"]
    assert [(r["block_p"], r["num_warps"]) for r in launches] == [(8, 1), (16, 4)]
    assert all(r["us"] > 0 and 0 < r["roofline_fraction"] for r in launches)
    best = min(launches, key=lambda r: r["us"])
    best_line = next(line for line in text.splitlines() if line.strip().startswith("best"))
    assert f"block_p={best['block_p']} num_warps={best['num_warps']}" in best_line
    assert text.count("  launch ") == 2
