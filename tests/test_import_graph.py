"""The import graph of ``jaxmamba``, ``pallas_kernels`` and ``transfer``: no cycles, and no import against the
layer order of docs/architecture.md ("1. Layers and import order").

Every import counts, at any depth (function-level and ``TYPE_CHECKING`` ones too, and
``importlib.import_module("literal")``): an import inside a function still ties the two modules together.
``LAYERS`` below is the document's table; ``test_layers_match_the_architecture_document`` holds the two
together, so a new module is placed in both or the suite fails.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxmamba", "pallas_kernels", "transfer")
DOC = ROOT / "docs" / "architecture.md"

#: docs/architecture.md's layers, from the bottom. A module belongs to the longest entry that is its name or a
#: package above it; the package face ``jaxmamba`` (its ``__init__``, whose other names load on first use) counts
#: for itself only.
LAYERS = (
    ("Contracts", ("jaxmamba", "jaxmamba.errors", "jaxmamba.config", "jaxmamba.hf_config", "jaxmamba.layout",
                   "jaxmamba.cpu_heap")),
    ("Kernels and transfer", ("pallas_kernels", "transfer")),
    ("Host data and device state", ("jaxmamba.metadata", "jaxmamba.cache", "jaxmamba.host_profile",
                                    "jaxmamba.compile_progress", "jaxmamba.compile_cache", "jaxmamba.hlo_traffic",
                                    "jaxmamba.hlo_flops", "jaxmamba.pallas_work",
                                    "jaxmamba.aot")),
    ("Model", ("jaxmamba.model", "jaxmamba.weights", "jaxmamba.parallel", "jaxmamba.random_checkpoint",
               "jaxmamba.roofline")),
    ("Step programs", ("jaxmamba.sampling", "jaxmamba.sampling_filter", "jaxmamba.buckets",
                       "jaxmamba.step_program", "jaxmamba.program_builder", "jaxmamba.steps")),
    ("Engine", ("jaxmamba.engine",)),
    ("Surfaces and tools", ("jaxmamba.plan", "jaxmamba.serve", "jaxmamba.serve_metrics", "jaxmamba.compare",
                            "jaxmamba.report", "jaxmamba.bench", "jaxmamba.handoff_demo", "jaxmamba.cli",
                            "jaxmamba.cli_interrupts", "jaxmamba.__main__")),
)
#: Narrower than the layer order: what a layer may take from the layers below it (the document's "Imports from").
ONLY_FROM_BELOW = {"Kernels and transfer": {"jaxmamba.errors", "jaxmamba.layout"}}
#: Inside ``jaxmamba.model`` the modules build on each other in this order (the document's layer 3).
MODEL_CHAIN = ("jaxmamba.model.ops", "jaxmamba.model.mlp", "jaxmamba.model.moe", "jaxmamba.model.layers",
               "jaxmamba.model.hybrid")


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted name: path}`` of every module of the project's packages (a package is its ``__init__``)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            modules[".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = path
    return modules


def imports_of(name: str, source: str, is_package: bool, known) -> set[str]:
    """The project modules that module ``name`` imports anywhere in ``source``. ``from a import b`` names the
    module ``a.b`` where that is one, else ``a``; a name that is no module falls back to its nearest package."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path.read_text(), path.name == "__init__.py", modules)
            for name, path in modules.items()}


