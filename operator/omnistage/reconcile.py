"""The one idempotent reconcile path: observe → plan (pure, plan.py) → act (act.py) → status.

What the API server holds is read from the watch-fed store (informer.STATE), never re-read: a pass
talks to the API server only to write. What a head says is asked every pass, cheaply: the head
answers 304 to the ETag of the listing (boot id + membership epoch) and report this operator holds
(HEADS), so the listing is fetched only when the epoch or boot id moved and the report only when
the boot id did. Besides those copies only the drains in flight (act.DRAINS, re-derived after a
restart from the `leaving` annotation) and the membership tokens (TOKENS) are kept between passes;
all of it is rebuilt after a restart, so an operator restart (or a crash mid-scale) converges.
"""

from __future__ import annotations

import base64
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import act as act_step
from . import head_client, kube, pods, pools
from .act import EmitFn as Emit
from .actions import Action, EnsureChild, Observed
from .actions import Emit as EmitAction
from .head_client import HeadClient, HeadRefused, HeadUnreachable
from .informer import STATE
from .metrics import STATUS
from .names import L_ROLE, ROLE_POOL, ROLE_REPLICA
from .plan import plan
from .render import render_secret, target_from
from .render.common import Target
from .render.pods import TOKEN_KEY, head_pod_name
from .status import pool_status
from .validation import InvalidSpec

log = logging.getLogger(__name__)

__all__ = ["Emit", "observe", "reconcile"]

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()
SYNC_TIMEOUT = 60.0  # s a pass waits for the watches' first listing (operator start, new leader)


class Tokens:
    """Each OmniStage's membership token, read (or created) once. RBAC refuses the operator
    list/watch on Secrets, so the Secret cannot come from a watch; a head that refuses the token
    (401: the Secret was replaced) makes the next pass read it again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[tuple[str, str], tuple[str | None, str]] = {}  # -> (OmniStage uid, token)

    def get(self, t: Target) -> str:
        with self._lock:
            held = self._tokens.get((t.namespace, t.name))
        if held is not None and held[0] == t.uid:
            return held[1]
        token = _ensure_secret(t)
        with self._lock:
            self._tokens[(t.namespace, t.name)] = (t.uid, token)
        return token

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._tokens.pop((namespace, name), None)


TOKENS = Tokens()


# A head that did not answer is dialled again after 5, 10, 20, then every 30 s (or when its pod changes):
# a head restarting in place is back within seconds, a dead one costs one dial per 30 s.
UNREACHABLE_RETRY_SECONDS = (5.0, 10.0, 20.0, 30.0)


@dataclass
class HeadView:
    """The last report and listing one head incarnation gave, with their ETags, and, for a head
    that did not answer, why and when to dial it again."""

    head_uid: str | None
    report: dict[str, Any] | None = None
    report_etag: str | None = None
    listing: dict[str, Any] | None = None
    listing_etag: str | None = None
    token_refused: bool = False  # 401: the Secret was replaced
    head_rv: str | None = None  # the head pod's resourceVersion when it was last dialled
    unreachable: str | None = None  # the HeadUnreachable message of the last dial
    failures: int = 0  # dials in a row without an answer
    answered: bool = False  # this head incarnation answered at least once
    retry_at: float = 0.0


HEADS: dict[tuple[str, str], HeadView] = {}


def _lock(namespace: str, name: str) -> threading.Lock:
    """Defence in depth: the work queue already never runs one OmniStage twice at once."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def forget(namespace: str, name: str) -> None:
    """Drop everything held in memory for a deleted OmniStage."""
    with _locks_guard:
        _locks.pop((namespace, name), None)
    TOKENS.forget(namespace, name)
    HEADS.pop((namespace, name), None)
    RESTING.pop((namespace, name), None)
    act_step.DRAINS.forget(namespace, name)
    STATUS.observe(namespace, name, None)


