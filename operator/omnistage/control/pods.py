"""Pure reading of pod objects (dicts as the API returns them) and the scale-down victim choice."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from ..api.podtemplate import ENGINE_CONTAINER
from ..names import (
    A_HEAD_RESTARTS,
    A_HEAD_UID,
    A_LEAVING,
    A_REPLICA_INDEX,
    A_SERVING_SINCE,
    A_STAGE_IDS,
    A_TEMPLATE_HASH,
    C_JOINED,
    HEAD_ROLES,
    L_POOL,
    L_ROLE,
    ROLE_HEAD,
)


def name(pod: dict[str, Any]) -> str:
    return pod["metadata"]["name"]


def uid(pod: dict[str, Any]) -> str:
    return pod["metadata"]["uid"]


def pool(pod: dict[str, Any]) -> str | None:
    """The OmniStagePool of a pool pod (None: a stage-0 pod)."""
    return pod["metadata"].get("labels", {}).get(L_POOL)


def role(pod: dict[str, Any]) -> str | None:
    return pod["metadata"].get("labels", {}).get(L_ROLE)


def _count(text: str | None) -> int | None:
    """A small non-negative integer as the operator writes one, else None (an annotation is
    untrusted: someone may have written anything there)."""
    return int(text) if text is not None and text.isdigit() and len(text) <= 9 else None


def stage_ids(pod: dict[str, Any]) -> tuple[int, ...]:
    """The stages a pod runs a replica of: its pool's, as rendered; stage 0 for head and replicas.
    () when the annotation is not the operator's (malformed() says so; the pod is replaced)."""
    ids = annotation(pod, A_STAGE_IDS)
    if not ids:
        return (0,)
    parsed = [_count(i) for i in ids.split(",")]
    return () if None in parsed or len(parsed) > 64 else tuple(parsed)


def head_restarts(pod: dict[str, Any]) -> int | None:
    """The head's restartCount when this pod was made (None: not recorded, or not the operator's)."""
    return _count(annotation(pod, A_HEAD_RESTARTS))


def malformed(pod: dict[str, Any]) -> str | None:
    """Why an annotation the operator reads on its own pod is not one it wrote, or None. Such a pod
    is foreign state: it is replaced, and no pass raises on it."""
    for key, valid in ((A_REPLICA_INDEX, lambda v: _count(v) is not None),
                       (A_STAGE_IDS, lambda v: stage_ids(pod) != ()),
                       (A_HEAD_RESTARTS, lambda v: _count(v) is not None)):
        value = annotation(pod, key)
        if value is not None and not valid(value):
            return f"its annotation {key}={value[:40]!r} is not one the operator wrote"
    return None


def annotation(pod: dict[str, Any], key: str) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(key)


def ip(pod: dict[str, Any]) -> str | None:
    return (pod.get("status") or {}).get("podIP")


def index(pod: dict[str, Any]) -> int:
    return _count(annotation(pod, A_REPLICA_INDEX)) or 0


def template_hash(pod: dict[str, Any]) -> str | None:
    return annotation(pod, A_TEMPLATE_HASH)


def head_uid(pod: dict[str, Any]) -> str | None:
    return annotation(pod, A_HEAD_UID)


def restarts(pod: dict[str, Any]) -> int:
    """How often the pod's containers restarted (the kubelet's restartCount)."""
    return sum(
        int(c.get("restartCount") or 0) for c in (pod.get("status") or {}).get("containerStatuses") or []
    )


def terminating(pod: dict[str, Any]) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def grace_left(pod: dict[str, Any], now: str) -> int:
    """Seconds until a terminating pod is killed: its deletionTimestamp is when its grace period ends
    (both RFC 3339, as the API server and conditions.timestamp write them)."""
    end = pod["metadata"].get("deletionTimestamp")
    if not end:
        return 0
    return max(0, int((_parse(end) - _parse(now)).total_seconds()))


def _parse(ts: str) -> datetime:
    return datetime.fromisoformat(ts)


def serving_since(head: dict[str, Any]) -> datetime | None:
    """When this head took over from a dead one (control/spare.py); None when it did not, or when the
    annotation is not a time (anyone who may edit the pod may write it)."""
    value = annotation(head, A_SERVING_SINCE) or ""
    try:
        return _parse(value) if 0 < len(value) <= 40 else None
    except ValueError:
        return None


