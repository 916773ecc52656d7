"""The head's membership endpoint: a ``vllm.endpoint_plugins`` entry point (HTTP layer only).

vLLM 0.30.0 resolves the entry point to a zero-argument factory returning an ``EndpointPlugin``
(``name``, ``required_tasks``, ``attach_router(app)``, ``async init_state(...)``), loads it only
when ``VLLM_PLUGINS`` names it (``omnistage_membership``; keep ``vllm_omni_register_models`` and
``omnistage_engine_patches`` in the list too), and attaches it in ``build_app`` after the core
routers. vllm-omni builds its app with that same ``build_app`` but never calls ``init_state``,
so the handlers find the engine at ``request.app.state.engine_client`` (set by
``omni_init_app_state``) and fall back to what ``init_state`` stored when upstream calls it.

Authentication: ``Authorization: Bearer <token>``. The token is read from the file named by
``OMNISTAGE_MEMBERSHIP_TOKEN_FILE`` (a mounted Secret; re-read when it changes, so a rotated
Secret takes effect without a restart) or else from ``OMNISTAGE_MEMBERSHIP_TOKEN``. With neither
set every call is refused (503 ``TokenNotConfigured``): the endpoint never runs open.

Routes (all JSON; every response, errors included, carries the head's ``bootId``)::

  GET  /omnistage/v1/membership[?all=true]
       200 {"bootId": str, "epoch": int, "distributed": true, "metricsEnabled": bool,
            "stages": {"0": [Replica, ...], ...}}
       Lists head-local replicas and those registered/attached/draining; ``all=true`` adds
       pending slots and replicas that left or were dropped by the head.

  POST /omnistage/v1/membership/join
       body {"stage": 0, "pod": "<pod name>", "ip": "<pod IP>", "waitSeconds": 5 (optional, <= 60)}
       200 {"bootId", "epoch", ...Replica, "replicaIds": [int]}  (the id the head assigned to the
           replica that registered from ``ip``; newest attached one; its metric series exist now)
       404 ReplicaNotRegistered  nothing registered from that IP yet (retry)
       409 ReplicaNotAttached    registered, head-side attach not finished (retry)
       409 ReplicaDetached       the head dropped it (DOWN/heartbeat timeout): restart the pod
       409 ReplicaOwnedByOtherPod that replica was joined under another pod name
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
       with the recorded result and ``alreadyLeft: true``. If the detach fails, routing to the
       replica is restored and the answer is 500 ``DetachFailed``.
       404 UnknownReplica / UnknownStage, 409 HeadLocalReplica, 409 PodMismatch

  Replica = {"stage", "replicaId", "host", "pod", "local", "state", "registered", "attached",
             "coordinatorStatus": "up"|"absent", "queueLength", "inFlight", "draining",
             "metricsRegistered"}
  state: pending | registered | attached | draining | detached | left

  Errors: {"error": <code>, "message": str, "bootId": str, ...details}; 401 Unauthorized (bad or
  missing token), 400 BadRequest (not a JSON object), 422 InvalidBody (field errors in
  ``fields``), 409 NotDistributed, 503 EngineNotReady / MembershipPatchDisabled /
  TokenNotConfigured.
"""

from __future__ import annotations

import hmac
import logging
import os
from argparse import Namespace
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .membership import BOOT_ID, Head, MembershipError

logger = logging.getLogger("omnistage_engine_patches.membership_api")

PLUGIN_NAME = "omnistage_membership"
BASE_PATH = "/omnistage/v1/membership"
TOKEN_FILE_ENV = "OMNISTAGE_MEMBERSHIP_TOKEN_FILE"
TOKEN_ENV = "OMNISTAGE_MEMBERSHIP_TOKEN"


# ---- token ------------------------------------------------------------------------------------

_token_cache: dict[str, Any] = {"key": None, "token": None}


