"""The user's guide (docs/) stays true to the code.

* docs/reference.md is exactly what `omnistage docs` generates from the API models (`make docs`);
* troubleshooting.md names every condition type, condition reason, Progressing action and Event
  reason (the enums of conditions.py, held to the code's syntax tree, so a new reason fails this test);
* membership-and-metrics.md names every operator metric;
* every variable the GPU tier and hack/gpu-repro.py read is documented in docs/gpu-tests.md and in
  the Makefile's comments above `test-gpu`;
* README.md and docs/ link only inside the repository, to files and anchors that exist;
* README.md stays a page a newcomer reads in minutes (at most README_LINES lines), and each benchmark
  page (docs/bench/) opens with its headline figure.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys

import pytest
from omnistage.api import conditions
from omnistage.api.conditions import EventReason, Progress, Reason, Type
from omnistage.api.crd import build_crd
from omnistage.api.docs import KUBERNETES_TYPES, reference_markdown
from omnistage.api.statuses import MemberState

from tests.gpu.support import ENGINE_IMAGE_ENV, SETTINGS
from tests.support.repo import ROOT

DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference.md"
OPERATOR = ROOT / "operator" / "omnistage"


# ----- the generated reference -----------------------------------------------------------------------

def test_committed_reference_matches_the_models():
    assert REFERENCE.read_text() == reference_markdown(), \
        "docs/reference.md is stale: run `make docs` and commit the result"


def test_a_changed_model_changes_the_reference():
    """Negative control: the comparison above sees a change of one description."""
    crd = build_crd()
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["replicas"]["description"] = "Something else entirely."
    changed = reference_markdown(crd)
    assert changed != REFERENCE.read_text() and "Something else entirely." in changed


def test_cli_prints_the_reference():
    out = subprocess.run(
        [sys.executable, "-m", "omnistage", "docs"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == reference_markdown()


def _fields(schema: dict, path: str):
    for name, sub in (schema.get("properties") or {}).items():
        yield path, name
        child = f"{path}.{name}"
        if child in KUBERNETES_TYPES:
            continue
        yield from _fields(sub, child)
        if isinstance(sub.get("items"), dict):
            yield from _fields(sub["items"], child + "[]")


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^### `([^`]+)`$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_reference_has_a_row_for_every_field_and_rule():
    version = build_crd()["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]["properties"]
    sections = _sections(reference_markdown())
    for top in ("spec", "status"):
        for parent, name in _fields(root[top], top):
            assert parent in sections, f"no section for {parent}"
            assert re.search(rf"^\| \[?`{re.escape(name)}`", sections[parent], flags=re.MULTILINE), (
                f"{parent}.{name}"
            )
    text = reference_markdown()
    for path in KUBERNETES_TYPES:  # a renamed embedded type must not silently drop out of the reference
        parent, name = path.rsplit(".", 1)
        node = root["spec"]
        for part in parent.split(".")[1:]:
            node = node["properties"][part.removesuffix("[]")]
            node = node.get("items", node) if part.endswith("[]") else node
        assert name in node["properties"], f"{path} is not in the CRD any more"
    for rule in ("spec.cache.mode lru and shm need membership", "metadata.name must be at most"):
        assert rule in text
    for ctype in conditions.TYPES:
        assert f"`{ctype}`" in text


# ----- troubleshooting: every reason the operator sets --------------------------------------------------
# Every condition type, reason, Progressing action, Event reason and member state is a member of an enum
# (api/conditions.py, api/statuses.MemberState). The tests below hold the enums to the code both ways: each
# member is
# named somewhere in the operator package (so nothing is promised that no code sets), and no call that
# sets a reason passes a string literal (so nothing is set that the enums, and so the docs, miss).

DOCUMENTED = [("condition reason", Reason), ("Progressing action", Progress), ("Event reason", EventReason)]
ENUMS = [Type, Reason, Progress, EventReason, MemberState]


def _operator_trees():
    for path in sorted(OPERATOR.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def referenced(enum) -> set[str]:
    """Members of `enum` the operator package names as Enum.MEMBER (or module.Enum.MEMBER)."""
    found = set()
    for _, tree in _operator_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                owner = node.value
                name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
                if name == enum.__name__:
                    found.add(node.attr)
    return found & set(enum.__members__)


# The calls that set a reason, and which argument is the reason.
REASON_ARGUMENT = {"Cond": 2, "emit": 1, "PostEvent": 1, "CreatePod": 1, "DeletePod": 2, "retire": -2}


def _literals(node: ast.AST):
    """String constants an expression can evaluate to (through `x if c else y` and `a or b`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.IfExp):
        yield from _literals(node.body)
        yield from _literals(node.orelse)
    elif isinstance(node, ast.BoolOp):
        for value in node.values:
            yield from _literals(value)


