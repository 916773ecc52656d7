"""spec.template: a core/v1 PodTemplateSpec overlay on the engine pods, and what in them is the operator's.

The schema (podtemplate.schema.json) is generated from the Kubernetes OpenAPI document of the
version the project builds against (hack/gen-podtemplate-schema.py). It is used three ways: crd.py
embeds it (the API server validates spec.template and `kubectl explain` describes it), `schema_problems`
checks a template where no API server did (`omnistage render`), and `strategic_merge` reads the
strategic-merge-patch rules from its x-kubernetes-patch-merge-key / x-kubernetes-patch-strategy
markers, so a list merges exactly as `kubectl patch --type=strategic` would merge it.

Everything here is pure: the same input gives the same output, nothing is read but the schema file.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omnistage_engine_patches import contract

# Beside the package root, where hack/gen-podtemplate-schema.py writes it.
SCHEMA_FILE = Path(__file__).parents[1] / "podtemplate.schema.json"

# ---- what the operator owns in an engine pod ------------------------------------------------------
# Names the renderers write and validation refuses in spec.template; both import them from here.

ENGINE_CONTAINER = "engine"

CONFIG_DIR = "/etc/omnistage"
TOKEN_DIR = "/var/run/secrets/omnistage"
CACHE_DIR = "/root/.cache"
SHM_DIR = "/dev/shm"
# The operator's files live in these; a mount at or below them would hide the deploy config or the
# membership token.
OPERATOR_FILE_DIRS = (CONFIG_DIR, TOKEN_DIR)
OPERATOR_MOUNT_PATHS = (CONFIG_DIR, TOKEN_DIR, CACHE_DIR, SHM_DIR)  # plus spec.modelVolume.mountPath

V_CONFIG, V_SHM, V_CACHE, V_TOKEN, V_MODEL = "config", "dshm", "cache", "membership-token", "model"
OPERATOR_VOLUMES = (V_CONFIG, V_SHM, V_CACHE, V_TOKEN, V_MODEL)

# The engine's address: the head binds --omni-master-address $(POD_IP), replicas announce
# --omni-replica-address $(POD_IP), vLLM's distributed runtime uses VLLM_HOST_IP.
POD_IP_ENV = "POD_IP"
VLLM_HOST_IP_ENV = "VLLM_HOST_IP"
ADDRESS_ENV = (POD_IP_ENV, VLLM_HOST_IP_ENV)

# The engine container's ports, by the names the Services and the NetworkPolicy use (`http` is open to
# every client, `membership` to the operator and the OmniStage's pods): no other container may take one.
PORT_HTTP, PORT_MASTER = "http", "master"
OPERATOR_PORT_NAMES = (PORT_HTTP, PORT_MASTER, contract.MEMBERSHIP_PORT_NAME)

# Fields of the engine container the operator renders from the spec: the command line (membership,
# ports, the stage config), the image (spec.engine.image; status.engineImage reports it), the ports
# the Services and the NetworkPolicy name, the probes that gate the head's readiness and joins, and
# the lifecycle hooks.
ENGINE_OWNED_FIELDS = ("command", "args", "image", "ports", "startupProbe", "readinessProbe", "livenessProbe",
                       "lifecycle")  # a replica's preStop hook drains it (omnistage_engine_patches.prestop)
# Pod fields the operator renders: replicas must not restart in place (a restarted replica never
# registers with the head again), the head must; the grace period is the drain's; no deadline ends a pod.
POD_OWNED_FIELDS = ("restartPolicy", "terminationGracePeriodSeconds", "activeDeadlineSeconds")


# ---- the schema -----------------------------------------------------------------------------------

@functools.cache
def _document() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


def schema() -> dict[str, Any]:
    """The PodTemplateSpec schema with the strategic-merge markers (callers must not mutate it)."""
    return _document()["schema"]


def source() -> dict[str, str]:
    """Which Kubernetes module, file and definition the schema was generated from."""
    return _document()["source"]


def subschema(path: str) -> dict[str, Any]:
    """The schema at a dotted path below PodTemplateSpec; list items are stepped through
    ("spec.containers.env.valueFrom" is the valueFrom of a container's env var)."""
    node = schema()
    for part in path.split("."):
        while node.get("type") == "array":
            node = node["items"]
        node = node["properties"][part]
    return node


_PATCH_MARKERS = ("x-kubernetes-patch-merge-key", "x-kubernetes-patch-strategy")


def _pruned(node: Any, drop: Callable[[str, Any], bool]) -> Any:
    """`node` without the mapping entries `drop(key, value)` picks, at any depth."""
    if isinstance(node, dict):
        return {k: _pruned(v, drop) for k, v in node.items() if not drop(k, v)}
    if isinstance(node, list):
        return [_pruned(v, drop) for v in node]
    return node


def without_patch_markers(node: Any) -> Any:
    """The schema as a CRD can carry it: the API server knows no x-kubernetes-patch-* fields."""
    return _pruned(node, lambda key, _: key in _PATCH_MARKERS)


# ---- strategic merge ------------------------------------------------------------------------------

def _child(node: dict[str, Any], key: str) -> dict[str, Any]:
    props = node.get("properties")
    if props is not None:
        return props.get(key, {})
    extra = node.get("additionalProperties")
    return extra if isinstance(extra, dict) else {}


def _merge_strategy(node: dict[str, Any]) -> tuple[bool, str | None]:
    strategy = node.get("x-kubernetes-patch-strategy", "")
    return "merge" in strategy.split(","), node.get("x-kubernetes-patch-merge-key")


def strategic_merge(original: Any, patch: Any, node: dict[str, Any]) -> Any:
    """Kubernetes' strategic merge patch of `patch` onto `original`, both plain JSON values.

    Objects and maps merge key by key, a null in the patch deletes the key. A list whose schema
    says patch-strategy merge merges by its patch-merge-key (the patch's item is merged into the
    original item with the same key, in place; new items are appended in the patch's order), or,
    without a key, as a set of scalars. Every other list (tolerations, command, args...) and every
    scalar is replaced. `$patch` directives are not supported (the CRD schema has no such field), and
    retainKeys only acts with a `$retainKeys` directive, so it never acts here.
    """
    if patch is None:
        return None
    if isinstance(patch, dict) and isinstance(original, dict):
        out = copy.deepcopy(original)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, _child(node, key))
            else:
                out[key] = _without_nulls(value)
        return out
    if isinstance(patch, list) and isinstance(original, list):
        merge, key = _merge_strategy(node)
        if not merge:
            return _without_nulls(patch)
        items = node.get("items", {})
        out = copy.deepcopy(original)
        if key is None:
            return out + [copy.deepcopy(v) for v in patch if v not in out]
        for item in patch:
            at = next((i for i, o in enumerate(out) if isinstance(o, dict) and isinstance(item, dict)
                       and o.get(key) == item.get(key)), None)
            if at is None:
                out.append(_without_nulls(item))
            else:
                out[at] = strategic_merge(out[at], item, items)
        return out
    return _without_nulls(patch)