def layer_of(module: str) -> int | None:
    best, index = "", None
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            covers = module == entry or (entry != "jaxmamba" and module.startswith(entry + "."))
            if covers and len(entry) > len(best):
                best, index = entry, i
    return index


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_graphs(graph: dict[str, set[str]]):
    """For each package, ``(package, graph)`` of its direct children (a subpackage collapsed to one node), from
    the imports between modules inside it; the package's own ``__init__`` (its face) is left out."""
    packages = sorted({m for m in graph if any(o.startswith(m + ".") for o in graph)})
    for package in packages:
        def child(module, package=package):
            if not module.startswith(package + "."):
                return None
            return package + "." + module[len(package) + 1:].split(".")[0]

        children: dict[str, set[str]] = {}
        for source, targets in graph.items():
            a = child(source)
            if a is None:
                continue
            children.setdefault(a, set())
            children[a] |= {b for t in targets if (b := child(t)) is not None and b != a}
        yield package, children


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import against ``LAYERS``, ``ONLY_FROM_BELOW`` and ``MODEL_CHAIN``, as readable lines."""
    bad = []
    for source, targets in sorted(graph.items()):
        here = layer_of(source)
        for target in sorted(targets):
            there = layer_of(target)
            if there > here:
                bad.append(f"{source} (layer {here}, {LAYERS[here][0]}) imports {target} "
                           f"(layer {there}, {LAYERS[there][0]})")
            allowed = ONLY_FROM_BELOW.get(LAYERS[here][0])
            if allowed is not None and there < here and target not in allowed:
                bad.append(f"{source} imports {target}: layer {here} takes only {sorted(allowed)} from below")
            if source in MODEL_CHAIN and target in MODEL_CHAIN and MODEL_CHAIN.index(target) > MODEL_CHAIN.index(source):
                bad.append(f"{source} imports {target}, later in the model's chain {' -> '.join(MODEL_CHAIN)}")
    return bad


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_scan_sees_every_spelling_of_an_import():
    known = {"jaxmamba", "jaxmamba.engine", "jaxmamba.engine.core", "jaxmamba.plan", "jaxmamba.steps",
             "jaxmamba.engine.runner", "jaxmamba.cli"}
    source = ("import jaxmamba.plan\nfrom jaxmamba.engine import core\nfrom . import runner\n"
              "from ..steps import Bucket\n"
              "def f():\n    from jaxmamba.cli import main\n    return importlib.import_module('jaxmamba.engine')\n"
              "if TYPE_CHECKING:\n    import numpy\n")
    assert imports_of("jaxmamba.engine.sizing", source, False, known) == {
        "jaxmamba.plan", "jaxmamba.engine.core", "jaxmamba.engine.runner", "jaxmamba.steps", "jaxmamba.cli",
        "jaxmamba.engine"}
    # In a package's __init__, ``.`` is the package itself.
    assert imports_of("jaxmamba.engine", "from .core import EngineCore\n", True, known) == {"jaxmamba.engine.core"}


def test_every_module_has_a_layer(graph):
    assert PACKAGES[0] in graph and "pallas_kernels.reference.common" in graph  # the walk reaches subpackages
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"place these in docs/architecture.md's layer table and in LAYERS: {unplaced}"


def test_no_module_imports_against_the_layer_order(graph):
    bad = upward_imports(graph)
    assert not bad, "imports against docs/architecture.md's layer order:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules(graph):
    found = cycles(graph)
    assert not found, f"modules that import each other in a cycle: {found}"


def test_no_import_cycles_between_the_parts_of_a_package(graph):
    found = {package: c for package, children in package_graphs(graph) if (c := cycles(children))}
    assert not found, f"parts of a package that import each other in a cycle: {found}"


def test_the_checks_catch_an_upward_import_and_a_cycle(graph):
    """The checks themselves: an engine module importing the CLI is upward, a kernel importing the config takes
    more than errors and layout, and a model module importing the engine back closes a cycle."""
    changed = {m: set(t) for m, t in graph.items()}
    changed["jaxmamba.engine.core"].add("jaxmamba.cli")
    changed["pallas_kernels.dispatch"].add("jaxmamba.config")
    changed["jaxmamba.model.ops"].add("jaxmamba.model.hybrid")
    bad = upward_imports(changed)
    assert any(line.startswith("jaxmamba.engine.core (layer 5, Engine) imports jaxmamba.cli") for line in bad)
    assert any(line.startswith("pallas_kernels.dispatch imports jaxmamba.config") for line in bad)
    assert any(line.startswith("jaxmamba.model.ops imports jaxmamba.model.hybrid") for line in bad)
    assert any("jaxmamba.model.hybrid" in c and "jaxmamba.model.ops" in c for c in cycles(changed))
    changed["jaxmamba.metadata.checks"].add("jaxmamba.engine.runner")
    assert any(set(c) >= {"jaxmamba.engine", "jaxmamba.metadata"}
               for package, children in package_graphs(changed) if package == "jaxmamba" for c in cycles(children))


def _document_layers() -> list[tuple[str, set[str]]]:
    """``(layer name, modules named)`` of each row of the document's table, in order: every backticked name
    that is a project module, as written or under ``jaxmamba.`` (``python -m jaxmamba``: ``jaxmamba.__main__``)."""
    modules = set(project_modules())
    section = DOC.read_text().split("## 1. Layers and import order", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = re.match(r"\|\s*(\d+)\.\s*([^|]+?)\s*\|([^|]*)\|", line)
        if not match:
            continue
        named = set()
        for token in re.findall(r"`([^`]+)`", match.group(3)):
            token = "jaxmamba.__main__" if token == "python -m jaxmamba" else token
            named |= {c for c in (token, f"jaxmamba.{token}") if c in modules}
        rows.append((match.group(2), named))
    return rows


def test_layers_match_the_architecture_document():
    rows = _document_layers()
    assert [name for name, _ in rows] == [name for name, _ in LAYERS]
    for (name, named), (_, entries) in zip(rows, LAYERS, strict=True):
        # Each entry is named in its row, and each module the row names is in this layer.
        assert set(entries) <= named, f"layer {name!r}: the document does not name {sorted(set(entries) - named)}"
        misplaced = sorted(m for m in named if LAYERS[layer_of(m)][0] != name)
        assert not misplaced, f"layer {name!r}: the document names {misplaced}, which LAYERS places elsewhere"
