"""The one idempotent reconcile path: read the OmniStage and its children from the API, make the
children match the spec, keep the engine's membership true, and write what it saw to status.

Nothing is remembered between calls: every decision is taken from what the API server and the
engine head say now, so an operator restart (or a crash in the middle of a scale) converges.
"""

from __future__ import annotations

import base64
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException
from omnistage_engine_patches import contract

from . import engine_truth, head_client, kube, pods
from .conditions import (
    CACHE_CONSISTENT,
    CONFIG_RENDERED,
    HEAD_READY,
    MEMBERSHIP_SYNCED,
    PROGRESSING,
    READY,
    REPLICA_FAILURE,
    REPLICAS_AVAILABLE,
    Cond,
    merge,
    ready,
)
from .head_client import HeadClient, HeadRefused, HeadUnreachable
from .metrics import STATUS
from .render import (
    render_api_service,
    render_configmap,
    render_head_pod,
    render_master_service,
    render_network_policy,
    render_replica_pod,
    render_secret,
    selector,
    target_from,
)
from .render.common import L_OMNISTAGE, L_ROLE, ROLE_REPLICA, Target
from .render.pods import TOKEN_KEY
from .validation import InvalidSpec

log = logging.getLogger(__name__)

# Emits a Kubernetes Event on the OmniStage: (type "Normal"|"Warning", reason, message).
Emit = Callable[[str, str, str], None]

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(namespace: str, name: str) -> threading.Lock:
    """One reconcile per OmniStage at a time (handlers, timer and pod events all call in)."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Pass:
    """What one reconcile pass observed and did; turned into status at the end."""

    t: Target
    emit: Emit
    head: dict[str, Any] | None = None
    replicas: list[dict[str, Any]] = field(default_factory=list)
    progressing: list[str] = field(default_factory=list)
    head_client: HeadClient | None = None
    report: dict[str, Any] | None = None
    verdict: engine_truth.Verdict | None = None
    listing: dict[str, Any] | None = None
    membership_problem: str | None = None
    members: list[dict[str, Any]] = field(default_factory=list)

    @property
    def joins_allowed(self) -> bool:
        """No replica gets traffic from a head whose cache guarantee is not proven."""
        return self.verdict is not None and self.verdict.consistent


def reconcile(namespace: str, name: str, emit: Emit) -> dict[str, Any] | None:
    with _lock(namespace, name):
        obj = kube.get_omnistage(namespace, name)
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            STATUS.observe(namespace, name, None)
            return None  # children go with it through their ownerReferences
        try:
            status = _reconcile(obj, emit)
        except ApiException as err:
            if err.status == 403 and "being terminated" in (err.body or ""):
                # The namespace is going away with everything in it: nothing to converge to, and
                # succeeding lets kopf release its finalizer.
                log.info("%s/%s: namespace is terminating; not reconciling", namespace, name)
                return None
            raise
        if status != obj.get("status"):
            kube.patch_status(namespace, name, status)
        STATUS.observe(namespace, name, {**status, "desiredReplicas": obj["spec"].get("replicas", 1)})
        return status


def _reconcile(obj: dict[str, Any], emit: Emit) -> dict[str, Any]:
    previous = obj.get("status") or {}
    generation = obj["metadata"].get("generation")
    try:
        t = target_from(obj)
    except InvalidSpec as err:
        # Loses nothing: running pods stay as they are until the spec is fixed.
        message = str(err)
        if _condition(previous, CONFIG_RENDERED).get("message") != message:
            emit("Warning", "InvalidSpec", message)
        conds = [Cond(CONFIG_RENDERED, False, "InvalidSpec", message),
                 Cond(READY, False, "InvalidSpec", message)]
        return {**previous, "conditions": merge(previous.get("conditions", []), conds, generation, now())}
    p = Pass(t, emit)
    token = _ensure_config_children(p)
    _ensure_head(p)
    if p.head is not None and pods.ip(p.head) and not pods.terminating(p.head):
        p.head_client = HeadClient(pods.ip(p.head), t.spec.engine.http_port, token)
    p.replicas = [r for r in kube.list_pods(t.namespace, f"{L_OMNISTAGE}={t.name},{L_ROLE}={ROLE_REPLICA}")]
    _read_engine_report(p, previous)
    _read_membership(p, previous)
    _retire_stale_replicas(p)
    _scale(p)
    _sync_membership(p)
    return _status(p, previous, generation)


def _condition(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c.get("type") == ctype), {})


def _ensure_config_children(p: Pass) -> str:
    t = p.t
    existing = kube.read("Secret", t.namespace, t.child_name("membership"))
    if existing and TOKEN_KEY in (existing.get("data") or {}):
        token = base64.b64decode(existing["data"][TOKEN_KEY]).decode()
    else:
        made, _ = kube.create(render_secret(t, secrets.token_urlsafe(32)))
        token = base64.b64decode(made["data"][TOKEN_KEY]).decode()
    for child, compare in ((render_configmap(t), ("data",)), (render_api_service(t), ("spec",)),
                           (render_master_service(t), ("spec",)), (render_network_policy(t), ("spec",))):
        result = kube.ensure(child, compare)
        if result != "unchanged":
            p.emit("Normal", "ConfigRendered" if child["kind"] == "ConfigMap" else "ChildSynced",
                   f"{child['kind']} {child['metadata']['name']} {result}")
    return token


def _ensure_head(p: Pass) -> None:
    t = p.t
    want = render_head_pod(t)
    head = kube.read("Pod", t.namespace, want["metadata"]["name"])
    if head is not None and not pods.terminating(head):
        outdated = pods.template_hash(head) != pods.template_hash(want)
        if outdated or pods.terminal(head):
            # Replicas are bound to one head incarnation (they never re-register), so the head
            # rolls first and its replicas follow; rolling them first would restart them twice.
            why = "its pod template changed" if outdated else f"it is {head['status'].get('phase')}"
            p.emit("Normal", "RollingHead", f"replacing head pod {pods.name(head)}: {why}")
            kube.delete_pod(t.namespace, pods.name(head), uid=pods.uid(head))
            p.progressing.append("RollingHead")
            head = kube.read("Pod", t.namespace, want["metadata"]["name"])
    if head is None:
        head, created = kube.create(want)
        if created:
            p.emit("Normal", "CreatedHead", f"created head pod {pods.name(head)}")
            p.progressing.append("CreatingHead")
    p.head = head


def _head_live(p: Pass) -> bool:
    return p.head is not None and not pods.terminating(p.head) and bool(pods.ip(p.head))


def _read_engine_report(p: Pass, previous: dict[str, Any]) -> None:
    """Ask the head what it really runs and hold the cache guarantee against it."""
    why = None
    if p.head_client is None or not pods.ready(p.head):
        why = "head pod is not ready"
    else:
        try:
            p.report = head_client.report(p.head_client)
        except HeadRefused as err:
            why = f"the head refused the report: {err.explain()}"
        except HeadUnreachable as err:
            why = f"head unreachable: {err}"
    p.verdict = engine_truth.check(str(p.t.cache.mode), p.t.distributed, p.report, why)
    if p.verdict.consistent or why == "head pod is not ready":
        if p.verdict.consistent and _condition(previous, CACHE_CONSISTENT).get("status") == "False":
            p.emit("Normal", p.verdict.reason, p.verdict.message)
        return
    if _condition(previous, CACHE_CONSISTENT).get("message") != p.verdict.message:
        p.emit("Warning", p.verdict.reason, p.verdict.message)


def _read_membership(p: Pass, previous: dict[str, Any]) -> None:
    if not p.t.distributed:
        return  # a static single replica: no master, no membership to keep
    if p.head_client is None or not pods.ready(p.head):
        p.membership_problem = "head pod is not ready"
        return
    try:
        p.listing = head_client.listing(p.head_client)
    except (HeadUnreachable, HeadRefused) as err:
        p.membership_problem = f"head unreachable: {err}"
        return
    before = (previous.get("head") or {})
    boot = p.listing.get("bootId")
    if before.get("uid") == pods.uid(p.head) and before.get("bootId") and boot != before.get("bootId"):
        # Same head pod, new engine process: its replicas registered with the old one.
        p.emit("Warning", "HeadRestarted",
               f"head engine restarted (boot id {before.get('bootId')} -> {boot}); rolling every replica")
        for r in [r for r in p.replicas if not pods.terminating(r)]:
            kube.delete_pod(p.t.namespace, pods.name(r), uid=pods.uid(r))
        p.replicas = kube.list_pods(p.t.namespace, f"{L_OMNISTAGE}={p.t.name},{L_ROLE}={ROLE_REPLICA}")
        p.progressing.append("HeadRestarted")


def _desired_replica_pods(t: Target) -> int:
    return t.spec.replicas - 1 if t.distributed else 0


def _live(p: Pass) -> list[dict[str, Any]]:
    return [r for r in p.replicas if not pods.terminating(r)]


def _member_of(p: Pass, pod: dict[str, Any]) -> dict[str, Any] | None:
    if p.listing is None:
        return None
    for m in head_client.members(p.listing):
        if m.get("pod") == pods.name(pod) or (pods.ip(pod) and m.get("host") == pods.ip(pod)):
            return m
    return None


def _retire(p: Pass, pod: dict[str, Any], drain_seconds: int, reason: str, why: str) -> None:
    """Tell the engine first, then delete: the engine stops routing to the replica and drains it,
    so no request is cut off by the pod's deletion."""
    t = p.t
    if pods.annotation(pod, pods.A_LEAVING) is None:
        kube.patch_pod_annotations(t.namespace, pods.name(pod), {pods.A_LEAVING: reason})
    member = _member_of(p, pod)
    if member is not None and p.head_client is not None:
        try:
            ack = head_client.leave(p.head_client, member["replicaId"], drain_seconds)
            drained = ack.get("drained", True)
            p.emit("Normal" if drained else "Warning", "Left" if drained else "DrainTimeout",
                   f"replica {member.get('replicaId')} ({pods.name(pod)}) left the engine"
                   + ("" if drained else f" after the {drain_seconds}s drain timeout with requests in flight"))
        except (HeadUnreachable, HeadRefused) as err:
            # The head cannot route to a replica it cannot reach either; its heartbeat timeout
            # detaches the replica. Deleting now keeps the scale-down moving.
            p.emit("Warning", "LeaveFailed", f"leave for {pods.name(pod)} failed ({err}); deleting anyway")
    kube.delete_pod(t.namespace, pods.name(pod), uid=pods.uid(pod))
    p.emit("Normal", reason, f"deleted replica pod {pods.name(pod)}: {why}")
    p.progressing.append(reason)


