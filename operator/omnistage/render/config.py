"""The vllm-omni deploy config: one YAML for the head, its replicas and every stage's pods, as
vllm-omni requires (a headless replica resolves the same file locally; the head's plan stays
authoritative). Stage 0 alone (render/stage0.py), or the whole pipeline with spec.stages
(render/stages.py)."""

from __future__ import annotations

from typing import Any

import yaml

from ..api.podtemplate import CONFIG_DIR
from ..names import A_CONFIG_HASH, A_EFFECTIVE_CACHE_MODE
from .common import Target, config_hash, metadata
from .stage0 import pipeline_keys, stage0_deploy
from .stages import render_pipeline_deploy_config

CONFIG_KEY = "deploy.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"


def render_deploy_config(t: Target) -> dict[str, Any]:
    if t.spec.stages:
        return render_pipeline_deploy_config(t)
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
            A_CONFIG_HASH: config_hash(text),
            A_EFFECTIVE_CACHE_MODE: str(t.cache.mode),
        }),
        "data": {CONFIG_KEY: text},
    }
