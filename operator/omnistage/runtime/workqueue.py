"""Work queued per OmniStage and run by bounded pools of workers, and what the operator's liveness
reads of their progress.

Why: one reconcile can wait on a slow or unreachable head (tight timeouts, but still seconds); run
serially, that delays every other OmniStage. Here each OmniStage is a key: it is queued at most
once, never run twice at once (a request while it runs marks it dirty and it runs once more
afterwards, so no trigger is lost), and `workers` different OmniStages run in parallel (WorkQueue:
the passes, the resync's probes). Drains are not coalesced (each is one pod's leave): FairPool runs
at most `per_key` of one OmniStage's at once and holds the rest in its own line, so a tenant whose
head hangs never holds every worker.

Each task runs under a deadline: how long its own bounded I/O may take (a head call's timeouts and
retries, a drain's timeout), plus room for a busy machine. A task past it, or work waiting while a
worker is free, is a pool that stopped making progress: Progress says so, and the operator's
liveness (probes.py, /healthz) fails with that reason, so the kubelet restarts a process whose
workers are stuck (a call without a timeout, a deadlock). A head that hangs stays within the
deadlines (its calls time out), so a tenant cannot make the operator restart.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)

# Work that may start (its key under its limit) waiting this long while a worker is free: the pool
# does not hand out work (its threads died, a bookkeeping bug).
QUEUE_STALL_SECONDS = 60.0


class Progress:
    """What one pool's workers are doing: each task from queued to started to finished, with its
    deadline."""

    def __init__(self, pool: str, workers: int):
        self.pool, self.workers = pool, workers
        self._lock = threading.Lock()
        self._tickets = itertools.count()
        self._waiting: dict[int, float] = {}  # ticket -> queued at (time.monotonic())
        self._running: dict[int, tuple[str, float, float]] = {}  # ticket -> (what, started, seconds allowed)

    def queued(self) -> int:
        with self._lock:
            ticket = next(self._tickets)
            self._waiting[ticket] = time.monotonic()
            return ticket

    def started(self, ticket: int, what: str, seconds: float) -> None:
        with self._lock:
            self._waiting.pop(ticket, None)
            self._running[ticket] = (what, time.monotonic(), seconds)

    def finished(self, ticket: int) -> None:
        with self._lock:
            self._waiting.pop(ticket, None)
            self._running.pop(ticket, None)

    def stuck(self) -> str | None:
        """Why this pool's workers make no progress, else None."""
        now = time.monotonic()
        with self._lock:
            late = sorted(((now - start, allowed, what) for what, start, allowed in self._running.values()
                           if now - start > allowed), reverse=True)
            waiting, running = list(self._waiting.values()), len(self._running)
        if late:
            ran, allowed, what = late[0]
            more = f" ({len(late)} tasks past theirs)" if len(late) > 1 else ""
            return (f"a {self.pool} worker has run {what} for {ran:.0f} s, past its deadline of "
                    f"{allowed:.0f} s{more}")
        if waiting and running < self.workers and now - min(waiting) > QUEUE_STALL_SECONDS:
            return (f"the {self.pool} queue is not draining: {len(waiting)} tasks waiting, the oldest for "
                    f"{now - min(waiting):.0f} s, while {self.workers - running} of {self.workers} workers "
                    "are free")
        return None


class WorkQueue:
    def __init__(self, work: Callable[[str, str], None], workers: int = 8, name: str = "reconcile",
                 deadline: float = 300.0):
        self._work = work
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"omnistage-{name}")
        self.progress = Progress(name, workers)
        self._deadline = deadline  # s one run of `work` may take (Progress)
        self._lock = threading.Lock()
        self._queued: set[Key] = set()  # submitted, not started
        self._running: set[Key] = set()
        self._dirty: set[Key] = set()  # asked for again while running

    def enqueue(self, namespace: str, name: str) -> bool:
        """Queue a reconcile of this OmniStage; False when one is already waiting to start."""
        key = (namespace, name)
        with self._lock:
            if key in self._queued:
                return False
            if key in self._running:
                self._dirty.add(key)
                return False
            self._queued.add(key)
        self._pool.submit(self._run, key, self.progress.queued())
        return True

    def pending(self) -> int:
        with self._lock:
            return len(self._queued) + len(self._running)

    def _run(self, key: Key, ticket: int) -> None:
        with self._lock:
            self._queued.discard(key)
            self._running.add(key)
        self.progress.started(ticket, f"{key[0]}/{key[1]}", self._deadline)
        try:
            self._work(*key)
        except Exception:
            log.exception("%s of %s/%s failed", self.progress.pool, *key)
        finally:
            self.progress.finished(ticket)
            with self._lock:
                self._running.discard(key)
                again = key in self._dirty
                self._dirty.discard(key)
            if again:
                self.enqueue(*key)


class FairPool:
    """`workers` threads shared by every OmniStage, of which one OmniStage's tasks hold at most
    `per_key` at once; its other tasks wait in its own line (in order), not in front of anyone
    else's. Tasks are not coalesced."""

    def __init__(self, name: str, workers: int, per_key: int):
        self.per_key = max(1, min(per_key, workers - 1))  # a worker left for other keys (but in a pool of 1)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"omnistage-{name}")
        self.progress = Progress(name, workers)
        self._lock = threading.Lock()
        self._in_flight: dict[Key, int] = {}  # submitted to the pool, not finished
        self._held: dict[Key, deque[tuple[Callable[[], None], float, str]]] = {}

    def submit(self, key: Key, task: Callable[[], None], seconds: float, what: str) -> None:
        """Run `task` (which must not raise past its own handling; it is logged) within `seconds`."""
        with self._lock:
            if self._in_flight.get(key, 0) >= self.per_key:
                self._held.setdefault(key, deque()).append((task, seconds, what))
                return
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
        self._pool.submit(self._run, key, task, seconds, what, self.progress.queued())

    def held(self, key: Key) -> int:
        """Tasks of this key waiting for one of its own to finish."""
        with self._lock:
            return len(self._held.get(key, ()))

    def _run(self, key: Key, task: Callable[[], None], seconds: float, what: str, ticket: int) -> None:
        self.progress.started(ticket, what, seconds)
        try:
            task()
        except Exception:
            log.exception("%s of %s/%s failed", what, *key)
        finally:
            self.progress.finished(ticket)
            with self._lock:
                line = self._held.get(key)
                after = line.popleft() if line else None
                if line is not None and not line:
                    del self._held[key]
                if after is None:
                    self._in_flight[key] -= 1
                    if not self._in_flight[key]:
                        del self._in_flight[key]
            if after is not None:  # its slot goes to its own next task
                self._pool.submit(self._run, key, *after, self.progress.queued())
