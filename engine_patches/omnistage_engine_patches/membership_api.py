"""The head's membership endpoint: a ``vllm.endpoint_plugins`` entry point.

vLLM 0.30.0 resolves the entry point to a zero-argument factory returning an ``EndpointPlugin``
(``name``, ``required_tasks``, ``attach_router(app)``, ``async init_state(...)``), loads it only
when ``VLLM_PLUGINS`` names it (``omnistage_membership``; keep ``vllm_omni_register_models`` and
``omnistage_engine_patches`` in the list too), and attaches it in ``build_app`` after the core
routers. vllm-omni builds its app with that same ``build_app`` but never calls ``init_state``,
so the handlers find the engine at ``request.app.state.engine_client`` (set by
``omni_init_app_state``) and fall back to what ``init_state`` stored when upstream calls it.

Only a process that serves vLLM's HTTP app (the head) attaches the plugin; headless replicas serve
nothing. Its parts: the routes and what they answer, :mod:`.membership_routes`; who may call them
(bearer tokens), :mod:`.membership_auth`; what a request may carry, :mod:`.membership_requests`; the
membership port they are served on, a second HTTP server in the head's process,
:mod:`.membership_server`; the operations on the live head, :mod:`.membership_ops`.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from fastapi import FastAPI

from . import contract
from .membership_routes import public_router
from .membership_server import membership_port, serve_beside
from .patches import BY_NAME, public_routes


class MembershipEndpointPlugin:
    """``vllm.plugins.endpoint_plugins.interface.EndpointPlugin`` for the membership routes."""

    name = contract.ENDPOINT_PLUGIN
    required_tasks = None  # membership is independent of the served task

    def attach_router(self, app: FastAPI) -> None:
        """The liveness on vLLM's (public) app; every token route on the membership port."""
        # public_routes' guard normally comes first among the endpoint plugins; had vLLM loaded them
        # before the general plugins (the patch's hook then too late for this app), the report served
        # from here would claim a filter the public app lacks: the guard is added here instead.
        if BY_NAME[contract.PUBLIC_ROUTES].apply().applied and not public_routes.guards(app):
            public_routes.Guard().attach_router(app)
        app.include_router(public_router)
        serve_beside(app, membership_port())

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        # Only upstream vLLM calls this; vllm-omni sets state.engine_client itself.
        state.omnistage_engine_client = engine_client


def plugin() -> MembershipEndpointPlugin:
    """The entry point: vLLM calls this factory with no arguments."""
    return MembershipEndpointPlugin()
