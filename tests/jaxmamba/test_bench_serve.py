"""``python -m jaxmamba.bench serve``: the feature workloads run, agree with the plain engine, and report."""

from __future__ import annotations

import json
import re

import pytest

from jaxmamba.bench import serve

SMALL = ["--num-requests", "6", "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--min-output", "2",
         "--max-output", "4"]


@pytest.mark.slow  # two engines for a benchmark's plumbing; prefix-caching correctness is tested elsewhere
def test_prefix_workload_hits_and_agrees(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    assert serve.main(["--workload", "prefix", "--num-prefixes", "2", "--prefix-len", "40", "--min-prompt", "2",
                       "--max-prompt", "8", "--max-model-len", "64", *SMALL, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["identical_fraction"] == 1.0
    # Waves of 2 over 2 prefixes: from the second wave on, every request finds its 32-token prefix cached.
    assert r["with"]["prefix_hit_tokens"] >= 32 * 4
    assert r["without"]["prefix_hit_tokens"] == 0
    assert "hit rate" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_spec_workload_agrees(tmp_path, method):
    out = tmp_path / "spec.json"
    # Long enough outputs that the model's own tokens start repeating (ngram drafts need a match).
    assert serve.main(["--workload", "spec", "--spec-method", method, "--num-spec", "2", "--min-prompt", "8",
                       "--max-prompt", "16", "--max-model-len", "64", *SMALL, "--min-output", "24", "--max-output",
                       "32", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["identical_fraction"] == 1.0 and r["with"]["draft_tokens"] > 0


def test_profile_host_reports_the_median_of_its_serving_passes(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert serve.main(["--profile-host", "--profile-batches", "2", "--host-passes", "3", "--num-requests", "4",
                       "--min-prompt", "2", "--max-prompt", "8", "--min-output", "2", "--max-output", "4",
                       "--max-num-batched-tokens", "16", "--max-model-len", "64", "--no-reference", "--json",
                       str(out)]) == 0
    run = json.loads(out.read_text())["profile_host"]["2"]
    figures = [p["host_us_per_output_token"] for p in run["host_profile_passes"]]
    assert len(figures) == 3 and all(f > 0 for f in figures)
    assert run["host_profile"]["host_us_per_output_token"] == sorted(figures)[1]
    assert run["host_profile"]["steps"] == run["steps"], "each pass serves the same workload"
    assert "the median of 3 serving passes" in capsys.readouterr().out


def test_profile_host_refuses_fewer_than_one_pass(capsys):
    with pytest.raises(SystemExit):
        serve.main(["--profile-host", "--host-passes", "0", "--no-reference"])
    assert "--host-passes must be at least 1" in capsys.readouterr().err


def test_profile_host_reports_every_phase_per_batch_size(tmp_path, capsys):
    from jaxmamba.host_profile import HOST_PHASES, PHASES

    out = tmp_path / "profile.json"
    assert serve.main(["--profile-host", "--profile-batches", "2,4", "--num-requests", "6", "--min-prompt", "2",
                       "--max-prompt", "8", "--min-output", "2", "--max-output", "4", "--max-num-batched-tokens",
                       "16", "--max-model-len", "64", "--no-reference", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["profile_host"]
    assert set(runs) == {"2", "4"}
    for rows, run in runs.items():
        prof = run["host_profile"]
        assert prof["steps"] == run["steps"] > 0
        assert 0 < prof["mean_batch_rows"] <= int(rows)
        assert all(prof[f"{p}_ms_per_step"] >= 0 for p in PHASES) and prof["schedule_ms_per_step"] > 0
        assert 0.0 <= prof["hidden_share"] <= 1.0
        assert prof["host_ms_per_step"] < 1e3 * run["wall_s"] / run["steps"] + 1e-6  # host time is part of wall
        assert prof["host_us_per_output_token"] == pytest.approx(1e3 * prof["host_ms_per_step"] * prof["steps"]
                                                                 / run["generated_tokens"])
        # The engine thread's CPU time per phase: positive where work ran, never above the phase's wall time.
        # ``other`` is the step less its phases, and each phase's wall interval encloses its CPU interval and
        # part of its own clock reads (CPU time, ~1 us each on a quiet host, several where two test workers share
        # two cores: a 46 us excess a step was seen there): other's CPU may exceed its wall by that much per phase
        # entered (about ten a step), where the engine thread seldom waits outside the phases. The bound still
        # catches another thread's CPU counted as the engine's (the dispatch thread's is ~1 ms a step here).
        assert prof["metadata_cpu_ms_per_step"] > 0 and prof["host_cpu_us_per_output_token"] > 0
        for p in HOST_PHASES:
            assert prof[f"{p}_cpu_ms_per_step"] <= prof[f"{p}_ms_per_step"] + (0.1 if p == "other" else 1e-3), p
        # The phases cover the step: what the engine thread spends outside all of them (``other``) is a small
        # part of its CPU, so the per-token figure is the step's whole host work.
        host_cpu_ms = sum(prof[f"{p}_cpu_ms_per_step"] for p in HOST_PHASES)
        assert 0 < prof["other_cpu_ms_per_step"] < host_cpu_ms / 3, prof
        assert prof["dispatch_thread_cpu_ms_per_step"] > 0  # async scheduling (the default) has a dispatch thread
        # The same workload's host path alone (stand-in steps, enqueued inline, no device watched): the same
        # steps and tokens through the same rows, every host phase counted, no dispatch thread.
        alone = run["host_path_alone"]
        assert alone["mean_batch_rows"] == pytest.approx(prof["mean_batch_rows"], rel=0.25)
        assert alone["host_cpu_us_per_output_token"] > 0 and alone["metadata_cpu_ms_per_step"] > 0
        assert alone["dispatch_thread_cpu_ms_per_step"] == 0 and alone["device_ms_per_step"] is None
    text = capsys.readouterr().out
    assert "host ms per step by phase" in text and "CPU ms per step by phase" in text
    assert "alone us/tok" in text and len(re.findall(r"^ +\d+ alone ", text, re.M)) == 2  # a phase row per batch
