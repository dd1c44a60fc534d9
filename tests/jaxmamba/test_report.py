"""``jaxmamba.report`` and ``python -m jaxmamba compare --report``: plots + markdown/HTML."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("matplotlib")

from jaxmamba import HybridConfig, random_model  # noqa: E402
from jaxmamba.cli import main  # noqa: E402
from jaxmamba.compare import CompareResult  # noqa: E402
from jaxmamba.report import write_compare_report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _pngs_ok(paths):
    for p in paths:
        assert p.exists(), p
        data = p.read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC), f"{p} is not a non-empty PNG"


def _synthetic(dtype="float32", bad_layer=None, family="nemotron_h"):
    rows = [("embed", "embedding", 0.0)] + [
        (f"layer {i}", kind, 2e-6 * (i + 1)) for i, kind in enumerate(["mamba", "attention", "mamba"])
    ] + [("final_norm", "norm", 3e-6)]
    if bad_layer is not None:
        name, kind, _ = rows[bad_layer]
        rows[bad_layer] = (name, kind, 0.7)
    return CompareResult("/ckpt", family, dtype, (2, 9), rows=rows, logits_max_abs=0.9 if bad_layer else 3e-6,
                         logits_scale=4.0, argmax_agreement=0.5 if bad_layer else 1.0)


def _linked_images(text):
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text) or re.findall(r"<img src='([^']+)'", text)


def test_markdown_report_lists_every_position_and_flags_a_mismatch(tmp_path):
    good, bad = _synthetic(), _synthetic("bfloat16", bad_layer=2)
    report = write_compare_report([good, bad], tmp_path / "r")
    assert report == tmp_path / "r" / "report.md"
    text = report.read_text()
    for r in (good, bad):
        section = text.split(f"{r.family}, {r.dtype} (")[1]
        for name, kind, delta in r.rows:
            assert f"| {name} | {kind} | {delta:.3e} |" in section
    summary = [line for line in text.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert summary[0].endswith("| OK |") and summary[1].endswith("| MISMATCH |")
    images = _linked_images(text)
    assert len(images) == 3 and len(set(images)) == 3  # summary + one plot per result
    _pngs_ok([report.parent / name for name in images])


def test_html_report_and_bad_input(tmp_path):
    report = write_compare_report([_synthetic()], tmp_path, filename="cmp.html")
    text = report.read_text()
    assert text.startswith("<!doctype html>") and "layer 2" in text and "final_norm" in text
    _pngs_ok([tmp_path / name for name in _linked_images(text)])
    with pytest.raises(ValueError):
        write_compare_report([], tmp_path)
    with pytest.raises(TypeError):
        write_compare_report(["not a result"], tmp_path)


def test_cli_compare_writes_a_report_for_every_layer(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = random_model("bamba", path=tmp_path / "bamba")
    rc = main(["compare", str(path), "--seq-len", "9", "--also-dtype", "bfloat16", "--report", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = tmp_path / "out" / "report.md"
    assert f"report: {report}" in out
    text = report.read_text()
    # Every decoder layer of the checkpoint appears (the last one through final_norm, as transformers reports it).
    num_layers = len(HybridConfig.from_hf(json.loads((path / "config.json").read_text())).layer_types)
    for i in range(num_layers - 1):
        assert f"| layer {i} |" in text
    assert f"covers layer {num_layers - 1}" in text and "| final_norm |" in text and "| embed |" in text
    assert "| float32 |" in text and "| bfloat16 |" in text and "MISMATCH" not in text
    images = _linked_images(text)
    assert len(images) == 3
    _pngs_ok([report.parent / name for name in images])


def test_cli_compare_report_to_a_named_markdown_file(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = random_model("mamba2", path=tmp_path / "m")
    assert main(["compare", str(path), "--seq-len", "7", "--report", str(tmp_path / "rep" / "mamba2.md")]) == 0
    text = (tmp_path / "rep" / "mamba2.md").read_text()
    assert all(f"| layer {i} |" in text for i in range(4)) and "covers layer" not in text
    _pngs_ok([tmp_path / "rep" / name for name in _linked_images(text)])
