"""Two namespaced installs side by side (issue 21, item 2): each tenant applies its own overlay of
manifests/overlays/namespaced (its `namespace:` and a `nameSuffix:`, as docs/install.md says), and
runs its operator under the ServiceAccount that overlay creates, restricted to its namespace. Both
scale an OmniStage; then one tenant is uninstalled the way docs/uninstall.md says (`kubectl delete`
of its overlay's objects) and the other keeps its CRDs, its RBAC and its operator: it scales again.

The operators run here, as the cluster tier runs them (tests/standin/harness.py OperatorProcess), with
the tenant's ServiceAccount token; the Deployments the overlays install are kwok's (never started).
The namespaces are not t-*: the operator suite's operator and stand-in runtime watch t-*.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.standin.harness import TESTS_PROBE_HEADS_EVERY, OperatorProcess, converged
from tests.standin.runtime import StandinRuntime
from tests.support.cluster import container_env

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "manifests" / "overlays" / "namespaced"
SAMPLE = ROOT / "manifests" / "samples" / "omnistage.yaml"
CRDS = ("omnistages.serving.omnistage.io", "omnistagepools.serving.omnistage.io")
READY_TIMEOUT = 300


def _tenant_objects(kustomize, tmp_path: Path, namespace: str) -> list[dict[str, Any]]:
    overlay = tmp_path / namespace
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": namespace,
        "nameSuffix": f"-{namespace}", "resources": [os.path.relpath(OVERLAY, overlay)]}))
    objects = kustomize(overlay)
    assert "CustomResourceDefinition" not in {d["kind"] for d in objects}, "a tenant must not own the CRDs"
    return objects


def _sample(replicas: int) -> str:
    doc = next(d for d in yaml.safe_load_all(SAMPLE.read_text()) if d and d.get("kind") == "OmniStage")
    doc["spec"]["replicas"] = replicas
    return json.dumps(doc)


def _as_list(objects: list[dict[str, Any]]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})


def test_two_namespaced_tenants_coexist_and_one_uninstalls_alone(
        kubectl, kubeconfig, kustomize, wait_for, omnistage_crd, service_account_kubeconfig, local_cluster, tmp_path):
    if not local_cluster:
        pytest.skip("runs the engines with the stand-in runtime: local control plane only")
    suffix = uuid.uuid4().hex[:5]
    tenants = [f"omnistage-a-{suffix}", f"omnistage-b-{suffix}"]
    objects = {ns: _tenant_objects(kustomize, tmp_path, ns) for ns in tenants}
    cluster_scoped = {ns: sorted(f"{d['kind']}/{d['metadata']['name']}" for d in objs
                                 if d["kind"] in ("ClusterRole", "ClusterRoleBinding")) for ns, objs in objects.items()}
    assert not set(cluster_scoped[tenants[0]]) & set(cluster_scoped[tenants[1]]), cluster_scoped
    operators: dict[str, OperatorProcess] = {}
    try:
        with StandinRuntime(kubeconfig=kubeconfig, namespaces=tenants, state_dir=tmp_path / "standin"):
            for ns, objs in objects.items():
                print(f"\n[tenants] {ns}: " + ", ".join(f"{d['kind']}/{d['metadata']['name']}" for d in objs))
                kubectl("apply", "--server-side", "--field-manager=omnistage-tests-tenants", "-f", "-",
                        input=_as_list(objs))
                dep = next(d for d in objs if d["kind"] == "Deployment")
                pod = dep["spec"]["template"]["spec"]
                env = container_env(pod["containers"][0])  # as the kubelet would: $(POD_IP) is loopback here
                sa = pod["serviceAccountName"]
                wait_for(f"ServiceAccount {ns}/{sa}", lambda ns=ns, sa=sa: kubectl(
                    "get", "serviceaccount", sa, "-n", ns, check=False).returncode == 0, timeout=60)
                # The watched namespace is what the Deployment's --namespace=$(POD_NAMESPACE) expands to.
                operators[ns] = OperatorProcess(service_account_kubeconfig(sa, ns), tmp_path / f"operator-{ns}.log",
                                                namespaces=[ns], env={**env, "POD_NAMESPACE": ns, "POD_NAME": f"op-{ns}"},
                                                probe_heads_every=TESTS_PROBE_HEADS_EVERY)
                operators[ns].start()
            for ns in tenants:
                kubectl("apply", "-n", ns, "-f", "-", input=_sample(replicas=1))
            for ns in tenants:
                wait_for(f"{ns}/qwen3-omni Ready", lambda ns=ns: converged(kubectl, ns, "qwen3-omni", 1),
                         timeout=READY_TIMEOUT, interval=1)
                kubectl("scale", "omnistage", "qwen3-omni", "-n", ns, "--replicas=2")
            for ns in tenants:
                wait_for(f"{ns}/qwen3-omni at 2 replicas", lambda ns=ns: converged(kubectl, ns, "qwen3-omni", 2),
                         timeout=READY_TIMEOUT, interval=1)

            # Tenant a uninstalls: its operator stops, its overlay's objects go (namespace included).
            gone, kept = tenants
            operators.pop(gone).stop()
            kubectl("delete", "--wait=false", "--ignore-not-found", "-f", "-", input=_as_list(objects[gone]))
            wait_for(f"namespace {gone} gone", lambda: kubectl("get", "namespace", gone, check=False).returncode != 0,
                     timeout=180, interval=1)

            # Tenant b is unharmed: the CRDs, its cluster-scoped RBAC, its OmniStage; its operator still acts.
            for crd in CRDS:
                assert kubectl("get", "crd", crd, check=False).returncode == 0, f"{crd} went with {gone}"
            for ref in cluster_scoped[kept]:
                assert kubectl("get", ref, check=False).returncode == 0, f"{ref} went with {gone}"
            kubectl("scale", "omnistage", "qwen3-omni", "-n", kept, "--replicas=1")
            wait_for(f"{kept}/qwen3-omni back to 1 replica", lambda: converged(kubectl, kept, "qwen3-omni", 1),
                     timeout=READY_TIMEOUT, interval=1)
            denied = operators[kept].rbac_denials()
            # kopf's namespace listing is refused by design of the overlay (it then watches --namespace).
            assert denied <= {("list", "namespaces", ""), ("watch", "namespaces", "")}, denied
    finally:
        for op in operators.values():
            op.stop()
        for ns in tenants:
            kubectl("delete", "--wait=false", "--ignore-not-found", "-f", "-", input=_as_list(objects[ns]), check=False)
