"""Every rule a valid OmniStage obeys beyond per-field constraints.

Each rule is written twice on purpose, once as CEL (the API server enforces it, see crd.py)
and once in Python (`omnistage render` and the reconcile loop enforce it), with one message.
A rule CEL cannot express (cel=None) is enforced by the operator alone: the OmniStage gets
Ready=False, reason InvalidSpec, and its running pods are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from .api import MAX_NAME_LENGTH, OPERATOR_OWNED_FLAGS, OmniStageSpec
from .cachemode import SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP, membership_can_change

OPERATOR_OWNED_STAGE_KEYS = ["mm_processor_cache_type", "mm_processor_cache_gb", "num_replicas", "stage_id"]


@dataclass(frozen=True)
class Rule:
    field: str  # relative to spec, as the API server's fieldPath
    cel: str | None
    message: str
    holds: Callable[[OmniStageSpec], bool]


def _no_owned_flags(spec: OmniStageSpec) -> bool:
    return not any(a.startswith(f) for a in spec.engine.extra_args for f in OPERATOR_OWNED_FLAGS)


def _model_volume_one_source(spec: OmniStageSpec) -> bool:
    mv = spec.model_volume
    return mv is None or (mv.pvc is not None) + (mv.host_path is not None) == 1


SPEC_RULES = [
    Rule(
        ".cache.mode",
        "!(self.cache.mode in ['lru', 'shm'] && (self.membership == 'dynamic' || self.replicas > 1))",
        SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP,
        lambda s: not (s.cache.mode in ("lru", "shm") and membership_can_change(s.membership, s.replicas)),
    ),
    Rule(
        ".gpu.count",
        "self.gpu.count >= self.engine.tensorParallelSize",
        "spec.gpu.count must be at least spec.engine.tensorParallelSize (GPUs per replica)",
        lambda s: s.gpu.count >= s.engine.tensor_parallel_size,
    ),
    Rule(
        ".engine.masterPort",
        "self.engine.httpPort != self.engine.masterPort",
        "spec.engine.httpPort and spec.engine.masterPort must differ",
        lambda s: s.engine.http_port != s.engine.master_port,
    ),
    Rule(
        ".engine.extraArgs",
        "!has(self.engine.extraArgs) || self.engine.extraArgs.all(a, " + " && ".join(f"!a.startsWith('{f}')" for f in OPERATOR_OWNED_FLAGS) + ")",
        "spec.engine.extraArgs must not set flags the operator manages (" + ", ".join(OPERATOR_OWNED_FLAGS)
        + "); remove them, the operator renders them from the spec",
        _no_owned_flags,
    ),
    Rule(
        ".engine.stageOverrides",
        # CEL cannot see into a preserve-unknown-fields object, so only the operator checks this.
        None,
        "spec.engine.stageOverrides must not set " + ", ".join(OPERATOR_OWNED_STAGE_KEYS)
        + "; use spec.cache and spec.replicas instead",
        lambda s: not any(k in s.engine.stage_overrides for k in OPERATOR_OWNED_STAGE_KEYS),
    ),
    Rule(
        ".modelVolume",
        "!has(self.modelVolume) || (has(self.modelVolume.pvc) ? 1 : 0) + (has(self.modelVolume.hostPath) ? 1 : 0) == 1",
        "spec.modelVolume needs exactly one of pvc or hostPath",
        _model_volume_one_source,
    ),
]

NAME_RULE_CEL = f"self.metadata.name.size() <= {MAX_NAME_LENGTH}"
NAME_RULE_MESSAGE = f"metadata.name must be at most {MAX_NAME_LENGTH} characters so the child object names fit"


class InvalidSpec(ValueError):
    """A spec the operator will not act on; `problems` are (field, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))


def _pydantic_problems(err: ValidationError) -> list[tuple[str, str]]:
    out = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        extra = f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
        out.append((f"spec.{path}" if path else "spec", f"{e['msg']}{extra}"))
    return out


def validate_omnistage(obj: dict[str, Any]) -> OmniStageSpec:
    """Parse and check an OmniStage object; raises InvalidSpec naming every offending field."""
    name = (obj.get("metadata") or {}).get("name") or ""
    problems: list[tuple[str, str]] = []
    if not name:
        problems.append(("metadata.name", "is required"))
    elif len(name) > MAX_NAME_LENGTH:
        problems.append(("metadata.name", NAME_RULE_MESSAGE))
    try:
        spec = OmniStageSpec.model_validate(obj.get("spec") or {})
    except ValidationError as err:
        raise InvalidSpec(problems + _pydantic_problems(err)) from None
    problems += [(f"spec{r.field}", r.message) for r in SPEC_RULES if not r.holds(spec)]
    if problems:
        raise InvalidSpec(problems)
    return spec
