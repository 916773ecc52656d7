"""spec.cache: the stage-0 multimodal processor cache a user asks for, and the modes the operator
resolves it to (the rule that resolves it: cachemode.py)."""

from __future__ import annotations

from enum import StrEnum

from omnistage_engine_patches import contract
from pydantic import Field

from .model_base import ApiModel


# The cache modes' spellings are the contract's: the engine report names the mode its frontend built
# in the same words, and engine_truth compares the two.
class CacheMode(StrEnum):
    AUTO = "auto"
    PROCESSOR_ONLY = contract.CACHE_PROCESSOR_ONLY
    # opt-in: processor-only plus per-replica mirrors (docs/cache-modes.md)
    REPLICA_AWARE = contract.CACHE_REPLICA_AWARE
    LRU = contract.CACHE_LRU
    SHM = contract.CACHE_SHM
    DISABLED = contract.CACHE_DISABLED


class EffectiveCacheMode(StrEnum):
    PROCESSOR_ONLY = contract.CACHE_PROCESSOR_ONLY
    REPLICA_AWARE = contract.CACHE_REPLICA_AWARE
    LRU = contract.CACHE_LRU
    SHM = contract.CACHE_SHM
    DISABLED = contract.CACHE_DISABLED
    NOT_APPLICABLE = contract.CACHE_NOT_APPLICABLE  # text-only models have no multimodal cache


class CacheSpec(ApiModel):
    """The stage-0 multimodal processor cache."""

    mode: CacheMode = Field(
        CacheMode.AUTO,
        description=(
            "Frontend multimodal cache. auto: processor-only whenever replicas can join or leave (membership "
            "dynamic or replicas > 1), else lru. processor-only: the frontend keeps processed items and "
            "always sends full tensors to the replica. replica-aware (opt-in): processor-only on the "
            "frontend, and a tensor is left out only for a replica known to hold it (a per-replica mirror of "
            "its receiver cache, decided after the replica is chosen); allowed with any membership. lru/shm: "
            "vLLM's sender caches, which omit tensors the frontend believes the replica holds; only valid "
            "for membership static with 1 replica (shm is same-host only). disabled: no frontend cache."
        ),
    )
    size_gib: float = Field(
        4,
        ge=0,
        alias="sizeGiB",
        description="Cache size in GiB per process (mm_processor_cache_gb). 0 disables the cache.",
    )
