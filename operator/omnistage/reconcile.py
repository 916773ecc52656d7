"""The one idempotent reconcile path: observe → plan (pure, plan.py) → act (act.py) → status.

Nothing is remembered between calls but the drains in flight (act.DRAINS, re-derived after a
restart from the `leaving` annotation): every decision is taken from what the API server and the
engine head say now, so an operator restart (or a crash in the middle of a scale) converges.
"""

from __future__ import annotations

import base64
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import act as act_step
from . import head_client, kube, pods
from .act import EmitFn as Emit
from .head_client import HeadClient, HeadRefused, HeadUnreachable
from .metrics import STATUS
from .plan import Action, EnsureChild, Observed, plan
from .plan import Emit as EmitAction
from .render import render_head_pod, render_secret, target_from
from .render.common import L_OMNISTAGE, L_ROLE, ROLE_REPLICA, Target
from .render.pods import TOKEN_KEY
from .validation import InvalidSpec

log = logging.getLogger(__name__)

__all__ = ["Emit", "observe", "reconcile"]

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(namespace: str, name: str) -> threading.Lock:
    """Defence in depth: the work queue already never runs one OmniStage twice at once."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def forget(namespace: str, name: str) -> None:
    """Drop everything held in memory for a deleted OmniStage."""
    with _locks_guard:
        _locks.pop((namespace, name), None)
    act_step.DRAINS.forget(namespace, name)
    STATUS.observe(namespace, name, None)


def reconcile(namespace: str, name: str, emit: Emit | None,
              emitter: Callable[[dict[str, Any]], Emit] | None = None) -> dict[str, Any] | None:
    """One pass; None when the OmniStage is gone (or its namespace is going). Events go to `emit`,
    or to `emitter(the OmniStage as read)` (the queue's workers have no body to hand)."""
    with _lock(namespace, name):
        obj = kube.get_omnistage(namespace, name)
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            act_step.DRAINS.forget(namespace, name)
            STATUS.observe(namespace, name, None)
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
            kube.patch_status(namespace, name, status, obj.get("status"))
        STATUS.observe(namespace, name, {**status, "desiredReplicas": obj["spec"].get("replicas", 1)})
        return status


def _reconcile(obj: dict[str, Any], emit: Emit) -> dict[str, Any]:
    try:
        t: Target | InvalidSpec = target_from(obj)
    except InvalidSpec as err:
        t = err
    if isinstance(t, InvalidSpec):
        actions, status = plan(t, Observed(obj))
        act_step.act(obj["metadata"]["namespace"], actions, None, emit, obj["metadata"]["name"])
        return status
    token = _ensure_secret(t)
    observed, client = observe(obj, t, token)
    actions, status = plan(t, observed)
    problems = act_step.act(t.namespace, actions, client, emit, t.name)
    if _changes(actions) or problems:
        # Status says what is true after the pass, not before it: read again (only when the pass
        # changed something, so a pass at rest costs no extra request) and let the plan describe it.
        # Its actions are left for the next pass, which the changed pods trigger anyway.
        observed, _ = observe(obj, t, token, problems=tuple(problems))
        _, status = plan(t, observed)
    return status


def _changes(actions: list[Action]) -> bool:
    return any(not isinstance(a, EmitAction | EnsureChild) for a in actions)


def _ensure_secret(t: Target) -> str:
    """The membership token: read, or created once (the head client needs it to observe)."""
    existing = kube.read("Secret", t.namespace, t.child_name("membership"))
    if existing and TOKEN_KEY in (existing.get("data") or {}):
        return base64.b64decode(existing["data"][TOKEN_KEY]).decode()
    made, _ = kube.create(render_secret(t, secrets.token_urlsafe(32)))
    return base64.b64decode(made["data"][TOKEN_KEY]).decode()


def observe(obj: dict[str, Any], t: Target, token: str,
            problems: tuple[str, ...] = ()) -> tuple[Observed, HeadClient | None]:
    """Read the pods, and ask a Ready head what it runs and who its members are (tight timeouts)."""
    head = kube.read("Pod", t.namespace, render_head_pod(t)["metadata"]["name"])
    client = None
    if head is not None and pods.ip(head) and not pods.terminating(head):
        client = HeadClient(pods.ip(head), t.spec.engine.http_port, token)
    replicas = tuple(kube.list_pods(t.namespace, f"{L_OMNISTAGE}={t.name},{L_ROLE}={ROLE_REPLICA}"))
    report = listing = None
    report_problem = listing_problem = None
    if client is not None and pods.ready(head):
        try:
            report = head_client.report(client)
        except HeadRefused as err:
            report_problem = f"the head refused the report: {err.explain()}"
        except HeadUnreachable as err:
            report_problem = f"head unreachable: {err}"
            listing_problem = str(err)  # not asked twice: one dead head costs one timeout per pass
        if t.distributed and listing_problem is None:
            try:
                listing = head_client.listing(client)
            except (HeadUnreachable, HeadRefused) as err:
                listing_problem = str(err)
    return Observed(obj=obj, head=head, replicas=replicas, head_reachable=client is not None, report=report,
                    report_problem=report_problem, listing=listing, listing_problem=listing_problem,
                    drains=act_step.DRAINS.states(t.namespace, t.name), problems=problems), client
