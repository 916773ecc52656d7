"""The rules of a multi-stage OmniStage (spec.stages and spec.transport), checked by the operator
alone: they read the known-pipelines table, which CEL cannot."""

from __future__ import annotations

from ..known_pipelines import PIPELINES as KNOWN_PIPELINES
from ..known_pipelines import SHIPPED_DEPLOY
from .owned import (
    OPERATOR_OWNED_STAGE_KEYS,
    OWNED_ENV_NAMES,
    OWNED_ENV_PREFIX,
    owned_env,
    owned_stage_key,
    walk,
)
from .specs import OmniStageSpec
from .stage_specs import CONNECTOR_PORT_SPAN, TransportMode, TransportProtocol


def multi_stage_problems(spec: OmniStageSpec) -> list[tuple[str, str]]:
    if not spec.stages:
        return []  # a multi-stage spec.pipeline without stages is the .pipeline rule's
    problem = _pipeline_problem(spec.pipeline)
    if problem:
        return [("spec.pipeline", problem)]
    return stage_id_problems(spec.pipeline, [s.id for s in spec.stages]) + _stage_name_problems(spec) \
        + _stage_override_problems(spec) + transport_problems(spec)


def _pipeline_problem(pipeline: str | None) -> str | None:
    renders = ", ".join(SHIPPED_DEPLOY)
    if pipeline is None:
        return (
            "spec.stages needs a multi-stage pipeline here; multi-stage pipelines the operator runs: "
            f"{renders}"
        )
    if pipeline not in KNOWN_PIPELINES:
        return f"{pipeline!r} is not a vllm-omni pipeline; use a registered key such as {renders}"
    if len(KNOWN_PIPELINES[pipeline]) < 2:
        return f"{pipeline!r} has only stage 0; remove spec.stages"
    if pipeline not in SHIPPED_DEPLOY:
        return (
            f"the operator does not run {pipeline!r} across pods yet; multi-stage pipelines it runs: "
            f"{renders}"
        )
    return None


def stage_id_problems(pipeline: str, ids: list[int]) -> list[tuple[str, str]]:
    """One entry per remote stage, ids 1..n-1 in order: the operator runs pods for each, and the head
    waits for every one of them at startup."""
    names = KNOWN_PIPELINES[pipeline]
    remote = list(range(1, len(names)))
    wanted = f"list stages {remote[0]}..{remote[-1]} ({', '.join(names[1:])}) once each, in order"
    problems = []
    for i, stage_id in enumerate(ids):
        if stage_id not in remote:
            problems.append(
                (
                    f"spec.stages[{i}].id",
                    (
                        f"{pipeline} has no stage {stage_id} after stage 0 (stages 0..{len(names) - 1}); "
                        f"{wanted}"
                    ),
                )
            )
    if not problems and ids != remote:
        problems.append(("spec.stages", f"got stage ids {', '.join(map(str, ids)) or 'none'}; {wanted}"))
    return problems


def _stage_name_problems(spec: OmniStageSpec) -> list[tuple[str, str]]:
    names = KNOWN_PIPELINES[spec.pipeline]
    return [
        (
            f"spec.stages[{i}].name",
            f"{spec.pipeline} calls stage {s.id} {names[s.id]!r}; use that or leave it out",
        )
        for i, s in enumerate(spec.stages)
        if s.name is not None and s.id < len(names) and s.name != names[s.id]
    ]


def _stage_override_problems(spec: OmniStageSpec) -> list[tuple[str, str]]:
    message = (
        "must not set " + ", ".join(OPERATOR_OWNED_STAGE_KEYS) + " or the operator's variables at any depth: "
        "the operator renders each stage's replicas and ids"
    )
    return [
        (f"spec.stages[{i}].engine.stageOverrides{path}", message)
        for i, s in enumerate(spec.stages)
        for path, key in walk(s.engine.stage_overrides)
        if owned_stage_key(key)
    ]


def transport_problems(spec: OmniStageSpec) -> list[tuple[str, str]]:
    transport, problems = spec.transport, []
    if transport is None:
        return []
    if transport.mode == TransportMode.SAME_NODE and transport.protocol == TransportProtocol.RDMA:
        problems.append(
            (
                "spec.transport.protocol",
                (
                    "rdma needs mode network (sameNode moves data through /dev/shm); "
                    "set mode network or protocol tcp"
                ),
            )
        )
    base, last = transport.base_port, transport.base_port + CONNECTOR_PORT_SPAN - 1
    for name, port in (("httpPort", spec.engine.http_port), ("masterPort", spec.engine.master_port),
                       ("membershipPort", spec.engine.membership_port)):
        if base <= port <= last:
            problems.append(
                (
                    "spec.transport.basePort",
                    (
                        f"the connectors' ports {base}..{last} hold spec.engine.{name} {port}; "
                        "move basePort off it"
                    ),
                )
            )
    problems += [(f"spec.transport.env[{i}].name", "is the operator's (" + ", ".join(OWNED_ENV_NAMES)
                  + f", {OWNED_ENV_PREFIX}*); remove it")
                 for i, e in enumerate(transport.env) if owned_env(e.name)]
    return problems
