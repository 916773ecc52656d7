"""The spec models of the OmniStage and the OmniStagePool, and the defaults their fields cite (their
status models: statuses.py). The CRD in crds/ is generated from them (crd.py), so a field's
description here is what `kubectl explain` prints, and a rule's message what the API server answers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any

from omnistage_engine_patches import contract
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from .child_names import MAX_OMNISTAGE_NAME
from .security import (
    ALLOWED_HOST_PATHS_ENV,
    GPU_RESOURCE,
    HOST_PATH,
    MAX_PATH_LENGTH,
    MAX_RESOURCE_NAME_LENGTH,
    MODEL_PATTERN,
    PLACEMENT_PRIORITY,
)

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


# Quantity strings as Kubernetes writes them (e.g. 16Gi, 512Mi, 1G).
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|K|M|G|T|P)?$"


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_enum_values=True,
        validate_default=True,
    )


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


class Membership(StrEnum):
    DYNAMIC = "dynamic"
    STATIC = "static"


class ModelKind(StrEnum):
    MULTIMODAL = "multimodal"
    TEXT_ONLY = "text-only"


class CacheSpec(_Model):
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


class EnvVar(_Model):
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


class EngineSpec(_Model):
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


class GpuSpec(_Model):
    """The GPUs each engine pod requests and the nodes that have them."""

    resource: Annotated[str, AfterValidator(GPU_RESOURCE.check)] = Field(
        "nvidia.com/gpu",
        min_length=1,
        max_length=MAX_RESOURCE_NAME_LENGTH,
        json_schema_extra=GPU_RESOURCE.schema(),
        description="Extended resource name of the GPU: DOMAIN/gpu of a GPU vendor (nvidia.com/gpu, "
        "amd.com/gpu), nvidia.com/gpu.shared or an NVIDIA MIG slice (nvidia.com/mig-3g.71gb).",
    )
    count: int = Field(1, ge=1, description="GPUs per engine pod; at least engine.tensorParallelSize.")
    product: str = Field("NVIDIA-H200", min_length=1, description="GPU product the pods must run on.")
    product_label: str = Field(
        "nvidia.com/gpu.product", min_length=1,
        description="Node label that carries the GPU product (set by NVIDIA GPU feature discovery).",
    )


class PlacementSpec(_Model):
    """Extra scheduling constraints for every engine pod: shorthand for the same fields of spec.template.spec
    (tolerations, affinity, priorityClassName and schedulerName in one of the two places only)."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Extra node labels; merged with the GPU product selector."
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra tolerations (core/v1 Toleration); a toleration for the GPU resource taint is "
                    "always added.",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )
    affinity: dict[str, Any] | None = Field(
        None, description="Pod affinity (core/v1 Affinity).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    priority_class_name: Annotated[str | None, AfterValidator(PLACEMENT_PRIORITY.check)] = Field(
        None, json_schema_extra=PLACEMENT_PRIORITY.schema(),
        description="PriorityClass of the engine pods (not system-node-critical or system-cluster-critical).")
    scheduler_name: str | None = Field(None, description="Scheduler of the engine pods.")


class PvcSource(_Model):
    claim_name: str = Field(min_length=1, description="PersistentVolumeClaim holding the model weights.")
    read_only: bool = Field(True, description="Mount the claim read-only.")


class HostPathSource(_Model):
    path: Annotated[str, AfterValidator(HOST_PATH.check)] = Field(
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        pattern="^/",
        json_schema_extra=HOST_PATH.schema(),
        description="Absolute directory on the node with the weights, mounted read-only. The operator "
        f"mounts only directories its administrator allows ({ALLOWED_HOST_PATHS_ENV}, none by default; "
        "docs/security.md).",
    )


class ModelVolumeSpec(_Model):
    """Where the weights come from. Without it the engine downloads into an emptyDir."""

    mount_path: str = Field(
        "/models", pattern="^/", description="Where the weights are mounted in the engine pods."
    )
    pvc: PvcSource | None = Field(None, description="Mount a PersistentVolumeClaim.")
    host_path: HostPathSource | None = Field(
        None, description="Mount a directory of the node (one the operator's administrator allows).")


