"""Names, labels, owner references and hashes shared by every child."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .. import api
from ..api import OmniStageSpec
from ..cachemode import CacheDecision, resolve_cache_mode
from ..podtemplate import L_INSTANCE, L_MANAGED_BY, L_NAME, LABEL_PREFIX
from ..validation import validate_omnistage

L_OMNISTAGE = f"{LABEL_PREFIX}/omnistage"
L_COMPONENT = f"{LABEL_PREFIX}/component"   # "engine" for every stage-0 pod: what the scale selector counts
L_ROLE = f"{LABEL_PREFIX}/role"             # "head" or "replica"
A_TEMPLATE_HASH = f"{LABEL_PREFIX}/template-hash"
A_CONFIG_HASH = f"{LABEL_PREFIX}/config-hash"
A_HEAD_UID = f"{LABEL_PREFIX}/head-uid"
A_REPLICA_INDEX = f"{LABEL_PREFIX}/replica-index"

ROLE_HEAD = "head"
ROLE_REPLICA = "replica"


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
        """Distributed runtime (head + headless replicas) unless a static single replica."""
        return not (self.spec.membership == api.Membership.STATIC and self.spec.replicas == 1)

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


def labels(t: Target, role: str | None = None) -> dict[str, str]:
    out = {
        L_NAME: "omnistage",
        L_INSTANCE: t.name,
        L_MANAGED_BY: "omnistage-operator",
        L_OMNISTAGE: t.name,
    }
    if role:
        out[L_COMPONENT] = "engine"
        out[L_ROLE] = role
    return out


def selector_labels(t: Target, role: str | None = None) -> dict[str, str]:
    out = {L_OMNISTAGE: t.name, L_COMPONENT: "engine"}
    if role:
        out[L_ROLE] = role
    return out


def selector(t: Target) -> str:
    """The scale subresource's selector: every stage-0 engine pod, head included, as spec.replicas counts."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(t).items()))


def metadata(t: Target, name: str, role: str | None = None, annotations: dict[str, str] | None = None,
             extra_labels: dict[str, str] | None = None) -> dict:
    """extra_labels: the pod template's (validation refused the operator's keys among them)."""
    meta: dict[str, Any] = {"name": name, "namespace": t.namespace, "labels": {**labels(t, role), **(extra_labels or {})}}
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
