#!/usr/bin/env python3
"""Generate operator/omnistage/podtemplate.schema.json, the schema of spec.template.

The source is the Kubernetes OpenAPI v3 document of the version the project builds and tests
against (K8S_VERSION in hack/build-k8s-bins.sh), read from the Go module cache that script fills:
$(go env GOMODCACHE)/k8s.io/kubernetes@<version>/api/openapi-spec/v3/api__v1_openapi.json. That is the
document controller-gen's known types come from, so the result is what a Go operator's CRD would carry.

What is kept and changed, and why:
  * every $ref is inlined (a CRD schema has none); PodTemplateSpec has no recursive type.
  * x-kubernetes-list-type/-list-map-keys/-map-type stay (the API server and server-side apply use
    them), and so do x-kubernetes-patch-merge-key/-patch-strategy: they are the strategic-merge rules
    operator/omnistage/podtemplate.py merges with. crd.py drops the patch markers, which a CRD
    schema cannot carry.
  * Quantity and IntOrString become x-kubernetes-int-or-string, the structural form controller-gen
    writes (Quantity with its pattern, which the OpenAPI document does not carry).
  * defaults are dropped (a defaulted field in an overlay would override what the operator renders),
    except on the keys of map-type lists, which the API server requires to be required or defaulted.
  * PodSpec's `required: [containers]` is dropped: an overlay may set nothing but, say, a label.
  * metadata keeps only labels and annotations (the operator owns the pod's name, namespace and
    owner); ephemeralContainers goes (the API server refuses them when a pod is created).
  * descriptions are cut to their first sentence, which keeps `kubectl explain` useful and the CRD
    far below the API server's limits.
  * the lists the CRD's CEL rules walk get an upper bound (BOUNDS), which Kubernetes leaves out: the API
    server estimates a rule's cost from the bounds of what it iterates, and a list inside an unbounded
    list is estimated past any budget, so without them the rules on containers' env, envFrom,
    volumeMounts and capabilities and on projected volumes' sources could only be checked by the operator.

  hack/gen-podtemplate-schema.py           write the file
  hack/gen-podtemplate-schema.py --check   exit 1 if the committed file differs from a regeneration
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "operator" / "omnistage" / "podtemplate.schema.json"
BUILD_SCRIPT = ROOT / "hack" / "build-k8s-bins.sh"
DOC_IN_MODULE = "api/openapi-spec/v3/api__v1_openapi.json"
ROOT_DEFINITION = "io.k8s.api.core.v1.PodTemplateSpec"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
# resource.Quantity's string form, as controller-gen writes it for the known type.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
# Fields of the source that the overlay leaves out (see the module docstring).
DROP = {
    "io.k8s.api.core.v1.PodSpec": {"ephemeralContainers"},
}
KEEP_ONLY = {
    "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta": {"labels", "annotations"},
}
DROP_REQUIRED = {"io.k8s.api.core.v1.PodSpec"}
# (definition, field) -> the bound its list gets (see the module docstring): far above what an engine
# pod's overlay carries, low enough that every rule of operator/omnistage/api/template_rules.py stays
# within the API server's CEL cost budget.
BOUNDS = {
    ("io.k8s.api.core.v1.PodSpec", "containers"): {"maxItems": 64},
    ("io.k8s.api.core.v1.PodSpec", "initContainers"): {"maxItems": 64},
    ("io.k8s.api.core.v1.PodSpec", "volumes"): {"maxItems": 256},
    ("io.k8s.api.core.v1.Container", "env"): {"maxItems": 1024},
    ("io.k8s.api.core.v1.Container", "envFrom"): {"maxItems": 128},
    ("io.k8s.api.core.v1.Container", "volumeMounts"): {"maxItems": 256},
    ("io.k8s.api.core.v1.Container", "ports"): {"maxItems": 128},
    ("io.k8s.api.core.v1.Capabilities", "add"): {"maxItems": 64},
    ("io.k8s.api.core.v1.ProjectedVolumeSource", "sources"): {"maxItems": 128},
}
# Keys a CRD schema node may carry, besides the ones handled explicitly below.
PASS_THROUGH = {
    "type", "format", "enum", "required", "minimum", "maximum", "pattern", "maxLength", "minLength",
    "maxItems", "minItems", "uniqueItems", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type", "x-kubernetes-patch-merge-key", "x-kubernetes-patch-strategy",
}
# A sentence ends at ". " unless the dot closes a common abbreviation.
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)(?<!\bvs)\.(\s|$)")


def k8s_version() -> str:
    """K8S_VERSION's default in hack/build-k8s-bins.sh: the one place the version is written."""
    m = re.search(r'^K8S_VERSION="\$\{K8S_VERSION:-(v[0-9.]+)\}"', BUILD_SCRIPT.read_text(), re.MULTILINE)
    if not m:
        raise SystemExit(f"cannot find K8S_VERSION in {BUILD_SCRIPT}")
    return m.group(1)


