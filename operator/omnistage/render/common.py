"""Names, labels, owner references and hashes shared by every child."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .. import api
from ..api import OmniStageSpec
from ..cachemode import CacheDecision, resolve_cache_mode
from ..validation import validate_omnistage

LABEL_PREFIX = api.GROUP
L_NAME = "app.kubernetes.io/name"
L_INSTANCE = "app.kubernetes.io/instance"
L_MANAGED_BY = "app.kubernetes.io/managed-by"
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

    @property
    def distributed(self) -> bool:
        """Distributed runtime (head + headless replicas) unless a static single replica."""
        return not (self.spec.membership == api.Membership.STATIC and self.spec.replicas == 1)

    def child_name(self, suffix: str) -> str:
        return f"{self.name}-{suffix}"


def target_from(obj: dict[str, Any]) -> Target:
    """Validate an OmniStage object; raises validation.InvalidSpec (cache rule included)."""
    spec = validate_omnistage(obj)
    meta = obj.get("metadata") or {}
    decision = resolve_cache_mode(spec.cache.mode, spec.membership, spec.replicas, spec.model_kind,
                                  spec.cache.size_gib)
    return Target(meta["name"], meta.get("namespace") or "default", meta.get("uid"), spec, decision)


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


def metadata(t: Target, name: str, role: str | None = None, annotations: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": t.namespace, "labels": labels(t, role)}
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
