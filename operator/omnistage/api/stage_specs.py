"""The stages after stage 0 (spec.stages) and how data moves between stages (spec.transport): the
multi-stage pipeline's settings (their rules: pipeline_rules.py; their capacity: OmniStagePoolSpec)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field

from .engine_spec import EnvVar
from .model_base import ApiModel


class StageEngineSpec(ApiModel):
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


class StageSpec(ApiModel):
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


class TransportSpec(ApiModel):
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
