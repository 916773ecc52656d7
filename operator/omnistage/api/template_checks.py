"""What the spec.template rows (template_rules.py) check: for each thing the template must not set, its
CEL (the API server's check) and the Python that names the offending items (the operator's), and the
CEL helpers every row uses (present, absent_or). Each reads the template defensively: a wrongly typed
part is the schema check's to report (template_schema_problems).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import names
from . import podtemplate as pt
from .owned import (
    OWNED_ENV_PREFIX,
    STANDIN_ENV_PREFIX,
    env_secret_cel,
    env_secret_items,
    membership_secret,
    not_membership_secret_cel,
    not_owned_env_cel,
    owned_env,
)
from .security import (
    ALLOWED_CAPABILITIES,
    MEMBERSHIP_SECRET_SUFFIX,
    SYSTEM_PRIORITY_CLASSES,
    cel_list,
    gpu_runtime_env,
    gpu_runtime_env_cel,
    gpu_runtime_prefix_cel,
    gpu_runtime_prefix_fenced,
)
from .specs import OmniStageSpec


def present(path: str) -> str:
    """CEL: every step of self.<path> is present (has() of a missing parent is an error)."""
    parts = path.split(".")
    return " && ".join(f"has(self.{'.'.join(parts[:i + 1])})" for i in range(len(parts)))


def absent_or(path: str, holds: str) -> str:
    return f"!({present(path)}) || {holds}"


def _template_meta(spec: OmniStageSpec, key: str) -> dict[str, Any]:
    return pt.mapping(spec.template, "metadata", key)


def _owned_label(key: str) -> bool:
    return key in names.OPERATOR_LABELS or key.startswith(names.GROUP + "/")


def owned_label_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{k}]" for k in _template_meta(spec, "labels") if _owned_label(k)]


def owned_annotation_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{k}]" for k in _template_meta(spec, "annotations") if k.startswith(names.GROUP + "/")]


def engine_owned_field_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].{f}" for i, c in pt.engine_containers(spec.template) for f in pt.ENGINE_OWNED_FIELDS
            if c.get(f) is not None]


def engine_owned_env_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].env[{j}].name" for i, c in pt.engine_containers(spec.template)
            for j, e in pt.objects(c.get("env")) if isinstance(e.get("name"), str) and owned_env(e["name"])]


def _owned_mount_paths(spec: OmniStageSpec) -> list[str]:
    paths = [*pt.OPERATOR_MOUNT_PATHS, *([spec.model_volume.mount_path] if spec.model_volume else [])]
    return [form for p in paths for form in (p, p + "/")]


def _owned_mount(path: str, spec: OmniStageSpec) -> bool:
    return path in _owned_mount_paths(spec) or any(path.startswith(d + "/") for d in pt.OPERATOR_FILE_DIRS)


def engine_owned_mount_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].volumeMounts[{j}].mountPath" for i, c in pt.engine_containers(spec.template)
            for j, m in pt.objects(c.get("volumeMounts"))
            if isinstance(m.get("mountPath"), str) and _owned_mount(m["mountPath"], spec)]


def _engine_container_cel(holds: str) -> str:
    """CEL: `holds` (about container c) is true of the engine container of spec.template."""
    return absent_or("template.spec.containers",
                     f"self.template.spec.containers.all(c, c.name != '{pt.ENGINE_CONTAINER}' || ({holds}))")


def engine_owned_fields_cel() -> str:
    return _engine_container_cel("!(" + " || ".join(f"has(c.{f})" for f in pt.ENGINE_OWNED_FIELDS) + ")")


def engine_owned_env_cel() -> str:
    return _engine_container_cel(f"!has(c.env) || c.env.all(e, {not_owned_env_cel('e')})")


def _owned_env_prefix(prefix: str) -> bool:
    """An envFrom prefix that names the operator's variables (the stand-in's excepted, as in owned_env)."""
    return prefix.startswith(OWNED_ENV_PREFIX) and not prefix.startswith(STANDIN_ENV_PREFIX)


def engine_env_prefix_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].envFrom[{j}].prefix" for i, c in pt.engine_containers(spec.template)
            for j, f in pt.objects(c.get("envFrom"))
            if isinstance(f.get("prefix"), str) and _owned_env_prefix(f["prefix"])]


def engine_env_prefix_cel() -> str:
    return _engine_container_cel(
        f"!has(c.envFrom) || c.envFrom.all(f, !has(f.prefix) || !f.prefix.startsWith('{OWNED_ENV_PREFIX}') "
        f"|| f.prefix.startsWith('{STANDIN_ENV_PREFIX}'))")


def gpu_request_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    def broken(spec: OmniStageSpec) -> list[str]:
        gpu = spec.gpu.resource
        return [f"[{i}].resources.{kind}[{gpu}]" for i, c in pt.spec_items(spec.template, field)
                for kind in ("limits", "requests") if gpu in pt.mapping(c, "resources", kind)]
    return broken


def gpu_request_cel(field: str) -> str:
    return absent_or(f"template.spec.{field}", f"self.template.spec.{field}.all(c, !has(c.resources) || ("
                     "(!has(c.resources.limits) || !(self.gpu.resource in c.resources.limits)) && "
                     "(!has(c.resources.requests) || !(self.gpu.resource in c.resources.requests))))")


# Pod fields spec.template must not set, and why (the message's end): what the operator renders, and
# nodeName, which places a pod past the scheduler.
UNSET_POD_FIELDS = {
    "restartPolicy": "is the operator's: the head restarts in place (Always), a replica must not (Never: a "
    "restarted replica never registers with the head again and is replaced instead)",
    "terminationGracePeriodSeconds": "is the operator's: the engine pods' lifecycle is, and their grace "
    "period is the drain (spec.engine.drainTimeoutSeconds, an OmniStagePool's drainTimeoutSeconds) plus "
    "vLLM's shutdown, so a pod deleted or evicted finishes its requests first; set the drain timeout instead",
    "activeDeadlineSeconds": "is the operator's: the engine pods' lifecycle is, and a deadline would kill a "
    "serving engine pod without a drain; spec.replicas and spec.rollout decide when engine pods end",
    "nodeName": "must not be set: it puts the pod on a node past the scheduler (the GPU capacity, taints, "
    "the GPU product selector); use spec.placement.nodeSelector or affinity",
    "schedulingGates": "must not be set: the operator decides when its pods start, and a gate only "
    "an outside controller removes holds a head or a surge pod Pending while the operator waits for it; "
    "remove them (a queueing controller such as Kueue adds its own gates at admission)",
}

# Host namespaces, each refused when true, and why.
HOST_NAMESPACES = {
    "hostNetwork": "every engine pod listens on the same ports (spec.engine.httpPort, "
    "spec.engine.masterPort, the connectors' from spec.transport.basePort), so two engine pods on one node "
    "would collide on the node's network, and the engine NetworkPolicy does not apply to host-network pods",
    "hostPID": "the pod would see every process of the node (the kubelet's, other tenants' engines), signal "
    "them and read their environment through /proc",
    "hostIPC": "the pod would share the node's System V IPC and POSIX shared memory with every process on it",
}


# Namespaces the pod's own containers would share, each refused when true, and why.
SHARED_NAMESPACES = {
    "shareProcessNamespace": "a sidecar would see the engine's processes, and through /proc/PID/root "
    "its files: the membership token only the engine container mounts (the master token in a head); "
    "remove it, and share files through a volume",
}


def set_pod_field_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    return lambda s: [""] if pt.mapping(s.template, "spec").get(field) is not None else []


def true_pod_field_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    return lambda s: [""] if pt.mapping(s.template, "spec").get(field) is True else []


def system_priority_items(spec: OmniStageSpec) -> list[str]:
    return (
        [""] if pt.mapping(spec.template, "spec").get("priorityClassName") in SYSTEM_PRIORITY_CLASSES else []
    )


def system_priority_cel() -> str:
    return absent_or("template.spec.priorityClassName",
                     f"!(self.template.spec.priorityClassName in {cel_list(SYSTEM_PRIORITY_CLASSES)})")


# ---- every container of spec.template (containers, initContainers; sidecars are either) ------------

ESCALATIONS = ("privileged", "allowPrivilegeEscalation")


def _containers_cel(field: str, holds: str) -> str:
    """CEL: `holds` (about container c) is true of every container in template.spec.<field>."""
    return absent_or(f"template.spec.{field}", f"self.template.spec.{field}.all(c, {holds})")


def escalation_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    return lambda s: [f"[{i}].securityContext.{k}" for i, c in pt.spec_items(s.template, field)
                      for k in ESCALATIONS if pt.mapping(c, "securityContext").get(k) is True]


def escalation_cel(field: str) -> str:
    return _containers_cel(field, "!has(c.securityContext) || (" + " && ".join(
        f"(!has(c.securityContext.{k}) || !c.securityContext.{k})" for k in ESCALATIONS) + ")")


def capability_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    def broken(spec: OmniStageSpec) -> list[str]:
        out = []
        for i, c in pt.spec_items(spec.template, field):
            added = pt.mapping(c, "securityContext", "capabilities").get("add")
            out += [f"[{i}].securityContext.capabilities.add[{j}]" for j, cap in enumerate(added)
                    if cap not in ALLOWED_CAPABILITIES] if isinstance(added, list) else []
        return out
    return broken


def capability_cel(field: str) -> str:
    caps = "c.securityContext.capabilities"
    return _containers_cel(field, f"!has(c.securityContext) || !has({caps}) || !has({caps}.add) || "
                                  f"{caps}.add.all(a, a in {cel_list(ALLOWED_CAPABILITIES)})")


def container_secret_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    def broken(spec: OmniStageSpec) -> list[str]:
        out = []
        for i, c in pt.spec_items(spec.template, field):
            out += [f"[{i}].env{item}" for item in env_secret_items(
                [(j, e.get("valueFrom")) for j, e in pt.objects(c.get("env"))])]
            out += [f"[{i}].envFrom[{j}].secretRef.name" for j, f in pt.objects(c.get("envFrom"))
                    if membership_secret(pt.mapping(f, "secretRef").get("name"))]
        return out
    return broken


def _engine_exempt(field: str) -> bool:
    """Whether the engine container is exempt: the engine of template.spec.containers (an init container
    named engine is not the engine)."""
    return field == "containers"


def token_mount_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    return lambda s: [f"[{i}].volumeMounts[{j}].name" for i, c in pt.spec_items(s.template, field)
                      if not (_engine_exempt(field) and c.get("name") == pt.ENGINE_CONTAINER)
                      for j, m in pt.objects(c.get("volumeMounts")) if m.get("name") == pt.V_TOKEN]


def token_mount_cel(field: str) -> str:
    engine = f"c.name == '{pt.ENGINE_CONTAINER}' || " if _engine_exempt(field) else ""
    return _containers_cel(
        field, f"{engine}!has(c.volumeMounts) || c.volumeMounts.all(m, m.name != '{pt.V_TOKEN}')"
    )


def gpu_env_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    """The GPU runtime's variables (security.GPU_RUNTIME_ENV_PREFIX) in env, and envFrom entries
    whose prefix does not keep their keys out of that namespace."""
    def broken(spec: OmniStageSpec) -> list[str]:
        out = []
        for i, c in pt.spec_items(spec.template, field):
            out += [f"[{i}].env[{j}].name" for j, e in pt.objects(c.get("env"))
                    if gpu_runtime_env(e.get("name"))]
            out += [f"[{i}].envFrom[{j}].prefix" for j, f in pt.objects(c.get("envFrom"))
                    if not gpu_runtime_prefix_fenced(f.get("prefix"))]
        return out
    return broken


def gpu_env_cel(field: str) -> str:
    return _containers_cel(field, f"(!has(c.env) || c.env.all(e, {gpu_runtime_env_cel('e.name')})) && "
                                  f"(!has(c.envFrom) || c.envFrom.all(f, {gpu_runtime_prefix_cel('f')}))")


def port_name_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    """Ports named as the operator names the engine's: the NetworkPolicy and the Services open and
    target ports by name, in every container of the pod."""
    return lambda s: [f"[{i}].ports[{j}].name" for i, c in pt.spec_items(s.template, field)
                      if not (_engine_exempt(field) and c.get("name") == pt.ENGINE_CONTAINER)
                      for j, p in pt.objects(c.get("ports")) if p.get("name") in pt.OPERATOR_PORT_NAMES]


def port_name_cel(field: str) -> str:
    engine = f"c.name == '{pt.ENGINE_CONTAINER}' || " if _engine_exempt(field) else ""
    return _containers_cel(field, f"{engine}!has(c.ports) || c.ports.all(p, !has(p.name) || "
                                  f"!(p.name in {cel_list(pt.OPERATOR_PORT_NAMES)}))")


def container_secret_cel(field: str) -> str:
    return _containers_cel(
        field,
        f"(!has(c.env) || c.env.all(e, {env_secret_cel('e')})) && "
        f"(!has(c.envFrom) || c.envFrom.all(f, {not_membership_secret_cel('f.secretRef')}))",
    )


MEMBERSHIP_SECRETS = (
    f"a Secret named *{MEMBERSHIP_SECRET_SUFFIX}: NAME{MEMBERSHIP_SECRET_SUFFIX} holds an "
    "OmniStage's membership token, which makes its engines join and leave; read another Secret"
)


def product_selector_items(spec: OmniStageSpec) -> list[str]:
    selector = pt.mapping(spec.template, "spec", "nodeSelector")
    return [f"[{spec.gpu.product_label}]"] if spec.gpu.product_label in selector else []


# spec.placement's fields that are single values or atomic lists in a PodSpec: a template value would
# replace the placement's entirely (tolerations and affinity's terms are not merged by Kubernetes).
PLACEMENT_EXCLUSIVE = {"tolerations": "tolerations", "affinity": "affinity",
                       "priority_class_name": "priorityClassName", "scheduler_name": "schedulerName"}


def placement_conflict_items(spec: OmniStageSpec) -> list[str]:
    pod = pt.mapping(spec.template, "spec")
    return [f".{name}" for field, name in PLACEMENT_EXCLUSIVE.items()
            if field in spec.placement.model_fields_set and pod.get(name) is not None]


def placement_conflict_cel() -> str:
    return " && ".join(f"!(has(self.placement.{n}) && {present('template.spec.' + n)})"
                       for n in PLACEMENT_EXCLUSIVE.values())


def template_schema_problems(spec: OmniStageSpec) -> list[tuple[str, str]]:
    """What the API server's schema would refuse in spec.template and the env lists' valueFrom (it
    does refuse it there; `omnistage render` and objects from elsewhere meet this check)."""
    problems = []
    if spec.template is not None:
        problems += pt.schema_problems(spec.template, pt.schema(), "spec.template")
    value_from = pt.subschema("spec.containers.env.valueFrom")
    for path, env in (
        ("engine.env", spec.engine.env),
        ("transport.env", spec.transport.env if spec.transport else []),
    ):
        for i, e in enumerate(env):
            if e.value_from is not None:
                problems += pt.schema_problems(e.value_from, value_from, f"spec.{path}[{i}].valueFrom")
    return problems
