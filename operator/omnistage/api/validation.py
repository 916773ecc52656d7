"""Every rule a valid OmniStage obeys beyond per-field constraints.

Each rule is written twice on purpose, once as CEL (the API server enforces it, see crd.py)
and once in Python (`omnistage render` and the reconcile loop enforce it), with one message.
A rule CEL cannot express (cel=None) is enforced by the operator alone: the OmniStage gets
Ready=False, reason InvalidSpec, and its running pods are left alone. The operator's problems name
the exact item or key (spec.engine.extraArgs[2], spec.engine.stageOverrides.runtime.num_replicas).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from omnistage_engine_patches import contract
from pydantic import ValidationError

from .. import names
from ..known_pipelines import PIPELINES as KNOWN_PIPELINES
from ..known_pipelines import SHIPPED_DEPLOY
from . import (
    CONNECTOR_PORT_SPAN,
    MAX_NAME_LENGTH,
    OPERATOR_OWNED_FLAGS,
    OmniStageSpec,
    TransportMode,
    TransportProtocol,
)
from . import podtemplate as pt
from .cachemode import SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP, membership_can_change

# Keys of the rendered stage 0 that carry the cache or the replica count. vllm-omni reads them at
# the top of a stage and inside its nested blocks (runtime:, engine_args:, engine_extras:), so a
# stageOverrides key is checked at any depth.
OPERATOR_OWNED_STAGE_KEYS = ["mm_processor_cache_type", "mm_processor_cache_gb", "num_replicas",
                             "omni_dp_size_local", "stage_id"]

# The operator's environment namespace. OMNISTAGE_STANDIN_* are knobs of the test suite's stand-in
# engine (tests/standin); the real engine and its plugin never read them, so users may set them.
OWNED_ENV_PREFIX = "OMNISTAGE_"
STANDIN_ENV_PREFIX = "OMNISTAGE_STANDIN_"
# Besides the contract's names and the prefix: the engine's address (the master address is $(POD_IP)).
_OWNED_ENV_NAMES = sorted({*(n for n in contract.OPERATOR_OWNED_ENV if not n.startswith(OWNED_ENV_PREFIX)),
                           *pt.ADDRESS_ENV})


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


# ---- spec.engine.extraArgs ----------------------------------------------------------------------
# vLLM's FlexibleArgumentParser (0.30.0) reads a flag as `--flag`, `--flag=v`, `--flag.key=v` (a
# JSON field of the flag), with `_` for `-` after the leading `--`, and abbreviated: argparse's
# allow_abbrev is on, so `--mm-processor-cache-t=shm` sets --mm-processor-cache-type.
# The API server checks the literal spellings (`--flag`, `--flag=`, `--flag.` with - or _), which
# cost CEL only the length of the literals. Cutting the option name out of an argument and
# normalising it costs the length of the argument, which is unbounded: the operator checks the rest.


def _spellings(flag: str) -> list[str]:
    """The flag as written, and with underscores if it is a long flag."""
    if not flag.startswith("--"):
        return [flag]
    return [flag, "--" + flag[2:].replace("-", "_")] if "-" in flag[2:] else [flag]


def _literal_owned_flag(arg: str) -> bool:
    return any(arg == s or arg.startswith((s + "=", s + ".")) for f in OPERATOR_OWNED_FLAGS for s in _spellings(f))


def _flag_name(arg: str) -> str:
    """The option name vLLM's parser looks up for `arg` ("" for a value, not a flag)."""
    if not arg.startswith("-") or len(arg) < 2 or arg[1].isdigit():
        return ""
    name = arg.split("=", 1)[0].split(".", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _resolves_to_owned_flag(arg: str) -> bool:
    """An abbreviation argparse would expand to an owned flag. Three characters ("--x", "-xy")
    at least: shorter is no flag at all. A prefix shared with another flag is ambiguous and
    fails in vLLM anyway, so refusing it costs nothing."""
    name = _flag_name(arg)
    return len(name) >= 3 and any(f.startswith(name) for f in OPERATOR_OWNED_FLAGS)


def _owned_flag_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}]" for i, a in enumerate(spec.engine.extra_args) if _literal_owned_flag(a)]


