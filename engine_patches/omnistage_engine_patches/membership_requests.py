"""What a membership request may carry (:mod:`.membership_routes`), read within bounds: a JSON body
of at most ``contract.MAX_BODY_BYTES`` (413 BodyTooLarge) and ``MAX_JSON_DEPTH`` levels, UTF-8, an
object (400 BadRequest), its fields checked (422 InvalidBody, the errors in ``fields``), and the
listing's page query (422 InvalidQuery). The wire shapes are :mod:`.contract`'s (``JoinRequest``,
``LeaveRequest``), which these models follow.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from . import contract
from .membership_listing import DEFAULT_PAGE, MAX_PAGE, MembershipError

MAX_JSON_DEPTH = 8  # join/leave bodies are flat objects


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, str_strip_whitespace=True)


class JoinBody(RequestBody):
    stage: int = Field(0, ge=0)
    pod: str = Field(min_length=1, max_length=253)
    ip: str = Field(min_length=1, max_length=64)
    wait_seconds: float = Field(5.0, alias="waitSeconds", ge=0, le=60)


class LeaveBody(RequestBody):
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


async def parse(request: Request, model: type[RequestBody]) -> Any:
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


def page_query(request: Request) -> tuple[bool, int, str | None]:
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