def terminal(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _condition(pod: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def ready(pod: dict[str, Any]) -> bool:
    """Ready as the kubelet says it: for a replica or pool pod (readiness gate C_JOINED) that means
    serving, joined on the head; for the head, its /health probe."""
    return _true(pod, "Ready")


def ready_since(pod: dict[str, Any]) -> str | None:
    """When the pod last turned Ready (RFC 3339), or None while it is not."""
    return (_condition(pod, "Ready") or {}).get("lastTransitionTime") if ready(pod) else None


def answers(head: dict[str, Any]) -> bool:
    """The head's app answers: Ready, or its engine container started (the kubelet's startup probe
    passed, and it stays so until a restart) and runs. What the operator reads a head on: its
    readiness (/health) is 503 while no live engine serves a stage, and a head whose engines are all
    silent must still be read, to say why and to join a replica that would serve."""
    if ready(head):
        return True
    if terminating(head) or terminal(head):
        return False
    return any(
        c.get("name") == ENGINE_CONTAINER and c.get("started") is True and "running" in (c.get("state") or {})
        for c in (head.get("status") or {}).get("containerStatuses") or []
    )


def containers_ready(pod: dict[str, Any]) -> bool:
    """The engine container runs (and passes its probe, if it has one): what a join waits for. A
    replica pod's Ready waits for the join itself (its readiness gate)."""
    return _true(pod, "ContainersReady")


def _true(pod: dict[str, Any], ctype: str) -> bool:
    c = _condition(pod, ctype)
    return bool(c and c.get("status") == "True") and not terminating(pod) and not terminal(pod)


def gated(pod: dict[str, Any]) -> bool:
    """The pod declares the joined readiness gate (replica and pool pods rendered since it exists)."""
    return any(
        g.get("conditionType") == C_JOINED for g in (pod.get("spec") or {}).get("readinessGates") or []
    )


def joined_condition(pod: dict[str, Any]) -> bool:
    """What the pod's joined condition says now (the operator's last word on it)."""
    c = _condition(pod, C_JOINED)
    return bool(c and c.get("status") == "True")


def unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's message when it could not place the pod, else None."""
    c = _condition(pod, "PodScheduled")
    if c and c.get("status") == "False":
        return c.get("message") or c.get("reason") or "Unschedulable"
    return None


def scheduled(pod: dict[str, Any]) -> bool:
    return bool((pod.get("spec") or {}).get("nodeName"))


def mounting(pod: dict[str, Any]) -> bool:
    """Scheduled and not started: its kubelet is mounting its volumes (the membership Secret's too)."""
    return scheduled(pod) and not terminating(pod) and (pod.get("status") or {}).get("phase") == "Pending"


def created(pod: dict[str, Any]) -> str:
    return pod["metadata"].get("creationTimestamp") or ""


def choose_victims(replicas: list[dict[str, Any]], count: int,
                   serving: Callable[[dict[str, Any]], bool] = ready) -> list[dict[str, Any]]:
    """Which replica pods leave on scale-down: those already leaving (a crash mid-scale must finish
    the same choice), then unscheduled ones (they serve nothing), then those not `serving` (the
    head's word: detached, silent, not joined, loading), then not-ready, then the newest (the
    oldest have the warmest caches). Ties go to the highest index, so the choice is stable."""
    def rank(pod: dict[str, Any]) -> tuple:
        return (
            annotation(pod, A_LEAVING) is None,
            scheduled(pod),
            serving(pod),
            ready(pod),
            _neg(created(pod)),
            -index(pod),
        )
    return sorted(replicas, key=rank)[:max(0, count)]


def _neg(timestamp: str) -> tuple[int, ...]:
    """Sort key that puts later RFC 3339 timestamps first."""
    return tuple(-ord(c) for c in timestamp)


def free_indices(replicas: list[dict[str, Any]], count: int) -> list[int]:
    """The lowest replica indices (from 1) not used by any existing pod: deterministic names make a
    create after a crash a harmless conflict instead of a duplicate pod."""
    used = {index(p) for p in replicas}
    out, i = [], 1
    while len(out) < count:
        if i not in used:
            out.append(i)
        i += 1
    return out


def spares(candidates: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """Spare head pods (control/spare.py), the one to keep first: not terminating, then the newest."""
    return tuple(sorted(candidates, key=lambda h: (terminating(h), _neg(created(h)))))


def heads(candidates: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the serving head, the one the Services select; the head beside it during a head change, its
    successor or its predecessor). Of several, one not terminating first, then the newest: when the
    move of the Services was cut off between its two label patches (two ROLE_HEAD pods), the newer is
    the serving one and the older its predecessor."""
    def pick(of: list[dict[str, Any]]) -> dict[str, Any] | None:
        return min(of, key=lambda h: (terminating(h), _neg(created(h)))) if of else None
    serving = pick([h for h in candidates if role(h) == ROLE_HEAD])
    rest = [h for h in candidates if h is not serving and role(h) in HEAD_ROLES]
    return serving, pick(rest)
