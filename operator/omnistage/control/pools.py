"""Which OmniStagePool runs which stage: pure checks of the pools that name an OmniStage.

A pool is only capacity; whether it fits its OmniStage depends on that OmniStage's spec.stages and
on the other pools, which no CEL rule on one object can see. So the operator decides here, and says
so on both sides: the pool's Ready condition names what to change, the OmniStage's StagesCovered
condition names the stages no valid pool runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ..api import OmniStagePoolSpec
from ..api.child_names import POOL_NAME_RULES, name_problems
from ..api.conditions import Reason
from ..known_pipelines import SHIPPED_DEPLOY
from ..render.common import Pool, Target
from . import collisions
from .collisions import Named

# vLLM's default gpu_memory_utilization, for a shipped stage that does not set one.
GPU_MEMORY_DEFAULT = 0.9


@dataclass(frozen=True)
class Fitted:
    """One pool object as the OmniStage's pass sees it: parsed (pool is None when its spec is not
    even a valid OmniStagePoolSpec) and, when it cannot run, why (reason, message)."""

    name: str
    obj: Mapping[str, Any]
    pool: Pool | None
    problem: tuple[str, str] | None = None

    @property
    def runs(self) -> bool:
        return self.pool is not None and self.problem is None


def parse(obj: Mapping[str, Any]) -> Pool | tuple[str, str]:
    meta = obj.get("metadata") or {}
    # A name created before the CRD refused it: its pods' labels and budget would be refused in turn.
    problems = [f"{field}: {message}" for field, message in name_problems(meta["name"], POOL_NAME_RULES)]
    try:
        spec = OmniStagePoolSpec.model_validate(obj.get("spec") or {})
    except ValidationError as err:
        problems += [f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
    if problems:
        return Reason.INVALID_SPEC, "; ".join(problems)
    return Pool(meta["name"], meta.get("uid"), meta.get("generation"), spec)


def _age(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("creationTimestamp") or "", meta["name"]


def fit(t: Target | None, omnistage: str, objs: Iterable[Mapping[str, Any]],
        names: Iterable[Named] = ()) -> list[Fitted]:
    """Every pool naming the OmniStage, in age order. A stage claimed by two pools stays with the
    older one (its pods already run it); the newer pool is refused and runs nothing. So is a pool whose
    children would take names an older object of `names` (the namespace's OmniStages and pools as
    Observed sees them, the OmniStage included) needs (collisions.py)."""
    out: list[Fitted] = []
    owner: dict[int, str] = {}
    names = tuple(names)
    for obj in sorted(objs, key=_age):
        name = obj["metadata"]["name"]
        parsed = parse(obj)
        if not isinstance(parsed, Pool):
            out.append(Fitted(name, obj, None, parsed))
            continue
        problem = collisions.pool_problem(obj, names) or _problem(t, omnistage, parsed, owner)
        if problem is None:
            owner.update({k: name for k in parsed.spec.stage_ids})
        out.append(Fitted(name, obj, parsed, problem))
    return out


def _problem(
    t: Target | None, omnistage: str, pool: Pool, owner: Mapping[int, str]
) -> tuple[str, str] | None:
    if t is None:
        return (
            Reason.OMNISTAGE_NOT_FOUND,
            f"OmniStage {omnistage} does not exist in this namespace; fix spec.omniStage",
        )
    ids = [s.id for s in t.spec.stages]
    if not ids:
        return Reason.NOT_MULTI_STAGE, (
            f"OmniStage {omnistage} has no spec.stages (stage 0 runs in its own pods); "
            "give it a multi-stage spec.pipeline and spec.stages, or delete this pool"
        )
    unknown = [k for k in pool.spec.stage_ids if k not in ids]
    if unknown:
        return Reason.UNKNOWN_STAGE, (
            f"OmniStage {omnistage} has no stage {', '.join(map(str, unknown))} in spec.stages "
            f"(its stages after stage 0: {', '.join(map(str, ids))}); fix spec.stageIds"
        )
    taken = {k: owner[k] for k in pool.spec.stage_ids if k in owner}
    if taken:
        return Reason.STAGE_IN_TWO_POOLS, (
            "stage "
            + ", ".join(f"{k} already runs in pool {p}" for k, p in taken.items())
            + "; a stage belongs to exactly one pool: remove it from spec.stageIds"
        )
    engines = {s.id: s.engine for s in t.spec.stages}
    need = max(engines[k].tensor_parallel_size or 1 for k in pool.spec.stage_ids)
    if pool.spec.gpu.count < need:
        return Reason.TOO_FEW_GPUS, (
            f"spec.gpu.count {pool.spec.gpu.count} is less than the tensorParallelSize {need} of "
            "one of its stages (the stages of a pod share its GPUs from 0); raise spec.gpu.count"
        )
    shares = {k: memory_share(t, k) for k in pool.spec.stage_ids}
    if sum(shares.values()) > 1.0 + 1e-9:
        listed = ", ".join(f"stage {k} {v:g}" for k, v in shares.items())
        return Reason.GPU_MEMORY_OVERCOMMITTED, (
            "the stages of a pod share its GPUs from 0 and their gpuMemoryUtilization adds up to more than "
            f"1 ({listed}); lower spec.stages[].engine.gpuMemoryUtilization of OmniStage {omnistage}, or put "
            "the stages in separate pools"
        )
    return None


def memory_share(t: Target, stage_id: int) -> float:
    """A stage's gpu_memory_utilization: its spec.stages entry, else the pipeline's shipped config."""
    spec = next(s for s in t.spec.stages if s.id == stage_id).engine.gpu_memory_utilization
    shipped = next(
        s for s in SHIPPED_DEPLOY[t.spec.pipeline]["config"]["stages"] if s["stage_id"] == stage_id
    )
    return spec if spec is not None else shipped.get("gpu_memory_utilization", GPU_MEMORY_DEFAULT)


def coverage(fitted: Iterable[Fitted]) -> dict[int, str]:
    """Stage id -> the pool that runs it."""
    return {k: f.name for f in fitted if f.runs for k in f.pool.spec.stage_ids}
