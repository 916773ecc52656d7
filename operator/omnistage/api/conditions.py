"""Kubernetes-style conditions, merged by type: lastTransitionTime moves only when status does."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any


class Type(StrEnum):
    """Condition types, in the order status lists them."""

    READY = "Ready"
    HEAD_READY = "HeadReady"
    REPLICAS_AVAILABLE = "ReplicasAvailable"
    MEMBERSHIP_SYNCED = "MembershipSynced"
    CACHE_CONSISTENT = "CacheConsistent"
    CONFIG_RENDERED = "ConfigRendered"
    PROGRESSING = "Progressing"
    REPLICA_FAILURE = "ReplicaFailure"
    # A roll (template change) creates its replacement pods before outdated ones leave (spec.rollout):
    # False when no GPU is free for a surge pod and the roll goes one pod at a time.
    ROLLOUT_SURGE = "RolloutSurge"
    # With spec.stages: every stage >= 1 runs in exactly one valid OmniStagePool; every stage has its
    # pool's replicas joined on the head.
    STAGES_COVERED = "StagesCovered"
    STAGES_READY = "StagesReady"


TYPES = list(Type)
STAGE_TYPES = (Type.STAGES_COVERED, Type.STAGES_READY)  # set only with spec.stages


class Reason(StrEnum):
    """Every condition reason the operator sets, by condition. An Event that announces a condition
    (InvalidSpec, Uncovered, PatchNotApplied, a CacheConsistent verdict) carries the same reason."""

    # ConfigRendered (and Ready, and an OmniStagePool's Ready when its spec is not even a valid model)
    RENDERED = "Rendered"
    INVALID_SPEC = "InvalidSpec"
    CONFIG_TOO_LARGE = "ConfigTooLarge"  # the deploy config would not fit in its ConfigMap (render/target.py)
    # An older OmniStage or OmniStagePool of the namespace needs names its children would take (also an
    # OmniStagePool's Ready): control/collisions.py
    NAME_COLLISION = "NameCollision"
    # HeadReady
    HEAD_READY = "HeadReady"
    HEAD_PENDING = "HeadPending"
    NO_HEAD = "NoHead"
    HEAD_ENGINE_SILENT = "HeadEngineSilent"  # the head pod is Ready, its own engine's heartbeats are late
    HEAD_ENGINE_GONE = (
        "HeadEngineGone"  # the head pod is Ready, its own engine is gone (restarted by liveness)
    )
    # ReplicasAvailable
    ALL_AVAILABLE = "AllAvailable"
    UNAVAILABLE = "Unavailable"
    # MembershipSynced
    SYNCED = "Synced"
    NOT_SYNCED = "NotSynced"
    SCALE_DOWN_HELD = (
        "ScaleDownHeld"  # a scale-down would remove the last live stage-0 engine (also its Event)
    )
    # CacheConsistent: the engine's real stage-0 frontend cache against status.effectiveCacheMode
    CONSISTENT = "Consistent"
    ENGINE_UNREPORTED = "EngineUnreported"  # the head has not said what it runs (starting, old or no plugin)
    PATCH_NOT_APPLIED = (
        "PatchNotApplied"  # a patch the mode needs is skipped or disabled (also StagesReady's)
    )
    CACHE_MISMATCH = "CacheMismatch"  # the frontend built another cache than the OmniStage promises
    # CacheConsistent and MembershipSynced: the head's report or listing broke the operator's bounds on
    # an answer (size, shape, time: runtime/head_answers.py) and was not read
    HEAD_ANSWER_REFUSED = "HeadAnswerRefused"
    # ReplicaFailure: what keeps the pods and children from being what the pass decided
    UNSCHEDULABLE = "Unschedulable"
    ENGINE_EXITED = "EngineExited"
    CHILD_REFUSED = "ChildRefused"  # the API server refused a child (also its Event); the others were applied
    PASS_FAILED = "PassFailed"  # the pass itself failed (also its Event); the next one retries
    NO_FAILURE = "NoFailure"
    # RolloutSurge
    NOT_ROLLING = "NotRolling"
    SURGING = "Surging"
    NO_CAPACITY_FOR_SURGE = "NoCapacityForSurge"
    HEAD_IN_PLACE = (
        "HeadReplacedInPlace"  # a head change that cannot surge (maxSurge 0, spec.stages): an outage
    )
    # Progressing, when the pass itself did nothing (else: the Progress values it did)
    CONVERGING = "Converging"
    STABLE = "Stable"
    # StagesCovered
    ALL_COVERED = "AllCovered"
    UNCOVERED = "Uncovered"
    # StagesReady
    ALL_STAGES_SERVING = "AllStagesServing"
    # Ready (an OmniStage's and an OmniStagePool's), StagesReady
    ALL_REPLICAS_SERVING = "AllReplicasServing"
    WAITING = "Waiting"
    # An OmniStagePool's Ready=False: why it cannot run (pools.py)
    OMNISTAGE_NOT_FOUND = "OmniStageNotFound"
    NOT_MULTI_STAGE = "NotMultiStage"
    UNKNOWN_STAGE = "UnknownStage"
    STAGE_IN_TWO_POOLS = "StageInTwoPools"
    TOO_FEW_GPUS = "TooFewGpus"
    GPU_MEMORY_OVERCOMMITTED = "GpuMemoryOvercommitted"


# An OmniStagePool's Ready=False reasons (the API reference lists them).
POOL_REASONS = (
    Reason.OMNISTAGE_NOT_FOUND,
    Reason.NOT_MULTI_STAGE,
    Reason.UNKNOWN_STAGE,
    Reason.STAGE_IN_TWO_POOLS,
    Reason.TOO_FEW_GPUS,
    Reason.GPU_MEMORY_OVERCOMMITTED,
    Reason.INVALID_SPEC,
)


class Progress(StrEnum):
    """What a pass did: Progressing's reason (the set of them, comma-joined). All but CreatingHead,
    CreatingSpareHead and ScalingUp are also the reason of the Event that says it, and a retirement's
    reason is what the pod's `leaving` annotation records."""

    CREATING_HEAD = "CreatingHead"
    ROLLING_HEAD = "RollingHead"
    HEAD_RESTARTED = "HeadRestarted"
    REATTACHING = "Reattaching"  # replicas of the head's previous engine register again (control/reattach.py)
    REATTACHED = "Reattached"  # one did: it serves the new head without a new pod
    SCALING_UP = "ScalingUp"
    SCALED_DOWN = "ScaledDown"
    ROLLING_REPLICA = "RollingReplica"  # its pod template changed
    ROLLED_REPLICA = "RolledReplica"  # it belonged to a previous head
    REPLACED_REPLICA = "ReplacedReplica"  # its engine exited or it turned NotReady
    POOL_DELETED = "PoolDeleted"  # a pool pod whose OmniStagePool is gone leaves (drained) and is deleted
    # A head change without an outage (control/headswap.py):
    SURGING_HEAD = "SurgingHead"  # a successor head starts beside the serving one
    MOVED_SERVICE = "MovedService"  # the Services select the successor now; the old head drains
    RETIRED_HEAD = "RetiredHead"  # the old head's replicas left; it is deleted
    # A warm spare head (spec.head.standby, control/spare.py):
    CREATING_SPARE_HEAD = "CreatingSpareHead"  # a spare head pod is created (Event CreatedSpareHead)
    SPARE_TOOK_OVER = "SpareTookOver"  # the head's engine died: the Services moved to the spare
    SPARE_RETIRED = "SpareRetired"  # a spare that is not wanted (spec, template, failed) is deleted
    # Standbys (spec.standby, control/standby.py):
    JOINED_STANDBY = "JoinedStandby"  # a scale-up turned a standby into a replica: a join only
    REFILLING_STANDBY = "RefillingStandby"  # a standby pod is created to keep spec.standby of them
    KEPT_STANDBY = "KeptStandby"  # a scale-down kept a replica pod that never joined as a standby
    STANDBY_SCALED_DOWN = "StandbyScaledDown"  # a standby beyond spec.standby leaves (no drain), deleted


