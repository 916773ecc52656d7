"""The OmniStage API (group serving.omnistage.io, version v1alpha1): its identity here, its models in
specs.py and the parts it is made of (cache_spec.py, engine_spec.py, pod_specs.py, stage_specs.py:
what a user writes) and statuses.py (what the operator reports).

The spec models are re-exported here, so `from omnistage.api import OmniStageSpec` is the one import
callers use; the status models are imported as `api.statuses`.
"""

from __future__ import annotations

from collections.abc import Iterable

from .. import names
from .cache_spec import CacheMode, CacheSpec, EffectiveCacheMode
from .engine_spec import DEFAULT_ENGINE_IMAGE, ENGINE_IMAGE_ENV, EngineSpec, EnvVar, operator_engine_image
from .pod_specs import (
    DisruptionBudgetSpec,
    GpuSpec,
    HostPathSource,
    ModelVolumeSpec,
    PlacementSpec,
    PvcSource,
    RolloutSpec,
)
from .specs import Membership, ModelKind, OmniStagePoolSpec, OmniStageSpec
from .stage_specs import StageEngineSpec, StageSpec, TransportMode, TransportProtocol, TransportSpec

GROUP = names.GROUP  # defined with the labels under it; the API's identity (group, version, kinds) reads here
VERSION = "v1alpha1"
KIND = "OmniStage"
PLURAL = "omnistages"
SINGULAR = "omnistage"
SHORT_NAMES = ["ost"]
POOL_KIND = "OmniStagePool"
POOL_PLURAL = "omnistagepools"
POOL_SINGULAR = "omnistagepool"
POOL_SHORT_NAMES = ["osp"]


def either(values: Iterable[object]) -> str:
    """"a, b or c": a description's list of the values a field takes."""
    words = [str(v) for v in values]
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else "".join(words)


__all__ = [
    "DEFAULT_ENGINE_IMAGE", "ENGINE_IMAGE_ENV", "GROUP", "KIND", "PLURAL", "POOL_KIND", "POOL_PLURAL",
    "POOL_SHORT_NAMES", "POOL_SINGULAR", "SHORT_NAMES", "SINGULAR", "VERSION",
    "CacheMode", "CacheSpec", "DisruptionBudgetSpec", "EffectiveCacheMode", "EngineSpec", "EnvVar", "GpuSpec",
    "HostPathSource", "Membership", "ModelKind", "ModelVolumeSpec", "OmniStagePoolSpec", "OmniStageSpec",
    "PlacementSpec", "PvcSource", "RolloutSpec", "StageEngineSpec", "StageSpec", "TransportMode",
    "TransportProtocol", "TransportSpec", "either", "operator_engine_image",
]
