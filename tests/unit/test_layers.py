"""The operator's layers, by folder: api/ (the API and its rules), render/ (the children) and
control/ (the decision) are pure; runtime/ is the only one that talks to the API server or a head.
Each pure module is imported alone in a fresh interpreter, which must load nothing from runtime/
and none of the I/O libraries."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

from tests.support.repo import ROOT

OPERATOR = ROOT / "operator" / "omnistage"
PURE_LAYERS = ("api", "render", "control")
IO_LIBRARIES = {"kubernetes", "kopf", "urllib3"}


def _modules(layer: str) -> list[str]:
    found = []
    for path in sorted((OPERATOR / layer).rglob("*.py")):
        parts = path.relative_to(OPERATOR.parent).with_suffix("").parts
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


PURE = [m for layer in PURE_LAYERS for m in _modules(layer)] + [
    "omnistage.names",
    "omnistage.known_pipelines",
]


def _loaded_after_import(module: str) -> list[str]:
    code = (f"import json, sys, {module}\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] "
            f"in {sorted(IO_LIBRARIES)!r} or m.startswith('omnistage.runtime'))))")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("module", PURE)
def test_a_pure_module_imports_no_runtime_and_no_io(module):
    loaded = _loaded_after_import(module)
    assert loaded == [], f"importing {module} loads {loaded}"


def test_the_check_sees_an_io_import():
    """Negative control: a runtime module does load them."""
    loaded = _loaded_after_import("omnistage.runtime.reconcile")
    assert "kubernetes" in loaded and "omnistage.runtime.kube" in loaded


def test_every_module_is_in_a_layer():
    """A new top-level module must be placed: a pure layer, runtime/, or the entry points."""
    entry = {"__init__", "__main__", "cli", "operator_main", "yamlio", "names", "known_pipelines"}
    top = {p.stem for p in OPERATOR.glob("*.py")}
    assert top <= entry, f"modules outside the layers: {sorted(top - entry)}"
    assert {p.name for p in OPERATOR.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == \
        {*PURE_LAYERS, "runtime"}


# ----- the import drawing, read from the source: every import (module level, under TYPE_CHECKING, or
# inside a function) is an edge, and edges may not run up the floors nor close a circle.

PLUGIN = ROOT / "engine_patches" / "omnistage_engine_patches"

# The operator's floors, lowest first; a module may import its own floor and those below it.
OPERATOR_FLOORS = {
    "names": ("omnistage", "omnistage.names", "omnistage.known_pipelines", "omnistage.yamlio"),
    "api": ("omnistage.api",),
    "render": ("omnistage.render",),
    "control": ("omnistage.control",),
    "runtime": ("omnistage.runtime",),
    "entry": ("omnistage.__main__", "omnistage.cli", "omnistage.operator_main"),
}
# The plugin's floors: the wire contract; the patch machinery (the helpers and the metric series the
# patches share); the patches; what serves or runs them (the plugin's entry point, the head's
# membership endpoint and report, the pod-side CLIs prestop and stages).
PLUGIN_FLOORS = {
    "contract": ("omnistage_engine_patches.contract",),
    "patching": ("omnistage_engine_patches._patching", "omnistage_engine_patches.metric_series",
                 "omnistage_engine_patches.reattach_engine"),
    "patches": ("omnistage_engine_patches.patches",),
    "endpoint": (
        "omnistage_engine_patches",
        "omnistage_engine_patches.membership_api",
        "omnistage_engine_patches.membership_auth",
        "omnistage_engine_patches.membership_connections",
        "omnistage_engine_patches.membership_listing",
        "omnistage_engine_patches.membership_ops",
        "omnistage_engine_patches.membership_requests",
        "omnistage_engine_patches.membership_routes",
        "omnistage_engine_patches.membership_server",
        "omnistage_engine_patches.report",
        "omnistage_engine_patches.prestop",
        "omnistage_engine_patches.stages",
    ),
}


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports, wherever the import stands."""
    mods = {_module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != m:
                    edges[m].add(target)
    return edges


def floor_of(module: str, floors: dict[str, tuple[str, ...]]) -> int:
    """The floor whose longest prefix names the module."""
    best = max(
        ((len(p), i) for i, prefixes in enumerate(floors.values()) for p in prefixes
         if module == p or module.startswith(p + ".")),
        default=None,
    )
    assert best is not None, f"{module} is on no floor: place it in the drawing"
    return best[1]


def upward(edges: dict[str, set[str]], floors: dict[str, tuple[str, ...]]) -> list[str]:
    names = list(floors)
    return sorted(
        f"{a} ({names[floor_of(a, floors)]}) imports {b} ({names[floor_of(b, floors)]})"
        for a, targets in edges.items() for b in targets if floor_of(b, floors) > floor_of(a, floors)
    )


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize(("root", "floors"), [(OPERATOR, OPERATOR_FLOORS), (PLUGIN, PLUGIN_FLOORS)],
                         ids=["operator", "plugin"])
def test_no_import_runs_up_the_floors(root, floors):
    """operator: names < api < render < control < runtime < the entry points; plugin: contract <
    patching < patches < endpoint. Every module is on a floor, and none imports a floor above its own."""
    assert upward(import_graph(root), floors) == []


def test_the_plugin_has_no_import_circle():
    assert circles(import_graph(PLUGIN)) == []


def test_the_operator_has_no_import_circle():
    assert circles(import_graph(OPERATOR)) == []


def test_the_drawing_sees_an_upward_import_and_a_circle(tmp_path):
    """Negative control, both ways: a lower floor importing a higher one (also from a function, or
    under TYPE_CHECKING), and a circle hidden that way, are found; the allowed direction is not."""
    root = tmp_path / "omnistage"
    for folder in ("api", "render", "control"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "names.py").write_text("")
    (root / "api" / "specs.py").write_text(
        "from .. import names\n\ndef f():\n    from ..render import pods\n")
    (root / "render" / "pods.py").write_text("from ..api import specs\n")
    (root / "control" / "plan.py").write_text("from . import steps\nfrom ..render import pods\n")
    (root / "control" / "steps.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .plan import Pass\n")
    edges = import_graph(root)
    assert upward(edges, OPERATOR_FLOORS) == [
        "omnistage.api.specs (api) imports omnistage.render.pods (render)"]
    assert circles(edges) == [["omnistage.api.specs", "omnistage.render.pods"],
                              ["omnistage.control.plan", "omnistage.control.steps"]]
