"""The reconcile decision as one pure function: plan(observation) -> (actions, status).

Nothing here talks to the API server or a head: `reconcile.observe` reads, `act` executes. Keeping
the decision pure lets a table of situations (tests/unit/test_plan.py) pin down every rule, and
makes a pass cheap to reason about: the same observation always yields the same actions.

The plan walks the pass in the order the old imperative loop did (children, head, head restart,
stale replicas, template roll, scale, membership) on a private model of the pods, so that a pod the
plan deletes early in the pass is not counted, joined or deleted again later in the same pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from omnistage_engine_patches import contract

from . import engine_truth, head_client, pods, pools
from .api import MemberState, OmniStagePoolSpec
from .conditions import Cond, EventReason, Progress, Reason, Type, merge, ready
from .names import A_CONFIG_HASH, A_LEAVING
from .render import (
    render_api_service,
    render_configmap,
    render_head_pod,
    render_master_service,
    render_network_policy,
    render_replica_pod,
    selector,
)
from .render.common import Pool, Target, pool_selector
from .render.pods import render_pool_pod
from .validation import InvalidSpec

# Drain states the act step records for a replica pod (by pod uid) while its `leave` runs elsewhere.
DRAIN_RUNNING = "running"  # the head is draining it; the pod stays until the leave returns
DRAIN_DONE = "done"  # the leave returned (drained or timed out): delete the pod
DRAIN_FAILED = "failed"  # the head could not be told; its heartbeat timeout detaches the replica


# ---- actions: what act.py executes, in order ---------------------------------------------------

@dataclass(frozen=True)
class Emit:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


@dataclass(frozen=True)
class EnsureChild:
    """Create the child, or patch it when the `compare` fields drifted (Event when it changed)."""
    obj: dict[str, Any]
    compare: tuple[str, ...]


@dataclass(frozen=True)
class CreatePod:
    obj: dict[str, Any]
    reason: str
    message: str  # "{pod}" is replaced by the created pod's name


@dataclass(frozen=True)
class DeletePod:
    name: str
    uid: str
    reason: str | None = None  # Event after the delete, when set
    message: str = ""


@dataclass(frozen=True)
class Annotate:
    name: str
    annotations: dict[str, str | None]


@dataclass(frozen=True)
class StartLeave:
    """Tell the head to stop routing to the pod's replicas and drain them; runs off the reconcile
    worker. `leaves` holds one (stage, replica id) per stage the pod runs (a pool pod may run two).
    The pod is deleted by a later pass, once the drain state says every leave returned."""
    pod: str
    uid: str
    leaves: tuple[tuple[int, int], ...]
    drain_seconds: int


@dataclass(frozen=True)
class Forget:
    """The head still lists a replica whose pod is gone: leave at once (no drain, nothing to route to)."""
    replica_id: int
    who: str
    stage: int = 0


@dataclass(frozen=True)
class Join:
    pod: str
    ip: str
    stage: int = 0


@dataclass(frozen=True)
class PoolStatus:
    """Write an OmniStagePool's status (the OmniStage's pass decides for its pools)."""
    name: str
    status: dict[str, Any]


Action = Emit | EnsureChild | CreatePod | DeletePod | Annotate | StartLeave | Forget | Join | PoolStatus


# ---- observation ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Observed:
    """Everything one pass read. `head_reachable` means a head client could be built (head pod has
    an IP and is not terminating); report/listing are None when not asked or no answer, with why."""
    obj: dict[str, Any]
    head: dict[str, Any] | None = None
    replicas: tuple[dict[str, Any], ...] = ()
    head_reachable: bool = False
    report: dict[str, Any] | None = None
    report_problem: str | None = None
    listing: dict[str, Any] | None = None
    listing_problem: str | None = None
    drains: Mapping[str, str] = field(default_factory=dict)  # pod uid -> DRAIN_* (act's drain executor)
    problems: tuple[str, ...] = ()  # what the previous act step could not do (joins refused, ...)
    pools: tuple[dict[str, Any], ...] = ()  # the OmniStagePools whose spec.omniStage names it


HEAD_NOT_READY = "head pod is not ready"

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


def _condition(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c.get("type") == ctype), {})


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def plan(t: Target | InvalidSpec, o: Observed, at: str | None = None) -> tuple[list[Action], dict[str, Any]]:
    """The one decision. `t` is the validated target or the InvalidSpec it raised; `at` is the
    timestamp for condition transitions (a parameter, so the function stays pure)."""
    at = at or now()
    previous = o.obj.get("status") or {}
    generation = o.obj["metadata"].get("generation")
    if isinstance(t, InvalidSpec):
        # Loses nothing: running pods stay as they are until the spec is fixed.
        message = str(t)
        actions: list[Action] = []
        if _condition(previous, Type.CONFIG_RENDERED).get("message") != message:
            actions.append(Emit("Warning", Reason.INVALID_SPEC, message))
        conds = [Cond(Type.CONFIG_RENDERED, False, Reason.INVALID_SPEC, message), Cond(Type.READY, False, Reason.INVALID_SPEC, message)]
        return actions, {**previous, "conditions": merge(previous.get("conditions", []), conds, generation, at)}
    m = _Model(t, o, previous)
    m.children()
    m.head_pod()
    m.engine_report()
    m.membership_read()
    m.retire_stale()
    m.scale()
    m.sync_membership()
    m.pool_statuses(at)
    return m.actions, m.status(generation, at)


class _Model:
    """One pass's working state: the observation plus what the plan has decided so far."""

    def __init__(self, t: Target, o: Observed, previous: dict[str, Any]):
        self.t, self.o, self.previous = t, o, previous
        self.actions: list[Action] = []
        self.progressing: list[str] = []
        self.head = o.head
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

    def head_live(self) -> bool:
        return self.head is not None and not pods.terminating(self.head) and bool(pods.ip(self.head))

    def head_talks(self) -> bool:
        """A head client exists and the head pod is Ready: the only head the plan reads answers from."""
        return self.o.head_reachable and self.head_live() and pods.ready(self.head)

    def live(self, pool: str | None = "*") -> list[dict[str, Any]]:
        """Replica and pool pods not going away; of one pool (None: stage-0 replicas) unless "*"."""
        return [r for r in self.o.replicas if not pods.terminating(r) and pods.uid(r) not in self.gone
                and (pool == "*" or pods.pool(r) == pool)]

    def members(self, stage: int = 0) -> list[dict[str, Any]]:
        return head_client.members(self.listing, stage) if self.listing is not None else []

    def member_of(self, pod: dict[str, Any], stage: int = 0) -> dict[str, Any] | None:
        for mm in self.members(stage):
            if mm.get("pod") == pods.name(pod) or (pods.ip(pod) and mm.get("host") == pods.ip(pod)):
                return mm
        return None

    def joined(self, pod: dict[str, Any], stage: int) -> bool:
        mm = self.member_of(pod, stage)
        return mm is not None and mm.get("pod") == pods.name(pod)

    def stage_ids(self) -> list[int]:
        return [0, *(s.id for s in self.t.spec.stages)]

    def delete(self, pod: dict[str, Any], reason: str | None = None, message: str = "") -> None:
        self.actions.append(DeletePod(pods.name(pod), pods.uid(pod), reason, message))
        self.gone.add(pods.uid(pod))

    # -- steps
    def children(self) -> None:
        t = self.t
        for child, compare in ((render_configmap(t), ("data",)), (render_api_service(t), ("spec",)),
                               (render_master_service(t), ("spec",)), (render_network_policy(t), ("spec",))):
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
                self.head = {**head, "metadata": {**head["metadata"], "deletionTimestamp": "planned"}}
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
        before = _condition(self.previous, Type.CACHE_CONSISTENT)
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
        """Replicas of another head incarnation or a finished process go at once; replicas whose
        template changed roll one at a time while every other replica is Ready."""
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
            elif self.listing is not None and self.member_of(r) is not None and not pods.ready(r):
                self._retire(r, 0, Progress.REPLACED_REPLICA, "it turned NotReady")
        live = self.live()
        if any(pods.uid(r) in self.handled for r in live):
            return  # one replica at a time: a roll waits for every drain in progress
        outdated = [r for r in live if self.want(r) is not None
                    and pods.template_hash(r) != pods.template_hash(self.want(r))]
        if outdated and all(pods.ready(r) for r in live if r not in outdated):
            self._retire(outdated[0], self.drain_of(outdated[0]), Progress.ROLLING_REPLICA, "its pod template changed")

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
        if len(staying) > desired:
            for victim in pods.choose_victims(staying, len(staying) - desired):
                self._retire(victim, self.drain_of(victim), Progress.SCALED_DOWN, self._why(Progress.SCALED_DOWN, victim))
            return
        # Pool pods too are created once the head has an IP, not once it is Ready: the head turns Ready
        # only after one replica of each remote stage registered.
        if len(staying) < desired and self.head_live():
            every = [r for r in self.o.replicas if pods.pool(r) == name]
            for i in pods.free_indices(every, desired - len(staying)):
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
                if _is_head_local(mm, head_ip) or mm.get("state") == contract.LEFT:
                    continue
                pod = live.get(mm.get("pod")) or next((r for r in runs if pods.ip(r) == mm.get("host")), None)
                if pod is None:
                    self.actions.append(Forget(mm["replicaId"], str(mm.get("pod") or mm.get("host")), stage))
        for name, pod in live.items():
            if not pods.ready(pod) or pods.annotation(pod, A_LEAVING) is not None \
                    or pods.uid(pod) in self.handled:
                continue
            for stage in pods.stage_ids(pod):
                if self.joined(pod, stage):
                    continue
                if stage == 0 and not self.verdict.consistent:
                    # The head holds an unjoined replica unroutable (contract.ROUTE_JOINED_ONLY_ENV); the
                    # multimodal cache guarantee is stage 0's (later stages take no frontend media).
                    self.membership_problem = f"{name} is not joined: {Type.CACHE_CONSISTENT} is False ({self.verdict.reason})"
                    continue
                self.actions.append(Join(name, pods.ip(pod), stage))

    # -- status
    def status(self, generation: int | None, at: str) -> dict[str, Any]:
        t, previous, head = self.t, self.previous, self.head
        live = self.live(None)  # stage-0 replicas: what spec.replicas and the scale selector count
        head_live = head is not None and not pods.terminating(head)
        engine_pods = ([head] if head_live else []) + live
        ready_pods = [x for x in engine_pods if pods.ready(x)]
        updated = (1 if head_live and pods.template_hash(head) == pods.template_hash(self.want_head) else 0) + sum(
            1 for r in live if pods.template_hash(r) == pods.template_hash(self.want_replica(pods.index(r)))
            and pods.head_uid(r) == pods.uid(head)) if head_live else 0
        problem = self.membership_problem or (self.o.problems[0] if self.o.problems else None)

        members, joined = [], 0
        for r in sorted(live, key=pods.index):
            mm = self.member_of(r)
            if pods.annotation(r, A_LEAVING) or pods.uid(r) in self.handled:
                state = MemberState.LEAVING
            elif mm is not None and mm.get("pod") == pods.name(r):
                state, joined = MemberState.JOINED, joined + 1
            elif pods.ready(r):
                state = MemberState.JOINING
            else:
                state = MemberState.PENDING
            member = {"pod": pods.name(r), "ip": pods.ip(r), "replicaId": mm.get("replicaId") if mm else None,
                      "state": str(state)}
            if state == MemberState.JOINING and not self.verdict.consistent:
                member["reason"] = f"{Type.CACHE_CONSISTENT}: {self.verdict.reason}"
            members.append(member)
        head_ready = head_live and pods.ready(head)
        if t.distributed:
            head_registered = any(_is_head_local(mm, pods.ip(head)) for mm in self.members())
            others = [mm for mm in self.members()
                      if not _is_head_local(mm, pods.ip(head)) and mm.get("state") != contract.LEFT]
        else:
            head_registered, others = head_ready, []  # one replica inside the head: nothing to sync
        registered = (1 if head_registered else 0) + joined
        desired = t.spec.replicas
        replica_desired = t.spec.replicas - 1 if t.distributed else 0
        replicas_ready = sum(1 for r in live if pods.ready(r))
        synced = (self.listing is not None or not t.distributed) and problem is None \
            and joined == replicas_ready and head_registered and len(others) == joined
        verdict = self.verdict
        every_pod = engine_pods + [r for r in self.live() if pods.pool(r) is not None]
        unschedulable = [f"{pods.name(x)}: {pods.unschedulable(x)}" for x in every_pod if pods.unschedulable(x)]
        exited = [f"{pods.name(x)}: engine exited ({x['status'].get('phase')})" for x in every_pod if pods.terminal(x)]
        failures = unschedulable + exited

        replicas_available = replicas_ready == replica_desired and len(live) == replica_desired
        conds = [
            Cond(Type.CONFIG_RENDERED, True, Reason.RENDERED,
                 f"effective stage-0 cache mode {t.cache.mode}: {t.cache.reason}"),
            Cond(Type.HEAD_READY, head_ready, Reason.HEAD_READY if head_ready else (Reason.HEAD_PENDING if head_live else Reason.NO_HEAD),
                 f"head pod {pods.name(head)}" if head else "no head pod"),
            Cond(Type.REPLICAS_AVAILABLE, replicas_available,
                 Reason.ALL_AVAILABLE if replicas_ready == replica_desired else Reason.UNAVAILABLE,
                 f"{replicas_ready}/{replica_desired} replica pods ready"),
            Cond(Type.MEMBERSHIP_SYNCED, synced, Reason.SYNCED if synced else Reason.NOT_SYNCED,
                 problem or (f"{registered}/{desired} replicas registered"
                             if self.listing is not None or not t.distributed else "membership not read yet")),
            Cond(Type.CACHE_CONSISTENT, verdict.consistent, verdict.reason, verdict.message),
            Cond(Type.REPLICA_FAILURE, bool(failures), Reason.UNSCHEDULABLE if unschedulable
                 else (Reason.ENGINE_EXITED if exited else Reason.NO_FAILURE), "; ".join(failures)),
        ]
        stages = self.stage_rows()
        stages_ready = all(row["registered"] == row["desired"] == row["ready"] and row["desired"] > 0
                           and not row.get("patchProblem") for row in stages)
        if t.spec.stages:
            conds += self.stage_conditions(stages, stages_ready)
        progressing = bool(self.progressing) or len(engine_pods) != desired or len(ready_pods) != desired \
            or any(row["ready"] != row["desired"] for row in stages)
        conds.append(Cond(Type.PROGRESSING, progressing, ",".join(sorted(set(self.progressing))) or
                          (Reason.CONVERGING if progressing else Reason.STABLE),
                          f"{len(engine_pods)}/{desired} engine pods, {len(ready_pods)} ready"
                          + "".join(f"; stage {row['id']}: {row['ready']}/{row['desired']} pods ready" for row in stages)))
        conds.append(ready(head_ready, replicas_available, synced, True, verdict.consistent, stages_ready))
        conds_out = merge(previous.get("conditions", []), conds, generation, at)

        head_status = None
        if head is not None:
            before = previous.get("head") or {}
            # After a container restart the last boot id is the dead process's: forget it, so the new
            # one's first answer is not taken for yet another restart.
            boot = (self.report or self.listing or {}).get("bootId") or (
                before.get("bootId") if before.get("uid") == pods.uid(head) and not self.head_restarted else None)
            head_status = {k: v for k, v in {"pod": pods.name(head), "uid": pods.uid(head), "ip": pods.ip(head),
                                             "bootId": boot, "restarts": pods.restarts(head)}.items() if v is not None}
        status = {
            "observedGeneration": generation,
            "replicas": len(engine_pods),
            "readyReplicas": len(ready_pods),
            "registeredReplicas": registered,
            "updatedReplicas": updated,
            "selector": selector(t),
            "effectiveCacheMode": str(t.cache.mode),
            "configHash": pods.annotation(self.want_head, A_CONFIG_HASH),
            "engineImage": t.engine_image,
            "head": head_status,
            "engine": engine_truth.summary(self.report) or (
                previous.get("engine") if head and (previous.get("head") or {}).get("uid") == pods.uid(head) else None),
            "membershipEpoch": (self.listing or {}).get("epoch", previous.get("membershipEpoch")),
            "members": members,
            "stages": [{k: v for k, v in row.items() if k != "patchProblem"} for row in stages] or None,
            "conditions": conds_out,
        }
        return {k: v for k, v in status.items() if v is not None}

    # -- stages >= 1 and their pools
    def stage_rows(self) -> list[dict[str, Any]]:
        """status.stages: per stage, its pool and that pool's pods (desired, Ready, joined for the stage)
        and the patch outcomes its replicas sent with their registration."""
        cover = pools.coverage(self.pools)
        rows = []
        for s in self.t.spec.stages:
            pool = cover.get(s.id)
            staying = self.staying(pool) if pool else []
            reports = {pods.name(r): (self.member_of(r, s.id) or {}).get("patches") for r in staying}
            row = {"id": s.id, "name": s.name or None, "pool": pool,
                   "desired": self.pool_of[pool].pool.spec.replicas if pool else 0,
                   "ready": sum(1 for r in staying if pods.ready(r)),
                   "registered": sum(1 for r in staying if self.joined(r, s.id)),
                   "patches": merged_outcomes([p for p in reports.values() if p]) or None,
                   "patchProblem": stage_patch_problem(reports)}
            rows.append({k: v for k, v in row.items() if v is not None})
        return rows

    def stage_conditions(self, rows: list[dict[str, Any]], stages_ready: bool) -> list[Cond]:
        uncovered = [row["id"] for row in rows if "pool" not in row]
        refused = [f"pool {f.name}: {f.problem[1]}" for f in self.pools if f.problem]
        if uncovered:
            covered = Cond(Type.STAGES_COVERED, False, Reason.UNCOVERED,
                           f"stage {', '.join(map(str, uncovered))} runs in no OmniStagePool: create one with "
                           f"spec.omniStage {self.t.name} and these spec.stageIds" + "".join(f"; {r}" for r in refused))
        else:
            covered = Cond(Type.STAGES_COVERED, True, Reason.ALL_COVERED,
                           "; ".join(f"stage {row['id']}: pool {row['pool']}" for row in rows)
                           + "".join(f"; {r}" for r in refused))
        if covered.message != _condition(self.previous, Type.STAGES_COVERED).get("message") and not covered.status:
            self.emit("Warning", Reason.UNCOVERED, covered.message)
        waiting = [f"stage {row['id']}: {row['registered']}/{row['desired']} registered, {row['ready']} ready"
                   for row in rows if not (row["registered"] == row["desired"] == row["ready"] and row["desired"])]
        broken = [f"stage {row['id']}: {row['patchProblem']}" for row in rows if row.get("patchProblem")]
        if broken:
            message = "; ".join(broken) + f". {engine_truth.PLUGIN_ADVICE}"
            ready_cond = Cond(Type.STAGES_READY, False, Reason.PATCH_NOT_APPLIED, message)
            if message != _condition(self.previous, Type.STAGES_READY).get("message"):
                self.emit("Warning", Reason.PATCH_NOT_APPLIED, message)
        else:
            ready_cond = Cond(Type.STAGES_READY, stages_ready, Reason.ALL_STAGES_SERVING if stages_ready else Reason.WAITING,
                              "; ".join(waiting) or "every stage's replicas are joined on the head")
        return [covered, ready_cond]

    def pool_statuses(self, at: str) -> None:
        """Each pool's status, written when it changed (the pass that decides for the pods says it)."""
        for f in self.pools:
            status = pool_status(f, self.t, self.staying(f.name), self.member_of, at)
            if status != (f.obj.get("status") or {}):
                self.actions.append(PoolStatus(f.name, status))


