"""The engine tier's negative controls (tests/engine/negative_controls.py) cover every patch, each with a
count of the regression tests that must fail, and a control whose count differs fails (issue 41 item 3).

The controls themselves run the engine tier with a patch off (make test-negative); here only their
table and their verdict, which need no vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest
from omnistage_engine_patches import contract

from tests.engine.negative_controls import CONTROLS, PATCH_IS_APPLIED, Control, judge

ENGINE_TIER = Path(__file__).resolve().parents[1] / "engine"


def test_every_patch_has_a_control_of_its_own():
    patches = [c.patch for c in CONTROLS]
    assert sorted(set(contract.PATCHES) - set(patches)) == [], "a patch without a negative control"
    assert sorted(set(patches) - set(contract.PATCHES)) == [], "a control for no patch of contract.PATCHES"
    assert len(patches) == len(set(patches)), "a patch with two controls: one count each"


@pytest.mark.parametrize("control", CONTROLS, ids=lambda c: c.patch)
def test_a_control_names_its_modules_and_how_many_regression_tests_fail(control):
    assert control.fails >= 1, "a control whose regression tests all pass with the patch off tests nothing"
    assert control.modules and all((ENGINE_TIER / m).is_file() for m in control.modules), control.modules


def outcomes(regression: dict[str, str], other: dict[str, str] | None = None) -> dict[str, dict[str, object]]:
    """A control run's record, as its plugin side writes it: each test's outcome, and whether it is a
    regression test."""
    return {**{n: {"regression": True, "outcome": o} for n, o in regression.items()},
            **{n: {"regression": False, "outcome": o} for n, o in (other or {}).items()}}


CONTROL = Control("some_patch", ("test_some_patch.py",), 2)


@pytest.mark.parametrize(("failed", "passed_anyway"), [(2, 0), (2, 1)])
def test_the_named_count_of_failures_is_a_pass(failed, passed_anyway):
    run = outcomes({**{f"test_regression_{i}": "failed" for i in range(failed)},
                    **{f"test_regression_other_{i}": "passed" for i in range(passed_anyway)}},
                   {PATCH_IS_APPLIED: "failed", "test_unchanged": "passed"})
    assert judge(CONTROL, run, 1.0).problems == []


@pytest.mark.parametrize("failed", [0, 1, 3])
def test_another_count_of_failures_fails_the_control(failed):
    caught = {f"test_regression_{i}": "failed" for i in range(failed)}
    run = outcomes({**caught, "test_regression_kept": "passed"})
    [problem] = judge(CONTROL, run, 1.0).problems
    assert f"{failed} regression tests failed where the control names 2" in problem
    assert "test_regression_kept" in problem, "the regression test that passed anyway is named"
    assert ("they test nothing" in problem) is (failed == 0)


def test_an_undocumented_failure_still_fails_the_control():
    run = outcomes({"test_regression_a": "failed", "test_regression_b": "failed"},
                   {"test_unchanged": "failed"})
    [problem] = judge(CONTROL, run, 1.0).problems
    assert "neither a regression test nor documented" in problem and "test_unchanged" in problem
