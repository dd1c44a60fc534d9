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


def test_roofline_reports_each_batch_against_the_ideal_bytes(tmp_path, capsys):
    """``--roofline --config``: random weights of a config's shape; per batch the ideal bytes of a decode
    step, the roofline at the copy bandwidth measured in the run, and the step alone and the engine as
    shares of it, beside the host profile."""
    import jaxmamba
    from jaxmamba.config import HybridConfig
    from jaxmamba.host_profile import PHASES
    from jaxmamba.roofline import ideal_decode_bytes

    config = jaxmamba.random_model("nemotron_h", size="tiny", path=tmp_path / "ckpt") / "config.json"
    out = tmp_path / "roofline.json"
    # (Steps enqueued on the engine thread, as a GPU's default: the host profile has no dispatch thread.)
    assert decode.main(["--roofline", "--config", str(config), "--batch", "1,2", "--prompt-len", "4",
                        "--new-tokens", "3", "--repeats", "1", "--copy-mib", "8", "--async-dispatch", "inline",
                        "--json", str(out)]) == 0
    r = json.loads(out.read_text())["roofline"]
    bandwidth = r["copy_bandwidth_bytes_per_s"]
    assert bandwidth > 0 and [row["batch"] for row in r["rows"]] == [1, 2]
    cfg = HybridConfig.from_hf(config)
    for row in r["rows"]:
        ideal = ideal_decode_bytes(cfg, row["batch"], 4 + 3 // 2, "float32")
        assert row["ideal_bytes"] == ideal.total and row["mean_context"] == 5
        assert row["roofline_ms"] == pytest.approx(1e3 * ideal.total / bandwidth)
        assert set(row["step_alone_ms"]) == {"greedy", "full"}
        for tail, ms in row["step_alone_ms"].items():
            assert row["step_alone_share"][tail] == pytest.approx(row["roofline_ms"] / ms)
        assert row["engine_share"] == pytest.approx(row["roofline_ms"] / row["engine_ms"])
        assert {f"{p}_ms_per_step" for p in PHASES} <= set(row["host_profile"])
        assert row["async_dispatch"] == "inline" and row["host_profile"]["dispatch_thread_cpu_ms_per_step"] == 0
    text = capsys.readouterr().out
    assert "copy bandwidth" in text and "roofline ms" in text and "random weights" in text


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--batch", "2,x"], ["--batch", "2,4"],
                                  ["--config", "config.json"]])
def test_batch_lists_and_configs_need_the_roofline(argv):
    with pytest.raises(SystemExit):
        decode.main(argv)


def test_the_benches_async_dispatch_choices_are_the_engines():
    """``bench decode`` and ``bench host-path`` spell the modes out (their ``--help`` does not import jax)."""
    from jaxmamba.bench.decode import ASYNC_DISPATCH_CHOICES
    from jaxmamba.steps import ASYNC_DISPATCH_MODES

    assert ASYNC_DISPATCH_CHOICES == ASYNC_DISPATCH_MODES
