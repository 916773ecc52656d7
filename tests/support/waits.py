"""The one bounded poll of every tier (issue 31): `wait_for(description, predicate, timeout, interval)`
returns the predicate's first truthy value, or raises TimeoutError naming what it waited for and the
last value it saw.

Tiers differ only in how often they poll and whether they talk: the cluster tier polls every 0.5 s and
prints `[wait]` lines (start, every 5 s, done), the GPU tier every 10 s as `[gpu]`, the engine tier
every 50 ms and silently (`say=None`: its waits are many and short, and a stand-in head's own waits
go to its pod log). It sleeps through `time.sleep`, so tests/conftest.py counts the time as waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

REPORT_EVERY = 5.0  # seconds between "still waiting" lines


def wait_for(description: str, predicate: Callable[[], T], timeout: float = 60, interval: float = 0.5,
             say: str | None = "wait") -> T:
    """Poll predicate until it returns something truthy; bounded by timeout; progress as `[say]` lines."""
    start = time.monotonic()
    next_report = start + REPORT_EVERY
    if say:
        print(f"[{say}] {description} (up to {timeout:.0f}s)", flush=True)
    while True:
        value = predicate()
        now = time.monotonic()
        if value:
            if say:
                print(f"[{say}] {description}: done after {now - start:.1f}s", flush=True)
            return value
        if now - start >= timeout:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {description}; last value {value!r}")
        if say and now >= next_report:
            print(f"[{say}]   still waiting for {description} ({now - start:.0f}s)", flush=True)
            next_report = now + REPORT_EVERY
        time.sleep(interval)
