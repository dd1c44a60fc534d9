"""The kernels import nothing from the model (the model may depend on the kernels, never the reverse).

``jaxmamba.errors`` and ``jaxmamba.layout`` are contracts shared by both sides and stay allowed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pallas_kernels

PACKAGE = Path(pallas_kernels.__file__).resolve().parent
FORBIDDEN = "jaxmamba.model"


def _is_forbidden(module: str) -> bool:
    return module == FORBIDDEN or module.startswith(FORBIDDEN + ".")


def model_imports(source: str) -> list[str]:
    """Every ``jaxmamba.model`` import in ``source``, at any depth (function-local and lazy ones too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _is_forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from jaxmamba.model.ops import x`` and ``from jaxmamba import model``
            found += [node.module] if _is_forbidden(node.module) else [
                f"{node.module}.{a.name}" for a in node.names if _is_forbidden(f"{node.module}.{a.name}")
            ]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _is_forbidden(node.args[0].value)):
            found.append(node.args[0].value)  # importlib.import_module("jaxmamba.model...")
    return found


def test_the_scan_sees_every_spelling_of_a_model_import():
    assert model_imports(
        "import jaxmamba.model.ops\nfrom jaxmamba.model.ops import segment_sum\nfrom jaxmamba import model\n"
        "def f():\n    import jaxmamba.model as m\n    return importlib.import_module('jaxmamba.model.ops')\n"
    ) == ["jaxmamba.model.ops", "jaxmamba.model.ops", "jaxmamba.model", "jaxmamba.model", "jaxmamba.model.ops"]
    assert model_imports("from jaxmamba.errors import SlotError\nfrom jaxmamba import layout\n"
                         "import jaxmamba.models_registry\n") == []


def test_no_kernel_module_imports_the_model():
    sources = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "reference" / "common.py" in sources  # the walk reaches subpackages
    offenders = {str(p.relative_to(PACKAGE)): m for p in sources if (m := model_imports(p.read_text()))}
    assert not offenders, f"pallas_kernels must not import {FORBIDDEN}: {offenders}"


def test_importing_every_kernel_module_loads_no_model_module():
    """Transitively too: a contract module that pulled in the model would show up here."""
    modules = sorted(
        "pallas_kernels." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        for p in PACKAGE.rglob("*.py")
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(m for m in sys.modules if m == {FORBIDDEN!r} or m.startswith({FORBIDDEN + '.'!r})))\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"importing pallas_kernels loaded {proc.stdout.strip()}"
