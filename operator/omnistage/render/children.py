"""Every child of an OmniStage at once, for `omnistage render` (and the golden files); and each kept
child kind's renderer (RENDERERS, beside api/child_kinds.py's row of that kind), which the children
step of control/ (control/children.py) ensures. The pods are rendered where they are created."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .common import Pool, Target
from .config import render_configmap
from .network import (
    render_api_service,
    render_disruption_budget,
    render_master_service,
    render_network_policy,
    render_pod_credential,
    render_secret,
)
from .pods import render_head_pod, render_pool_pod, render_replica_pod

#: Each kind of api/child_kinds.CHILD_KINDS: every object of it an OmniStage has, from its target and the
#: pools that run (a new kind is its row there and its renderer here; a unit test holds the two equal).
RENDERERS: dict[str, Callable[[Target, Sequence[Pool]], list[dict[str, Any]]]] = {
    "ConfigMap": lambda t, pools: [render_configmap(t)],
    "Service": lambda t, pools: [render_api_service(t), render_master_service(t)],
    "NetworkPolicy": lambda t, pools: [render_network_policy(t)],
    "PodDisruptionBudget": lambda t, pools: [render_disruption_budget(t),
                                             *(render_disruption_budget(t, pool) for pool in pools)],
}


@dataclass
class ChildSet:
    configmap: dict[str, Any]
    secret: dict[str, Any]
    api_service: dict[str, Any]
    master_service: dict[str, Any]
    network_policy: dict[str, Any]
    disruption_budgets: list[dict[str, Any]]  # the replicas', then each pool's
    head: dict[str, Any]
    replicas: list[dict[str, Any]] = field(default_factory=list)
    pool_pods: list[dict[str, Any]] = field(default_factory=list)
    # each replica and pool pod's, in their order
    credentials: list[dict[str, Any]] = field(default_factory=list)

    def all(self) -> list[dict[str, Any]]:
        return [self.configmap, self.secret, self.api_service, self.master_service, self.network_policy,
                *self.disruption_budgets, self.head, *self.credentials, *self.replicas, *self.pool_pods]


def render_children(
    t: Target, token: str, head_ip: str, head_uid: str, pools: Sequence[Pool] = ()
) -> ChildSet:
    """Replica and pool pods need the head's IP and UID, which exist only once the head pod does; the
    reconcile loop renders them later, `omnistage render` passes placeholders. `pools`: the
    OmniStagePools that run stages 1..n-1 (pools.fit has checked them)."""
    replicas = [render_replica_pod(t, i, head_ip, head_uid) for i in range(1, t.replica_pods + 1)]
    pool_pods = [render_pool_pod(t, pool, i, head_ip, head_uid) for pool in pools
                 for i in range(1, pool.spec.replicas + 1)]
    return ChildSet(
        configmap=render_configmap(t),
        secret=render_secret(t, token),
        api_service=render_api_service(t),
        master_service=render_master_service(t),
        network_policy=render_network_policy(t),
        disruption_budgets=[
            render_disruption_budget(t),
            *(render_disruption_budget(t, pool) for pool in pools),
        ],
        head=render_head_pod(t),
        replicas=replicas,
        pool_pods=pool_pods,
        credentials=[render_pod_credential(pod, token) for pod in (*replicas, *pool_pods)],
    )
