"""The spec.template rows of validation.SPEC_RULES: for each thing the template must not set, its CEL
(the API server's check) and the Python that names the offending items (the operator's). The
template's schema is the API server's (crd.py); these rules keep what the operator renders the
operator's. Each reads the template defensively: a wrongly typed part is the schema check's to report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import names
from . import podtemplate as pt
from .owned import owned_env
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


def owned_volume_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].name" for i, v in pt.spec_items(spec.template, "volumes") if v.get("name") in pt.OPERATOR_VOLUMES]


def owned_pod_field_items(field: str) -> Callable[[OmniStageSpec], list[str]]:
    return lambda s: [""] if pt.mapping(s.template, "spec").get(field) is not None else []


def host_network_items(spec: OmniStageSpec) -> list[str]:
    return [""] if pt.mapping(spec.template, "spec").get("hostNetwork") is True else []


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
