"""Benchmarks: ``python -m jaxmamba.bench <subcommand> ...`` (``kernels``, ``serve``, ``transfer``, ...).

Each subcommand is a module ``jaxmamba.bench.<name>`` with ``main(argv) -> int``;
``python -m jaxmamba.bench`` lists the ones present without importing them. The subcommands import the
engine, torch, transformers and NIXL (the last three optional extras) inside the functions that use them, so
a subcommand's ``--help`` and its other modes do not pay for what they do not run.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path


def checked_baseline(parser: argparse.ArgumentParser, repo: Path, python: str) -> str:
    """For a bench's ``--baseline-repo``/``--baseline-python`` (its runs start in ``repo``, another checkout's root):
    ``python`` as an absolute path, or ``parser.error`` before any run where ``repo`` is not a directory, holds no
    ``jaxmamba`` package (the baseline's processes would import an installed one, this tree's under an editable
    install, and compare a tree with itself) or the interpreter is not found. A relative interpreter path is the
    caller's, made absolute here, not link-resolved: a venv's interpreter is a link whose target has none of the
    venv's packages."""
    if not repo.is_dir():
        parser.error(f"--baseline-repo={str(repo)!r} is not a directory")
    if not (repo / "jaxmamba" / "__init__.py").is_file():
        parser.error(f"--baseline-repo={str(repo)!r} holds no jaxmamba package (a checkout's root)")
    found = shutil.which(python)
    if found is None:
        parser.error(f"--baseline-python={python!r}: no such interpreter")
    return os.path.abspath(found)
