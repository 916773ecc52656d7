"""What every renderer takes: a validated OmniStage (Target), refused when its children could not
be written. The spec's rules are api/validation.py's; one more depends on rendering: the deploy
config must fit in its ConfigMap, which the API server caps at 1 MiB. Without this check a 1.1 MB
spec.engine.stageOverrides (the OmniStage itself may be 1.5 MiB) made every pass fail on the
ConfigMap's apply; refused here, it is an InvalidSpec like any other: a condition and an Event,
and nothing running is touched."""

from __future__ import annotations

from typing import Any

import yaml

from .. import api
from ..api.cachemode import resolve_cache_mode
from ..api.conditions import Reason
from ..api.security import operator_namespace
from ..api.validation import DEFAULT_NAMESPACE, InvalidSpec, validate_omnistage
from .common import Target
from .config import render_configmap

# What the API server lets a ConfigMap's data and binaryData hold, keys and values together, in bytes
# (k8s.io/kubernetes pkg/apis/core/validation: MaxConfigMapSize... core.MaxSecretSize, 1 MiB).
CONFIGMAP_LIMIT = 1024 * 1024


def target_from(obj: dict[str, Any], default_image: str | None = None) -> Target:
    """Validate an OmniStage object; raises validation.InvalidSpec (cache rule and config size included).

    default_image is the engine image when spec.engine.image is unset; None means the operator's
    configuration (api.operator_engine_image: OMNISTAGE_ENGINE_IMAGE, else the built-in default),
    read here so that every renderer stays a pure function of the Target."""
    spec = validate_omnistage(obj)
    meta = obj.get("metadata") or {}
    decision = resolve_cache_mode(spec.cache.mode, spec.membership, spec.replicas, spec.model_kind,
                                  spec.cache.size_gib)
    image = spec.engine.image or default_image or api.operator_engine_image()
    t = Target(meta["name"], meta.get("namespace") or DEFAULT_NAMESPACE, meta.get("uid"), spec, decision,
               image, operator_namespace())
    problem = config_size_problem(t)
    if problem is not None:
        raise InvalidSpec([problem], Reason.CONFIG_TOO_LARGE)
    return t


def configmap_bytes(cm: dict[str, Any]) -> int:
    """A ConfigMap's size as the API server counts it: every key and value of data and binaryData."""
    return sum(len(k.encode()) + len(v.encode()) for part in ("data", "binaryData")
               for k, v in (cm.get(part) or {}).items())


def config_size_problem(t: Target) -> tuple[str, str] | None:
    """(the field that makes the deploy config too big for its ConfigMap, why), or None when it fits."""
    cm = render_configmap(t)
    size = configmap_bytes(cm)
    if size <= CONFIGMAP_LIMIT:
        return None
    # The stage overrides are the free-form part of the config: name the biggest.
    overrides = {
        "spec.engine.stageOverrides": t.spec.engine.stage_overrides,
        **{f"spec.stages[{i}].stageOverrides": s.stage_overrides for i, s in enumerate(t.spec.stages)},
    }
    field, biggest = max(overrides.items(), key=lambda kv: len(yaml.safe_dump(kv[1] or {})))
    return field, (
        f"the rendered deploy config (ConfigMap {cm['metadata']['name']}) is {size:,} bytes, over the "
        f"{CONFIGMAP_LIMIT:,} bytes (1 MiB) the API server lets a ConfigMap hold; {field} makes "
        f"{len(yaml.safe_dump(biggest or {})):,} bytes of it: shrink it (vLLM's own defaults need no "
        "override; large data belongs in the model directory or a volume)"
    )
