"""What the operator holds in process memory per OmniStage, and the one forget() that drops it when
the OmniStage is gone: the lock, the token and the rest are held here; each other store (the heads'
answers in headview, the drains in drains.py, the Event counts, the metric series) registers its own
forget, so this module imports none of them. None of it is state the cluster lacks: after a restart each piece
is rebuilt (the token read again, the head asked again, a `leaving` pod's leave issued again), so
an operator restart converges. Kept apart from the pass so that what a pass remembers is listed
in one place; kopf's per-object memo does not fit, as the passes run on the operator's own
workers, outside kopf handlers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Key = tuple[str, str]  # (namespace, name)

_locks: dict[Key, threading.Lock] = {}
_locks_guard = threading.Lock()


def lock(namespace: str, name: str) -> threading.Lock:
    """Defence in depth: the work queue already never runs one OmniStage twice at once."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


class Tokens:
    """Each OmniStage's membership token, by the OmniStage's uid (a re-created OmniStage has a new
    Secret). RBAC refuses the operator list/watch on Secrets, so the token cannot come from a
    watch: reconcile.ensure_token reads (or creates) it once and keeps it here, and reads the Secret
    again (re-creating it from this token when someone deleted it) when an engine pod is about to
    mount it and once per full resync (recheck): no event says that it is gone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[Key, tuple[str | None, str]] = {}  # -> (OmniStage uid, token)
        self._recheck: set[Key] = set()  # whose Secret the next pass reads although it holds the token

    def held(self, namespace: str, name: str, uid: str | None) -> str | None:
        with self._lock:
            held = self._tokens.get((namespace, name))
        return held[1] if held is not None and held[0] == uid else None

    def keep(self, namespace: str, name: str, uid: str | None, token: str) -> None:
        """The token, as read from (or written to) a Secret that is the OmniStage's."""
        with self._lock:
            self._tokens[(namespace, name)] = (uid, token)
            self._recheck.discard((namespace, name))

    def recheck(self, namespace: str, name: str) -> None:
        """The next pass reads the Secret (and again until one read finds it the OmniStage's)."""
        with self._lock:
            self._recheck.add((namespace, name))

    def due(self, namespace: str, name: str) -> bool:
        with self._lock:
            return (namespace, name) in self._recheck

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._tokens.pop((namespace, name), None)
            self._recheck.discard((namespace, name))


TOKENS = Tokens()

@dataclass(frozen=True)
class Resting:
    """What a pass read when it found its OmniStage at rest (no change, no problem, status as
    written), and how to ask its head again. plan() is pure, so the same reading gives the same
    nothing: a later pass that reads the same skips the plan, and the resync only probes the head."""

    fingerprint: tuple[Any, ...]
    client: Any  # the head_client.HeadClient to ask, or None (not imported: this module is a leaf)
    distributed: bool


RESTING: dict[Key, Resting] = {}

# Each OmniStage as last seen with a valid spec (the watch-fed store's own object, not a copy: at
# rest it costs nothing): a pass of an invalid spec renders nothing from it, and keeps the children
# as this one rendered them (plan._invalid). After a restart with the spec still invalid there is
# none until it is fixed.
LAST_VALID: dict[Key, dict[str, Any]] = {}


_FORGETS: list[Callable[[str, str], None]] = []


def register(forget_one: Callable[[str, str], None]) -> None:
    """A store that holds something per OmniStage: `forget_one(namespace, name)` drops it."""
    _FORGETS.append(forget_one)


def forget(namespace: str, name: str) -> None:
    """Drop everything held for a deleted OmniStage: its lock, token and rest, and what every
    registered store holds (head answers, drain states, Event counts, metric series)."""
    with _locks_guard:
        _locks.pop((namespace, name), None)
    TOKENS.forget(namespace, name)
    RESTING.pop((namespace, name), None)
    LAST_VALID.pop((namespace, name), None)
    for forget_one in _FORGETS:
        forget_one(namespace, name)
