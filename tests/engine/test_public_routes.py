"""Patch ``public_routes`` (issue 40 item 4): vLLM's OpenAI port serves the routes a user needs, and
refuses vllm-omni's ``/v1/omni/sleep`` and every other control route.

Real here: vLLM 0.30.0's own ``build_app`` (the function vllm-omni's server calls), with the plugin
loaded through vLLM's plugin loader (conftest), so the guard reaches the app the way it reaches the
head's: vLLM's endpoint-plugin phase calls the patched ``vllm.plugins.load_endpoint_plugins``. On top,
what vllm-omni's ``omni_run_server_worker`` adds: its router (``/v1/omni/sleep``, ``/v1/omni/wakeup``,
its chat, speech, image and video routes, the realtime WebSockets) and its profiler router, and vLLM's
development routes (``VLLM_SERVER_DEV_MODE=1``: ``/sleep``, ``/wake_up``, ``/collective_rpc`` ...) so
that they are there to be refused. Called in process (Starlette's TestClient: no socket, no lifespan,
no engine: a handler that runs answers its own error, which is how a test tells "reached its handler"
from "refused by the guard"). On real engines: tests/cluster/real/test_real_engines.py
(``test_the_public_port_refuses_the_control_routes``).

With ``OMNISTAGE_DISABLE_PATCHES=public_routes`` the regression tests fail (every route answers on
the public port, as upstream); the others hold either way.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)")

from fastapi import FastAPI
from omnistage_engine_patches import _patching, contract
from omnistage_engine_patches.membership_api import MembershipEndpointPlugin
from omnistage_engine_patches.patches import public_routes
from omnistage_engine_patches.patches.public_routes import allowed, route_path
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

pytestmark = pytest.mark.engine

#: What issue 40 names, and vLLM's development and scaling routes: all refused.
CONTROL = [("POST", "/v1/omni/sleep"), ("POST", "/v1/omni/wakeup"), ("POST", "/start_profile"),
           ("POST", "/stop_profile"), ("POST", "/scale_elastic_ep"), ("POST", "/is_scaling_elastic_ep"),
           ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/collective_rpc"),
           ("POST", "/reset_prefix_cache"), ("POST", "/reset_mm_cache"), ("POST", "/pause"), ("POST", "/resume"),
           ("POST", "/update_weights"), ("GET", "/server_info"), ("POST", "/v1/audio/voices"),
           ("DELETE", "/v1/audio/voices/{name}")]
#: What a user needs (issue 40 names the first four): each must reach its handler.
USER = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"), ("POST", "/v1/audio/speech"), ("POST", "/v1/images/generations"),
        ("GET", "/v1/videos/{video_id}"), ("GET", contract.LIVE_PATH)]


def refused(resp) -> bool:
    """The guard's answer (404 in OpenAI's error shape, naming the patch), not a handler's (a HEAD
    answer has no body: its length says it)."""
    if resp.status_code != 404:
        return False
    if resp.request.method == "HEAD":
        return resp.headers.get("content-length") == str(len(public_routes.REFUSED))
    return resp.content == public_routes.REFUSED


@pytest.fixture(scope="module")
def omni_app():
    """vLLM's app as vllm-omni's server builds it (omni_run_server_worker), dev routes included."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_SERVER_DEV_MODE", "1")
    try:
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm_omni.entrypoints.openai import api_server as omni
        from vllm_omni.entrypoints.serve.utils.routes import remove_route_from_app

        args = FrontendArgs.add_cli_args(FlexibleArgumentParser(prog="public-routes")).parse_args(
            ["--host", "127.0.0.1", "--port", "8000"])
        app = build_app(args, ("generate",))
        for path, methods in (("/v1/chat/completions", {"POST"}), ("/v1/chat/completions/batch", {"POST"}),
                              ("/v1/models", {"GET"}), ("/health", {"GET"})):
            remove_route_from_app(app, path, methods)
        app.include_router(omni.router)
        app.include_router(omni.profiler_router)
        app.state.engine_client = None
    finally:
        mp.undo()
    return app


def routes(app) -> set[tuple[str, str]]:
    """(method, path) of every route the app has; "WEBSOCKET" for a WebSocket route."""
    found = set()
    for r in app.routes:
        path = getattr(r, "path", None)
        methods = getattr(r, "methods", None)
        if path is None:
            continue
        if type(r).__name__.endswith("WebSocketRoute"):
            found.add((public_routes.WS, path))
        found.update((m, path) for m in methods or ())
    return found


def concrete(path: str) -> str:
    return path.replace("{name}", "some-voice").replace("{video_id}", "video-1").replace(
        "{response_id}", "resp-1").replace("{session_id}", "session-1")


def test_the_patch_is_applied(engine_patches, omni_app):
    assert engine_patches[contract.PUBLIC_ROUTES].outcome == contract.APPLIED
    import vllm.plugins

    assert _patching.is_ours(vllm.plugins.load_endpoint_plugins, contract.PUBLIC_ROUTES)
    assert public_routes.guards(omni_app)


