"""What status says after a pass: built from the pass's decision (state.Pass) through the API's
status models, so that status holds only keys the CRD schema has (the API server would prune any
other without a word). Pure, like the plan: it reads the decision and writes nothing.

Counts and conditions describe the pods as the plan leaves them: a pod it deletes or retires is
no longer counted, a replica it retires is Leaving.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    engine_pods = ([head] if head_staying else []) + live
    # Serving as the head lists it: a head whose own engine is silent or gone is not counted.
    ready_pods = ([head] if p.head_serves() else []) + [r for r in live if p.serves(r, unread=True)]
    updated = (1 if pods.template_hash(head) == pods.template_hash(p.want_head) else 0) + sum(
        1 for r in live if pods.template_hash(r) == pods.template_hash(p.want_replica(pods.index(r)))
        and pods.head_uid(r) == pods.uid(head)) if head_staying else 0
    members = _members(p, live + standbys)
    joined = sum(1 for m in members if m.state == MemberState.JOINED)
    if t.distributed:
        head_registered = (mm := p.head_engine()) is not None and contract.is_live(mm)
    else:
        head_registered = head_staying and pods.ready(head)  # one replica inside the head: nothing to sync
    stages = stage_rows(p)
    conds = _conditions(p, engine_pods, ready_pods, joined, head_registered, stages)
    same_head = head is not None and (previous.get("head") or {}).get("uid") == pods.uid(head)
    return dump(
        statuses.OmniStageStatus(
            **present(
                observed_generation=generation,
                replicas=len(engine_pods),
                ready_replicas=len(ready_pods),
                registered_replicas=(1 if head_registered else 0) + joined,
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
                    for row in stages
                ]
                or None,
                conditions=merge(previous.get("conditions", []), conds, generation, at),
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


def _conditions(p: Pass, engine_pods: list[dict[str, Any]], ready_pods: list[dict[str, Any]], joined: int,
                head_registered: bool, stages: list[dict[str, Any]]) -> list[Cond]:
    t, head = p.t, p.head
    live = standby.split(p, p.live(None))[0]
    head_ready = p.head_serves()
    head_engine = liveness.head_engine_problem(p)
    kept = standby.held(p)  # the standbys' registrations: unjoined on purpose
    others = [mm for mm in p.members() if not contract.is_head_local(mm, pods.ip(head)) and mm.get("state")
              != contract.LEFT and mm.get("replicaId") not in kept] if t.distributed else []
    problem = p.membership_problem or p.scale_held or (p.o.problems[0] if p.o.problems else None)
    desired = t.spec.replicas
    replica_desired = t.replica_pods
    replicas_ready = sum(1 for r in live if p.serves(r, unread=True))  # a replica pod is Ready once joined
    # Synced: every replica whose engine runs is joined (their Ready follows the join).
    running = sum(1 for r in live if pods.containers_ready(r) and not pods.annotation(r, A_LEAVING)
                  and pods.uid(r) not in p.handled)
    read = p.listing is not None or not t.distributed
    synced = read and problem is None and joined == running and head_registered and len(others) == joined
    every_pod = engine_pods + [r for r in p.live() if pods.pool(r) is not None]
    unschedulable = [f"{pods.name(x)}: {pods.unschedulable(x)}" for x in every_pod if pods.unschedulable(x)]
    exited = [
        f"{pods.name(x)}: engine exited ({x['status'].get('phase')})" for x in every_pod if pods.terminal(x)
    ]
    refused = [f"the API server refused {why}" for why in p.o.refused[:MOST_REFUSED]] + (
        [f"and {len(p.o.refused) - MOST_REFUSED} more children"] if len(p.o.refused) > MOST_REFUSED else [])
    replicas_available = replicas_ready == replica_desired and len(live) == replica_desired
    registered = (1 if head_registered else 0) + joined
    verdict = p.verdict
    conds = [
        Cond(
            Type.CONFIG_RENDERED,
            True,
            Reason.RENDERED,
            f"effective stage-0 cache mode {t.cache.mode}: {t.cache.reason}"
            + (f"; {note}" if (note := transport_note(t)) else ""),
        ),
        Cond(
            Type.HEAD_READY,
            head_ready,
            head_engine[0]
            if head_engine
            else (
                Reason.HEAD_READY
                if head_ready
                else (Reason.HEAD_PENDING if p.head_staying() else Reason.NO_HEAD)
            ),
            head_engine[1] if head_engine else (f"head pod {pods.name(head)}" if head else "no head pod"),
        ),
        Cond(
            Type.REPLICAS_AVAILABLE,
            replicas_available,
            Reason.ALL_AVAILABLE if replicas_ready == replica_desired else Reason.UNAVAILABLE,
            f"{replicas_ready}/{replica_desired} replica pods serving",
        ),
        Cond(
            Type.MEMBERSHIP_SYNCED,
            synced,
            Reason.SYNCED
            if synced
            else Reason.SCALE_DOWN_HELD
            if problem and problem == p.scale_held
            else Reason.HEAD_ANSWER_REFUSED
            if problem and problem == p.o.answer_refused
            else Reason.NOT_SYNCED,
            problem or (f"{registered}/{desired} replicas registered" if read else "membership not read yet"),
        ),
        Cond(Type.CACHE_CONSISTENT, verdict.consistent, verdict.reason, verdict.message),
        Cond(
            Type.REPLICA_FAILURE,
            bool(refused or unschedulable or exited),
            Reason.CHILD_REFUSED
            if refused
            else Reason.UNSCHEDULABLE
            if unschedulable
            else Reason.ENGINE_EXITED
            if exited
            else Reason.NO_FAILURE,
            "; ".join(refused + unschedulable + exited),
        ),
    ]
    conds.append(rollout_condition(p))
    stages_ready = all(row["registered"] == row["desired"] == row["ready"] and row["desired"] > 0
                       and not row.get("patchProblem") for row in stages)
    if t.spec.stages:
        conds += stage_conditions(p, stages)
    progressing = bool(p.progressing) or len(engine_pods) != desired or len(ready_pods) != desired \
        or any(row["ready"] != row["desired"] for row in stages)
    conds.append(
        Cond(
            Type.PROGRESSING,
            progressing,
            ",".join(sorted(set(p.progressing))) or (Reason.CONVERGING if progressing else Reason.STABLE),
            f"{len(engine_pods)}/{desired} engine pods, {len(ready_pods)} ready"
            + "".join(f"; stage {row['id']}: {row['ready']}/{row['desired']} pods ready" for row in stages),
        )
    )
    conds.append(ready(head_ready, replicas_available, synced, verdict.consistent, stages_ready))
    return conds


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
