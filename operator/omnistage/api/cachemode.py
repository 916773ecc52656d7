"""The stage-0 cache-mode rule: the heart of the operator, one pure function.

vLLM's sender caches (lru, shm) omit a tensor from IPC when the frontend has seen the media
before, assuming the receiving engine still holds it. That holds for one fixed replica only:
once a second replica exists, or may join later, a request can land on a replica that never
received the tensor and fails with an empty 200. So whenever membership can change the
frontend must use the processor-only cache, which always sends the full tensor, or the opt-in
replica-aware mode, which decides per replica after the replica is chosen (`auto` never picks it
until it has run on GPUs: docs/cache-modes.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage_engine_patches import contract

from .cache_spec import CacheMode, EffectiveCacheMode
from .specs import Membership, ModelKind

SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP = (
    f"spec.cache.mode {' and '.join(contract.SENDER_CACHE_MODES)} need membership: static and replicas: 1: "
    "a replica that joins or is routed to misses tensors the frontend omitted. Use cache.mode auto or "
    "processor-only"
)


class CacheModeRejected(ValueError):
    field = "spec.cache.mode"


@dataclass(frozen=True)
class CacheDecision:
    mode: EffectiveCacheMode
    reason: str


def membership_can_change(membership: str, replicas: int) -> bool:
    return membership == Membership.DYNAMIC or replicas > 1


def resolve_cache_mode(requested: str, membership: str, replicas: int, model_kind: str,
                       size_gib: float = 4) -> CacheDecision:
    """Resolve spec.cache.mode; raises CacheModeRejected for a sender cache with changing membership.

    An explicit lru/shm with dynamic membership is rejected rather than accepted with a warning:
    the failure it causes is silent (HTTP 200, empty content), so a warning would be missed.
    A size of 0 is a disabled cache whatever the mode: vLLM builds none, and the status must say
    what the engine builds.
    """
    dynamic = membership_can_change(membership, replicas)
    if requested in contract.SENDER_CACHE_MODES and dynamic:
        raise CacheModeRejected(SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP)
    if model_kind == ModelKind.TEXT_ONLY:
        return CacheDecision(
            EffectiveCacheMode.NOT_APPLICABLE, "text-only model: no multimodal processor cache"
        )
    if requested == CacheMode.DISABLED:
        return CacheDecision(EffectiveCacheMode.DISABLED, "cache disabled in spec")
    if size_gib == 0:
        return CacheDecision(EffectiveCacheMode.DISABLED, "cache.sizeGiB is 0: no cache")
    if requested == CacheMode.PROCESSOR_ONLY:
        return CacheDecision(EffectiveCacheMode.PROCESSOR_ONLY, "processor-only requested in spec")
    if requested == CacheMode.REPLICA_AWARE:
        return CacheDecision(EffectiveCacheMode.REPLICA_AWARE,
                             "replica-aware requested in spec: tensors omitted per replica, after the pick")
    if requested == CacheMode.AUTO:
        if dynamic:
            why = "membership is dynamic" if membership == Membership.DYNAMIC else f"{replicas} replicas"
            return CacheDecision(
                EffectiveCacheMode.PROCESSOR_ONLY, f"auto: {why}, replicas can join or leave"
            )
        return CacheDecision(EffectiveCacheMode.LRU, "auto: static single replica keeps the sender cache")
    return CacheDecision(EffectiveCacheMode(requested), f"{requested} requested for a static single replica")
