"""Shared fixtures: GPU skipping, and an oracle that runs vLLM's own contract code.

vLLM pins a transformers that conflicts with the test extra, so it lives in its
own virtual environment (``.venv-vllm``, or the interpreter named by
``JAXMAMBA_VLLM_PYTHON``). ``vllm_oracle(code)`` runs ``code`` there and returns
the JSON it prints on its last stdout line. Tests marked ``vllm`` skip when no
such interpreter exists.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Shared test helpers (hf_reference.py) live in tests/_support. Not tests/ itself: its
# jaxmamba/ folder would become a namespace package shadowing the real one.
sys.path.insert(0, str(Path(__file__).resolve().parent / "_support"))
if not os.environ.get("JAXMAMBA_TEST_GPU"):
    # Keep CPU runs off any accidentally visible accelerator.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: XLA flags every test process (and every worker, notebook kernel and engine process it starts)
#: compiles with. XLA's CPU compile time dominates this suite: an engine compiles one step program
#: per bucket, and LLVM's optimisation of those programs costs more than running the tiny models
#: they serve. Level 0 halves compile time (tests/jaxmamba/test_engine.py + test_spec_decode.py,
#: cold compile cache: 1208 s -> 663 s on 2 shared cores). Numbers are still checked against the
#: references and transformers with the same tolerances; benchmarks and deviceless GPU-target compiles
#: (whose register counts must be production's) never run under this setting.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


if not os.environ.get("JAXMAMBA_TEST_GPU") and TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    # CPU runs only (a GPU run compiles as in production). Subprocesses inherit it; those that set XLA_FLAGS themselves append to this value.
    os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()


def pytest_configure(config):
    # pytest-xdist's workers start with SIGINT ignored (the controller takes Ctrl-C), and children inherit an
    # ignored signal: the engine's Ctrl-C handling (it defers only Python's default handler) and a plan
    # subprocess's Ctrl-C exit were untestable there, passing alone and failing in the full suite. Give the
    # workers the disposition a user's process has.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Engines with the same model shape compile identical step programs: let every test after
    # the first load them from JAX's persistent cache instead of compiling again.
    import jax

    cache_dir = os.environ.get("JAXMAMBA_TEST_COMPILE_CACHE", str(REPO / ".jax_cache"))
    if cache_dir == "none":  # a test re-run in a process that must never touch JAX's persistent cache
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_per_module():
    """Free jit-cached executables after each test module: each keeps memory mappings alive, and a
    whole suite in one process must stay under the kernel's mapping limit (see
    tests/pallas_kernels/conftest.py). Engines hold their own AOT executables; the persistent
    cache makes any recompile cheap."""
    yield
    import jax

    jax.clear_caches()


def _has_gpu() -> bool:
    try:
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:
        return False


#: Node ids that belong to the slow tier though not marked in their files (tests/slow_tests.txt says why).
SLOW_NODE_IDS = frozenset(line.strip() for line in (REPO / "tests" / "slow_tests.txt").read_text().splitlines()
                          if line.strip() and not line.startswith("#"))


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_NODE_IDS:
            item.add_marker(pytest.mark.slow)
    if not _has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run with JAXMAMBA_TEST_GPU=1 on a GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    from jaxmamba.aot import AOT_INSTALL_HINT, aot_available

    if not aot_available():
        skip_aot = pytest.mark.skip(reason=f"needs the aot extra: {AOT_INSTALL_HINT}")
        for item in items:
            if "aot" in item.keywords:
                item.add_marker(skip_aot)


def _vllm_python() -> str | None:
    cand = os.environ.get("JAXMAMBA_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    return cand if Path(cand).exists() else None


@pytest.fixture(scope="session")
def vllm_oracle():
    """Run a snippet under vLLM's interpreter; return the JSON printed on its last line."""
    python = _vllm_python()
    if python is None:
        pytest.skip("vLLM contract venv not found (.venv-vllm or JAXMAMBA_VLLM_PYTHON)")

    def run(code: str):
        proc = subprocess.run(
            [python, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "VLLM_SSM_CONV_STATE_LAYOUT": "DS"},
        )
        if proc.returncode != 0:
            raise AssertionError(f"vLLM oracle failed:\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run
