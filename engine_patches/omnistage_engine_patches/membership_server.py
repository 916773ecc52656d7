"""The membership port: a second HTTP server in the head's process, serving the token routes
(:mod:`.membership_routes`).

It listens on ``contract.MEMBERSHIP_PORT_ENV`` (default ``contract.DEFAULT_MEMBERSHIP_PORT``; the
operator renders ``spec.engine.membershipPort``) of the address vLLM's own server binds (``--host``),
started and stopped with vLLM's app (its lifespan) on the same event loop, so the handlers see the
engine exactly as vLLM's routes do. vLLM's public port answers those routes 404: the NetworkPolicy
opens that port to everyone, and the membership port only to the operator's namespace and the
OmniStage's own pods. A membership port that cannot be bound fails the head's start (the kubelet
restarts it) rather than leave a head nobody can manage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from fastapi import FastAPI

from . import contract, report
from .membership_connections import Book, guarded_protocol
from .membership_routes import membership_app

# The endpoint's one log, whichever of its modules (membership_auth, _routes, _server) writes.
logger = logging.getLogger("omnistage_engine_patches.membership_api")

#: Bounds of the membership server beside the body's (MAX_BODY_BYTES) and the connections'
#: (membership_connections: how many, and how long each may take to ask).
MAX_HEADER_BYTES = 16 * 1024
STOP_SECONDS = 10.0


def membership_port(environ: Any = os.environ) -> int:
    """contract.MEMBERSHIP_PORT_ENV, else contract.DEFAULT_MEMBERSHIP_PORT (0: any free port, tests)."""
    raw = (environ.get(contract.MEMBERSHIP_PORT_ENV) or "").strip()
    if not raw:
        return contract.DEFAULT_MEMBERSHIP_PORT
    if not raw.isdigit() or int(raw) > 65535:
        raise ValueError(f"{contract.MEMBERSHIP_PORT_ENV}={raw!r} is not a port number (0-65535)")
    return int(raw)


def _listen(host: str, port: int) -> socket.socket:
    """The membership port, bound now: a port someone else holds fails the head's start, loudly."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise RuntimeError(
            f"the membership port {host}:{port} cannot be bound ({err}): set "
            f"{contract.MEMBERSHIP_PORT_ENV} (spec.engine.membershipPort) to a free port"
        ) from err
    return sock


async def serve_membership(state: Any, host: str, port: int) -> Callable[[], Awaitable[None]]:
    """Start the membership server on the running loop; returns the coroutine function that stops
    it. The bound port is left in ``state.omnistage_membership_port``."""
    import uvicorn

    class _Server(uvicorn.Server):
        """No signal handlers of its own: the process's (vLLM's) stay in charge of stopping it."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        def install_signal_handlers(self) -> None:  # uvicorn before 0.29
            pass

    sock = _listen(host, port)
    state.omnistage_membership_port = sock.getsockname()[1]
    # No limit_concurrency: it counted connections that never sent a byte (64 of them locked the
    # operator out); membership_connections bounds them per peer and in time instead. No proxy
    # headers (no proxy stands before this port: a peer would choose its own address) and no
    # WebSocket upgrade (nothing here speaks it, and it would hand the connection past the guard).
    config = uvicorn.Config(membership_app(state), lifespan="off", log_level="warning", access_log=False,
                            http=guarded_protocol(Book()), ws="none", proxy_headers=False,
                            limit_concurrency=None, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                            timeout_keep_alive=5, timeout_graceful_shutdown=5)
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            raise RuntimeError(f"the membership server on {host}:{port} did not start: {task.exception()!r}")
        await asyncio.sleep(0.01)
    logger.info(
        "membership endpoint on %s:%d (%s and %s; head boot id %s)",
        host,
        state.omnistage_membership_port,
        contract.MEMBERSHIP_PATH,
        contract.ENGINE_PATH,
        report.BOOT_ID,
    )

    async def stop() -> None:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(task), STOP_SECONDS)
        sock.close()

    return stop


def serve_beside(app: FastAPI, port: int) -> None:
    """Run the membership server for as long as vLLM's app runs: its lifespan, wrapped."""
    inner, state = app.router.lifespan_context, app.state
    args = getattr(state, "args", None)
    host = getattr(args, "host", None) or "0.0.0.0"

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as value:
            stop = await serve_membership(state, host, port)
            try:
                yield value
            finally:
                await stop()

    app.router.lifespan_context = lifespan
