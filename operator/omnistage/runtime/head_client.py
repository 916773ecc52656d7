"""Client for the engine head's HTTP endpoints (engine_patches' membership_api): the engine
report, the membership listing, join and leave. Paths and field values come from the shared
contract module, so the two sides cannot drift apart.

Calls are idempotent on the engine side, so transient failures (head still starting, connection
refused, 5xx) are retried with backoff; a 4xx is an answer and is returned to the caller.

Timeouts are tight: these calls run on the reconcile workers (a draining leave runs on drains.DRAINS),
and a head that does not answer within them is reported unreachable rather than waited for. An
unreachable head costs at most about CONNECT_SECONDS x attempts + the backoff per call.

What a head answers is untrusted (its image is the tenant's): each answer is read in chunks, at
most MAX_ANSWER_BYTES, and whole within the call's timeout (not per read: a body dripped a byte at
a time would otherwise hold a worker for ever). An answer over either bound is no answer."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import urllib3
from omnistage_engine_patches import contract

from .metrics import MEMBERSHIP_CALLS, MEMBERSHIP_SECONDS

log = logging.getLogger(__name__)
_pool = urllib3.PoolManager(retries=False)

CONNECT_SECONDS = 1.0  # the head is in the cluster network: a connect takes milliseconds or never
READ_SECONDS = 3.0  # report, listing and an undrained leave answer in milliseconds
JOIN_SECONDS = 10.0  # a join attaches the replica's client to the stage pool on the head
#: A listing of a thousand replicas is about 0.5 MB; nothing the operator asks for comes near this.
MAX_ANSWER_BYTES = 4 * 1024 * 1024
_CHUNK = 64 * 1024


class _BadAnswer(Exception):
    """The head's answer broke a bound (too large, or not complete in time): no answer."""


def _read_bounded(resp: urllib3.BaseHTTPResponse, deadline: float) -> bytes:
    """The body, at most MAX_ANSWER_BYTES, read whole before `deadline` (time.monotonic())."""
    declared = resp.headers.get("Content-Length")
    if declared and declared.isdigit() and int(declared) > MAX_ANSWER_BYTES:
        raise _BadAnswer(f"answer of {declared} bytes, over {MAX_ANSWER_BYTES}")
    chunks, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise _BadAnswer("answer not complete within its timeout")
        chunk = resp.read1(_CHUNK)  # what has arrived, without waiting for a full chunk
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise _BadAnswer(f"answer over {MAX_ANSWER_BYTES} bytes")
        chunks.append(chunk)


class HeadRefused(RuntimeError):
    """The head answered, and the answer was no (e.g. the replica has not registered yet)."""

    def __init__(self, op: str, status: int, body: dict[str, Any]):
        self.op, self.status, self.body = op, status, body
        super().__init__(f"{op}: HTTP {status}: {body.get('error') or body}")

    @property
    def code(self) -> str | None:
        return self.body.get("error")

    def explain(self) -> str:
        return str(self.body.get("message") or self)


class HeadUnreachable(RuntimeError):
    """No answer from the head after the retries (not started yet, restarting, or gone)."""


@dataclass(frozen=True)
class HeadClient:
    ip: str
    port: int
    token: str

    def url(self, path: str) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}{path}"


def _call(op: str, method: str, head: HeadClient, path: str, body: dict[str, Any] | None, timeout: float,
          attempts: int) -> dict[str, Any]:
    data, _ = _conditional_call(op, method, head, path, body, timeout, attempts, None)
    assert data is not None  # only a conditional request is answered 304
    return data


