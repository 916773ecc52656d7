"""Which engine pods go and which are made, as steps of a pass (plan.decided_pass runs them in this
order): retire_stale (pods of another head incarnation, a finished process, a deleted pool, or a
retirement decided earlier), roll (outdated templates, within spec.rollout; standbys first) and
scale (to each group's desired count, plus a roll's surge; stage 0 joins its standbys first and keeps
spec.standby of them: standby.py).

Every pod that goes goes through retire(): the head is told first and the pod deleted once its
replicas have left, so no request is cut off by the deletion. Pure, like the rest of the plan: the
steps only append to the Pass's actions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnistage_engine_patches import contract

from ..api.conditions import EventReason, Progress
from ..names import A_LEAVING
from ..render.common import Pool
from . import liveness, pods, reattach, standby
from .actions import DRAIN_DONE, DRAIN_FAILED, Action, Annotate, CreatePod, MarkJoined, PostEvent, StartLeave

if TYPE_CHECKING:
    from .state import Pass

# Why a replica leaves, by the reason its `leaving` annotation records (the delete's Event says it).
_WHY = {
    Progress.SCALED_DOWN: "spec.replicas is {replicas}",
    Progress.ROLLING_REPLICA: "its pod template changed",
    Progress.ROLLED_REPLICA: "it belongs to a previous head",
    Progress.REPLACED_REPLICA: "its engine exited, it turned NotReady, or the head detached its engine",
    Progress.POOL_DELETED: "its OmniStagePool {pool} is gone",
    Progress.STANDBY_SCALED_DOWN: "spec.standby is {standby}",
}


def retire(p: Pass, pod: dict[str, Any], drain_seconds: int, reason: str, why: str) -> list[Action]:
    """Tell the engine first, then delete: the engine stops routing to the replica and drains it,
    so no request is cut off by the pod's deletion. The drain is started here and finished on a
    later pass (the `leaving` annotation records the decision across passes and restarts)."""
    acts: list[Action] = []
    uid = pods.uid(pod)
    if uid in p.handled or uid in p.gone:
        return acts
    p.handled.add(uid)
    if pods.annotation(pod, A_LEAVING) is None:
        acts.append(Annotate(pods.name(pod), {A_LEAVING: reason}))
    if pods.gated(pod) and pods.joined_condition(pod):
        # NotReady before the head stops routing to it (mark_joined leaves it alone from now on).
        acts.append(MarkJoined(pods.name(pod), uid, False))
    p.progressing.append(reason)
    members = [(stage, p.member_of(pod, stage)) for stage in pods.stage_ids(pod)]
    leaves = tuple((stage, mm["replicaId"]) for stage, mm in members
                   if mm is not None and mm.get("state") != contract.LEFT)
    drain = p.o.drains.get(uid)
    if leaves and p.head_talks() and drain not in (DRAIN_DONE, DRAIN_FAILED):
        if drain is None:  # not started, or started by an operator that has since restarted
            acts.append(StartLeave(pods.name(pod), uid, leaves, drain_seconds))
        return acts  # DRAIN_RUNNING: the pod stays until the head let every stage's replica go
    # Left, never joined, or the head cannot be told (its heartbeat timeout detaches it).
    kind = "pool pod" if pods.pool(pod) else "standby pod" if p.standby(pod) else "replica pod"
    acts.append(p.deletion(pod, reason, f"deleted {kind} {pods.name(pod)}: {why}"))
    return acts


def retire_stale(p: Pass) -> list[Action]:
    """Replicas of another head incarnation or a finished process go at once (replicas whose
    template changed are roll()'s)."""
    acts: list[Action] = []
    if not p.head_live():
        return acts
    head_uid, head_restarts = pods.uid(p.head), pods.restarts(p.head)
    rolled, waiting = [], []
    for r in p.live():
        drain = p.drain_of(r)
        if (why := pods.malformed(r)) is not None:
            acts += retire(p, r, 0, Progress.REPLACED_REPLICA, why)
        elif pods.annotation(r, A_LEAVING) is not None:
            # A retirement decided earlier (this operator or one before a restart) is finished,
            # whatever happened to the spec since.
            reason = pods.annotation(r, A_LEAVING) or Progress.SCALED_DOWN
            acts += retire(
                p,
                r,
                drain
                if reason in (Progress.SCALED_DOWN, Progress.ROLLING_REPLICA, Progress.POOL_DELETED)
                else 0,
                reason,
                _why(p, reason, r),
            )
        elif pods.pool(r) is not None and pods.pool(r) not in p.pool_of:
            acts += retire(p, r, drain, Progress.POOL_DELETED, _why(p, Progress.POOL_DELETED, r))
        elif (made_at := pods.head_restarts(r)) is not None and (
                pods.head_uid(r) != head_uid or head_restarts > made_at):
            # Made for another head pod, or before the head's container restarted: a new engine. A
            # replica whose engine re-attaches (patch reattach) registers with it again (finding a
            # new pod through the master Service); any other never does (a multi-stage head answers
            # nothing until one of every remote stage did, so this is read from the pods, not from
            # the head's boot id).
            what = ("the head pod was replaced" if pods.head_uid(r) != head_uid
                    else f"restartCount {made_at} -> {head_restarts}")
            if (verdict := reattach.fate(p, r)) == reattach.REJOINED:
                acts += reattach.rejoined(p, r)
                acts.append(PostEvent("Normal", Progress.REATTACHED, f"replica pod {pods.name(r)} "
                                      f"re-attached to the new head engine ({what}) without a new pod"))
            elif verdict == reattach.WAITING:
                waiting.append(pods.name(r))
                acts += reattach.wait(p, r)
            elif pods.head_uid(r) != head_uid:
                acts += retire(p, r, 0, Progress.ROLLED_REPLICA, "it belongs to a previous head")
            else:
                rolled.append(what)
                p.head_restarted = True
                acts += retire(p, r, 0, Progress.ROLLED_REPLICA, "its head's engine restarted")
        elif pods.terminal(r):
            acts += retire(p, r, 0, Progress.REPLACED_REPLICA,
                           f"its engine exited ({r['status'].get('phase')})")
        elif (mm := liveness.detached(p, r)) is not None:
            # The head dropped its engine (it said DOWN or died, or was silent for the coordinator's
            # 600 s) while the pod lives: replicas never register again, so a new pod does.
            acts += retire(
                p,
                r,
                0,
                Progress.REPLACED_REPLICA,
                f"the head detached its engine (stage {mm.get('stage')} "
                f"replica {mm.get('replicaId')}): its process exited or its heartbeats stopped for good",
            )
        elif standby.hold_failed(p, r):
            why = "it is a standby the head still routes to and its hold failed: a new standby replaces it"
            acts.append(PostEvent("Warning", Progress.REPLACED_REPLICA, f"standby pod {pods.name(r)}: {why}"))
            acts += retire(p, r, p.drain_of(r), Progress.REPLACED_REPLICA, why)
        elif p.standby(r) and (mm := standby.detached(p, r) or standby.silent(p, r)) is not None:
            # Nothing is routed to a standby, so nothing waits for it to resume: a new pod is the
            # quickest way back to a standby a scale-up can join.
            what = "dropped its engine" if mm.get("state") == contract.DETACHED else "heard no heartbeat"
            why = (f"it is a standby and the head {what} (stage {mm.get('stage', 0)} replica "
                   f"{mm.get('replicaId')}, registered, never joined): a new standby replaces it")
            # Said once: from the next pass on it is leaving (the branch above).
            acts.append(PostEvent("Warning", Progress.REPLACED_REPLICA, f"standby pod {pods.name(r)}: {why}"))
            acts += retire(p, r, 0, Progress.REPLACED_REPLICA, why)
        elif p.listing is not None and p.member_of(r) is not None and not pods.containers_ready(r):
            # Its container, not its Ready (that waits for the join): a replica the head
            # lists whose engine stopped answering.
            acts += retire(p, r, 0, Progress.REPLACED_REPLICA, "it turned NotReady")
        else:
            acts += reattach.remember(p, r)
    if waiting:
        p.progressing.append(Progress.REATTACHING)
        p.head_restarted = True
    if rolled:
        acts.append(PostEvent(
            "Warning",
            Progress.HEAD_RESTARTED,
            f"head engine restarted ({rolled[0]}); rolling every replica"
            + (" and every pool pod" if p.t.spec.stages else "")
            + " bound to the engine before",
        ))
    return acts


# -- rollouts: surge first, then drain (spec.rollout)
def groups(p: Pass) -> list[tuple[Pool | None, int]]:
    """Each set of pods a count applies to: stage-0 replicas, then every pool that runs."""
    return [(None, p.replica_desired()), *((f.pool, f.pool.spec.replicas) for f in p.pools if f.runs)]


def outdated(p: Pass, pool: Pool | None) -> list[dict[str, Any]]:
    """Staying pods of the group whose template changed (none without a live head: its replicas
    are bound to it and go with it, whatever their template; nor while a head change replaces them
    with their head)."""
    if not p.head_live() or p.holds_outdated_head():
        return []
    return [r for r in p.staying(pool.name if pool else None) if p.want(r) is not None
            and pods.template_hash(r) != pods.template_hash(p.want(r))]


def surge(p: Pass, pool: Pool | None) -> int:
    """Pods a roll of the group may run beyond its desired count (its replacements, made first: a
    standby joined, else a new pod). Outdated standbys are no replicas: the refill replaces them."""
    if pool is None and p.change.replica_target == 0:
        return 0  # a head change's old set is emptied, not rolled
    return min(p.t.spec.rollout.max_surge, sum(1 for r in outdated(p, pool) if not p.standby(r)))


def surge_blocked(p: Pass, pool: Pool | None) -> str | None:
    """The scheduler's word on a replacement pod of a rolling group that found no node (no GPU
    free for a surge), else None."""
    old = outdated(p, pool)
    if not old:
        return None
    stuck = [f"{pods.name(r)}: {pods.unschedulable(r)}" for r in p.staying(pool.name if pool else None)
             if pods.unschedulable(r) and r not in old]
    return "; ".join(stuck) or None


def roll(p: Pass) -> list[Action]:
    """Replace outdated pods within spec.rollout. Their replacements are created first (scale()
    allows surge() extra pods) and an outdated pod is drained only while at least desired -
    maxUnavailable others serve (Ready: joined). Outdated pods that serve nothing go first, at no
    cost. No GPU free for a surge pod: one pod at a time (its GPU goes to the replacement, and
    the next waits until that one joined)."""
    acts: list[Action] = []
    if not p.head_live():
        return acts
    r = p.t.spec.rollout
    for pool, desired in groups(p):
        old = outdated(p, pool)
        for s in [x for x in old if p.standby(x)]:  # they serve nothing: replaced first, all at once
            acts += retire(p, s, 0, Progress.ROLLING_REPLICA, "its pod template changed")
        old = [x for x in old if not p.standby(x)]
        if not old:
            continue
        one_at_a_time = r.max_surge == 0 or surge_blocked(p, pool) is not None
        floor = desired - max(r.max_unavailable, 1 if one_at_a_time else 0)
        serving = sum(1 for x in p.staying(pool.name if pool else None) if p.serves(x))
        for x in sorted(old, key=p.serves):
            if p.serves(x):
                if serving - 1 < floor:
                    break
                serving -= 1
            acts += retire(p, x, p.drain_of(x), Progress.ROLLING_REPLICA, "its pod template changed")
    return acts


def scale(p: Pass) -> list[Action]:
    acts: list[Action] = []
    t = p.t
    acts += _scale(p, None, p.replica_desired(), f"spec.replicas {t.spec.replicas}")
    for fitted in p.pools:
        if fitted.runs:  # a pool that cannot run keeps the pods it has (loses nothing) and gets no more
            acts += _scale(p, fitted.pool, fitted.pool.spec.replicas,
                   f"OmniStagePool {fitted.name} spec.replicas {fitted.pool.spec.replicas}")
    return acts


def _scale(p: Pass, pool: Pool | None, desired: int, why: str) -> list[Action]:
    """The group to `desired` pods (plus a roll's surge), its standbys (standby.py) beside: a scale-up
    joins them first, a scale-down keeps a victim as one while they are short, and the standbys are
    then trimmed or refilled to the group's spec.standby."""
    acts: list[Action] = []
    name = pool.name if pool else None
    staying, standbys = standby.split(p, p.staying(name))
    want = desired + surge(p, pool)  # a roll's replacements, beyond desired until the outdated pods left
    new = 0
    if len(staying) > want:
        victims = pods.choose_victims(staying, len(staying) - want, serving=p.serves)
        if pool is None:
            victims = liveness.keep_one_live(p, victims)
        for victim in victims:
            if standby.keep(p, victim, standbys, acts):
                continue
            acts += retire(p, victim, p.drain_of(victim), Progress.SCALED_DOWN,
                           _why(p, Progress.SCALED_DOWN, victim))
    elif len(staying) < want:
        new = want - len(staying) - standby.join(p, standbys, want - len(staying), why, acts)
    for s in standby.surplus(p, standbys, name):
        acts += retire(p, s, 0, Progress.STANDBY_SCALED_DOWN, _why(p, Progress.STANDBY_SCALED_DOWN, s))
    refill = max(0, p.standby_desired(name) - len(standbys))
    # Pool pods too are created once the head has an IP, not once it is Ready: the head turns Ready
    # only after one replica of each remote stage registered. Replicas first, then the standbys.
    if (new or refill) and p.head_live():
        every = [r for r in p.o.replicas + p.change.names_held if pods.pool(r) == name]
        for n, i in enumerate(pods.free_indices(every, new + refill)):
            if n >= new:
                acts.append(standby.create(p, i, name))
                continue
            want_pod = p.want_pool_pod(pool, i) if pool else p.want_replica(i)
            kind = "pool pod" if pool else "replica pod"
            acts.append(CreatePod(want_pod, EventReason.SCALED_UP, f"created {kind} {{pod}} ({why})"))
            p.progressing.append(Progress.SCALING_UP)
    return acts


def _why(p: Pass, reason: str, pod: dict[str, Any]) -> str:
    fitted = p.pool_of.get(pods.pool(pod) or "")
    replicas = fitted.pool.spec.replicas if fitted and fitted.pool else p.t.spec.replicas
    why = _WHY.get(reason, "it was leaving").format(replicas=replicas, pool=pods.pool(pod),
                                                     standby=p.standby_desired(pods.pool(pod)))
    return f"its pool's {why}" if fitted and reason == Progress.SCALED_DOWN else why