class StageEngineSpec(_Model):
    """A remote stage's engine settings; unset ones keep the pipeline's shipped deploy config."""

    tensor_parallel_size: int | None = Field(None, ge=1, description="GPUs per replica of this stage.")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of each GPU's memory this stage may use; stages sharing a pod's GPU "
        "split it (the shipped Qwen3-Omni layout: talker 0.6, code2wav 0.1).",
    )
    max_num_seqs: int | None = Field(
        None, ge=1, description="Maximum concurrent sequences per replica of this stage."
    )
    max_model_len: int | None = Field(None, ge=1, description="Maximum context length of this stage.")
    stage_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keys merged into this stage of the rendered deploy config (as "
        "spec.engine.stageOverrides for stage 0; the same keys are refused).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class StageSpec(_Model):
    """One stage after stage 0. Its settings are the pipeline's config (one ConfigMap: changing them rolls
    the head and every pod); its capacity is an OmniStagePool's."""

    id: int = Field(ge=1, le=15, description="Stage id in the pipeline (1..n-1, in order).")
    name: str | None = Field(
        None, max_length=63, description="The pipeline's name for the stage (e.g. talker); checked when set.")
    engine: StageEngineSpec = Field(
        default_factory=StageEngineSpec,
        json_schema_extra={"default": {}},
        description="Engine settings of the stage.",
    )


class TransportMode(StrEnum):
    NETWORK = "network"  # stages in any pods, on any nodes: NIXL over UCX
    SAME_NODE = (
        "sameNode"  # every engine pod on one node, one shared /dev/shm: the shipped SharedMemoryConnector
    )


class TransportProtocol(StrEnum):
    # UCX picks TCP or RDMA from its environment (UCX_TLS, UCX_NET_DEVICES), not from the connector
    # spec: the deploy config is the same for both; the pods' environment differs.
    TCP = "tcp"
    RDMA = "rdma"


# A connector port is basePort + purpose offset (0, 100, 200) + 16 * local rank + from_stage
# (vllm-omni initialization.py:48-80); the replica-id term is 0 with one replica per pod (the
# connector_ports patch). So basePort..basePort+1023 holds every port a pod's connectors bind.
CONNECTOR_PORT_SPAN = 1024


class TransportSpec(_Model):
    """How stage k's outputs reach stage k+1 (multi-stage pipelines only)."""

    mode: TransportMode = Field(
        TransportMode.NETWORK,
        description="network: NixlConnector (UCX) on every edge, engine pods on any nodes. sameNode: the "
        "pipeline's shipped SharedMemoryConnector; every engine pod on the head's node, sharing a host "
        "directory as /dev/shm (needs a namespace that allows hostPath volumes).",
    )
    protocol: TransportProtocol = Field(
        TransportProtocol.TCP,
        description="tcp or rdma (network only). tcp sets UCX_TLS=tcp,sm,self unless env sets UCX_TLS; rdma "
        "leaves UCX to pick the RDMA device (give the pods the NIC resource and IPC_LOCK through "
        "spec.template).",
    )
    base_port: int = Field(
        30000,
        ge=1024,
        le=65536 - CONNECTOR_PORT_SPAN,
        description="First connector port; each engine pod's connectors bind "
                    f"basePort..basePort+{CONNECTOR_PORT_SPAN - 1}.",
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=64,
        description="Environment of every engine pod for the transport (UCX_TLS, UCX_NET_DEVICES, ...).")


class RolloutSpec(_Model):
    """How replica and pool pods are replaced when their pod template changes."""

    max_surge: int = Field(
        1,
        ge=0,
        le=256,
        description="Replacement pods a roll may create beyond the desired count before an outdated pod "
        "leaves: each outdated pod is drained only once enough others are joined. When no GPU is free for a "
        "surge pod (it stays unschedulable), condition RolloutSurge says so and the roll goes one pod at a "
        "time. 0: no surge, one pod at a time (as with maxUnavailable 1).",
    )
    max_unavailable: int = Field(
        0,
        ge=0,
        le=256,
        description="How many fewer replicas than desired may serve during a roll. 0: never fewer than "
        "spec.replicas while a surge pod fits.",
    )


class DisruptionBudgetSpec(_Model):
    """The PodDisruptionBudget the operator renders over the replica pods (a pool: its pods)."""

    max_unavailable: int = Field(
        1,
        ge=1,
        le=256,
        description="How many replica pods voluntary disruptions (the eviction API: kubectl drain, the "
        "cluster autoscaler) may take out of serving at once. Not the head: one head cannot be protected "
        "without blocking every drain of its node.",
    )


class OmniStageSpec(_Model):
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
            "classes, host namespaces, hostPath volumes, privileged containers, privilege escalation, "
            "capabilities beyond IPC_LOCK and SYS_NICE, the operator's Secrets (NAME-membership), volumes, "
            "mount paths, environment variables, labels and annotations (docs/security.md)."
        ),
    )


# ---- OmniStagePool: the capacity of stages 1..n-1 ---------------------------------------------------

class OmniStagePoolSpec(_Model):
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
