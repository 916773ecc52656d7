"""The head's membership endpoint: a ``vllm.endpoint_plugins`` entry point (HTTP layer only).

vLLM 0.30.0 resolves the entry point to a zero-argument factory returning an ``EndpointPlugin``
(``name``, ``required_tasks``, ``attach_router(app)``, ``async init_state(...)``), loads it only
when ``VLLM_PLUGINS`` names it (``omnistage_membership``; keep ``vllm_omni_register_models`` and
``omnistage_engine_patches`` in the list too), and attaches it in ``build_app`` after the core
routers. vllm-omni builds its app with that same ``build_app`` but never calls ``init_state``,
so the handlers find the engine at ``request.app.state.engine_client`` (set by
``omni_init_app_state``) and fall back to what ``init_state`` stored when upstream calls it.
The operations themselves are :mod:`.membership_ops`; the names that cross the wire are
:mod:`.contract`'s.

Its own port: every route below but ``/omnistage/v1/live`` is served by a second HTTP server
in the head's process, on ``contract.MEMBERSHIP_PORT_ENV`` (default
``contract.DEFAULT_MEMBERSHIP_PORT``; the operator renders ``spec.engine.membershipPort``) of the
address vLLM's own server binds (``--host``), started and stopped with vLLM's app (its lifespan)
on the same event loop, so the handlers see the engine exactly as vLLM's routes do. vLLM's public
port answers them 404: the NetworkPolicy opens that port to everyone, and the membership port
only to the operator's namespace and the OmniStage's own pods. Only a process that serves vLLM's
HTTP app (the head) attaches the plugin; headless replicas serve nothing. The liveness path stays
on the public port, where the kubelet probes it. A membership port that cannot be bound fails the
head's start (the kubelet restarts it) rather than leave a head nobody can manage.

Authentication: ``Authorization: Bearer <token>``, checked before anything else (the body is not
read before). The master token is read from the file named by ``OMNISTAGE_MEMBERSHIP_TOKEN_FILE``
(a mounted Secret; re-read when it changes, so a rotated Secret takes effect without a restart) or
else from ``OMNISTAGE_MEMBERSHIP_TOKEN``. With neither set every call is refused (503
``TokenNotConfigured``): the endpoint never runs open. The master token may do everything; a pod
credential (``contract.pod_credential``: a replica or pool pod's preStop hook holds only its own)
may only ``leave`` with ``"pod": <its own name>`` and no other selector: anything else it asks is
403 ``Forbidden``.

Routes (all JSON)::

  GET  /omnistage/v1/engine
       200 EngineReport (``contract.EngineReport``): {"bootId", "pluginVersion", "vllmVersion",
           "vllmOmniVersion", "distributed", "frontendCache", "patches"}
       Answers on any head, distributed or not, also before the engine is ready (fields it
       cannot know yet are null) and with the membership patch off.

  GET  /omnistage/v1/engine and /omnistage/v1/membership (without ``all``) answer with an ETag
       and honour If-None-Match: 304, no body, while the answer the caller holds still stands (the
       listing's ETag is the boot id and the membership epoch, so an unchanged head builds no
       listing): the operator's cheap probe of every head, every few seconds.

  GET  /omnistage/v1/membership[?all=true[&limit=500][&after=<stage>:<replicaId>]]
       200 {"bootId": str, "epoch": int, "distributed": true, "metricsEnabled": bool,
            "stages": {"0": [Replica, ...], ...}, "next": str | null}
       Lists head-local replicas and those registered/attached/draining (``next`` is null).
       ``all=true`` lists every route the head ever allocated, pending slots and replicas that
       left or were dropped included, in (stage, replicaId) order, one page at a time: at most
       ``limit`` entries (default 500, at most 1000) after the cursor ``after``; ``next`` is the
       cursor of the following page, null on the last one.
       422 InvalidQuery (bad ``limit`` or ``after``)

  POST /omnistage/v1/membership/join
       body {"stage": 0, "pod": "<pod name>", "ip": "<pod IP>", "waitSeconds": 5 (optional, <= 60)}
       200 {"bootId", "epoch", ...Replica, "replicaIds": [int]}  (the id the head assigned to the
           replica that registered from ``ip``; newest attached one; its metric series exist
           now, and it is routable: a hold, see ``held``, ends here)
       404 ReplicaNotRegistered  nothing registered from that IP yet (retry)
       409 ReplicaNotAttached    registered, head-side attach not finished (retry)
       409 ReplicaDetached       the head dropped it (DOWN/heartbeat timeout): restart the pod
       409 ReplicaOwnedByOtherPod that replica was joined under another pod name
       409 FrontendCacheUnsafe   the head's stage-0 frontend runs a sender cache: a replica
                                 routed through it may miss tensors; nothing is joined
       Idempotent: joining again returns the same replica id.

  POST /omnistage/v1/membership/leave
       body {"stage": 0, "replicaId": int | "pod": str | "ip": str, "drainTimeoutSeconds": 30}
       (at least one selector; ``replicaId`` wins; ``pod`` must match the joined pod if both given)
       200 {"bootId", "epoch", "stage", "replicaId", "pod", "host", "state": "left",
            "drained": bool, "timedOut": bool, "detached": bool, "inFlightAtDetach": int,
            "waitedSeconds": float, "metricsRegistered": false, "alreadyLeft": bool}
       Stops routing new requests to the replica, waits up to ``drainTimeoutSeconds`` for its
       in-flight requests, detaches it (upstream ``MembershipController.handle_unregister``),
       removes its metric series. Idempotent: leaving a replica that already left answers 200
       with the recorded result and ``alreadyLeft: true`` (for all but the newest 4096 leaves
       only its identity, with ``recordExpired: true``). If the detach fails, routing to the
       replica is restored and the answer is 500 ``DetachFailed``.
       404 UnknownReplica / UnknownStage, 409 HeadLocalReplica, 409 PodMismatch

  Replica = {"stage", "replicaId", "host", "pod", "local", "state", "registered", "attached",
             "held", "coordinatorStatus": "up"|"silent"|"absent", "silentSeconds"?, "queueLength",
             "inFlight", "draining", "metricsRegistered", "patches"?}
  state: pending | registered | attached | draining | detached | left (the default listing shows
        detached replicas until a leave makes them left: the operator replaces their pods)
  coordinatorStatus: silent = attached, heartbeats late past the heartbeat timeout: unroutable,
        kept (patch ``engine_liveness``), routable again when its heartbeats resume

  GET /omnistage/v1/live   (no token) the head's liveness: 200 {"localEngine": "live"|"silent",
       "reason"} while its own stage-0 engine lives, 503 {"localEngine": "gone", "reason"} once
       it is gone (its process died, or it was detached): the kubelet restarts the head
  patches: {patch name: outcome} the replica's own process sent with its registration
        (``contract.REGISTRATION_PATCHES_KEY`` in the stage config, patch ``registration_report``);
        absent for the head-local replica (see GET /omnistage/v1/engine), for a replica whose
        plugin predates the key or runs with that patch off, and before it registered. Fixed at
        registration, so it moves neither the epoch nor the ETag.
  held: attached but unroutable until joined (only on a head started with
        OMNISTAGE_ROUTE_JOINED_ONLY=1, for replicas that registered after startup)

  Errors: {"error": <code>, "message": str, "bootId": str, ...details}; 400 BadRequest (not a
  JSON object, not UTF-8, nested deeper than 8 levels), 413 BodyTooLarge (over 16 KiB), 422
  InvalidBody (field errors in ``fields``), 409 NotDistributed, 503 EngineNotReady / EngineBusy
  / MembershipPatchDisabled / TokenNotConfigured. Three answers reveal nothing about the head:
  401 Unauthorized (bad or missing token), 403 Forbidden (a pod credential asking for more than
  its own pod's leave) and 500 (``InternalError``: "internal error, see the head's log";
  ``DetachFailed``) carry no ``bootId`` and no exception text (the head logs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import socket
from argparse import Namespace
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from . import contract, report
from ._patching import applied
from .membership_listing import DEFAULT_PAGE, MAX_PAGE
from .membership_ops import LiveHead, MembershipError
from .patches import engine_liveness, membership

logger = logging.getLogger("omnistage_engine_patches.membership_api")

MAX_JSON_DEPTH = 8  # join/leave bodies are flat objects
INTERNAL_ERROR = "InternalError"
#: Answers that carry no bootId: a caller without the token learns nothing about the head, and a
#: 500 says only that something failed (the head's log has the rest).
_OPAQUE_STATUSES = frozenset({401, 403, 500})


# ---- token ------------------------------------------------------------------------------------

_token_cache: dict[str, Any] = {"key": None, "token": None}
#: What an unauthenticated caller hears when the head has no token: nothing of where it would be.
NOT_CONFIGURED = "membership is not configured on this head"


def _log_once(why: str) -> None:
    """Why membership is refused, in the head's log; once per cause (every caller may ask again)."""
    if _token_cache.get("logged") != why:
        _token_cache["logged"] = why
        logger.error("%s: every membership call answers 503", why)