def _conditional_call(
    op: str,
    method: str,
    head: HeadClient,
    path: str,
    body: dict[str, Any] | None,
    timeout: float,
    attempts: int,
    etag: str | None,
) -> tuple[dict[str, Any] | None, str | None]:
    """(answer, its ETag); (None, etag) when the head answered 304 to If-None-Match: etag."""
    delay, last = 0.2, None
    headers = {"Authorization": f"Bearer {head.token}", "Content-Type": "application/json"}
    if etag:
        headers["If-None-Match"] = etag
    for attempt in range(attempts):
        start = time.monotonic()
        resp = None
        try:
            resp = _pool.request(
                method, head.url(path),
                body=json.dumps(body).encode() if body is not None else None,
                headers=headers, timeout=urllib3.Timeout(connect=CONNECT_SECONDS, read=timeout),
                preload_content=False,
            )
            raw = _read_bounded(resp, start + CONNECT_SECONDS + timeout)
            resp.release_conn()
        except (urllib3.exceptions.HTTPError, _BadAnswer) as err:
            if resp is not None:
                resp.close()  # never reuse a connection left mid-answer
            MEMBERSHIP_CALLS.labels(op, "bad_answer" if isinstance(err, _BadAnswer) else "unreachable").inc()
            last = err
        else:
            MEMBERSHIP_SECONDS.labels(op).observe(time.monotonic() - start)
            if resp.status == 304 and etag:
                MEMBERSHIP_CALLS.labels(op, "not_modified").inc()
                return None, etag
            try:
                data = json.loads(raw or b"{}")
            except ValueError:
                data = {"error": raw[:200].decode(errors="replace")}
            if not isinstance(data, dict):
                data = {"error": f"unexpected answer {str(data)[:200]}"}
            if resp.status < 300:
                MEMBERSHIP_CALLS.labels(op, "ok").inc()
                return data, resp.headers.get("ETag")
            if resp.status < 500:
                MEMBERSHIP_CALLS.labels(op, f"http_{resp.status}").inc()
                raise HeadRefused(op, resp.status, data)
            MEMBERSHIP_CALLS.labels(op, "server_error").inc()
            last = HeadRefused(op, resp.status, data)
        if attempt + 1 < attempts:
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    # The message lands in conditions and Events: keep it stable across passes (urllib3's text
    # carries object addresses), the full error goes to the log.
    # The probes (report, list) of a dead head repeat every backoff: headview.ask_head logs the
    # change to unreachable once; a join or leave that fails is worth a line each time.
    log.log(logging.DEBUG if op in ("report", "list") else logging.INFO,
            "%s at %s: no answer: %s", op, head.url(path), last)
    reason = str(last) if isinstance(last, HeadRefused | _BadAnswer) else type(last).__name__
    raise HeadUnreachable(f"{op} at {head.url(path)}: no answer ({reason})")


def report_if_changed(
    head: HeadClient, etag: str | None, attempts: int = 2
) -> tuple[dict[str, Any] | None, str | None]:
    """The report and its ETag; (None, etag) while the report behind `etag` still stands."""
    return _conditional_call("report", "GET", head, contract.ENGINE_PATH, None, READ_SECONDS, attempts, etag)


def listing_if_changed(head: HeadClient, etag: str | None,
                       attempts: int = 2) -> tuple[dict[str, Any] | None, str | None]:
    """The listing and its ETag; (None, etag) while the head's boot id and membership epoch are
    those behind `etag`: the cheap probe a pass at rest makes instead of a listing."""
    return _conditional_call(
        "list", "GET", head, contract.MEMBERSHIP_PATH, None, READ_SECONDS, attempts, etag
    )


def join(head: HeadClient, pod: str, ip: str, stage: int = 0) -> dict[str, Any]:
    body: contract.JoinRequest = {"stage": stage, "pod": pod, "ip": ip}
    return _call("join", "POST", head, contract.JOIN_PATH, body, timeout=JOIN_SECONDS, attempts=2)


def leave(head: HeadClient, replica_id: int, drain_seconds: int, stage: int = 0, hold: bool = False
          ) -> dict[str, Any]:
    """Stop routing to the replica, drain it up to `drain_seconds`, detach it, drop its metrics; with
    `hold`, keep it attached and unroutable instead (a standby: a join routes to it again). The head
    answers when drained, so a draining leave (drain_seconds > 0) belongs on drains.DRAINS."""
    body: contract.LeaveRequest = {
        "stage": stage,
        "replicaId": replica_id,
        "drainTimeoutSeconds": drain_seconds,
    }
    op, path = ("hold", contract.HOLD_PATH) if hold else ("leave", contract.LEAVE_PATH)
    return _call(op, "POST", head, path, body, timeout=drain_seconds + READ_SECONDS,
                 attempts=3 if drain_seconds else 2)