"""The one idempotent reconcile pass, a straight line as KubeRay's RayCluster reads: ensure the
token, observe, decide once (pure: control/plan.py), act (act.py), describe (the status: the
decision's, told what act could not do; what only a new read can show is the next pass's).

What the API server holds is read from the watch-fed store (informer.STATE), never re-read: a pass
talks to the API server only to write, and to read the membership Secret (which no watch may see)
when it holds no token, an engine pod is about to mount it, or the resync's full pass checks that it
is still there (ensure_token: once a minute per OmniStage). What a head says is
asked every pass, cheaply (headview.py: one conditional GET, 304 at rest). What the pass remembers
between passes is memory.py's.
"""

from __future__ import annotations

import base64
import logging
import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kubernetes.client.exceptions import ApiException

from .. import api
from ..api.child_names import may_collide
from ..api.conditions import EventReason, Reason, timestamp
from ..api.validation import InvalidSpec
from ..control import collisions, identity, pods, pools
from ..control.actions import Action, EnsureChild, Observed, PostEvent
from ..control.plan import Plan, decision, plan, plan_with_report
from ..control.pool_status import pool_status
from ..control.status import failed_status
from ..names import HEAD_ROLES, REPLICA_ROLES, ROLE_POOL, ROLE_SPARE_HEAD
from ..render import render_secret, target_from
from ..render.common import Target
from ..render.pods import TOKEN_KEY
from . import act as act_step
from . import credentials, headview, kube, memory
from . import drains as drains_step
from .act import EmitFn as Emit
from .head_client import HeadClient
from .headview import ask_head, said, view_for
from .informer import STATE
from .metrics import STATUS

log = logging.getLogger(__name__)

__all__ = ["Emit", "observe", "reconcile"]

SYNC_TIMEOUT = 60.0  # s a pass waits for the watches' first listing (operator start, new leader)
INVALID = "invalid spec"  # the fingerprint of an invalid spec at rest: no valid reading equals it


def reconcile(namespace: str, name: str, emit: Emit | None,
              emitter: Callable[[dict[str, Any]], Emit] | None = None) -> dict[str, Any] | None:
    """One pass; None when the OmniStage is gone (or its namespace is going). Events go to `emit`,
    or to `emitter(the OmniStage as read)` (the queue's workers have no body to hand)."""
    if not STATE.synced(SYNC_TIMEOUT):
        raise RuntimeError(f"the watches have not listed everything after {SYNC_TIMEOUT:.0f}s")
    with memory.lock(namespace, name):
        # A miss is read once: the OmniStage may be newer than its watch event (kopf saw it first).
        obj = STATE.omnistages.get(namespace, name) or kube.get_omnistage(namespace, name)
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            drains_step.DRAINS.forget(namespace, name)
            STATUS.observe(namespace, name, None)
            _orphaned_pools(namespace, name)
            return None  # children go with it through their ownerReferences
        emit = emit or emitter(obj)
        try:
            status = _reconcile(obj, emit)
        except ApiException as err:
            if act_step.namespace_going(err):
                # The namespace is going away with everything in it: nothing to converge to.
                log.info("%s/%s: namespace is terminating; not reconciling", namespace, name)
                return None
            _failed(obj, emit, f"the API server answered {err.status}: {kube.reason_of(err)}")
            raise
        except Exception as err:
            _failed(obj, emit, f"{type(err).__name__}: {err}")
            raise
        if status != obj.get("status"):
            STATE.wrote(kube.patch_status(namespace, name, status, obj.get("status")))
        STATUS.observe(namespace, name, {**status, "desiredReplicas": obj["spec"].get("replicas", 1)})
        return status


def _failed(obj: dict[str, Any], emit: Emit, why: str) -> None:
    """A pass that raised still says why: ReplicaFailure=True reason PassFailed and a Warning Event
    (repeats aggregated); the queue logs the traceback and the resync tries again. Never raises: the
    API server may be what failed."""
    meta = obj["metadata"]
    why = act_step.bounded(why)
    emit("Warning", Reason.PASS_FAILED, f"the operator's pass failed: {why}")
    status = failed_status(obj.get("status") or {}, meta.get("generation"), why, timestamp())
    if status == obj.get("status"):
        return
    try:
        STATE.wrote(kube.patch_status(meta["namespace"], meta["name"], status, obj.get("status")))
    except Exception as err:  # noqa: BLE001 -- said in the log; the pass's own error is raised on
        log.warning("%s/%s: the PassFailed condition was not written: %s", meta["namespace"], meta["name"],
                    getattr(err, "status", None) or type(err).__name__)


