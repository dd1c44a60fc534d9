"""``python -m jaxmamba.bench host-path``: the engine's whole host path by phase, the compiled steps stubbed out."""

from __future__ import annotations

import json

import pytest

from jaxmamba.bench.__main__ import main as bench_main
from jaxmamba.bench.__main__ import subcommands
from jaxmamba.host_profile import HOST_PHASES


@pytest.mark.parametrize("scheduling", ["--async-scheduling", "--no-async-scheduling"])
def test_host_path_reports_every_phase_of_the_best_pass(tmp_path, capsys, scheduling):
    assert "host-path" in subcommands()
    out = tmp_path / "host_path.json"
    assert bench_main(["host-path", "--profile-batches", "4", "--num-requests", "8", "--passes", "2",
                       "--max-num-batched-tokens", "32", scheduling, "--json", str(out)]) == 0
    run = json.loads(out.read_text())["host_path"]["4"]
    passes = run["passes_us_per_output_token"]
    assert len(passes) == 2 and run["host_cpu_us_per_output_token"] == min(passes)
    assert 0 < run["mean_batch_rows"] <= 4 and run["steps"] > 0
    # The host path's phases, ``other`` among them (a small part: the phases cover the step); the stand-in's
    # sampling is ``wait``, device time, outside the host's figure.
    phases_ms = sum(run[f"{p}_cpu_ms_per_step"] for p in HOST_PHASES)
    assert 0 <= run["other_cpu_ms_per_step"] < phases_ms / 2
    assert run["metadata_cpu_ms_per_step"] > 0 and run["schedule_cpu_ms_per_step"] > 0
    assert run["wait_ms_per_step"] > 0
    assert (run["dispatch_thread_cpu_ms_per_step"] > 0) == (scheduling == "--async-scheduling")
    # No device time is watched (the stand-in has no device; a watcher thread would disturb the engine thread).
    assert run["device_ms_per_step"] is None and run["hidden_share"] is None
    text = capsys.readouterr().out
    assert "compiled steps stubbed out" in text and "other" in text


def test_count_bytecodes_reports_the_same_python_bytecodes_a_step_on_every_run(tmp_path, capsys):
    """--count-bytecodes: the engine thread's Python bytecodes per step and the functions that run most of them, the
    same figure to a fraction of a percent on every run of the same workload (timings spread with the machine's
    load; this does not: only a collection that runs a finalizer mid-step moves it)."""
    figures = []
    for i in range(2):
        out = tmp_path / f"bytecodes{i}.json"
        assert bench_main(["host-path", "--profile-batches", "4", "--num-requests", "8", "--passes", "1",
                           "--max-num-batched-tokens", "32", "--count-bytecodes", "5", "--json", str(out)]) == 0
        figures.append(json.loads(out.read_text())["host_path"]["4"])
    first, second = figures
    assert first["bytecodes_per_step"] > 100
    # Two processes' runs of bench serve's 768-request workload agreed to 0.004% (BENCHMARKS.md, "Session 19");
    # a few steps in one process carry more of its one-time work (first calls, caches filled).
    assert first["bytecodes_per_step"] == pytest.approx(second["bytecodes_per_step"], rel=0.03)
    top = first["top_functions"]
    assert len(top) == 5 and [n for _, n in top] == sorted((n for _, n in top), reverse=True)
    assert any(name.endswith("Scheduler.schedule") for name, _ in top)
    assert sum(n for _, n in top) <= first["bytecodes_per_step"]
    assert "Python bytecodes a step on the engine thread" in capsys.readouterr().out


def test_time_functions_times_named_functions_inside_the_engine_and_puts_them_back(tmp_path, capsys):
    """--time-functions: inclusive wall time of named functions where the engine calls them (a method, a
    classmethod, and a function under the name its caller looks up), per call and per step; the originals are
    back afterwards."""
    from jaxmamba.engine import runner, step_rows

    names = ["jaxmamba.engine.runner:ModelRunner._inputs", "jaxmamba.engine.step_rows:StepRows.of",
             "jaxmamba.engine.runner:token_inputs"]
    originals = (runner.ModelRunner._inputs, vars(step_rows.StepRows)["of"], runner.token_inputs)
    out = tmp_path / "timed.json"
    assert bench_main(["host-path", "--profile-batches", "4", "--num-requests", "8", "--passes", "2",
                       "--max-num-batched-tokens", "32", "--time-functions", ",".join(names),
                       "--json", str(out)]) == 0
    timed = json.loads(out.read_text())["host_path"]["4"]["timed_functions"]
    assert list(timed) == names
    for name in names:  # each runs once a step (steps with no row to run make it a little under one)
        assert 0.5 < timed[name]["calls_per_step"] <= 1.0 and timed[name]["us_per_call"] > 0
    inputs, of = timed[names[0]], timed[names[1]]
    assert of["us_per_step"] < inputs["us_per_step"], "inclusive: _inputs calls StepRows.of"
    assert (runner.ModelRunner._inputs, vars(step_rows.StepRows)["of"], runner.token_inputs) == originals
    assert "us a call  jaxmamba.engine.runner:token_inputs" in capsys.readouterr().out
    for bad, why in (("jaxmamba.engine.runner:NoSuchThing", "has no function 'NoSuchThing'"),
                     ("jaxmamba.engine.no_such_module:f", "no module 'jaxmamba.engine.no_such_module'"),
                     ("token_inputs", "is not MODULE:NAME")):
        with pytest.raises(SystemExit):
            bench_main(["host-path", "--profile-batches", "4", "--time-functions", bad])
        assert why in capsys.readouterr().err


