"""The reconcile decision as one pure function: plan(t, observed) -> Plan(actions, status, pools).

Nothing here talks to the API server or a head: `reconcile.observe` reads, `act` executes, and
status.py describes what the decision leaves. Keeping the decision pure lets a table of situations
(tests/unit/test_plan.py) pin down every rule, and makes a pass cheap to reason about: the same
observation always yields the same actions.

The steps run in dependency order (children, head, head restart, stale replicas, template roll,
scale, membership) on one Pass, which records what each decided, so that a pod deleted early in
the pass is not counted, joined or deleted again by a later step. Which pods go and which are made
(stale replicas, the roll, the scale) is rollout.py's; the rest of the steps are the Pass's own.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from omnistage_engine_patches import contract

from ..api import OmniStagePoolSpec
from ..api.child_kinds import BY_KIND
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
from . import engine_truth, headswap, identity, liveness, pods, pools, rollout, status
from .actions import (
    HEAD_NOT_READY,
    Action,
    CreatePod,
    DeletePod,
    EnsureChild,
    Join,
    LeaveDeparted,
    MarkJoined,
    Observed,
    OnOtherHead,
    PostEvent,
    StartLeave,
)

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
    if o.secret_refused:
        return _secret_refused(t, o, generation, at)
    p = decide(t, o, at)
    return Plan(p.actions, status.omnistage_status(p, generation, at), status.pool_statuses(p, at))


def decide(t: Target, o: Observed, at: str | None = None) -> Pass:
    p = Pass(t, o, at or timestamp())
    p.children()
    identity.restore(p)
    headswap.begin(p)
    p.head_pod()
    p.engine_report()
    p.membership_read()
    rollout.retire_stale(p)
    rollout.roll(p)
    rollout.scale(p)
    p.sync_membership()
    p.mark_joined()
    liveness.announce(p)
    p.announce_stages()
    headswap.run(p)
    return p


def _invalid(err: InvalidSpec, o: Observed, generation: int | None, at: str) -> Plan:
    """Loses nothing: running pods stay as they are until the spec is fixed."""
    previous = o.obj.get("status") or {}
    message = str(err)
    actions: list[Action] = []
    if condition(previous, Type.CONFIG_RENDERED).get("message") != message:
        actions.append(PostEvent("Warning", err.reason, message))
    conds = [Cond(Type.CONFIG_RENDERED, False, err.reason, message),
             Cond(Type.READY, False, err.reason, message)]
    return Plan(
        actions, {**previous, "conditions": merge(previous.get("conditions", []), conds, generation, at)}, {}
    )


def _secret_refused(t: Target, o: Observed, generation: int | None, at: str) -> Plan:
    """A Secret of the membership token's name that the OmniStage does not own: pods would mount a
    token the operator did not issue. Loses nothing: the children are kept as rendered, running pods
    stay as they are, and nothing is created or deleted until the Secret is deleted or renamed."""
    p = Pass(t, o, at)
    p.children()
    message = o.secret_refused or ""
    if condition(p.previous, Type.MEMBERSHIP_SYNCED).get("message") != message:
        p.emit("Warning", Reason.NOT_SYNCED, message)
    conds = [Cond(Type.MEMBERSHIP_SYNCED, False, Reason.NOT_SYNCED, message),
             Cond(Type.READY, False, Reason.WAITING, f"waiting for {Type.MEMBERSHIP_SYNCED}: {message}")]
    return Plan(
        p.actions,
        {**p.previous, "conditions": merge(p.previous.get("conditions", []), conds, generation, at)},
        {},
    )


def mounts_membership_secret(actions: list[Action], o: Observed) -> bool:
    """An engine pod is about to mount the membership Secret: these actions create one, or one is
    scheduled and not started. Only then does a pass read the Secret (RBAC gives the operator no
    watch on Secrets, and a read every pass would cost a request at rest): a deleted Secret is
    re-created before a pod needs it, and running pods keep the copy their kubelet mounted."""
    def creates(acts: list[Action] | tuple[Action, ...]) -> bool:
        return any(
            isinstance(a, CreatePod) or (isinstance(a, OnOtherHead) and creates(a.actions)) for a in acts
        )

    seen = [o.head, *o.replicas, *((o.other.head, *o.other.replicas) if o.other is not None else ())]
    return creates(actions) or any(pod is not None and pods.mounting(pod) for pod in seen)


class Pass:
    """One pass's working state: the observation plus what the steps decided so far. Once decide()
    returns it is the decision that status.py describes."""

    def __init__(self, t: Target, o: Observed, at: str, want_head: dict[str, Any] | None = None):
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
        self.head_restarted = False  # this pass rolls replicas of an earlier engine of this head pod
        self.verdict: engine_truth.Verdict | None = None
        self.want_head = want_head or render_head_pod(t)  # rendered once per pass
        # Set by headswap.begin while a head change runs (or is said before it runs in place):
        self.keep_head = False  # an outdated head is not deleted by head_pod()
        self.create_head = True  # a missing head is created by head_pod()
        self.replica_target: int | None = None  # stage-0 replicas this set gets (None: t.replica_pods)
        self.neighbours: tuple[dict[str, Any], ...] = ()  # the other set's replicas (their names are taken)
        self.swap: headswap.Swap | None = None
        self.in_place: tuple[str, str] | None = None  # (reason, why) a head change cannot surge
        self.scale_held: str | None = None  # why a stage-0 scale-down keeps a pod (liveness.keep_one_live)
        self._want_replica: dict[int, dict[str, Any]] = {}
        self._want_pool_pod: dict[tuple[str, int], dict[str, Any]] = {}
        self.pools = pools.fit(t, t.name, o.pools)
        self.pool_of = {f.name: f for f in self.pools}

    # -- helpers
    def emit(self, etype: str, reason: str, message: str) -> None:
        self.actions.append(PostEvent(etype, reason, message))

    def want_replica(self, index: int) -> dict[str, Any]:
        if index not in self._want_replica:
            self._want_replica[index] = render_replica_pod(self.t, index, pods.ip(self.head) or "",
                                                           pods.uid(self.head), pods.restarts(self.head))
        return self._want_replica[index]

    def want_pool_pod(self, pool: Pool, index: int) -> dict[str, Any]:
        key = (pool.name, index)
        if key not in self._want_pool_pod:
            self._want_pool_pod[key] = render_pool_pod(self.t, pool, index, pods.ip(self.head) or "",
                                                       pods.uid(self.head), pods.restarts(self.head))
        return self._want_pool_pod[key]

    def want(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        """The pod as it should be now; None for a pod of a pool that cannot run (it is not rolled)."""
        if pods.pool(pod) is None:
            return self.want_replica(pods.index(pod))
        fitted = self.pool_of.get(pods.pool(pod))
        return (
            self.want_pool_pod(fitted.pool, pods.index(pod)) if fitted is not None and fitted.runs else None
        )

    def drain_of(self, pod: dict[str, Any]) -> int:
        if pods.pool(pod) is None:
            return self.t.spec.engine.drain_timeout_seconds
        fitted = self.pool_of.get(pods.pool(pod))
        return (
            fitted.pool.spec.drain_timeout_seconds
            if fitted is not None and fitted.pool
            else DEFAULT_POOL_DRAIN
        )

    def head_staying(self) -> bool:
        """A head pod that is not on its way out (by an earlier delete or by this pass)."""
        return self.head is not None and not pods.terminating(self.head) and not self.head_going

    def head_live(self) -> bool:
        return self.head_staying() and bool(pods.ip(self.head))

    def head_talks(self) -> bool:
        """A head client exists and the head answers (Ready, or started: pods.answers): the only head
        the plan reads answers from."""
        return self.o.head_addressable and self.head_live() and pods.answers(self.head)

    def live(self, pool: str | None = "*") -> list[dict[str, Any]]:
        """Replica and pool pods not going away; of one pool (None: stage-0 replicas) unless "*"."""
        return [r for r in self.o.replicas if not pods.terminating(r) and pods.uid(r) not in self.gone
                and (pool == "*" or pods.pool(r) == pool)]

    def members(self, stage: int = 0) -> list[contract.Member]:
        return contract.members(self.listing, stage) if self.listing is not None else []

    def member_of(self, pod: dict[str, Any], stage: int = 0) -> dict[str, Any] | None:
        """The member this pod runs: joined under its name from its address, else registered from
        its address. A member joined under its name from another address is an earlier pod of that
        name (names come back after a scale-down or an eviction), not this one."""
        name, ip = pods.name(pod), pods.ip(pod)
        by_host = None
        for mm in self.members(stage):
            same_host = bool(ip) and mm.get("host") == ip
            if mm.get("pod") == name and (same_host or not ip or not mm.get("host")):
                return mm
            if same_host and by_host is None:
                by_host = mm
        return by_host

    def joined(self, pod: dict[str, Any], stage: int) -> bool:
        mm = self.member_of(pod, stage)
        return mm is not None and mm.get("pod") == pods.name(pod)

    def engine_live(self, pod: dict[str, Any], stage: int) -> bool:
        """Joined, and the head can route to its engine now (attached, heartbeats on time)."""
        mm = self.member_of(pod, stage)
        return mm is not None and mm.get("pod") == pods.name(pod) and contract.is_live(mm)

    def serves(self, pod: dict[str, Any], unread: bool = False) -> bool:
        """Ready and live at the head for every stage it runs: the head's word too, not only the
        pod's Ready (which kwok, for one, writes True at start-up), and never a silent or detached
        engine. `unread`: the answer when the membership was not read (a roll drains nothing on a
        guess; status trusts the pod's Ready)."""
        if self.listing is None:
            return unread and pods.ready(pod)
        return pods.ready(pod) and all(self.engine_live(pod, stage) for stage in pods.stage_ids(pod))

    def head_engine(self) -> contract.Member | None:
        """The head's own stage-0 engine as its listing says it (None: static, or not read)."""
        if self.head is None:
            return None
        head_ip = pods.ip(self.head)
        return next((mm for mm in self.members() if contract.is_head_local(mm, head_ip)), None)

    def head_serves(self) -> bool:
        """The head pod is Ready and, where it keeps a membership, its own engine is live: a head
        whose engine is silent or gone is no serving replica (issue 26), whatever its pod says.
        Unread membership trusts the pod's Ready, as serves(unread=True) does."""
        if not self.head_staying() or not pods.ready(self.head):
            return False
        if not self.t.distributed or self.listing is None:
            return True
        mm = self.head_engine()
        return mm is not None and contract.is_live(mm)

    def replica_desired(self) -> int:
        """Stage-0 replicas this set is scaled to."""
        if self.replica_target is not None:
            return self.replica_target
        return self.t.replica_pods

    def holds_outdated_head(self) -> bool:
        """A head change runs (or waits to run in place): the head stays, its replicas are not rolled."""
        return self.keep_head and headswap.outdated(self)

    def stage_ids(self) -> list[int]:
        return [0, *(s.id for s in self.t.spec.stages)]

    def delete(self, pod: dict[str, Any], reason: str | None = None, message: str = "") -> None:
        self.actions.append(DeletePod(pods.name(pod), pods.uid(pod), reason, message))
        self.gone.add(pods.uid(pod))

    # -- steps
    def children(self) -> None:
        t = self.t
        budgets = [
            render_disruption_budget(t),
            *(render_disruption_budget(t, f.pool) for f in self.pools if f.runs),
        ]
        for child in (render_configmap(t), render_api_service(t), render_master_service(t),
                      render_network_policy(t), *budgets):
            self.actions.append(EnsureChild(child, BY_KIND[child["kind"]].owned_fields))

    def head_pod(self) -> None:
        head, want = self.head, self.want_head
        if head is not None and not pods.terminating(head):
            outdated = pods.template_hash(head) != pods.template_hash(want) and not self.keep_head
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
        if head is None and self.create_head:
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
        # A head whose container restarted runs a new engine, which its replicas never register with
        # again: rollout.retire_stale rolls them, by the restart count each pod recorded when it was
        # made (from the pods, never from status, which an OmniStage editor may write).
        if not self.head_talks():
            self.membership_problem, self.listing = HEAD_NOT_READY, None
            return
        if self.listing is None:
            self.membership_problem = f"head unreachable: {self.o.listing_problem}"

    def staying(self, pool: str | None) -> list[dict[str, Any]]:
        """Live pods of a pool (None: stage-0 replicas) not on their way out: what its replicas is
        compared with."""
        return [r for r in self.live(pool) if pods.uid(r) not in self.handled]

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
                    self.actions.append(
                        LeaveDeparted(mm["replicaId"], str(mm.get("pod") or mm.get("host")), stage)
                    )
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
                    self.membership_problem = (
                        f"{name} is not joined: {Type.CACHE_CONSISTENT} is False ({self.verdict.reason})"
                    )
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
        return next(
            (r for r in self.o.replicas if pods.terminating(r) and mm.get("pod") == pods.name(r)), None
        )

    def drain_disrupted(self) -> None:
        """A replica pod someone else deletes keeps its engine running for its grace period (its
        preStop hook is draining it already): have the head stop routing to it and drain it within
        what remains of that grace, less the engine's own shutdown. Once per pod (the drain state).
        Also when the hook's leave got there first (the member is draining): the head's leave is
        idempotent (the second waits for the first), and the drain is said (Event, Leaving) either way."""
        for r in self.o.replicas:
            if not pods.terminating(r) or pods.uid(r) in self.o.drains:
                continue
            leaves = tuple((stage, mm["replicaId"]) for stage in pods.stage_ids(r)
                           if (mm := self.member_of(r, stage)) is not None and mm.get("pod") == pods.name(r)
                           and mm.get("state") != contract.LEFT)
            if not leaves:
                continue  # left already (the operator's own deletes come after the leave), or never joined
            drain = max(0, min(self.drain_of(r), pods.grace_left(r, self.at) - SHUTDOWN_SECONDS))
            kind = "pool pod" if pods.pool(r) else "replica pod"
            if pods.gated(r) and pods.joined_condition(r):
                self.actions.append(MarkJoined(pods.name(r), pods.uid(r), False))
            self.emit(
                "Normal",
                EventReason.DISRUPTED,
                f"{kind} {pods.name(r)} is being deleted by someone else "
                f"(eviction, node drain, kubectl delete): draining it for up to {drain}s",
            )
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
            # Live, not only joined: a silent engine leaves the Endpoints and the PodDisruptionBudget's
            # count until its heartbeats resume.
            want = not leaving and all(self.engine_live(r, stage) for stage in pods.stage_ids(r))
            if want != pods.joined_condition(r):
                self.actions.append(MarkJoined(pods.name(r), pods.uid(r), want))

    def announce_stages(self) -> None:
        """A Warning when StagesCovered or StagesReady turns bad, or says something new while bad."""
        if not self.t.spec.stages:
            return
        covered, stages_ready = status.stage_conditions(self, status.stage_rows(self))
        if not covered.status and covered.message != condition(self.previous, Type.STAGES_COVERED).get(
            "message"
        ):
            self.emit("Warning", Reason.UNCOVERED, covered.message)
        if stages_ready.reason == Reason.PATCH_NOT_APPLIED \
                and stages_ready.message != condition(self.previous, Type.STAGES_READY).get("message"):
            self.emit("Warning", Reason.PATCH_NOT_APPLIED, stages_ready.message)