def _orphaned_pools(namespace: str, name: str) -> None:
    """Pools naming an OmniStage that does not exist say so (their pods, owned by the OmniStage, went
    with it)."""
    fitted = pools.fit(None, name, STATE.pools.owned(namespace, name))
    act_step.write_pool_statuses(
        namespace,
        {f.name: s for f in fitted if (s := pool_status(f, None, [])) != (f.obj.get("status") or {})},
    )


def _reconcile(obj: dict[str, Any], emit: Emit) -> dict[str, Any]:
    """token -> observe -> decide -> act -> describe, each once."""
    try:
        t: Target | InvalidSpec = target_from(obj)
    except InvalidSpec as err:
        t = err
    meta = obj["metadata"]
    neighbours = _neighbours(obj)
    if isinstance(t, InvalidSpec) or collisions.refusal(obj, neighbours) is not None:
        # Before the token: an OmniStage whose names an older object needs writes nothing, not even
        # its membership Secret (which could be that object's replica's credential). An invalid spec
        # keeps the children its last valid spec rendered (last_valid).
        pools_named = tuple(STATE.pools.owned(meta["namespace"], meta["name"]))
        observed = Observed(obj, pools=pools_named, neighbours=neighbours,
                            last_valid=_last_valid(obj) if isinstance(t, InvalidSpec) else None)
        decided = plan(t, observed)
        acted = act_step.act(meta["namespace"], decided.actions, None, emit, meta["name"])
        # An invalid spec at rest waits for its edit (a new generation) or a child's drift, both watched:
        # without a rest of its own the resync gave it a full pass every second, for as long as it
        # stayed invalid. A refused name is not rested: the object that holds it may go, unwatched.
        if isinstance(t, InvalidSpec) and _rests(obj, observed, decided, tuple(acted.problems),
                                                  tuple(acted.refused)):
            memory.RESTING[(meta["namespace"], meta["name"])] = memory.Resting((INVALID,), None, False)
        else:
            memory.RESTING.pop((meta["namespace"], meta["name"]), None)
        return decided.status
    memory.LAST_VALID[(t.namespace, t.name)] = obj
    # token
    token, secret_refused = ensure_token(t, emit)
    # observe
    observed, (client, beside_client) = observe(obj, t, token, secret_refused)
    key, fingerprint = (t.namespace, t.name), _fingerprint(observed, t)
    rest = memory.RESTING.get(key)
    if rest is not None and rest.fingerprint == fingerprint:
        return obj.get("status") or {}  # nothing read changed since a pass that found it at rest
    # The credentials of replica and pool pods that are mounting their volumes, and the membership
    # Secret they mount too (re-created if it was deleted); a pod the decision creates has both made
    # sure of by act, just before it (membership below).
    mounting: list[str] = []
    if secret_refused is None and _mounting(observed):
        token, secret_refused = ensure_token(t, emit, read=True)
        if secret_refused is not None:
            observed = replace(observed, secret_refused=secret_refused)
        else:
            mounting = credentials.ensure_mounting(_engine_pods(observed), token, emit)
    # decide
    d = decision(t, observed)
    # act
    acted = act_step.act(t.namespace, d.plan.actions, client, emit, t.name, beside=beside_client, token=token,
                         membership=lambda: _membership(t, emit))
    problems, refused = tuple(mounting + acted.problems), tuple(acted.refused)
    if _rests(obj, observed, d.plan, problems, refused):
        memory.RESTING[key] = memory.Resting(fingerprint, client, t.distributed)
    else:
        memory.RESTING.pop(key, None)
    # describe: the decision, told what act could not do. What only a new read can show (a created
    # pod's uid, the replica id a join got) is the next pass's, which the changed pods start anyway.
    result = plan_with_report(d, problems, refused)
    act_step.write_pool_statuses(t.namespace, result.pools)
    return result.status


def _membership(t: Target, emit: Emit) -> tuple[str | None, str | None]:
    """act's check of the membership Secret before the first pod it creates (ensure_token, read=True).
    A refused one is read again by the next pass, whose decision then creates and deletes nothing."""
    token, why = ensure_token(t, emit, read=True)
    if why is not None:
        memory.TOKENS.recheck(t.namespace, t.name)
    return token, why


def _last_valid(obj: dict[str, Any]) -> Target | None:
    """The target of this OmniStage's last valid spec (memory.LAST_VALID), the same uid's, if any."""
    meta = obj["metadata"]
    last = memory.LAST_VALID.get((meta["namespace"], meta["name"]))
    if last is None or last["metadata"].get("uid") != meta.get("uid"):
        return None
    try:
        return target_from(last)
    except InvalidSpec:  # the operator's configuration is its process's: valid then, valid now
        return None


