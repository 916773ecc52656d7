"""GPU tier: the operator runs IN the cluster, installed from manifests/, and OmniStages run on real GPUs.

Run it with `make test-gpu` (docs/gpu-tests.md lists every variable; support.SETTINGS is the same list).
Without OMNISTAGE_GPU_CLUSTER=1 (or OMNISTAGE_GPU_OMNISTAGE) every test marked `gpu` is skipped.

Why in the cluster: the operator dials each head pod's IP (the engine report and the membership
endpoint); from a laptop pod IPs are not reachable, so the tier applies the install manifests
(`kubectl kustomize manifests/`, the images replaced) and lets the Deployment's pod do the work. This
process talks only to the API server KUBECONFIG names and, through `kubectl port-forward`, to
127.0.0.1 (the head's API and /metrics, the operator's /metrics).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.standin.harness import membership_port
from tests.support.kubectl import Kubectl

from .checks import GpuOmniStage, operator_leader, stage_converged, wait_gpu
from .support import (
    MANIFESTS,
    OPERATOR_NAME,
    OPERATOR_NAMESPACE,
    Settings,
    SettingsError,
    allocatable_gpus,
    install_objects,
    object_ref,
    omnistage_for_test,
)

FIELD_MANAGER = "omnistage-gpu-tests"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multistage(run): a multi-stage GPU test of the network or sameNode run; "
                            "skipped unless OMNISTAGE_GPU_MULTISTAGE asks for that run")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        settings = Settings.from_env()
    except SettingsError:
        return  # the `settings` fixture reports it, with the variable to fix
    if not settings.requested:
        skip = pytest.mark.skip(reason="no GPU cluster requested: run `make test-gpu KUBECONFIG=...` "
                                "(docs/gpu-tests.md)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
        return
    for item in items:
        marker = item.get_closest_marker("multistage")
        run = (marker.args or ("network",))[0] if marker else None
        if run is not None and run not in settings.multistage:
            item.add_marker(pytest.mark.skip(reason=f"the multi-stage {run} run was not asked for: set "
                                             "OMNISTAGE_GPU_MULTISTAGE=1 (docs/gpu-tests.md)"))


@pytest.fixture(scope="session")
def settings() -> Settings:
    try:
        return Settings.from_env()
    except SettingsError as err:
        pytest.fail(str(err))


@pytest.fixture(scope="session")
def kubectl(settings: Settings) -> Kubectl:
    binary = shutil.which(settings.kubectl) or settings.kubectl
    if not Path(binary).exists():
        pytest.fail(f"kubectl {settings.kubectl!r} not found: put it on PATH or set OMNISTAGE_KUBECTL")
    k = Kubectl(binary, settings.kubeconfig, timeout=120)  # a remote API server, under GPU load
    nodes = k.json("get", "nodes", "-l", f"{settings.product_label}={settings.product}")["items"]
    gpus = allocatable_gpus(nodes, settings.resource)
    print(f"[gpu] {len(nodes)} node(s) labelled {settings.product_label}={settings.product}, "
          f"{gpus} allocatable {settings.resource}", flush=True)
    if not gpus:
        pytest.fail(f"no schedulable node labelled {settings.product_label}={settings.product} with allocatable "
                    f"{settings.resource}: check the NVIDIA device plugin / GPU operator, or set "
                    "OMNISTAGE_GPU_PRODUCT / OMNISTAGE_GPU_PRODUCT_LABEL / OMNISTAGE_GPU_RESOURCE")
    return k


@dataclass
class InstalledOperator:
    namespace: str
    name: str
    installed: bool  # False: it was running before the session (OMNISTAGE_GPU_OPERATOR=existing)
    image: str


def _deployment_available(kubectl: Kubectl, namespace: str, name: str) -> bool:
    dep = kubectl.json("get", "deployment", name, "-n", namespace)
    return any(c.get("type") == "Available" and c.get("status") == "True"
               for c in (dep.get("status") or {}).get("conditions") or [])


@pytest.fixture(scope="session")
def operator_in_cluster(settings: Settings, kubectl: Kubectl) -> Iterator[InstalledOperator]:
    """The operator as users deploy it: manifests/ applied server-side (install), or the one found."""
    if settings.operator == "existing":
        found = kubectl.json("get", "deployments", "-A", "-l", f"app.kubernetes.io/name={OPERATOR_NAME}")["items"]
        if not found:
            pytest.fail(f"OMNISTAGE_GPU_OPERATOR=existing but no Deployment labelled app.kubernetes.io/name="
                        f"{OPERATOR_NAME} in the cluster (install it, docs/install.md)")
        dep = found[0]
        ns, name = dep["metadata"]["namespace"], dep["metadata"]["name"]
        wait_gpu(f"Deployment {ns}/{name} Available", lambda: _deployment_available(kubectl, ns, name), timeout=300)
        image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
        yield InstalledOperator(ns, name, False, image)
        return

    rendered = [d for d in yaml.safe_load_all(kubectl("kustomize", str(MANIFESTS)).stdout) if d]
    objects = install_objects(rendered, settings.operator_image, settings.engine_image)
    if kubectl.exists("deployment", OPERATOR_NAME, "-n", OPERATOR_NAMESPACE):
        pytest.fail(f"an operator is already installed (deployment {OPERATOR_NAMESPACE}/{OPERATOR_NAME}): run with "
                    "OMNISTAGE_GPU_OPERATOR=existing to test it, or uninstall it first (docs/uninstall.md)")
    created = [o for o in objects if not kubectl.exists(*object_ref(o))]
    print("[gpu] installing from manifests/: " + ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in objects),
          flush=True)
    kubectl("apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    image = next(c["image"] for o in objects if o["kind"] == "Deployment"
                 for c in o["spec"]["template"]["spec"]["containers"])
    try:
        kubectl("wait", "--for=condition=Established", "crd/omnistages.serving.omnistage.io", "--timeout=120s",
                timeout=150)
        kubectl("rollout", "status", f"deployment/{OPERATOR_NAME}", "-n", OPERATOR_NAMESPACE, "--timeout=600s",
                timeout=660)
        yield InstalledOperator(OPERATOR_NAMESPACE, OPERATOR_NAME, True, image)
    finally:
        if settings.keep:
            print(f"[gpu] OMNISTAGE_GPU_KEEP=1: the operator stays installed in {OPERATOR_NAMESPACE}", flush=True)
        else:
            print(f"[gpu] logs of the operator:\n{_operator_log(kubectl)}", flush=True)
            # Only what this session created, newest first; a CRD or namespace that was there stays.
            for obj in reversed(created):
                kubectl("delete", *object_ref(obj), "--ignore-not-found", "--wait=false", check=False)


def _operator_log(kubectl: Kubectl) -> str:
    """The leader's log (`logs deployment/...` picks either pod, possibly the idle follower)."""
    leading = operator_leader(kubectl, OPERATOR_NAMESPACE)
    target = f"pod/{leading}" if leading else f"deployment/{OPERATOR_NAME}"
    proc = kubectl("logs", target, "-n", OPERATOR_NAMESPACE, "--tail=200", check=False)
    return f"({target})\n" + (proc.stdout or proc.stderr)