def _expected_token() -> str | None:
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        try:
            st = os.stat(path)
        except OSError as err:
            raise MembershipError(503, "TokenNotConfigured", f"{TOKEN_FILE_ENV}={path} is unreadable: {err}") from err
        key = (path, st.st_mtime_ns, st.st_size, st.st_ino)
        if _token_cache["key"] != key:
            with open(path, encoding="utf-8") as f:
                _token_cache.update(key=key, token=f.read().strip())
        return _token_cache["token"] or None
    return (os.environ.get(TOKEN_ENV) or "").strip() or None


def _authorize(request: Request) -> None:
    expected = _expected_token()
    if not expected:
        raise MembershipError(503, "TokenNotConfigured", f"set {TOKEN_FILE_ENV} or {TOKEN_ENV} on the head")
    scheme, _, presented = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), expected.encode()):
        raise MembershipError(401, "Unauthorized", "missing or wrong bearer token")


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


async def _parse(request: Request, model: type[_Body]) -> Any:
    try:
        raw = await request.json()
    except ValueError as err:
        raise MembershipError(400, "BadRequest", f"body is not JSON: {err}") from err
    if not isinstance(raw, dict):
        raise MembershipError(400, "BadRequest", "body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        fields = [
            {"field": ".".join(str(p) for p in e["loc"]) or "body", "message": e["msg"]}
            for e in err.errors(include_url=False)
        ]
        raise MembershipError(422, "InvalidBody", "; ".join(f"{f['field']}: {f['message']}" for f in fields),
                              fields=fields) from err


# ---- routes -----------------------------------------------------------------------------------

router = APIRouter()


def _engine_client(request: Request) -> Any:
    state = request.app.state
    client = getattr(state, "engine_client", None) or getattr(state, "omnistage_engine_client", None)
    if client is None:
        raise MembershipError(503, "EngineNotReady", "no engine client on this server yet")
    return client


def _error(err: MembershipError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _handle(request: Request, op) -> JSONResponse:
    try:
        _authorize(request)
        return JSONResponse(await op())
    except MembershipError as err:
        if err.status >= 500:
            logger.warning("membership %s %s: %s %s", request.method, request.url.path, err.code, err.message)
        return _error(err)
    except Exception as err:  # an answer, never a bare 500 page
        logger.exception("membership %s %s failed", request.method, request.url.path)
        return _error(MembershipError(500, "InternalError", f"{type(err).__name__}: {err}"))


@router.get(BASE_PATH)
async def list_membership(request: Request) -> JSONResponse:
    include_all = (request.query_params.get("all") or "").lower() in ("1", "true", "yes")

    async def op():
        return await Head.locate(_engine_client(request)).snapshot(include_all=include_all)

    return await _handle(request, op)


@router.post(BASE_PATH + "/join")
async def join(request: Request) -> JSONResponse:
    async def op():
        body = await _parse(request, JoinBody)
        head = Head.locate(_engine_client(request))
        return await head.join(body.stage, body.pod, body.ip, body.wait_seconds)

    return await _handle(request, op)


@router.post(BASE_PATH + "/leave")
async def leave(request: Request) -> JSONResponse:
    async def op():
        body = await _parse(request, LeaveBody)
        head = Head.locate(_engine_client(request))
        return await head.leave(body.stage, replica_id=body.replica_id, pod=body.pod or None, ip=body.ip or None,
                                drain_timeout=body.drain_timeout_seconds)

    return await _handle(request, op)


# ---- the plugin -------------------------------------------------------------------------------


class MembershipEndpointPlugin:
    """``vllm.plugins.endpoint_plugins.interface.EndpointPlugin`` for the membership routes."""

    name = PLUGIN_NAME
    required_tasks = None  # membership is independent of the served task

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)
        logger.info("membership endpoint at %s (head boot id %s)", BASE_PATH, BOOT_ID)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        # Only upstream vLLM calls this; vllm-omni sets state.engine_client itself.
        state.omnistage_engine_client = engine_client


def plugin() -> MembershipEndpointPlugin:
    """The entry point: vLLM calls this factory with no arguments."""
    return MembershipEndpointPlugin()
