"""The install path (issue 9 section 4): `kubectl apply -k manifests/` and the Helm chart, one source.

manifests/ (kustomize) is the source; charts/omnistage-operator is generated from it by
hack/gen-helm-chart.py. Here:

* the committed chart is what the generator makes of manifests/ now (drift fails the test);
* `helm lint --strict` passes for every mode, and the values schema refuses a wrong type;
* `helm template` equals the kustomize build in every mode, modulo exactly two decisions: the
  Namespace object is not in the chart (`helm install --create-namespace` owns it), and every
  templated object carries Helm's own two labels (helm.sh/chart, app.kubernetes.io/managed-by) on
  top of the three the manifests give it (tests/unit/test_chart.py renders every value);
* both forms are applied to the cluster, `--dry-run=server` and for real (the Deployment rolls out
  on the local cluster's CPU node, where kwok runs it; its image is never pulled there);
* the PodMonitor/ServiceMonitor/PrometheusRule (and the dashboard ConfigMap) and the KEDA
  ScaledObject example are validated by the API server against the real upstream CRDs (copied from
  their Go modules by hack/build-k8s-bins.sh: KEDA v2.21.0, Prometheus Operator v0.85.0), dry-run
  and for real, and the ScaledObject's target serves the scale subresource KEDA drives.

The real installs use the manifests' own names (namespace omnistage-system, ClusterRole
omnistage-operator, ...), so they run only on the local control plane (never on a cluster that may
hold a real installation) and one session at a time (a lock next to the cluster state).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "omnistage-operator"
MANIFESTS = ROOT / "manifests"
NS = "omnistage-system"
RELEASE = "omnistage-operator"
SCALED_OBJECT = MANIFESTS / "autoscaling" / "keda-scaledobject.yaml"
SAMPLE = MANIFESTS / "samples" / "omnistage.yaml"
CLUSTER_DIR = Path(os.environ.get("OMNISTAGE_CLUSTER_DIR", "/tmp/omnistage-cluster"))

# helm values of each mode -> the kustomize directories that are its source.
MODES = {
    "cluster-wide": ([], ["manifests"]),
    # The namespaced overlay leaves the shared CRDs out (a tenant's uninstall keeps them); Helm's crds/ has them.
    "namespaced": (["--set", "namespaced=true"], ["crds", "manifests/overlays/namespaced"]),
    "monitoring": (["--set", "monitoring.enabled=true"], ["manifests", "manifests/monitoring"]),
}


def key(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def show(proc: subprocess.CompletedProcess[str]) -> str:
    return (proc.stdout + proc.stderr).strip()


@pytest.fixture
def install_lock():
    """One session at a time installs into omnistage-system on the shared local cluster."""
    lock = CLUSTER_DIR.with_name(CLUSTER_DIR.name + ".install.lock")
    with open(lock, "w") as f:
        print(f"[install] taking {lock}", flush=True)
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# ----- one source -----------------------------------------------------------------------------------

def test_chart_is_generated_from_manifests(kubectl):
    proc = subprocess.run([sys.executable, str(ROOT / "hack" / "gen-helm-chart.py"), "--check"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "OMNISTAGE_KUBECTL": kubectl.binary})
    print(show(proc))
    assert proc.returncode == 0, f"the chart drifted from manifests/:\n{show(proc)}"


@pytest.mark.parametrize("mode", MODES)
def test_helm_lint(helm, mode):
    proc = helm("lint", "--strict", str(CHART), "--namespace", NS, *MODES[mode][0], check=False)
    print(show(proc))
    assert proc.returncode == 0 and "0 chart(s) failed" in proc.stdout, show(proc)


def test_chart_values_schema_refuses_a_wrong_type(helm):
    proc = helm("template", RELEASE, str(CHART), "--set", "namespaced=yes", check=False)
    assert proc.returncode != 0 and "namespaced" in proc.stderr, show(proc)


def helm_labelled(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the chart renders it at the defaults: with Helm's two labels (not on the CRDs,
    which crds/ holds as they are)."""
    if obj["kind"] == "CustomResourceDefinition":
        return obj
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    obj = json.loads(json.dumps(obj))
    obj["metadata"]["labels"].update({"helm.sh/chart": f"omnistage-operator-{version}",
                                      "app.kubernetes.io/managed-by": "Helm"})
    return obj


