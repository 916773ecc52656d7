"""Kubernetes-style conditions, merged by type: lastTransitionTime moves only when status does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TYPES = ["Ready", "HeadReady", "ReplicasAvailable", "MembershipSynced", "ConfigRendered", "Progressing",
         "ReplicaFailure"]


@dataclass(frozen=True)
class Cond:
    type: str
    status: bool
    reason: str
    message: str = ""


def merge(previous: list[dict[str, Any]], new: list[Cond], generation: int | None, now: str) -> list[dict[str, Any]]:
    """Conditions of types not in `new` are kept as they were."""
    old = {c.get("type"): c for c in previous or []}
    fresh = {c.type for c in new}
    out = [c for c in previous or [] if c.get("type") not in fresh]
    for c in new:
        status = "True" if c.status else "False"
        before = old.get(c.type)
        changed = before is None or before.get("status") != status
        out.append({
            "type": c.type, "status": status, "reason": c.reason, "message": c.message,
            "observedGeneration": generation,
            "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
        })
    return sorted(out, key=lambda c: TYPES.index(c["type"]) if c["type"] in TYPES else len(TYPES))


def ready(head_ready: bool, replicas_available: bool, membership_synced: bool, config_ok: bool) -> Cond:
    if not config_ok:
        return Cond("Ready", False, "InvalidSpec", "the spec is invalid; see ConfigRendered")
    missing = [n for n, ok in (("HeadReady", head_ready), ("ReplicasAvailable", replicas_available),
                               ("MembershipSynced", membership_synced)) if not ok]
    if missing:
        return Cond("Ready", False, "Waiting", "waiting for " + ", ".join(missing))
    return Cond("Ready", True, "AllReplicasServing", "head ready, replicas available, membership synced")
