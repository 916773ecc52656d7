"""The reconcile decision as one pure function: plan(t, observed) -> Plan(actions, status, pools).

Nothing here talks to the API server or a head: `reconcile.observe` reads, `act` executes, and
status.py describes what the decision leaves. Keeping the decision pure lets a table of situations
(tests/unit/test_plan.py) pin down every rule, and makes a pass cheap to reason about: the same
observation always yields the same actions.

The steps run in dependency order (children, head, head restart, stale replicas, template roll,
scale, membership) on one Pass, which records what each decided, so that a pod deleted early in
the pass is not counted, joined or deleted again by a later step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from omnistage_engine_patches import contract

from ..api import OmniStagePoolSpec
from ..api.conditions import Cond, EventReason, Progress, Reason, Type, merge, timestamp
from ..api.conditions import get as condition
from ..api.validation import InvalidSpec
from ..names import A_LEAVING
from ..render import (
    render_api_service,
    render_configmap,
    render_disruption_budget,
    render_head_pod,
    render_master_service,
    render_network_policy,
    render_replica_pod,
)
from ..render.common import Pool, Target
from ..render.pods import SHUTDOWN_SECONDS, render_pool_pod
from . import engine_truth, pods, pools, status
from .actions import (
    DRAIN_DONE,
    DRAIN_FAILED,
    HEAD_NOT_READY,
    Action,
    Annotate,
    CreatePod,
    DeletePod,
    Emit,
    EnsureChild,
    Forget,
    Join,
    MarkJoined,
    Observed,
    StartLeave,
)

# Why a replica leaves, by the reason its `leaving` annotation records (the delete's Event says it).
_WHY = {
    Progress.SCALED_DOWN: "spec.replicas is {replicas}",
    Progress.ROLLING_REPLICA: "its pod template changed",
    Progress.ROLLED_REPLICA: "it belongs to a previous head",
    Progress.REPLACED_REPLICA: "its engine exited or it turned NotReady",
    Progress.POOL_DELETED: "its OmniStagePool {pool} is gone",
}
# A pool pod's drain when its pool is gone (the pool's own setting went with it).
DEFAULT_POOL_DRAIN = OmniStagePoolSpec.model_fields["drain_timeout_seconds"].default


class Plan(NamedTuple):
    actions: list[Action]  # for act, in order
    status: dict[str, Any]  # the OmniStage's, as the actions leave it
    pools: dict[str, dict[str, Any]]  # OmniStagePool name -> its status, for those that changed


def plan(t: Target | InvalidSpec, o: Observed, at: str | None = None) -> Plan:
    """The one decision. `t` is the validated target or the InvalidSpec it raised; `at` is the
    timestamp for condition transitions (a parameter, so the function stays pure)."""
    at = at or timestamp()
    generation = o.obj["metadata"].get("generation")
    if isinstance(t, InvalidSpec):
        return _invalid(t, o, generation, at)
    p = decide(t, o, at)
    return Plan(p.actions, status.omnistage_status(p, generation, at), status.pool_statuses(p, at))


def decide(t: Target, o: Observed, at: str | None = None) -> Pass:
    p = Pass(t, o, at or timestamp())
    p.children()
    p.head_pod()
    p.engine_report()
    p.membership_read()
    p.retire_stale()
    p.roll()
    p.scale()
    p.sync_membership()
    p.mark_joined()
    p.announce_stages()
    return p


def _invalid(err: InvalidSpec, o: Observed, generation: int | None, at: str) -> Plan:
    """Loses nothing: running pods stay as they are until the spec is fixed."""
    previous = o.obj.get("status") or {}
    message = str(err)
    actions: list[Action] = []
    if condition(previous, Type.CONFIG_RENDERED).get("message") != message:
        actions.append(Emit("Warning", Reason.INVALID_SPEC, message))
    conds = [Cond(Type.CONFIG_RENDERED, False, Reason.INVALID_SPEC, message),
             Cond(Type.READY, False, Reason.INVALID_SPEC, message)]
    return Plan(actions, {**previous, "conditions": merge(previous.get("conditions", []), conds, generation, at)}, {})


class Pass:
    """One pass's working state: the observation plus what the steps decided so far. Once decide()
    returns it is the decision that status.py describes."""

    def __init__(self, t: Target, o: Observed, at: str):
        self.t, self.o, self.previous = t, o, o.obj.get("status") or {}
        self.at = at  # now, as plan() was given it (a pod's remaining grace is measured from it)
        self.actions: list[Action] = []
        self.progressing: list[str] = []  # Progress values: what this pass did
        self.head = o.head
        self.head_going = False  # this pass deletes the head (it rolls)
        self.gone: set[str] = set()  # pod uids deleted by this plan
        self.handled: set[str] = set()  # pod uids whose retirement this plan already decided
        self.listing = o.listing
        self.report = o.report
        self.membership_problem: str | None = None
        self.head_restarted = False  # this pass saw the head's container restart
        self.verdict: engine_truth.Verdict | None = None
        self.want_head = render_head_pod(t)  # rendered once per pass
        self._want_replica: dict[int, dict[str, Any]] = {}
        self._want_pool_pod: dict[tuple[str, int], dict[str, Any]] = {}
        self.pools = pools.fit(t, t.name, o.pools)
        self.pool_of = {f.name: f for f in self.pools}

    # -- helpers
    def emit(self, etype: str, reason: str, message: str) -> None:
        self.actions.append(Emit(etype, reason, message))

    def want_replica(self, index: int) -> dict[str, Any]:
        if index not in self._want_replica:
            self._want_replica[index] = render_replica_pod(self.t, index, pods.ip(self.head) or "",
                                                           pods.uid(self.head))
        return self._want_replica[index]

    def want_pool_pod(self, pool: Pool, index: int) -> dict[str, Any]:
        key = (pool.name, index)
        if key not in self._want_pool_pod:
            self._want_pool_pod[key] = render_pool_pod(self.t, pool, index, pods.ip(self.head) or "",
                                                       pods.uid(self.head))
        return self._want_pool_pod[key]

    def want(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        """The pod as it should be now; None for a pod of a pool that cannot run (it is not rolled)."""
        if pods.pool(pod) is None:
            return self.want_replica(pods.index(pod))
        fitted = self.pool_of.get(pods.pool(pod))
        return self.want_pool_pod(fitted.pool, pods.index(pod)) if fitted is not None and fitted.runs else None

    def drain_of(self, pod: dict[str, Any]) -> int:
        if pods.pool(pod) is None:
            return self.t.spec.engine.drain_timeout_seconds
        fitted = self.pool_of.get(pods.pool(pod))
        return fitted.pool.spec.drain_timeout_seconds if fitted is not None and fitted.pool else DEFAULT_POOL_DRAIN

    def head_staying(self) -> bool:
        """A head pod that is not on its way out (by an earlier delete or by this pass)."""
        return self.head is not None and not pods.terminating(self.head) and not self.head_going

    def head_live(self) -> bool:
        return self.head_staying() and bool(pods.ip(self.head))

    def head_talks(self) -> bool:
        """A head client exists and the head pod is Ready: the only head the plan reads answers from."""
        return self.o.head_reachable and self.head_live() and pods.ready(self.head)

    def live(self, pool: str | None = "*") -> list[dict[str, Any]]:
        """Replica and pool pods not going away; of one pool (None: stage-0 replicas) unless "*"."""
        return [r for r in self.o.replicas if not pods.terminating(r) and pods.uid(r) not in self.gone
                and (pool == "*" or pods.pool(r) == pool)]

    def members(self, stage: int = 0) -> list[contract.Member]:
        return contract.members(self.listing, stage) if self.listing is not None else []

    def member_of(self, pod: dict[str, Any], stage: int = 0) -> dict[str, Any] | None:
        for mm in self.members(stage):
            if mm.get("pod") == pods.name(pod) or (pods.ip(pod) and mm.get("host") == pods.ip(pod)):
                return mm
        return None

    def joined(self, pod: dict[str, Any], stage: int) -> bool:
        mm = self.member_of(pod, stage)
        return mm is not None and mm.get("pod") == pods.name(pod)

    def serves(self, pod: dict[str, Any], unread: bool = False) -> bool:
        """Ready and joined at the head for every stage it runs: the head's word too, not only the
        pod's Ready (which kwok, for one, writes True at start-up). `unread`: the answer when the
        membership was not read (a roll drains nothing on a guess; status trusts the pod's Ready)."""
        if self.listing is None:
            return unread and pods.ready(pod)
        return pods.ready(pod) and all(self.joined(pod, stage) for stage in pods.stage_ids(pod))

    def stage_ids(self) -> list[int]:
        return [0, *(s.id for s in self.t.spec.stages)]

    def delete(self, pod: dict[str, Any], reason: str | None = None, message: str = "") -> None:
        self.actions.append(DeletePod(pods.name(pod), pods.uid(pod), reason, message))
        self.gone.add(pods.uid(pod))

    # -- steps
    def children(self) -> None:
        t = self.t
        budgets = [render_disruption_budget(t), *(render_disruption_budget(t, f.pool) for f in self.pools if f.runs)]
        for child, compare in ((render_configmap(t), ("data",)), (render_api_service(t), ("spec",)),
                               (render_master_service(t), ("spec",)), (render_network_policy(t), ("spec",)),
                               *((b, ("spec",)) for b in budgets)):
            self.actions.append(EnsureChild(child, compare))

    def head_pod(self) -> None:
        head, want = self.head, self.want_head
        if head is not None and not pods.terminating(head):
            outdated = pods.template_hash(head) != pods.template_hash(want)
            if outdated or pods.terminal(head):
                # Replicas are bound to one head incarnation (they never re-register), so the head
                # rolls first and its replicas follow; rolling them first would restart them twice.
                why = "its pod template changed" if outdated else f"it is {head['status'].get('phase')}"
                self.emit("Normal", Progress.ROLLING_HEAD, f"replacing head pod {pods.name(head)}: {why}")
                self.actions.append(DeletePod(pods.name(head), pods.uid(head)))
                self.progressing.append(Progress.ROLLING_HEAD)
                # What the old head said no longer counts; its successor is created on a later pass
                # (the name is taken until the old pod is gone).
                self.head_going = True
                self.listing, self.report = None, None
                return
        if head is None:
            self.actions.append(CreatePod(want, EventReason.CREATED_HEAD, "created head pod {pod}"))
            self.progressing.append(Progress.CREATING_HEAD)

    def engine_report(self) -> None:
        """Hold the cache guarantee against what the head says it runs."""
        if not self.head_talks():
            why = HEAD_NOT_READY
            self.report = None
        else:
            why = self.o.report_problem
        self.verdict = engine_truth.check(str(self.t.cache.mode), self.t.distributed, self.report, why)
        before = condition(self.previous, Type.CACHE_CONSISTENT)
        if self.verdict.consistent or why == HEAD_NOT_READY:
            if self.verdict.consistent and before.get("status") == "False":
                self.emit("Normal", self.verdict.reason, self.verdict.message)
            return
        if before.get("message") != self.verdict.message:
            self.emit("Warning", self.verdict.reason, self.verdict.message)

    def membership_read(self) -> None:
        if not self.t.distributed:
            self.listing = None
            return  # a static single replica: no master, no membership to keep
        before = self.previous.get("head") or {}
        if self.head_live() and before.get("uid") == pods.uid(self.head) and before.get("restarts") is not None \
                and pods.restarts(self.head) > before["restarts"]:
            # The head's container restarted: a new engine process, which its replicas never register
            # with again. Seen from the pod, not the head's boot id: a multi-stage head answers nothing
            # (not even /health) until a replica of every remote stage registered, which none will.
            self._roll_for_new_head(f"its container restarted (restartCount {before['restarts']} -> "
                                    f"{pods.restarts(self.head)})")
            self.head_restarted = True
            return
        if not self.head_talks():
            self.membership_problem, self.listing = HEAD_NOT_READY, None
            return
        if self.listing is None:
            self.membership_problem = f"head unreachable: {self.o.listing_problem}"
            return
        boot = self.listing.get("bootId")
        if before.get("uid") == pods.uid(self.head) and before.get("bootId") and boot != before.get("bootId"):
            # Same head pod, new engine process: its replicas registered with the old one.
            self._roll_for_new_head(f"boot id {before.get('bootId')} -> {boot}")

    def _roll_for_new_head(self, why: str) -> None:
        self.emit("Warning", Progress.HEAD_RESTARTED, f"head engine restarted ({why}); rolling every replica"
                  + (" and every pool pod" if self.t.spec.stages else ""))
        for r in self.live():
            self.delete(r)
        self.progressing.append(Progress.HEAD_RESTARTED)

    def _retire(self, pod: dict[str, Any], drain_seconds: int, reason: str, why: str) -> None:
        """Tell the engine first, then delete: the engine stops routing to the replica and drains it,
        so no request is cut off by the pod's deletion. The drain is started here and finished on a
        later pass (the `leaving` annotation records the decision across passes and restarts)."""
        uid = pods.uid(pod)
        if uid in self.handled or uid in self.gone:
            return
        self.handled.add(uid)
        if pods.annotation(pod, A_LEAVING) is None:
            self.actions.append(Annotate(pods.name(pod), {A_LEAVING: reason}))
        if pods.gated(pod) and pods.joined_condition(pod):
            # NotReady before the head stops routing to it (mark_joined leaves it alone from now on).
            self.actions.append(MarkJoined(pods.name(pod), uid, False))
        self.progressing.append(reason)
        members = [(stage, self.member_of(pod, stage)) for stage in pods.stage_ids(pod)]
        leaves = tuple((stage, mm["replicaId"]) for stage, mm in members
                       if mm is not None and mm.get("state") != contract.LEFT)
        drain = self.o.drains.get(uid)
        if leaves and self.head_talks() and drain not in (DRAIN_DONE, DRAIN_FAILED):
            if drain is None:  # not started, or started by an operator that has since restarted
                self.actions.append(StartLeave(pods.name(pod), uid, leaves, drain_seconds))
            return  # DRAIN_RUNNING: the pod stays until the head let every stage's replica go
        # Left, never joined, or the head cannot be told (its heartbeat timeout detaches it).
        kind = "pool pod" if pods.pool(pod) else "replica pod"
        self.delete(pod, reason, f"deleted {kind} {pods.name(pod)}: {why}")

    def retire_stale(self) -> None:
        """Replicas of another head incarnation or a finished process go at once (replicas whose
        template changed are roll()'s)."""
        if not self.head_live():
            return
        head_uid = pods.uid(self.head)
        for r in self.live():
            drain = self.drain_of(r)
            if pods.annotation(r, A_LEAVING) is not None:
                # A retirement decided earlier (this operator or one before a restart) is finished,
                # whatever happened to the spec since.
                reason = pods.annotation(r, A_LEAVING) or Progress.SCALED_DOWN
                self._retire(r, drain if reason in (Progress.SCALED_DOWN, Progress.ROLLING_REPLICA, Progress.POOL_DELETED) else 0,
                             reason, self._why(reason, r))
            elif pods.pool(r) is not None and pods.pool(r) not in self.pool_of:
                self._retire(r, drain, Progress.POOL_DELETED, self._why(Progress.POOL_DELETED, r))
            elif pods.head_uid(r) != head_uid:
                self._retire(r, 0, Progress.ROLLED_REPLICA, "it belongs to a previous head")
            elif pods.terminal(r):
                self._retire(r, 0, Progress.REPLACED_REPLICA, f"its engine exited ({r['status'].get('phase')})")
            elif self.listing is not None and self.member_of(r) is not None and not pods.containers_ready(r):
                # Its container, not its Ready (that waits for the join): a replica the head
                # lists whose engine stopped answering.
                self._retire(r, 0, Progress.REPLACED_REPLICA, "it turned NotReady")

    # -- rollouts: surge first, then drain (spec.rollout)
    def groups(self) -> list[tuple[Pool | None, int]]:
        """Each set of pods a count applies to: stage-0 replicas, then every pool that runs."""
        t = self.t
        return [(None, t.spec.replicas - 1 if t.distributed else 0),
                *((f.pool, f.pool.spec.replicas) for f in self.pools if f.runs)]

    def outdated(self, pool: Pool | None) -> list[dict[str, Any]]:
        """Staying pods of the group whose template changed (none without a live head: its replicas
        are bound to it and go with it, whatever their template)."""
        if not self.head_live():
            return []
        return [r for r in self.staying(pool.name if pool else None) if self.want(r) is not None
                and pods.template_hash(r) != pods.template_hash(self.want(r))]

    def surge(self, pool: Pool | None) -> int:
        """Pods a roll of the group may run beyond its desired count (its replacements, made first)."""
        return min(self.t.spec.rollout.max_surge, len(self.outdated(pool)))

    def surge_blocked(self, pool: Pool | None) -> str | None:
        """The scheduler's word on a replacement pod of a rolling group that found no node (no GPU
        free for a surge), else None."""
        if not self.outdated(pool):
            return None
        stuck = [f"{pods.name(r)}: {pods.unschedulable(r)}" for r in self.staying(pool.name if pool else None)
                 if pods.unschedulable(r) and r not in self.outdated(pool)]
        return "; ".join(stuck) or None

    def roll(self) -> None:
        """Replace outdated pods within spec.rollout. Their replacements are created first (scale()
        allows surge() extra pods) and an outdated pod is drained only while at least desired -
        maxUnavailable others serve (Ready: joined). Outdated pods that serve nothing go first, at no
        cost. No GPU free for a surge pod: one pod at a time (its GPU goes to the replacement, and
        the next waits until that one joined)."""
        if not self.head_live():
            return
        r = self.t.spec.rollout
        for pool, desired in self.groups():
            outdated = self.outdated(pool)
            if not outdated:
                continue
            one_at_a_time = r.max_surge == 0 or self.surge_blocked(pool) is not None
            floor = desired - max(r.max_unavailable, 1 if one_at_a_time else 0)
            serving = sum(1 for x in self.staying(pool.name if pool else None) if self.serves(x))
            for x in sorted(outdated, key=self.serves):
                if self.serves(x):
                    if serving - 1 < floor:
                        break
                    serving -= 1
                self._retire(x, self.drain_of(x), Progress.ROLLING_REPLICA, "its pod template changed")

    def _why(self, reason: str, pod: dict[str, Any]) -> str:
        fitted = self.pool_of.get(pods.pool(pod) or "")
        replicas = fitted.pool.spec.replicas if fitted and fitted.pool else self.t.spec.replicas
        why = _WHY.get(reason, "it was leaving").format(replicas=replicas, pool=pods.pool(pod))
        return f"its pool's {why}" if fitted and reason == Progress.SCALED_DOWN else why

    def staying(self, pool: str | None) -> list[dict[str, Any]]:
        """Live pods of a pool (None: stage-0 replicas) not on their way out: what its replicas is compared with."""
        return [r for r in self.live(pool) if pods.uid(r) not in self.handled]

    def scale(self) -> None:
        t = self.t
        self._scale(None, t.spec.replicas - 1 if t.distributed else 0, f"spec.replicas {t.spec.replicas}")
        for fitted in self.pools:
            if fitted.runs:  # a pool that cannot run keeps the pods it has (loses nothing) and gets no more
                self._scale(fitted.pool, fitted.pool.spec.replicas,
                            f"OmniStagePool {fitted.name} spec.replicas {fitted.pool.spec.replicas}")

    def _scale(self, pool: Pool | None, desired: int, why: str) -> None:
        name = pool.name if pool else None
        staying = self.staying(name)
        surge = self.surge(pool)  # a roll's replacements, beyond desired until the outdated pods left
        if len(staying) > desired + surge:
            for victim in pods.choose_victims(staying, len(staying) - desired - surge):
                self._retire(victim, self.drain_of(victim), Progress.SCALED_DOWN, self._why(Progress.SCALED_DOWN, victim))
            return
        # Pool pods too are created once the head has an IP, not once it is Ready: the head turns Ready
        # only after one replica of each remote stage registered.
        if len(staying) < desired + surge and self.head_live():
            every = [r for r in self.o.replicas if pods.pool(r) == name]
            for i in pods.free_indices(every, desired + surge - len(staying)):
                want = self.want_pool_pod(pool, i) if pool else self.want_replica(i)
                kind = "pool pod" if pool else "replica pod"
                self.actions.append(CreatePod(want, EventReason.SCALED_UP, f"created {kind} {{pod}} ({why})"))
                self.progressing.append(Progress.SCALING_UP)

    def sync_membership(self) -> None:
        """Join every Ready replica the head has not acknowledged; make the head forget every replica
        whose pod is gone (it would otherwise wait out its 30 s heartbeat timeout)."""
        if self.listing is None:
            return
        live = {pods.name(r): r for r in self.live()}
        head_ip = pods.ip(self.head)
        for stage in self.stage_ids():
            runs = [r for r in live.values() if stage in pods.stage_ids(r)]
            for mm in self.members(stage):
                if contract.is_head_local(mm, head_ip) or mm.get("state") == contract.LEFT:
                    continue
                pod = live.get(mm.get("pod")) or next((r for r in runs if pods.ip(r) == mm.get("host")), None)
                if pod is None and self.disrupted(mm) is None:
                    self.actions.append(Forget(mm["replicaId"], str(mm.get("pod") or mm.get("host")), stage))
        self.drain_disrupted()
        for name, pod in live.items():
            if not pods.containers_ready(pod) or pods.annotation(pod, A_LEAVING) is not None \
                    or pods.uid(pod) in self.handled:
                continue
            joins = []
            for stage in pods.stage_ids(pod):
                if self.joined(pod, stage):
                    continue
                if stage == 0 and not self.verdict.consistent:
                    # The head holds an unjoined replica unroutable (contract.ROUTE_JOINED_ONLY_ENV); the
                    # multimodal cache guarantee is stage 0's (later stages take no frontend media).
                    self.membership_problem = f"{name} is not joined: {Type.CACHE_CONSISTENT} is False ({self.verdict.reason})"
                    joins = None
                    break
                joins.append(Join(name, pods.ip(pod), stage))
            if joins and pods.gated(pod) and pods.joined_condition(pod):
                # Not joined, yet its condition says so (kwok's start-up True, a stale word): the
                # truth first, in case the join is refused.
                self.actions.append(MarkJoined(name, pods.uid(pod), False))
            self.actions.extend(joins or [])
            if joins and pods.gated(pod):
                # Ready at once when every join lands (act skips this when one is refused).
                self.actions.append(MarkJoined(name, pods.uid(pod), True))

    def disrupted(self, mm: contract.Member) -> dict[str, Any] | None:
        """The terminating pod, not deleted by this plan, that a joined member of the head runs in:
        someone else (an eviction, a node drain, kubectl delete) is deleting it, or an earlier pass did
        after its drain."""
        return next((r for r in self.o.replicas if pods.terminating(r) and mm.get("pod") == pods.name(r)), None)

    def drain_disrupted(self) -> None:
        """A replica pod someone else deletes keeps its engine running for its grace period (its
        preStop hook is draining it already): have the head stop routing to it and drain it within
        what remains of that grace, less the engine's own shutdown. Once per pod (the drain state)."""
        for r in self.o.replicas:
            if not pods.terminating(r) or pods.uid(r) in self.o.drains:
                continue
            leaves = tuple((stage, mm["replicaId"]) for stage in pods.stage_ids(r)
                           if (mm := self.member_of(r, stage)) is not None and mm.get("pod") == pods.name(r)
                           and mm.get("state") not in (contract.LEFT, contract.DRAINING))
            if not leaves:
                continue  # left already (the operator's own deletes come after the leave), or never joined
            drain = max(0, min(self.drain_of(r), pods.grace_left(r, self.at) - SHUTDOWN_SECONDS))
            kind = "pool pod" if pods.pool(r) else "replica pod"
            if pods.gated(r) and pods.joined_condition(r):
                self.actions.append(MarkJoined(pods.name(r), pods.uid(r), False))
            self.emit("Normal", EventReason.DISRUPTED, f"{kind} {pods.name(r)} is being deleted by someone else "
                      f"(eviction, node drain, kubectl delete): draining it for up to {drain}s")
            self.actions.append(StartLeave(pods.name(r), pods.uid(r), leaves, drain))

    def mark_joined(self) -> None:
        """Keep each gated pod's joined condition equal to what the head says: True while every
        replica it runs is joined, False while it leaves or the head does not route to it (kwok,
        for one, writes True into every readiness gate at start-up). Unread membership changes
        nothing but a leaving pod."""
        planned = {a.pod for a in self.actions if isinstance(a, MarkJoined)}
        for r in self.live():
            if not pods.gated(r) or pods.name(r) in planned:
                continue
            leaving = pods.annotation(r, A_LEAVING) is not None or pods.uid(r) in self.handled
            if self.listing is None and not leaving:
                continue
            want = not leaving and all(self.joined(r, stage) for stage in pods.stage_ids(r))
            if want != pods.joined_condition(r):
                self.actions.append(MarkJoined(pods.name(r), pods.uid(r), want))

    def announce_stages(self) -> None:
        """A Warning when StagesCovered or StagesReady turns bad, or says something new while bad."""
        if not self.t.spec.stages:
            return
        covered, stages_ready = status.stage_conditions(self, status.stage_rows(self))
        if not covered.status and covered.message != condition(self.previous, Type.STAGES_COVERED).get("message"):
            self.emit("Warning", Reason.UNCOVERED, covered.message)
        if stages_ready.reason == Reason.PATCH_NOT_APPLIED \
                and stages_ready.message != condition(self.previous, Type.STAGES_READY).get("message"):
            self.emit("Warning", Reason.PATCH_NOT_APPLIED, stages_ready.message)