def _retire_stale_replicas(p: Pass) -> None:
    """Replicas of another head incarnation or a finished process go at once; replicas whose
    template changed roll one at a time while every other replica is Ready."""
    if not _head_live(p):
        return
    head_uid, t = pods.uid(p.head), p.t
    live = _live(p)
    for r in live:
        if pods.head_uid(r) != head_uid:
            _retire(p, r, 0, "RolledReplica", "it belongs to a previous head")
        elif pods.terminal(r):
            _retire(p, r, 0, "ReplacedReplica", f"its engine exited ({r['status'].get('phase')})")
        elif _member_of(p, r) is not None and pods.annotation(r, pods.A_LEAVING) is None and not pods.ready(r) \
                and p.listing is not None:
            _retire(p, r, 0, "ReplacedReplica", "it turned NotReady")
    live = _live(p)
    outdated = [r for r in live if pods.template_hash(r) != pods.template_hash(
        render_replica_pod(t, pods.index(r), pods.ip(p.head), head_uid))]
    if outdated and all(pods.ready(r) for r in live if r not in outdated):
        _retire(p, outdated[0], t.spec.engine.drain_timeout_seconds, "RollingReplica", "its pod template changed")


def _scale(p: Pass) -> None:
    t = p.t
    live = _live(p)
    desired = _desired_replica_pods(t)
    if len(live) > desired:
        for victim in pods.choose_victims(live, len(live) - desired):
            _retire(p, victim, t.spec.engine.drain_timeout_seconds, "ScaledDown",
                    f"spec.replicas is {t.spec.replicas}")
        return
    if len(live) < desired and _head_live(p):
        for i in pods.free_indices(p.replicas, desired - len(live)):
            pod, created = kube.create(render_replica_pod(t, i, pods.ip(p.head), pods.uid(p.head)))
            if created:
                p.emit("Normal", "ScaledUp", f"created replica pod {pods.name(pod)} (spec.replicas {t.spec.replicas})")
                p.progressing.append("ScalingUp")
    p.replicas = kube.list_pods(t.namespace, f"{L_OMNISTAGE}={t.name},{L_ROLE}={ROLE_REPLICA}")


