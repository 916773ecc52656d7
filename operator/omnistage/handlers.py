"""kopf registrations, kept thin: every trigger runs the same reconcile()."""

from __future__ import annotations

import logging
import time

import kopf

from . import api, kube
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


@kopf.timer(api.GROUP, api.VERSION, api.PLURAL, interval=RESYNC_SECONDS, sharp=False)
def resync(namespace: str, name: str, body, **_) -> None:
    """Level-based safety net: catches whatever no event announced (head restarts, lost watches)."""
    _run(namespace, name, body)


@kopf.on.event("pods", labels={L_COMPONENT: "engine", L_OMNISTAGE: kopf.PRESENT})
def on_engine_pod(namespace: str, labels, type: str, **_) -> None:
    """A replica that disappears or turns NotReady must leave the engine now, not after its
    30 s heartbeat timeout; a new head needs its replicas rolled."""
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
