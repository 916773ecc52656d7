"""What the head says about each engine's liveness, and what the pass does with it.

The head's membership listing is the truth: a member is *live* when it is attached and its
heartbeats are on time (``contract.is_live``), *silent* when they stopped past the heartbeat
timeout (the engine_liveness patch keeps it attached and unroutable until they resume) and
*detached* when the head dropped it (its process said DOWN or died, or it was silent for the
coordinator's 600 s). Pod readiness follows from it, never the other way round. A standby's liveness
is its registration's (standby.py: silent or detached, it is replaced at once, not kept).

Pure: reads the Pass, appends to its actions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnistage_engine_patches import contract

from ..api.conditions import EventReason, Reason, Type
from ..api.conditions import get as condition
from ..api.statuses import MemberState
from . import pods
from .actions import Action, PostEvent

if TYPE_CHECKING:
    from .state import Pass


def head_engine_problem(p: Pass) -> tuple[str, str] | None:
    """(HeadReady reason, message) while the head answers but its own stage-0 engine is not live
    (its pod not Ready, unless a replica serves); None otherwise (or when the membership was not read)."""
    if not p.t.distributed or p.listing is None or not p.head_staying() or not pods.answers(p.head):
        return None
    mm = p.head_engine()
    if mm is not None and contract.is_live(mm):
        return None
    name = pods.name(p.head)
    if mm is not None and mm.get("coordinatorStatus") == contract.COORD_SILENT:
        return Reason.HEAD_ENGINE_SILENT, (
            f"head pod {name}: its own stage-0 engine (replica {mm.get('replicaId')}) has sent no heartbeat "
            f"for {mm.get('silentSeconds', '?')}s past the heartbeat timeout: not routed to until its "
            "heartbeats resume"
        )
    what = f"replica {mm.get('replicaId')}, {mm.get('state')}" if mm is not None else "not listed"
    return Reason.HEAD_ENGINE_GONE, (
        f"head pod {name}: its own stage-0 engine is gone ({what}): its liveness probe fails and the kubelet "
        f"restarts it; every replica is then rolled onto the new engine")


def _member(p: Pass, pod: dict[str, Any], holds) -> contract.Member | None:
    """The first member this pod was joined as (under its name) for which `holds(member)`. Never one
    only registered from its address: pod IPs come back, and an old registration from this address
    is another pod's."""
    for stage in pods.stage_ids(pod):
        mm = p.member_of(pod, stage)
        if mm is not None and mm.get("pod") == pods.name(pod) and holds(mm):
            return mm
    return None


def detached(p: Pass, pod: dict[str, Any]) -> contract.Member | None:
    """The member the head detached on its own while this pod, joined as it, still lives."""
    return _member(p, pod, lambda mm: mm.get("state") == contract.DETACHED)


def silent(p: Pass, pod: dict[str, Any]) -> contract.Member | None:
    """The joined member of this pod whose heartbeats are late (kept, unroutable)."""
    return _member(p, pod, lambda mm: mm.get("coordinatorStatus") == contract.COORD_SILENT)


def keep_one_live(p: Pass, victims: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stage-0 scale-down never removes the last live engine: when the head's own engine does not
    serve and every replica that does is a victim, the last of them stays (the victims are ranked
    not-serving first), and the pass says why."""
    if p.listing is None or p.head_serves():
        return victims
    serving_victims = [v for v in victims if p.serves(v)]
    serving_left = [r for r in p.staying(None) if p.serves(r) and r not in victims]
    if not serving_victims or serving_left:
        return victims
    kept = serving_victims[-1]
    problem = head_engine_problem(p)
    head_words = problem[1] if problem else f"head pod {pods.name(p.head)} is not serving"
    p.scale_held = (f"scale-down keeps replica pod {pods.name(kept)}: it is the only live stage-0 engine "
                    f"({head_words})")
    return [v for v in victims if v is not kept]


def announce(p: Pass) -> list[Action]:
    """Warnings when an engine goes silent, the head's own engine is lost or a scale-down is held;
    a Normal Event when an engine's heartbeats resume. Once per change: against the last status."""
    acts: list[Action] = []
    before = {m.get("pod"): m for m in p.previous.get("members") or []}
    for r in p.live(None):
        name, was = pods.name(r), before.get(pods.name(r), {}).get("state")
        mm = silent(p, r)
        if mm is not None and was != MemberState.SILENT:
            acts.append(PostEvent(
                "Warning",
                EventReason.ENGINE_SILENT,
                f"replica pod {name} (stage-0 replica {mm.get('replicaId')}): no heartbeat past the "
                "heartbeat timeout; the head routes nothing to it until its heartbeats resume",
            ))
        elif mm is None and was == MemberState.SILENT and p.serves(r):
            acts.append(PostEvent(
                "Normal", EventReason.ENGINE_RESUMED, f"replica pod {name}: heartbeats resumed, serving again"
            ))
    problem = head_engine_problem(p)
    head_before = condition(p.previous, Type.HEAD_READY)
    if problem is not None and head_before.get("reason") != problem[0]:
        acts.append(PostEvent("Warning", problem[0], problem[1]))
    elif problem is None and head_before.get("reason") == Reason.HEAD_ENGINE_SILENT and p.head_serves():
        acts.append(PostEvent(
            "Normal",
            EventReason.ENGINE_RESUMED,
            f"head pod {pods.name(p.head)}: its own engine's heartbeats resumed, serving again",
        ))
    if p.scale_held and condition(p.previous, Type.MEMBERSHIP_SYNCED).get("message") != p.scale_held:
        acts.append(PostEvent("Warning", Reason.SCALE_DOWN_HELD, p.scale_held))
    return acts
