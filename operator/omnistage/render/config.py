"""The vllm-omni deploy config: one YAML for head and replicas, as vllm-omni requires
(a headless replica resolves the same file locally; the head's plan stays authoritative)."""

from __future__ import annotations

from typing import Any

import yaml

from ..api import EffectiveCacheMode
from ..podtemplate import CONFIG_DIR
from .common import Target, config_hash, metadata

CONFIG_KEY = "deploy.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"


def _cache_keys(mode: str, size_gib: float) -> dict[str, Any]:
    """Stage-0 cache settings. processor-only has no vLLM 0.30.0 knob: the config keeps an lru
    size (the processor-only cache and the replicas' receiver caches are sized by it) and the
    engine plugin swaps the frontend to MultiModalProcessorOnlyCache (OMNISTAGE_FRONTEND_CACHE).
    replica-aware renders the same keys: its per-replica mirrors take their capacity from that
    size, which is what each replica's receiver cache is built with."""
    if mode == EffectiveCacheMode.NOT_APPLICABLE:
        return {}
    if mode == EffectiveCacheMode.DISABLED or size_gib == 0:
        return {"mm_processor_cache_gb": 0}
    sender = "shm" if mode == EffectiveCacheMode.SHM else "lru"
    return {"mm_processor_cache_gb": size_gib, "mm_processor_cache_type": sender}


# Engine settings with one name in EngineSpec, render/stages.StageEngine and the deploy YAML; unset
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


def render_deploy_config(t: Target) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if t.spec.pipeline:
        config["pipeline"] = t.spec.pipeline
    config.update(pipeline_keys(t))
    config["stages"] = [stage0_deploy(t)]
    return config


def deploy_yaml(t: Target) -> str:
    return yaml.safe_dump(render_deploy_config(t), sort_keys=False)


def render_configmap(t: Target) -> dict[str, Any]:
    text = deploy_yaml(t)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(t, t.child_name("config"), annotations={
            "serving.omnistage.io/config-hash": config_hash(text),
            "serving.omnistage.io/effective-cache-mode": str(t.cache.mode),
        }),
        "data": {CONFIG_KEY: text},
    }
