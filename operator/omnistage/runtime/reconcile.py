"""The one idempotent reconcile pass: ensure the token, observe, plan (pure: plan.py), act
(act.py), then status.

What the API server holds is read from the watch-fed store (informer.STATE), never re-read: a pass
talks to the API server only to write. What a head says is asked every pass, cheaply (headview.py:
one conditional GET, 304 at rest). What the pass remembers between passes is memory.py's.
"""

from __future__ import annotations

import base64
import logging
import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kubernetes.client.exceptions import ApiException

from ..api.validation import InvalidSpec
from ..control import pods, pools
from ..control.actions import Action, EnsureChild, Observed, PostEvent
from ..control.plan import plan
from ..control.status import pool_status
from ..names import HEAD_ROLES, ROLE_POOL, ROLE_REPLICA
from ..render import render_secret, target_from
from ..render.common import Target
from ..render.pods import TOKEN_KEY
from . import act as act_step
from . import kube, memory
from .act import EmitFn as Emit
from .head_client import HeadClient
from .headview import ask_head, said, view_for
from .informer import STATE
from .metrics import STATUS

log = logging.getLogger(__name__)

__all__ = ["Emit", "observe", "reconcile"]

SYNC_TIMEOUT = 60.0  # s a pass waits for the watches' first listing (operator start, new leader)


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
            act_step.DRAINS.forget(namespace, name)
            STATUS.observe(namespace, name, None)
            _orphaned_pools(namespace, name)
            return None  # children go with it through their ownerReferences
        emit = emit or emitter(obj)
        try:
            status = _reconcile(obj, emit)
        except ApiException as err:
            if err.status == 403 and "being terminated" in (err.body or ""):
                # The namespace is going away with everything in it: nothing to converge to.
                log.info("%s/%s: namespace is terminating; not reconciling", namespace, name)
                return None
            raise
        if status != obj.get("status"):
            STATE.wrote(kube.patch_status(namespace, name, status, obj.get("status")))
        STATUS.observe(namespace, name, {**status, "desiredReplicas": obj["spec"].get("replicas", 1)})
        return status


def _orphaned_pools(namespace: str, name: str) -> None:
    """Pools naming an OmniStage that does not exist say so (their pods, owned by the OmniStage, went
    with it)."""
    fitted = pools.fit(None, name, STATE.pools.owned(namespace, name))
    act_step.write_pool_statuses(namespace, {f.name: s for f in fitted
                                             if (s := pool_status(f, None, [])) != (f.obj.get("status") or {})})


def _reconcile(obj: dict[str, Any], emit: Emit) -> dict[str, Any]:
    try:
        t: Target | InvalidSpec = target_from(obj)
    except InvalidSpec as err:
        t = err
    if isinstance(t, InvalidSpec):
        decided = plan(t, Observed(obj))
        act_step.act(obj["metadata"]["namespace"], decided.actions, None, emit, obj["metadata"]["name"])
        return decided.status
    token = ensure_token(t)
    observed, (client, other_client) = observe(obj, t, token)
    key, fingerprint = (t.namespace, t.name), _fingerprint(observed, t)
    rest = memory.RESTING.get(key)
    if rest is not None and rest.fingerprint == fingerprint:
        return obj.get("status") or {}  # nothing read changed since a pass that found it at rest
    decided = plan(t, observed)
    problems = act_step.act(t.namespace, decided.actions, client, emit, t.name, other=other_client)
    changed = _changes(decided.actions) or bool(problems)
    # A head change never rests: the resync probes only the head the Services select, and the other
    # head's news (a replica registered there) must reach a pass too.
    if not changed and not decided.pools and decided.status == obj.get("status") and observed.other is None:
        memory.RESTING[key] = memory.Resting(fingerprint, client, t.distributed)
    else:
        memory.RESTING.pop(key, None)
    if changed:
        # Status says what is true after the pass, not before it: read again (only when the pass
        # changed something, so a pass at rest costs no extra request) and let the plan describe it.
        # Its actions are left for the next pass, which the changed pods trigger anyway.
        observed, _ = observe(obj, t, token, problems=tuple(problems))
        decided = plan(t, observed)
    act_step.write_pool_statuses(t.namespace, decided.pools)
    return decided.status


