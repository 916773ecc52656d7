"""Reading an object's status the way kubectl shows it: its conditions and a pod's readiness. One copy
for the cluster, GPU and bench tiers (issue 31: these were written once per tier)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def condition(obj: Mapping[str, Any] | None, ctype: str) -> dict[str, Any]:
    """The condition of type `ctype` in obj's status, or {}."""
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c.get("type") == ctype), {})


def is_true(obj: Mapping[str, Any] | None, ctype: str) -> bool:
    return condition(obj, ctype).get("status") == "True"


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Running, with its Ready condition True (what a Service's endpoints and `kubectl get` count)."""
    return (pod.get("status") or {}).get("phase") == "Running" and is_true(pod, "Ready")