def _respelled_owned_flag_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}]" for i, a in enumerate(spec.engine.extra_args)
            if _resolves_to_owned_flag(a) and not _literal_owned_flag(a)]


def _owned_flags_cel() -> str:
    tests = [f"a == '{s}' || a.startsWith('{s}=') || a.startsWith('{s}.')"
             for f in OPERATOR_OWNED_FLAGS for s in _spellings(f)]
    return "!has(self.engine.extraArgs) || self.engine.extraArgs.all(a, !(" + " || ".join(tests) + "))"


# ---- spec.engine.env ------------------------------------------------------------------------------


def _owned_env(name: str) -> bool:
    """VLLM_PLUGINS switches the engine plugin off; OMNISTAGE_* are its switches, the resolved
    cache mode and the membership token; POD_IP and VLLM_HOST_IP are the engine's address. The
    operator renders all of them."""
    if name.startswith(STANDIN_ENV_PREFIX):
        return False
    return name in _OWNED_ENV_NAMES or name in contract.OPERATOR_OWNED_ENV or name.startswith(OWNED_ENV_PREFIX)


def _owned_env_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].name" for i, e in enumerate(spec.engine.env) if _owned_env(e.name)]


def _not_owned_env_cel(var: str) -> str:
    """CEL: the env var `var` is not the operator's (the same test as _owned_env)."""
    names = ", ".join(f"'{n}'" for n in _OWNED_ENV_NAMES)
    return (f"!({var}.name in [{names}]) && "
            f"(!{var}.name.startsWith('{OWNED_ENV_PREFIX}') || {var}.name.startsWith('{STANDIN_ENV_PREFIX}'))")


def _owned_env_cel() -> str:
    return f"!has(self.engine.env) || self.engine.env.all(e, {_not_owned_env_cel('e')})"


def _env_value_and_source_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}]" for i, e in enumerate(spec.engine.env) if e.value_from is not None and e.value]


