"""The operator's Events, aggregated the way client-go's correlator does, without patching any.

A pass that finds the same problem says the same thing: a pod the API server refuses (quota,
admission) made one `CreateRefused` Event per pass before, about 720 an hour per refused pod, each a
new object in etcd. client-go's EventCorrelator keys an Event on its object, type, reason and
message and PATCHes the first one's count and lastTimestamp on every repeat. That needs `patch` on
events, which issue 9 removed on purpose: with it the operator could rewrite any Event in every
namespace it watches (a cluster-wide grant by default), other controllers' included, and hide what
they said. So the count is kept here and carried by the next Event the operator creates instead:

* the first occurrence of a key is posted (count 1);
* a repeat is posted only when its count enters a new power of two (2, 4, 8, ...), or when the last
  Event posted for the key is REPOST_SECONDS old (half the API server's default one-hour Event TTL,
  so a problem that persists always has a live Event); each carries count = occurrences so far and
  firstTimestamp = the first one, as client-go's would;
* a key quiet for QUIET_SECONDS starts over (client-go's aggregation window): a repeat a day later
  is news, and is posted at once.

So an hour of one refusal every 5 s makes 10 Events, not 720; `kubectl get events` shows the newest
with its running count. The memory is bounded like client-go's (an LRU of MAX_KEYS) and dropped
with the OmniStage (memory.forget).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..api.conditions import timestamp
from . import kube

REPOST_SECONDS = 1800.0
QUIET_SECONDS = 600.0
MAX_KEYS = 4096  # client-go's maxLruCacheEntries

Key = tuple[str, str, str, str, str, str]  # namespace, name, uid, type, reason, message


@dataclass
class Series:
    count: int  # occurrences since the series began
    first: str  # its first occurrence (the Event's firstTimestamp)
    last_seen: float  # monotonic
    posted_at: float  # monotonic, of the last Event posted
    posted_count: int  # the count that Event carried


def bucket(count: int) -> int:
    """1, 2-3, 4-7, 8-15, ...: a new Event when the count enters the next."""
    return count.bit_length()


def due(s: Series, now: float) -> bool:
    return bucket(s.count) != bucket(s.posted_count) or now - s.posted_at >= REPOST_SECONDS


class Correlator:
    def __init__(self, post: Callable[..., None] | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], str] | None = None) -> None:
        # kube.post_event looked up at each call (None), so that a test's stand-in for it applies.
        self._post, self._clock, self._wall = post, clock, wall
        self._lock = threading.Lock()
        self._series: OrderedDict[Key, Series] = OrderedDict()

    def emit(self, involved: dict[str, Any], etype: str, reason: str, message: str) -> bool:
        """Record one occurrence; post an Event when it is due. True when one was posted."""
        meta = involved["metadata"]
        key = (meta["namespace"], meta["name"], meta.get("uid") or "", etype, reason, message)
        now = self._clock()
        with self._lock:
            s = self._series.get(key)
            if s is None or now - s.last_seen >= QUIET_SECONDS:
                s = Series(count=0, first=(self._wall or timestamp)(), last_seen=now, posted_at=now, posted_count=0)
                self._series[key] = s
            self._series.move_to_end(key)
            while len(self._series) > MAX_KEYS:
                self._series.popitem(last=False)
            s.count, s.last_seen = s.count + 1, now
            if not due(s, now):
                return False
            s.posted_at, s.posted_count = now, s.count
            count, first = s.count, s.first
        (self._post or kube.post_event)(involved, etype, reason, message, count=count, first_timestamp=first)
        return True

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            for key in [k for k in self._series if k[0] == namespace and k[1] == name]:
                del self._series[key]


EVENTS = Correlator()
