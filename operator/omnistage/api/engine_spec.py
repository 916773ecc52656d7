"""spec.engine: how the vllm-omni engine runs in the head and replica pods, and the engine image an
OmniStage that names none gets."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any

from omnistage_engine_patches import contract
from pydantic import Field

from .model_base import ApiModel

# The engine image of OmniStages that leave spec.engine.image unset comes from the operator's
# configuration, never from a CRD default: a default is written into every stored object, so an
# operator upgrade would never move them. `omnistage run --engine-image` sets the variable, the
# install manifests set it to the engine image released with the operator, and without it (e.g.
# `omnistage render` on a laptop) the built-in default below applies.
ENGINE_IMAGE_ENV = "OMNISTAGE_ENGINE_IMAGE"
DEFAULT_ENGINE_IMAGE = "ghcr.io/omnistage/omnistage-engine:0.1.0"


def operator_engine_image(environ: Mapping[str, str] = os.environ) -> str:
    """The engine image the operator renders when spec.engine.image is unset."""
    return (environ.get(ENGINE_IMAGE_ENV) or "").strip() or DEFAULT_ENGINE_IMAGE


class EnvVar(ApiModel):
    name: str = Field(min_length=1, description="Environment variable name.")
    value: str = Field("", description="Environment variable value (empty when valueFrom is set).")
    # crd.py replaces this schema by core/v1 EnvVarSource's (podtemplate.schema.json).
    value_from: dict[str, Any] | None = Field(
        None,
        description="Source of the value (core/v1 EnvVarSource: secretKeyRef, configMapKeyRef, fieldRef, "
        "resourceFieldRef), e.g. HF_TOKEN from a Secret.",
    )


# Bounds the cost of the CEL rules over spec.engine.extraArgs (a JSON-valued flag fits many times over).
MAX_ARG_LENGTH = 65536


class EngineSpec(ApiModel):
    """How the vllm-omni engine runs in the head and replica pods."""

    image: str | None = Field(
        None,
        min_length=1,
        description=(
            "Engine image with vllm 0.30.0, vllm-omni 0.30.0 and this project's engine_patches plugin. "
            f"Unset: the operator's default ({ENGINE_IMAGE_ENV} of the operator, else "
            f"{DEFAULT_ENGINE_IMAGE}), so upgrading the operator moves the OmniStage to its engine image; "
            "status.engineImage shows the one in use."
        ),
    )
    image_pull_policy: str | None = Field(
        None,
        pattern="^(Always|IfNotPresent|Never)$",
        description="Image pull policy of the engine containers.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs per engine replica (stage-0 tensor_parallel_size)."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of each GPU's memory vLLM may use (0 < x <= 1)."
    )
    max_num_seqs: int | None = Field(None, ge=1, description="Maximum concurrent sequences per replica.")
    max_model_len: int | None = Field(None, ge=1, description="Maximum model context length.")
    enable_prefix_caching: bool | None = Field(
        None, description="Enable vLLM prefix caching (unset: vLLM default)."
    )
    log_stats: bool = Field(
        True, description="Record engine statistics (per-replica Prometheus series on the head)."
    )
    http_port: int = Field(
        8000, ge=1, le=65535, description="Port of the head's OpenAI API (open to every client)."
    )
    membership_port: int = Field(
        contract.DEFAULT_MEMBERSHIP_PORT, ge=1, le=65535,
        description=(
            "Port of the head's membership endpoint (join, leave, the listing and the engine report; bearer "
            "tokens): the operator and the OmniStage's own pods reach it, nobody else (NetworkPolicy)."
        ),
    )
    master_port: int = Field(
        25000,
        ge=1,
        le=65535,
        description="Port of the head's replica registration socket (--omni-master-port).",
    )
    drain_timeout_seconds: int = Field(
        30,
        ge=0,
        le=3600,
        description="How long a leaving replica may finish in-flight requests before it is detached and "
                    "deleted.",
    )
    heartbeat_timeout_seconds: int = Field(
        30,
        ge=5,
        le=590,
        description=(
            "Seconds a stage engine's heartbeats may be late before the head's coordinator marks it silent "
            "and stops routing to it (vllm-omni's omni_heartbeat_timeout; default 30, its own). Lower finds "
            "a truly dead replica sooner but raises false alarms on a busy or paused node; a silent engine "
            "is kept and routable again when its heartbeats resume (engine_liveness patch). Below 600: the "
            "coordinator forgets an engine silent that long, and the head then detaches it."
        ),
    )
    startup_timeout_seconds: int = Field(
        1800,
        ge=60,
        description="How long the head may take to load the model before its startup probe fails.",
    )
    extra_args: list[Annotated[str, Field(max_length=MAX_ARG_LENGTH)]] = Field(
        default_factory=list,
        max_length=64,
        description=(
            "Extra arguments for `vllm serve` on head and replicas. Flags the operator sets (membership, "
            "ports, the multimodal cache, the stage config) are refused in every spelling vLLM accepts, and "
            "so is $( (Kubernetes would expand $(VAR) into the variable's value)."
        ),
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description=(
            "Extra environment variables of the engine container (value or valueFrom), applied before "
            "spec.template. VLLM_PLUGINS, POD_IP, VLLM_HOST_IP and OMNISTAGE_* belong to the operator."
        ),
    )
    stage_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Extra keys merged into stage 0 of the rendered vllm-omni deploy config (e.g. "
            "max_num_batched_tokens). Cache and replica keys and the operator's environment variables are "
            "refused at any depth."
        ),
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

