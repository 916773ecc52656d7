"""The status models of the OmniStage and OmniStagePool: the CRDs' status schema (crd.py) and what
control/status.py builds status through, so that status holds only keys the schema has."""

from __future__ import annotations

from enum import StrEnum

from pydantic import ConfigDict, Field

from . import either
from .cache_spec import EffectiveCacheMode
from .conditions import STAGE_TYPES
from .conditions import TYPES as CONDITION_TYPES
from .model_base import ApiModel


class MemberState(StrEnum):
    """A replica pod's membership, as status.members[] and an OmniStagePool's members[] say it."""

    PENDING = "Pending"  # not Ready yet
    JOINING = "Joining"  # Ready, not acknowledged by the head yet
    JOINED = "Joined"
    SILENT = "Silent"  # joined, its heartbeats late past the heartbeat timeout: unroutable until they resume
    LEAVING = "Leaving"  # its retirement is decided: draining, then deleted
    # A standby (spec.standby): registered with the head and attached, live, not joined: one join away
    # from serving. A standby not there yet is Pending; one whose heartbeats are late is Silent.
    STANDBY = "Standby"


# An OmniStagePool's status lists only its pods that stay, so none of them is Leaving.
POOL_MEMBER_STATES = (MemberState.PENDING, MemberState.JOINING, MemberState.JOINED, MemberState.SILENT,
                      MemberState.STANDBY)


class _Status(ApiModel):
    """A part of a status. status.py builds status through these (so it holds only keys the CRD
    schema has); what an older operator wrote and a pass carries forward may hold keys this one
    does not know, which are dropped rather than failing the pass."""

    model_config = ConfigDict(extra="ignore")


class Condition(_Status):
    type: str = Field(description="Condition type.")
    status: str = Field(description="True, False or Unknown.")
    reason: str = Field("", description="Machine-readable reason code.")
    message: str = Field("", description="Human-readable explanation.")
    observed_generation: int | None = Field(None, description="Generation the condition was computed for.")
    last_transition_time: str | None = Field(None, description="When the status last changed (RFC 3339).")


class HeadStatus(_Status):
    pod: str | None = Field(None, description="Head pod name.")
    uid: str | None = Field(None, description="Head pod UID; a change means every replica must be rolled.")
    ip: str | None = Field(None, description="Head pod IP (the engine's master address).")
    boot_id: str | None = Field(
        None, description="The engine's boot id as reported by the membership endpoint."
    )
    restarts: int | None = Field(
        None,
        description="The head pod's container restarts; a rise means a new engine process, and every replica "
        "and pool pod is rolled.",
    )
    spare: str | None = Field(
        None, description="The warm spare head pod (spec.head.standby): takes the Services if this head's "
        "engine dies.")
    spare_ready: bool | None = Field(
        None, description="Whether the spare head is Ready, its engine loaded: only a Ready spare takes "
        "over.")


class MemberStatus(_Status):
    pod: str = Field(description="Replica pod name.")
    ip: str | None = Field(None, description="Replica pod IP.")
    replica_id: int | None = Field(None, description="Replica id the head assigned (never reused).")
    state: str = Field(description=f"{either(MemberState)}.")
    reason: str | None = Field(
        None, description="Why a Ready replica is not joined yet (e.g. CacheConsistent: CacheMismatch)."
    )
    standby: bool | None = Field(
        None, description="A standby pod (spec.standby): not joined on purpose, not counted in replicas."
    )


class EngineStatus(_Status):
    """What the head's engine reported it really runs (the engine plugin's report)."""

    boot_id: str | None = Field(None, description="The head engine process the report came from.")
    plugin_version: str | None = Field(
        None, description="omnistage-engine-patches version in the engine image."
    )
    vllm_version: str | None = Field(None, description="vllm version in the engine image.")
    vllm_omni_version: str | None = Field(None, description="vllm-omni version in the engine image.")
    distributed: bool | None = Field(
        None, description="Whether the head runs the distributed runtime (master server)."
    )
    frontend_cache_class: str | None = Field(
        None, description="vLLM class of the multimodal cache the stage-0 frontend built (none: no cache).")
    frontend_cache_mode: str | None = Field(
        None,
        description=(
            "The mode that class implements (processor-only, replica-aware, lru, shm, none); must match "
            "effectiveCacheMode."
        ),
    )
    patches: dict[str, str] = Field(
        default_factory=dict,
        description="Each engine patch's outcome: applied, skipped, disabled or upstream-fixed.")


