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
