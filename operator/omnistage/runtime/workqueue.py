"""Reconcile work queued per OmniStage and run by a bounded pool of workers.

Why: one reconcile can wait on a slow or unreachable head (tight timeouts, but still seconds); run
serially, that delays every other OmniStage. Here each OmniStage is a key: it is queued at most
once, never run twice at once (a request while it runs marks it dirty and it runs once more
afterwards, so no trigger is lost), and `workers` different OmniStages run in parallel.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)


class WorkQueue:
    def __init__(self, work: Callable[[str, str], None], workers: int = 8):
        self._work = work
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="omnistage-reconcile")
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
        self._pool.submit(self._run, key)
        return True

    def pending(self) -> int:
        with self._lock:
            return len(self._queued) + len(self._running)

    def _run(self, key: Key) -> None:
        with self._lock:
            self._queued.discard(key)
            self._running.add(key)
        try:
            self._work(*key)
        except Exception:
            log.exception("reconcile of %s/%s failed", *key)
        finally:
            with self._lock:
                self._running.discard(key)
                again = key in self._dirty
                self._dirty.discard(key)
            if again:
                self.enqueue(*key)