def _expected_token() -> str | None:
    path = os.environ.get(contract.TOKEN_FILE_ENV)
    if path:
        try:
            st = os.stat(path)
            key = (path, st.st_mtime_ns, st.st_size, st.st_ino)
            if _token_cache["key"] != key:
                with open(path, encoding="utf-8") as f:
                    _token_cache.update(key=key, token=f.read().strip())
        except OSError as err:
            # The path is the head's to know: its log says it, the answer only that it is unset.
            _log_once(f"membership token file {contract.TOKEN_FILE_ENV}={path} is unreadable: {err}")
            raise MembershipError(503, "TokenNotConfigured", NOT_CONFIGURED) from err
        return _token_cache["token"] or None
    return (os.environ.get(contract.TOKEN_ENV) or "").strip() or None


def _authorize(request: Request) -> str | None:
    """Who asks: None for the master token (the operator's: everything), a pod's name for that pod's
    credential (its own leave only, see _handle); 401 for anything else."""
    expected = _expected_token()
    if not expected:
        _log_once(f"membership token not configured: set {contract.TOKEN_FILE_ENV} or {contract.TOKEN_ENV} "
                  "on the head")
        raise MembershipError(503, "TokenNotConfigured", NOT_CONFIGURED)
    scheme, _, presented = (request.headers.get("authorization") or "").partition(" ")
    presented = presented.strip()
    if scheme.lower() == "bearer":
        if hmac.compare_digest(presented.encode(), expected.encode()):
            return None
        pod = contract.credential_pod(expected, presented)
        if pod is not None:
            return pod
    raise MembershipError(401, "Unauthorized", "missing or wrong bearer token")