# ---- spec.engine.stageOverrides -------------------------------------------------------------------


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, key) of every mapping key at any depth, lists included."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}"
            yield here, str(key)
            yield from _walk(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def _owned_stage_key(key: str) -> bool:
    # A dashed spelling of an owned key means nothing else, so it is refused too. A stage's env
    # (env:, runtime.env:) reaches its engine processes, so the operator's variables are refused.
    return key.replace("-", "_") in OPERATOR_OWNED_STAGE_KEYS or _owned_env(key)


def _owned_stage_paths(spec: OmniStageSpec) -> list[str]:
    return [path for path, key in _walk(spec.engine.stage_overrides) if _owned_stage_key(key)]


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
            for j, e in pt.objects(c.get("env")) if isinstance(e.get("name"), str) and _owned_env(e["name"])]


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
        _owned_flags_cel(),
        "spec.engine.extraArgs must not set flags the operator manages (" + ", ".join(OPERATOR_OWNED_FLAGS)
        + "; as --flag, --flag=value or --flag.key=value, with - or _); " + _FLAGS_INSTEAD,
        _owned_flag_items,
    ),
    Rule(
        ".engine.extraArgs",
        # Abbreviations and mixed spellings: see above, the operator checks.
        None,
        "spec.engine.extraArgs must not set flags the operator manages in a spelling vLLM expands "
        "(an abbreviation such as --mm-processor-cache-t, or mixed - and _); " + _FLAGS_INSTEAD,
        _respelled_owned_flag_items,
    ),
    Rule(
        ".engine.env",
        _owned_env_cel(),
        "spec.engine.env must not set variables the operator manages (" + ", ".join(_OWNED_ENV_NAMES)
        + f", {OWNED_ENV_PREFIX}*; the test stand-in's {STANDIN_ENV_PREFIX}* excepted): they switch the engine "
        "plugin off or on, set the frontend cache, carry the membership token and the engine's address; use "
        "spec.cache for the cache",
        _owned_env_items,
    ),
    Rule(
        ".engine.stageOverrides",
        # CEL cannot see into a preserve-unknown-fields object, so only the operator checks this.
        None,
        "spec.engine.stageOverrides must not set " + ", ".join(OPERATOR_OWNED_STAGE_KEYS)
        + f" or the operator's variables ({', '.join(_OWNED_ENV_NAMES)}, {OWNED_ENV_PREFIX}*) at any depth "
        "(e.g. runtime.num_replicas, engine_args.mm_processor_cache_type); use spec.cache and spec.replicas instead",
        _owned_stage_paths,
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
        _env_value_and_source_items,
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
        + ", ".join(_OWNED_ENV_NAMES) + f", {OWNED_ENV_PREFIX}*; the test stand-in's {STANDIN_ENV_PREFIX}* "
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

# ---- spec.stages and spec.transport (multi-stage pipelines) ------------------------------------------
# Checked by the operator alone: they read the known-pipelines table, which CEL cannot.


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
        return f"spec.stages needs a multi-stage pipeline here; multi-stage pipelines the operator runs: {renders}"
    if pipeline not in KNOWN_PIPELINES:
        return f"{pipeline!r} is not a vllm-omni pipeline; use a registered key such as {renders}"
    if len(KNOWN_PIPELINES[pipeline]) < 2:
        return f"{pipeline!r} has only stage 0; remove spec.stages"
    if pipeline not in SHIPPED_DEPLOY:
        return f"the operator does not run {pipeline!r} across pods yet; multi-stage pipelines it runs: {renders}"
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
            problems.append((f"spec.stages[{i}].id",
                             f"{pipeline} has no stage {stage_id} after stage 0 (stages 0..{len(names) - 1}); {wanted}"))
    if not problems and ids != remote:
        problems.append(("spec.stages", f"got stage ids {', '.join(map(str, ids)) or 'none'}; {wanted}"))
    return problems


def _stage_name_problems(spec: OmniStageSpec) -> list[tuple[str, str]]:
    names = KNOWN_PIPELINES[spec.pipeline]
    return [(f"spec.stages[{i}].name", f"{spec.pipeline} calls stage {s.id} {names[s.id]!r}; use that or leave it out")
            for i, s in enumerate(spec.stages) if s.name is not None and s.id < len(names) and s.name != names[s.id]]


def _stage_override_problems(spec: OmniStageSpec) -> list[tuple[str, str]]:
    message = ("must not set " + ", ".join(OPERATOR_OWNED_STAGE_KEYS) + " or the operator's variables at any depth: "
               "the operator renders each stage's replicas and ids")
    return [(f"spec.stages[{i}].engine.stageOverrides{path}", message)
            for i, s in enumerate(spec.stages) for path, key in _walk(s.engine.stage_overrides) if _owned_stage_key(key)]


def transport_problems(spec: OmniStageSpec) -> list[tuple[str, str]]:
    transport, problems = spec.transport, []
    if transport is None:
        return []
    if transport.mode == TransportMode.SAME_NODE and transport.protocol == TransportProtocol.RDMA:
        problems.append(("spec.transport.protocol", ("rdma needs mode network (sameNode moves data through /dev/shm); "
                                                    "set mode network or protocol tcp")))
    base, last = transport.base_port, transport.base_port + CONNECTOR_PORT_SPAN - 1
    for name, port in (("httpPort", spec.engine.http_port), ("masterPort", spec.engine.master_port)):
        if base <= port <= last:
            problems.append(("spec.transport.basePort",
                             f"the connectors' ports {base}..{last} hold spec.engine.{name} {port}; move basePort off it"))
    problems += [(f"spec.transport.env[{i}].name", "is the operator's (" + ", ".join(_OWNED_ENV_NAMES)
                  + f", {OWNED_ENV_PREFIX}*); remove it")
                 for i, e in enumerate(transport.env) if _owned_env(e.name)]
    return problems


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
