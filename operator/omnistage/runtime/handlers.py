"""What starts the passes: every trigger queues the same reconcile() for its OmniStage.

The watch-fed store (informer.py) and the resync thread only enqueue (workqueue.QUEUE): a bounded
pool runs the passes, one OmniStage at a time per key, so a slow head delays nobody else and a
trigger never waits on one. kopf runs the process (startup handlers, signals) and watches nothing:
a new OmniStage or generation, every OmniStage listed at a start, and a deletion (whose last pass
finds it gone and forgets it, memory.forget) all reach the queue from the store."""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import threading
import time
import zlib

import kopf

from .. import api
from . import leader, memory, metrics, probes
from .drains import DRAINS
from .events import EVENTS
from .headview import probe
from .informer import STATE
from .metrics import RECONCILE_SECONDS
from .reconcile import reconcile
from .workqueue import WorkQueue

log = logging.getLogger(__name__)
RESYNC_SECONDS = 5.0  # every OmniStage's head is probed this often
FULL_RESYNC_SECONDS = 60.0  # and every OmniStage gets a full pass this often (spread over the period)
WATCHED_NAMESPACES: list[str] = []  # globs as kopf accepts them; [] = all. Set by watch(), before kopf starts


def watch(namespaces: list[str]) -> None:
    """The namespaces this operator reconciles (operator_main.run, from `omnistage run -n`)."""
    WATCHED_NAMESPACES[:] = namespaces


def probe_every(seconds: float) -> None:
    """How often every head is probed (operator_main.run, from `omnistage run --probe-heads-every`);
    before kopf starts. A shorter period notices a registration or a restarted head engine sooner, at
    one conditional GET per head per period."""
    global RESYNC_SECONDS
    RESYNC_SECONDS = seconds


def full_pass_every(seconds: float) -> None:
    """How often every OmniStage gets a full pass (operator_main.run, from `omnistage run
    --full-pass-every`); before kopf starts. The full pass is what notices a deleted membership Secret
    (no watch may see Secrets), at one GET per OmniStage per period."""
    global FULL_RESYNC_SECONDS
    FULL_RESYNC_SECONDS = seconds


def _emitter(body):
    ref = {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
           "metadata": {"name": body["metadata"]["name"], "namespace": body["metadata"]["namespace"],
                        "uid": body["metadata"]["uid"]}}

    def emit(etype: str, reason: str, message: str) -> None:
        EVENTS.emit(ref, etype, reason, message)  # repeats aggregated (events.py)
    return emit


def _work(namespace: str, name: str) -> None:
    """One queued pass, measured; the series of an OmniStage found gone are removed after it."""
    if not leader.is_leading():  # leadership lost while this pass was queued
        return
    start, gone = time.monotonic(), False
    try:
        gone = reconcile(namespace, name, None, emitter=_emitter) is None
    except Exception as err:
        metrics.reconcile_failed(namespace, name, type(err).__name__)
        raise
    finally:
        RECONCILE_SECONDS.labels(namespace, name).observe(time.monotonic() - start)
        if gone:
            memory.forget(namespace, name)


# 16: a pass mostly waits (API writes, a head's answer); after a start, every hanging head holds
# one worker for a read timeout once, and at 1,000 OmniStages with 10% hanging 8 workers made the
# restart take 90 s (bench_fleet).
# A pass's deadline (its liveness bound, workqueue.Progress): its head calls are bounded (observe: two
# heads' conditional GETs, act: HEAD_SECONDS_PER_PASS per head and one call past it), and its API
# writes take milliseconds; a pass still running after 5 minutes is stuck, not slow.
PASS_SECONDS = 300.0
QUEUE = WorkQueue(_work, workers=16, name="reconcile", deadline=PASS_SECONDS)
DRAINS.on_done = QUEUE.enqueue  # a finished drain is deleted by the next pass, now


def _probe(namespace: str, name: str) -> None:
    """The resync's cheap look at an OmniStage at rest: its head's conditional GET; a full pass
    only when the head said something new (headview.probe)."""
    if leader.is_leading() and probe(namespace, name):
        QUEUE.enqueue(namespace, name)


# Probes have workers of their own: a head that hangs (up to the read timeout) holds a prober,
# never a reconcile worker, so a scale waits on no dead head.
# A probe is one conditional GET per answer (report, listing), each bounded by head_client's timeouts.
PROBES = WorkQueue(_probe, workers=8, name="probe", deadline=60.0)


def _run(namespace: str, name: str) -> None:
    if not leader.is_leading():  # a follower replica does nothing (leader.py)
        return
    QUEUE.enqueue(namespace, name)


@kopf.on.startup()
def start_resync(**_) -> None:
    """The watch-fed store (informer.py), and the level-based safety net: every RESYNC_SECONDS each
    OmniStage's head is probed (one conditional GET, 304 at rest; a full pass when it said
    something new or the OmniStage was not at rest) and every FULL_RESYNC_SECONDS each gets a full
    pass (spread over the period, so a scale never waits behind the whole fleet). The probe costs no
    API request; the full pass one, the read of the membership Secret (a deleted one is re-created).
    The probe is what notices a head engine restarted in place (new boot id: 200) within
    RESYNC_SECONDS. A plain thread, not a kopf timer: kopf timers put a finalizer on each
    OmniStage, which then blocks namespace deletion whenever the operator is down or the namespace
    refuses the children."""
    literal = WATCHED_NAMESPACES and not any(set("*?[") & set(p) for p in WATCHED_NAMESPACES)
    # Namespaced mode may not list cluster-wide (RBAC); globs need the cluster-wide watch.
    scopes: list[str | None] = list(WATCHED_NAMESPACES) if literal else [None]
    STATE.start(scopes, on_change=_on_watched)  # called from the informers' threads
    resync = threading.Thread(target=_resync_forever, name="omnistage-resync", daemon=True)
    resync.start()
    probes.watch_thread(resync)
    probes.watch_pools(QUEUE.progress, PROBES.progress, DRAINS.progress)


@kopf.on.startup()
async def watch_loop(**_) -> None:
    """Liveness asks kopf's event loop to run a no-op (probes.py); async, so it runs in that loop."""
    probes.watch_loop(asyncio.get_running_loop())


def _on_watched(namespace: str, name: str) -> None:
    """An engine pod or a child changed: a replica that disappears or turns NotReady must leave the
    engine now, not after its 30 s heartbeat timeout; a new head needs its replicas rolled; a
    child edited by someone else is put back."""
    if _watched(namespace):
        _run(namespace, name)


def _resync_forever() -> None:
    slots, tick = max(1, round(FULL_RESYNC_SECONDS / RESYNC_SECONDS)), 0
    while True:
        time.sleep(RESYNC_SECONDS)
        tick += 1
        if not leader.is_leading():  # a follower does nothing (leader.py)
            continue
        for obj in STATE.omnistages.all():
            ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
            if not _watched(ns):
                continue
            if zlib.crc32(f"{ns}/{name}".encode()) % slots == tick % slots:
                # Its full pass of the period, which reads the membership Secret too: no watch may see
                # it deleted (RBAC), so one GET per OmniStage per period is the price of noticing.
                memory.TOKENS.recheck(ns, name)
                _run(ns, name)
            else:
                PROBES.enqueue(ns, name)  # queued: the loop never waits on a head


def _watched(namespace: str) -> bool:
    return not WATCHED_NAMESPACES or any(fnmatch.fnmatchcase(namespace, p) for p in WATCHED_NAMESPACES)