def _forbidden(message: str) -> MembershipError:
    return MembershipError(403, "Forbidden", message)


ONLY_OWN_LEAVE = "a pod credential may only make its own pod leave (POST leave with its name as pod)"


# ---- bodies -----------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, str_strip_whitespace=True)


class JoinBody(_Body):
    stage: int = Field(0, ge=0)
    pod: str = Field(min_length=1, max_length=253)
    ip: str = Field(min_length=1, max_length=64)
    wait_seconds: float = Field(5.0, alias="waitSeconds", ge=0, le=60)


class LeaveBody(_Body):
    stage: int = Field(0, ge=0)
    replica_id: int | None = Field(None, alias="replicaId", ge=0)
    pod: str | None = Field(None, max_length=253)
    ip: str | None = Field(None, max_length=64)
    drain_timeout_seconds: float = Field(30.0, alias="drainTimeoutSeconds", ge=0, le=3600)

    @model_validator(mode="after")
    def _one_selector(self) -> LeaveBody:
        if self.replica_id is None and not self.pod and not self.ip:
            raise ValueError("give replicaId, pod or ip")
        return self


def _too_large() -> MembershipError:
    return MembershipError(413, "BodyTooLarge", f"the body exceeds {contract.MAX_BODY_BYTES} bytes")


