"""The membership endpoint's routes (HTTP layer only: the operations are :mod:`.membership_ops`, who
may call is :mod:`.membership_auth`, what a request may carry :mod:`.membership_requests`). Every route
but ``/omnistage/v1/live`` is on the membership port (:mod:`.membership_server`); the liveness is on
vLLM's public port, where the kubelet probes it. The names that cross the wire are :mod:`.contract`'s.

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

  POST /omnistage/v1/membership/hold
       body as leave's (master token only)
       200 {"bootId", "epoch", "stage", "replicaId", "pod": null, "host", "state": "attached",
            "held": true, "drained": bool, "timedOut": bool, "detached": false, "inFlightAtHold": int,
            "waitedSeconds": float, "metricsRegistered": bool}
       A joined replica stands by (the operator's spec.standby): no new request is routed to it,
       its pod name is dropped, and its in-flight requests finish where they are (waited for up to
       ``drainTimeoutSeconds``; its metric series go once none is left). It stays attached and
       held: a join routes to it again. Idempotent.
       409 ReplicaLeft / ReplicaDetached (it can never serve again: a process registers once),
       409 ReplicaNotAttached, 409 HeadLocalReplica, 404 UnknownReplica / UnknownStage

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

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import contract, report
from ._patching import applied
from .membership_auth import ONLY_OWN_LEAVE, authorize, forbidden, own_pod_only
from .membership_listing import MembershipError
from .membership_ops import LiveHead
from .membership_requests import JoinBody, LeaveBody, RequestBody, page_query, parse
from .patches import engine_liveness, membership

# The endpoint's one log, whichever of its modules (membership_auth, _routes, _server) writes.
logger = logging.getLogger("omnistage_engine_patches.membership_api")

INTERNAL_ERROR = "InternalError"
#: Answers that carry no bootId: a caller without the token learns nothing about the head, and a
#: 500 says only that something failed (the head's log has the rest).
_OPAQUE_STATUSES = frozenset({401, 403, 500})


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
        pod = authorize(request)
        if pod is not None and not own_leave:
            raise forbidden(ONLY_OWN_LEAVE)
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
        include_all, limit, after = page_query(request)
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


async def _command(request: Request, model: type[RequestBody],
                   call: Callable[[LiveHead, Any], Awaitable[Any]],
                   check: Callable[[Any, str], None] | None = None) -> JSONResponse:
    """A POST: its body parsed as `model`, then `call(head, body)` on the live head. With `check`,
    a pod credential is admitted too, and `check(body, pod)` refuses what that pod may not ask."""
    async def op(pod: str | None = None):
        body = await parse(request, model)
        if pod is not None and check is not None:
            check(body, pod)
        return await call(LiveHead.locate(_engine_client(request)), body)

    return await _handle(request, op, own_leave=check is not None)


@router.post(contract.JOIN_PATH)
async def join(request: Request) -> JSONResponse:
    return await _command(request, JoinBody, lambda head, body: head.join(body.stage, body.pod, body.ip,
                                                                          body.wait_seconds))


@router.post(contract.LEAVE_PATH)
async def leave(request: Request) -> JSONResponse:
    return await _command(request, LeaveBody, lambda head, body: head.leave(
        body.stage, replica_id=body.replica_id, pod=body.pod or None, ip=body.ip or None,
        drain_timeout=body.drain_timeout_seconds), check=own_pod_only)


@router.post(contract.HOLD_PATH)
async def hold(request: Request) -> JSONResponse:
    # The master token only: a pod has no say in whether it stands by.
    return await _command(request, LeaveBody, lambda head, body: head.hold(
        body.stage, replica_id=body.replica_id, pod=body.pod or None, ip=body.ip or None,
        drain_timeout=body.drain_timeout_seconds))


def membership_app(state: Any) -> FastAPI:
    """The membership port's app: the token routes, sharing vLLM's app state (its engine client)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.state = state
    app.include_router(router)
    return app