def reconcile(namespace: str, name: str, emit: Emit | None,
              emitter: Callable[[dict[str, Any]], Emit] | None = None) -> dict[str, Any] | None:
    """One pass; None when the OmniStage is gone (or its namespace is going). Events go to `emit`,
    or to `emitter(the OmniStage as read)` (the queue's workers have no body to hand)."""
    if not STATE.synced(SYNC_TIMEOUT):
        raise RuntimeError(f"the watches have not listed everything after {SYNC_TIMEOUT:.0f}s")
    with _lock(namespace, name):
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
    token = TOKENS.get(t)
    observed, client = observe(obj, t, token)
    key, fingerprint = (t.namespace, t.name), _fingerprint(observed, t)
    rest = RESTING.get(key)
    if rest is not None and rest.fingerprint == fingerprint:
        return obj.get("status") or {}  # nothing read changed since a pass that found it at rest
    decided = plan(t, observed)
    problems = act_step.act(t.namespace, decided.actions, client, emit, t.name)
    changed = _changes(decided.actions) or bool(problems)
    if not changed and not decided.pools and decided.status == obj.get("status"):
        RESTING[key] = Resting(fingerprint, client, t.distributed)
    else:
        RESTING.pop(key, None)
    if changed:
        # Status says what is true after the pass, not before it: read again (only when the pass
        # changed something, so a pass at rest costs no extra request) and let the plan describe it.
        # Its actions are left for the next pass, which the changed pods trigger anyway.
        observed, _ = observe(obj, t, token, problems=tuple(problems))
        decided = plan(t, observed)
    act_step.write_pool_statuses(t.namespace, decided.pools)
    return decided.status


@dataclass(frozen=True)
class Resting:
    """What a pass read when it found its OmniStage at rest (no change, no problem, status as
    written), and how to ask its head again. plan() is pure, so the same reading gives the same
    nothing: a later pass that reads the same skips the plan, and the resync only probes the head."""

    fingerprint: tuple[Any, ...]
    client: HeadClient | None
    distributed: bool


RESTING: dict[tuple[str, str], Resting] = {}


def _rv(obj: dict[str, Any] | None) -> str | None:
    return obj["metadata"].get("resourceVersion") if obj else None


def _fingerprint(o: Observed, t: Target) -> tuple[Any, ...]:
    children = tuple(sorted((c["kind"], c["metadata"]["name"], _rv(c)) for inf in STATE.children.values()
                            for c in inf.owned(t.namespace, t.name)))
    view = HEADS.get((t.namespace, t.name))
    return (_rv(o.obj), _rv(o.head), tuple(sorted(_rv(r) or "" for r in o.replicas)),
            tuple(sorted(_rv(p) or "" for p in o.pools)), children,
            o.head_reachable, tuple(sorted(o.drains.items())), o.problems,
            _head_part(view, o.report, o.listing, o.report_problem, o.listing_problem))


def _head_part(view: HeadView | None, report: Any, listing: Any, report_problem: str | None,
               listing_problem: str | None) -> tuple[Any, ...]:
    """What the head said, as far as a pass depends on it (the last element of a fingerprint)."""
    return (view and view.listing_etag, view and view.report_etag, report is None, listing is None,
            report_problem, listing_problem)


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
    """The pods from the watches, and what a Ready head runs and who its members are (tight timeouts)."""
    head = STATE.pods.get(t.namespace, head_pod_name(t))
    client = None
    if head is not None and pods.ip(head) and not pods.terminating(head):
        client = HeadClient(pods.ip(head), t.spec.engine.http_port, token)
    replicas = tuple(p for p in STATE.pods.owned(t.namespace, t.name)
                     if (p["metadata"].get("labels") or {}).get(L_ROLE) in (ROLE_REPLICA, ROLE_POOL))
    report = listing = None
    report_problem = listing_problem = None
    if client is not None and pods.ready(head):
        view = HEADS.get((t.namespace, t.name))
        if view is None or view.head_uid != pods.uid(head):
            view = HEADS[(t.namespace, t.name)] = HeadView(pods.uid(head))
        if view.head_rv != _rv(head):  # the pod changed (readiness, IP): worth a dial at once
            view.head_rv, view.retry_at = _rv(head), 0.0
        report, listing, report_problem, listing_problem = ask_head(client, view, t.distributed)
        if view.token_refused:
            TOKENS.forget(t.namespace, t.name)  # read the Secret again next pass
    return Observed(obj=obj, head=head, replicas=replicas, head_reachable=client is not None, report=report,
                    report_problem=report_problem, listing=listing, listing_problem=listing_problem,
                    drains=act_step.DRAINS.states(t.namespace, t.name), problems=problems,
                    pools=tuple(STATE.pools.owned(t.namespace, t.name))), client