def _is_head_local(m: dict[str, Any], head_ip: str | None) -> bool:
    return bool(m.get("local")) or (m.get("host") == head_ip and not m.get("pod"))


def _sync_membership(p: Pass) -> None:
    """Join every Ready replica the head has not acknowledged; make the head forget every replica
    whose pod is gone (it would otherwise wait out its 30 s heartbeat timeout)."""
    if p.listing is None:
        return
    live = {pods.name(r): r for r in _live(p)}
    head_ip = pods.ip(p.head)
    for m in head_client.members(p.listing):
        if _is_head_local(m, head_ip) or m.get("state") == contract.LEFT:
            continue
        pod = live.get(m.get("pod")) or next((r for r in live.values() if pods.ip(r) == m.get("host")), None)
        if pod is None:
            try:
                head_client.leave(p.head_client, m["replicaId"], 0)
                p.emit("Normal", "Left", f"replica {m.get('replicaId')} ({m.get('pod') or m.get('host')}) left: "
                                         "its pod is gone")
            except (HeadUnreachable, HeadRefused) as err:
                p.membership_problem = f"leave for departed replica {m.get('replicaId')} failed: {err}"
    for name, pod in live.items():
        member = _member_of(p, pod)
        if not pods.ready(pod) or pods.annotation(pod, pods.A_LEAVING) is not None:
            continue
        if member is not None and member.get("pod") == name:
            continue
        if not p.joins_allowed:
            # The head holds an unjoined replica unroutable (contract.ROUTE_JOINED_ONLY_ENV).
            p.membership_problem = f"{name} is not joined: {CACHE_CONSISTENT} is False ({p.verdict.reason})"
            continue
        try:
            ack = head_client.join(p.head_client, name, pods.ip(pod))
            p.emit("Normal", "Joined", f"replica pod {name} joined the engine as replica {ack.get('replicaId')}")
        except HeadRefused as err:
            # Not registered, not attached, or the newest registration from this IP is a detached
            # predecessor (kwok reuses pod IPs): wait. A replica whose engine really died fails
            # its pod, and the failed pod is replaced above.
            p.membership_problem = f"{name} has not joined yet: {err.explain()}"
        except HeadUnreachable as err:
            p.membership_problem = f"join for {name} failed: {err}"
    try:
        p.listing = head_client.listing(p.head_client)
    except (HeadUnreachable, HeadRefused) as err:
        p.membership_problem = f"head unreachable: {err}"
        p.listing = None


