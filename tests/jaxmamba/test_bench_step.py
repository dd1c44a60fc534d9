"""``python -m jaxmamba.bench step``: one bucket's step under the profiler, its kernels in a table; and the
trace reading on synthetic planes (device streams vs host thunks, nested thunks, no kernel events)."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest

from jaxmamba.bench import step
from jaxmamba.bench._kernel_trace import kernel_table


def _event(name, start, duration, **stats):
    return NS(name=name, start_ns=start, duration_ns=duration, stats=list(stats.items()))


def _profile(*planes):
    return NS(planes=[NS(name=name, lines=[NS(name=ln, events=evs) for ln, evs in lines]) for name, lines in planes])


def test_a_loop_thunk_does_not_count_its_body_twice():
    """On the CPU a while loop's thunk spans its body's thunks on the same thread: only the innermost count."""
    prof = _profile(("/host:CPU", [("worker", [
        _event("while.1", 0, 100, hlo_op="while.1", hlo_module="jit_step"),
        _event("dot.2", 10, 30, hlo_op="dot.2", hlo_module="jit_step"),
        _event("dot.2", 50, 30, hlo_op="dot.2", hlo_module="jit_step"),
        _event("end: dot.2", 80, 0, hlo_op="dot.2", hlo_module="jit_step"),
        _event("fusion.3", 200, 20, hlo_op="fusion.3", hlo_module="jit_other"),
    ])]))
    table = kernel_table(prof, "jit_step", steps=2, step_ms=0.1, flops={"dot.2": 4000})
    assert [(r.name, r.launches, r.time_us) for r in table.rows] == [("dot.2", 1, 0.03)]
    assert table.rows[0].flops_per_s == pytest.approx(4000 / 0.03e-6)
    assert table.rows[0].share == pytest.approx(0.03 / 100)


def test_device_streams_win_over_host_events_and_derived_lines_are_skipped():
    prof = _profile(
        ("/device:GPU:0", [("Stream #13(compute)", [_event("gemm_kernel", 0, 500, hlo_op="fusion.7",
                                                            hlo_module="jit_step(2)")]),
                           ("XLA Ops", [_event("fusion.7", 0, 500, hlo_op="fusion.7", hlo_module="jit_step(2)")])]),
        ("/host:CPU", [("python", [_event("thunk", 0, 9000, hlo_op="fusion.7", hlo_module="jit_step")])]))
    table = kernel_table(prof, "jit_step", steps=1, step_ms=1.0)
    assert [(r.name, r.time_us) for r in table.rows] == [("fusion.7", 0.5)] and table.planes == ["/device:GPU:0"]


def test_a_trace_without_kernel_events_says_so():
    prof = _profile(("/host:CPU", [("python", [_event("PjitFunction(step)", 0, 100)])]))
    table = kernel_table(prof, "jit_step", steps=1, step_ms=1.0)
    assert not table.events_found and table.rows == []
    assert "no kernel events in the trace" in table.format()


def test_profiles_a_mixed_bucket_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert step.main(["--batch", "2", "--prompt-len", "8", "--repeats", "1", "--steps", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["backend"] == "cpu" and not r["bucket"]["decode_only"] and r["bucket"]["num_tokens"] >= 16
    assert r["events_found"], r.get("note")  # XLA's CPU thunks are host events with an hlo_op stat
    rows = r["rows"]
    assert rows and all(row["launches"] >= 1 and row["time_us"] > 0 for row in rows)
    assert 0 < sum(row["share"] for row in rows) < 3  # CPU thunks may overlap on the client's threads
    with_flops = [row for row in rows if row["flops"]]
    assert with_flops and sum(row["flops"] for row in with_flops) <= r["program_flops"]
    assert r["batch_flops"] > 0 and r["program_flops"] >= r["batch_flops"]
    assert "us/step" in capsys.readouterr().out


@pytest.mark.slow
def test_profiles_a_decode_bucket_on_the_cpu(tmp_path):
    decode_out = tmp_path / "decode.json"
    assert step.main(["--batch", "2", "--prompt-len", "8", "--decode", "--repeats", "1", "--steps", "1",
                      "--json", str(decode_out)]) == 0
    d = json.loads(decode_out.read_text())
    assert d["bucket"]["decode_only"] and d["rows"]


def test_counts_must_be_positive():
    with pytest.raises(SystemExit):
        step.main(["--steps", "0"])
