"""The operator's Events, aggregated the way client-go's correlator does, without patching any.

A pass that finds the same problem says the same thing: a pod the API server refuses (quota,
admission) would make one `CreateRefused` Event per pass, about 720 an hour per refused pod, each a
new object in etcd. client-go's EventCorrelator keys an Event on its object, type, reason and
message and PATCHes the first one's count and lastTimestamp on every repeat. That needs `patch` on
events, which the operator is denied on purpose: with it the operator could rewrite any Event in
every namespace it watches (a cluster-wide grant by default), other controllers' included, and hide
what they said. So the count is kept here and carried by the next Event the operator creates instead:

* the first occurrence of a key is posted (count 1);
* a repeat is posted only when its count enters a new power of two (2, 4, 8, ...), or when the last
  Event posted for the key is REPOST_SECONDS old (half the API server's default one-hour Event TTL,
  so a problem that persists always has a live Event); each carries count = occurrences so far and
  firstTimestamp = the first one, as client-go's would;
* a key quiet for QUIET_SECONDS starts over (client-go's aggregation window): a repeat a day later
  is news, and is posted at once.

So an hour of one refusal every 5 s makes 10 Events, not 720; `kubectl get events` shows the newest
with its running count.

Repeats of one message are half of it. The same problem can also say something slightly different
every time (a refusal naming pod 1, 2, 3...; a quota message with the current usage), and then no
two keys match. client-go's EventAggregator handles that, and so does this module: once an
object's Events of one type and reason have said MAX_SIMILAR different messages with no gap of
QUIET_SECONDS, every later one of them joins a single series keyed without the message, posted by
the rules above with the message "(combined from similar events): " and the newest message. So 30
refusals of 30 pods make 9 Events of their own and 5 combined ones (counts 1, 2, 4, 8, 16). A gap of
QUIET_SECONDS starts the group over.

The memory is bounded like client-go's (an LRU of MAX_KEYS series and one of MAX_KEYS groups, each
group remembering fewer than MAX_SIMILAR messages) and dropped with the OmniStage (memory.forget).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..api.conditions import timestamp
from . import kube, memory

# Emits a Kubernetes Event on the OmniStage: (type "Normal"|"Warning", reason, message).
EmitFn = Callable[[str, str, str], None]

REPOST_SECONDS = 1800.0
QUIET_SECONDS = 600.0  # client-go's defaultAggregateIntervalInSeconds: both windows are this one
MAX_KEYS = 4096  # client-go's maxLruCacheEntries
MAX_SIMILAR = 10  # client-go's defaultAggregateMaxEvents: the MAX_SIMILAR-th different message is combined
COMBINED_PREFIX = "(combined from similar events): "  # client-go's words, so tools that know them match

Group = tuple[str, str, str, str, str]  # namespace, name, uid, type, reason
Key = tuple[str, str, str, str, str, str | None]  # a Group and its message; None: the group's combined series


@dataclass
class Series:
    count: int  # occurrences since the series began
    first: str  # its first occurrence (the Event's firstTimestamp)
    last_seen: float  # monotonic
    posted_at: float  # monotonic, of the last Event posted
    posted_count: int  # the count that Event carried


@dataclass
class Similar:
    """What one group (object, type, reason) said since it last went quiet."""
    last_seen: float  # monotonic
    messages: set[str] = field(default_factory=set)  # the different ones, while fewer than MAX_SIMILAR
    combining: bool = False  # reached MAX_SIMILAR: every later occurrence joins the combined series

    def combines(self, message: str) -> bool:
        """Record `message`; True when it goes into the combined series. Once combining, the
        messages are not needed any more (client-go keeps MAX_SIMILAR - 1 and drops an arbitrary
        one, so which repeats still get Events of their own is arbitrary there; here none do)."""
        if not self.combining:
            self.messages.add(message)
            if len(self.messages) >= MAX_SIMILAR:
                self.combining, self.messages = True, set()
        return self.combining


def bucket(count: int) -> int:
    """1, 2-3, 4-7, 8-15, ...: a new Event when the count enters the next."""
    return count.bit_length()


def due(s: Series, now: float) -> bool:
    return bucket(s.count) != bucket(s.posted_count) or now - s.posted_at >= REPOST_SECONDS


T = TypeVar("T", Series, Similar)


def current(table: OrderedDict[Any, T], key: Any, now: float, new: Callable[[], T]) -> T:
    """table[key], or new() in its place when it is absent or was quiet for QUIET_SECONDS. The
    table is kept in use order and cut to MAX_KEYS from the least recently used end."""
    entry = table.get(key)
    if entry is None or now - entry.last_seen >= QUIET_SECONDS:
        entry = table[key] = new()
    table.move_to_end(key)
    while len(table) > MAX_KEYS:
        table.popitem(last=False)
    entry.last_seen = now
    return entry


class Correlator:
    def __init__(self, post: Callable[..., None] | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], str] | None = None) -> None:
        # kube.post_event looked up at each call (None), so that a test's stand-in for it applies.
        self._post, self._clock, self._wall = post, clock, wall
        self._lock = threading.Lock()
        self._series: OrderedDict[Key, Series] = OrderedDict()
        self._groups: OrderedDict[Group, Similar] = OrderedDict()

    def emit(self, involved: dict[str, Any], etype: str, reason: str, message: str) -> bool:
        """Record one occurrence; post an Event when it is due. True when one was posted."""
        meta = involved["metadata"]
        group = (meta["namespace"], meta["name"], meta.get("uid") or "", etype, reason)
        now = self._clock()
        with self._lock:
            combined = current(self._groups, group, now, lambda: Similar(last_seen=now)).combines(message)
            key = (*group, None if combined else message)
            s = current(self._series, key, now, lambda: Series(
                count=0, first=(self._wall or timestamp)(), last_seen=now, posted_at=now, posted_count=0))
            s.count += 1
            if not due(s, now):
                return False
            s.posted_at, s.posted_count = now, s.count
            count, first = s.count, s.first
        if combined:
            message = COMBINED_PREFIX + message
        (self._post or kube.post_event)(involved, etype, reason, message, count=count, first_timestamp=first)
        return True

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            for table in (self._series, self._groups):
                for key in [k for k in table if k[0] == namespace and k[1] == name]:
                    del table[key]


EVENTS = Correlator()
memory.register(EVENTS.forget)
