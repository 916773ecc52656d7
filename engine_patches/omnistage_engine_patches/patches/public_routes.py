"""Patch ``public_routes``: vLLM's OpenAI port serves the routes a user needs, and refuses the rest.

That port is the head's public one: the OmniStage's NetworkPolicy opens it to every namespace, and
nothing on it asks for credentials. vllm-omni 0.30.0 serves its control routes there too:
``POST /v1/omni/sleep`` pauses the scheduler, aborts the requests in flight and leaves an admission
gate no public route clears, while the head's liveness still answers 200 (issue 40); ``/v1/omni/wakeup``,
vLLM's ``/scale_elastic_ep``, the profiler's ``/start_profile`` and ``/stop_profile``, and, with
switches an image may set, vLLM's development routes (``/sleep``, ``/wake_up``, ``/collective_rpc``,
``/reset_prefix_cache``, ``/pause``, ``/update_weights`` ...) and runtime LoRA loading sit beside them.

With this patch every app vLLM's ``build_app`` builds (the one vllm-omni serves on ``--port``) gets
an ASGI guard in front of its routes that lets through only the :data:`PUBLIC` allow-list, whatever
added the other routes and whenever: a route a later vLLM or vllm-omni adds stays closed until it is
listed here. A refused HTTP request is answered 404 in OpenAI's error shape before any handler runs;
a refused WebSocket is closed before it is accepted (the server answers 403).

How: ``vllm.plugins.load_endpoint_plugins`` (which ``build_app`` calls, by its module attribute,
to attach the endpoint plugins after the core routes) is wrapped to put :class:`Guard` first among
the endpoint plugins it returns; vLLM then calls its ``attach_router(app)``, which adds the guard as
the app's middleware. vLLM loads endpoint plugins only where it builds an HTTP app, so the guard
costs nothing in engine cores and workers, and it does not depend on ``VLLM_PLUGINS`` naming the
membership endpoint. The membership endpoint (attached after it, and the server of the head's report)
adds the guard itself to an app that lacks it (vLLM loaded the endpoint plugins before this patch's
hook was in place), so the report never claims a filter the public port lacks.

Switch it off with ``OMNISTAGE_DISABLE_PATCHES=public_routes`` (the negative control): every route
answers on the public port again, as upstream.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .. import contract
from .._patching import Target, ours, shape_problem, wrap

logger = logging.getLogger("omnistage_engine_patches.public_routes")

NAME = contract.PUBLIC_ROUTES

WS = "WEBSOCKET"  # a WebSocket route's "method" in PUBLIC
_GET, _POST = frozenset({"GET"}), frozenset({"POST"})

#: What the public port serves: each route (``{name}`` is one path segment) and its methods. Health
#: and metrics (the kubelet, Prometheus), the head's liveness, the model list, and the inference routes
#: of vLLM 0.30.0 and vllm-omni 0.30.0: each runs the model for its caller and changes nothing for
#: anyone else (a response, video or session is reached by the id its creator was given). Left out:
#: every control and development route, the profiler, runtime LoRA loading, uploading and deleting
#: voices (shared by every caller, listed by name: anyone could delete anyone's), SageMaker's
#: ``/ping`` and ``/invocations``, ``/load``, and the API docs (``/openapi.json`` lists every route).
PUBLIC: dict[str, frozenset[str]] = {
    "/health": _GET,
    "/metrics": _GET,
    contract.LIVE_PATH: _GET,
    "/version": _GET,
    "/v1/models": _GET,
    "/tokenize": _POST,
    "/detokenize": _POST,
    # OpenAI's inference routes (vLLM's, vllm-omni's handlers where it replaces them)
    "/v1/chat/completions": _POST,
    "/v1/chat/completions/batch": _POST,
    "/v1/completions": _POST,
    "/v1/responses": _POST,
    "/v1/responses/{response_id}": _GET,
    "/v1/responses/{response_id}/cancel": _POST,
    "/v1/embeddings": _POST,
    "/v1/audio/transcriptions": _POST,
    "/v1/audio/translations": _POST,
    "/v1/audio/speech": _POST,
    "/v1/audio/speech/batch": _POST,
    "/v1/audio/generate": _POST,
    "/v1/audio/voices": _GET,
    "/v1/images/generations": _POST,
    "/v1/images/edits": _POST,
    "/v1/videos": _GET | _POST,
    "/v1/videos/sync": _POST,
    "/v1/videos/{video_id}": _GET | frozenset({"DELETE"}),
    "/v1/videos/{video_id}/content": _GET,
    # vLLM's other inference APIs: Anthropic's messages, scoring and the pooling tasks
    "/v1/messages": _POST,
    "/v1/messages/count_tokens": _POST,
    "/generative_scoring": _POST,
    "/pooling": _POST,
    "/classify": _POST,
    "/score": _POST,
    "/v1/score": _POST,
    "/rerank": _POST,
    "/v1/rerank": _POST,
    "/v2/rerank": _POST,
    # realtime and streaming sessions (vllm-omni)
    "/v1/realtime": frozenset({WS}),
    "/v1/realtime/video": frozenset({WS}),
    "/v1/realtime/robot/openpi": frozenset({WS}),
    "/v1/audio/speech/stream": frozenset({WS}),
    "/v1/video/chat/stream": frozenset({WS}),
    "/v1/duplex": frozenset({WS}),
    "/v1/realtime/sessions": _POST,
    "/v1/realtime/sessions/{session_id}/step": _POST,
    "/v1/realtime/sessions/{session_id}/reset": _POST,
    "/v1/realtime/sessions/{session_id}/close": _POST,
    "/v1/realtime/sessions/{session_id}/status": _GET,
}
#: Methods that read what a listed route already gives: HEAD as its GET, OPTIONS (CORS preflight).
_ALSO = {"HEAD": "GET", "OPTIONS": None}


def _split(path: str) -> tuple[str, ...]:
    return tuple(path.strip("/").split("/"))


_TEMPLATES = [(_split(path), methods) for path, methods in PUBLIC.items()]


def route_path(scope: dict[str, Any]) -> str:
    """The path the app's router matches (without the ``--root-path`` prefix, as Starlette's
    ``get_route_path``); one trailing slash dropped (Starlette redirects it to the route without)."""
    path, root = scope.get("path") or "/", scope.get("root_path") or ""
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        path = path[len(root):] or "/"
    return path[:-1] if len(path) > 1 and path.endswith("/") else path


def allowed(method: str, path: str) -> bool:
    """Whether the public port serves `method` (WS for a WebSocket) on `path` (a route path)."""
    parts = _split(path)
    also = _ALSO.get(method, method)
    for template, methods in _TEMPLATES:
        if (method in methods or (method in _ALSO and (also is None or also in methods))) and \
                len(template) == len(parts) and all(t == p or (t[:1] == "{" and t[-1:] == "}" and p)
                                                    for t, p in zip(template, parts, strict=True)):
            return True
    return False


REFUSED = json.dumps({"error": {
    "message": "not served on this port (omnistage patch public_routes: only the routes a user needs are)",
    "type": "NotFoundError", "param": None, "code": 404}}).encode()


class PublicRoutes:
    """The ASGI guard: requests off the allow-list never reach a route."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)  # lifespan
        method = WS if kind == "websocket" else scope.get("method", "")
        if allowed(method, route_path(scope)):
            return await self.app(scope, receive, send)
        logger.debug("public port: refused %s %s", method, scope.get("path"))
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: the server answers 403
            return
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(REFUSED)).encode())]})
        await send({"type": "http.response.body", "body": REFUSED})


def guards(app: Any) -> bool:
    """Whether `app` (a Starlette app) has the guard among its middleware."""
    return any(getattr(m, "cls", None) is PublicRoutes for m in getattr(app, "user_middleware", None) or ())


class Guard:
    """An ``EndpointPlugin`` in shape (vLLM attaches it with its endpoint plugins): adds no route,
    puts :class:`PublicRoutes` in front of the app's."""

    name = "omnistage_public_routes"
    required_tasks = None  # every app vLLM serves

    def attach_router(self, app: Any) -> None:
        if not guards(app):
            app.add_middleware(PublicRoutes)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        pass  # no state: vLLM calls this on every endpoint plugin


def install() -> str | None:
    import vllm.plugins

    target = Target(vllm.plugins, "load_endpoint_plugins", ("supported_tasks",))
    problem = shape_problem(target)
    if problem:
        return problem
    if ours(NAME, target):
        return None

    @wrap(vllm.plugins, "load_endpoint_plugins", NAME)
    def load_endpoint_plugins(orig, *args, **kwargs):
        return [Guard(), *orig(*args, **kwargs)]

    return None


__all__ = ["NAME", "PUBLIC", "REFUSED", "Guard", "PublicRoutes", "allowed", "guards", "route_path"]