def _rests(obj: dict[str, Any], observed: Observed, decided: Plan, problems: tuple[str, ...],
           refused: tuple[str, ...]) -> bool:
    """The pass found the OmniStage at rest: it changed nothing, and act had nothing to say. A head
    change never rests: the resync probes only the serving head, the one the Services select, and the
    news of the head beside it (a replica registered there) must reach a pass too. Nor does a refused
    Secret: the resync's next pass reads it again (whoever deletes it causes no event the operator
    can watch)."""
    return (not _changes(decided.actions) and not problems and not refused and not decided.pools
            and decided.status == obj.get("status") and observed.beside is None
            and observed.secret_refused is None)


def ensure_token(t: Target, emit: Emit, read: bool = False) -> tuple[str | None, str | None]:
    """(the membership token the head client needs, None), or (what is held or None, why the Secret
    is refused). Held, else read from the Secret, which is created when missing (the one write a
    pass makes before it plans). `read`: an engine pod is about to mount it (_mounting, or act
    about to create one), so it is read even when the token is held, and re-created from the held
    token when it was deleted (a pod would wait in FailedMount); so is it on each full resync (memory.TOKENS.
    recheck): no event says it was deleted, and an operator restarted without it would make a new
    token, which the running head refuses. A Secret of that name is adopted only when its
    ownerReferences name this OmniStage's uid: someone else's would give the engines a token the
    operator did not issue."""
    held = memory.TOKENS.held(t.namespace, t.name, t.uid)
    if held is not None and not read and not memory.TOKENS.due(t.namespace, t.name):
        return held, None
    name = t.child_name("membership")
    secret = kube.read("Secret", t.namespace, name)
    if secret is None:
        secret, created = kube.create(render_secret(t, held or secrets.token_urlsafe(32)))
        if created and held is not None:
            emit(
                "Normal",
                EventReason.CHILD_SYNCED,
                f"Secret {name} re-created from the membership token the "
                "operator holds: it had been deleted, and engine pods mount it",
            )
    why = _not_ours(secret, t)
    if why is not None:
        log.warning("%s/%s: %s", t.namespace, t.name, why)
        return held, why
    token = base64.b64decode(secret["data"][TOKEN_KEY]).decode()
    memory.TOKENS.keep(t.namespace, t.name, t.uid, token)
    return token, None


def _not_ours(secret: dict[str, Any], t: Target) -> str | None:
    """Why a Secret of the membership token's name is not this OmniStage's to use, else None."""
    meta = secret["metadata"]
    refs = meta.get("ownerReferences") or []
    if not any(ref.get("uid") == t.uid for ref in refs):
        owners = ", ".join(f"{ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})" for ref in refs)
        earlier = any(ref.get("kind") == api.KIND and ref.get("name") == t.name for ref in refs)
        return (
            f"Secret {meta['name']} is not this OmniStage's: its ownerReferences name "
            f"{owners or 'no owner'}, not uid {t.uid}"
            + (
                "; it is an earlier OmniStage's of this name, which the garbage collector removes"
                if earlier
                else ""
            )
            + ". The operator does not adopt a membership token it did not issue, and creates or deletes no "
            f"engine pod until it is gone: delete Secret {meta['name']} (or, if something else needs it, "
            "re-create it under another name) and the operator creates its own"
        )
    if TOKEN_KEY not in (secret.get("data") or {}):
        return (
            f"Secret {meta['name']} has no key {TOKEN_KEY!r}: delete it and the operator creates it again "
            "(it may not update Secrets)"
        )
    return None


def observe(obj: dict[str, Any], t: Target, token: str | None, secret_refused: str | None = None
            ) -> tuple[Observed, tuple[HeadClient | None, HeadClient | None]]:
    """The pods from the watches, and what a Ready head runs and who its members are (tight timeouts).
    During a head change, the set beside the serving one too (Observed.beside: the successor head or
    the predecessor, and its replicas), with its client.
    No token (ensure_token refused the Secret and holds none): no head is asked."""
    # Its pods are those whose controller ownerReference names its uid, whatever their labels say;
    # their labels as the operator wrote them, and the strays to restore or delete (control/identity.py).
    owned, strays = identity.sort_out(
        t,
        [p for p in STATE.pods.owned(t.namespace, t.name) if identity.owner_uid(p) == t.uid],
        {pool["metadata"]["name"] for pool in STATE.pools.owned(t.namespace, t.name)},
    )
    head, beside_head = pods.heads([p for p in owned if pods.role(p) in HEAD_ROLES])
    spares = pods.spares([p for p in owned if pods.role(p) == ROLE_SPARE_HEAD])
    engines = tuple(p for p in owned if pods.role(p) in (*REPLICA_ROLES, ROLE_POOL))  # standbys too
    beside_replicas = tuple(r for r in engines
                            if beside_head is not None and pods.head_uid(r) == pods.uid(beside_head))
    drains = drains_step.DRAINS.states(t.namespace, t.name)
    beside = beside_client = None
    if beside_head is not None:
        beside, beside_client = _observe_set(
            obj, t, token, beside_head, beside_replicas, headview.beside_serving(t.namespace, t.name), drains
        )
    serving_replicas = tuple(r for r in engines if r not in beside_replicas)
    observed, client = _observe_set(obj, t, token, head, serving_replicas, (t.namespace, t.name), drains)
    return replace(observed, pools=tuple(STATE.pools.owned(t.namespace, t.name)), beside=beside,
                   spares=spares, secret_refused=secret_refused, strays=strays,
                   neighbours=_neighbours(obj)), \
        (client, beside_client)