async def _read_body(request: Request) -> bytes:
    """The body, read at most ``contract.MAX_BODY_BYTES`` into memory whatever the client
    declares (a chunked body has no length to check up front)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > contract.MAX_BODY_BYTES:
                raise _too_large()
        except ValueError as err:
            raise MembershipError(400, "BadRequest", "invalid Content-Length") from err
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > contract.MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, iteratively (a recursive walk is what the limit prevents)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


async def _parse(request: Request, model: type[_Body]) -> Any:
    raw = await _read_body(request)
    try:
        value = json.loads(raw)
    except RecursionError as err:  # deep nesting exhausts the C parser's recursion limit
        raise MembershipError(
            400, "BadRequest", f"body is nested deeper than {MAX_JSON_DEPTH} levels"
        ) from err
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise MembershipError(400, "BadRequest", f"body is not UTF-8 JSON: {err}") from err
    if not isinstance(value, dict):
        raise MembershipError(400, "BadRequest", "body must be a JSON object")
    if _depth(value) > MAX_JSON_DEPTH:
        raise MembershipError(400, "BadRequest", f"body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return model.model_validate(value)
    except ValidationError as err:
        fields = [
            {"field": ".".join(str(p) for p in e["loc"]) or "body", "message": e["msg"]}
            for e in err.errors(include_url=False)
        ]
        raise MembershipError(422, "InvalidBody", "; ".join(f"{f['field']}: {f['message']}" for f in fields),
                              fields=fields) from err


def _page_query(request: Request) -> tuple[bool, int, str | None]:
    """``all``, ``limit`` and the ``after`` cursor (its format is membership_ops' to check)."""
    params = request.query_params
    include_all = (params.get("all") or "").lower() in ("1", "true", "yes")
    limit = DEFAULT_PAGE
    if params.get("limit") is not None:
        try:
            limit = int(params["limit"])
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_PAGE:
            message = f"limit must be an integer from 1 to {MAX_PAGE}"
            raise MembershipError(
                422, "InvalidQuery", message, fields=[{"field": "limit", "message": message}]
            )
    return include_all, limit, params.get("after") or None


# ---- routes -----------------------------------------------------------------------------------

#: The membership port's routes (every one needs a token) and the public port's (the liveness only).
router = APIRouter()
public_router = APIRouter()


def _engine_client_or_none(request: Request) -> Any | None:
    state = request.app.state
    return getattr(state, "engine_client", None) or getattr(state, "omnistage_engine_client", None)


def _engine_client(request: Request) -> Any:
    client = _engine_client_or_none(request)
    if client is None:
        raise MembershipError(503, "EngineNotReady", "no engine client on this server yet")
    return client


def _error(err: MembershipError) -> JSONResponse:
    body = err.body()
    if err.status not in _OPAQUE_STATUSES:
        body["bootId"] = report.BOOT_ID
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(body, status_code=err.status, headers=headers)


async def _handle(request: Request, op, own_leave: bool = False) -> Response:
    """`op()` for the master token; for a pod credential only when `own_leave` (the leave route),
    as `op(pod)`, which checks the body names that pod alone."""
    try:
        pod = _authorize(request)
        if pod is not None and not own_leave:
            raise _forbidden(ONLY_OWN_LEAVE)
        answer = await (op(pod) if own_leave else op())
        return answer if isinstance(answer, Response) else JSONResponse(answer)
    except MembershipError as err:
        if err.status >= 500:
            logger.warning("membership %s %s: %s %s", request.method, request.url.path, err.code, err.message)
        return _error(err)
    except Exception:  # an answer, never a bare 500 page; the details go to the log only
        logger.exception("membership %s %s failed", request.method, request.url.path)
        return _error(MembershipError(500, INTERNAL_ERROR, "internal error, see the head's log"))


# ---- conditional GETs: the operator's cheap probe -------------------------------------------------
# The operator polls every head every few seconds; at rest nothing changed. It sends back the ETag
# of the answer it holds (If-None-Match) and gets 304 with no body while that answer still stands.
# The listing's ETag is the boot id, the membership epoch (bumped by every join, leave, attach and
# detach) and a digest of what the coordinator last published of each engine (up or silent), so a
# probe of an unchanged head builds no listing, and an engine that comes up, goes silent or resumes
# is seen at once (the operator counts only live engines); the report's ETag is a digest of it.


def listing_etag(boot_id: str, epoch: int, liveness: str = "") -> str:
    return f'"{boot_id}.{epoch}.{liveness}"' if liveness else f'"{boot_id}.{epoch}"'


def report_etag(body: dict[str, Any]) -> str:
    return '"' + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24] + '"'


def _conditional(request: Request, body: dict[str, Any], etag: str | None) -> Response:
    if etag is not None and request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    return JSONResponse(body, headers={"ETag": etag} if etag else None)


@router.get(contract.ENGINE_PATH)
async def engine_report(request: Request) -> Response:
    async def op():
        body = report.build(_engine_client_or_none(request))  # never raises, engine or not
        return _conditional(request, body, report_etag(body))

    return await _handle(request, op)


@public_router.get(contract.LIVE_PATH)
async def live(request: Request) -> Response:
    """The head's liveness (no token: it says one word about this process). 503 only when the
    head's own stage-0 engine is gone, the one state no wait repairs (nothing restarts an in-head
    engine, and replicas never register with a new head): the kubelet restarts the head, the
    operator rolls its replicas. A silent engine is alive (engine_liveness waits for it), and an
    engine not built yet is the startup probe's business. Read from this (HTTP) thread: plain
    reads of the pools' client slots, nothing on the orchestrator's loop, so a stalled
    orchestrator cannot fail it."""
    state, why = contract.LOCAL_LIVE, "the engine is not built yet"
    client = _engine_client_or_none(request)
    engine = getattr(client, "engine", client)
    pools = getattr(engine, "stage_pools", None)
    orch = next(
        (o for o in membership.running_orchestrators() if pools is not None and o.stage_pools is pools), None
    )
    if not applied(contract.ENGINE_LIVENESS):
        why = f"patch {contract.ENGINE_LIVENESS!r} is not active: liveness is not judged here"
    elif orch is not None:
        get_master = getattr(getattr(engine, "_runtime", None), "_get_omni_master_server", None)
        try:
            state, why = engine_liveness.local_engine(orch, get_master() if callable(get_master) else None)
        except Exception as err:  # a shape we do not know: never restart a head on our own error
            logger.warning("liveness: the local engine could not be read", exc_info=True)
            state, why = contract.LOCAL_LIVE, f"the local engine could not be read ({type(err).__name__})"
    if state == contract.LOCAL_GONE:
        logger.error("liveness: the head's own stage-0 engine is gone (%s): answering 503", why)
    return JSONResponse({"localEngine": state, "reason": why},
                        status_code=503 if state == contract.LOCAL_GONE else 200)


