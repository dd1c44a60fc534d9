"""Execute every notebook under ``notebooks/`` (jupytext percent format) and check its figures.

Each notebook runs in a fresh Jupyter kernel with ``JAXMAMBA_NOTEBOOK_OUT`` pointing at a
temporary directory; a failing ``assert`` inside a notebook fails the test (nbclient raises
``CellExecutionError``). Afterwards every figure the notebook promises must exist as a
non-empty PNG. Notebooks that compare against transformers skip without it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# notebook -> (figures it must write, modules it needs beyond the base install)
EXPECTED = {
    "01_quickstart.py": (["01_mixed_batch.png", "01_buckets.png"], []),
    "02_cross_framework.py": (["02_layer_deltas.png", "02_kernel_backend.png"], ["torch", "transformers"]),
    # (03 also writes 03_spec_decode_slots.png when the engine accepts a speculative_config.)
    "03_state_cache.py": (["03_page_layout.png", "03_slot_contents.png", "03_pool_usage.png",
                           "03_prefix_cache_hits.png"], []),
    "04_disaggregation.py": (["04_transfer_ranges.png"], []),
    "05_kernels.py": (["05_kernels.png"], []),
}


def test_every_notebook_is_covered():
    assert sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.py")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs_and_writes_figures(name, tmp_path, monkeypatch):
    figures, needs = EXPECTED[name]
    for module in needs:
        pytest.importorskip(module)
    out = tmp_path / "out"
    monkeypatch.setenv("JAXMAMBA_NOTEBOOK_OUT", str(out))
    # Keep the kernel on the CPU like the rest of the suite unless GPU tests were asked for.
    if not os.environ.get("JAXMAMBA_TEST_GPU"):
        monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = jupytext.read(NOTEBOOKS / name)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    start = time.monotonic()
    client.execute()
    elapsed = time.monotonic() - start
    print(f"{name}: executed in {elapsed:.1f} s")
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    written = sorted(p.name for p in out.glob("*.png"))
    for fig in sorted(set(figures) | set(written)):
        path = out / fig
        assert path.is_file(), f"{name} did not write {fig} (wrote {sorted(p.name for p in out.glob('*.png'))})"
        data = path.read_bytes()
        assert len(data) > 5000 and data.startswith(PNG_MAGIC), f"{fig} is not a non-empty PNG ({len(data)} bytes)"