def test_decode_workload_runs_every_row_in_every_step(tmp_path, capsys):
    """--workload decode: what bench decode --roofline's engine runs, all requests admitted in the first step
    and decoding together after it (one step a token), so every step holds every row."""
    out = tmp_path / "decode.json"
    assert bench_main(["host-path", "--workload", "decode", "--profile-batches", "4", "--prompt-len", "8",
                       "--max-tokens", "6", "--passes", "1", "--no-async-scheduling", "--json", str(out)]) == 0
    run = json.loads(out.read_text())["host_path"]["4"]
    assert run["mean_batch_rows"] == 4 and run["steps"] == 6
    assert "decode workload (8-token prompts, 6 tokens each" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_main(["host-path", "--workload", "decode", "--prompt-len", "150", "--max-tokens", "20"])
    assert "exceeds --max-model-len=160" in capsys.readouterr().err


def test_the_stand_in_dispatch_makes_no_array_while_serving(monkeypatch):
    """The stand-in's ``dispatch`` hands out device arrays made when it was built: making them per call (three
    array creations, ~0.3 ms a step on the CPU client) would count as the engine's own dispatch in ``bench
    host-path`` and hide its host path behind the stand-in's. Its tokens still vary from step to step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmamba.bench.host_inputs import _fake_steps_class
    from jaxmamba.steps import Bucket

    class Model:
        class cfg:
            vocab_size = 1000

    buckets = [Bucket(8, 4, decode_only=True), Bucket(16, 4)]
    steps = _fake_steps_class()(Model, None, buckets, {b: None for b in buckets})

    def refuse(*args, **kwargs):
        raise AssertionError("the stand-in made an array while serving")

    monkeypatch.setattr(jax, "device_put", refuse)
    for name in ("asarray", "array", "zeros"):
        monkeypatch.setattr(jnp, name, refuse)
    tokens = []
    for _ in range(3):
        (sampled, accepted, *_, last_tokens), caches = steps.dispatch(buckets[0], "caches", None, None, None, None)
        assert caches == "caches" and sampled.shape == (4, 1) and accepted.shape == (4,)
        assert not np.asarray(accepted).any() and last_tokens.shape == (4,)
        tokens.append(np.asarray(sampled).tolist())
    assert tokens[0] != tokens[1] != tokens[2]


def test_the_stand_in_engine_takes_a_gpu_s_choices(monkeypatch):
    """On a GPU (``jax.default_backend()`` "gpu", a stand-in H100 for the pools' budget) the engine sizes its pools
    from the largest bucket's compiled temporaries (``sizing.gpu_cache_budget``) and enqueues inline: the stand-in
    steps give it their (empty) memory, so ``bench host-path`` and ``bench serve --profile-host``'s ``alone``
    figure run there (they raised AttributeError: the stand-in had no ``memory``)."""
    import jax
    from stand_in_gpu import StandInH100

    from jaxmamba.bench.host_inputs import stubbed_host_profiles, stubbed_llm
    from jaxmamba.engine import sizing

    class GpuDevice:  # the budget's device memory; everything else as jax has it
        def __getattr__(self, name):
            return getattr(jax, name)

        def devices(self, *a):
            return [StandInH100(1 << 30)]

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(sizing, "jax", GpuDevice())
    llm = stubbed_llm(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    assert llm.runner.dispatch_inline  # a GPU's "auto"
    assert llm.engine_core.pools.num_blocks > 0 and llm.engine_core.pools.max_concurrency >= 4
    (summary,) = stubbed_host_profiles(llm, [[1, 2, 3], [4, 5]] * 3, [4] * 6, 1)
    assert summary["steps"] >= 4 and 0 < summary["mean_batch_rows"] <= 4 and summary["host_cpu_us_per_output_token"] > 0


@pytest.mark.parametrize("scheduling", ["--async-scheduling", "--no-async-scheduling"])
def test_device_traffic_streams_through_the_caches_once_a_step_as_device_time(tmp_path, monkeypatch, scheduling):
    """--device-traffic-mib N: every stand-in step copies N MiB on the engine thread (what a CPU device's step does to
    the host's caches), once a step, synchronous or async, inside the ``wait`` phase: device time, not host time."""
    from jaxmamba.bench import host_inputs

    copies = []
    copy = host_inputs.copy_through_caches

    def counted(source, destination):
        copies.append(source.nbytes)
        copy(source, destination)

    monkeypatch.setattr(host_inputs, "copy_through_caches", counted)
    out = tmp_path / "traffic.json"
    assert bench_main(["host-path", "--profile-batches", "4", "--num-requests", "8", "--passes", "2",
                       "--max-num-batched-tokens", "32", "--device-traffic-mib", "64", scheduling,
                       "--json", str(out)]) == 0
    run = json.loads(out.read_text())["host_path"]["4"]
    assert copies and set(copies) == {64 << 20}
    assert len(copies) == 2 * run["steps"]  # both passes' steps; the summary is one pass's
    # A 64 MiB copy cannot run in a millisecond (64 GB/s on one thread): it is in ``wait``, where the host's
    # figure (HOST_PHASES, ``wait`` not among them) does not count it.
    assert run["wait_ms_per_step"] > 1.0
    assert run["host_cpu_us_per_output_token"] * run["mean_batch_rows"] / 1e3 < run["wait_ms_per_step"]


def test_device_traffic_must_not_be_negative(capsys):
    with pytest.raises(SystemExit):
        bench_main(["host-path", "--device-traffic-mib", "-1"])
    assert "--device-traffic-mib=-1 must be >= 0" in capsys.readouterr().err


def test_baseline_repo_alternates_the_two_trees_in_fresh_processes(tmp_path, capsys):
    """--baseline-repo: the same bench in another checkout and in this one, alternately (baseline first in even
    rounds), each a fresh process; the medians and their ratio per batch size. This checkout as its own baseline:
    both sides run the same code and report figures for every round."""
    from pathlib import Path

    import jaxmamba

    root = Path(jaxmamba.__file__).resolve().parents[1]
    out = tmp_path / "ab.json"
    assert bench_main(["host-path", "--baseline-repo", str(root), "--rounds", "2", "--profile-batches", "4",
                       "--num-requests", "8", "--passes", "1", "--max-num-batched-tokens", "32",
                       "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for name in ("baseline", "this"):
        assert len(r["rounds"][name]["4"]) == 2 and all(v > 0 for v in r["rounds"][name]["4"])
        assert r["median"][name]["4"] == pytest.approx(sum(r["rounds"][name]["4"]) / 2)
    lines = capsys.readouterr().out.splitlines()
    order = [line.split(",")[1].split(":")[0].strip() for line in lines if line.startswith("round ")]
    assert order == ["baseline", "this", "this", "baseline"]
    assert any(line.startswith("max_num_seqs 4: median of 2 rounds") and "this / baseline" in line for line in lines)


def test_baseline_repo_names_a_failed_run_and_refuses_what_it_cannot_compare(tmp_path, capsys):
    # A checkout whose bench does not run: the comparison ends naming it (here a package that fails on import).
    broken = tmp_path / "broken"
    (broken / "jaxmamba").mkdir(parents=True)
    (broken / "jaxmamba" / "__init__.py").write_text("raise ImportError('a broken checkout')\n")
    assert bench_main(["host-path", "--baseline-repo", str(broken), "--rounds", "1", "--profile-batches", "4",
                       "--num-requests", "8", "--passes", "1", "--max-num-batched-tokens", "32"]) == 1
    err = capsys.readouterr().err
    assert "the baseline run" in err and "a broken checkout" in err
    empty = tmp_path / "not-a-checkout"
    empty.mkdir()
    for bad, why in ((["--baseline-repo", str(tmp_path / "missing")], "is not a directory"),
                     (["--baseline-repo", str(empty)], "holds no jaxmamba package"),
                     (["--baseline-repo", str(broken), "--baseline-python", "no-such-python"], "no such interpreter"),
                     (["--baseline-repo", str(broken), "--rounds", "0"], "must be >= 1"),
                     (["--baseline-repo", str(broken), "--count-bytecodes", "5"], "look inside one tree")):
        with pytest.raises(SystemExit):
            bench_main(["host-path", *bad])
        assert why in capsys.readouterr().err


def test_baseline_repo_refuses_a_run_that_imported_jaxmamba_from_outside_its_checkout(tmp_path, capsys):
    """A checkout whose processes end up running another tree's jaxmamba (here a package that hands itself over to
    the installed one, as an interpreter with that tree ahead on its path would) would compare a tree with itself."""
    from pathlib import Path

    import jaxmamba

    shim = tmp_path / "shim"
    (shim / "jaxmamba").mkdir(parents=True)
    installed = str(Path(jaxmamba.__file__).resolve().parents[1])
    (shim / "jaxmamba" / "__init__.py").write_text(
        "import importlib, sys\n"
        f"sys.path = [{installed!r}] + [p for p in sys.path if p not in ('', {str(shim)!r})]\n"
        "del sys.modules[__name__]\n"
        "sys.modules[__name__] = importlib.import_module(__name__)\n")
    assert bench_main(["host-path", "--baseline-repo", str(shim), "--rounds", "1", "--profile-batches", "4",
                       "--num-requests", "8", "--passes", "1", "--max-num-batched-tokens", "32"]) == 1
    err = capsys.readouterr().err
    assert f"the baseline run imported jaxmamba from {installed}" in err and f"not from {shim}" in err
