"""The membership steps: joins and leaves on the head, the drain of a replica someone else deletes,
and each gated pod's joined condition kept equal to what the head says."""

from __future__ import annotations

from omnistage_engine_patches import contract

from ..api.conditions import EventReason, Type
from ..names import A_LEAVING
from ..render.pods import SHUTDOWN_SECONDS
from . import pods
from .actions import Action, Join, LeaveDeparted, MarkJoined, PostEvent, StartLeave
from .state import Pass


def sync(p: Pass) -> list[Action]:
    """Join every Ready replica the head has not acknowledged; make the head forget every replica
    whose pod is gone (it would otherwise wait out its 30 s heartbeat timeout)."""
    acts: list[Action] = []
    if p.listing is None:
        return acts
    live = {pods.name(r): r for r in p.live()}
    head_ip = pods.ip(p.head)
    for stage in p.stage_ids():
        runs = [r for r in live.values() if stage in pods.stage_ids(r)]
        for mm in p.members(stage):
            if contract.is_head_local(mm, head_ip) or mm.get("state") == contract.LEFT:
                continue
            pod = live.get(mm.get("pod")) or next((r for r in runs if pods.ip(r) == mm.get("host")), None)
            if pod is None and p.disrupted(mm) is None:
                acts.append(
                    LeaveDeparted(mm["replicaId"], str(mm.get("pod") or mm.get("host")), stage)
                )
    acts += drain_disrupted(p)
    for name, pod in live.items():
        if not pods.containers_ready(pod) or pods.annotation(pod, A_LEAVING) is not None \
                or pods.uid(pod) in p.handled or p.standby(pod) \
                or pods.uid(pod) in p.reattaching:  # a standby stays unjoined: unroutable
            continue
        joins: list[int] = []
        for stage in pods.stage_ids(pod):
            if p.joined(pod, stage):
                continue
            if stage == 0 and not p.verdict.consistent:
                # The head holds an unjoined replica unroutable (contract.ROUTE_JOINED_ONLY_ENV); the
                # multimodal cache guarantee is stage 0's (later stages take no frontend media).
                p.membership_problem = (
                    f"{name} is not joined: {Type.CACHE_CONSISTENT} is False ({p.verdict.reason})"
                )
                joins = []
                break
            joins.append(stage)
        if not joins:
            continue
        if pods.gated(pod) and pods.joined_condition(pod):
            # Not joined, yet its condition says so (kwok's start-up True, a stale word): the
            # truth first, in case the join is refused.
            acts.append(MarkJoined(name, pods.uid(pod), False))
        said = (f"pool pod {name} joined stage {{stage}} as replica {{replica}}" if pods.pool(pod)
                else f"replica pod {name} joined the engine as replica {{replica}}")
        # Ready at once when every join lands.
        acts.append(Join(name, pods.uid(pod), pods.ip(pod), tuple(joins), said, mark=pods.gated(pod)))
    return acts


def drain_disrupted(p: Pass) -> list[Action]:
    """A replica pod someone else deletes keeps its engine running for its grace period (its
    preStop hook is draining it already): have the head stop routing to it and drain it within
    what remains of that grace, less the engine's own shutdown. Once per pod (the drain state).
    Also when the hook's leave got there first (the member is draining): the head's leave is
    idempotent (the second waits for the first), and the drain is said (Event, Leaving) either way."""
    acts: list[Action] = []
    for r in p.o.replicas:
        if not pods.terminating(r) or pods.uid(r) in p.o.drains:
            continue
        leaves = tuple((stage, mm["replicaId"]) for stage in pods.stage_ids(r)
                       if (mm := p.member_of(r, stage)) is not None and mm.get("pod") == pods.name(r)
                       and mm.get("state") != contract.LEFT)
        if not leaves:
            continue  # left already (the operator's own deletes come after the leave), or never joined
        drain = max(0, min(p.drain_of(r), pods.grace_left(r, p.at) - SHUTDOWN_SECONDS))
        kind = "pool pod" if pods.pool(r) else "replica pod"
        if pods.gated(r) and pods.joined_condition(r):
            acts.append(MarkJoined(pods.name(r), pods.uid(r), False))
        acts.append(PostEvent(
            "Normal",
            EventReason.DISRUPTED,
            f"{kind} {pods.name(r)} is being deleted by someone else "
            f"(eviction, node drain, kubectl delete): draining it for up to {drain}s",
        ))
        acts.append(StartLeave(pods.name(r), pods.uid(r), leaves, drain))
    return acts


def mark_joined(p: Pass) -> list[Action]:
    """Keep each gated pod's joined condition equal to what the head says: True while every
    replica it runs is joined, False while it leaves or the head does not route to it (kwok,
    for one, writes True into every readiness gate at start-up). Unread membership changes
    nothing but a leaving pod."""
    acts: list[Action] = []
    planned = {a.pod for a in p.actions if isinstance(a, MarkJoined)}
    for r in p.live():
        if not pods.gated(r) or pods.name(r) in planned:
            continue
        leaving = pods.annotation(r, A_LEAVING) is not None or pods.uid(r) in p.handled
        if p.listing is None and not leaving:
            continue
        # Live, not only joined: a silent engine leaves the Endpoints and the PodDisruptionBudget's
        # count until its heartbeats resume.
        # A standby is never routed to: its gate stays False.
        want = not leaving and not p.standby(r) and all(p.engine_live(r, s) for s in pods.stage_ids(r))
        if want != pods.joined_condition(r):
            acts.append(MarkJoined(pods.name(r), pods.uid(r), want))
    return acts