def test_regression_control_routes_are_refused_on_the_public_port(omni_app):
    """Regression: /v1/omni/sleep and its siblings answer 404 before any handler runs (they were
    answered by their handlers, without credentials, on the port every namespace reaches)."""
    present = routes(omni_app)
    missing = [c for c in CONTROL if c not in present]
    assert not missing, f"not on the app, so not tested: {missing}"
    client = TestClient(omni_app, raise_server_exceptions=False)
    answers = {f"{m} {p}": client.request(m, concrete(p), json={"stage_ids": [0]}) for m, p in CONTROL}
    open_ = {k: r.status_code for k, r in answers.items() if not refused(r)}
    assert not open_, f"answered by their handlers on the public port: {open_}"


def test_regression_every_route_off_the_list_is_refused(omni_app):
    """Regression: an allow-list, not a deny-list: each route of the app either is on it or is
    refused, so a route a later vLLM adds stays closed (here: vLLM's own, at their real paths)."""
    client = TestClient(omni_app, raise_server_exceptions=False)
    off_list = sorted((m, p) for m, p in routes(omni_app)
                      if m != public_routes.WS and not allowed(m, concrete(p)))
    assert len(off_list) >= 20, off_list  # the docs, /load, /ping, /invocations, CONTROL ...
    still = [f"{m} {p}" for m, p in off_list if not refused(client.request(m, concrete(p)))]
    assert not still, f"off the list, yet answered by their handlers: {still}"


def test_regression_a_websocket_off_the_list_is_closed_before_it_is_accepted(omni_app):
    """Regression: a WebSocket to a path off the list is closed before vLLM's routing sees it (a
    route of that path would otherwise take it); the realtime WebSocket reaches its handler."""
    client = TestClient(omni_app, raise_server_exceptions=False)
    for path in ("/v1/omni/sleep", "/v1/omni/sleep/stream"):
        with pytest.raises(WebSocketDisconnect) as closed, client.websocket_connect(path):
            pass
        assert closed.value.code == 1008, path
    assert allowed(public_routes.WS, "/v1/realtime") and (public_routes.WS, "/v1/realtime") in routes(omni_app)


def test_what_a_user_needs_reaches_its_handler(omni_app):
    """/v1/chat/completions, /v1/models, /health and /metrics (and the other inference routes) are
    not refused: each answers from its own handler (no engine here: its own error, or 200)."""
    client = TestClient(omni_app, raise_server_exceptions=False)
    for method, path in USER:
        assert allowed(method, path), (method, path)
        resp = client.request(method, concrete(path), json={"model": "m", "messages": [], "prompt": "x"})
        assert not refused(resp), f"{method} {path} refused: {resp.status_code} {resp.text[:200]}"
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize(("method", "path", "root", "expected"), [
    ("GET", "/v1/models", "", True),
    ("GET", "/v1/models/", "", True),  # Starlette redirects it to /v1/models
    ("HEAD", "/health", "", True),
    ("OPTIONS", "/v1/chat/completions", "", True),  # CORS preflight
    ("GET", "/v1/chat/completions", "", False),  # POST only
    ("POST", "/v1/omni/sleep", "", False),
    ("POST", "/v1/omni/sleep/", "", False),
    ("POST", "//v1/omni/sleep", "", False),
    ("POST", "/v1/omni", "", False),
    ("GET", "/v1/videos/abc/content", "", True),
    ("GET", "/v1/videos//content", "", False),  # a parameter is one non-empty segment
    ("GET", "/v1/videos/a/b/content", "", False),
    ("POST", "/api/v1/chat/completions", "/api", True),  # --root-path
    ("POST", "/api/sleep", "/api", False),
    ("POST", "/apisleep", "/api", False),
    ("GET", "/", "", False),
    ("WEBSOCKET", "/v1/realtime", "", True),
    ("GET", "/v1/realtime", "", False),
])
def test_the_allow_list_matches_as_the_router_does(method, path, root, expected):
    assert allowed(method, route_path({"path": path, "root_path": root})) is expected


def test_an_app_built_past_the_hook_gets_the_guard_from_the_membership_endpoint():
    """Regression: an app whose endpoint plugins were loaded without the patch's hook (vLLM loaded
    them before the general plugins) still gets the guard when the membership endpoint, the server
    of the head's report, is attached: the report never claims a filter the public port lacks."""
    app = FastAPI()
    MembershipEndpointPlugin().attach_router(app)
    assert public_routes.guards(app)
    assert TestClient(app).post("/v1/omni/sleep").status_code == 404
    assert sum(getattr(m, "cls", None) is public_routes.PublicRoutes for m in app.user_middleware) == 1
    guarded = FastAPI()
    public_routes.Guard().attach_router(guarded)
    MembershipEndpointPlugin().attach_router(guarded)  # the usual order: not added twice
    assert sum(getattr(m, "cls", None) is public_routes.PublicRoutes for m in guarded.user_middleware) == 1
