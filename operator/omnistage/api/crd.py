"""Generate the CustomResourceDefinitions (OmniStage, OmniStagePool) from the API models.

Kubernetes wants a structural OpenAPI v3 schema: every node typed, no $ref, no anyOf for
optional fields. Pydantic's JSON schema is close; `structural` closes the gap. spec.template and
the valueFrom of spec.engine.env and spec.transport.env are Kubernetes' own types: their schema is
generated from the Kubernetes OpenAPI document (podtemplate.schema.json,
hack/gen-podtemplate-schema.py) and embedded here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .. import api
from ..yamlio import dump_all
from . import conditions, podtemplate, statuses
from .child_names import OMNISTAGE_NAME_RULES, POOL_NAME_RULES, NameRule
from .validation import SPEC_RULES

_DROP = {"title"}


def structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline $refs, collapse Optional[...] and drop what Kubernetes rejects."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural(merged, defs)
    if "anyOf" in schema:
        options = [o for o in schema["anyOf"] if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {schema['anyOf']} structurally")
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        return structural({**options[0], **rest}, defs)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROP or (key == "default" and value is None):
            continue
        if key == "additionalProperties" and value is False:
            continue  # Kubernetes forbids it beside properties; unknown fields are pruned anyway
        if key == "exclusiveMinimum":  # JSON Schema 2020 number -> OpenAPI v3.0 boolean form
            out["minimum"], out["exclusiveMinimum"] = value, True
            continue
        if key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = structural(value, defs)
        else:
            out[key] = value
    if out.get("x-kubernetes-preserve-unknown-fields") and out.get("type") == "object":
        out.pop("additionalProperties", None)
    if out.get("type") == "object" and out.get("additionalProperties") is True:
        out.pop("additionalProperties")
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _schema_of(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="serialization")
    defs = raw.pop("$defs", {})
    return structural(raw, defs)


def _sort_enum_defaults(schema: dict[str, Any]) -> None:
    """Enum defaults come out as members; Kubernetes wants the plain string."""
    if "default" in schema and hasattr(schema["default"], "value"):
        schema["default"] = schema["default"].value
    for sub in schema.get("properties", {}).values():
        _sort_enum_defaults(sub)
    if isinstance(schema.get("items"), dict):
        _sort_enum_defaults(schema["items"])


def _kubernetes_type(path: str | None, description: str) -> dict[str, Any]:
    """The generated schema of a Kubernetes type (None: PodTemplateSpec itself) as a CRD carries it."""
    node = podtemplate.schema() if path is None else podtemplate.subschema(path)
    return {**podtemplate.without_patch_markers(node), "description": description}


_TEMPLATE_PARTS = {
    "metadata": "Labels and annotations added to the engine pods (the operator's own are refused).",
    "spec": "Pod spec merged into the engine pods (core/v1 PodSpec; Kubernetes strategic merge).",
}


def _embed_kubernetes_types(spec_schema: dict[str, Any]) -> None:
    props = spec_schema["properties"]
    template = _kubernetes_type(None, props["template"]["description"])
    for part, description in _TEMPLATE_PARTS.items():
        template["properties"][part]["description"] = description
    props["template"] = template
    for owner in ("engine", "transport"):
        env = props[owner]["properties"]["env"]["items"]["properties"]
        env["valueFrom"] = _kubernetes_type("spec.containers.env.valueFrom", env["valueFrom"]["description"])


# Both kinds: what `kubectl get` answers first is whether it works and, if not, why (KServe's READY).
READY_COLUMNS = [
    {
        "name": "Status",
        "type": "string",
        "jsonPath": f'.status.conditions[?(@.type=="{conditions.Type.READY}")].status',
        "description": "The Ready condition",
    },
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": f'.status.conditions[?(@.type=="{conditions.Type.READY}")].reason',
        "description": "Why it is (not) Ready; docs/troubleshooting.md lists every reason",
    },
]


def build_crd() -> dict[str, Any]:
    spec_schema = _schema_of(api.OmniStageSpec)
    _embed_kubernetes_types(spec_schema)
    spec_schema["x-kubernetes-validations"] = [
        {"rule": r.cel, "message": r.message, "fieldPath": r.field} for r in SPEC_RULES if r.cel
    ]
    root = _root(
        "OmniStage runs vllm-omni with a replicated, elastic stage 0 on GPU nodes and keeps its "
        "multimodal caches consistent while replicas join and leave.",
        spec_schema,
        statuses.OmniStageStatus,
    )
    root["x-kubernetes-validations"] = _name_validations(OMNISTAGE_NAME_RULES)
    return _definition(api.KIND, api.PLURAL, api.SINGULAR, api.SHORT_NAMES, root, [
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas",
         "description": "Stage-0 engine replicas wanted (head included)"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas",
         "description": "Engine pods that are Ready"},
        {"name": "Registered", "type": "integer", "jsonPath": ".status.registeredReplicas",
         "description": "Replicas the engine head acknowledged"},
        {"name": "Standby", "type": "integer", "jsonPath": ".status.readyStandbyReplicas",
         "description": "Standby pods one join away from serving (spec.standby)"},
        {"name": "Cache", "type": "string", "jsonPath": ".status.effectiveCacheMode",
         "description": "Resolved stage-0 frontend cache mode"},
        *READY_COLUMNS,
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ])


def _name_validations(rules: tuple[NameRule, ...]) -> list[dict[str, str]]:
    """On the root, the one place CEL sees metadata.name (child_names.py: why each limit)."""
    return [{"rule": r.cel, "message": r.message} for r in rules]


def _definition(kind: str, plural: str, singular: str, short_names: list[str], root: dict[str, Any],
                columns: list[dict[str, Any]]) -> dict[str, Any]:
    """A namespaced kind of the group with status and scale subresources (spec.replicas counted by
    status.replicas over status.selector)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": short_names,
                "categories": ["all"],
            },
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


