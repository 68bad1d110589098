"""smp's imports point down: no module imports one of a higher layer, and no modules import
each other in a circle (docs/design.md §0).

The graph comes from the modules' own source (every ``import`` and ``from ... import``, at any
depth: one inside a function counts as much as one at the top, since hiding a circle in a
function does not remove it), plus the packages that Python runs on the way to a module
(importing ``smp.checkpoints.keys`` runs ``smp/checkpoints/__init__.py`` first).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import smp

ROOT = Path(smp.__file__).parent

# The rule table: each module's layer is that of the longest prefix listed here; a module may
# import its own layer or lower ones (acyclically), never a higher one.
LAYERS = {
    # 0: no smp imports at all
    "smp._C": 0,  # the C++ extension
    "smp.config": 0,
    # 1: process state and what every concern shares
    "smp.state": 1,
    "smp.comm": 1,
    "smp.amp": 1,
    "smp.kernels": 1,
    "smp.core": 1,
    # 2: memory savers on one module's activations and parameters
    "smp.memory": 2,
    # 3: tensor parallelism
    "smp.tp": 3,
    # 4: the concerns that work on the whole model
    "smp.partitioning": 4,
    "smp.pipeline": 4,
    "smp.dp": 4,
    "smp.checkpoints": 4,
    # 5: the classes users hold, composing the concerns
    "smp.model": 5,
    "smp.step": 5,
    "smp.optimizer": 5,
    "smp.planner": 5,  # prices whole layouts: partitioning, pipeline schedules, dp, tp
    # 6: the public faces: the package, smp.nn, and SMP v1's import paths
    "smp": 6,
    "smp.nn": 6,
    "smp.v1": 6,
    "smp.compat": 6,
    "smp.state_mod": 6,
    "smp.optimizers": 6,
    "smp.utils": 6,
    "smp.patches": 6,
    "smp.test": 6,
}


def _modules() -> dict[str, Path]:
    found = {"smp._C": None}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module ``name`` is, or is inside (``smp.x.y`` where y is a name in module smp.x)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _package_of(module: str) -> str:
    path = MODULES[module]
    return module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]


def _imported_names(module: str) -> set[str]:
    names: set[str] = set()
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(module).split(".")
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            # ``from a import b``: b is module a.b when there is one, else a name in a
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "smp" or n.startswith("smp.")}


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        if path is None:
            continue
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        targets = set()
        for name in _imported_names(module):
            target = _resolve(name)
            if target is None:
                continue
            parts = target.split(".")
            # the packages Python runs on the way to ``target`` (not those this module is in)
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step in MODULES and step not in ancestors:
                    targets.add(step)
        targets.discard(module)
        edges[module] = targets
    return edges


EDGES = _edges()


def layer(module: str) -> int:
    parts = module.split(".")
    while parts:
        key = ".".join(parts)
        if key in LAYERS:
            return LAYERS[key]
        parts.pop()
    raise KeyError(module)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    missing = []
    for module in MODULES:
        try:
            layer(module)
        except KeyError:
            missing.append(module)
    assert not missing, f"add these modules to LAYERS: {missing}"


def test_imports_point_down():
    upward = [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in sorted(EDGES.items())
        for b in sorted(targets)
        if layer(b) > layer(a)
    ]
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_no_import_circles():
    circles = _cycles(EDGES)
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_layer_zero_imports_nothing_of_smp():
    for module in (m for m in MODULES if MODULES[m] is not None and layer(m) == 0):
        assert not EDGES[module], f"{module} imports {sorted(EDGES[module])}"


# The checker itself: it must see what it claims to see.


def test_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    lower = tmp_path / "smp" / "core"
    lower.mkdir(parents=True)
    (tmp_path / "smp" / "__init__.py").write_text("")
    (lower / "__init__.py").write_text("")
    (lower / "a.py").write_text("def f():\n    from smp.model import DistributedModel\n")
    (lower / "b.py").write_text("from . import a\nfrom .a import f\n")
    monkeypatch.setitem(MODULES, "smp.core.a", lower / "a.py")
    monkeypatch.setitem(MODULES, "smp.core.b", lower / "b.py")
    assert _imported_names("smp.core.a") == {"smp.model.DistributedModel"}
    assert _imported_names("smp.core.b") == {"smp.core.a", "smp.core.a.f"}
    assert _resolve("smp.model.DistributedModel") == "smp.model"


def test_finds_a_circle_and_an_upward_import():
    edges = {"smp.core.a": {"smp.core.b"}, "smp.core.b": {"smp.core.a"}, "smp.model": set()}
    assert _cycles(edges) == [["smp.core.a", "smp.core.b"]]
    assert layer("smp.core.a") < layer("smp.model")
    assert layer("smp.checkpoints.keys") == 4 and layer("smp") == 6


@pytest.mark.parametrize("module", ["smp.model", "smp.step", "smp.optimizer"])
def test_the_composing_classes_see_the_concerns(module):
    # a sanity check of the graph: these import concerns of lower layers
    assert any(layer(b) in (2, 3, 4) for b in EDGES[module]), EDGES[module]


@pytest.mark.parametrize(
    "path",
    [
        # module paths the user guide names, which the layout keeps (v1's are in
        # test_v1_inventory.py)
        "smp.nn.functional.copy_to_region",
        "smp.nn.functional.gather_from_region",
        "smp.partitioning.CrossingCosts",
        "smp.memory.offload.current",
        "smp.core.tree.flatten",
    ],
)
def test_the_guides_module_paths_resolve(path):
    module, _, name = path.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))
