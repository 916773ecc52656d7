"""Every child of an OmniStage at once, for `omnistage render` (and the golden files). The reconcile
renders each child in the step of control/ that owns it (the ConfigMap, Services, NetworkPolicy and
budgets in control/children.py, the pods where they are created), not through this set."""

from __future__ import annotations

from collections.abc import Sequence
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
