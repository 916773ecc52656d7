"""The house rule on size: a product module (operator/ and engine_patches/) holds at most 400 lines.

The modules that were over it when the rule got its guard are listed with the size they had then: they
may shrink, not grow, and each leaves the list once it is split (issue 31). The failure message names
the largest modules, so that whoever is stopped here sees where the room is."""

from __future__ import annotations

import pytest

from .conftest import ROOT

CEILING = 400
PRODUCT = (ROOT / "operator" / "omnistage", ROOT / "engine_patches" / "omnistage_engine_patches")
# Over the ceiling when this test came (after the rewrap to 110 columns; control/plan.py, at 473 then,
# left with the straight decision, render/pods.py, at 442, once its exploded argument lists were
# compacted, runtime/kube.py, at 492, split into the client, drift.py and lease.py); generated modules
# are not written by hand and are not counted.
OVER = {
    "engine_patches/omnistage_engine_patches/membership_api.py": 592,
    "operator/omnistage/api/specs.py": 556,
    "operator/omnistage/api/validation.py": 478,
}
GENERATED = {"operator/omnistage/known_pipelines.py"}


def sizes() -> dict[str, int]:
    return {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for root in PRODUCT for p in sorted(root.rglob("*.py"))
        if str(p.relative_to(ROOT)) not in GENERATED
    }


def largest(found: dict[str, int], n: int = 8) -> str:
    return "; ".join(f"{path} {lines}" for path, lines in sorted(found.items(), key=lambda kv: -kv[1])[:n])


def test_no_product_module_is_over_the_ceiling():
    found = sizes()
    over = {path: lines for path, lines in found.items() if lines > OVER.get(path, CEILING)}
    assert not over, (
        f"over {CEILING} lines (or over the size a listed module had): {over}; split by what the code "
        f"decides. Largest now: {largest(found)}"
    )


@pytest.mark.parametrize("path", sorted(OVER))
def test_a_listed_module_is_still_over(path):
    """A module split below the ceiling leaves the list, so the list says what is left to do."""
    lines = sizes().get(path)
    assert lines is not None and lines > CEILING, f"{path} is at {lines}: remove it from OVER"
