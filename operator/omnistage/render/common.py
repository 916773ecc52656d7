"""Names, labels, owner references and hashes shared by every child."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .. import api
from ..api import OmniStagePoolSpec, OmniStageSpec
from ..api.cachemode import CacheDecision, membership_can_change
from ..api.security import DEFAULT_OPERATOR_NAMESPACE
from ..names import (
    APP_NAME,
    COMPONENT_ENGINE,
    COMPONENT_POOL,
    L_COMPONENT,
    L_INSTANCE,
    L_MANAGED_BY,
    L_NAME,
    L_OMNISTAGE,
    L_POOL,
    L_ROLE,
    MANAGED_BY,
    ROLE_POOL,
    ROLE_SPARE_HEAD,
    ROLE_STANDBY,
)


@dataclass(frozen=True)
class Pool:
    """A parsed OmniStagePool (its spec valid as a model; whether it fits its OmniStage is pools.py's)."""

    name: str
    uid: str | None
    generation: int | None
    spec: OmniStagePoolSpec

    def pod_name(self, index: int) -> str:
        return f"{self.name}-{index}"


@dataclass(frozen=True)
class Target:
    """A validated OmniStage: what every renderer takes (target.target_from makes it)."""

    name: str
    namespace: str
    uid: str | None
    spec: OmniStageSpec
    cache: CacheDecision
    engine_image: str  # spec.engine.image, else the operator's default
    #: Where the operator runs: the NetworkPolicy lets its pods reach the head's membership port.
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE

    @property
    def distributed(self) -> bool:
        """Distributed runtime (head + headless replicas) unless a static single replica without
        remote stages: the same rule as the cache mode's."""
        return bool(self.spec.stages) or membership_can_change(self.spec.membership, self.spec.replicas)

    @property
    def replica_pods(self) -> int:
        """Stage-0 replica pods besides the head: spec.replicas counts engine pods, head included (the
        head pod carries one), and a single engine that is not distributed runs in the head alone."""
        return self.spec.replicas - 1 if self.distributed else 0

    def child_name(self, suffix: str) -> str:
        return f"{self.name}-{suffix}"


def labels(t: Target, role: str | None = None, pool: str | None = None) -> dict[str, str]:
    out = {
        L_NAME: APP_NAME,
        L_INSTANCE: t.name,
        L_MANAGED_BY: MANAGED_BY,
        L_OMNISTAGE: t.name,
    }
    if role:
        out.update(selector_labels(t, role, pool))
    return out


def selector_labels(t: Target, role: str | None = None, pool: str | None = None) -> dict[str, str]:
    pooled = role == ROLE_POOL or pool is not None  # a pool's standby too
    out = {L_OMNISTAGE: t.name, L_COMPONENT: COMPONENT_POOL if pooled else COMPONENT_ENGINE}
    if role:
        out[L_ROLE] = role
    if pool:
        out[L_POOL] = pool
    return out


def selector(t: Target) -> str:
    """The scale subresource's selector: every stage-0 engine pod, head included, as spec.replicas counts
    (standbys and a spare head are not: an HPA averaging over their idle engines would under-count the
    load)."""
    pairs = [f"{k}={v}" for k, v in sorted(selector_labels(t).items())]
    # "notin", not "!=": kubectl scale parses the selector into a LabelSelector, which has no "!=".
    return ",".join([*pairs, f"{L_ROLE} notin ({ROLE_SPARE_HEAD},{ROLE_STANDBY})"])


def pool_selector(t: Target, pool: str) -> str:
    """A pool's scale subresource selector: its pods."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(t, ROLE_POOL, pool).items()))


def metadata(t: Target, name: str, role: str | None = None, annotations: dict[str, str] | None = None,
             extra_labels: dict[str, str] | None = None, pool: str | None = None) -> dict:
    """extra_labels: the pod template's (validation refused the operator's keys among them)."""
    meta: dict[str, Any] = {"name": name, "namespace": t.namespace,
                            "labels": {**labels(t, role, pool), **(extra_labels or {})}}
    if annotations:
        meta["annotations"] = annotations
    if t.uid:
        meta["ownerReferences"] = [{
            "apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "name": t.name, "uid": t.uid,
            "controller": True, "blockOwnerDeletion": True,
        }]
    return meta


def content_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def config_hash(deploy_yaml: str) -> str:
    return hashlib.sha256(deploy_yaml.encode()).hexdigest()[:16]