class StageStatus(_Status):
    id: int = Field(description="Stage id.")
    name: str | None = Field(None, description="The pipeline's name for the stage.")
    pool: str | None = Field(None, description="The OmniStagePool that runs it (none: no pool covers it).")
    desired: int = Field(0, description="Replicas its pool wants.")
    ready: int = Field(0, description="Its pool's Ready pods.")
    registered: int = Field(0, description="Replicas of the stage joined on the head.")
    patches: dict[str, str] = Field(
        default_factory=dict,
        description="Each engine patch's outcome in the stage's replicas, as they sent it when they "
        "registered (the first not in effect when they differ); connector_ports must be applied.",
    )


class OmniStageStatus(_Status):
    """Observed state, written only by the operator."""

    observed_generation: int | None = Field(None, description="Spec generation the status describes.")
    replicas: int = Field(0, description="Stage-0 engine pods that exist (head included).")
    ready_replicas: int = Field(0, description="Engine pods that are Ready.")
    registered_replicas: int = Field(0, description="Engine replicas the head acknowledged (head included).")
    standby_replicas: int = Field(
        0, description="Standby pods that exist (spec.standby): not joined, not counted in replicas.")
    ready_standby_replicas: int = Field(
        0, description="Standby pods registered with the head, attached and live: each one join away from "
        "serving.")
    updated_replicas: int = Field(0, description="Engine pods running the current config and pod template.")
    selector: str = Field("", description="Label selector of the counted pods (scale subresource).")
    effective_cache_mode: EffectiveCacheMode | None = Field(
        None, description="The resolved stage-0 cache mode."
    )
    config_hash: str | None = Field(None, description="Hash of the rendered engine config and pod template.")
    engine_image: str | None = Field(
        None,
        description="Engine image of the current pod template: spec.engine.image, else the operator's "
        "default (pods not rolled yet may still run an older one; see updatedReplicas).",
    )
    head: HeadStatus | None = Field(None, description="The head pod.")
    engine: EngineStatus | None = Field(None, description="What the head's engine reported it runs.")
    membership_epoch: int | None = Field(None, description="Membership epoch last acknowledged by the head.")
    members: list[MemberStatus] = Field(
        default_factory=list, description="Replica pods and their membership."
    )
    stages: list[StageStatus] = Field(
        default_factory=list,
        description="Stages after stage 0: their pool and replicas (multi-stage pipelines).",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description=", ".join(t for t in CONDITION_TYPES if t not in STAGE_TYPES)
        + f"; {' and '.join(STAGE_TYPES)} with spec.stages.")


class PoolMemberStatus(_Status):
    pod: str = Field(description="Pod name.")
    ip: str | None = Field(None, description="Pod IP.")
    state: str = Field(description=f"{either(POOL_MEMBER_STATES)} (every stage of the pod joined).")
    replica_ids: dict[str, int] = Field(
        default_factory=dict, description="Replica id the head assigned to this pod, by stage id.")
    standby: bool | None = Field(
        None, description="A standby pod (spec.standby): not joined on purpose, not counted in replicas.")


class OmniStagePoolStatus(_Status):

    observed_generation: int | None = Field(None, description="Spec generation the status describes.")
    replicas: int = Field(0, description="Pods that exist.")
    ready_replicas: int = Field(0, description="Pods that are Ready.")
    registered_replicas: int = Field(0, description="Pods joined on the head for every one of their stages.")
    standby_replicas: int = Field(
        0, description="Standby pods that exist (spec.standby): not joined, not counted in replicas.")
    ready_standby_replicas: int = Field(
        0, description="Standby pods whose every stage is registered with the head, attached and live: each "
        "one join away from serving.")
    selector: str = Field("", description="Label selector of the counted pods (scale subresource).")
    members: list[PoolMemberStatus] = Field(default_factory=list, description="Pods and their membership.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready.")