def _without_nulls(value: Any) -> Any:
    return _pruned(value, lambda _, v: v is None)


def overlay(pod: dict[str, Any], template: dict[str, Any] | None) -> dict[str, Any]:
    """The rendered pod ({"metadata": ..., "spec": ...}) with the template merged onto it."""
    if not template:
        return copy.deepcopy(pod)
    return strategic_merge(pod, template, schema())


# ---- checking a template without an API server ----------------------------------------------------

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "integer": (int,), "number": (int, float),
    "boolean": (bool,),
}


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else f"{path}[{key}]"


def schema_problems(value: Any, node: dict[str, Any], path: str) -> list[tuple[str, str]]:
    """What the API server's schema check would refuse in `value`: types, unknown fields, required
    fields, enums, patterns, lengths, list sizes and duplicate keys of map-type lists, each as (field
    path, message)."""
    if node.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            return [(path, f"must be an integer or a string (got {value!r})")]
        if isinstance(value, str) and node.get("pattern") and not re.search(node["pattern"], value):
            return [(path, f"is not a valid quantity (got {value!r})")]
        return []
    kind = node.get("type")
    if kind is None:
        return []
    ok = isinstance(value, _JSON_TYPES[kind]) and not (
        kind in ("integer", "number") and isinstance(value, bool)
    )
    if not ok:
        return [(path, f"must be of type {kind} (got {value!r})")]
    problems: list[tuple[str, str]] = []
    if "enum" in node and value not in node["enum"]:
        problems.append((path, f"must be one of {', '.join(map(str, node['enum']))} (got {value!r})"))
    if kind == "string" and node.get("pattern") and not re.search(node["pattern"], value):
        problems.append((path, f"must match {node['pattern']} (got {value!r})"))
    if kind == "string" and len(value) > node.get("maxLength", len(value)):
        problems.append((path, f"must be at most {node['maxLength']} characters"))
    if kind == "array" and len(value) > node.get("maxItems", len(value)):
        problems.append((path, f"must have at most {node['maxItems']} items (got {len(value)})"))
    if kind == "object":
        props = node.get("properties")
        # The API server drops nulls of non-nullable fields before it validates; so does this check.
        value = {k: v for k, v in value.items() if v is not None}
        for key, sub in value.items():
            if props is not None:
                if key not in props:
                    problems.append((_key_path(path, key), "unknown field"))
                else:
                    problems += schema_problems(sub, props[key], _key_path(path, key))
            elif isinstance(node.get("additionalProperties"), dict):
                problems += schema_problems(sub, node["additionalProperties"], f"{path}[{key}]")
        problems += [(_key_path(path, r), "is required") for r in node.get("required", []) if r not in value]
    if kind == "array":
        for i, item in enumerate(value):
            problems += schema_problems(item, node.get("items", {}), f"{path}[{i}]")
        keys = node.get("x-kubernetes-list-map-keys")
        if node.get("x-kubernetes-list-type") == "map" and keys:
            seen: set[str] = set()
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    k = json.dumps([item.get(x) for x in keys])
                    if k in seen:
                        problems.append((f"{path}[{i}]", f"duplicate entry with the same {', '.join(keys)}"))
                    seen.add(k)
    return problems


# ---- reading a template (defensively: ownership is checked even where its types are wrong) --------

def spec_items(template: dict[str, Any] | None, field: str) -> list[tuple[int, dict[str, Any]]]:
    """(index, item) of the object items of template.spec.<field> (containers, volumes...)."""
    spec = (template or {}).get("spec")
    found = spec.get(field) if isinstance(spec, dict) else None
    return [(i, c) for i, c in enumerate(found) if isinstance(c, dict)] if isinstance(found, list) else []


def engine_containers(template: dict[str, Any] | None) -> list[tuple[int, dict[str, Any]]]:
    return [(i, c) for i, c in spec_items(template, "containers") if c.get("name") == ENGINE_CONTAINER]


def mapping(node: Any, *path: str) -> dict[str, Any]:
    """The object at path below node, or {} when it is absent or not an object."""
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def objects(node: Any) -> list[tuple[int, dict[str, Any]]]:
    return [(i, x) for i, x in enumerate(node) if isinstance(x, dict)] if isinstance(node, list) else []