def _settled(report: dict[str, Any] | None) -> bool:
    """A report that no longer changes within this boot (the engine and its frontend are built)."""
    return report is not None and report.get("distributed") is not None and report.get("frontendCache") is not None


def ask_head(client: HeadClient, view: HeadView, distributed: bool) -> tuple[
        dict[str, Any] | None, dict[str, Any] | None, str | None, str | None]:
    """(report, listing, report_problem, listing_problem). At rest: one conditional GET answered
    304 (the listing's on a distributed head, the report's otherwise); the listing is fetched when
    the epoch or boot id moved, the report when the boot id moved or it was not settled yet. A head
    that did not answer is not dialled again before its backoff (UNREACHABLE_RETRY_SECONDS) unless
    its pod changed: until then a pass says so at once instead of waiting out a timeout, and it is
    then dialled once, without a retry."""
    if view.unreachable is not None and time.monotonic() < view.retry_at:
        return None, None, f"head unreachable: {view.unreachable}", view.unreachable
    # A retry is for a head that has answered before (a blip); a head this operator never heard from
    # (after a start, a new head) or that did not answer last time is dialled once: its backoff
    # retries it in 5 s anyway, and after a restart a hanging head so holds a worker 3 s, not 6.
    attempts = 2 if view.answered and view.unreachable is None else 1
    report_problem = listing_problem = None
    view.token_refused = False
    try:
        if distributed:
            try:
                fresh, view.listing_etag = head_client.listing_if_changed(client, view.listing_etag, attempts)
                view.listing = fresh if fresh is not None else view.listing
            except HeadRefused as err:
                view.listing, view.listing_etag = None, None
                view.token_refused = err.status == 401
                listing_problem = str(err)
            boot = (view.listing or {}).get("bootId")
            if view.listing is not None and _settled(view.report) and view.report.get("bootId") == boot:
                view.unreachable, view.failures, view.answered = None, 0, True
                return view.report, view.listing, None, None
        try:
            fresh, view.report_etag = head_client.report_if_changed(client, view.report_etag, attempts)
            view.report = fresh if fresh is not None else view.report
        except HeadRefused as err:
            view.report, view.report_etag = None, None
            view.token_refused = view.token_refused or err.status == 401
            report_problem = f"the head refused the report: {err.explain()}"
    except HeadUnreachable as err:
        view.report = view.listing = view.report_etag = view.listing_etag = None
        view.failures += 1
        if view.failures == 1:
            log.info("head unreachable: %s; dialled again after %s s", err, "/".join(
                f"{s:.0f}" for s in UNREACHABLE_RETRY_SECONDS))
        backoff = UNREACHABLE_RETRY_SECONDS[min(view.failures, len(UNREACHABLE_RETRY_SECONDS)) - 1]
        view.unreachable, view.retry_at = str(err), time.monotonic() + backoff
        return None, None, f"head unreachable: {err}", str(err)
    view.unreachable, view.failures, view.answered = None, 0, True
    return view.report, (view.listing if distributed and listing_problem is None else None), \
        report_problem, listing_problem


def probe(namespace: str, name: str) -> bool:
    """For the resync: True when the OmniStage needs a full pass. One the last pass found at rest
    only has its head asked (one conditional GET, 304 at rest), off the reconcile workers: its pods,
    children and spec changes arrive as watch events, which queue a pass themselves."""
    key = (namespace, name)
    rest, view = RESTING.get(key), HEADS.get(key)
    if rest is None:
        return True
    if rest.client is None or view is None:
        return False  # no head to ask; its pod's events will queue a pass
    lock = _lock(namespace, name)
    if not lock.acquire(blocking=False):
        return False  # a pass is running: it asks the head itself
    try:
        answers = ask_head(rest.client, view, rest.distributed)
        return _head_part(view, *answers) != rest.fingerprint[-1]
    finally:
        lock.release()
