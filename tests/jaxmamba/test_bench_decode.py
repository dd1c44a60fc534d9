"""``python -m jaxmamba.bench decode``: both sides run the same greedy batch and the report adds up."""

from __future__ import annotations

import json

import pytest

from jaxmamba.bench import decode


def test_decode_bench_reports_both_sides_and_the_step_alone(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "decode.json"
    assert decode.main(["--batch", "2", "--prompt-len", "5", "--new-tokens", "4", "--repeats", "1",
                        "--profile-step", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    ours, ref = r["jaxmamba"], r["transformers"]
    assert ours["compiles_while_serving"] == 0
    assert [len(t) for t in ours["tokens"]] == [4, 4] and ours["tokens"] == ref["tokens"]  # tiny: no dt drift
    assert set(ours["step_alone_ms"]) == {"greedy", "full"}
    assert r["decode_ratio"] == pytest.approx(ours["decode_tok_per_s"] / ref["decode_tok_per_s"])
    text = capsys.readouterr().out
    assert "load average" in text and "decode tok/s" in text


def test_new_tokens_must_leave_a_decode_step():
    with pytest.raises(SystemExit):
        decode.main(["--new-tokens", "1"])


def test_decode_bench_with_windows_times_one_step_alone(tmp_path, capsys):
    """``--num-scheduler-steps``: the engine decodes in windows (same tokens), and ``--profile-step`` still
    times one decode step's program (a window's takes other inputs)."""
    out = tmp_path / "decode.json"
    assert decode.main(["--batch", "2", "--prompt-len", "5", "--new-tokens", "6", "--repeats", "1", "--no-reference",
                        "--num-scheduler-steps", "4", "--profile-step", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["args"]["num_scheduler_steps"] == 4 and r["jaxmamba"]["compiles_while_serving"] == 0
    assert [len(t) for t in r["jaxmamba"]["tokens"]] == [6, 6]
    assert set(r["jaxmamba"]["step_alone_ms"]) == {"greedy", "full"}
    assert "num_scheduler_steps=4" in capsys.readouterr().out
