"""``python -m jaxmamba.bench host-inputs``: times the host inputs of every step of a small run, dumps
them, and the dumps of two runs compare equal (the A/B check for host-path changes)."""

from __future__ import annotations

import pickle

from jaxmamba.bench import host_inputs
from jaxmamba.bench.__main__ import main as bench_main
from jaxmamba.bench.__main__ import subcommands


def test_host_inputs_times_dumps_and_compares(tmp_path, capsys, monkeypatch):
    assert "host-inputs" in subcommands()
    # Four short requests, two of them mid-prompt when the others decode: decode and mixed steps.
    monkeypatch.setitem(host_inputs.SCENARIOS, "smoke",
                        (dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=97), 4, (6, 20), (3, 3)))
    first, second = tmp_path / "a.pkl", tmp_path / "b.pkl"
    for dump in (first, second):
        assert bench_main(["host-inputs", "--scenarios", "smoke", "--repeats", "2", "--dump", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "median us" in out and "smoke      decode" in out and "smoke      mixed" in out
    steps = pickle.loads(first.read_bytes())
    assert len(steps) > 3 and any(len(step[5]) for step in steps), "the steps' block-table writes are dumped"
    assert any(len(step[6]) for step in steps), "the steps' state-table writes are dumped"
    assert bench_main(["host-inputs", "--compare", str(first), str(second)]) == 0
    assert f"{len(steps)} steps identical" in capsys.readouterr().out
    # A changed value in one step is found.
    name, bucket, order, int_buf, float_buf, written, state_written, num_decodes = steps[-1]
    int_buf = int_buf.copy()
    int_buf[0] += 1
    second.write_bytes(pickle.dumps(steps[:-1] + [(name, bucket, order, int_buf, float_buf, written, state_written,
                                                   num_decodes)]))
    assert bench_main(["host-inputs", "--compare", str(first), str(second)]) == 1
    assert f"step {len(steps) - 1} (smoke) differs in output field 3" in capsys.readouterr().out