# The patches a stage pod's replica needs in effect: connector ports without the replica term, which
# the head also assumes when it advertises a replica's sender endpoint (each pod binds its own).
STAGE_POD_PATCHES = (contract.CONNECTOR_PORTS,)


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
    bad = sorted(f"{name} {report[name]} in {pod}" for pod, report in reports.items() if report
                 for name in STAGE_POD_PATCHES if report.get(name, contract.SKIPPED) not in contract.EFFECTIVE_OUTCOMES)
    return ", ".join(bad) or None


def pool_status(f: pools.Fitted, t: Target | None, staying: list[dict[str, Any]],
                member_of: Callable[[dict[str, Any], int], dict[str, Any] | None] = lambda pod, stage: None,
                at: str | None = None) -> dict[str, Any]:
    """An OmniStagePool's status. `staying`: its pods not on their way out; `member_of(pod, stage)`:
    the head's listing entry of the pod's replica of that stage."""
    previous = f.obj.get("status") or {}
    generation = f.obj["metadata"].get("generation")
    ids = f.pool.spec.stage_ids if f.pool else []
    members, registered = [], 0
    for r in sorted(staying, key=pods.index):
        listed = {k: member_of(r, k) for k in pods.stage_ids(r)}
        done = all(mm is not None and mm.get("pod") == pods.name(r) for mm in listed.values())
        registered += done
        state = MemberState.JOINED if done else (MemberState.JOINING if pods.ready(r) else MemberState.PENDING)
        member = {"pod": pods.name(r), "ip": pods.ip(r), "state": str(state),
                  "replicaIds": {str(k): mm["replicaId"] for k, mm in listed.items() if mm is not None}}
        members.append({k: v for k, v in member.items() if v is not None})
    ready_pods = sum(1 for r in staying if pods.ready(r))
    if f.problem:
        cond = Cond(Type.READY, False, f.problem[0], f.problem[1])
    else:
        desired = f.pool.spec.replicas
        ok = ready_pods == registered == len(staying) == desired
        cond = Cond(Type.READY, ok, Reason.ALL_REPLICAS_SERVING if ok else Reason.WAITING,
                    f"{ready_pods}/{desired} pods ready, {registered} joined on the head for stages "
                    + ", ".join(map(str, ids)))
    status = {
        "observedGeneration": generation,
        "replicas": len(staying),
        "readyReplicas": ready_pods,
        "registeredReplicas": registered,
        "selector": pool_selector(t, f.name) if t is not None else previous.get("selector", ""),
        "members": members,
        "conditions": merge(previous.get("conditions", []), [cond], generation, at or now()),
    }
    return {k: v for k, v in status.items() if v is not None}


def _is_head_local(m: dict[str, Any], head_ip: str | None) -> bool:
    return bool(m.get("local")) or (m.get("host") == head_ip and not m.get("pod"))
