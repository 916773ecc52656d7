"""The top-level spec models of the OmniStage and the OmniStagePool (their parts: cache_spec.py,
engine_spec.py, pod_specs.py, stage_specs.py; their status models: statuses.py). The CRD in crds/ is
generated from them (crd.py), so a field's description here is what `kubectl explain` prints, and a
rule's message what the API server answers.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field

from .cache_spec import CacheSpec
from .child_names import MAX_OMNISTAGE_NAME
from .engine_spec import EngineSpec
from .model_base import ApiModel
from .pod_specs import DisruptionBudgetSpec, GpuSpec, HeadSpec, ModelVolumeSpec, PlacementSpec, RolloutSpec
from .security import MODEL_PATTERN
from .stage_specs import StageSpec, TransportSpec

# spec.standby's bound: standbys are GPUs held idle; more than this is a second deployment, not a warm spare.
MAX_STANDBY = 16

# Quantity strings as Kubernetes writes them (e.g. 16Gi, 512Mi, 1G).
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|K|M|G|T|P)?$"


class Membership(StrEnum):
    DYNAMIC = "dynamic"
    STATIC = "static"


class ModelKind(StrEnum):
    MULTIMODAL = "multimodal"
    TEXT_ONLY = "text-only"


class OmniStageSpec(ApiModel):
    """Desired state of an OmniStage: one head pod plus replicas-1 headless stage-0 replica pods."""

    model: str = Field(
        min_length=1,
        pattern=MODEL_PATTERN,
        description="Model name or path served by `vllm serve` (e.g. Qwen/Qwen3-Omni-30B-A3B-Instruct, "
        "/models/...): its first argument, so no leading '-', no '$', whitespace or control characters.",
    )
    pipeline: str | None = Field(
        None,
        max_length=128,
        description="vllm-omni pipeline registry key written into the deploy config (e.g. "
        "qwen3_omni_moe_thinker_only). A multi-stage pipeline (e.g. qwen3_omni_moe) needs spec.stages and "
        "OmniStagePools for stages 1..n-1.",
    )
    stages: list[StageSpec] = Field(
        default_factory=list,
        max_length=15,
        description="Every stage after stage 0 of a multi-stage spec.pipeline, ids 1..n-1 in order. Their "
        "replicas run in OmniStagePool pods; the head waits at startup for one replica of each.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"]},
    )
    transport: TransportSpec | None = Field(
        None,
        description="How data moves between stages (with spec.stages; unset: network over TCP from port "
                    "30000).",
    )
    model_kind: ModelKind = Field(
        ModelKind.MULTIMODAL,
        description="multimodal (has a multimodal processor cache) or text-only (no cache to manage).",
    )
    replicas: int = Field(
        1,
        ge=1,
        le=256,
        description="Stage-0 engine replicas, head included (the head pod carries one). Change with `kubectl "
                    "scale`.",
    )
    standby: int = Field(
        0,
        ge=0,
        le=MAX_STANDBY,
        description="Standby replica pods kept beside the stage-0 replicas: started, registered with the "
        "head and attached, but not joined, so the head routes nothing to them. A scale-up (kubectl scale, "
        "an HPA) joins standbys first, a join only, and then starts pods to refill this count. Not counted "
        "in spec.replicas, readyReplicas or the scale subresource. A standby holds its GPUs "
        "(docs/scaling.md: the price). Needs spec.membership dynamic.",
    )
    head: HeadSpec = Field(
        default_factory=HeadSpec,
        json_schema_extra={"default": {}},
        description="The head pod (a warm spare of it).",
    )
    membership: Membership = Field(
        Membership.DYNAMIC,
        description="dynamic: replicas may join and leave at run time (kubectl scale, HPA). static: a fixed "
                    "set.",
    )
    cache: CacheSpec = Field(
        default_factory=CacheSpec,
        json_schema_extra={"default": {}},
        description="Stage-0 multimodal processor cache.",
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec,
        json_schema_extra={"default": {}},
        description="Engine image, parallelism and arguments.",
    )
    gpu: GpuSpec = Field(
        default_factory=GpuSpec,
        json_schema_extra={"default": {}},
        description="GPUs per engine pod and the nodes that have them.",
    )
    placement: PlacementSpec = Field(
        default_factory=PlacementSpec,
        json_schema_extra={"default": {}},
        description="Extra scheduling constraints.",
    )
    shm_size: str = Field(
        "16Gi", pattern=QUANTITY_PATTERN, description="Size of the /dev/shm memory volume of each engine pod."
    )
    model_volume: ModelVolumeSpec | None = Field(None, description="Where the model weights come from.")
    # Sized for the sample's Qwen3-Omni-30B-A3B: ~66 GiB of bf16 weights plus vLLM's compile caches.
    download_volume_size: str = Field(
        "100Gi",
        pattern=QUANTITY_PATTERN,
        description="Without spec.modelVolume each engine pod downloads the weights into its cache emptyDir "
        "(/root/.cache): its sizeLimit and the engine container's ephemeral-storage request, so the "
        "scheduler picks a node with the room and the kubelet evicts a pod that outgrows it instead of "
        "filling the node's disk. Unused with spec.modelVolume.",
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        json_schema_extra={"default": {}},
        description="How a template change replaces replica and pool pods (surge first, within these "
                    "bounds).",
    )
    disruption_budget: DisruptionBudgetSpec = Field(
        default_factory=DisruptionBudgetSpec, json_schema_extra={"default": {}},
        description="The PodDisruptionBudget NAME-replicas over the replica pods.",
    )
    # crd.py replaces this schema by core/v1 PodTemplateSpec's (podtemplate.schema.json).
    template: dict[str, Any] | None = Field(
        None,
        description=(
            "Pod template (core/v1 PodTemplateSpec) merged into the head and replica pods with Kubernetes' "
            "strategic merge: containers merge by name (the engine container is named engine), env and "
            "volumes by name, volumeMounts by mountPath; other lists (tolerations, envFrom...) replace. "
            "spec.placement and spec.engine.env are applied first. Refused: the engine container's command, "
            "args, image, ports, probes and lifecycle hooks, the GPU resource, restartPolicy, the pod's "
            "lifecycle (terminationGracePeriodSeconds, activeDeadlineSeconds), nodeName, system priority "
            "classes, host namespaces, a shared process namespace, scheduling gates, hostPath volumes "
            "outside the operator's allow-list (mounted read-only), volume sources beyond an allow-list, "
            "projected ServiceAccount tokens, the operator's ServiceAccount, privileged containers, "
            "privilege escalation, capabilities beyond IPC_LOCK and SYS_NICE (every container drops the "
            "rest), NVIDIA_* variables and envFrom without a prefix, the operator's Secrets "
            "(NAME-membership), port names, volumes, mount paths, environment variables, labels and "
            "annotations (docs/security.md)."
        ),
    )


# ---- OmniStagePool: the capacity of stages 1..n-1 ---------------------------------------------------

class OmniStagePoolSpec(ApiModel):
    """A group of pods, each running one headless replica of every stage in stageIds, for an
    OmniStage with spec.stages. The pool is the only writer of its replica count (scale subresource)."""

    omni_stage: str = Field(
        min_length=1, max_length=MAX_OMNISTAGE_NAME, description="The OmniStage (same namespace)."
    )
    stage_ids: list[Annotated[int, Field(ge=1, le=15)]] = Field(
        min_length=1,
        max_length=15,
        description="Stages each pod runs, one process per stage, sharing the pod's GPUs (numbered from 0 "
        "for every stage). Every stage >= 1 of the OmniStage belongs to exactly one pool.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    replicas: int = Field(
        1,
        ge=1,
        le=256,
        description="Pods (one replica of each stage per pod); at least 1: the head waits for one replica of "
        "each remote stage. Change with `kubectl scale omnistagepool`.",
    )
    gpu: GpuSpec = Field(
        default_factory=GpuSpec, json_schema_extra={"default": {}}, description="GPUs per pod."
    )
    placement: PlacementSpec = Field(
        default_factory=PlacementSpec,
        json_schema_extra={"default": {}},
        description="Extra scheduling constraints of the pool's pods (instead of the OmniStage's placement; "
        "the OmniStage's spec.template applies to them too).",
    )
    standby: int = Field(
        0,
        ge=0,
        le=MAX_STANDBY,
        description="Standby pods kept beside the pool's pods: started, each stage registered with the head "
        "and attached, but not joined, so the head routes nothing to them. A scale-up of the pool joins "
        "standbys first, a join only, then starts pods to refill this count. Not counted in spec.replicas, "
        "readyReplicas or the scale subresource. A standby holds its GPUs (docs/scaling.md: the price).",
    )
    drain_timeout_seconds: int = Field(
        300,
        ge=0,
        le=3600,
        description="How long a leaving pod's replicas may finish in-flight requests. A downstream replica "
        "is bound to a request for its whole answer (a full audio reply), hence longer than stage 0's "
        "default.",
    )
    disruption_budget: DisruptionBudgetSpec = Field(
        default_factory=DisruptionBudgetSpec, json_schema_extra={"default": {}},
        description="The PodDisruptionBudget POOL-pool over the pool's pods.")