@router.get(contract.MEMBERSHIP_PATH)
async def list_membership(request: Request) -> Response:
    async def op():
        include_all, limit, after = _page_query(request)
        head = LiveHead.locate(_engine_client(request))
        if include_all:  # pages of every route: not what the probe is for
            return await head.snapshot(include_all=True, limit=limit, after=after)
        liveness = head.liveness_digest()
        etag = listing_etag(report.BOOT_ID, head.state.epoch, liveness)
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"ETag": etag})  # no listing built
        body = await head.snapshot()
        return _conditional(request, body, listing_etag(body["bootId"], body["epoch"], liveness))

    return await _handle(request, op)


async def _command(request: Request, model: type[_Body], call: Callable[[LiveHead, Any], Awaitable[Any]],
                   check: Callable[[Any, str], None] | None = None) -> JSONResponse:
    """A POST: its body parsed as `model`, then `call(head, body)` on the live head. With `check`,
    a pod credential is admitted too, and `check(body, pod)` refuses what that pod may not ask."""
    async def op(pod: str | None = None):
        body = await _parse(request, model)
        if pod is not None and check is not None:
            check(body, pod)
        return await call(LiveHead.locate(_engine_client(request)), body)

    return await _handle(request, op, own_leave=check is not None)


@router.post(contract.JOIN_PATH)
async def join(request: Request) -> JSONResponse:
    return await _command(request, JoinBody, lambda head, body: head.join(body.stage, body.pod, body.ip,
                                                                          body.wait_seconds))


def _own_pod_only(body: LeaveBody, pod: str) -> None:
    """A pod credential's leave: by its own pod name, nothing else (an id or an address could pick
    another pod's replica)."""
    if body.pod != pod or body.replica_id is not None or body.ip:
        raise _forbidden(ONLY_OWN_LEAVE)


@router.post(contract.LEAVE_PATH)
async def leave(request: Request) -> JSONResponse:
    return await _command(request, LeaveBody, lambda head, body: head.leave(
        body.stage, replica_id=body.replica_id, pod=body.pod or None, ip=body.ip or None,
        drain_timeout=body.drain_timeout_seconds), check=_own_pod_only)


# ---- the membership port: a second HTTP server in the head's process ----------------------------

#: Bounds of the membership server beside the body's (MAX_BODY_BYTES): its callers are the operator
#: and the preStop hooks, a handful at once.
MAX_CONNECTIONS = 64
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


def membership_app(state: Any) -> FastAPI:
    """The membership port's app: the token routes, sharing vLLM's app state (its engine client)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.state = state
    app.include_router(router)
    return app


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
    config = uvicorn.Config(membership_app(state), lifespan="off", log_level="warning", access_log=False,
                            limit_concurrency=MAX_CONNECTIONS, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
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


def _serve_beside(app: FastAPI, port: int) -> None:
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


# ---- the plugin -------------------------------------------------------------------------------


class MembershipEndpointPlugin:
    """``vllm.plugins.endpoint_plugins.interface.EndpointPlugin`` for the membership routes."""

    name = contract.ENDPOINT_PLUGIN
    required_tasks = None  # membership is independent of the served task

    def attach_router(self, app: FastAPI) -> None:
        """The liveness on vLLM's (public) app; every token route on the membership port."""
        app.include_router(public_router)
        _serve_beside(app, membership_port())

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        # Only upstream vLLM calls this; vllm-omni sets state.engine_client itself.
        state.omnistage_engine_client = engine_client


def plugin() -> MembershipEndpointPlugin:
    """The entry point: vLLM calls this factory with no arguments."""
    return MembershipEndpointPlugin()