def _neighbours(obj: dict[str, Any]) -> tuple[collisions.Named, ...]:
    """The namespace's other OmniStages, and its OmniStagePools, whose names may give a child of this
    OmniStage's or of one of its pools' (api/child_names.may_collide: one name begins the other), from
    the watches. Those alone: the list is part of the resting fingerprint."""
    meta = obj["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    own = [name, *(p["metadata"]["name"] for p in STATE.pools.owned(namespace, name))]
    found = [collisions.named(o) for o in STATE.omnistages.all()
             if o["metadata"].get("namespace") == namespace and o["metadata"]["name"] != name]
    found += [collisions.named(p, api.POOL_KIND) for p in STATE.pools.all()
              if p["metadata"].get("namespace") == namespace]
    return tuple(sorted(n for n in found if any(may_collide(n.name, mine) for mine in own)))


def _observe_set(obj: dict[str, Any], t: Target, token: str | None, head: dict[str, Any] | None,
                 replicas: tuple[dict[str, Any], ...], key: memory.Key, drains: dict[str, str]
                 ) -> tuple[Observed, HeadClient | None]:
    """One head and its replicas: the head's client, its report and listing."""
    client = None
    if head is not None and pods.ip(head) and not pods.terminating(head) and token is not None:
        client = HeadClient(pods.ip(head), t.spec.engine.membership_port, token)
    report = listing = None
    report_problem = listing_problem = refused = None
    if client is not None and pods.answers(
        head
    ):  # Ready, or started: read a head whose engines are silent too
        view = view_for(key, pods.uid(head), _rv(head))
        report, listing, report_problem, listing_problem = ask_head(client, view, t.distributed)
        refused = view.refused
        if view.token_refused:  # 401: the Secret was replaced; read it again next pass
            memory.TOKENS.forget(t.namespace, t.name)
    return Observed(obj=obj, head=head, replicas=replicas, head_addressable=client is not None, report=report,
                    report_problem=report_problem, listing=listing, listing_problem=listing_problem,
                    answer_refused=refused, drains=drains), client


def _engine_pods(o: Observed) -> list[dict[str, Any]]:
    """The replica and pool pods of the serving set and of the one beside it."""
    return [*o.replicas, *(o.beside.replicas if o.beside is not None else ())]


def _mounting(o: Observed) -> bool:
    """An engine pod is scheduled and still mounting its volumes, the membership Secret among them.
    Only then, and before act creates a pod (act.SecretCheck), does a pass read the Secret (RBAC gives
    the operator no watch on Secrets, and a read every pass would cost a request at rest): a deleted
    Secret is re-created before a pod needs it, and running pods keep the copy their kubelet mounted."""
    beside = (o.beside.head, *o.beside.replicas) if o.beside is not None else ()
    seen = [o.head, *o.spares, *o.replicas, *beside]
    return any(pod is not None and pods.mounting(pod) for pod in seen)


def _rv(obj: dict[str, Any] | None) -> str | None:
    return obj["metadata"].get("resourceVersion") if obj else None


def _fingerprint(o: Observed, t: Target) -> tuple[Any, ...]:
    children = tuple(sorted((c["kind"], c["metadata"]["name"], _rv(c)) for inf in STATE.children.values()
                            for c in inf.owned(t.namespace, t.name)))
    view = headview.HEADS.get((t.namespace, t.name))
    return (_rv(o.obj), _rv(o.head), tuple(sorted(_rv(r) or "" for r in (*o.replicas, *o.spares))),
            tuple(sorted(_rv(p) or "" for p in o.pools)), children,
            o.head_addressable, tuple(sorted(o.drains.items())), o.problems, o.neighbours,
            said(view, o.report, o.listing, o.report_problem, o.listing_problem))


def _changes(actions: list[Action]) -> bool:
    return any(not isinstance(a, PostEvent | EnsureChild) for a in actions)
