"""The deploy config of a whole multi-stage pipeline (issue 12): one ConfigMap for the head (stage 0)
and every remote stage's pods, as vllm-omni requires (a headless stage resolves the same file locally;
the head builds a config for every remote stage from it and its plan stays authoritative).

Pure: it starts from vllm-omni's shipped deploy YAML of the pipeline, kept in known_pipelines.py by
hack/gen-known-pipelines.py (the operator's image does not carry vllm-omni, and a render must not read
files), and changes only what running the stages in their own pods needs:

* stage 0 is today's stage-0 entry (config.stage0_deploy: the head's GPUs, engine keys, cache keys);
* every remote stage gets `num_replicas: 1` (the head waits at startup for exactly one registered
  replica of it; more join later through registration), `devices` numbered from 0 (its pod's own
  GPUs; the shipped "1" assumes one host with two GPUs) and its StageEngine settings;
* transport network: one NixlConnector spec on every connected edge, the only 0.30.0 connector a
  middle stage (talker) can both receive and send through across pods; sameNode: the shipped
  SharedMemoryConnector config, unchanged.

Not wired into the API yet: validation still refuses multi-stage pipelines, so the pipeline and the
remote stages' settings are arguments here instead of spec fields. Problems are reported with the
field names the API will have (spec.stages[i].stageId, spec.transport.*).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..known_pipelines import PIPELINES, SHIPPED_DEPLOY
from ..validation import InvalidSpec
from .common import Target
from .config import engine_keys, pipeline_keys, pod_devices, stage0_deploy

# vllm-omni's default connector zmq_port (resolve_connector_spec, initialization.py:83-125).
DEFAULT_BASE_PORT = 50051
# A connector port is basePort + purpose offset (0, 100, 200) + 16 * local rank + from_stage
# (initialization.py:48-80); the replica-id term is 0 with one replica per pod (connector_ports patch).
# So one stride of vllm-omni's arithmetic, basePort..basePort+1023, holds every port a pod may bind.
PORT_SPAN = 1024
MIN_BASE_PORT = 1024   # below: privileged ports
MAX_BASE_PORT = 65535 - PORT_SPAN + 1

NIXL = "NixlConnector"
NIXL_CONNECTOR = "omnistage_nixl"          # its name under `connectors:` in the rendered config
NIXL_BACKENDS = ["UCX"]
# Resolved by the connector in each pod: the address of the default route, the pod IP.
NIXL_HOST = "auto"
CONNECTOR_REFS = ("input_connectors", "output_connectors")


class TransportMode(StrEnum):
    NETWORK = "network"      # stages in any pods, on any nodes: NIXL over UCX
    SAME_NODE = "sameNode"   # every stage's pods share one /dev/shm: the shipped SharedMemoryConnector


class TransportProtocol(StrEnum):
    # UCX picks TCP or RDMA from its environment (UCX_TLS, UCX_NET_DEVICES), not from the connector
    # spec: the deploy config is the same for both; the pods' environment differs.
    TCP = "tcp"
    RDMA = "rdma"


@dataclass(frozen=True)
class StageEngine:
    """A remote stage's engine settings (the coming spec.stages[i]); None keeps the shipped value."""

    stage_id: int
    tensor_parallel_size: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    stage_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Transport:
    """How stage k's data reaches stage k+1 (the coming spec.transport)."""

    mode: str = TransportMode.NETWORK
    protocol: str = TransportProtocol.TCP
    base_port: int = DEFAULT_BASE_PORT


def render_pipeline_deploy_config(t: Target, pipeline: str, stages: Sequence[StageEngine],
                                  transport: Transport) -> dict[str, Any]:
    """The deploy config of every stage of `pipeline`: stage 0 from `t` (spec.pipeline is not read),
    stages 1..n-1 from `stages` (one entry each, in stage-id order). Raises InvalidSpec."""
    shipped = shipped_deploy(pipeline)
    problems = stage_id_problems(pipeline, stages) + transport_problems(transport, t)
    if problems:
        raise InvalidSpec(problems)
    config = copy.deepcopy(shipped["config"])
    by_id = {s["stage_id"]: s for s in config["stages"]}
    by_id[0].update(stage0_deploy(t))
    for s in stages:
        by_id[s.stage_id].update(remote_stage_deploy(s, by_id[s.stage_id]))
    if transport.mode == TransportMode.NETWORK:
        use_nixl(config, shipped["edges"], transport.base_port)
    # `pipeline` explicit: head and stage pods resolve the same registry entry whatever the model's
    # Hugging Face config would pick (a resolver may choose the thinker-only variant).
    return {"pipeline": pipeline, **pipeline_keys(t), **config}


