"""The command line: compare, convert and generate on small random checkpoints."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from jaxmamba import load_pretrained, random_model
from jaxmamba.cli import main


@pytest.mark.parametrize("family", ["nemotron_h", "falcon_h1", "mamba2"])
def test_compare_reports_every_layer_and_passes(tmp_path, capsys, family):
    pytest.importorskip("transformers")
    path = random_model(family, path=tmp_path / family)
    assert main(["compare", str(path), "--seq-len", "19"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "greedy argmax agreement: 100.00%" in out
    deltas = [float(line.split()[-1]) for line in out.splitlines() if line.startswith(("layer", "embed", "final_norm"))]
    assert len(deltas) == 5 and max(deltas) < 1e-4


def test_compare_detects_a_wrong_weight(tmp_path, capsys, monkeypatch):
    """The tool must be able to fail: perturb one jaxmamba weight and it reports MISMATCH."""
    pytest.importorskip("transformers")
    import jaxmamba.weights as weights

    path = random_model("bamba", path=tmp_path / "b")
    real = weights.params_from_tensors

    def corrupt(cfg, tensors, dtype="float32"):
        pure = real(cfg, tensors, dtype)
        pure["layers"][2]["mamba"]["D"] = pure["layers"][2]["mamba"]["D"] + 0.5
        return pure

    monkeypatch.setattr(weights, "params_from_tensors", corrupt)
    assert main(["compare", str(path), "--seq-len", "11"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out
    rows = {line.split()[0] + line.split()[1]: float(line.split()[-1]) for line in out.splitlines() if line.startswith("layer")}
    assert rows["layer1"] < 1e-4 < rows["layer2"], "the first diverging layer is the corrupted one"


def test_convert_round_trip(tmp_path):
    src = random_model("granite_hybrid", path=tmp_path / "hf")
    assert main(["convert", str(src), str(tmp_path / "orbax")]) == 0
    assert main(["convert", "--to", "hf", str(tmp_path / "orbax"), str(tmp_path / "hf2")]) == 0
    ids = np.arange(1, 9, dtype=np.int32)[None]
    np.testing.assert_array_equal(np.asarray(load_pretrained(tmp_path / "hf2")(ids)), np.asarray(load_pretrained(src)(ids)))


def test_generate_runs_as_a_module(tmp_path):
    path = random_model("nemotron_h", path=tmp_path / "n")
    proc = subprocess.run([sys.executable, "-m", "jaxmamba", "generate", str(path), "--prompt", "1 2 3",
                           "--max-tokens", "4", "--quiet", "--max-model-len", "64"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = [l for l in proc.stdout.splitlines() if l.startswith("prompt")][0]
    generated = line.split("->")[1].split("]")[0].strip(" [").split(",")
    assert len(generated) == 4 and line.endswith("(length)")
    # Sized to its one 3-token prompt: a one-row decode bucket and one 16-token mixed bucket.
    assert "buckets 2, compilations 2," in proc.stdout


def test_generate_takes_large_seeds_and_text_and_shows_compile_progress(tmp_path, capsys):
    """--seed 3000000000 once ended in an OverflowError traceback, and compiling was ~17 s of silence:
    large seeds are taken, and compiling shows its progress."""
    path = random_model("nemotron_h", path=tmp_path / "n")
    assert main(["generate", str(path), "--prompt", "1 2 3", "--prompt", "Hello, world", "--max-tokens", "3",
                 "--seed", "3000000000", "--temperature", "1", "--max-model-len", "64"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"(compiling|loading) \d+ programs", err), "the compile progress is shown"
    assert "(length)" in out and "'" in out, "the text prompt's output is shown as text too"


def test_generate_sizes_the_engine_to_its_prompts_unless_told(monkeypatch):
    """The README's main job once compiled 9 step programs (~80 s cold on a 2-core CPU) for three short prompts:
    the engine is now sized to the prompts (text counted by its bytes), and the command line's own sizes win."""
    import jaxmamba
    from jaxmamba import cli
    from jaxmamba.errors import ConfigError

    seen = {}

    def llm(path, **kwargs):  # stops cmd_generate once the engine's arguments are known
        seen.clear()
        seen.update(kwargs)
        raise ConfigError("stop here")

    monkeypatch.setattr(cli, "_checkpoint", lambda checkpoint, family: "ckpt")
    monkeypatch.setattr(jaxmamba, "LLM", llm)
    sized = lambda: {k: seen.get(k) for k in ("max_num_seqs", "max_num_batched_tokens", "buckets")}  # noqa: E731
    assert main(["generate", "--quiet"]) == 2
    assert sized() == {"max_num_seqs": 3, "max_num_batched_tokens": 16, "buckets": None}
    assert main(["generate", "--quiet", "--prompt", "x" * 20]) == 2  # 20 bytes + 2 special tokens
    assert sized() == {"max_num_seqs": 1, "max_num_batched_tokens": 32, "buckets": None}
    assert main(["generate", "--quiet", "--max-num-seqs", "4"]) == 2
    assert sized() == {"max_num_seqs": 4, "max_num_batched_tokens": None, "buckets": None}
    assert main(["generate", "--quiet", "--max-num-batched-tokens", "64"]) == 2
    assert sized() == {"max_num_seqs": None, "max_num_batched_tokens": 64, "buckets": None}
    assert main(["generate", "--quiet", "--buckets", "4,16"]) == 2
    assert sized()["max_num_seqs"] is None and sized()["buckets"] is not None


