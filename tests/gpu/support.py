"""The GPU tier's settings and plans: pure functions, tested without a cluster (test_support.py).

Every variable the tier reads is in SETTINGS, with its default and meaning; `make test-gpu`, `make
help`-style comments in the Makefile and docs/gpu-tests.md document the same list
(tests/unit/test_docs.py fails when one of them misses a variable).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
SAMPLE = MANIFESTS / "samples" / "omnistage.yaml"
SPEECH_SAMPLE = MANIFESTS / "samples" / "qwen3-omni-speech.yaml"
MULTISTAGE_RUNS = {"0": (), "1": ("network", "sameNode"), "network": ("network",)}
# What manifests/base installs (tests/support/cluster.py and tests/cluster/conftest.py use the same names).
OPERATOR_NAMESPACE = "omnistage-system"
OPERATOR_NAME = "omnistage-operator"
OPERATOR_CONTAINER = "operator"
ENGINE_IMAGE_ENV = "OMNISTAGE_ENGINE_IMAGE"  # the operator's default engine image (api.ENGINE_IMAGE_ENV)

# name -> (default, meaning). Defaults of None: see the meaning.
SETTINGS: dict[str, tuple[str | None, str]] = {
    "KUBECONFIG": (None, ("the GPU cluster (required); the tests only talk to its API server and, through "
                         "`kubectl port-forward`, to 127.0.0.1")),
    "OMNISTAGE_USE_EXISTING_CLUSTER": (None, "1: use the cluster KUBECONFIG names (make test-gpu sets it)"),
    "OMNISTAGE_GPU_CLUSTER": (None, "1: run the GPU tier (make test-gpu sets it); without it tests/gpu is skipped"),
    "OMNISTAGE_KUBECTL": ("kubectl", "kubectl binary"),
    "OMNISTAGE_GPU_OPERATOR": ("install", ("install: apply manifests/ (kustomize) to the cluster with the images "
                               "below, wait for the Deployment, remove what was installed at the end; existing: "
                               "test the operator already running in the cluster")),
    "OMNISTAGE_GPU_OPERATOR_IMAGE": (None, ("operator image to install (the Dockerfile's operator target); default: "
                                     "the one in manifests/base/deployment.yaml")),
    "OMNISTAGE_GPU_ENGINE_IMAGE": (None, ("engine image (the Dockerfile's engine target): the installed operator's "
                                   "OMNISTAGE_ENGINE_IMAGE, or with OMNISTAGE_GPU_OPERATOR=existing the test "
                                   "OmniStage's spec.engine.image; default: the manifests' / the operator's default")),
    "OMNISTAGE_GPU_PRODUCT": ("NVIDIA-H200", "value of the GPU product node label (spec.gpu.product)"),
    "OMNISTAGE_GPU_PRODUCT_LABEL": ("nvidia.com/gpu.product", ("node label carrying the GPU product "
                                    "(spec.gpu.productLabel; GPU feature discovery sets it)")),
    "OMNISTAGE_GPU_RESOURCE": ("nvidia.com/gpu", "extended resource of the GPUs (spec.gpu.resource)"),
    "OMNISTAGE_GPU_SAMPLE": (str(SAMPLE.relative_to(ROOT)), ("OmniStage YAML the tests apply (e.g. your copy "
                             "of manifests/samples/omnistage-production.yaml with weights on a PVC)")),
    "OMNISTAGE_GPU_REPLICAS": ("2", ("spec.replicas of the test OmniStage; the scale test adds one, so the "
                               "cluster needs REPLICAS+1 engine pods' worth of GPUs")),
    "OMNISTAGE_GPU_NAMESPACE": (None, ("namespace of the test OmniStage; default: a fresh omnistage-gpu-<hex>, "
                                "deleted at the end (a given namespace is created if missing, never deleted)")),
    "OMNISTAGE_GPU_OMNISTAGE": (None, ("NAMESPACE/NAME of an OmniStage already running: the tests use it "
                                "instead of applying one (implies OMNISTAGE_GPU_OPERATOR=existing)")),
    "OMNISTAGE_GPU_READY_TIMEOUT": ("3600", ("seconds an OmniStage may take to become Ready (model download "
                                    "and load) and each scale step to converge")),
    "OMNISTAGE_GPU_KEEP": ("0", "1: leave the test namespace and the installed operator in place"),
    "OMNISTAGE_GPU_MULTISTAGE": ("0", ("1: also run the multi-stage tests (test_multistage*.py): the speech "
                                 "pipeline across pods over the network, then on one node (sameNode, hostPath); "
                                 "network: only the network run; 0: neither")),
    "OMNISTAGE_GPU_MULTISTAGE_SAMPLE": (str(SPEECH_SAMPLE.relative_to(ROOT)), ("OmniStage and OmniStagePool YAML "
                                        "the multi-stage tests apply (e.g. a copy with transport.protocol rdma "
                                        "and the NIC in spec.template)")),
    "OMNISTAGE_GPU_MULTISTAGE_CLIENTS": ("4", ("concurrent clients, one speech request in flight each, while "
                                         "the speech pool is scaled 1 -> 2 -> 1")),
}


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    requested: bool
    kubeconfig: str
    kubectl: str
    operator: str  # install | existing
    operator_image: str | None
    engine_image: str | None
    product: str
    product_label: str
    resource: str
    sample: Path
    replicas: int
    namespace: str | None
    omnistage: tuple[str, str] | None
    ready_timeout: float
    keep: bool
    multistage: tuple[str, ...] = ()  # the multi-stage runs asked for: network, sameNode
    multistage_sample: Path = SPEECH_SAMPLE
    multistage_clients: int = 4

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        """Raises SettingsError (the message names the variable) when the tier is requested but
        cannot run as configured; `requested` False means: skip the tier."""
        def get(name: str) -> str:
            value = (env.get(name) or "").strip()
            return value or (SETTINGS[name][0] or "")

        target = get("OMNISTAGE_GPU_OMNISTAGE")
        requested = get("OMNISTAGE_GPU_CLUSTER") == "1" or bool(target)
        problems = []
        if requested and get("OMNISTAGE_USE_EXISTING_CLUSTER") != "1":
            problems.append("OMNISTAGE_USE_EXISTING_CLUSTER=1 is required: the GPU tier never runs on the local "
                            "control plane (no GPUs)")
        if requested and not get("KUBECONFIG"):
            problems.append("KUBECONFIG must name the GPU cluster")
        operator = "existing" if target else get("OMNISTAGE_GPU_OPERATOR")
        if operator not in ("install", "existing"):
            problems.append(f"OMNISTAGE_GPU_OPERATOR is {operator!r}; use install or existing")
        omnistage = None
        if target:
            ns, _, name = target.partition("/")
            if not ns or not name:
                problems.append(f"OMNISTAGE_GPU_OMNISTAGE is {target!r}; use NAMESPACE/NAME")
            omnistage = (ns, name)
        numbers = {}
        for name in ("OMNISTAGE_GPU_REPLICAS", "OMNISTAGE_GPU_READY_TIMEOUT", "OMNISTAGE_GPU_MULTISTAGE_CLIENTS"):
            try:
                numbers[name] = int(get(name))
                if numbers[name] < 1:
                    raise ValueError
            except ValueError:
                problems.append(f"{name} is {get(name)!r}; use a positive whole number")
                numbers[name] = 1
        sample = Path(get("OMNISTAGE_GPU_SAMPLE"))
        if requested and not target and not (sample if sample.is_absolute() else ROOT / sample).is_file():
            problems.append(f"OMNISTAGE_GPU_SAMPLE {sample} is not a file")
        multistage = get("OMNISTAGE_GPU_MULTISTAGE")
        if multistage not in MULTISTAGE_RUNS:
            problems.append(f"OMNISTAGE_GPU_MULTISTAGE is {multistage!r}; use 0, 1 or network")
        runs = MULTISTAGE_RUNS.get(multistage, ())
        speech = Path(get("OMNISTAGE_GPU_MULTISTAGE_SAMPLE"))
        speech = speech if speech.is_absolute() else ROOT / speech
        if requested and runs and not speech.is_file():
            problems.append(f"OMNISTAGE_GPU_MULTISTAGE_SAMPLE {speech} is not a file")
        if requested and problems:
            raise SettingsError("make test-gpu: " + "; ".join(problems) + " (docs/gpu-tests.md)")
        return cls(
            requested=requested, kubeconfig=get("KUBECONFIG"), kubectl=get("OMNISTAGE_KUBECTL"), operator=operator,
            operator_image=get("OMNISTAGE_GPU_OPERATOR_IMAGE") or None,
            engine_image=get("OMNISTAGE_GPU_ENGINE_IMAGE") or None, product=get("OMNISTAGE_GPU_PRODUCT"),
            product_label=get("OMNISTAGE_GPU_PRODUCT_LABEL"), resource=get("OMNISTAGE_GPU_RESOURCE"),
            sample=sample if sample.is_absolute() else ROOT / sample, replicas=numbers["OMNISTAGE_GPU_REPLICAS"],
            namespace=get("OMNISTAGE_GPU_NAMESPACE") or None, omnistage=omnistage,
            ready_timeout=float(numbers["OMNISTAGE_GPU_READY_TIMEOUT"]), keep=get("OMNISTAGE_GPU_KEEP") == "1",
            multistage=runs if requested else (), multistage_sample=speech,
            multistage_clients=numbers["OMNISTAGE_GPU_MULTISTAGE_CLIENTS"],
        )


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    for obj in objects:
        if obj.get("kind") == "Deployment" and obj["metadata"]["name"] == OPERATOR_NAME:
            for c in obj["spec"]["template"]["spec"]["containers"]:
                if c["name"] == OPERATOR_CONTAINER:
                    return c
    raise LookupError(f"no Deployment {OPERATOR_NAME} with a container {OPERATOR_CONTAINER!r} in the manifests")


def install_objects(rendered: list[dict[str, Any]], operator_image: str | None,
                    engine_image: str | None) -> list[dict[str, Any]]:
    """`kubectl kustomize manifests/` with the two images replaced: what `kubectl apply -k` of an overlay
    with an `images:` entry and an env patch would send (docs/install.md shows that overlay)."""
    out = copy.deepcopy(rendered)
    container = operator_container(out)
    if operator_image:
        container["image"] = operator_image
    if engine_image:
        env = container.setdefault("env", [])
        entry = next((e for e in env if e.get("name") == ENGINE_IMAGE_ENV), None)
        if entry is None:
            env.append({"name": ENGINE_IMAGE_ENV, "value": engine_image})
        else:
            entry.pop("valueFrom", None)
            entry["value"] = engine_image
    return out


def object_ref(obj: dict[str, Any]) -> list[str]:
    """kubectl arguments naming one object (kind.group so the CRD's own kinds never collide)."""
    api = obj["apiVersion"]
    group = api.split("/", 1)[0] if "/" in api else ""
    kind = obj["kind"].lower() + (f".{group}" if group else "")
    ns = obj["metadata"].get("namespace")
    return [kind, obj["metadata"]["name"], *(["-n", ns] if ns else [])]


def omnistage_for_test(sample: dict[str, Any], settings: Settings, namespace: str) -> dict[str, Any]:
    """The OmniStage the tier applies: the sample, placed on the configured GPUs in the test namespace."""
    obj = copy.deepcopy(sample)
    obj.setdefault("metadata", {})["namespace"] = namespace
    spec = obj.setdefault("spec", {})
    spec["replicas"] = settings.replicas
    gpu = spec.setdefault("gpu", {})
    gpu.update({"product": settings.product, "productLabel": settings.product_label, "resource": settings.resource})
    if settings.engine_image and settings.operator == "existing":
        # An installed operator carries its own default; the test's image goes into the spec.
        spec.setdefault("engine", {})["image"] = settings.engine_image
    return obj



def allocatable_gpus(nodes: list[dict[str, Any]], resource: str) -> int:
    total = 0
    for node in nodes:
        if (node.get("spec") or {}).get("unschedulable"):
            continue
        value = str(((node.get("status") or {}).get("allocatable") or {}).get(resource, "0"))
        total += int(value) if value.isdigit() else 0
    return total


def gpus_needed(obj: dict[str, Any], replicas: int) -> int:
    """GPUs `replicas` engine pods of this OmniStage request."""
    return replicas * int(((obj.get("spec") or {}).get("gpu") or {}).get("count", 1))
