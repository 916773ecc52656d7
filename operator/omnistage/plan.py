"""The reconcile decision as one pure function: plan(observation) -> (actions, status).

Nothing here talks to the API server or a head: `reconcile.observe` reads, `act` executes. Keeping
the decision pure lets a table of situations (tests/unit/test_plan.py) pin down every rule, and
makes a pass cheap to reason about: the same observation always yields the same actions.

The plan walks the pass in the order the old imperative loop did (children, head, head restart,
stale replicas, template roll, scale, membership) on a private model of the pods, so that a pod the
plan deletes early in the pass is not counted, joined or deleted again later in the same pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from omnistage_engine_patches import contract

from . import engine_truth, head_client, pods
from .conditions import (
    CACHE_CONSISTENT,
    CONFIG_RENDERED,
    HEAD_READY,
    MEMBERSHIP_SYNCED,
    PROGRESSING,
    R_CREATED_HEAD,
    R_HEAD_RESTARTED,
    R_INVALID_SPEC,
    R_RENDERED,
    R_REPLACED_REPLICA,
    R_ROLLED_REPLICA,
    R_ROLLING_HEAD,
    R_ROLLING_REPLICA,
    R_SCALED_DOWN,
    R_SCALED_UP,
    READY,
    REPLICA_FAILURE,
    REPLICAS_AVAILABLE,
    Cond,
    merge,
    ready,
)
from .render import (
    render_api_service,
    render_configmap,
    render_head_pod,
    render_master_service,
    render_network_policy,
    render_replica_pod,
    selector,
)
from .render.common import A_CONFIG_HASH, Target
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
    """Tell the head to stop routing to the replica and drain it; runs off the reconcile worker.
    The pod is deleted by a later pass, once the drain state says the leave returned."""
    pod: str
    uid: str
    replica_id: int
    drain_seconds: int


@dataclass(frozen=True)
class Forget:
    """The head still lists a replica whose pod is gone: leave at once (no drain, nothing to route to)."""
    replica_id: int
    who: str


@dataclass(frozen=True)
class Join:
    pod: str
    ip: str


Action = Emit | EnsureChild | CreatePod | DeletePod | Annotate | StartLeave | Forget | Join


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


HEAD_NOT_READY = "head pod is not ready"

# Why a replica leaves, by the reason its `leaving` annotation records (the delete's Event says it).
_WHY = {
    R_SCALED_DOWN: "spec.replicas is {replicas}",
    R_ROLLING_REPLICA: "its pod template changed",
    R_ROLLED_REPLICA: "it belongs to a previous head",
    R_REPLACED_REPLICA: "its engine exited or it turned NotReady",
}


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
        if _condition(previous, CONFIG_RENDERED).get("message") != message:
            actions.append(Emit("Warning", R_INVALID_SPEC, message))
        conds = [Cond(CONFIG_RENDERED, False, R_INVALID_SPEC, message), Cond(READY, False, R_INVALID_SPEC, message)]
        return actions, {**previous, "conditions": merge(previous.get("conditions", []), conds, generation, at)}
    m = _Model(t, o, previous)
    m.children()
    m.head_pod()
    m.engine_report()
    m.membership_read()
    m.retire_stale()
    m.scale()
    m.sync_membership()
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
        self.verdict: engine_truth.Verdict | None = None
        self.want_head = render_head_pod(t)  # rendered once per pass
        self._want_replica: dict[int, dict[str, Any]] = {}

    # -- helpers
    def emit(self, etype: str, reason: str, message: str) -> None:
        self.actions.append(Emit(etype, reason, message))

    def want_replica(self, index: int) -> dict[str, Any]:
        if index not in self._want_replica:
            self._want_replica[index] = render_replica_pod(self.t, index, pods.ip(self.head) or "",
                                                           pods.uid(self.head))
        return self._want_replica[index]

    def head_live(self) -> bool:
        return self.head is not None and not pods.terminating(self.head) and bool(pods.ip(self.head))

    def head_talks(self) -> bool:
        """A head client exists and the head pod is Ready: the only head the plan reads answers from."""
        return self.o.head_reachable and self.head_live() and pods.ready(self.head)

    def live(self) -> list[dict[str, Any]]:
        return [r for r in self.o.replicas if not pods.terminating(r) and pods.uid(r) not in self.gone]

    def members(self) -> list[dict[str, Any]]:
        return head_client.members(self.listing) if self.listing is not None else []

    def member_of(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        for mm in self.members():
            if mm.get("pod") == pods.name(pod) or (pods.ip(pod) and mm.get("host") == pods.ip(pod)):
                return mm
        return None

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
                self.emit("Normal", R_ROLLING_HEAD, f"replacing head pod {pods.name(head)}: {why}")
                self.actions.append(DeletePod(pods.name(head), pods.uid(head)))
                self.progressing.append(R_ROLLING_HEAD)
                # What the old head said no longer counts; its successor is created on a later pass
                # (the name is taken until the old pod is gone).
                self.head = {**head, "metadata": {**head["metadata"], "deletionTimestamp": "planned"}}
                self.listing, self.report = None, None
                return
        if head is None:
            self.actions.append(CreatePod(want, R_CREATED_HEAD, "created head pod {pod}"))
            self.progressing.append("CreatingHead")

    def engine_report(self) -> None:
        """Hold the cache guarantee against what the head says it runs."""
        if not self.head_talks():
            why = HEAD_NOT_READY
            self.report = None
        else:
            why = self.o.report_problem
        self.verdict = engine_truth.check(str(self.t.cache.mode), self.t.distributed, self.report, why)
        before = _condition(self.previous, CACHE_CONSISTENT)
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
        if not self.head_talks():
            self.membership_problem, self.listing = HEAD_NOT_READY, None
            return
        if self.listing is None:
            self.membership_problem = f"head unreachable: {self.o.listing_problem}"
            return
        before = self.previous.get("head") or {}
        boot = self.listing.get("bootId")
        if before.get("uid") == pods.uid(self.head) and before.get("bootId") and boot != before.get("bootId"):
            # Same head pod, new engine process: its replicas registered with the old one.
            self.emit("Warning", R_HEAD_RESTARTED,
                      f"head engine restarted (boot id {before.get('bootId')} -> {boot}); rolling every replica")
            for r in self.live():
                self.delete(r)
            self.progressing.append(R_HEAD_RESTARTED)

    def _retire(self, pod: dict[str, Any], drain_seconds: int, reason: str, why: str) -> None:
        """Tell the engine first, then delete: the engine stops routing to the replica and drains it,
        so no request is cut off by the pod's deletion. The drain is started here and finished on a
        later pass (the `leaving` annotation records the decision across passes and restarts)."""
        uid = pods.uid(pod)
        if uid in self.handled or uid in self.gone:
            return
        self.handled.add(uid)
        if pods.annotation(pod, pods.A_LEAVING) is None:
            self.actions.append(Annotate(pods.name(pod), {pods.A_LEAVING: reason}))
        self.progressing.append(reason)
        member = self.member_of(pod)
        drain = self.o.drains.get(uid)
        if member is not None and member.get("state") != contract.LEFT and self.head_talks() \
                and drain not in (DRAIN_DONE, DRAIN_FAILED):
            if drain is None:  # not started, or started by an operator that has since restarted
                self.actions.append(StartLeave(pods.name(pod), uid, member["replicaId"], drain_seconds))
            return  # DRAIN_RUNNING: the pod stays until the head let it go
        # Left, never joined, or the head cannot be told (its heartbeat timeout detaches it).
        self.delete(pod, reason, f"deleted replica pod {pods.name(pod)}: {why}")

    def retire_stale(self) -> None:
        """Replicas of another head incarnation or a finished process go at once; replicas whose
        template changed roll one at a time while every other replica is Ready."""
        if not self.head_live():
            return
        t, head_uid = self.t, pods.uid(self.head)
        drain = t.spec.engine.drain_timeout_seconds
        for r in self.live():
            if pods.annotation(r, pods.A_LEAVING) is not None:
                # A retirement decided earlier (this operator or one before a restart) is finished,
                # whatever happened to the spec since.
                reason = pods.annotation(r, pods.A_LEAVING) or R_SCALED_DOWN
                self._retire(r, drain if reason in (R_SCALED_DOWN, R_ROLLING_REPLICA) else 0, reason,
                             _WHY.get(reason, "it was leaving").format(replicas=t.spec.replicas))
            elif pods.head_uid(r) != head_uid:
                self._retire(r, 0, R_ROLLED_REPLICA, "it belongs to a previous head")
            elif pods.terminal(r):
                self._retire(r, 0, R_REPLACED_REPLICA, f"its engine exited ({r['status'].get('phase')})")
            elif self.listing is not None and self.member_of(r) is not None and not pods.ready(r):
                self._retire(r, 0, R_REPLACED_REPLICA, "it turned NotReady")
        live = self.live()
        if any(pods.uid(r) in self.handled for r in live):
            return  # one replica at a time: a roll waits for every drain in progress
        outdated = [r for r in live if pods.template_hash(r) != pods.template_hash(self.want_replica(pods.index(r)))]
        if outdated and all(pods.ready(r) for r in live if r not in outdated):
            self._retire(outdated[0], drain, R_ROLLING_REPLICA, "its pod template changed")

    def staying(self) -> list[dict[str, Any]]:
        """Live replicas not on their way out: what spec.replicas is compared with."""
        return [r for r in self.live() if pods.uid(r) not in self.handled]

    def scale(self) -> None:
        t = self.t
        staying = self.staying()
        desired = t.spec.replicas - 1 if t.distributed else 0
        if len(staying) > desired:
            for victim in pods.choose_victims(staying, len(staying) - desired):
                self._retire(victim, t.spec.engine.drain_timeout_seconds, R_SCALED_DOWN,
                            f"spec.replicas is {t.spec.replicas}")
            return
        if len(staying) < desired and self.head_live():
            for i in pods.free_indices(list(self.o.replicas), desired - len(staying)):
                self.actions.append(CreatePod(self.want_replica(i), R_SCALED_UP,
                                              f"created replica pod {{pod}} (spec.replicas {t.spec.replicas})"))
                self.progressing.append("ScalingUp")

    def sync_membership(self) -> None:
        """Join every Ready replica the head has not acknowledged; make the head forget every replica
        whose pod is gone (it would otherwise wait out its 30 s heartbeat timeout)."""
        if self.listing is None:
            return
        live = {pods.name(r): r for r in self.live()}
        head_ip = pods.ip(self.head)
        for mm in self.members():
            if _is_head_local(mm, head_ip) or mm.get("state") == contract.LEFT:
                continue
            pod = live.get(mm.get("pod")) or next((r for r in live.values() if pods.ip(r) == mm.get("host")), None)
            if pod is None:
                self.actions.append(Forget(mm["replicaId"], str(mm.get("pod") or mm.get("host"))))
        for name, pod in live.items():
            member = self.member_of(pod)
            if not pods.ready(pod) or pods.annotation(pod, pods.A_LEAVING) is not None \
                    or pods.uid(pod) in self.handled:
                continue
            if member is not None and member.get("pod") == name:
                continue
            if not self.verdict.consistent:
                # The head holds an unjoined replica unroutable (contract.ROUTE_JOINED_ONLY_ENV).
                self.membership_problem = f"{name} is not joined: {CACHE_CONSISTENT} is False ({self.verdict.reason})"
                continue
            self.actions.append(Join(name, pods.ip(pod)))

    # -- status
    def status(self, generation: int | None, at: str) -> dict[str, Any]:
        t, previous, head = self.t, self.previous, self.head
        live = self.live()
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
            if pods.annotation(r, pods.A_LEAVING) or pods.uid(r) in self.handled:
                state = "Leaving"
            elif mm is not None and mm.get("pod") == pods.name(r):
                state, joined = "Joined", joined + 1
            elif pods.ready(r):
                state = "Joining"
            else:
                state = "Pending"
            member = {"pod": pods.name(r), "ip": pods.ip(r), "replicaId": mm.get("replicaId") if mm else None,
                      "state": state}
            if state == "Joining" and not self.verdict.consistent:
                member["reason"] = f"{CACHE_CONSISTENT}: {self.verdict.reason}"
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
        failures = [f"{pods.name(x)}: {pods.unschedulable(x)}" for x in engine_pods if pods.unschedulable(x)]
        failures += [f"{pods.name(x)}: engine exited ({x['status'].get('phase')})" for x in engine_pods
                     if pods.terminal(x)]

        replicas_available = replicas_ready == replica_desired and len(live) == replica_desired
        conds = [
            Cond(CONFIG_RENDERED, True, R_RENDERED,
                 f"effective stage-0 cache mode {t.cache.mode}: {t.cache.reason}"),
            Cond(HEAD_READY, head_ready, "HeadReady" if head_ready else ("HeadPending" if head_live else "NoHead"),
                 f"head pod {pods.name(head)}" if head else "no head pod"),
            Cond(REPLICAS_AVAILABLE, replicas_available,
                 "AllAvailable" if replicas_ready == replica_desired else "Unavailable",
                 f"{replicas_ready}/{replica_desired} replica pods ready"),
            Cond(MEMBERSHIP_SYNCED, synced, "Synced" if synced else "NotSynced",
                 problem or (f"{registered}/{desired} replicas registered"
                             if self.listing is not None or not t.distributed else "membership not read yet")),
            Cond(CACHE_CONSISTENT, verdict.consistent, verdict.reason, verdict.message),
            Cond(REPLICA_FAILURE, bool(failures), "Unschedulable" if any("engine exited" not in f for f in failures)
                 else ("EngineExited" if failures else "NoFailure"), "; ".join(failures)),
        ]
        progressing = bool(self.progressing) or len(engine_pods) != desired or len(ready_pods) != desired
        conds.append(Cond(PROGRESSING, progressing, ",".join(sorted(set(self.progressing))) or
                          ("Converging" if progressing else "Stable"),
                          f"{len(engine_pods)}/{desired} engine pods, {len(ready_pods)} ready"))
        conds.append(ready(head_ready, replicas_available, synced, True, verdict.consistent))
        conds_out = merge(previous.get("conditions", []), conds, generation, at)

        head_status = None
        if head is not None:
            before = previous.get("head") or {}
            boot = (self.report or self.listing or {}).get("bootId") or (
                before.get("bootId") if before.get("uid") == pods.uid(head) else None)
            head_status = {k: v for k, v in {"pod": pods.name(head), "uid": pods.uid(head), "ip": pods.ip(head),
                                             "bootId": boot}.items() if v is not None}
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
            "conditions": conds_out,
        }
        return {k: v for k, v in status.items() if v is not None}


def _is_head_local(m: dict[str, Any], head_ip: str | None) -> bool:
    return bool(m.get("local")) or (m.get("host") == head_ip and not m.get("pod"))
