"""Client for the engine head's membership endpoint (engine_patches' membership_api).

Calls are idempotent on the engine side, so transient failures (head still starting, connection
refused, 5xx) are retried with backoff; a 4xx is an answer and is returned to the caller."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import urllib3

from .metrics import MEMBERSHIP_CALLS, MEMBERSHIP_SECONDS

BASE_PATH = "/omnistage/v1/membership"
_pool = urllib3.PoolManager(retries=False)


class MembershipError(RuntimeError):
    """The head answered, and the answer was no (e.g. the replica has not registered yet)."""

    def __init__(self, op: str, status: int, body: dict[str, Any]):
        self.op, self.status, self.body = op, status, body
        super().__init__(f"membership {op}: HTTP {status}: {body.get('error') or body}")


class HeadUnreachable(RuntimeError):
    """No answer from the head after the retries (not started yet, restarting, or gone)."""


@dataclass(frozen=True)
class Head:
    ip: str
    port: int
    token: str

    def url(self, suffix: str = "") -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}{BASE_PATH}{suffix}"


def _call(op: str, method: str, head: Head, suffix: str, body: dict[str, Any] | None, timeout: float,
          attempts: int) -> dict[str, Any]:
    delay, last = 0.2, None
    for attempt in range(attempts):
        start = time.monotonic()
        try:
            resp = _pool.request(
                method, head.url(suffix),
                body=json.dumps(body).encode() if body is not None else None,
                headers={"Authorization": f"Bearer {head.token}", "Content-Type": "application/json"},
                timeout=urllib3.Timeout(connect=2.0, read=timeout),
            )
        except urllib3.exceptions.HTTPError as err:
            MEMBERSHIP_CALLS.labels(op, "unreachable").inc()
            last = err
        else:
            MEMBERSHIP_SECONDS.labels(op).observe(time.monotonic() - start)
            try:
                data = json.loads(resp.data or b"{}")
            except ValueError:
                data = {"error": resp.data[:200].decode(errors="replace")}
            if resp.status < 300:
                MEMBERSHIP_CALLS.labels(op, "ok").inc()
                return data
            if resp.status < 500:
                MEMBERSHIP_CALLS.labels(op, f"http_{resp.status}").inc()
                raise MembershipError(op, resp.status, data)
            MEMBERSHIP_CALLS.labels(op, "server_error").inc()
            last = MembershipError(op, resp.status, data)
        if attempt + 1 < attempts:
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    raise HeadUnreachable(f"membership {op} at {head.url(suffix)}: {last}")


def get(head: Head, attempts: int = 2) -> dict[str, Any]:
    return _call("list", "GET", head, "", None, timeout=10, attempts=attempts)


def join(head: Head, pod: str, ip: str, stage: int = 0) -> dict[str, Any]:
    return _call("join", "POST", head, "/join", {"stage": stage, "pod": pod, "ip": ip}, timeout=30, attempts=3)


def leave(head: Head, replica_id: int, drain_seconds: int, stage: int = 0) -> dict[str, Any]:
    """Stop routing to the replica, drain it up to `drain_seconds`, detach it, drop its metrics."""
    body = {"stage": stage, "replicaId": replica_id, "drainTimeoutSeconds": drain_seconds}
    return _call("leave", "POST", head, "/leave", body, timeout=drain_seconds + 15, attempts=3)


def members(listing: dict[str, Any], stage: int = 0) -> list[dict[str, Any]]:
    return list((listing.get("stages") or {}).get(str(stage)) or [])