def _status(p: Pass, previous: dict[str, Any], generation: int | None) -> dict[str, Any]:
    t = p.t
    live = _live(p)
    head_live = p.head is not None and not pods.terminating(p.head)
    engine_pods = ([p.head] if head_live else []) + live
    ready_pods = [x for x in engine_pods if pods.ready(x)]
    want = {pods.name(r): pods.template_hash(render_replica_pod(t, pods.index(r), pods.ip(p.head) or "",
                                                                  pods.uid(p.head))) for r in live} if head_live else {}
    updated = (1 if head_live and pods.template_hash(p.head) == pods.template_hash(render_head_pod(t)) else 0) + sum(
        1 for r in live if pods.template_hash(r) == want.get(pods.name(r)) and pods.head_uid(r) == pods.uid(p.head))

    members, joined = [], 0
    for r in sorted(live, key=pods.index):
        m = _member_of(p, r)
        if pods.annotation(r, pods.A_LEAVING):
            state = "Leaving"
        elif m is not None and m.get("pod") == pods.name(r):
            state, joined = "Joined", joined + 1
        elif pods.ready(r):
            state = "Joining"
        else:
            state = "Pending"
        member = {"pod": pods.name(r), "ip": pods.ip(r), "replicaId": m.get("replicaId") if m else None,
                  "state": state}
        if state == "Joining" and not p.joins_allowed:
            member["reason"] = f"{CACHE_CONSISTENT}: {p.verdict.reason if p.verdict else 'unknown'}"
        members.append(member)
    head_ready = head_live and pods.ready(p.head)
    if t.distributed:
        head_registered = p.listing is not None and any(_is_head_local(m, pods.ip(p.head)) for m in
                                                        head_client.members(p.listing))
        others = [m for m in head_client.members(p.listing or {})
                  if not _is_head_local(m, pods.ip(p.head)) and m.get("state") != contract.LEFT]
    else:
        head_registered, others = head_ready, []  # one replica inside the head: nothing to sync
    registered = (1 if head_registered else 0) + joined
    desired = t.spec.replicas
    replica_desired = _desired_replica_pods(t)
    replicas_ready = sum(1 for r in live if pods.ready(r))
    synced = (p.listing is not None or not t.distributed) and p.membership_problem is None \
        and joined == replicas_ready and head_registered and len(others) == joined
    verdict = p.verdict or engine_truth.check(str(t.cache.mode), t.distributed, None, "not asked")
    failures = [f"{pods.name(x)}: {pods.unschedulable(x)}" for x in engine_pods if pods.unschedulable(x)]
    failures += [f"{pods.name(x)}: engine exited ({x['status'].get('phase')})" for x in engine_pods if pods.terminal(x)]

    replicas_available = replicas_ready == replica_desired and len(live) == replica_desired
    conds = [
        Cond(CONFIG_RENDERED, True, "Rendered", f"effective stage-0 cache mode {t.cache.mode}: {t.cache.reason}"),
        Cond(HEAD_READY, head_ready, "HeadReady" if head_ready else ("HeadPending" if head_live else "NoHead"),
             f"head pod {pods.name(p.head)}" if p.head else "no head pod"),
        Cond(REPLICAS_AVAILABLE, replicas_available,
             "AllAvailable" if replicas_ready == replica_desired else "Unavailable",
             f"{replicas_ready}/{replica_desired} replica pods ready"),
        Cond(MEMBERSHIP_SYNCED, synced, "Synced" if synced else "NotSynced",
             p.membership_problem or (f"{registered}/{desired} replicas registered"
                                      if p.listing is not None or not t.distributed else "membership not read yet")),
        Cond(CACHE_CONSISTENT, verdict.consistent, verdict.reason, verdict.message),
        Cond(REPLICA_FAILURE, bool(failures), "Unschedulable" if any("engine exited" not in f for f in failures)
             else ("EngineExited" if failures else "NoFailure"), "; ".join(failures)),
    ]
    progressing = bool(p.progressing) or len(engine_pods) != desired or len(ready_pods) != desired
    conds.append(Cond(PROGRESSING, progressing, ",".join(sorted(set(p.progressing))) or
                      ("Converging" if progressing else "Stable"),
                      f"{len(engine_pods)}/{desired} engine pods, {len(ready_pods)} ready"))
    conds.append(ready(head_ready, replicas_available, synced, True, verdict.consistent))
    conds_out = merge(previous.get("conditions", []), conds, generation, now())

    head_status = None
    if p.head is not None:
        before = previous.get("head") or {}
        boot = (p.report or p.listing or {}).get("bootId") or (
            before.get("bootId") if before.get("uid") == pods.uid(p.head) else None)
        head_status = {k: v for k, v in {"pod": pods.name(p.head), "uid": pods.uid(p.head), "ip": pods.ip(p.head),
                                         "bootId": boot}.items() if v is not None}
    status = {
        "observedGeneration": generation,
        "replicas": len(engine_pods),
        "readyReplicas": len(ready_pods),
        "registeredReplicas": registered,
        "updatedReplicas": updated,
        "selector": selector(t),
        "effectiveCacheMode": str(t.cache.mode),
        "configHash": pods.annotation(render_head_pod(t), "serving.omnistage.io/config-hash"),
        "engineImage": t.engine_image,
        "head": head_status,
        "engine": engine_truth.summary(p.report) or (
            previous.get("engine") if (previous.get("head") or {}).get("uid") == pods.uid(p.head) else None),
        "membershipEpoch": (p.listing or {}).get("epoch", previous.get("membershipEpoch")),
        "members": members,
        "conditions": conds_out,
    }
    return {k: v for k, v in status.items() if v is not None}
