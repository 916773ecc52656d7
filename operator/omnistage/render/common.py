"""Names, labels, owner references and hashes shared by every child."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .. import api
from ..api import OmniStagePoolSpec, OmniStageSpec
from ..cachemode import CacheDecision, resolve_cache_mode
from ..podtemplate import L_INSTANCE, L_MANAGED_BY, L_NAME, LABEL_PREFIX
from ..validation import validate_omnistage

L_OMNISTAGE = f"{LABEL_PREFIX}/omnistage"
L_COMPONENT = f"{LABEL_PREFIX}/component"   # COMPONENT_ENGINE or COMPONENT_POOL
L_ROLE = f"{LABEL_PREFIX}/role"             # "head", "replica" or "pool"
L_POOL = f"{LABEL_PREFIX}/pool"             # the OmniStagePool of a pool pod
A_TEMPLATE_HASH = f"{LABEL_PREFIX}/template-hash"
A_CONFIG_HASH = f"{LABEL_PREFIX}/config-hash"
A_HEAD_UID = f"{LABEL_PREFIX}/head-uid"
A_REPLICA_INDEX = f"{LABEL_PREFIX}/replica-index"
A_STAGE_IDS = f"{LABEL_PREFIX}/stage-ids"      # a pool pod's stages ("1,2"): read even after its pool is gone

ROLE_HEAD = "head"
ROLE_REPLICA = "replica"
ROLE_POOL = "pool"
# Stage-0 pods (head and replicas: what the OmniStage's scale selector counts) and the pods of the
# OmniStagePools (stages >= 1, counted by each pool's own selector).
COMPONENT_ENGINE = "engine"
COMPONENT_POOL = "pool"
ENGINE_COMPONENTS = (COMPONENT_ENGINE, COMPONENT_POOL)


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
    """A validated OmniStage: what every renderer takes."""

    name: str
    namespace: str
    uid: str | None
    spec: OmniStageSpec
    cache: CacheDecision
    engine_image: str  # spec.engine.image, else the operator's default

    @property
    def distributed(self) -> bool:
        """Distributed runtime (head + headless replicas) unless a static single replica without
        remote stages."""
        return bool(self.spec.stages) or not (self.spec.membership == api.Membership.STATIC
                                               and self.spec.replicas == 1)

    def child_name(self, suffix: str) -> str:
        return f"{self.name}-{suffix}"


def target_from(obj: dict[str, Any], default_image: str | None = None) -> Target:
    """Validate an OmniStage object; raises validation.InvalidSpec (cache rule included).

    default_image is the engine image when spec.engine.image is unset; None means the operator's
    configuration (api.operator_engine_image: OMNISTAGE_ENGINE_IMAGE, else the built-in default),
    read here so that every renderer stays a pure function of the Target."""
    spec = validate_omnistage(obj)
    meta = obj.get("metadata") or {}
    decision = resolve_cache_mode(spec.cache.mode, spec.membership, spec.replicas, spec.model_kind,
                                  spec.cache.size_gib)
    image = spec.engine.image or default_image or api.operator_engine_image()
    return Target(meta["name"], meta.get("namespace") or "default", meta.get("uid"), spec, decision, image)


def labels(t: Target, role: str | None = None, pool: str | None = None) -> dict[str, str]:
    out = {
        L_NAME: "omnistage",
        L_INSTANCE: t.name,
        L_MANAGED_BY: "omnistage-operator",
        L_OMNISTAGE: t.name,
    }
    if role:
        out.update(selector_labels(t, role, pool))
    return out


def selector_labels(t: Target, role: str | None = None, pool: str | None = None) -> dict[str, str]:
    out = {L_OMNISTAGE: t.name, L_COMPONENT: COMPONENT_POOL if role == ROLE_POOL else COMPONENT_ENGINE}
    if role:
        out[L_ROLE] = role
    if pool:
        out[L_POOL] = pool
    return out


def selector(t: Target) -> str:
    """The scale subresource's selector: every stage-0 engine pod, head included, as spec.replicas counts."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(t).items()))


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
