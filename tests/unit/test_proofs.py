"""Every proof `make test` leaves out runs in CI: a module with a test marked `full` is in a slice of
tests/proofs.py, which .ci/run runs one of per landing."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from tests import proofs

ROOT = Path(__file__).resolve().parents[2]
FULL = re.compile(r"pytest\.mark\.full\b")
TEST = re.compile(r"^(?:async )?def (test_\w+)", re.MULTILINE)


def _tests_of(module: str) -> set[str]:
    return set(TEST.findall((ROOT / module).read_text()))


def uncovered(slices) -> list[str]:
    """The tests of modules with a `full` test that no slice runs (a slice names a module, all its
    tests, or one test of it: "path::test")."""
    full = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
            if FULL.search(p.read_text())}
    assert full, "no test is marked full: the scan is broken"
    covered: set[tuple[str, str]] = set()
    for s in slices:
        for entry in s.modules:
            module, _, test = entry.partition("::")
            assert (ROOT / module).exists(), f"a slice names a module that does not exist: {module}"
            tests = _tests_of(module)
            assert not test or test in tests, f"a slice names a test that does not exist: {entry}"
            covered |= {(module, t) for t in ([test] if test else tests)}
    return sorted(f"{m}::{t}" for m in full for t in _tests_of(m) if (m, t) not in covered)


def test_every_test_of_a_module_with_a_full_test_is_in_a_slice():
    assert uncovered(proofs.SLICES) == [], "a test of a module with a full test runs in no CI slice"
    runs = [(m, s.engine_version) for s in proofs.SLICES for m in s.modules]
    assert len(runs) == len(set(runs)), "a module or test is in two slices on the same engine version"


def test_a_test_left_out_of_a_split_module_is_found():
    """The check above can fail: drop one test of the split disruptions module from its slice."""
    [roll] = [s for s in proofs.SLICES if s.name == "disruptions-roll"]
    cut = [replace(s, modules=s.modules[1:]) if s is roll else s for s in proofs.SLICES]
    assert uncovered(cut) == [roll.modules[0]]


def test_the_landings_go_round_every_slice():
    n = len(proofs.SLICES)
    assert {proofs.for_landing(k).name for k in range(100, 100 + n)} == {s.name for s in proofs.SLICES}
    assert proofs.for_landing(7) == proofs.for_landing(7 + n)
