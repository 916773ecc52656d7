"""Client for the engine head's HTTP endpoints (engine_patches' membership_api): the engine
report, the membership listing, join and leave. Paths and field values come from the shared
contract module, so the two sides cannot drift apart.

Calls are idempotent on the engine side, so transient failures (head still starting, connection
refused, 5xx) are retried with backoff; a 4xx is an answer and is returned to the caller.

Timeouts are tight: these calls run on the reconcile workers (a draining leave runs on drains.DRAINS),
and a head that does not answer within them is reported unreachable rather than waited for. An
unreachable head costs at most about CONNECT_SECONDS x attempts + the backoff per call.

What a head answers is untrusted (its image is the tenant's). Each exchange (connect, status line,
headers, chunk framing, body) ends by one deadline, CONNECT_SECONDS + its timeout after it began,
and reads at most its answer's bytes: the head's connections are `_BoundedSocket`s, which hold
every read to the calling thread's `_Exchange` (a per-read timeout alone would let a head drip one
byte every 2 s into a status line or a header for as long as it liked). The body is
then parsed within a memory budget and cut down to what the decision reads (head_answers). An
answer over a bound is no answer: HeadAnswerRefused, which status names."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import urllib3
from omnistage_engine_patches import contract

from . import head_answers
from .head_answers import Limits
from .metrics import MEMBERSHIP_CALLS, MEMBERSHIP_SECONDS

log = logging.getLogger(__name__)

CONNECT_SECONDS = 1.0  # the head is in the cluster network: a connect takes milliseconds or never
READ_SECONDS = 3.0  # report, listing and an undrained leave answer in milliseconds
JOIN_SECONDS = 10.0  # a join attaches the replica's client to the stage pool on the head
HEADER_BYTES = 16 * 1024  # the status line, the headers and the chunk framing of one answer
_CHUNK = 64 * 1024
_LATE = "not complete within its timeout"
#: What each call's answer is, for the messages, and how it is read.
ANSWERS: dict[str, tuple[str, Limits, Callable[[Any], dict[str, Any]]]] = {
    "report": ("engine report", head_answers.REPORT, head_answers.report),
    "list": ("membership listing", head_answers.LISTING, head_answers.listing),
    "join": ("join answer", head_answers.SMALL, head_answers.small),
    "leave": ("leave answer", head_answers.SMALL, head_answers.small),
    "hold": ("hold answer", head_answers.SMALL, head_answers.small),
}


class _BadAnswer(Exception):
    """The head's answer broke a bound (too large, malformed, or not complete in time): no answer,
    and no second attempt (each is the head's choice, and a late answer would cost the call its
    deadline twice). A head that sends nothing at all is a read timeout, retried as before."""


class _Exchange(threading.local):
    """The calling thread's exchange with a head: its deadline (time.monotonic()), the per-read
    timeout, and the bytes the answer may still take. deadline None: no exchange (a pooled
    connection's checks between calls)."""

    deadline: float | None = None
    read_seconds = 0.0
    left = 0


_EXCHANGE = _Exchange()


@contextmanager
def _exchange(deadline: float, read_seconds: float, most_bytes: int) -> Iterator[None]:
    _EXCHANGE.deadline, _EXCHANGE.read_seconds, _EXCHANGE.left = deadline, read_seconds, most_bytes
    try:
        yield
    finally:
        _EXCHANGE.deadline = None


class _BoundedSocket(socket.socket):
    """A head connection's socket. Every read waits at most until the exchange's deadline (and the
    read timeout) and counts against the answer's bytes, whatever http.client or urllib3 reads
    with it: the status line, a header, a chunk-size line, a trailer or the body."""

    __slots__ = ()

    def _bounded(self, read: Callable[..., Any], *args: Any) -> Any:
        ex = _EXCHANGE
        if ex.deadline is None:
            return read(*args)
        left = ex.deadline - time.monotonic()
        if left <= 0:
            raise _BadAnswer(_LATE)
        self.settimeout(min(left, ex.read_seconds))
        try:
            got = read(*args)
        except TimeoutError:
            if left < ex.read_seconds:
                raise _BadAnswer(_LATE) from None
            raise  # a head that sends nothing: urllib3's ReadTimeoutError, as before
        ex.left -= got if isinstance(got, int) else len(got)
        if ex.left < 0:
            raise _BadAnswer("over its size with its headers")
        return got

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        return self._bounded(super().recv_into, buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        return self._bounded(super().recv, bufsize, flags)


class _HeadConnection(urllib3.connection.HTTPConnection):
    def _new_conn(self) -> socket.socket:
        sock = super()._new_conn()
        timeout = sock.gettimeout()
        bounded = _BoundedSocket(sock.family, sock.type, sock.proto, fileno=sock.detach())
        bounded.settimeout(timeout)
        return bounded


class _HeadPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _HeadConnection


_pool = urllib3.PoolManager(retries=False)
_pool.pool_classes_by_scheme = {"http": _HeadPool}  # the heads are dialled over http only


def _read_bounded(resp: urllib3.BaseHTTPResponse, most: int) -> bytearray:
    """The body as sent, at most `most` bytes (the deadline is the socket's)."""
    declared = resp.headers.get("Content-Length")
    if declared and declared.isdigit() and int(declared) > most:
        raise _BadAnswer(f"over {most} bytes")
    if resp.headers.get("Content-Encoding", "identity").lower() not in ("", "identity"):
        raise _BadAnswer("a compressed answer")  # never inflated: a small body can inflate to GiBs
    body = bytearray()  # parsed as it is: a copy would be one more answer's size in memory
    while chunk := resp.read1(_CHUNK, decode_content=False):  # what has arrived, without waiting
        body += chunk
        if len(body) > most:
            raise _BadAnswer(f"over {most} bytes")
    return body


class HeadRefused(RuntimeError):
    """The head answered, and the answer was no (e.g. the replica has not registered yet)."""

    def __init__(self, op: str, status: int, body: dict[str, Any]):
        self.op, self.status, self.body = op, status, body
        super().__init__(f"{op}: HTTP {status}: {str(body.get('error') or body)[:300]}")  # lands in status

    @property
    def code(self) -> str | None:
        return self.body.get("error")

    def explain(self) -> str:
        return str(self.body.get("message") or self)


class HeadUnreachable(RuntimeError):
    """No answer from the head after the retries (not started yet, restarting, or gone)."""


class HeadAnswerRefused(HeadUnreachable):
    """The head answered, but its answer broke a bound (size, shape, deadline): no answer either.
    `answer` names it (ANSWERS), `why` is constant per kind of breach."""

    def __init__(self, message: str, answer: str, why: str):
        super().__init__(message)
        self.answer, self.why = answer, why


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
    """(answer, its ETag); (None, etag) when the head answered 304 to If-None-Match: etag. The answer
    holds only what head_answers keeps of it."""
    answer, limits, keep = ANSWERS[op]
    delay, last = 0.2, None
    headers = {"Authorization": f"Bearer {head.token}", "Content-Type": "application/json"}
    if etag:
        headers["If-None-Match"] = etag
    for attempt in range(attempts):
        start = time.monotonic()
        resp = None
        try:
            with _exchange(start + CONNECT_SECONDS + timeout, timeout, limits.bytes + HEADER_BYTES):
                resp = _pool.request(
                    method, head.url(path),
                    body=json.dumps(body).encode() if body is not None else None,
                    headers=headers, timeout=urllib3.Timeout(connect=CONNECT_SECONDS, read=timeout),
                    preload_content=False,
                )
                raw = _read_bounded(resp, limits.bytes) or bytearray(b"{}")
            resp.release_conn()
        except (urllib3.exceptions.HTTPError, _BadAnswer) as err:
            if resp is not None:
                resp.close()  # never reuse a connection left mid-answer
            MEMBERSHIP_CALLS.labels(op, "bad_answer" if isinstance(err, _BadAnswer) else "unreachable").inc()
            last = err
            if isinstance(err, _BadAnswer):
                break
        else:
            MEMBERSHIP_SECONDS.labels(op).observe(time.monotonic() - start)
            if resp.status == 304 and etag:
                MEMBERSHIP_CALLS.labels(op, "not_modified").inc()
                return None, etag
            if resp.status < 300:
                try:
                    data = head_answers.read(raw, limits, keep)
                except head_answers.Refused as err:
                    MEMBERSHIP_CALLS.labels(op, "bad_answer").inc()
                    last = _BadAnswer(str(err))
                    break
                MEMBERSHIP_CALLS.labels(op, "ok").inc()
                return data, (resp.headers.get("ETag") or "")[:256] or None
            try:
                data = head_answers.read(raw, head_answers.SMALL, head_answers.small)
            except head_answers.Refused:
                data = {"error": raw[:200].decode(errors="replace")}
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
    if isinstance(last, _BadAnswer):
        raise HeadAnswerRefused(f"{op} at {head.url(path)}: the head's answer ({answer}) was refused: {last}",
                                answer, str(last))
    reason = str(last) if isinstance(last, HeadRefused) else type(last).__name__
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