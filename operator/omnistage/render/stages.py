"""The deploy config of a whole multi-stage pipeline (spec.stages): one ConfigMap for the head
(stage 0) and every remote stage's pods, as vllm-omni requires (a headless stage resolves the same
file locally; the head builds a config for every remote stage from it and its plan stays
authoritative).

Pure: it starts from vllm-omni's shipped deploy YAML of the pipeline, kept in known_pipelines.py by
hack/gen-known-pipelines.py (the operator's image does not carry vllm-omni, and a render must not read
files), and changes only what running the stages in their own pods needs:

* stage 0 is the single-stage head's entry (stage0.stage0_deploy: the head's GPUs, engine keys, cache keys);
* every remote stage gets `num_replicas: 1` (the head waits at startup for exactly one registered
  replica of it; more join later through registration), `devices` numbered from 0 (its pod's own
  GPUs; the shipped "1" assumes one host with two GPUs) and its spec.stages[i].engine settings;
* transport network: one NixlConnector spec on every connected edge, the only 0.30.0 connector a
  middle stage (talker) can both receive and send through across pods, and `async_chunk: false`
  (NO_CHUNKS_OVER_NIXL says why); sameNode: the shipped SharedMemoryConnector config, unchanged.

pipeline_rules.multi_stage_problems has checked the pipeline, the stage ids and the transport.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from ..api import StageSpec, TransportMode, TransportSpec
from ..known_pipelines import SHIPPED_DEPLOY
from .common import Target
from .stage0 import engine_keys, pipeline_keys, pod_devices, stage0_deploy

NIXL = "NixlConnector"
NIXL_CONNECTOR = "omnistage_nixl"          # its name under `connectors:` in the rendered config
NIXL_BACKENDS = ["UCX"]
# Resolved by the connector in each pod: the address of the default route, the pod IP.
NIXL_HOST = "auto"
CONNECTOR_REFS = ("input_connectors", "output_connectors")
# vllm-omni 0.30.0 cannot stream chunks over NIXL: with `async_chunk: true` a sending stage's worker
# (its payload connector, omni_connector_runtime.py:187 -> 555-588) and its scheduler's chunk adapter
# (OmniChunkTransferAdapter, omni_scheduler_mixin.py:148 -> chunk_transfer_adapter.py:290-313) build
# a NixlConnector each from the one resolved spec and both bind its handshake port: the second fails
# ("Address already in use") and the stage never starts. Two ports would not be enough: both read
# and write chunks, and a receiver dials the one endpoint the head advertises per sender replica
# (payload_sender_info). Without chunks the worker alone moves each stage's whole output, which
# works (tests/connector/test_nixl_chunks.py), at the price of streaming: a stage starts once its
# upstream finished. Said in the ConfigRendered condition (transport_note).
NO_CHUNKS_OVER_NIXL = (
    "transport network renders async_chunk: false: vllm-omni 0.30.0's chunk streaming binds one NIXL "
    "handshake port twice per stage (worker and scheduler) and the stage fails to start; each stage "
    "now hands its whole output on (no streaming between stages; docs/multi-stage.md#transports)"
)


def transport(t: Target) -> TransportSpec:
    return t.spec.transport or TransportSpec()


def render_pipeline_deploy_config(t: Target) -> dict[str, Any]:
    """The deploy config of every stage of spec.pipeline: stage 0 as for a single-stage OmniStage,
    stages 1..n-1 from spec.stages."""
    shipped = SHIPPED_DEPLOY[t.spec.pipeline]
    config = copy.deepcopy(shipped["config"])
    by_id = {s["stage_id"]: s for s in config["stages"]}
    by_id[0].update(stage0_deploy(t))
    for s in t.spec.stages:
        by_id[s.id].update(remote_stage_deploy(s, by_id[s.id]))
    if transport(t).mode == TransportMode.NETWORK:
        use_nixl(config, shipped["edges"], transport(t).base_port)
        config["async_chunk"] = False
    # `pipeline` explicit: head and stage pods resolve the same registry entry whatever the model's
    # Hugging Face config would pick (a resolver may choose the thinker-only variant).
    return {"pipeline": t.spec.pipeline, **pipeline_keys(t), **config}


def transport_note(t: Target) -> str | None:
    """What the rendered transport changes in the shipped pipeline, for status: None when nothing."""
    if not t.spec.stages or transport(t).mode != TransportMode.NETWORK:
        return None
    return NO_CHUNKS_OVER_NIXL if SHIPPED_DEPLOY[t.spec.pipeline]["config"].get("async_chunk") else None


def remote_stage_deploy(s: StageSpec, shipped_stage: dict[str, Any]) -> dict[str, Any]:
    tp = s.engine.tensor_parallel_size or shipped_stage.get("tensor_parallel_size", 1)
    return {
        "num_replicas": 1,
        "devices": pod_devices(tp),
        **engine_keys(s.engine),
        **s.engine.stage_overrides,
    }


def use_nixl(config: dict[str, Any], edges: Sequence[tuple[int, int]], base_port: int) -> None:
    """Every connected edge on one NIXL spec. The shipped connector's extra stays: it carries model
    tuning the stage processors read from the connector (Qwen3-Omni's codec chunk frames)."""
    config["connectors"] = {
        NIXL_CONNECTOR: {
            "name": NIXL,
            "extra": {
                **shipped_edge_extra(config),
                "backends": list(NIXL_BACKENDS),
                "host": NIXL_HOST,
                "zmq_port": base_port,
            },
        }
    }
    by_id = {s["stage_id"]: s for s in config["stages"]}
    for s in config["stages"]:
        for refs in CONNECTOR_REFS:
            if s.get(refs):
                s[refs] = {edge: NIXL_CONNECTOR for edge in s[refs]}
    # An edge vllm-omni connected without naming a connector (runtime `edges`: auto SHM) gets one too.
    for src, dst in edges:
        if f"to_stage_{dst}" not in (by_id[src].get("output_connectors") or {}):
            by_id[dst].setdefault("input_connectors", {})[f"from_stage_{src}"] = NIXL_CONNECTOR


def shipped_edge_extra(config: dict[str, Any]) -> dict[str, Any]:
    """The extra of the one connector the shipped stages name (hack/gen-known-pipelines.py checks
    there is one); none when vllm-omni connects the edges itself."""
    refs = {ref for s in config["stages"] for refs in CONNECTOR_REFS for ref in (s.get(refs) or {}).values()}
    return next((dict(config["connectors"][ref].get("extra") or {}) for ref in refs), {})