def _root(description: str, spec_schema: dict[str, Any], status_model: type[BaseModel]) -> dict[str, Any]:
    status_schema = _schema_of(status_model)
    for schema in (spec_schema, status_schema):
        _sort_enum_defaults(schema)
    # Conditions are a map keyed by type (the API conventions): the API server refuses two of one
    # type, and server-side apply and strategic merge merge them by type.
    status_schema["properties"]["conditions"].update({"x-kubernetes-list-type": "map",
                                                       "x-kubernetes-list-map-keys": ["type"]})
    return {
        "type": "object",
        "description": description,
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
        "required": ["spec"],
    }


def build_pool_crd() -> dict[str, Any]:
    """OmniStagePool: the capacity of stages 1..n-1; its own scale subresource (HPA/KEDA per pod group)."""
    root = _root(
        "OmniStagePool runs replicas of an OmniStage's stages after stage 0 (e.g. Qwen3-Omni's talker "
        "and code2wav): each pod one headless process per stage in spec.stageIds, joined on the OmniStage's "
        "head.",
        _schema_of(api.OmniStagePoolSpec),
        statuses.OmniStagePoolStatus,
    )
    root["x-kubernetes-validations"] = _name_validations(POOL_NAME_RULES)
    return _definition(
        api.POOL_KIND,
        api.POOL_PLURAL,
        api.POOL_SINGULAR,
        api.POOL_SHORT_NAMES,
        root,
        [
            {
                "name": "OmniStage",
                "type": "string",
                "jsonPath": ".spec.omniStage",
                "description": "The pipeline",
            },
            {
                "name": "Stages",
                "type": "string",
                "jsonPath": ".spec.stageIds",
                "description": "Stages each pod runs",
            },
            {
                "name": "Desired",
                "type": "integer",
                "jsonPath": ".spec.replicas",
                "description": "Pods wanted",
            },
            {
                "name": "Ready",
                "type": "integer",
                "jsonPath": ".status.readyReplicas",
                "description": "Pods that are Ready",
            },
            {
                "name": "Registered",
                "type": "integer",
                "jsonPath": ".status.registeredReplicas",
                "description": "Pods joined on the head for every one of their stages",
            },
            {
                "name": "Standby",
                "type": "integer",
                "jsonPath": ".status.readyStandbyReplicas",
                "description": "Standby pods one join away from serving (spec.standby)",
            },
            *READY_COLUMNS,
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    )


def crd_yaml() -> str:
    return dump_all([build_crd(), build_pool_crd()])
