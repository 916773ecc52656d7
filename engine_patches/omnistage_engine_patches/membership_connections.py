"""Who may hold a connection to the membership port (:mod:`.membership_server`), and for how long.

The port's callers are the operator (a few calls at once per head: a pass, and a handful of draining
leaves) and the replicas' preStop hooks (one call each). Its peers are the operator's namespace and the
OmniStage's own pods (the NetworkPolicy), and one of those pods may run hostile model code with a pod
credential. uvicorn alone let such a pod lock the operator out: it has no header timeout, and its
``limit_concurrency`` counts connections that never sent a byte, so 64 half-open connections made
every operator call answer 503 for as long as they were held (issue 40). Here, per connection:

* **WAITING** (no request yet, or between two): its request's headers must be complete within
  ``HEADER_SECONDS`` (a deadline, not an idle timer: a header dripped a byte at a time is closed too);
* **BODY** (headers in, the body not yet read whole): the body within ``BODY_SECONDS``;
* **BUSY** (the app has the request): no deadline. Every route authorizes before it reads anything,
  so a caller without a token is answered at once; only the holders of a token stay BUSY.

Counted per server: at most ``MAX_PER_PEER`` connections of one address, whatever they do (a newcomer
past it is closed at once: a peer only ever hurts itself), and at most ``MAX_WAITING`` WAITING
connections in all. Past that a newcomer is admitted and the oldest WAITING connection of the peer
holding the most is closed, so many hostile peers together cannot keep a new caller out either: the
operator's connection waits for the milliseconds its headers take, and is the newest of the fewest.
There is no cap on requests in progress (uvicorn's limit_concurrency is off): the peers' caps bound them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

# The endpoint's one log, whichever of its modules writes.
logger = logging.getLogger("omnistage_engine_patches.membership_api")

#: Read when a phase starts (module attributes, so a test may shorten them).
HEADER_SECONDS = 5.0  # the operator's headers take milliseconds; a caller has this long
BODY_SECONDS = 5.0  # a body is at most contract.MAX_BODY_BYTES (16 KiB)
#: Above the operator's own calls to one head at once (a pass, drains.DRAINS_PER_OMNISTAGE leaves, an
#: idle kept-alive connection), far below what would crowd a head.
MAX_PER_PEER = 16
MAX_WAITING = 64

WAITING, BODY, BUSY = "waiting", "body", "busy"


def _has_body(scope: dict[str, Any]) -> bool:
    """The request announces a body (HTTP/1.1: a length above 0, or a transfer coding)."""
    for name, value in scope.get("headers") or ():
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


class Book:
    """One server's connections: per peer, and those WAITING (oldest first). Runs on its loop only."""

    def __init__(self) -> None:
        self.per_peer: Counter[str] = Counter()
        self.waiting: dict[Any, None] = {}  # insertion order: when each began to wait
        self.open: set[Any] = set()

    def admit(self, conn: Any) -> bool:
        """A new connection: counted (True), or over its peer's cap (False: the caller closes it)."""
        if self.per_peer[conn.peer] >= MAX_PER_PEER:
            return False
        self.per_peer[conn.peer] += 1
        if self.per_peer[conn.peer] == MAX_PER_PEER:  # once per episode, not per refused connection
            logger.warning("membership port: %s holds %d connections, its cap: more are closed at once",
                           conn.peer, MAX_PER_PEER)
        self.open.add(conn)
        return True

    def forget(self, conn: Any) -> None:
        if conn in self.open:
            self.open.discard(conn)
            self.waiting.pop(conn, None)
            self.per_peer[conn.peer] -= 1
            if not self.per_peer[conn.peer]:
                del self.per_peer[conn.peer]

    def set_waiting(self, conn: Any, waiting: bool) -> None:
        self.waiting.pop(conn, None)
        if waiting and conn in self.open:
            self.waiting[conn] = None

    def victim(self, newcomer: Any) -> Any | None:
        """When more than MAX_WAITING wait: the oldest WAITING connection of the peer that has the
        most of them (never the newcomer), else None."""
        if len(self.waiting) <= MAX_WAITING:
            return None
        counts = Counter(c.peer for c in self.waiting)
        ranked = ((-counts[c.peer], i, c) for i, c in enumerate(self.waiting) if c is not newcomer)
        return min(ranked, default=(0, 0, None), key=lambda r: r[:2])[2]


def guarded_protocol(book: Book) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the phases above, counted in `book`. h11, not httptools: only h11
    bounds the header's size (h11_max_incomplete_event_size); httptools would take any size."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.peer = "?"
            self.phase = WAITING
            self.deadline: asyncio.TimerHandle | None = None
            self.app = _phased(self, self.app)  # uvicorn runs each request with this connection's app

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self.peer = self.client[0] if self.client else "?"
            if not book.admit(self):
                transport.abort()  # type: ignore[attr-defined]
                return
            self.enter(WAITING)
            victim = book.victim(self)
            if victim is not None:
                victim.close_now(f"{MAX_WAITING} connections wait and its peer {victim.peer} holds the most")

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            book.forget(self)
            super().connection_lost(exc)

        def enter(self, phase: str) -> None:
            if self not in book.open:
                return  # closed, or never admitted
            self.phase = phase
            self._cancel()
            book.set_waiting(self, phase == WAITING)
            if phase == WAITING:
                self.deadline = self.loop.call_later(
                    HEADER_SECONDS, self.close_now, f"no complete request headers within {HEADER_SECONDS:g}s")
            elif phase == BODY:
                self.deadline = self.loop.call_later(
                    BODY_SECONDS, self.close_now, f"no complete body within {BODY_SECONDS:g}s")

        def close_now(self, why: str) -> None:
            logger.debug("membership port: closing a connection of %s: %s", self.peer, why)
            self._cancel()
            book.forget(self)
            self.transport.abort()  # never wait to flush to a peer that does not read

        def _cancel(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

    return GuardedH11Protocol


def _phased(conn: Any, app: Any) -> Any:
    """`app` for one connection, moving it through the phases as its requests go: BODY (or BUSY
    without a body) when the headers are in, BUSY once the body is read, WAITING once answered."""

    async def phased(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            return await app(scope, receive, send)
        conn.enter(BODY if _has_body(scope) else BUSY)

        async def receive_phased() -> Any:
            message = await receive()
            if conn.phase == BODY and not message.get("more_body", False):
                conn.enter(BUSY)
            return message

        async def send_phased(message: dict[str, Any]) -> None:
            await send(message)
            if message.get("type") == "http.response.body" and not message.get("more_body", False):
                # Answered: the next request's headers (and what is left of an unread body) get a
                # deadline of their own. uvicorn closes the connection itself when it will not go on.
                conn.enter(WAITING)

        await app(scope, receive_phased, send_phased)

    return phased
