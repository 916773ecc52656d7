"""No module imports a conftest: a conftest holds fixtures and hooks, and what tests share besides them
is a module of tests/support/ (or of the tier), which a test imports by name. A conftest imported as a
library runs its import-time work a second time under another name and hides its helpers from the
reader, who looks for them in tests/support/."""

from __future__ import annotations

import ast

from tests.support.repo import ROOT

SOURCES = ("tests", "hack")


def conftest_imports(tree: ast.AST) -> list[str]:
    """The imports in `tree` that name a conftest module: `from .conftest import x`,
    `from tests.engine.conftest import x`, `from tests.engine import conftest`, `import tests.x.conftest`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if "conftest" in module.split(".") or any(a.name == "conftest" for a in node.names):
                found.append(f"{node.lineno}: from {'.' * node.level}{module} import "
                             f"{', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if "conftest" in a.name.split(".")]
    return found


def test_the_reader_sees_every_spelling():
    """Negative control: each way of importing a conftest is found, and a module merely named like one
    is not."""
    snippet = ast.parse(
        "from .conftest import ROOT\nfrom tests.engine.conftest import loopback_ip\n"
        "from tests.engine import conftest as engine_tier\nimport tests.cluster.conftest\n"
        "from tests.support.engine_stack import Replica\nimport conftest_helpers\n"
    )
    assert [line.split(":")[0] for line in conftest_imports(snippet)] == ["1", "2", "3", "4"]


def test_no_module_imports_a_conftest():
    found = [
        f"{path.relative_to(ROOT)}:{hit}"
        for root in SOURCES for path in sorted((ROOT / root).rglob("*.py"))
        for hit in conftest_imports(ast.parse(path.read_text()))
    ]
    assert not found, f"imports of a conftest (move what they import to tests/support/): {found}"