@pytest.fixture(scope="module")
def gpu_omnistage(settings: Settings, kubectl: Kubectl, operator_in_cluster: InstalledOperator
                  ) -> Iterator[GpuOmniStage]:
    """An OmniStage on the GPUs, Ready: the one named by OMNISTAGE_GPU_OMNISTAGE, or the sample applied
    in a test namespace (deleted afterwards unless given or OMNISTAGE_GPU_KEEP=1)."""
    if settings.omnistage:
        ns, name = settings.omnistage
        obj = kubectl.json("get", "omnistage", name, "-n", ns)
        stage = GpuOmniStage(ns, name, obj["spec"].get("replicas", 1), obj["spec"]["engine"]["httpPort"],
                             obj["spec"]["gpu"]["count"], False, membership_port(obj))
        wait_gpu(f"{ns}/{name} Ready", lambda: stage_converged(kubectl, stage, stage.replicas), settings.ready_timeout)
        yield stage
        return
    ns = settings.namespace or f"omnistage-gpu-{uuid.uuid4().hex[:5]}"
    made_ns = not kubectl.exists("namespace", ns)
    if made_ns:
        kubectl("create", "namespace", ns)
    sample = yaml.safe_load(settings.sample.read_text())
    obj = omnistage_for_test(sample, settings, ns)
    name = obj["metadata"]["name"]
    kubectl("apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "-f", "-", input=json.dumps(obj))
    stored = kubectl.json("get", "omnistage", name, "-n", ns)
    stage = GpuOmniStage(ns, name, settings.replicas, stored["spec"]["engine"]["httpPort"],
                         stored["spec"]["gpu"]["count"], True, membership_port(stored))
    try:
        wait_gpu(f"{ns}/{name} Ready with {stage.replicas} registered replicas",
                 lambda: stage_converged(kubectl, stage, stage.replicas), settings.ready_timeout)
        yield stage
    finally:
        print(f"[gpu] {ns}/{name} at the end:\n" + kubectl("describe", "omnistage", name, "-n", ns, check=False).stdout,
              flush=True)
        if settings.keep:
            print(f"[gpu] OMNISTAGE_GPU_KEEP=1: {ns}/{name} stays", flush=True)
        elif made_ns:
            kubectl("delete", "namespace", ns, "--wait=false", check=False)
        else:
            kubectl("delete", "omnistage", name, "-n", ns, "--wait=false", check=False)


@pytest.fixture(scope="session")
def gpu_nodes(settings: Settings, kubectl: Kubectl) -> list[dict[str, Any]]:
    """The nodes labelled with the GPU product, as listed at the start of the session."""
    return kubectl.json("get", "nodes", "-l", f"{settings.product_label}={settings.product}")["items"]


@pytest.fixture(scope="session")
def speech_results() -> dict[str, dict[str, Any]]:
    """What each multi-stage run measured (answers, latency, throughput, time to Ready), by transport
    mode: the sameNode run compares itself with the network run."""
    return {}
