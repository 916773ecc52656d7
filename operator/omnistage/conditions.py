"""Kubernetes-style conditions, merged by type: lastTransitionTime moves only when status does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Condition types (KubeRay-style constants: one spelling, used everywhere).
READY = "Ready"
HEAD_READY = "HeadReady"
REPLICAS_AVAILABLE = "ReplicasAvailable"
MEMBERSHIP_SYNCED = "MembershipSynced"
CACHE_CONSISTENT = "CacheConsistent"
CONFIG_RENDERED = "ConfigRendered"
PROGRESSING = "Progressing"
REPLICA_FAILURE = "ReplicaFailure"
# With spec.stages: every stage >= 1 runs in exactly one valid OmniStagePool; every stage has its
# pool's replicas joined on the head.
STAGES_COVERED = "StagesCovered"
STAGES_READY = "StagesReady"
TYPES = [READY, HEAD_READY, REPLICAS_AVAILABLE, MEMBERSHIP_SYNCED, CACHE_CONSISTENT, CONFIG_RENDERED, PROGRESSING,
         REPLICA_FAILURE, STAGES_COVERED, STAGES_READY]

# CacheConsistent reasons: the engine's real stage-0 frontend cache against status.effectiveCacheMode.
R_CONSISTENT = "Consistent"
R_ENGINE_UNREPORTED = "EngineUnreported"  # the head has not said what it runs (starting, old or no plugin)
R_PATCH_NOT_APPLIED = "PatchNotApplied"  # a patch the mode needs is skipped or disabled in the engine
R_CACHE_MISMATCH = "CacheMismatch"  # the frontend built another cache than the OmniStage promises

# ConfigRendered / Ready reasons.
R_RENDERED = "Rendered"
R_INVALID_SPEC = "InvalidSpec"

# Event reasons (and Progressing reasons: what a pass did), one spelling for plan.py and act.py.
R_CONFIG_RENDERED = "ConfigRendered"  # the ConfigMap was created or changed
R_CHILD_SYNCED = "ChildSynced"  # a Service or the NetworkPolicy was created or changed
R_CREATED_HEAD = "CreatedHead"
R_ROLLING_HEAD = "RollingHead"
R_HEAD_RESTARTED = "HeadRestarted"
R_ROLLED_REPLICA = "RolledReplica"  # it belonged to a previous head
R_REPLACED_REPLICA = "ReplacedReplica"  # its engine exited or it turned NotReady
R_ROLLING_REPLICA = "RollingReplica"  # its pod template changed
R_SCALED_DOWN = "ScaledDown"
R_SCALED_UP = "ScaledUp"
R_JOINED = "Joined"
R_LEFT = "Left"
R_DRAIN_TIMEOUT = "DrainTimeout"
R_LEAVE_FAILED = "LeaveFailed"
R_POOL_DELETED = "PoolDeleted"
R_CREATE_REFUSED = "CreateRefused"  # the API server refused a pod (admission, quota): message has its words  # a pool pod whose OmniStagePool is gone leaves (drained) and is deleted

# StagesCovered / StagesReady reasons (a pool's own Ready=False reasons are in pools.py).
R_ALL_COVERED = "AllCovered"
R_UNCOVERED = "Uncovered"
R_ALL_STAGES_SERVING = "AllStagesServing"
R_STAGES_WAITING = "Waiting"


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


def ready(head_ready: bool, replicas_available: bool, membership_synced: bool, config_ok: bool,
          cache_consistent: bool, stages_ready: bool = True) -> Cond:
    if not config_ok:
        return Cond(READY, False, R_INVALID_SPEC, "the spec is invalid; see ConfigRendered")
    missing = [n for n, ok in ((HEAD_READY, head_ready), (REPLICAS_AVAILABLE, replicas_available),
                               (MEMBERSHIP_SYNCED, membership_synced), (CACHE_CONSISTENT, cache_consistent),
                               (STAGES_READY, stages_ready)) if not ok]
    if missing:
        return Cond(READY, False, "Waiting", "waiting for " + ", ".join(missing))
    return Cond(READY, True, "AllReplicasServing",
                "head ready, replicas available, membership synced, engine cache consistent")
