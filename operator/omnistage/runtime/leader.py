"""Leader election over one coordination.k8s.io/v1 Lease, so two operator replicas never act at once.

kopf's own peering is not used: with two replicas of equal priority it freezes both (it arbitrates
priorities, it does not elect), it needs the KopfPeering CRDs, and it pauses only kopf's handlers,
not the resync thread (handlers.py). This follows client-go's leaderelection instead:

* the Lease holds `holderIdentity` (the pod name), `leaseDurationSeconds`, `renewTime`; every write
  is a PUT with the resourceVersion this replica last knew, so of two replicas racing for it one
  gets 409 (and then reads the Lease afresh);
* the leader renews every RENEW_PERIOD with one PUT and no read: its own last write is what it
  knows. A follower watches the Lease (one watch, resumed every few minutes) instead of polling it,
  and takes it over once it has seen the same record unchanged for LEASE_DURATION *by its own
  clock* (the holder's renewTime is never compared with the local clock, so clock skew cannot
  shorten a lease). At rest a leader-elected pair so costs the API server RENEW_PERIOD's 6 writes a
  minute, where client-go's read-then-write every 2 s (follower) and 5 s (leader) costs 54;
* the leader counts itself leading only until RENEW_DEADLINE after the start of its last successful
  renewal; RENEW_DEADLINE < LEASE_DURATION, so a leader cut off from the API server stops acting at
  least LEASE_DURATION - RENEW_DEADLINE before anybody else may start.

`lease_action` and `leading` are the pure rules (tests/unit/test_leader.py); `Elector` applies them with
kube.py's Lease calls (read, create, replace, watch). While `is_leading()` is False the operator
does nothing (handlers.py checks it before every reconcile and in the resync loop); its probe still
answers, so it stays Ready.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import Gauge

from ..names import LEASE_NAME

log = logging.getLogger(__name__)


LEASE_DURATION = 20.0  # s a follower waits, after it last saw the Lease change, before taking it
RENEW_DEADLINE = 15.0  # s after its last successful renewal a leader stops acting
RENEW_PERIOD = (
    10.0  # s between a leader's renewals (6 writes a minute; two retries fit before RENEW_DEADLINE)
)
RETRY_PERIOD = 2.0     # s between retries after a failure, and a follower's looks when it cannot watch

LEADER = Gauge("omnistage_operator_leader", "1 while this operator replica holds the leader Lease.")

CREATE, RENEW, ACQUIRE, WAIT = "create", "renew", "acquire", "wait"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True)
class Timing:
    duration: float = LEASE_DURATION
    renew_deadline: float = RENEW_DEADLINE
    renew_period: float = RENEW_PERIOD
    retry_period: float = RETRY_PERIOD

    def __post_init__(self) -> None:
        # A leader must have stopped before a follower may start, and must get a renewal in first.
        if not self.renew_period < self.renew_deadline < self.duration:
            raise ValueError(f"need renew_period < renew_deadline < duration, got {self}")


def lease_action(me: str, lease: dict[str, Any] | None, observed_at: float, now: float) -> str:
    """What to do with the Lease as read now (pure).

    lease: the Lease object (None: there is none); observed_at: local monotonic time at which this
    replica first saw the Lease in its present version (resourceVersion)."""
    if lease is None:
        return CREATE
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    if holder == me:
        return RENEW
    if not holder:
        return ACQUIRE  # released by a leader that shut down cleanly
    duration = spec.get("leaseDurationSeconds") or LEASE_DURATION
    return ACQUIRE if now - observed_at >= duration else WAIT


def leading(renewed_at: float | None, now: float, renew_deadline: float) -> bool:
    """Whether a replica whose last successful write of the Lease began at `renewed_at` may act."""
    return renewed_at is not None and now - renewed_at < renew_deadline


def micro_time(at: datetime.datetime | None = None) -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds, UTC)."""
    return (at or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseClient(Protocol):
    def read_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create_lease(self, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any] | None: ...
    def replace_lease(self, namespace: str, name: str, resource_version: str,
                      spec: dict[str, Any]) -> dict[str, Any] | None: ...
    def watch_lease(self, namespace: str, name: str, resource_version: str,
                    idle_timeout: float) -> Iterator[dict[str, Any] | None]: ...


class Elector:
    def __init__(self, namespace: str, identity: str, name: str = LEASE_NAME, timing: Timing = Timing(),
                 client: LeaseClient | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], str] = micro_time):
        if client is None:
            from . import lease as client  # the Lease verbs; imported late so tests can inject theirs
        self.namespace, self.identity, self.name, self.timing = namespace, identity, name, timing
        self.client, self.clock, self.wall = client, clock, wall
        self._renewed_at: float | None = None
        self._known: dict[str, Any] | None = None  # the Lease as last read, written or watched (None: absent)
        # Whether `_known` is current without a read: true after this replica's own write (until a 409
        # says otherwise) and while the watch delivered every change; a follower without a watch reads.
        self._fresh = False
        self._seen: tuple[str | None, float] = (None, 0.0)  # (resourceVersion, local time first seen)
        self._was_leading = False
        self._lock = threading.Lock()  # is_leading() is asked from kopf's workers and the resync thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def is_leading(self) -> bool:
        now_leading = leading(self._renewed_at, self.clock(), self.timing.renew_deadline)
        self._transition(now_leading)
        return now_leading

    def _transition(self, now_leading: bool) -> None:
        with self._lock:
            if now_leading == self._was_leading:
                return
            self._was_leading = now_leading
        LEADER.set(1 if now_leading else 0)
        log.warning("leader election: %s %s Lease %s/%s", self.identity,
                    "now holds the" if now_leading else "no longer holds the", self.namespace, self.name)

    def observe(self, lease: dict[str, Any] | None, at: float | None = None) -> None:
        """Record the Lease as read, written or delivered by the watch; its version's first sighting
        starts the follower's LEASE_DURATION."""
        self._known, self._fresh = lease, True
        version = (lease or {}).get("metadata", {}).get("resourceVersion")
        if version != self._seen[0]:
            self._seen = (version, self.clock() if at is None else at)

    def step(self) -> float:
        """One round: create/renew/acquire the Lease or wait, from what this replica knows of it (read
        only when that is not current). Returns the seconds until the next round."""
        started = self.clock()  # the lease counts from before the request, never from its answer
        try:
            if not self._fresh:
                self.observe(self.client.read_lease(self.namespace, self.name), started)
            lease, self._fresh = self._known, False
            action = lease_action(self.identity, lease, self._seen[1], started)
            if action == WAIT:
                if (lease or {}).get("spec", {}).get("holderIdentity") != self.identity:
                    self._renewed_at = None
                return self._next()
            spec = self._spec(lease, action)
            if action == CREATE:
                written = self.client.create_lease(self.namespace, self.name, spec)
            else:
                version = lease["metadata"]["resourceVersion"]
                written = self.client.replace_lease(self.namespace, self.name, version, spec)
            if written is None:  # 409: another replica wrote first; it leads (the next round reads)
                self._renewed_at = None
            else:
                self._renewed_at = started
                self.observe(written, started)
                if action != RENEW:
                    log.warning("leader election: %s took Lease %s/%s (%s)", self.identity, self.namespace,
                                self.name, action)
        except Exception:  # API server unreachable etc.: is_leading() lapses by itself at the deadline
            log.exception("leader election: Lease %s/%s round failed", self.namespace, self.name)
            return self._next(failed=True)
        return self._next()

    def _next(self, failed: bool = False) -> float:
        self.is_leading()  # logs a transition as soon as it happens
        return (
            self.timing.renew_period
            if self._renewed_at is not None and not failed
            else self.timing.retry_period
        )

    def follow(self) -> float:
        """While another replica holds the Lease: watch it, instead of polling, until it may be taken
        over (LEASE_DURATION after the last change this replica saw: the watch then stays idle that
        long and ends with a read timeout) or it is released or deleted. One watch carries every
        renewal; the server ends it after a few minutes and it is resumed. Returns the seconds until
        the next step: 0 to decide now, RETRY_PERIOD after a failed watch (the next step reads)."""
        try:
            while not self._stop.is_set():
                if not self._following():
                    return 0.0
                lease = self._known
                left = lease["spec"].get("leaseDurationSeconds") or self.timing.duration
                left -= self.clock() - self._seen[1]
                if left <= 0:
                    self._fresh = True  # silent for the whole lease: what is known is current
                    return 0.0
                for event in self.client.watch_lease(
                    self.namespace, self.name, lease["metadata"]["resourceVersion"], left + 0.5
                ):
                    self.observe(event)
                    if self._stop.is_set() or not self._following():
                        return 0.0  # released (or deleted): decide at once
        except Exception as err:  # noqa: BLE001 -- a read timeout is silence; anything else: read again
            if not _is_timeout(err):
                log.warning("leader election: watching Lease %s/%s failed (%s); reading it",
                            self.namespace, self.name, err)
                self._fresh = False
                return self.timing.retry_period
            self._fresh = True  # nothing changed for the rest of the lease
        return 0.0

    def _following(self) -> bool:
        """Another replica holds the Lease as far as this one knows, and the client can watch it."""
        holder = ((self._known or {}).get("spec") or {}).get("holderIdentity")
        return holder not in (None, "", self.identity) and hasattr(self.client, "watch_lease")

    def _spec(self, lease: dict[str, Any] | None, action: str) -> dict[str, Any]:
        old = (lease or {}).get("spec") or {}
        now = self.wall()
        taken = action != RENEW
        return {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.timing.duration),
                "acquireTime": now if taken else old.get("acquireTime", now), "renewTime": now,
                "leaseTransitions": (old.get("leaseTransitions") or 0) + (1 if taken and lease else 0)}

    def run(self) -> None:
        delay = 0.0
        while not self._stop.wait(delay):
            delay = self.step()
            if self._renewed_at is None and self._following():
                delay = self.follow()

    def start(self) -> threading.Thread:
        self._thread = threading.Thread(target=self.run, name="omnistage-leader", daemon=True)
        self._thread.start()
        return self._thread

    def release(self) -> None:
        """On a clean shutdown: stop acting, then hand the Lease back so the other replica takes it
        at once (its watch sees the release) instead of after LEASE_DURATION."""
        was = self._renewed_at is not None
        self._stop.set()
        if self._thread is not None and was:  # a follower's thread may sit in a watch: not waited for
            self._thread.join(10)
        self._renewed_at = None
        self.is_leading()
        if not was:
            return
        try:
            lease = self.client.read_lease(self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = {
                    **lease["spec"],
                    "holderIdentity": None,
                    "leaseDurationSeconds": 1,
                    "renewTime": self.wall(),
                }
                self.client.replace_lease(
                    self.namespace, self.name, lease["metadata"]["resourceVersion"], spec
                )
                log.warning(
                    "leader election: %s released Lease %s/%s", self.identity, self.namespace, self.name
                )
        except Exception:  # the Lease then expires after LEASE_DURATION instead
            log.exception("leader election: releasing Lease %s/%s failed", self.namespace, self.name)


def _is_timeout(err: BaseException) -> bool:
    """A watch that saw nothing for its idle timeout (urllib3's ReadTimeoutError, possibly wrapped)."""
    while err is not None:
        if "timeout" in type(err).__name__.lower() or "timed out" in str(err).lower():
            return True
        err = err.__cause__ or err.__context__
    return False


_elector: Elector | None = None


def is_leading() -> bool:
    """True when this replica may act: it holds the Lease, or no election runs (a single replica)."""
    return _elector is None or _elector.is_leading()


def configure(elector: Elector | None) -> None:
    global _elector
    _elector = elector


def default_namespace() -> str | None:
    """The Lease's namespace when no flag names one: $POD_NAMESPACE (the Deployment's downward API),
    else the in-cluster ServiceAccount's namespace; None outside a cluster (no election)."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip() or None
    except OSError:
        return None


def default_identity() -> str:
    """$POD_NAME (unique per replica, kept across container restarts of the same pod), else host-pid."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