def ensure_token(t: Target) -> str:
    """The membership token the head client needs: held, else read from the Secret, else the Secret
    is created (the one write a pass makes before it plans)."""
    held = memory.TOKENS.held(t.namespace, t.name, t.uid)
    if held is not None:
        return held
    existing = kube.read("Secret", t.namespace, t.child_name("membership"))
    if existing and TOKEN_KEY in (existing.get("data") or {}):
        token = base64.b64decode(existing["data"][TOKEN_KEY]).decode()
    else:
        made, _ = kube.create(render_secret(t, secrets.token_urlsafe(32)))
        token = base64.b64decode(made["data"][TOKEN_KEY]).decode()
    memory.TOKENS.keep(t.namespace, t.name, t.uid, token)
    return token


def observe(obj: dict[str, Any], t: Target, token: str, problems: tuple[str, ...] = ()
            ) -> tuple[Observed, tuple[HeadClient | None, HeadClient | None]]:
    """The pods from the watches, and what a Ready head runs and who its members are (tight timeouts).
    During a head change, the second head and its replicas too (Observed.other), with its client."""
    owned = STATE.pods.owned(t.namespace, t.name)
    head, second = pods.heads([p for p in owned if pods.role(p) in HEAD_ROLES])
    engines = tuple(p for p in owned if pods.role(p) in (ROLE_REPLICA, ROLE_POOL))
    theirs = tuple(r for r in engines if second is not None and pods.head_uid(r) == pods.uid(second))
    drains = act_step.DRAINS.states(t.namespace, t.name)
    other = other_client = None
    if second is not None:
        other, other_client = _observe_set(obj, t, token, second, theirs, memory.second_head(t.namespace, t.name),
                                           drains)
    observed, client = _observe_set(obj, t, token, head, tuple(r for r in engines if r not in theirs),
                                    (t.namespace, t.name), drains)
    return replace(observed, problems=problems, pools=tuple(STATE.pools.owned(t.namespace, t.name)),
                   other=other), (client, other_client)


def _observe_set(obj: dict[str, Any], t: Target, token: str, head: dict[str, Any] | None,
                 replicas: tuple[dict[str, Any], ...], key: memory.Key, drains: dict[str, str]
                 ) -> tuple[Observed, HeadClient | None]:
    """One head and its replicas: the head's client, its report and listing."""
    client = None
    if head is not None and pods.ip(head) and not pods.terminating(head):
        client = HeadClient(pods.ip(head), t.spec.engine.http_port, token)
    report = listing = None
    report_problem = listing_problem = None
    if client is not None and pods.ready(head):
        view = view_for(key, pods.uid(head), _rv(head))
        report, listing, report_problem, listing_problem = ask_head(client, view, t.distributed)
        if view.token_refused:  # 401: the Secret was replaced; read it again next pass
            memory.TOKENS.forget(t.namespace, t.name)
    return Observed(obj=obj, head=head, replicas=replicas, head_addressable=client is not None, report=report,
                    report_problem=report_problem, listing=listing, listing_problem=listing_problem,
                    drains=drains), client


def _rv(obj: dict[str, Any] | None) -> str | None:
    return obj["metadata"].get("resourceVersion") if obj else None


def _fingerprint(o: Observed, t: Target) -> tuple[Any, ...]:
    children = tuple(sorted((c["kind"], c["metadata"]["name"], _rv(c)) for inf in STATE.children.values()
                            for c in inf.owned(t.namespace, t.name)))
    view = memory.HEADS.get((t.namespace, t.name))
    return (_rv(o.obj), _rv(o.head), tuple(sorted(_rv(r) or "" for r in o.replicas)),
            tuple(sorted(_rv(p) or "" for p in o.pools)), children,
            o.head_addressable, tuple(sorted(o.drains.items())), o.problems,
            said(view, o.report, o.listing, o.report_problem, o.listing_problem))


def _changes(actions: list[Action]) -> bool:
    return any(not isinstance(a, PostEvent | EnsureChild) for a in actions)
