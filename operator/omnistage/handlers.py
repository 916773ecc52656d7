"""kopf registrations, kept thin: every trigger runs the same reconcile()."""

from __future__ import annotations

import contextvars
import fnmatch
import logging
import threading
import time

import kopf

from . import api, kube, leader
from .metrics import RECONCILE_ERRORS, RECONCILE_SECONDS, STATUS
from .reconcile import reconcile
from .render.common import L_COMPONENT, L_OMNISTAGE

log = logging.getLogger(__name__)
RESYNC_SECONDS = 5.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    prefix = api.GROUP
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=prefix)
    settings.watching.server_timeout = 60
    settings.posting.level = logging.INFO
    # Several OmniStages reconcile in parallel; each one is serialised by reconcile()'s lock.
    settings.execution.max_workers = 8


def _emitter(body):
    ref = {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
           "metadata": {"name": body["metadata"]["name"], "namespace": body["metadata"]["namespace"],
                        "uid": body["metadata"]["uid"]}}
    return lambda etype, reason, message: kopf.event(ref, type=etype, reason=reason, message=message)


def _run(namespace: str, name: str, body) -> None:
    if not leader.is_leading():  # a follower replica does nothing (leader.py)
        return
    start = time.monotonic()
    try:
        reconcile(namespace, name, _emitter(body))
    except Exception as err:
        RECONCILE_ERRORS.labels(namespace, name, type(err).__name__).inc()
        raise
    finally:
        RECONCILE_SECONDS.labels(namespace, name).observe(time.monotonic() - start)


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL)
def on_change(namespace: str, name: str, body, **_) -> None:
    _run(namespace, name, body)


@kopf.on.startup()
def start_resync(**_) -> None:
    """Level-based safety net: every few seconds reconcile every OmniStage, catching whatever no
    event announced (a head engine restarted in place, a lost watch). A plain thread, not a kopf
    timer: kopf timers put a finalizer on each OmniStage, which then blocks namespace deletion
    whenever the operator is down or the namespace refuses the children."""
    ctx = contextvars.copy_context()  # kopf's event posting lives in context variables
    threading.Thread(target=ctx.run, args=(_resync_forever,), name="omnistage-resync", daemon=True).start()


def _resync_forever() -> None:
    while True:
        time.sleep(RESYNC_SECONDS)
        if not leader.is_leading():  # a follower does not even list (leader.py)
            continue
        try:
            literal = WATCHED_NAMESPACES and not any(set("*?[") & set(p) for p in WATCHED_NAMESPACES)
            # Namespaced mode may not list cluster-wide (RBAC); globs need the cluster-wide list.
            items = [o for ns in WATCHED_NAMESPACES for o in kube.list_omnistages(ns)] if literal \
                else kube.list_omnistages()
        except Exception:
            log.exception("resync: listing OmniStages failed")
            continue
        for obj in items:
            ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
            if not _watched(ns):
                continue
            try:
                _run(ns, name, obj)
            except Exception:
                log.exception("resync of %s/%s failed", ns, name)


WATCHED_NAMESPACES: list[str] = []  # set by operator_main.run; globs as kopf accepts them; [] = all


def _watched(namespace: str) -> bool:
    return not WATCHED_NAMESPACES or any(fnmatch.fnmatchcase(namespace, p) for p in WATCHED_NAMESPACES)


@kopf.on.event("pods", labels={L_COMPONENT: "engine", L_OMNISTAGE: kopf.PRESENT})
def on_engine_pod(namespace: str, labels, type: str, **_) -> None:
    """A replica that disappears or turns NotReady must leave the engine now, not after its
    30 s heartbeat timeout; a new head needs its replicas rolled."""
    if not leader.is_leading():  # a follower does not even read (leader.py)
        return
    owner = labels[L_OMNISTAGE]
    obj = kube.get_omnistage(namespace, owner)
    if obj is None:
        return
    _run(namespace, owner, obj)


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
def on_omnistage_event(namespace: str, name: str, type: str, **_) -> None:
    if type == "DELETED":
        STATUS.observe(namespace, name, None)


@kopf.on.probe(id="omnistages")
def watched(**_) -> int:
    return STATUS.count()
