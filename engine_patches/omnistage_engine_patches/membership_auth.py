"""Who may call the head's membership endpoint (:mod:`.membership_routes`): the bearer token.

``Authorization: Bearer <token>``, checked before anything else (the body is not read before). The
master token is read from the file named by ``OMNISTAGE_MEMBERSHIP_TOKEN_FILE`` (a mounted Secret;
re-read when it changes, so a rotated Secret takes effect without a restart) or else from
``OMNISTAGE_MEMBERSHIP_TOKEN``. With neither set every call is refused (503 ``TokenNotConfigured``):
the endpoint never runs open. The master token may do everything; a pod credential
(``contract.pod_credential``: a replica or pool pod's preStop hook holds only its own) may only
``leave`` with ``"pod": <its own name>`` and no other selector: anything else it asks is 403
``Forbidden``.
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

from fastapi import Request

from . import contract
from .membership_listing import MembershipError
from .membership_requests import LeaveBody

# The endpoint's one log, whichever of its modules (membership_auth, _routes, _server) writes.
logger = logging.getLogger("omnistage_engine_patches.membership_api")

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


def authorize(request: Request) -> str | None:
    """Who asks: None for the master token (the operator's: everything), a pod's name for that pod's
    credential (its own leave only: own_pod_only); 401 for anything else."""
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


def forbidden(message: str) -> MembershipError:
    return MembershipError(403, "Forbidden", message)


ONLY_OWN_LEAVE = "a pod credential may only make its own pod leave (POST leave with its name as pod)"


def own_pod_only(body: LeaveBody, pod: str) -> None:
    """A pod credential's leave: by its own pod name, nothing else (an id or an address could pick
    another pod's replica)."""
    if body.pod != pod or body.replica_id is not None or body.ip:
        raise forbidden(ONLY_OWN_LEAVE)
