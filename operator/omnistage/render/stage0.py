"""Stage 0's entry of the deploy config (the head's and every stage-0 replica's) and the keys every
stage shares: the parts of render/config.py that render/stages.py builds a whole pipeline from."""

from __future__ import annotations

from typing import Any

from omnistage_engine_patches import contract

from ..api import EffectiveCacheMode
from .common import Target


def _cache_keys(mode: str, size_gib: float) -> dict[str, Any]:
    """Stage-0 cache settings. processor-only has no vLLM 0.30.0 knob: the config keeps an lru
    size (the processor-only cache and the replicas' receiver caches are sized by it) and the
    engine plugin swaps the frontend to MultiModalProcessorOnlyCache (OMNISTAGE_FRONTEND_CACHE).
    replica-aware renders the same keys: its per-replica mirrors take their capacity from that
    size, which is what each replica's receiver cache is built with."""
    if mode == EffectiveCacheMode.NOT_APPLICABLE:
        return {}
    record = contract.CACHE_MODES[mode]
    if record.vllm_cache_type is None or size_gib == 0:
        return {"mm_processor_cache_gb": 0}
    # The processor-only frontends have no vLLM knob: they keep the lru size the plugin builds on.
    return {"mm_processor_cache_gb": size_gib,
            "mm_processor_cache_type": record.vllm_cache_type if record.sender else "lru"}


# Engine settings with one name in EngineSpec, StageEngineSpec and the deploy YAML; unset
# (None) ones are left out, so a stage keeps what its shipped deploy config says.
ENGINE_KEYS = ("tensor_parallel_size", "gpu_memory_utilization", "max_num_seqs", "max_model_len")


def engine_keys(e: Any) -> dict[str, Any]:
    return {k: getattr(e, k) for k in ENGINE_KEYS if getattr(e, k) is not None}


def pod_devices(count: int) -> str:
    """A stage's `devices`: the pod's own GPUs, which the device plugin numbers from 0 in every pod."""
    return ",".join(str(i) for i in range(count))


def stage0_deploy(t: Target) -> dict[str, Any]:
    """The stage-0 entry of `stages:`, the head's and every stage-0 replica's."""
    e = t.spec.engine
    stage0: dict[str, Any] = {
        "stage_id": 0,
        # The head's own replica; headless replicas join through registration, so the head
        # never waits for them at startup and kubectl scale needs no config change.
        "num_replicas": 1,
        "devices": pod_devices(t.spec.gpu.count),
        **engine_keys(e),
    }
    stage0.update(_cache_keys(t.cache.mode, t.spec.cache.size_gib))
    stage0.update(e.stage_overrides)
    return stage0


def pipeline_keys(t: Target) -> dict[str, Any]:
    """Top-level keys vllm-omni applies to every stage."""
    keys: dict[str, Any] = {"distributed_executor_backend": "mp"}
    if t.spec.engine.enable_prefix_caching is not None:
        keys["enable_prefix_caching"] = t.spec.engine.enable_prefix_caching
    return keys
