"""Services, the NetworkPolicy guarding the head's engine ports, and the membership Secrets: the
master token (the head's) and each replica or pool pod's own credential."""

from __future__ import annotations

import base64
from typing import Any

from omnistage_engine_patches import contract

from ..api.podtemplate import PORT_HTTP, PORT_MASTER
from ..names import (
    ENGINE_COMPONENTS,
    L_COMPONENT,
    L_INSTANCE,
    L_MANAGED_BY,
    L_NAME,
    L_OMNISTAGE,
    MEMBERSHIP_SECRET,
    ROLE_HEAD,
    ROLE_POOL,
    ROLE_REPLICA,
)
from .common import Pool, Target, metadata, selector_labels
from .pods import TOKEN_KEY, credential_secret_name

#: The label every namespace carries with its own name (Kubernetes sets it): how the NetworkPolicy
#: names the operator's namespace.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def render_api_service(t: Target) -> dict[str, Any]:
    """The OpenAI API of the head (not its membership port: the operator dials the head's pod IP)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(t, t.name),
        "spec": {
            "selector": selector_labels(t, ROLE_HEAD),
            "ports": [
                {"name": PORT_HTTP, "port": t.spec.engine.http_port, "targetPort": PORT_HTTP,
                 "protocol": "TCP"}
            ],
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
            "ports": [{"name": PORT_MASTER, "port": t.spec.engine.master_port, "targetPort": PORT_MASTER,
                       "protocol": "TCP"}],
        },
    }


def render_network_policy(t: Target) -> dict[str, Any]:
    """Three rules, the named ports first:
    - the head's `http` port (the OpenAI API, its liveness): everyone;
    - the head's `membership` port (join, leave, the listing, the engine report): the operator's
      namespace and the OmniStage's own engine pods (their preStop hooks leave), nobody else;
    - every port: the OmniStage's own engine pods (head, replicas, pool pods), from each other.
      vllm-omni binds the head's coordinator and three sockets per replica, and each producing stage
      replica its connectors' zmq and UCX listeners, on ports it picks at random
      (get_open_ports_list), unauthenticated: no policy can name them, so this rule admits them by
      who asks, not by port. It is their only fence, so the policy selects every engine pod, not
      the head alone. The membership port does not rest on it: the head refuses a caller without
      the master token or the pod credential of the pod it asks about (contract.pod_credential).
    Nothing else reaches any engine pod."""
    def engines() -> dict[str, Any]:  # a fresh dict each time: one object twice would dump as a YAML alias
        return {
            "matchLabels": {L_OMNISTAGE: t.name},
            "matchExpressions": [{"key": L_COMPONENT, "operator": "In", "values": list(ENGINE_COMPONENTS)}],
        }

    operator = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: t.operator_namespace}}}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": metadata(t, t.child_name("head-engine")),
        "spec": {
            "podSelector": engines(),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"port": PORT_HTTP, "protocol": "TCP"}]},
                {"from": [operator, {"podSelector": engines()}],
                 "ports": [{"port": contract.MEMBERSHIP_PORT_NAME, "protocol": "TCP"}]},
                {"from": [{"podSelector": engines()}]},
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


def render_pod_credential(pod: dict[str, Any], master_token: str) -> dict[str, Any]:
    """A replica or pool pod's own membership credential (contract.pod_credential), the Secret its
    preStop hook mounts: written before the pod, owned by the OmniStage as the pod is (it goes with
    the OmniStage; a pod of the same name later gets the same credential, so the Secret stays and is
    reused). Its labels are the pod's selector labels, its owner the pod's owner."""
    meta = pod["metadata"]
    name = meta["name"]
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k in (L_NAME, L_INSTANCE, L_MANAGED_BY,
                                                                         L_OMNISTAGE)}
    out_meta: dict[str, Any] = {
        "name": credential_secret_name(name),
        "namespace": meta["namespace"],
        "labels": labels,
    }
    if meta.get("ownerReferences"):
        out_meta["ownerReferences"] = [dict(ref) for ref in meta["ownerReferences"]]
    return {
        "apiVersion": "v1", "kind": "Secret", "metadata": out_meta, "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(contract.pod_credential(master_token, name).encode()).decode()},
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
    desired = pool.spec.replicas if pool else t.replica_pods
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