@pytest.mark.parametrize("mode", MODES)
def test_helm_template_equals_kustomize(helm, kustomize, mode):
    values, sources = MODES[mode]
    built = [d for src in sources for d in kustomize(ROOT / src)]
    assert sum(d["kind"] == "CustomResourceDefinition" for d in built) == 2, "both CRDs, once"
    # The differences by design: helm install --create-namespace owns the namespace; Helm's labels.
    assert [d["metadata"]["name"] for d in built if d["kind"] == "Namespace"] == [NS]
    want = {key(d): helm_labelled(d) for d in built if d["kind"] != "Namespace"}
    got = {key(d): d for d in docs(helm("template", RELEASE, str(CHART), "--namespace", NS, "--include-crds",
                                        *values).stdout)}
    print(f"\n[install] {mode}: kustomize {len(built)} objects, helm template {len(got)} (+ the Namespace)")
    assert sorted(got) == sorted(want)
    differ = [k for k in want if want[k] != got[k]]
    assert not differ, f"helm template differs from kustomize for {differ}"


def test_chart_follows_the_release_namespace_and_values(helm):
    out = helm("template", RELEASE, str(CHART), "--namespace", "gpu-ops", "--set", "namespaced=true",
               "--set", "image.tag=9.9.9", "--set", "engineImage=registry.example/engine:9.9.9").stdout
    assert NS not in out
    dep = next(d for d in docs(out) if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    # The watched namespace is the pod's own, from the downward API.
    assert dep["metadata"]["namespace"] == "gpu-ops" and "--namespace=$(POD_NAMESPACE)" in c["args"]
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in c["env"]
    assert c["image"] == "ghcr.io/omnistage/omnistage-operator:9.9.9"
    assert {"name": "OMNISTAGE_ENGINE_IMAGE", "value": "registry.example/engine:9.9.9"} in c["env"]


def test_a_namespace_overlay_retargets_the_namespaced_install(kustomize, tmp_path):
    # What docs/install.md tells a tenant to write: the operator then watches team-a (its own namespace,
    # from the downward API), and the shared CRDs are not part of the tenant's objects.
    overlay = tmp_path / "team-a"
    overlay.mkdir()
    source = os.path.relpath(MANIFESTS / "overlays" / "namespaced", overlay)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": "team-a", "nameSuffix": "-team-a", "resources": [source]}))
    objects = kustomize(overlay)
    assert "CustomResourceDefinition" not in {d["kind"] for d in objects}
    assert NS not in json.dumps(objects)
    dep = next(d for d in objects if d["kind"] == "Deployment")
    assert "--namespace=$(POD_NAMESPACE)" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    # nameSuffix keeps two tenants' cluster-scoped objects apart; kustomize follows the references.
    cluster_scoped = [d for d in objects if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert cluster_scoped and all(d["metadata"]["name"].endswith("-team-a") for d in cluster_scoped)
    assert {s["name"] for d in objects if d["kind"].endswith("Binding") for s in d["subjects"]} == {
        "omnistage-operator-team-a"}


# ----- both forms on the cluster ----------------------------------------------------------------------

def _apply(kubectl, objects: list[dict[str, Any]], *flags: str) -> str:
    return kubectl("apply", "--server-side", "--field-manager=omnistage-tests-install", *flags, "-f", "-",
                   input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})).stdout


def _remove(kubectl, wait_for, objects: list[dict[str, Any]]) -> None:
    # Not the CRD: it is the omnistage_crd fixture's (deleting it would delete every OmniStage).
    rest = [d for d in objects if d["kind"] != "CustomResourceDefinition"]
    kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rest}), check=False)
    kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=false", check=False)
    wait_for(f"namespace {NS} gone", lambda: kubectl("get", "namespace", NS, check=False).returncode != 0,
             timeout=120, interval=1)


def _rolled_out(kubectl) -> None:
    proc = kubectl("rollout", "status", "deployment/omnistage-operator", "-n", NS, "--timeout=120s",
                   timeout=150, check=False)
    print(f"[install]   {show(proc)}")
    assert proc.returncode == 0, show(proc)


@pytest.mark.parametrize("source", ["manifests", "manifests/overlays/namespaced"])
def test_kustomize_applies_dry_run_and_for_real(kubectl, kustomize, wait_for, local_cluster, omnistage_crd,
                                                install_lock, source):
    if not local_cluster:
        pytest.skip("installs into omnistage-system with the manifests' names: local control plane only")
    objects = kustomize(ROOT / source)
    _remove(kubectl, wait_for, objects)  # whatever an interrupted run left
    try:
        # A server-side dry run of a namespaced object needs its namespace to exist.
        _apply(kubectl, [d for d in objects if d["kind"] == "Namespace"])
        out = kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts",
                      "--field-manager=omnistage-tests-install", "-k", str(ROOT / source)).stdout
        print(f"\n[install] kubectl apply --server-side --dry-run=server -k {source}:\n{out}")
        assert out.count("(server dry run)") == len(objects), out
        # For real, all but the CRD: the omnistage_crd fixture owns it (its dry run passed above).
        out = _apply(kubectl, [d for d in objects if d["kind"] != "CustomResourceDefinition"])
        print(f"[install] kubectl apply --server-side -k {source} (without the CRD):\n{out}")
        _rolled_out(kubectl)
        sa = f"system:serviceaccount:{NS}:omnistage-operator"
        scope = ["-n", NS] if "namespaced" in source else ["--all-namespaces"]
        assert kubectl("auth", "can-i", "list", "omnistages.serving.omnistage.io", *scope, f"--as={sa}",
                       check=False).stdout.strip() == "yes"
    finally:
        _remove(kubectl, wait_for, objects)


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_helm_installs_dry_run_and_for_real(kubectl, helm, kustomize, wait_for, local_cluster, omnistage_crd,
                                            install_lock, mode):
    if not local_cluster:
        pytest.skip("installs into omnistage-system with the manifests' names: local control plane only")
    values = MODES[mode][0]
    _remove(kubectl, wait_for, kustomize(ROOT / MODES[mode][1][0]))
    helm("uninstall", RELEASE, "--namespace", NS, "--ignore-not-found", check=False)
    try:
        kubectl("create", "namespace", NS)
        rendered = helm("template", RELEASE, str(CHART), "--namespace", NS, "--include-crds", *values).stdout
        out = kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts",
                      "--field-manager=omnistage-tests-install", "-f", "-", input=rendered).stdout
        print(f"\n[install] helm template | kubectl apply --server-side --dry-run=server ({mode}):\n{out}")
        assert out.count("(server dry run)") == len(docs(rendered))
        # --skip-crds: the omnistage_crd fixture owns the CRD (a plain `helm install` installs it).
        proc = helm("install", RELEASE, str(CHART), "--namespace", NS, "--skip-crds", "--wait=watcher",
                    "--timeout=120s", *values, timeout=180, check=False)
        print(f"[install] helm install ({mode}):\n{show(proc)}")
        assert proc.returncode == 0, show(proc)
        assert "STATUS: deployed" in proc.stdout
        _rolled_out(kubectl)
        listed = json.loads(helm("list", "--namespace", NS, "-o", "json").stdout)
        assert [(r["name"], r["status"]) for r in listed] == [(RELEASE, "deployed")]
    finally:
        proc = helm("uninstall", RELEASE, "--namespace", NS, "--ignore-not-found", "--wait", check=False)
        print(f"[install] helm uninstall: {show(proc)}")
        kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=false", check=False)
        wait_for(f"namespace {NS} gone", lambda: kubectl("get", "namespace", NS, check=False).returncode != 0,
                 timeout=120, interval=1)


# ----- monitoring and autoscaling against the real CRDs -------------------------------------------------

@pytest.fixture(scope="module")
def monitoring_crds(kubectl, third_party_crds, wait_for) -> list[str]:
    files = sorted(third_party_crds.glob("*.yaml"))
    names = [docs(f.read_text())[0]["metadata"]["name"] for f in files]
    assert sorted(names) == ["podmonitors.monitoring.coreos.com", "prometheusrules.monitoring.coreos.com",
                             "scaledobjects.keda.sh", "servicemonitors.monitoring.coreos.com"], names
    for f in files:
        kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=omnistage-tests", "-f", str(f))
    for name in names:
        wait_for(f"CRD {name} Established", lambda name=name: kubectl(
            "wait", "--for=condition=Established", f"crd/{name}", "--timeout=5s", check=False).returncode == 0,
            timeout=60)
    return names


def test_monitoring_objects_validate_against_the_prometheus_operator_crds(kubectl, kustomize, namespace,
                                                                          monitoring_crds):
    # Into the test namespace (the monitoring manifests name omnistage-system), as the chart would.
    objects = [json.loads(json.dumps(d).replace(f'"{NS}"', f'"{namespace}"'))
               for d in kustomize(MANIFESTS / "monitoring")]
    assert sorted(d["kind"] for d in objects) == ["ConfigMap", "PodMonitor", "PrometheusRule", "ServiceMonitor"]
    out = _apply(kubectl, objects, "--dry-run=server")
    assert out.count("(server dry run)") == 4, out
    print(f"\n[install] {_apply(kubectl, objects)}")
    pm = kubectl.json("get", "podmonitor", "omnistage-engines", "-n", namespace)
    assert pm["spec"]["selector"]["matchLabels"] == {"serving.omnistage.io/component": "engine",
                                                     "serving.omnistage.io/role": "head"}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    rule = kubectl.json("get", "prometheusrule", "omnistage-operator", "-n", namespace)
    assert {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]} >= {
        "OmniStageCacheInconsistent", "OmniStagePatchNotApplied", "OmniStageReplicasNotJoined",
        "OmniStageOperatorNotLeading"}
    dashboard = kubectl.json("get", "configmap", "omnistage-operator-dashboard", "-n", namespace)
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["omnistage.json"])["uid"] == "omnistage-operator"
    # The schemas are real: a wrong type or format is refused, not stored.
    by_kind = {d["kind"]: d for d in objects}
    bad_pm = json.loads(json.dumps(by_kind["PodMonitor"]))
    bad_pm["spec"]["podMetricsEndpoints"] = "http"
    bad_rule = json.loads(json.dumps(by_kind["PrometheusRule"]))
    bad_rule["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    for bad, field in ((bad_pm, "podMetricsEndpoints"), (bad_rule, "for")):
        proc = kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=json.dumps(bad), check=False)
        assert proc.returncode != 0 and field in proc.stderr, show(proc)


def test_keda_scaledobject_validates_and_targets_the_scale_subresource(kubectl, namespace, omnistage_crd,
                                                                       monitoring_crds):
    so = docs(SCALED_OBJECT.read_text())[0]
    trigger = so["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and "vllm:num_requests_waiting" in trigger["metadata"]["query"]
    sample = next(d for d in docs(SAMPLE.read_text()) if d["kind"] == "OmniStage")
    ref = so["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (sample["apiVersion"], sample["kind"],
                                                             sample["metadata"]["name"])
    for flags in (["--dry-run=server"], []):
        out = kubectl("apply", "--server-side", "--field-manager=omnistage-tests-install", *flags,
                      "-n", namespace, "-f", str(SCALED_OBJECT)).stdout
        print(f"\n[install] kubectl apply {' '.join(flags)} -f {SCALED_OBJECT.relative_to(ROOT)}: {out.strip()}")
    assert kubectl.json("get", "scaledobject", ref["name"], "-n", namespace)["spec"]["maxReplicaCount"] >= 2
    # KEDA (through the HPA it creates) reads and writes spec.replicas through /scale.
    kubectl("apply", "-n", namespace, "-f", str(SAMPLE))
    path = f"/apis/{ref['apiVersion']}/namespaces/{namespace}/omnistages/{ref['name']}/scale"
    scale = json.loads(kubectl("get", "--raw", path).stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == sample["spec"]["replicas"]
    kubectl("scale", "omnistage", ref["name"], "-n", namespace, "--replicas=3")
    assert json.loads(kubectl("get", "--raw", path).stdout)["spec"]["replicas"] == 3