@pytest.mark.parametrize("args, says", [
    (["--max-model-len", "0"], "max_model_len=0"),
    (["--max-model-len", "99999"], "max_position_embeddings"),
    (["--prompt", "1 99999"], None),  # a rejected prompt: reported per prompt, exit 1
])
def test_user_errors_are_one_line_with_status_2(tmp_path, capsys, args, says):
    path = random_model("nemotron_h", path=tmp_path / "n")
    code = main(["generate", str(path), "--quiet", "--max-tokens", "2", *args])
    err = capsys.readouterr().err
    if says is None:
        assert code == 1
        return
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and says in lines[-1] and "Traceback" not in err


def test_missing_checkpoint_and_missing_extra_are_user_errors(tmp_path, capsys, monkeypatch):
    assert main(["generate", str(tmp_path / "nope"), "--quiet"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    assert main(["compare", str(tmp_path / "nope")]) == 2
    assert "jaxmamba[torch]" in capsys.readouterr().err


def test_serve_port_is_checked_before_anything_loads(tmp_path, capsys):
    """--port 99999 once compiled for a minute, then listened on some other port. A bad or busy
    port is now a one-line error before the checkpoint is even read (it does not exist here)."""
    import socket

    from jaxmamba.errors import ConfigError

    pytest.importorskip("uvicorn")
    from jaxmamba.serve import serve

    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path / "nope"), "--port", "99999"])
    assert e.value.code == 2 and "port '99999' must be an integer in [0, 65535]" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tmp_path / "nope"), "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
        with pytest.raises(ConfigError, match="port=70000 must be an int in"):
            serve(tmp_path / "nope", port=70000)


def test_quiet_on_every_progress_subcommand_and_generate_help_names_text(capsys):
    from jaxmamba.cli import build_parser

    parser = build_parser()
    for command in (["generate"], ["serve"], ["plan", "model"]):
        assert parser.parse_args([*command, "--quiet"]).quiet, command
    for argv in (["--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "text or token-id prompts" in out and "from token-id prompts" not in out, argv


def test_handoff_without_the_vllm_venv_or_with_one_token_is_a_user_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_VENV", str(tmp_path / "no-venv"))
    assert main(["handoff"]) == 2
    assert "error: vLLM's CPU venv is not built: run bash tests/setup_vllm_cpu.sh" in capsys.readouterr().err
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    monkeypatch.setenv("VLLM_CPU_VENV", str(tmp_path / "venv"))
    assert main(["handoff", "--prompt", "7"]) == 2
    assert "error: --prompt needs at least 2 token ids" in capsys.readouterr().err
