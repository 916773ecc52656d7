"""Every rule a valid OmniStage obeys beyond per-field constraints.

Each rule is written twice on purpose, once as CEL (the API server enforces it, see crd.py)
and once in Python (`omnistage render` and the reconcile loop enforce it), with one message.
A rule CEL cannot express (cel=None) is enforced by the operator alone: the OmniStage gets
Ready=False, reason InvalidSpec, and its running pods are left alone. The operator's problems name
the exact item or key (spec.engine.extraArgs[2], spec.engine.stageOverrides.runtime.num_replicas).

This module is the table (SPEC_RULES) and the check that runs it (validate_omnistage); the longer
predicates behind its rows are in owned.py (what the operator sets), template_rules.py (what
spec.template must not set) and pipeline_rules.py (the multi-stage rules, Python only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omnistage_engine_patches import contract
from pydantic import ValidationError

from .. import names
from ..known_pipelines import PIPELINES as KNOWN_PIPELINES
from . import podtemplate as pt
from .cachemode import SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP, membership_can_change
from .child_names import OMNISTAGE_NAME_RULES, name_problems
from .conditions import Reason
from .owned import (
    OPERATOR_OWNED_FLAGS,
    OPERATOR_OWNED_STAGE_KEYS,
    OWNED_ENV_NAMES,
    OWNED_ENV_PREFIX,
    STANDIN_ENV_PREFIX,
    argv_expansion_cel,
    argv_expansion_items,
    env_secret_cel,
    env_value_and_source_items,
    host_path_outside_allow_list,
    owned_env_cel,
    owned_env_items,
    owned_flag_items,
    owned_flags_cel,
    owned_stage_paths,
    respelled_owned_flag_items,
    spec_env_secret_items,
)
from .pipeline_rules import multi_stage_problems
from .security import ALLOWED_CAPABILITIES, ALLOWED_HOST_PATHS_ENV, system_priority_message
from .specs import OmniStageSpec
from .template_rules import (
    HOST_NAMESPACES,
    MEMBERSHIP_SECRETS,
    PLACEMENT_EXCLUSIVE,
    UNSET_POD_FIELDS,
    absent_or,
    capability_cel,
    capability_items,
    container_secret_cel,
    container_secret_items,
    engine_env_prefix_cel,
    engine_env_prefix_items,
    engine_owned_env_cel,
    engine_owned_env_items,
    engine_owned_field_items,
    engine_owned_fields_cel,
    engine_owned_mount_items,
    escalation_cel,
    escalation_items,
    gpu_request_cel,
    gpu_request_items,
    host_path_volume_items,
    owned_annotation_items,
    owned_label_items,
    owned_volume_items,
    placement_conflict_cel,
    placement_conflict_items,
    present,
    product_selector_items,
    secret_volume_cel,
    secret_volume_items,
    set_pod_field_items,
    system_priority_cel,
    system_priority_items,
    template_schema_problems,
    token_mount_cel,
    token_mount_items,
    true_pod_field_items,
)


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


def _model_volume_one_source(spec: OmniStageSpec) -> bool:
    mv = spec.model_volume
    return mv is None or (mv.pvc is not None) + (mv.host_path is not None) == 1


# Pipelines with stages 1..n: the head waits at startup for a replica of every remote stage, so such a
# pipeline needs spec.stages (and OmniStagePools to run them).
MULTI_STAGE_PIPELINES = sorted(key for key, stages in KNOWN_PIPELINES.items() if len(stages) > 1)
SINGLE_STAGE_EXAMPLES = (
    "qwen3_omni_moe_thinker_only",
    "qwen2_5_omni_thinker_only",
    "ming_flash_omni_thinker_only",
)

_FLAGS_INSTEAD = (
    "the operator renders them: set spec.cache for the multimodal cache, spec.replicas for "
    "replicas, spec.engine.httpPort/masterPort for ports, spec.engine.heartbeatTimeoutSeconds for the "
    "heartbeat timeout and spec.engine.stageOverrides for other stage-0 keys"
)

SPEC_RULES = [
    Rule(
        ".pipeline",
        "!has(self.pipeline) || !(self.pipeline in ["
        + ", ".join(f"'{p}'" for p in MULTI_STAGE_PIPELINES)
        + "]) || (has(self.stages) && size(self.stages) > 0)",
        "spec.pipeline names a multi-stage vllm-omni pipeline (stages after stage 0, e.g. qwen3_omni_moe: "
        "thinker, talker, code2wav) and the head waits for every stage at startup: list stages 1..n-1 in "
        "spec.stages and run them with OmniStagePools, or use a single-stage pipeline such as "
        + ", ".join(SINGLE_STAGE_EXAMPLES),
        _unless(lambda s: s.pipeline not in MULTI_STAGE_PIPELINES or bool(s.stages)),
    ),
    Rule(
        ".cache.mode",
        f"!(self.cache.mode in [{', '.join(repr(m) for m in contract.SENDER_CACHE_MODES)}] "
        "&& (self.membership == 'dynamic' || self.replicas > 1))",
        SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP,
        _unless(lambda s: not (s.cache.mode in contract.SENDER_CACHE_MODES
                               and membership_can_change(s.membership, s.replicas))),
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
        ".engine.membershipPort",
        "self.engine.membershipPort != self.engine.httpPort && self.engine.membershipPort != "
        "self.engine.masterPort",
        "spec.engine.membershipPort must differ from spec.engine.httpPort and spec.engine.masterPort",
        _unless(lambda s: s.engine.membership_port not in (s.engine.http_port, s.engine.master_port)),
    ),
    Rule(
        ".engine.extraArgs",
        owned_flags_cel(),
        "spec.engine.extraArgs must not set flags the operator manages ("
        + ", ".join(OPERATOR_OWNED_FLAGS)
        + "; as --flag, --flag=value or --flag.key=value, with - or _); "
        + _FLAGS_INSTEAD,
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
        ".engine.extraArgs",
        argv_expansion_cel(),
        "spec.engine.extraArgs must not contain $( : Kubernetes replaces $(VAR) in a container's arguments "
        "with the variable's value (a Secret's too) and vLLM publishes some of them (--served-model-name on "
        "/v1/models); the operator builds the engine's command line, so write every value literally",
        argv_expansion_items,
    ),
    Rule(
        ".engine.env",
        owned_env_cel(),
        "spec.engine.env must not set variables the operator manages ("
        + ", ".join(OWNED_ENV_NAMES)
        + f", {OWNED_ENV_PREFIX}*; the test stand-in's {STANDIN_ENV_PREFIX}* excepted): they switch the "
        "engine plugin off or on, set the frontend cache, carry the membership token and the engine's "
        "address; use spec.cache for the cache",
        owned_env_items,
    ),
    Rule(
        ".engine.stageOverrides",
        # CEL cannot see into a preserve-unknown-fields object, so only the operator checks this.
        None,
        "spec.engine.stageOverrides must not set "
        + ", ".join(OPERATOR_OWNED_STAGE_KEYS)
        + f" or the operator's variables ({', '.join(OWNED_ENV_NAMES)}, {OWNED_ENV_PREFIX}*) at any depth "
        "(e.g. runtime.num_replicas, engine_args.mm_processor_cache_type); use spec.cache and spec.replicas "
        "instead",
        owned_stage_paths,
    ),
    Rule(
        ".modelVolume",
        "!has(self.modelVolume) || (has(self.modelVolume.pvc) ? 1 : 0) + (has(self.modelVolume.hostPath) ? 1 "
        ": 0) == 1",
        "spec.modelVolume needs exactly one of pvc or hostPath",
        _unless(_model_volume_one_source),
    ),
    Rule(
        ".engine.env",
        "!has(self.engine.env) || self.engine.env.all(e, !has(e.valueFrom) || !has(e.value) || e.value == "
        "'')",
        "spec.engine.env entries take value or valueFrom, not both",
        env_value_and_source_items,
    ),
    *(
        Rule(
            f".{path}",
            absent_or(path, f"self.{path}.all(e, {env_secret_cel('e')})"),
            f"spec.{path} must not take a value from {MEMBERSHIP_SECRETS}",
            spec_env_secret_items(env),
        )
        for path, env in (
            ("engine.env", lambda s: s.engine.env),
            ("transport.env", lambda s: s.transport.env if s.transport else []),
        )
    ),
    Rule(
        ".modelVolume.hostPath.path",
        # The operator's configuration, which the API server cannot see; it refuses only what is never
        # allowed (the field's own rule, security.HOST_PATH).
        None,
        "spec.modelVolume.hostPath.path must be at or below a host directory the operator's administrator "
        f"allows ({ALLOWED_HOST_PATHS_ENV} of the operator: `omnistage run --allowed-host-paths`, the chart "
        "value allowedHostPaths; none by default): a host directory is open to every pod that mounts it, so "
        "the cluster decides which; use spec.modelVolume.pvc, or ask for the directory to be allowed",
        host_path_outside_allow_list,
    ),
    Rule(
        ".template.metadata.labels",
        absent_or(
            "template.metadata.labels",
            "self.template.metadata.labels.all(k, !(k in ["
            + ", ".join(f"'{k}'" for k in names.OPERATOR_LABELS)
            + f"]) && !k.startsWith('{names.GROUP}/'))",
        ),
        "spec.template.metadata.labels must not set the operator's labels "
        f"({', '.join(names.OPERATOR_LABELS)}, {names.GROUP}/*): the Services, the NetworkPolicy and the "
        "scale selector find the engine pods by them",
        owned_label_items,
    ),
    Rule(
        ".template.metadata.annotations",
        absent_or(
            "template.metadata.annotations",
            f"self.template.metadata.annotations.all(k, !k.startsWith('{names.GROUP}/'))",
        ),
        f"spec.template.metadata.annotations must not set {names.GROUP}/* annotations: they carry the "
        "operator's pod template hash and each replica's head",
        owned_annotation_items,
    ),
    Rule(
        ".template.spec.containers",
        engine_owned_fields_cel(),
        f"spec.template.spec.containers: the engine container (name: {pt.ENGINE_CONTAINER}) must not set "
        + ", ".join(pt.ENGINE_OWNED_FIELDS)
        + ": the operator renders them (use spec.engine.image, "
        "spec.engine.extraArgs, spec.engine.httpPort/masterPort and spec.engine.startupTimeoutSeconds)",
        engine_owned_field_items,
    ),
    Rule(
        ".template.spec.containers",
        engine_owned_env_cel(),
        "spec.template.spec.containers: the engine container's env must not set variables the operator "
        "manages ("
        + ", ".join(OWNED_ENV_NAMES)
        + f", {OWNED_ENV_PREFIX}*; the test stand-in's {STANDIN_ENV_PREFIX}* excepted): they switch the "
        "engine plugin off or on, set the frontend cache, carry the membership token and the engine's "
        "address",
        engine_owned_env_items,
    ),
    Rule(
        ".template.spec.containers",
        engine_env_prefix_cel(),
        "spec.template.spec.containers: the engine container's envFrom must not use a prefix in the "
        f"operator's namespace ({OWNED_ENV_PREFIX}*; the test stand-in's {STANDIN_ENV_PREFIX}* excepted): it "
        "would set the operator's variables; use another prefix",
        engine_env_prefix_items,
    ),
    Rule(
        ".template.spec.containers",
        # No CEL: comparing every mount path with spec.modelVolume.mountPath (a string of any length, with
        # and without a trailing /) is estimated at more than 100x the API server's CEL cost budget, even
        # with volumeMounts bounded (hack/gen-podtemplate-schema.py).
        None,
        "spec.template.spec.containers: the engine container's volumeMounts must not use the operator's "
        f"mount paths ({', '.join(pt.OPERATOR_MOUNT_PATHS)}, spec.modelVolume.mountPath, or below "
        f"{' or '.join(pt.OPERATOR_FILE_DIRS)}): they hold the deploy config, the membership token, the "
        "caches and the model; mount elsewhere",
        engine_owned_mount_items,
    ),
    *(
        Rule(
            f".template.spec.{field}",
            gpu_request_cel(field),
            f"spec.template.spec.{field} must not request the GPU resource (spec.gpu.resource): the operator "
            "sets it on the engine container from spec.gpu.count",
            gpu_request_items(field),
        )
        for field in ("containers", "initContainers")
    ),
    # The security model (docs/security.md), for every container: the engine, sidecars, init containers.
    *(
        rule
        for field in ("containers", "initContainers")
        for rule in (
            Rule(
                f".template.spec.{field}",
                escalation_cel(field),
                f"spec.template.spec.{field}: no container may set securityContext.privileged or "
                "allowPrivilegeEscalation to true: a privileged container is root on the node (every device "
                "and capability), and privilege escalation (setuid binaries, file capabilities) undoes the "
                "engine pods' hardening; remove them",
                escalation_items(field),
            ),
            Rule(
                f".template.spec.{field}",
                capability_cel(field),
                f"spec.template.spec.{field}: securityContext.capabilities.add may hold only "
                f"{' and '.join(ALLOWED_CAPABILITIES)} (pinned memory for GPU and RDMA transfers, NUMA "
                "binding): engine containers drop every capability, and any other (SYS_ADMIN, NET_ADMIN, "
                "SYS_PTRACE...) is a step towards the node",
                capability_items(field),
            ),
            Rule(
                f".template.spec.{field}",
                container_secret_cel(field),
                f"spec.template.spec.{field}: env valueFrom.secretKeyRef and envFrom secretRef must not "
                "refer to "
                + MEMBERSHIP_SECRETS,
                container_secret_items(field),
            ),
            Rule(
                f".template.spec.{field}",
                token_mount_cel(field),
                f"spec.template.spec.{field}: only the engine container may mount the operator's volume "
                f"{pt.V_TOKEN}: it holds the OmniStage's membership token, which makes its engines join and "
                "leave",
                token_mount_items(field),
            ),
        )
    ),
    Rule(
        ".template.spec.volumes",
        # The operator's allow-list, which the API server cannot see; a check of each volume's path
        # in CEL (up to 256 volumes) would cost past the API server's budget for the whole schema.
        None,
        "spec.template.spec.volumes may mount only host directories (hostPath) the operator's administrator "
        f"allows ({ALLOWED_HOST_PATHS_ENV} of the operator: `omnistage run --allowed-host-paths`, the chart "
        "value allowedHostPaths; none by default), each a plain absolute path other than / without '.' or "
        "'..' segments or '//': any other node directory (the container runtime's socket, /etc, the "
        "kubelet's files) is a way onto the node; bring the weights with spec.modelVolume (a "
        "PersistentVolumeClaim, or an allowed directory)",
        host_path_volume_items,
    ),
    Rule(
        ".template.spec.volumes",
        secret_volume_cel(),
        f"spec.template.spec.volumes (secret, projected) must not mount {MEMBERSHIP_SECRETS}",
        secret_volume_items,
    ),
    Rule(
        ".template.spec.volumes",
        absent_or(
            "template.spec.volumes",
            "self.template.spec.volumes.all(v, !(v.name in ["
            + ", ".join(f"'{v}'" for v in pt.OPERATOR_VOLUMES)
            + "]))",
        ),
        "spec.template.spec.volumes must not use the operator's volume names ("
        + ", ".join(pt.OPERATOR_VOLUMES)
        + "): a volume of the same name would replace the deploy config, /dev/shm, the cache, the membership "
        "token or the model volume; name yours differently",
        owned_volume_items,
    ),
    *(
        Rule(
            f".template.spec.{field}",
            "!(" + present(f"template.spec.{field}") + ")",
            f"spec.template.spec.{field} {why}",
            set_pod_field_items(field),
        )
        for field, why in UNSET_POD_FIELDS.items()
    ),
    *(
        Rule(
            f".template.spec.{field}",
            absent_or(f"template.spec.{field}", f"!self.template.spec.{field}"),
            f"spec.template.spec.{field} must not be true: {why}",
            true_pod_field_items(field),
        )
        for field, why in HOST_NAMESPACES.items()
    ),
    Rule(
        ".template.spec.priorityClassName",
        system_priority_cel(),
        system_priority_message("spec.template.spec.priorityClassName"),
        system_priority_items,
    ),
    Rule(
        ".template.spec.nodeSelector",
        absent_or(
            "template.spec.nodeSelector", "!(self.gpu.productLabel in self.template.spec.nodeSelector)"
        ),
        "spec.template.spec.nodeSelector must not set the GPU product label (spec.gpu.productLabel): "
        "use spec.gpu.product",
        product_selector_items,
    ),
    Rule(
        ".placement",
        placement_conflict_cel(),
        "spec.placement and spec.template.spec must not both set "
        + ", ".join(PLACEMENT_EXCLUSIVE.values())
        + ": Kubernetes does not merge these, so the template's would replace the placement's; set each in "
          "one place",
        placement_conflict_items,
    ),
]

class InvalidSpec(ValueError):
    """A spec the operator will not act on; `problems` are (field, message) pairs; `reason` is the
    ConfigRendered and Ready reason it sets (InvalidSpec, or ConfigTooLarge: render/target.py)."""

    def __init__(self, problems: list[tuple[str, str]], reason: str = Reason.INVALID_SPEC):
        self.problems, self.reason = problems, reason
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))


def _pydantic_problems(err: ValidationError) -> list[tuple[str, str]]:
    out = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        extra = (
            f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
        )
        out.append((f"spec.{path}" if path else "spec", f"{e['msg']}{extra}"))
    return out


def validate_omnistage(obj: dict[str, Any]) -> OmniStageSpec:
    """Parse and check an OmniStage object; raises InvalidSpec naming every offending field."""
    name = (obj.get("metadata") or {}).get("name") or ""
    problems: list[tuple[str, str]] = []
    if not name:
        problems.append(("metadata.name", "is required"))
    else:
        problems += name_problems(name, OMNISTAGE_NAME_RULES)
    try:
        spec = OmniStageSpec.model_validate(obj.get("spec") or {})
    except ValidationError as err:
        raise InvalidSpec(problems + _pydantic_problems(err)) from None
    problems += template_schema_problems(spec)
    problems += [(f"spec{r.field}{part}", r.message) for r in SPEC_RULES for part in r.broken(spec)]
    if not problems:
        problems += multi_stage_problems(spec)
    if problems:
        raise InvalidSpec(problems)
    return spec