class EventReason(StrEnum):
    """The reasons of Events that are neither a condition's (Reason) nor a pass's Progress."""

    CONFIG_RENDERED = "ConfigRendered"  # the ConfigMap was created or changed
    CHILD_SYNCED = (
        "ChildSynced"  # a Service, the NetworkPolicy or a PodDisruptionBudget was created or changed
    )
    CREATED_HEAD = "CreatedHead"
    CREATED_SPARE_HEAD = "CreatedSpareHead"
    SCALED_UP = "ScaledUp"
    JOINED = "Joined"
    LEFT = "Left"
    DRAIN_TIMEOUT = "DrainTimeout"
    LEAVE_FAILED = "LeaveFailed"
    STANDING_BY = "StandingBy"  # a hold returned: the replica is a standby, unroutable, attached
    DISRUPTED = "Disrupted"  # someone else deletes a joined replica or pool pod: drained within its grace
    CREATE_REFUSED = "CreateRefused"  # the API server refused a pod (admission, quota): message has its words
    ENGINE_SILENT = "EngineSilent"  # a joined engine's heartbeats stopped: unroutable, kept (engine_liveness)
    ENGINE_RESUMED = "EngineResumed"  # its heartbeats resumed: serving again
    LABELS_RESTORED = "LabelsRestored"  # an engine pod's operator labels were changed: written back
    STRAY_POD = "StrayPod"  # a pod owned by the OmniStage that the operator did not make as it is: deleted


