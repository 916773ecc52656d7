"""The operator's layers, by folder: api/ (the API and its rules), render/ (the children) and
control/ (the decision) are pure; runtime/ is the only one that talks to the API server or a head.
Each pure module is imported alone in a fresh interpreter, which must load nothing from runtime/
and none of the I/O libraries."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import ROOT

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
