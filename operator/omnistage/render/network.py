"""Services, the NetworkPolicy guarding the head's engine ports, and the membership token."""

from __future__ import annotations

import base64
from typing import Any

from ..names import (
    ENGINE_COMPONENTS,
    L_COMPONENT,
    L_OMNISTAGE,
    MEMBERSHIP_SECRET,
    ROLE_HEAD,
    ROLE_POOL,
    ROLE_REPLICA,
)
from .common import Pool, Target, metadata, selector_labels
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
        "apiVersion": "v1", "kind": "Secret", "metadata": metadata(t, t.child_name(MEMBERSHIP_SECRET)),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def render_disruption_budget(t: Target, pool: Pool | None = None) -> dict[str, Any]:
    """The PodDisruptionBudget over the replica pods (or one pool's pods): the eviction API (kubectl
    drain, the cluster autoscaler) takes at most spec.disruptionBudget.maxUnavailable of them out of
    serving at once; a replica pod is Ready (healthy to the budget) only while joined.

    minAvailable as a number, not maxUnavailable: with maxUnavailable the disruption controller takes
    the expected count from the pods' controller's scale subresource, and that is the OmniStage's,
    which counts the head too (and is not a pool's count at all); a number needs no scale. The head
    is left out: a budget over one pod blocks every drain of its node (its drain is an outage until a
    new head and its replicas are up, whatever a budget says)."""
    desired = pool.spec.replicas if pool else (t.spec.replicas - 1 if t.distributed else 0)
    budget = pool.spec.disruption_budget if pool else t.spec.disruption_budget
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": metadata(t, f"{pool.name}-pool" if pool else t.child_name("replicas")),
        "spec": {
            "minAvailable": max(0, desired - budget.max_unavailable),
            "selector": {"matchLabels": selector_labels(t, ROLE_POOL if pool else ROLE_REPLICA,
                                                        pool.name if pool else None)},
        },
    }
