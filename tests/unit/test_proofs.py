"""Every proof `make test` leaves out runs in CI: a module with a test marked `full` is in a slice of
tests/proofs.py, which .ci/run runs one of per landing."""

from __future__ import annotations

import re
from pathlib import Path

from tests import proofs

ROOT = Path(__file__).resolve().parents[2]
FULL = re.compile(r"pytest\.mark\.full\b")


def test_every_module_with_a_full_test_is_in_a_slice():
    full = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
            if FULL.search(p.read_text())}
    sliced = [m for s in proofs.SLICES for m in s.modules]
    assert full, "no test is marked full: the scan is broken"
    assert sorted(full - set(sliced)) == [], "a module with a full test runs in no CI slice"
    runs = [(m, s.engine_version) for s in proofs.SLICES for m in s.modules]
    assert len(runs) == len(set(runs)), "a module is in two slices on the same engine version"
    assert all((ROOT / m).exists() for m in sliced), "a slice names a module that does not exist"


def test_the_landings_go_round_every_slice():
    n = len(proofs.SLICES)
    assert {proofs.for_landing(k).name for k in range(100, 100 + n)} == {s.name for s in proofs.SLICES}
    assert proofs.for_landing(7) == proofs.for_landing(7 + n)