def module_cache() -> Path:
    if os.environ.get("GOMODCACHE"):
        return Path(os.environ["GOMODCACHE"])
    try:
        out = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, timeout=60, check=True)
        if out.stdout.strip():
            return Path(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return Path(os.environ.get("GOPATH") or Path.home() / "go") / "pkg" / "mod"


def document_path(version: str | None = None) -> Path:
    """Where hack/build-k8s-bins.sh leaves the document (it may not exist yet)."""
    return module_cache() / f"k8s.io/kubernetes@{version or k8s_version()}" / DOC_IN_MODULE


def first_sentence(text: str) -> str:
    text = " ".join(text.split("\n\n", 1)[0].split())
    m = _SENTENCE_END.search(text)
    return text[: m.start() + 1] if m else text


class _Inliner:
    def __init__(self, schemas: dict[str, Any]):
        self.schemas = schemas

    def definition(self, name: str, stack: tuple[str, ...]) -> dict[str, Any]:
        if name in stack:
            raise SystemExit(f"recursive type {name} under {ROOT_DEFINITION}: cannot inline it")
        if name == QUANTITY:
            return {"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}
        if name == INT_OR_STRING:
            return {"x-kubernetes-int-or-string": True}
        return self.node(self.schemas[name], (*stack, name), name)

    def node(self, src: dict[str, Any], stack: tuple[str, ...], name: str | None = None) -> dict[str, Any]:
        ref = src.get("$ref") or next((a["$ref"] for a in src.get("allOf", []) if "$ref" in a), None)
        out: dict[str, Any] = {}
        if ref:
            out.update(self.definition(ref.rsplit("/", 1)[-1], stack))
        for key, value in src.items():
            if key in ("$ref", "allOf", "default", "description", "x-kubernetes-unions",
                       "x-kubernetes-group-version-kind", "oneOf"):
                continue
            if key == "properties":
                props = {p: v for p, v in value.items()
                         if p not in DROP.get(name or "", set())
                         and (name not in KEEP_ONLY or p in KEEP_ONLY[name])}
                out["properties"] = {p: {**self.node(v, stack), **BOUNDS.get((name or "", p), {})}
                                     for p, v in props.items()}
                for p, v in out["properties"].items():
                    # A map-type list's keys must be required or defaulted (structural schemas).
                    item_keys = v.get("x-kubernetes-list-map-keys", [])
                    item_src = props[p].get("items", {})
                    for k in item_keys:
                        default = self._default_of(item_src, k)
                        if default is not None and k not in v["items"].get("required", []):
                            v["items"]["properties"][k]["default"] = default
            elif key == "required":
                if name not in DROP_REQUIRED:
                    kept = [r for r in value if name not in KEEP_ONLY or r in KEEP_ONLY[name]]
                    if kept:
                        out["required"] = kept
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                out[key] = self.node(value, stack)
            elif key in PASS_THROUGH:
                out[key] = value
            else:
                raise SystemExit(f"unexpected key {key!r} in {stack[-1] if stack else '?'}: decide how to carry it")
        description = src.get("description") or (self.schemas[ref.rsplit("/", 1)[-1]].get("description")
                                                 if ref else None)
        if description:
            out["description"] = first_sentence(description)
        if out.get("x-kubernetes-int-or-string"):
            out.pop("type", None)  # int-or-string nodes carry no type
        return out

    def _default_of(self, items: dict[str, Any], key: str) -> Any:
        ref = items.get("$ref") or next((a["$ref"] for a in items.get("allOf", []) if "$ref" in a), None)
        target = self.schemas[ref.rsplit("/", 1)[-1]] if ref else items
        return target.get("properties", {}).get(key, {}).get("default")


def generate(doc: dict[str, Any], version: str) -> dict[str, Any]:
    schema = _Inliner(doc["components"]["schemas"]).definition(ROOT_DEFINITION, ())
    return {
        "source": {"module": f"k8s.io/kubernetes@{version}", "file": DOC_IN_MODULE, "definition": ROOT_DEFINITION,
                   "generator": "hack/gen-podtemplate-schema.py"},
        "schema": schema,
    }


def render(doc_path: Path, version: str) -> str:
    return json.dumps(generate(json.loads(doc_path.read_text()), version), indent=1, sort_keys=True) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
    args = ap.parse_args()
    version = k8s_version()
    path = document_path(version)
    if not path.exists():
        print(f"{path} is missing: run hack/build-k8s-bins.sh (it downloads k8s.io/kubernetes@{version})",
              file=sys.stderr)
        return 2
    text = render(path, version)
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run {Path(__file__).relative_to(ROOT)}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text)} bytes) from {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
