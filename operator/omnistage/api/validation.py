"""Every rule a valid OmniStage obeys beyond per-field constraints.

Each rule is written twice on purpose, once as CEL (the API server enforces it, see crd.py)
and once in Python (`omnistage render` and the reconcile loop enforce it), with one message.
A rule CEL cannot express (cel=None) is enforced by the operator alone: the OmniStage gets
Ready=False, reason InvalidSpec, and its running pods are left alone. The operator's problems name
the exact item or key (spec.engine.extraArgs[2], spec.engine.stageOverrides.runtime.num_replicas).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from .. import names
from ..known_pipelines import PIPELINES as KNOWN_PIPELINES
from . import (
    MAX_NAME_LENGTH,
    OPERATOR_OWNED_FLAGS,
    OmniStageSpec,
)
from . import podtemplate as pt
from .cachemode import SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP, membership_can_change
from .owned import (
    OPERATOR_OWNED_STAGE_KEYS,
    OWNED_ENV_NAMES,
    OWNED_ENV_PREFIX,
    STANDIN_ENV_PREFIX,
    env_value_and_source_items,
    owned_env,
    owned_env_cel,
    owned_env_items,
    owned_flag_items,
    owned_flags_cel,
    owned_stage_paths,
    respelled_owned_flag_items,
)
from .pipeline_rules import multi_stage_problems


@dataclass(frozen=True)
class Rule:
    field: str  # relative to spec, as the API server's fieldPath
    cel: str | None
    message: str
    # The parts of `field` that break the rule, relative to it ("" for the field as a whole,
    # "[2]" for an item, ".runtime.num_replicas" for a nested key); empty when the rule holds.
    broken: Callable[[OmniStageSpec], list[str]]


def _unless(holds: Callable[[OmniStageSpec], bool]) -> Callable[[OmniStageSpec], list[str]]:
    """For rules about a field as a whole."""
    return lambda s: [] if holds(s) else [""]


# ---- spec.template ---------------------------------------------------------------------------------
# Its schema is the API server's (crd.py); these rules keep what the operator renders the operator's.
# Each reads the template defensively: a wrongly typed part is reported by the schema check instead.


def _present(path: str) -> str:
    """CEL: every step of self.<path> is present (has() of a missing parent is an error)."""
    parts = path.split(".")
    return " && ".join(f"has(self.{'.'.join(parts[:i + 1])})" for i in range(len(parts)))


def _absent_or(path: str, holds: str) -> str:
    return f"!({_present(path)}) || {holds}"


def _template_meta(spec: OmniStageSpec, key: str) -> dict[str, Any]:
    return pt.mapping(spec.template, "metadata", key)


def _owned_label(key: str) -> bool:
    return key in names.OPERATOR_LABELS or key.startswith(names.GROUP + "/")


def _owned_label_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{k}]" for k in _template_meta(spec, "labels") if _owned_label(k)]


def _owned_annotation_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{k}]" for k in _template_meta(spec, "annotations") if k.startswith(names.GROUP + "/")]


def _engine_owned_field_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].{f}" for i, c in pt.engine_containers(spec.template) for f in pt.ENGINE_OWNED_FIELDS
            if c.get(f) is not None]


def _engine_owned_env_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].env[{j}].name" for i, c in pt.engine_containers(spec.template)
            for j, e in pt.objects(c.get("env")) if isinstance(e.get("name"), str) and owned_env(e["name"])]


def _owned_mount_paths(spec: OmniStageSpec) -> list[str]:
    paths = [*pt.OPERATOR_MOUNT_PATHS, *([spec.model_volume.mount_path] if spec.model_volume else [])]
    return [form for p in paths for form in (p, p + "/")]


def _owned_mount(path: str, spec: OmniStageSpec) -> bool:
    return path in _owned_mount_paths(spec) or any(path.startswith(d + "/") for d in pt.OPERATOR_FILE_DIRS)


def _engine_owned_mount_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].volumeMounts[{j}].mountPath" for i, c in pt.engine_containers(spec.template)
            for j, m in pt.objects(c.get("volumeMounts"))
            if isinstance(m.get("mountPath"), str) and _owned_mount(m["mountPath"], spec)]


def _engine_container_cel(holds: str) -> str:
    """CEL: `holds` (about container c) is true of the engine container of spec.template."""
    return _absent_or("template.spec.containers",
                      f"self.template.spec.containers.all(c, c.name != '{pt.ENGINE_CONTAINER}' || ({holds}))")


def _engine_owned_fields_cel() -> str:
    return _engine_container_cel("!(" + " || ".join(f"has(c.{f})" for f in pt.ENGINE_OWNED_FIELDS) + ")")


def _gpu_request_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    def broken(spec: OmniStageSpec) -> list[str]:
        gpu = spec.gpu.resource
        return [f"[{i}].resources.{kind}[{gpu}]" for i, c in pt.spec_items(spec.template, field)
                for kind in ("limits", "requests") if gpu in pt.mapping(c, "resources", kind)]
    return broken


def _gpu_request_cel(field: str) -> str:
    return _absent_or(f"template.spec.{field}", f"self.template.spec.{field}.all(c, !has(c.resources) || ("
                      "(!has(c.resources.limits) || !(self.gpu.resource in c.resources.limits)) && "
                      "(!has(c.resources.requests) || !(self.gpu.resource in c.resources.requests))))")


def _owned_volume_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].name" for i, v in pt.spec_items(spec.template, "volumes") if v.get("name") in pt.OPERATOR_VOLUMES]


def _owned_pod_field_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    return lambda s: [""] if pt.mapping(s.template, "spec").get(field) is not None else []


def _host_network_items(spec: OmniStageSpec) -> list[str]:
    return [""] if pt.mapping(spec.template, "spec").get("hostNetwork") is True else []


def _product_selector_items(spec: OmniStageSpec) -> list[str]:
    selector = pt.mapping(spec.template, "spec", "nodeSelector")
    return [f"[{spec.gpu.product_label}]"] if spec.gpu.product_label in selector else []


# spec.placement's fields that are single values or atomic lists in a PodSpec: a template value would
# replace the placement's entirely (tolerations and affinity's terms are not merged by Kubernetes).
_PLACEMENT_EXCLUSIVE = {"tolerations": "tolerations", "affinity": "affinity",
                        "priority_class_name": "priorityClassName", "scheduler_name": "schedulerName"}


def _placement_conflict_items(spec: OmniStageSpec) -> list[str]:
    pod = pt.mapping(spec.template, "spec")
    return [f".{name}" for field, name in _PLACEMENT_EXCLUSIVE.items()
            if field in spec.placement.model_fields_set and pod.get(name) is not None]


def _placement_conflict_cel() -> str:
    return " && ".join(f"!(has(self.placement.{n}) && {_present('template.spec.' + n)})"
                       for n in _PLACEMENT_EXCLUSIVE.values())


def _template_schema_problems(spec: OmniStageSpec) -> list[tuple[str, str]]:
    """What the API server's schema would refuse in spec.template and engine.env[].valueFrom (it
    does refuse it there; `omnistage render` and objects from elsewhere meet this check)."""
    problems = []
    if spec.template is not None:
        problems += pt.schema_problems(spec.template, pt.schema(), "spec.template")
    value_from = pt.subschema("spec.containers.env.valueFrom")
    for i, e in enumerate(spec.engine.env):
        if e.value_from is not None:
            problems += pt.schema_problems(e.value_from, value_from, f"spec.engine.env[{i}].valueFrom")
    return problems


def _model_volume_one_source(spec: OmniStageSpec) -> bool:
    mv = spec.model_volume
    return mv is None or (mv.pvc is not None) + (mv.host_path is not None) == 1


# Pipelines with stages 1..n: the head waits at startup for a replica of every remote stage, so such a
# pipeline needs spec.stages (and OmniStagePools to run them).
MULTI_STAGE_PIPELINES = sorted(key for key, stages in KNOWN_PIPELINES.items() if len(stages) > 1)
SINGLE_STAGE_EXAMPLES = ("qwen3_omni_moe_thinker_only", "qwen2_5_omni_thinker_only", "ming_flash_omni_thinker_only")

_FLAGS_INSTEAD = ("the operator renders them: set spec.cache for the multimodal cache, spec.replicas for "
                  "replicas, spec.engine.httpPort/masterPort for ports and spec.engine.stageOverrides for other stage-0 keys")

SPEC_RULES = [
    Rule(
        ".pipeline",
        "!has(self.pipeline) || !(self.pipeline in [" + ", ".join(f"'{p}'" for p in MULTI_STAGE_PIPELINES) + "])"
        " || (has(self.stages) && size(self.stages) > 0)",
        "spec.pipeline names a multi-stage vllm-omni pipeline (stages after stage 0, e.g. qwen3_omni_moe: thinker, "
        "talker, code2wav) and the head waits for every stage at startup: list stages 1..n-1 in spec.stages and run "
        "them with OmniStagePools, or use a single-stage pipeline such as " + ", ".join(SINGLE_STAGE_EXAMPLES),
        _unless(lambda s: s.pipeline not in MULTI_STAGE_PIPELINES or bool(s.stages)),
    ),
    Rule(
        ".cache.mode",
        "!(self.cache.mode in ['lru', 'shm'] && (self.membership == 'dynamic' || self.replicas > 1))",
        SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP,
        _unless(lambda s: not (s.cache.mode in ("lru", "shm") and membership_can_change(s.membership, s.replicas))),
    ),
    Rule(
        ".gpu.count",
        "self.gpu.count >= self.engine.tensorParallelSize",
        "spec.gpu.count must be at least spec.engine.tensorParallelSize (GPUs per replica)",
        _unless(lambda s: s.gpu.count >= s.engine.tensor_parallel_size),
    ),
    Rule(
        ".engine.masterPort",
        "self.engine.httpPort != self.engine.masterPort",
        "spec.engine.httpPort and spec.engine.masterPort must differ",
        _unless(lambda s: s.engine.http_port != s.engine.master_port),
    ),
    Rule(
        ".engine.extraArgs",
        owned_flags_cel(),
        "spec.engine.extraArgs must not set flags the operator manages (" + ", ".join(OPERATOR_OWNED_FLAGS)
        + "; as --flag, --flag=value or --flag.key=value, with - or _); " + _FLAGS_INSTEAD,
        owned_flag_items,
    ),
    Rule(
        ".engine.extraArgs",
        # Abbreviations and mixed spellings: see above, the operator checks.
        None,
        "spec.engine.extraArgs must not set flags the operator manages in a spelling vLLM expands "
        "(an abbreviation such as --mm-processor-cache-t, or mixed - and _); " + _FLAGS_INSTEAD,
        respelled_owned_flag_items,
    ),
    Rule(
        ".engine.env",
        owned_env_cel(),
        "spec.engine.env must not set variables the operator manages (" + ", ".join(OWNED_ENV_NAMES)
        + f", {OWNED_ENV_PREFIX}*; the test stand-in's {STANDIN_ENV_PREFIX}* excepted): they switch the engine "
        "plugin off or on, set the frontend cache, carry the membership token and the engine's address; use "
        "spec.cache for the cache",
        owned_env_items,
    ),
    Rule(
        ".engine.stageOverrides",
        # CEL cannot see into a preserve-unknown-fields object, so only the operator checks this.
        None,
        "spec.engine.stageOverrides must not set " + ", ".join(OPERATOR_OWNED_STAGE_KEYS)
        + f" or the operator's variables ({', '.join(OWNED_ENV_NAMES)}, {OWNED_ENV_PREFIX}*) at any depth "
        "(e.g. runtime.num_replicas, engine_args.mm_processor_cache_type); use spec.cache and spec.replicas instead",
        owned_stage_paths,
    ),
    Rule(
        ".modelVolume",
        "!has(self.modelVolume) || (has(self.modelVolume.pvc) ? 1 : 0) + (has(self.modelVolume.hostPath) ? 1 : 0) == 1",
        "spec.modelVolume needs exactly one of pvc or hostPath",
        _unless(_model_volume_one_source),
    ),
    Rule(
        ".engine.env",
        "!has(self.engine.env) || self.engine.env.all(e, !has(e.valueFrom) || !has(e.value) || e.value == '')",
        "spec.engine.env entries take value or valueFrom, not both",
        env_value_and_source_items,
    ),
    Rule(
        ".template.metadata.labels",
        _absent_or("template.metadata.labels", "self.template.metadata.labels.all(k, !(k in ["
                   + ", ".join(f"'{k}'" for k in names.OPERATOR_LABELS) + f"]) && !k.startsWith('{names.GROUP}/'))"),
        f"spec.template.metadata.labels must not set the operator's labels ({', '.join(names.OPERATOR_LABELS)}, "
        f"{names.GROUP}/*): the Services, the NetworkPolicy and the scale selector find the engine pods by them",
        _owned_label_items,
    ),
    Rule(
        ".template.metadata.annotations",
        _absent_or("template.metadata.annotations",
                   f"self.template.metadata.annotations.all(k, !k.startsWith('{names.GROUP}/'))"),
        f"spec.template.metadata.annotations must not set {names.GROUP}/* annotations: they carry the "
        "operator's pod template hash and each replica's head",
        _owned_annotation_items,
    ),
    Rule(
        ".template.spec.containers",
        _engine_owned_fields_cel(),
        f"spec.template.spec.containers: the engine container (name: {pt.ENGINE_CONTAINER}) must not set "
        + ", ".join(pt.ENGINE_OWNED_FIELDS) + ": the operator renders them (use spec.engine.image, "
        "spec.engine.extraArgs, spec.engine.httpPort/masterPort and spec.engine.startupTimeoutSeconds)",
        _engine_owned_field_items,
    ),
    Rule(
        ".template.spec.containers",
        # No CEL: env (and volumeMounts below) are unbounded lists inside the unbounded containers list;
        # the API server estimates such a rule at more than 100x its cost budget and refuses the CRD.
        None,
        "spec.template.spec.containers: the engine container's env must not set variables the operator manages ("
        + ", ".join(OWNED_ENV_NAMES) + f", {OWNED_ENV_PREFIX}*; the test stand-in's {STANDIN_ENV_PREFIX}* "
        "excepted): they switch the engine plugin off or on, set the frontend cache, carry the membership token "
        "and the engine's address",
        _engine_owned_env_items,
    ),
    Rule(
        ".template.spec.containers",
        None,  # over the API server's CEL cost budget, as above
        "spec.template.spec.containers: the engine container's volumeMounts must not use the operator's mount "
        f"paths ({', '.join(pt.OPERATOR_MOUNT_PATHS)}, spec.modelVolume.mountPath, or below "
        f"{' or '.join(pt.OPERATOR_FILE_DIRS)}): they hold the deploy config, the membership token, the "
        "caches and the model; mount elsewhere",
        _engine_owned_mount_items,
    ),
    *(Rule(
        f".template.spec.{field}",
        _gpu_request_cel(field),
        f"spec.template.spec.{field} must not request the GPU resource (spec.gpu.resource): the operator sets it "
        "on the engine container from spec.gpu.count",
        _gpu_request_items(field),
    ) for field in ("containers", "initContainers")),
    Rule(
        ".template.spec.volumes",
        _absent_or("template.spec.volumes", "self.template.spec.volumes.all(v, !(v.name in ["
                   + ", ".join(f"'{v}'" for v in pt.OPERATOR_VOLUMES) + "]))"),
        "spec.template.spec.volumes must not use the operator's volume names (" + ", ".join(pt.OPERATOR_VOLUMES)
        + "): a volume of the same name would replace the deploy config, /dev/shm, the cache, the membership "
        "token or the model volume; name yours differently",
        _owned_volume_items,
    ),
    Rule(
        ".template.spec.restartPolicy",
        "!(" + _present("template.spec.restartPolicy") + ")",
        "spec.template.spec.restartPolicy is the operator's: the head restarts in place (Always), a replica "
        "must not (Never: a restarted replica never registers with the head again and is replaced instead)",
        _owned_pod_field_items("restartPolicy"),
    ),
    Rule(
        ".template.spec.hostNetwork",
        _absent_or("template.spec.hostNetwork", "!self.template.spec.hostNetwork"),
        "spec.template.spec.hostNetwork must not be true: every engine pod listens on the same ports "
        "(spec.engine.httpPort, spec.engine.masterPort, the connectors' from spec.transport.basePort), so two "
        "engine pods on one node would collide on the node's network, and the engine NetworkPolicy does not "
        "apply to host-network pods",
        _host_network_items,
    ),
    Rule(
        ".template.spec.nodeSelector",
        _absent_or("template.spec.nodeSelector", "!(self.gpu.productLabel in self.template.spec.nodeSelector)"),
        "spec.template.spec.nodeSelector must not set the GPU product label (spec.gpu.productLabel): "
        "use spec.gpu.product",
        _product_selector_items,
    ),
    Rule(
        ".placement",
        _placement_conflict_cel(),
        "spec.placement and spec.template.spec must not both set " + ", ".join(_PLACEMENT_EXCLUSIVE.values())
        + ": Kubernetes does not merge these, so the template's would replace the placement's; set each in one place",
        _placement_conflict_items,
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
    problems += _template_schema_problems(spec)
    problems += [(f"spec{r.field}{part}", r.message) for r in SPEC_RULES for part in r.broken(spec)]
    if not problems:
        problems += multi_stage_problems(spec)
    if problems:
        raise InvalidSpec(problems)
    return spec