def literal_reasons(trees) -> list[str]:
    """`file:line literal` for every reason argument (and self.progressing.append(X)) that is a literal."""
    out = []
    for path, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == "append" and isinstance(func, ast.Attribute) \
                    and getattr(func.value, "attr", None) == "progressing":
                args = node.args
            elif called in REASON_ARGUMENT and len(node.args) > abs(REASON_ARGUMENT[called]):
                args = [node.args[REASON_ARGUMENT[called]]]
            else:
                continue
            out += [f"{path.name}:{node.lineno} {lit!r}" for arg in args for lit in _literals(arg)]
    return out


def test_the_readers_see_what_they_should():
    """Negative controls for the tests below: the syntax-tree readers find a known member and a literal."""
    assert {"HEAD_PENDING", "UNSCHEDULABLE", "GPU_MEMORY_OVERCOMMITTED"} <= referenced(Reason)
    assert {"LEAVING", "PENDING"} <= referenced(MemberState)
    snippet = ast.parse(
        'Cond(Type.READY, ok, Reason.WAITING if ok else "Stuck")\nself.progressing.append("Busy")\n'
        'self.emit("Normal", EventReason.JOINED, "joined")'
    )
    assert literal_reasons([(OPERATOR / "x.py", snippet)]) == ["x.py:1 'Stuck'", "x.py:2 'Busy'"]


@pytest.mark.parametrize("enum", ENUMS, ids=lambda e: e.__name__)
def test_every_member_is_set_somewhere(enum):
    unused = sorted(set(enum.__members__) - referenced(enum))
    assert not unused, f"{enum.__name__} promises {unused}, which no operator code sets"


def test_no_reason_is_a_literal():
    found = literal_reasons(_operator_trees())
    assert not found, f"reasons written as literals (make them members of conditions.py's enums): {found}"


def _troubleshooting() -> str:
    return (DOCS / "troubleshooting.md").read_text()


def test_troubleshooting_has_a_section_per_condition_type():
    text = _troubleshooting()
    for ctype in conditions.TYPES:
        assert re.search(rf"^## {ctype}$", text, flags=re.MULTILINE), (
            f"docs/troubleshooting.md has no section {ctype}"
        )


@pytest.mark.parametrize("kind, enum", DOCUMENTED, ids=[kind for kind, _ in DOCUMENTED])
def test_troubleshooting_names_every(kind, enum):
    text = _troubleshooting()
    missing = sorted(r for r in enum if f"`{r}`" not in text)
    assert not missing, f"docs/troubleshooting.md does not explain the {kind}s {missing}"


def test_every_member_state_is_explained():
    text = (DOCS / "membership-and-metrics.md").read_text()
    missing = sorted(s for s in MemberState if f"| `{s}` |" not in text)
    assert not missing, f"docs/membership-and-metrics.md does not explain the member states {missing}"


def test_every_operator_metric_is_documented():
    names = set(re.findall(r'"(omnistage_[a-z_]+)"', (OPERATOR / "runtime" / "metrics.py").read_text()))
    assert {"omnistage_engine_patch", "omnistage_condition", "omnistage_replicas"} <= names
    text = (DOCS / "membership-and-metrics.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"docs/membership-and-metrics.md does not describe {missing}"


# ----- the GPU tier's variables -------------------------------------------------------------------------

def _variables_read() -> set[str]:
    """Environment names written as string literals in the GPU tier and hack/gpu-repro.py."""
    sources = [*sorted((ROOT / "tests" / "gpu").glob("*.py")), ROOT / "hack" / "gpu-repro.py"]
    names = set()
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"KUBECONFIG|OMNISTAGE_[A-Z_]+", node.value):
                names.add(node.value)
    return names - {ENGINE_IMAGE_ENV}  # the operator's own variable, set on its Deployment


