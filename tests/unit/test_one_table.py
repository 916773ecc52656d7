"""One concept, one table (issue 31): what several layers need to agree on is written once, and these
tests find a second spelling in the product code."""

from __future__ import annotations

import re

from .conftest import ROOT

OPERATOR = ROOT / "operator" / "omnistage"


def _sources(root=OPERATOR):
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(root.rglob("*.py"))}


def test_replica_pods_are_worked_out_once():
    """spec.replicas counts engine pods, head included: Target.replica_pods says how many of them are
    replica pods, and nothing else subtracts the head again."""
    again = re.compile(r"spec\.replicas\s*-\s*1|range\(1,\s*[\w.]*spec\.replicas\)")
    found = [path for path, text in _sources().items()
             if again.search(text) and path != "operator/omnistage/render/common.py"]
    assert found == []