class PodReason(StrEnum):
    """Reasons of the joined condition the operator sets on replica and pool pods (names.C_JOINED)."""

    JOINED = "Joined"  # the head routes to every replica the pod runs
    NOT_JOINED = "NotJoined"  # not yet, or no longer (leaving, or the head lost it)


@dataclass(frozen=True)
class Cond:
    type: str
    status: bool
    reason: str
    message: str = ""


def timestamp() -> str:
    """Now, in RFC 3339 as conditions and Events carry it."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def get(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    """A status's condition of that type ({} when it has none)."""
    return next((c for c in status.get("conditions", []) if c.get("type") == ctype), {})


def merge(
    previous: list[dict[str, Any]], new: list[Cond], generation: int | None, now: str
) -> list[dict[str, Any]]:
    """Conditions of types not in `new` are kept as they were."""
    old = {c.get("type"): c for c in previous or []}
    fresh = {c.type for c in new}
    out = [c for c in previous or [] if c.get("type") not in fresh]
    for c in new:
        status = "True" if c.status else "False"
        before = old.get(c.type)
        changed = before is None or before.get("status") != status
        out.append({
            # str(): the enums' plain values, as the API server hands them back
            "type": str(c.type), "status": status, "reason": str(c.reason), "message": c.message,
            "observedGeneration": generation,
            "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
        })
    return sorted(out, key=lambda c: TYPES.index(c["type"]) if c["type"] in TYPES else len(TYPES))


def ready(head_ready: bool, replicas_available: bool, membership_synced: bool, cache_consistent: bool,
          stages_ready: bool = True) -> Cond:
    """Ready of a valid spec (an invalid one gets Ready False with its reason from the plan)."""
    missing = [
        n
        for n, ok in (
            (Type.HEAD_READY, head_ready),
            (Type.REPLICAS_AVAILABLE, replicas_available),
            (Type.MEMBERSHIP_SYNCED, membership_synced),
            (Type.CACHE_CONSISTENT, cache_consistent),
            (Type.STAGES_READY, stages_ready),
        )
        if not ok
    ]
    if missing:
        return Cond(Type.READY, False, Reason.WAITING, "waiting for " + ", ".join(missing))
    return Cond(Type.READY, True, Reason.ALL_REPLICAS_SERVING,
                "head ready, replicas available, membership synced, engine cache consistent")