def _makefile_test_gpu_block() -> str:
    text = (ROOT / "Makefile").read_text()
    head, sep, _ = text.partition("\ntest-gpu:")
    assert sep, "the Makefile has no test-gpu target"
    return head.rsplit("\n\n", 1)[-1]  # the comment block right above the target


def test_gpu_variables_are_documented_in_docs_and_makefile():
    read = _variables_read()
    assert {"OMNISTAGE_GPU_CLUSTER", "OMNISTAGE_KUBECTL", "OMNISTAGE_GPU_PRODUCT"} <= read
    assert read <= set(SETTINGS), (
        f"read but not in tests/gpu/support.SETTINGS: {sorted(read - set(SETTINGS))}"
    )
    docs, make = (DOCS / "gpu-tests.md").read_text(), _makefile_test_gpu_block()
    for name in [*SETTINGS, "PYTEST_ARGS"]:
        assert f"`{name}`" in docs, f"docs/gpu-tests.md does not document {name}"
        assert name in make, f"the Makefile's comments above test-gpu do not document {name}"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_targets():
    def dry(*args: str) -> str:
        return subprocess.run(["make", "-n", *args], capture_output=True, text=True, cwd=ROOT, timeout=30,
                              check=True).stdout

    assert "omnistage docs > docs/reference.md" in dry("docs")
    gpu = dry("test-gpu", "KUBECONFIG=/tmp/gpu.kubeconfig", "PYTEST_ARGS=-k serving")
    assert "OMNISTAGE_USE_EXISTING_CLUSTER=1 OMNISTAGE_GPU_CLUSTER=1" in gpu
    assert "pytest tests/gpu" in gpu and "-k serving" in gpu and "/tmp/gpu.kubeconfig" in gpu


# ----- links ------------------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path) -> set[str]:
    text = path.read_text()
    found = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}
    return found | set(re.findall(r'<a id="([^"]+)"></a>', text))


BENCH = DOCS / "bench"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted(BENCH.glob("*.md"))]
README_LINES = 160


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_in_the_repository_and_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks are not links
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"https?://", target):
            continue
        assert "://" not in target and not target.startswith("/"), f"{page.name}: {target}"
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        assert dest.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
        assert dest.exists(), f"{page.name} links to a missing file: {target}"
        if anchor:
            assert anchor in _anchors(dest), f"{page.name}: no anchor #{anchor} in {dest.relative_to(ROOT)}"
    assert "shared/DESIGN.md" not in page.read_text()


def test_readme_points_to_the_guide_and_the_index_is_complete():
    readme = (ROOT / "README.md").read_text()
    assert "## Documentation" in readme and "(docs/README.md)" in readme and "(docs/design.md)" in readme
    assert readme.startswith("# omnistage-operator\n\n```bash\nmake demo")
    index = (DOCS / "README.md").read_text()
    for page in [*sorted(DOCS.glob("*.md")), *sorted(BENCH.glob("*.md"))]:
        if page.name != "README.md":
            link = page.relative_to(DOCS).as_posix()
            assert f"]({link})" in index, f"docs/README.md does not list {link}"


def test_the_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, (
        f"README.md has {lines} lines, over {README_LINES}: move the detail to a page of docs/ and link it"
    )


HEADLINE = re.compile(r"\*\*.*\d", flags=re.DOTALL)  # opens in bold, and says a figure


def headline(text: str) -> str:
    """The first paragraph after a page's title."""
    body = text.split("\n", 1)[1] if text.startswith("# ") else ""
    return body.strip().split("\n\n", 1)[0]


def test_the_headline_reader_sees_a_figure():
    """Negative control for the test below: a page that opens with its method has no headline."""
    assert HEADLINE.match(headline("# P\n\n**0 errors in 40 requests.** More.\n\n## How"))
    assert not HEADLINE.match(headline("# P\n\n`make bench` runs 40 requests.\n\n## Results"))
    assert headline("no title\n\n**1**") == ""


@pytest.mark.parametrize("page", sorted(BENCH.glob("*.md")), ids=lambda p: p.name)
def test_a_benchmark_page_opens_with_its_headline_figure(page):
    first = headline(page.read_text())
    assert HEADLINE.match(first), (
        f"docs/bench/{page.name}: the paragraph under the title must open in bold with the headline figure"
    )
