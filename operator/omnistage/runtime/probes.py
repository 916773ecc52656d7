"""The operator's own probes on --probe-port: liveness (/healthz) and readiness (/readyz), apart.

kopf's liveness endpoint answered both before, so a replica counted Ready the moment kopf ran, the
leader before its informers had listed anything. Now:

* /healthz, liveness: this process still works. kopf's event loop answers (it runs the startup
  handlers, the signal handling and a clean stop's Lease release), the resync thread runs, and the
  worker pools make progress (workqueue.Progress: no pass, probe or drain past its deadline, no
  queue waiting while a worker is free; the answer names the pool and the task). It
  never looks at the API server or the Lease: a restart does not bring a cut-off API server back, it
  only costs a warm follower.
* /readyz, readiness: "leading and synced" (this replica holds the Lease, or no election runs, and
  every informer has listed every watched namespace) or "standing by" (a follower: it watches
  nothing until it leads, leader.py). A leader still listing is not Ready: a rolling update then
  waits for it before it stops the next replica.

The body is JSON with the state in words (`kubectl get --raw` through the pod proxy, or curl).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .workqueue import Progress

log = logging.getLogger(__name__)

LOOP_TIMEOUT = 5.0  # s kopf's event loop may take to run a no-op before the process counts as dead

LEADING_AND_SYNCED = "leading and synced"
LEADING_SYNCING = "leading, informers still listing"
STANDING_BY = "standing by"


def readiness(leading: bool, synced: bool) -> tuple[bool, str]:
    """Ready, and the state in words, of a replica that leads (or runs without election) or follows."""
    if not leading:
        return True, STANDING_BY
    return (True, LEADING_AND_SYNCED) if synced else (False, LEADING_SYNCING)


@dataclass
class Checks:
    """What the probes read; operator_main wires the runtime's, the tests their own."""

    leading: Callable[[], bool]
    synced: Callable[[], bool]
    omnistages: Callable[
        [], int
    ]  # OmniStages with a status this replica observed
    loop: asyncio.AbstractEventLoop | None = None  # kopf's, once its startup handlers ran (handlers.py)
    threads: tuple[threading.Thread, ...] = ()  # threads the operator cannot work without
    pools: tuple[Progress, ...] = ()  # the worker pools' progress (handlers.py: passes, probes, drains)


def liveness(c: Checks) -> tuple[bool, str]:
    if c.loop is None:
        return False, "starting: kopf's startup handlers have not run"
    dead = [t.name for t in c.threads if not t.is_alive()]
    if dead:
        return False, f"thread {', '.join(dead)} died"
    stuck = [why for pool in c.pools if (why := pool.stuck()) is not None]
    if stuck:
        return False, "; ".join(stuck)
    try:
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), c.loop).result(LOOP_TIMEOUT)
    except Exception as err:  # noqa: BLE001 -- a closed or stuck loop: either way not alive
        return False, f"kopf's event loop did not answer in {LOOP_TIMEOUT:.0f} s ({type(err).__name__})"
    return True, "alive"


CHECKS: Checks | None = None  # set by serve(); handlers.py adds kopf's loop and the resync thread


def watch_loop(loop: asyncio.AbstractEventLoop) -> None:
    if CHECKS is not None:
        CHECKS.loop = loop


def watch_thread(thread: threading.Thread) -> None:
    if CHECKS is not None:
        CHECKS.threads += (thread,)


def watch_pools(*pools: Progress) -> None:
    if CHECKS is not None:
        CHECKS.pools += pools


def _answer(path: str) -> tuple[int, dict]:
    c = CHECKS
    if c is None:
        return 503, {"state": "starting"}
    if path == "/healthz":
        ok, state = liveness(c)
        return (200 if ok else 503), {"state": state}
    if path == "/readyz":
        leading = c.leading()
        ok, state = readiness(leading, c.synced() if leading else False)
        return (200 if ok else 503), {"state": state, "leading": leading, "omnistages": c.omnistages()}
    return 404, {"error": f"no probe at {path}: /healthz (liveness) or /readyz (readiness)"}


def send_json(handler: http.server.BaseHTTPRequestHandler, code: int, body: dict) -> None:
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server calls it by this name
        send_json(self, *_answer(self.path.split("?", 1)[0]))

    def log_message(self, *_) -> None:  # a probe every few seconds is not worth a log line
        pass


def serve(port: int, bind: str, checks: Checks) -> http.server.ThreadingHTTPServer | None:
    global CHECKS
    CHECKS = checks
    if not port:
        return None
    server = http.server.ThreadingHTTPServer((bind, port), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="omnistage-probes", daemon=True).start()
    log.info("probes on %s:%d: /healthz (liveness), /readyz (readiness)", bind, port)
    return server