def shipped_deploy(pipeline: str) -> dict[str, Any]:
    renders = ", ".join(SHIPPED_DEPLOY)
    if pipeline not in PIPELINES:
        problem = f"{pipeline!r} is not a vllm-omni pipeline; use a registered key such as {renders}"
    elif len(PIPELINES[pipeline]) < 2:
        problem = f"{pipeline!r} has only stage 0; run it without spec.stages"
    elif pipeline not in SHIPPED_DEPLOY:
        problem = f"the operator does not run {pipeline!r} across pods yet; multi-stage pipelines it runs: {renders}"
    else:
        return SHIPPED_DEPLOY[pipeline]
    raise InvalidSpec([("spec.pipeline", problem)])


def stage_id_problems(pipeline: str, stages: Sequence[StageEngine]) -> list[tuple[str, str]]:
    """One entry per remote stage, ids 1..n-1 in order: the operator runs pods for each, and the head
    waits for every one of them at startup."""
    names = PIPELINES[pipeline]
    remote = list(range(1, len(names)))
    wanted = f"list stages {remote[0]}..{remote[-1]} ({', '.join(names[1:])}) once each, in order"
    problems = []
    for i, s in enumerate(stages):
        where = f"spec.stages[{i}].stageId"
        if s.stage_id == 0:
            problems.append((where, f"stage 0 ({names[0]}) is the head's, set by spec.engine; {wanted}"))
        elif s.stage_id not in remote:
            problems.append((where, f"{pipeline} has no stage {s.stage_id} (stages 0..{len(names) - 1}); {wanted}"))
    if not problems and [s.stage_id for s in stages] != remote:
        got = ", ".join(str(s.stage_id) for s in stages) or "none"
        problems.append(("spec.stages", f"got stage ids {got}; {wanted}"))
    return problems


def transport_problems(transport: Transport, t: Target) -> list[tuple[str, str]]:
    problems = []
    if transport.mode not in set(TransportMode):
        problems.append(("spec.transport.mode", f"{transport.mode!r}: use one of {', '.join(TransportMode)}"))
    if transport.protocol not in set(TransportProtocol):
        problems.append(("spec.transport.protocol",
                         f"{transport.protocol!r}: use one of {', '.join(TransportProtocol)}"))
    elif transport.mode == TransportMode.SAME_NODE and transport.protocol == TransportProtocol.RDMA:
        problem = "rdma needs mode network (sameNode moves data through /dev/shm); set mode network or protocol tcp"
        problems.append(("spec.transport.protocol", problem))
    base, last = transport.base_port, transport.base_port + PORT_SPAN - 1
    if not MIN_BASE_PORT <= base <= MAX_BASE_PORT:
        problem = f"{base}: use {MIN_BASE_PORT}..{MAX_BASE_PORT} (the connectors bind basePort..basePort+{PORT_SPAN - 1})"
        problems.append(("spec.transport.basePort", problem))
    for name, port in (("httpPort", t.spec.engine.http_port), ("masterPort", t.spec.engine.master_port)):
        if base <= port <= last:
            problem = f"the connectors' ports {base}..{last} hold spec.engine.{name} {port}; move basePort off it"
            problems.append(("spec.transport.basePort", problem))
    return problems


def remote_stage_deploy(s: StageEngine, shipped_stage: dict[str, Any]) -> dict[str, Any]:
    tp = s.tensor_parallel_size or shipped_stage.get("tensor_parallel_size", 1)
    return {"num_replicas": 1, "devices": pod_devices(tp), **engine_keys(s), **s.stage_overrides}


def use_nixl(config: dict[str, Any], edges: Sequence[tuple[int, int]], base_port: int) -> None:
    """Every connected edge on one NIXL spec. The shipped connector's extra stays: it carries model
    tuning the stage processors read from the connector (Qwen3-Omni's codec chunk frames)."""
    config["connectors"] = {NIXL_CONNECTOR: {"name": NIXL, "extra": {
        **shipped_edge_extra(config), "backends": list(NIXL_BACKENDS), "host": NIXL_HOST, "zmq_port": base_port}}}
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
