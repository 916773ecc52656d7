"""Where the engine pods run and what they mount (spec.gpu, spec.placement, spec.modelVolume), and
how they are replaced and disrupted (spec.rollout, spec.disruptionBudget); a pool's pods take the
same models."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field

from .model_base import ApiModel
from .security import (
    ALLOWED_HOST_PATHS_ENV,
    GPU_RESOURCE,
    HOST_PATH,
    MAX_PATH_LENGTH,
    MAX_RESOURCE_NAME_LENGTH,
    PLACEMENT_PRIORITY,
)


class GpuSpec(ApiModel):
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


class PlacementSpec(ApiModel):
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


class PvcSource(ApiModel):
    claim_name: str = Field(min_length=1, description="PersistentVolumeClaim holding the model weights.")
    read_only: bool = Field(True, description="Mount the claim read-only.")


class HostPathSource(ApiModel):
    path: Annotated[str, AfterValidator(HOST_PATH.check)] = Field(
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        pattern="^/",
        json_schema_extra=HOST_PATH.schema(),
        description="Absolute directory on the node with the weights, mounted read-only. The operator "
        f"mounts only directories its administrator allows ({ALLOWED_HOST_PATHS_ENV}, none by default; "
        "docs/security.md).",
    )


class ModelVolumeSpec(ApiModel):
    """Where the weights come from. Without it the engine downloads into an emptyDir."""

    mount_path: str = Field(
        "/models", pattern="^/", description="Where the weights are mounted in the engine pods."
    )
    pvc: PvcSource | None = Field(None, description="Mount a PersistentVolumeClaim.")
    host_path: HostPathSource | None = Field(
        None, description="Mount a directory of the node (one the operator's administrator allows).")


class RolloutSpec(ApiModel):
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


class HeadSpec(ApiModel):
    """The head pod: the OpenAI API, the orchestrator and one stage-0 engine."""

    standby: int = Field(
        0,
        ge=0,
        le=1,
        description="Warm spare head pods (0 or 1): a second head, loaded and Ready but outside the "
        "Services, serving nothing. When the serving head's engine dies (its container restarted, its pod "
        "deleted or failed), the Services move to the spare at once, the replicas re-attach to it without "
        "reloading their model, and the dead head becomes the spare once its engine is loaded again (a new "
        "spare pod is made if it is gone). Costs a head's GPUs and memory, held idle (docs/scaling.md: "
        "when it pays). Needs spec.membership dynamic and a single-stage pipeline.",
    )


class DisruptionBudgetSpec(ApiModel):
    """The PodDisruptionBudget the operator renders over the replica pods (a pool: its pods)."""

    max_unavailable: int = Field(
        1,
        ge=1,
        le=256,
        description="How many replica pods voluntary disruptions (the eviction API: kubectl drain, the "
        "cluster autoscaler) may take out of serving at once. Not the head: one head cannot be protected "
        "without blocking every drain of its node.",
    )
