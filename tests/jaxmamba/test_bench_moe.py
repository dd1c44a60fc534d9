"""``python -m jaxmamba.bench moe``: runs, agrees with the dense loop, and reports."""

from __future__ import annotations

import json

from jaxmamba.bench import moe


def test_moe_bench_runs_and_agrees(tmp_path, capsys, monkeypatch):
    # A narrow layer of the real structure keeps the test to a few seconds.
    monkeypatch.setitem(moe.PRESETS, "nemotron", ("nemotron_h_moe", 64, 16, 4, 2, 1, 32, 48))
    out = tmp_path / "moe.json"
    assert moe.main(["--tokens", "4", "24", "--repeats", "1", "--ragged-dot", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [row["tokens"] for row in r["rows"]] == [4, 24]
    assert r["experts"] == 16 and r["top_k"] == 4 and r["method"] == "tiled"
    for row in r["rows"]:
        assert row["rel_diff"] < 1e-5 and row["grouped_ms"] > 0 and row["dense_loop_ms"] > 0
        assert row["ragged_dot_ms"] > 0
    assert "dense loop ms" in capsys.readouterr().out
