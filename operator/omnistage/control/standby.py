"""Warm standbys (spec.standby of the OmniStage and of each OmniStagePool): replica or pool
pods kept started, every stage registered with the head and attached, but not joined, so the head holds
them unroutable (contract.ROUTE_JOINED_ONLY_ENV). A scale-up joins one at once instead of waiting a
cold start.

A standby is a replica or pool pod whose role label is ROLE_STANDBY (its pool label says which pool):
outside the PodDisruptionBudget (an unready standby never blocks an eviction, and evicting one takes
nothing out of serving) and the scale selector (spec.replicas, readyReplicas and an HPA count serving
pods only). The label is state, like a head's role: a scale-up turns a standby ROLE_REPLICA (ROLE_POOL)
and membership.sync joins it in the same pass; the standbys are then refilled with new pods.

A scale-down keeps a replica as a standby while the standbys are short of spec.standby: one that
never joined by its label alone, a joined one by its label and the head's hold (membership_ops.hold:
drained, its requests in flight finish, kept attached and unroutable under no pod name). It is never
made to leave: a replica that left is detached, and a replica process registers only once. A standby
the head still routes to under its name (a hold not done yet, cut short by an operator restart, or a
pod relabelled by hand) is held again (hold); one whose hold failed is replaced (rollout.retire_stale).

Pure, like the rest of the plan: these steps append to the Pass's actions. rollout.py calls them for
stage 0 and for each pool (`pool`: its name, None for stage 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnistage_engine_patches import contract

from ..api.conditions import Progress
from ..api.statuses import MemberState
from ..names import A_LEAVING, L_ROLE, ROLE_POOL, ROLE_REPLICA, ROLE_STANDBY
from . import pods
from .actions import DRAIN_FAILED, Action, CreatePod, MarkJoined, PostEvent, SetRole, StartLeave

if TYPE_CHECKING:
    from .state import Pass


def registration(p: Pass, pod: dict[str, Any], stage: int = 0) -> contract.Member | None:
    """The head's entry for a standby's replica of `stage`: registered from its address and not joined
    under any pod name, the newest of them (replica ids rise and are never reused: an older one from
    the same address is an earlier pod's)."""
    ip = pods.ip(pod)
    if not ip or p.head is None:
        return None
    regs = [mm for mm in p.members(stage) if mm.get("host") == ip and not mm.get("pod")
            and not contract.is_head_local(mm, pods.ip(p.head))]
    return max(regs, key=lambda mm: mm.get("replicaId", -1), default=None)


def registrations(p: Pass, pod: dict[str, Any]) -> list[contract.Member | None]:
    """A standby's registration for each stage it runs (a pool pod runs several), its stage id in it."""
    return [None if (mm := registration(p, pod, stage)) is None else {**mm, "stage": stage}
            for stage in pods.stage_ids(pod)]


def warm(p: Pass, pod: dict[str, Any]) -> bool:
    """One join away from serving: its engine runs and the head holds every stage of it attached,
    heartbeats on time."""
    regs = registrations(p, pod)
    return pods.containers_ready(pod) and all(mm is not None and contract.is_live(mm) for mm in regs)


def silent(p: Pass, pod: dict[str, Any]) -> contract.Member | None:
    """A standby's registration whose heartbeats are late (a join would route to a stalled engine)."""
    return next((mm for mm in registrations(p, pod)
                 if mm is not None and mm.get("coordinatorStatus") == contract.COORD_SILENT), None)


def detached(p: Pass, pod: dict[str, Any]) -> contract.Member | None:
    """A standby the head dropped (its process said DOWN or died, or it stayed silent past the
    coordinator's timeout): it never registers again, so it is replaced."""
    return next((mm for mm in registrations(p, pod)
                 if mm is not None and mm.get("state") == contract.DETACHED), None)


def split(p: Pass, staying: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the replicas, the standbys) of stage-0 pods, as this pass leaves their roles."""
    return [r for r in staying if not p.standby(r)], [r for r in staying if p.standby(r)]


def _rank(p: Pass, pod: dict[str, Any]) -> tuple:
    """Which standby joins first: a warm one, then one whose engine runs, then the oldest (lowest index
    on a tie); a silent one last."""
    return (silent(p, pod) is not None, not warm(p, pod), not pods.containers_ready(pod),
            pods.created(pod), pods.index(pod))


def _relabel(p: Pass, pod: dict[str, Any], role: str) -> list[Action]:
    p.roles[pods.uid(pod)] = role
    return [SetRole(pods.name(pod), pods.uid(pod), role)]


def join(p: Pass, standbys: list[dict[str, Any]], count: int, why: str, acts: list[Action]) -> int:
    """A scale-up short of `count` replicas turns up to that many standbys into replicas (membership.sync
    joins them in this pass: a join only) and takes them out of `standbys`; returns how many, its
    actions added to `acts`."""
    chosen = sorted(standbys, key=lambda s: _rank(p, s))[:max(0, count)]
    for s in chosen:
        standbys.remove(s)
        acts += _relabel(p, s, ROLE_POOL if pods.pool(s) else ROLE_REPLICA)
        p.progressing.append(Progress.JOINED_STANDBY)
        state = "joins now" if warm(p, s) else "joins once its engine registered"
        acts.append(PostEvent("Normal", Progress.JOINED_STANDBY, f"standby pod {pods.name(s)} {state} "
                              f"({why}): a new standby refills spec.standby"))
    return len(chosen)


def never_joined(p: Pass, pod: dict[str, Any]) -> bool:
    """The head never joined this pod (read, not guessed): no member under its name, its joined
    condition False, no retirement decided."""
    if p.listing is None or pods.joined_condition(pod) or pods.annotation(pod, A_LEAVING) is not None:
        return False
    name = pods.name(pod)
    return not any(mm.get("pod") == name for stage in pods.stage_ids(pod) for mm in p.members(stage))


def _keepable(p: Pass, pod: dict[str, Any]) -> bool:
    """It can stand by: it never joined, or it is joined and live at the head (a hold keeps it attached);
    a silent or dropped engine, or one whose retirement is decided, goes the usual way."""
    if pods.annotation(pod, A_LEAVING) is not None or pods.uid(pod) in p.handled:
        return False
    return never_joined(p, pod) or all(p.engine_live(pod, stage) for stage in pods.stage_ids(pod))


def keep(p: Pass, victim: dict[str, Any], standbys: list[dict[str, Any]], acts: list[Action]) -> bool:
    """A scale-down victim becomes a standby while the standbys are short of spec.standby: its label
    now, and (hold, later in this pass) the head's hold if it was joined: nothing is lost, nothing
    restarts. Its actions are added to `acts`."""
    pool = pods.pool(victim)
    if len(standbys) >= p.standby_desired(pool) or not _keepable(p, victim):
        return False
    was_joined = not never_joined(p, victim)
    acts += _relabel(p, victim, ROLE_STANDBY)
    standbys.append(victim)
    p.progressing.append(Progress.KEPT_STANDBY)
    how = "drained and held unroutable by the head" if was_joined else "it never joined"
    whose = f"OmniStagePool {pool}" if pool else "spec.replicas"
    acts.append(PostEvent("Normal", Progress.KEPT_STANDBY,
                          f"{_kind(victim)} {pods.name(victim)} is kept as a standby ({whose} "
                          f"{_replicas(p, pool)}, spec.standby {p.standby_desired(pool)}): {how}"))
    return True


def hold(p: Pass) -> list[Action]:
    """Every standby the head still lists joined under its name is held: NotReady first (its joined gate),
    then the head drains it and keeps it attached, unroutable, under no name (StartLeave with hold)."""
    acts: list[Action] = []
    for s in p.live():
        uid = pods.uid(s)
        if not p.standby(s) or uid in p.handled or pods.annotation(s, A_LEAVING) is not None:
            continue
        leaves = tuple((stage, mm["replicaId"]) for stage in pods.stage_ids(s)
                       if (mm := p.member_of(s, stage)) is not None and mm.get("pod") == pods.name(s)
                       and mm.get("state") in (contract.ATTACHED, contract.DRAINING))
        if not leaves or not p.head_talks():
            continue
        p.handled.add(uid)
        if pods.gated(s) and pods.joined_condition(s):
            acts.append(MarkJoined(pods.name(s), uid, False))
        if p.o.drains.get(uid) is None:  # running: wait; failed: rollout.retire_stale replaces it
            acts.append(StartLeave(pods.name(s), uid, leaves, p.drain_of(s), hold=True))
        p.progressing.append(Progress.KEPT_STANDBY)
    return acts


def hold_failed(p: Pass, pod: dict[str, Any]) -> bool:
    """A standby whose hold the head refused or never answered, still joined under its name."""
    return p.standby(pod) and p.o.drains.get(pods.uid(pod)) == DRAIN_FAILED and any(
        p.joined(pod, stage) for stage in pods.stage_ids(pod))


def surplus(p: Pass, standbys: list[dict[str, Any]], pool: str | None = None) -> list[dict[str, Any]]:
    """Standbys beyond spec.standby, those farthest from serving first: they leave with no drain (the
    head routes nothing to them) and are deleted."""
    extra = len(standbys) - p.standby_desired(pool)
    return pods.choose_victims(standbys, extra, serving=lambda s: warm(p, s))


def create(p: Pass, index: int, pool: str | None = None) -> CreatePod:
    """A standby pod: the replica (pool) pod of that index, its role ROLE_STANDBY (not part of its hash)."""
    fitted = p.pool_of.get(pool) if pool else None
    want = p.want_pool_pod(fitted.pool, index) if fitted and fitted.pool else p.want_replica(index)
    meta = want["metadata"]
    pod = {**want, "metadata": {**meta, "labels": {**meta["labels"], L_ROLE: ROLE_STANDBY}}}
    p.progressing.append(Progress.REFILLING_STANDBY)
    whose = f"OmniStagePool {pool} spec.standby" if pool else "spec.standby"
    return CreatePod(pod, Progress.REFILLING_STANDBY, f"created standby pod {{pod}} ({whose} "
                     f"{p.standby_desired(pool)}): registered and attached, not joined until a scale-up")


def state(p: Pass, pod: dict[str, Any]) -> MemberState:
    """A staying standby's status.members state: Standby once it is one join away, Silent while its
    heartbeats are late (the next pass replaces it), Pending while it loads and registers."""
    if warm(p, pod):
        return MemberState.STANDBY
    return MemberState.SILENT if silent(p, pod) is not None else MemberState.PENDING


def held(p: Pass) -> set[int]:
    """The stage-0 replica ids the head lists for the standbys: registered, unjoined on purpose
    (membership is in sync with them there)."""
    return {mm["replicaId"] for s in p.live(None) if p.standby(s) and (mm := registration(p, s)) is not None}


def _kind(pod: dict[str, Any]) -> str:
    return "pool pod" if pods.pool(pod) else "replica pod"


def _replicas(p: Pass, pool: str | None) -> int:
    fitted = p.pool_of.get(pool) if pool else None
    return fitted.pool.spec.replicas if fitted is not None and fitted.pool else p.t.spec.replicas
