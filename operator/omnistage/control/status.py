"""What status says after a pass: built from the pass's decision (state.Pass) through the API's
status models, so that status holds only keys the CRD schema has (the API server would prune any
other without a word). Pure, like the plan: it reads the decision and writes nothing.

Counts and conditions describe the pods as the plan leaves them: a pod it deletes or retires is
no longer counted, a replica it retires is Leaving.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnistage_engine_patches import contract
from pydantic import BaseModel

from ..api import statuses
from ..api.conditions import Cond, Reason, Type, merge, ready
from ..api.statuses import MemberState
from ..names import A_CONFIG_HASH, A_LEAVING
from ..render import selector
from ..render.stages import transport_note
from . import engine_truth, headswap, liveness, pods, pools, rollout, standby

if TYPE_CHECKING:
    from .state import Pass

# The patches a stage pod's replica needs in effect: connector ports without the replica term, which
# the head also assumes when it advertises a replica's sender endpoint (each pod binds its own).
STAGE_POD_PATCHES = (contract.CONNECTOR_PORTS,)
MOST_REFUSED = 4  # refused children ReplicaFailure names (each message is bounded: runtime/act.refusal)


def dump(model: BaseModel) -> dict[str, Any]:
    """The status as written: the keys the pass set, by their API names."""
    return model.model_dump(by_alias=True, exclude_unset=True)


def present(**fields: Any) -> dict[str, Any]:
    """The fields that have a value (a status leaves out what it does not know)."""
    return {k: v for k, v in fields.items() if v is not None}


def omnistage_status(p: Pass, generation: int | None, at: str) -> dict[str, Any]:
    t, previous, head = p.t, p.previous, p.head
    # stage-0 replicas: what spec.replicas and the scale selector count; the standbys beside them
    live, standbys = standby.split(p, p.live(None))
    head_staying = p.head_staying()
    updated = (1 if pods.template_hash(head) == pods.template_hash(p.want_head) else 0) + sum(
        1 for r in live if pods.template_hash(r) == pods.template_hash(p.want_replica(pods.index(r)))
        and pods.head_uid(r) == pods.uid(head)) if head_staying else 0
    members = _members(p, live + standbys)
    facts = _facts(p, live, sum(1 for m in members if m.state == MemberState.JOINED), stage_rows(p))
    same_head = head is not None and (previous.get("head") or {}).get("uid") == pods.uid(head)
    return dump(
        statuses.OmniStageStatus(
            **present(
                observed_generation=generation,
                replicas=len(facts.engine_pods),
                ready_replicas=len(facts.ready_pods),
                registered_replicas=facts.registered,
                standby_replicas=len(standbys),
                ready_standby_replicas=sum(1 for s in standbys if standby.warm(p, s)),
                updated_replicas=updated,
                selector=selector(t),
                effective_cache_mode=str(t.cache.mode),
                config_hash=pods.annotation(p.want_head, A_CONFIG_HASH),
                engine_image=t.engine_image,
                head=_head(p),
                engine=engine_truth.summary(p.report) or (previous.get("engine") if same_head else None),
                membership_epoch=(p.listing or {}).get("epoch", previous.get("membershipEpoch")),
                members=members,
                stages=[
                    statuses.StageStatus(**{k: v for k, v in row.items() if k != "patchProblem"})
                    for row in facts.stages
                ]
                or None,
                conditions=merge(previous.get("conditions", []), _conditions(p, facts), generation, at),
            )
        )
    )


def _members(p: Pass, live: list[dict[str, Any]]) -> list[statuses.MemberStatus]:
    # A replica someone else deletes is listed while the head still routes to it or drains it.
    going = [r for r in p.o.replicas if pods.pool(r) is None and pods.terminating(r)
             and (mm := p.member_of(r)) is not None and mm.get("pod") == pods.name(r)]
    out = []
    for r in sorted(live + going, key=pods.index):
        mm = p.member_of(r)
        if pods.annotation(r, A_LEAVING) or pods.uid(r) in p.handled or pods.terminating(r):
            state = MemberState.LEAVING
        elif p.standby(r):
            state = standby.state(p, r)
        elif liveness.silent(p, r) is not None:
            state = MemberState.SILENT
        elif mm is not None and mm.get("pod") == pods.name(r):
            state = MemberState.JOINED
        elif mm is not None and pods.containers_ready(r):
            state = MemberState.JOINING  # registered with the head (held unroutable), not joined yet
        else:
            state = MemberState.PENDING  # scheduling, pulling, loading the model: not registered yet
        held = state == MemberState.JOINING and not p.verdict.consistent
        out.append(
            statuses.MemberStatus(
                pod=pods.name(r),
                ip=pods.ip(r),
                replica_id=mm.get("replicaId") if mm else None,
                state=str(state),
                **present(reason=f"{Type.CACHE_CONSISTENT}: {p.verdict.reason}" if held else None,
                       standby=p.standby(r) or None),
            )
        )
    return out


@dataclass(frozen=True)
class Facts:
    """What more than one condition reads, worked out once per pass."""
    engine_pods: list[dict[str, Any]]  # the staying head and the stage-0 replicas (status.replicas)
    ready_pods: list[dict[str, Any]]  # of those, the ones serving as the head lists them
    stages: list[dict[str, Any]]  # stage_rows
    head_ready: bool  # p.head_serves()
    registered: int  # the head (its engine registered) and the joined replicas
    replicas_ready: int  # stage-0 replica pods serving
    replicas_available: bool  # every replica pod spec.replicas asks for is there and serving
    problem: str | None  # what keeps the membership from syncing, in its own words
    read: bool  # the membership was read (a static set has none to read)
    synced: bool


def _facts(p: Pass, live: list[dict[str, Any]], joined: int, stages: list[dict[str, Any]]) -> Facts:
    """The Facts of a pass: `live` its stage-0 replicas (no standbys), `joined` how many are joined."""
    t, head, staying, head_ready = p.t, p.head, p.head_staying(), p.head_serves()
    if t.distributed:
        head_registered = (mm := p.head_engine()) is not None and contract.is_live(mm)
    else:  # one replica inside the head: nothing to sync
        head_registered = staying and pods.ready(head)
    kept = standby.held(p)  # the standbys' registrations: unjoined on purpose
    others = [mm for mm in p.members() if not contract.is_head_local(mm, pods.ip(head)) and mm.get("state")
              != contract.LEFT and mm.get("replicaId") not in kept] if t.distributed else []
    problem = p.membership_problem or p.scale_held or (p.o.problems[0] if p.o.problems else None)
    replicas_ready = sum(1 for r in live if p.serves(r, unread=True))  # a replica pod is Ready once joined
    # Synced: every replica whose engine runs is joined (their Ready follows the join).
    running = sum(1 for r in live if pods.containers_ready(r) and not pods.annotation(r, A_LEAVING)
                  and pods.uid(r) not in p.handled)
    read = p.listing is not None or not t.distributed
    return Facts(
        engine_pods=([head] if staying else []) + live,
        # Serving as the head lists it: a head whose own engine is silent or gone is not counted.
        ready_pods=([head] if head_ready else []) + [r for r in live if p.serves(r, unread=True)],
        stages=stages, head_ready=head_ready, registered=(1 if head_registered else 0) + joined,
        replicas_ready=replicas_ready, problem=problem, read=read,
        replicas_available=replicas_ready == t.replica_pods and len(live) == t.replica_pods,
        synced=read and problem is None and joined == running and head_registered and len(others) == joined,
    )


def _config_rendered(p: Pass, f: Facts) -> list[Cond]:
    """ConfigRendered: the spec rendered into a config; says the effective stage-0 cache mode and why."""
    message = f"effective stage-0 cache mode {p.t.cache.mode}: {p.t.cache.reason}"
    if note := transport_note(p.t):
        message += f"; {note}"
    return [Cond(Type.CONFIG_RENDERED, True, Reason.RENDERED, message)]


def _head_ready(p: Pass, f: Facts) -> list[Cond]:
    """HeadReady: the head pod is Ready and, where it keeps a membership, its own engine is live."""
    engine = liveness.head_engine_problem(p)
    if engine:
        return [Cond(Type.HEAD_READY, f.head_ready, engine[0], engine[1])]
    if f.head_ready:
        reason = Reason.HEAD_READY
    elif p.head_staying():
        reason = Reason.HEAD_PENDING
    else:
        reason = Reason.NO_HEAD
    message = f"head pod {pods.name(p.head)}" if p.head else "no head pod"
    return [Cond(Type.HEAD_READY, f.head_ready, reason, message)]


def _replicas_available(p: Pass, f: Facts) -> list[Cond]:
    """ReplicasAvailable: every stage-0 replica pod spec.replicas asks for exists and serves."""
    desired = p.t.replica_pods
    reason = Reason.ALL_AVAILABLE if f.replicas_ready == desired else Reason.UNAVAILABLE
    return [Cond(Type.REPLICAS_AVAILABLE, f.replicas_available, reason,
                 f"{f.replicas_ready}/{desired} replica pods serving")]


def _membership_synced(p: Pass, f: Facts) -> list[Cond]:
    """MembershipSynced: the head has registered its own engine and joined every replica whose engine runs."""
    if f.synced:
        reason = Reason.SYNCED
    elif f.problem and f.problem == p.scale_held:
        reason = Reason.SCALE_DOWN_HELD
    elif f.problem and f.problem == p.o.answer_refused:
        reason = Reason.HEAD_ANSWER_REFUSED
    else:
        reason = Reason.NOT_SYNCED
    message = f.problem or (f"{f.registered}/{p.t.spec.replicas} replicas registered" if f.read
                            else "membership not read yet")
    return [Cond(Type.MEMBERSHIP_SYNCED, f.synced, reason, message)]


def _cache_consistent(p: Pass, f: Facts) -> list[Cond]:
    """CacheConsistent: the engines' cache settings agree (the pass's verdict, in its own words)."""
    return [Cond(Type.CACHE_CONSISTENT, p.verdict.consistent, p.verdict.reason, p.verdict.message)]


def _replica_failure(p: Pass, f: Facts) -> list[Cond]:
    """ReplicaFailure: the API server refused a child, or a pod cannot be scheduled or its engine exited."""
    every_pod = f.engine_pods + [r for r in p.live() if pods.pool(r) is not None]
    unschedulable = [f"{pods.name(x)}: {pods.unschedulable(x)}" for x in every_pod if pods.unschedulable(x)]
    exited = [f"{pods.name(x)}: engine exited ({x['status'].get('phase')})"
              for x in every_pod if pods.terminal(x)]
    refused = [f"the API server refused {why}" for why in p.o.refused[:MOST_REFUSED]]
    if len(p.o.refused) > MOST_REFUSED:
        refused.append(f"and {len(p.o.refused) - MOST_REFUSED} more children")
    if refused:
        reason = Reason.CHILD_REFUSED
    elif unschedulable:
        reason = Reason.UNSCHEDULABLE
    elif exited:
        reason = Reason.ENGINE_EXITED
    else:
        reason = Reason.NO_FAILURE
    return [Cond(Type.REPLICA_FAILURE, bool(refused or unschedulable or exited), reason,
                 "; ".join(refused + unschedulable + exited))]


def _rollout_surge(p: Pass, f: Facts) -> list[Cond]:
    """RolloutSurge: whether a roll in progress can create its replacements first (rollout_condition)."""
    return [rollout_condition(p)]


def _stages(p: Pass, f: Facts) -> list[Cond]:
    """StagesCovered and StagesReady, with spec.stages only (stage_conditions)."""
    return stage_conditions(p, f.stages) if p.t.spec.stages else []


def _progressing(p: Pass, f: Facts) -> list[Cond]:
    """Progressing: the pass changes pods, or some are missing or not Ready (reason: what the pass does)."""
    desired = p.t.spec.replicas
    progressing = bool(p.progressing) or len(f.engine_pods) != desired or len(f.ready_pods) != desired \
        or any(row["ready"] != row["desired"] for row in f.stages)
    reason = ",".join(sorted(set(p.progressing)))
    if not reason:
        reason = Reason.CONVERGING if progressing else Reason.STABLE
    message = f"{len(f.engine_pods)}/{desired} engine pods, {len(f.ready_pods)} ready" + "".join(
        f"; stage {row['id']}: {row['ready']}/{row['desired']} pods ready" for row in f.stages)
    return [Cond(Type.PROGRESSING, progressing, reason, message)]


def _ready(p: Pass, f: Facts) -> list[Cond]:
    """Ready: the head, the replicas, the membership, the engine cache and every stage all are."""
    stages_ready = all(row["registered"] == row["desired"] == row["ready"] and row["desired"] > 0
                       and not row.get("patchProblem") for row in f.stages)
    return [ready(f.head_ready, f.replicas_available, f.synced, p.verdict.consistent, stages_ready)]


# The conditions a pass sets, in the order it sets them (merge lists them in Type's order).
CONDITIONS: tuple[Callable[[Pass, Facts], list[Cond]], ...] = (
    _config_rendered, _head_ready, _replicas_available, _membership_synced, _cache_consistent,
    _replica_failure, _rollout_surge, _stages, _progressing, _ready,
)


def _conditions(p: Pass, f: Facts) -> list[Cond]:
    """The conditions this pass sets (merge keeps the others as they were)."""
    return [c for condition in CONDITIONS for c in condition(p, f)]


def failed_status(previous: dict[str, Any], generation: int | None, why: str, at: str) -> dict[str, Any]:
    """After a pass that failed (runtime/reconcile.py): the status it found, and ReplicaFailure saying
    why, until a pass gets through."""
    cond = Cond(Type.REPLICA_FAILURE, True, Reason.PASS_FAILED,
                f"the operator's last pass failed and is retried at the next resync: {why}")
    return {**previous, "conditions": merge(previous.get("conditions", []), [cond], generation, at)}


def rollout_condition(p: Pass) -> Cond:
    """RolloutSurge: whether a roll in progress can create its replacements first (a head change's
    own words while one runs)."""
    head_change = headswap.describe(p)
    if head_change is not None:
        return head_change
    outdated = [pods.name(r) for r in p.live() if p.want(r) is not None
                and pods.template_hash(r) != pods.template_hash(p.want(r))] if p.head_live() else []
    if not outdated:
        return Cond(Type.ROLLOUT_SURGE, True, Reason.NOT_ROLLING,
                    "every replica, standby and pool pod runs the current template")
    r = p.t.spec.rollout
    bounds = f"maxSurge {r.max_surge}, maxUnavailable {r.max_unavailable}"
    blocked = "; ".join(filter(None, (rollout.surge_blocked(p, pool) for pool, _ in rollout.groups(p))))
    if blocked:
        return Cond(
            Type.ROLLOUT_SURGE,
            False,
            Reason.NO_CAPACITY_FOR_SURGE,
            f"{len(outdated)} pods to roll; no GPU is free for a surge pod ({blocked}): rolling one pod at a "
            f"time, each drained before its replacement can start and the next only once that one "
            f"joined ({bounds})",
        )
    return Cond(Type.ROLLOUT_SURGE, True, Reason.SURGING, f"{len(outdated)} pods to roll: standbys first, "
                f"replacements join before outdated pods are drained ({bounds})")


def _head(p: Pass) -> statuses.HeadStatus | None:
    head, before = p.head, p.previous.get("head") or {}
    if head is None:
        return None
    # After a container restart the last boot id is the dead process's: forget it, so the new
    # one's first answer is not taken for yet another restart.
    boot = (p.report or p.listing or {}).get("bootId") or (
        before.get("bootId") if before.get("uid") == pods.uid(head) and not p.head_restarted else None)
    spare = next((s for s in p.o.spares if pods.uid(s) not in p.gone and not pods.terminating(s)), None)
    return statuses.HeadStatus(**present(pod=pods.name(head), uid=pods.uid(head), ip=pods.ip(head),
                                         boot_id=boot, restarts=pods.restarts(head),
                                         spare=spare and pods.name(spare),
                                         spare_ready=spare and pods.ready(spare)))


# ---- stages >= 1 and their pools ---------------------------------------------------------------------

def stage_rows(p: Pass) -> list[dict[str, Any]]:
    """status.stages: per stage, its pool and that pool's pods (desired, Ready, joined for the stage)
    and the patch outcomes its replicas sent with their registration (patchProblem: not written,
    what StagesReady says)."""
    cover = pools.coverage(p.pools)
    rows = []
    for s in p.t.spec.stages:
        pool = cover.get(s.id)
        staying = p.staying(pool) if pool else []
        reports = {pods.name(r): (p.member_of(r, s.id) or {}).get("patches") for r in staying}
        row = {"id": s.id, "name": s.name or None, "pool": pool,
               "desired": p.pool_of[pool].pool.spec.replicas if pool else 0,
               "ready": sum(1 for r in staying if p.serves(r, unread=True)),
               "registered": sum(1 for r in staying if p.joined(r, s.id)),
               "patches": merged_outcomes([o for o in reports.values() if o]) or None,
               "patchProblem": stage_patch_problem(reports)}
        rows.append(present(**row))
    return rows


def stage_conditions(p: Pass, rows: list[dict[str, Any]]) -> list[Cond]:
    """StagesCovered and StagesReady (the plan announces them when they turn bad: stages.announce)."""
    uncovered = [row["id"] for row in rows if "pool" not in row]
    refused = "".join(f"; pool {f.name}: {f.problem[1]}" for f in p.pools if f.problem)
    if uncovered:
        covered = Cond(Type.STAGES_COVERED, False, Reason.UNCOVERED,
                       f"stage {', '.join(map(str, uncovered))} runs in no OmniStagePool: create one with "
                       f"spec.omniStage {p.t.name} and these spec.stageIds" + refused)
    else:
        covered = Cond(Type.STAGES_COVERED, True, Reason.ALL_COVERED,
                       "; ".join(f"stage {row['id']}: pool {row['pool']}" for row in rows) + refused)
    waiting = [
        f"stage {row['id']}: {row['registered']}/{row['desired']} registered, {row['ready']} ready"
        for row in rows
        if not (row["registered"] == row["desired"] == row["ready"] and row["desired"])
    ]
    broken = [f"stage {row['id']}: {row['patchProblem']}" for row in rows if row.get("patchProblem")]
    if broken:
        return [covered, Cond(Type.STAGES_READY, False, Reason.PATCH_NOT_APPLIED,
                              "; ".join(broken) + f". {engine_truth.PLUGIN_ADVICE}")]
    stages_ready = not waiting
    return [
        covered,
        Cond(
            Type.STAGES_READY,
            stages_ready,
            Reason.ALL_STAGES_SERVING if stages_ready else Reason.WAITING,
            "; ".join(waiting) or "every stage's replicas are joined on the head",
        ),
    ]


def merged_outcomes(reports: list[dict[str, str]]) -> dict[str, str]:
    """One outcome per patch over a stage's replicas: the first not in effect, else the shared one."""
    out: dict[str, str] = {}
    for report in reports:
        for name, outcome in report.items():
            if name not in out or (out[name] in contract.EFFECTIVE_OUTCOMES
                                   and outcome not in contract.EFFECTIVE_OUTCOMES):
                out[name] = outcome
    return dict(sorted(out.items()))


def stage_patch_problem(reports: Mapping[str, dict[str, str] | None]) -> str | None:
    """Which pods run a stage replica without a patch a stage pod needs (None: every reporting pod
    has them; a replica that sent no report, an older plugin, is not judged)."""
    bad = sorted(
        f"{name} {report[name]} in {pod}"
        for pod, report in reports.items()
        if report
        for name in STAGE_POD_PATCHES
        if report.get(name, contract.SKIPPED) not in contract.EFFECTIVE_OUTCOMES
    )
    return ", ".join(bad) or None
