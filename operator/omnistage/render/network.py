"""Services, the NetworkPolicy guarding the head's engine ports, and the membership token."""

from __future__ import annotations

import base64
from typing import Any

from ..names import ENGINE_COMPONENTS, L_COMPONENT, L_OMNISTAGE, ROLE_HEAD
from .common import Target, metadata, selector_labels
from .pods import TOKEN_KEY


def render_api_service(t: Target) -> dict[str, Any]:
    """The OpenAI API (and membership endpoint) of the head."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": metadata(t, t.name),
        "spec": {
            "selector": selector_labels(t, ROLE_HEAD),
            "ports": [{"name": "http", "port": t.spec.engine.http_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_master_service(t: Target) -> dict[str, Any]:
    """Headless, and published before the head is Ready: replicas register while the head is
    still starting (its /health only turns 200 once its own replica is up)."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": metadata(t, t.child_name("master")),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(t, ROLE_HEAD),
            "ports": [{"name": "master", "port": t.spec.engine.master_port, "targetPort": "master",
                       "protocol": "TCP"}],
        },
    }


def render_network_policy(t: Target) -> dict[str, Any]:
    """Every engine pod of the OmniStage (head, replicas, pool pods) takes every TCP port from every
    other; everyone else gets only the HTTP port. The head binds its coordinator and three sockets
    per replica on random ports, so replicas need every TCP port of the head; a replica, started
    with --omni-replica-address (its pod IP), and each producing stage replica (the connectors' zmq
    ports, UCX's own listeners) listen too, unauthenticated: this policy is their only fence, so it
    selects them as well, not the head alone."""
    def engines() -> dict[str, Any]:  # a fresh dict each time: one object twice would dump as a YAML alias
        return {"matchLabels": {L_OMNISTAGE: t.name},
                "matchExpressions": [{"key": L_COMPONENT, "operator": "In", "values": list(ENGINE_COMPONENTS)}]}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": metadata(t, t.child_name("head-engine")),
        "spec": {
            "podSelector": engines(),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": engines()}]},
                {"ports": [{"port": t.spec.engine.http_port, "protocol": "TCP"}]},
            ],
        },
    }


def render_secret(t: Target, token: str) -> dict[str, Any]:
    """The token the operator presents to the head's membership endpoint. The caller supplies it
    so rendering stays pure; the reconcile loop generates it once and never rotates it silently."""
    return {
        "apiVersion": "v1", "kind": "Secret", "metadata": metadata(t, t.child_name("membership")),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }
