"""Draining leaves, off the reconcile workers: the executor they run on and the state of each, by pod
uid. act.py starts them (a StartLeave action), the next pass's observe reads their states
(reconcile.observe), and the pass after a leave returned deletes the pod; the OmniStage is queued
again as soon as a leave returns (on_done, set by handlers.py). A hold (a standby's, StartLeave.hold)
runs here too; once it returned its record is dropped, as the pod stays."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..api.conditions import EventReason
from ..control import actions
from ..control.actions import DRAIN_DONE, DRAIN_FAILED, DRAIN_RUNNING
from . import head_client, memory
from .events import EmitFn
from .head_client import HeadClient, HeadRefused, HeadUnreachable
from .workqueue import FairPool

log = logging.getLogger(__name__)


# A drain mostly waits on its head. One OmniStage drains at most DRAINS_PER_OMNISTAGE pods at once (a
# scale-down by 4 side by side, as before): a tenant whose head hangs its leaves holds a quarter of the
# workers, never all of them, and its other leaves wait in its own line.
DRAIN_WORKERS = 16
DRAINS_PER_OMNISTAGE = 4


def drain_deadline(drain_seconds: int) -> float:
    """How long one pod's leaves may hold a drain worker: head_client.leave's own bound (3 attempts of
    connect + drain + read, and the backoff between them; a pool pod's stages leave side by side),
    and room for a busy machine. Past it the worker is stuck (workqueue.Progress)."""
    return 3 * (head_client.CONNECT_SECONDS + drain_seconds + head_client.READ_SECONDS) + 60.0


class Drains:
    """Draining leaves, off the reconcile workers: a bounded pool, fair between OmniStages, and the
    state of each by pod uid (in memory only: after an operator restart the plan sees no record for a
    pod that carries the `leaving` annotation and simply starts the leave again; the head's leave is
    idempotent)."""

    def __init__(self, workers: int = DRAIN_WORKERS, per_omnistage: int = DRAINS_PER_OMNISTAGE):
        self._pool = FairPool("drain", workers, per_omnistage)
        self.progress = self._pool.progress
        self._lock = threading.Lock()
        self._state: dict[tuple[str, str], dict[str, str]] = {}  # (namespace, name) -> pod uid -> DRAIN_*
        self.on_done: Callable[[str, str], None] = lambda namespace, name: None  # set by handlers: enqueue

    def states(self, namespace: str, name: str) -> dict[str, str]:
        with self._lock:
            return dict(self._state.get((namespace, name), {}))

    def forget(self, namespace: str, name: str, uid: str | None = None) -> None:
        with self._lock:
            if uid is None:
                self._state.pop((namespace, name), None)
            else:
                self._state.get((namespace, name), {}).pop(uid, None)

    def _set(self, key: tuple[str, str], uid: str, state: str) -> None:
        with self._lock:
            self._state.setdefault(key, {})[uid] = state

    def start(
        self, namespace: str, name: str, client: HeadClient, a: actions.StartLeave, emit: EmitFn
    ) -> None:
        key = (namespace, name)
        with self._lock:
            if self._state.get(key, {}).get(a.uid) == DRAIN_RUNNING:
                return
            self._state.setdefault(key, {})[a.uid] = DRAIN_RUNNING

        def leave(stage: int, replica_id: int) -> str:
            who = f"replica {replica_id}" + (f" of stage {stage}" if stage else "")
            try:
                ack = head_client.leave(client, replica_id, a.drain_seconds, stage, hold=a.hold)
                drained = ack.get("drained", True)
                if a.hold:
                    emit("Normal", EventReason.STANDING_BY, f"{who} ({a.pod}) stands by: held unroutable by "
                         "the head" + ("" if drained else f", its requests in flight still finishing after "
                                                           f"{a.drain_seconds}s"))
                    return DRAIN_DONE
                emit(
                    "Normal" if drained else "Warning",
                    EventReason.LEFT if drained else EventReason.DRAIN_TIMEOUT,
                    f"{who} ({a.pod}) left the engine"
                    + (
                        ""
                        if drained
                        else f" after the {a.drain_seconds}s drain timeout with requests in flight"
                    ),
                )
                return DRAIN_DONE
            except (HeadUnreachable, HeadRefused) as err:
                # The head cannot route to a replica it cannot reach either; its heartbeat timeout
                # detaches the replica. Deleting keeps the scale-down moving.
                emit(
                    "Warning",
                    EventReason.LEAVE_FAILED,
                    f"leave for {who} ({a.pod}) failed ({err}); deleting anyway",
                )
            except Exception:  # never lose the record: a stuck RUNNING would hold the pod forever
                log.exception("leave for %s/%s failed", namespace, a.pod)
            return DRAIN_FAILED

        def run() -> None:
            # A pool pod's stages drain side by side: its deletion waits for the slowest, not the sum.
            if len(a.leaves) == 1:
                states = [leave(*a.leaves[0])]
            else:
                with ThreadPoolExecutor(
                    max_workers=len(a.leaves), thread_name_prefix="omnistage-leave"
                ) as each:
                    states = list(each.map(lambda sr: leave(*sr), a.leaves))
            if a.hold and DRAIN_FAILED not in states:
                self.forget(namespace, name, a.uid)  # a standby stays: nothing more to record
            else:
                self._set(key, a.uid, DRAIN_FAILED if DRAIN_FAILED in states else DRAIN_DONE)
            self.on_done(namespace, name)

        self._pool.submit(key, run, drain_deadline(a.drain_seconds),
                          f"the leave of pod {a.pod} ({namespace}/{name})")


DRAINS = Drains()
memory.register(DRAINS.forget)
