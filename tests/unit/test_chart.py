"""The Helm chart's values, rendered by the real `helm template` (issue 21, item 1).

charts/omnistage-operator is generated from manifests/ (hack/gen-helm-chart.py); that `helm
template` at the defaults equals the kustomize build is checked by tests/cluster/test_install.py
(it needs kubectl). Here every value of values.schema.json is set at least once and its rendered
objects asserted (test_every_value_is_rendered_by_a_case fails when a value has no case), the schema's
refusals are checked, and the chart's README is what the generator makes of the schema.

helm is the project's own (hack/build-k8s-bins.sh builds it from its Go module); without it the
helm tests skip, saying so. No cluster is needed: `helm template` runs offline.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.repo import ROOT, hack_script

CHART = ROOT / "charts" / "omnistage-operator"
NS = "omnistage-system"
RELEASE = "omnistage-operator"
VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
RBAC_KINDS = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def generator():
    return hack_script("gen-helm-chart.py")


@pytest.fixture(scope="module")
def helm_binary() -> str:
    if os.environ.get("OMNISTAGE_HELM"):
        return os.environ["OMNISTAGE_HELM"]
    proc = subprocess.run(["bash", str(ROOT / "hack" / "build-k8s-bins.sh"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        pytest.skip("no helm: `make k8s-bins` builds it from its Go module (or set OMNISTAGE_HELM)")
    return str(Path(proc.stdout.strip().splitlines()[-1]) / "helm")


@pytest.fixture(scope="module")
def helm(helm_binary, tmp_path_factory) -> Callable[..., subprocess.CompletedProcess[str]]:
    """helm("template", ...) with its own empty config, cache and data directories."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_DATA_HOME": str(home / "data")}

    def run(*args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        extra = []
        if values is not None:
            f = home / f"values-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
            f.write_text(yaml.safe_dump(values))
            extra = ["--values", str(f)]
        return subprocess.run([helm_binary, *args, *extra], capture_output=True, text=True, timeout=120,
                              check=False, env=env)

    return run


@pytest.fixture(scope="module")
def render(helm) -> Callable[..., list[dict[str, Any]]]:
    def template(values: dict[str, Any] | None = None, *sets: str, release: str = RELEASE,
                 namespace: str = NS) -> list[dict[str, Any]]:
        proc = helm("template", release, str(CHART), "--namespace", namespace, *sets, values=values)
        assert proc.returncode == 0, proc.stderr
        return [d for d in yaml.safe_load_all(proc.stdout) if d]
    return template


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name}: {[o['metadata']['name'] for o in objects if o['kind'] == kind]}"
    return found[0]


def pod_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return pod_spec(objects)["containers"][0]


def subjects(objects: list[dict[str, Any]]) -> set[str]:
    return {s["name"] for o in objects if o["kind"].endswith("Binding") for s in o["subjects"]}


# ----- the defaults ---------------------------------------------------------------------------------------

def test_defaults_render_what_values_yaml_says(render):
    objs = render()
    dep = one(objs, "Deployment", RELEASE)
    pod, c = pod_spec(objs), container(objs)
    assert dep["spec"]["replicas"] == VALUES["replicaCount"] == 2
    assert c["image"] == f"{VALUES['image']['repository']}:{VALUES['image']['tag']}"
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert c["resources"] == VALUES["resources"] and c["securityContext"] == VALUES["securityContext"]
    assert pod["affinity"] == VALUES["affinity"] and pod["securityContext"] == VALUES["podSecurityContext"]
    assert pod["serviceAccountName"] == RELEASE
    for absent in ("imagePullSecrets", "nodeSelector", "tolerations", "priorityClassName"):
        assert absent not in pod
    assert "annotations" not in dep["spec"]["template"]["metadata"]
    assert sorted(o["kind"] for o in objs) == ["ClusterRole", "ClusterRoleBinding", "Deployment",
                                               "PodDisruptionBudget", "Role", "RoleBinding", "Service",
                                               "ServiceAccount"]
    assert one(objs, "PodDisruptionBudget")["spec"] == {
        "maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "omnistage-operator"}}}


@pytest.mark.parametrize("sets", [[], ["--set", "namespaced=true"], ["--set", "monitoring.enabled=true"]],
                         ids=["cluster-wide", "namespaced", "monitoring"])
@pytest.mark.parametrize("release", [RELEASE, "team-a"])
def test_every_object_carries_the_standard_labels(render, sets, release):
    objs = render(None, *sets, release=release)
    want = {"app.kubernetes.io/name": "omnistage-operator", "app.kubernetes.io/instance": release,
            "app.kubernetes.io/version": VERSION, "app.kubernetes.io/managed-by": "Helm",
            "helm.sh/chart": f"omnistage-operator-{VERSION}"}
    for o in objs:
        labels = o["metadata"]["labels"]
        assert {k: labels.get(k) for k in want} == want, f"{o['kind']} {o['metadata']['name']}"
    pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pod_labels == {k: want[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                                               "app.kubernetes.io/version")}


def test_names_follow_the_release(render):
    objs = render(None, "--set", "namespaced=true", release="team-a")
    fullname = "team-a-omnistage-operator"
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert names == {
        ("ServiceAccount", fullname),
        ("ClusterRole", fullname),
        ("ClusterRole", f"{fullname}-discovery"),
        ("ClusterRoleBinding", f"{fullname}-discovery"),
        ("Role", f"{fullname}-leader-election"),
        ("RoleBinding", f"{fullname}-leader-election"),
        ("RoleBinding", fullname),
        ("Service", f"{fullname}-metrics"),
        ("Deployment", fullname),
        ("PodDisruptionBudget", fullname),
    }
    assert {o["roleRef"]["name"] for o in objs if "roleRef" in o} == {
        fullname, f"{fullname}-discovery", f"{fullname}-leader-election"}
    assert subjects(objs) == {fullname}
    # The operator elects on a fixed Lease name (operator/omnistage/leader.py), whatever the release.
    role = one(objs, "Role")
    assert [r.get("resourceNames") for r in role["rules"]] == [None, ["omnistage-operator"]]


# ----- every value -----------------------------------------------------------------------------------------
# (values, check(objects)): each case sets some values and asserts what they render.

def _check_image(objs):
    c = container(objs)
    assert c["image"] == "registry.example/ml/operator:9.9.9" and c["imagePullPolicy"] == "Always"


def _check_pull_secrets(objs):
    assert pod_spec(objs)["imagePullSecrets"] == [{"name": "regcred"}]


def _check_engine_image(objs):
    assert {"name": "OMNISTAGE_ENGINE_IMAGE", "value": "registry.example/ml/engine:9.9.9"} in container(objs)[
        "env"
    ]


def _check_allowed_host_paths(objs):
    """The operator reads the allow-list from this variable (api/security.py), comma-separated."""
    assert {"name": "OMNISTAGE_ALLOWED_HOST_PATHS", "value": "/mnt/models,/data/weights"} in container(objs)[
        "env"
    ]


def _check_bind_address(objs):
    """/metrics and the probes bind what the operator reads here (operator_main.bind_address); by default
    the pod's IP, which Kubernetes expands from POD_IP, itself defined before it (issue 27, item 8)."""
    env = container(objs)["env"]
    assert {"name": "OMNISTAGE_BIND_ADDRESS", "value": "0.0.0.0"} in env


def _check_bind_address_default(objs):
    env = container(objs)["env"]
    names = [e["name"] for e in env]
    assert {"name": "OMNISTAGE_BIND_ADDRESS", "value": "$(POD_IP)"} in env
    assert env[names.index("POD_IP")]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # $(VAR) expands earlier variables only
    assert names.index("POD_IP") < names.index("OMNISTAGE_BIND_ADDRESS")


def _check_namespaced(objs):
    assert "--namespace=$(POD_NAMESPACE)" in container(objs)["args"]
    assert {(o["kind"], o["metadata"]["name"]) for o in objs if o["kind"] in RBAC_KINDS} == {
        ("ClusterRole", RELEASE), ("RoleBinding", RELEASE), ("ClusterRole", f"{RELEASE}-discovery"),
        ("ClusterRoleBinding", f"{RELEASE}-discovery"), ("Role", f"{RELEASE}-leader-election"),
        ("RoleBinding", f"{RELEASE}-leader-election")}


def _bindings_of_the_operator_role(objs):
    return sorted((o["kind"], o["metadata"].get("namespace")) for o in objs
                  if o["kind"] in ("RoleBinding", "ClusterRoleBinding") and o["roleRef"]["name"] == RELEASE)


def _check_watch_namespaces_namespaced(objs):
    """Each watched namespace: a --namespace and the operator's rights there; the own namespace no more."""
    args = container(objs)["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    assert _bindings_of_the_operator_role(objs) == [("RoleBinding", "team-a"), ("RoleBinding", "team-b")]
    for rb in (o for o in objs if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == RELEASE):
        assert rb["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NS}]


def _check_watch_namespaces_cluster_wide(objs):
    """Cluster-wide rights stay; the operator only watches fewer namespaces."""
    args = container(objs)["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a"]
    assert _bindings_of_the_operator_role(objs) == [("ClusterRoleBinding", None)]


def _check_replicas(objs):
    assert one(objs, "Deployment")["spec"]["replicas"] == 1


def _check_resources_merge(objs):
    # Helm merges maps: the default requests stay.
    assert container(objs)["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"},
                                            "limits": {"memory": "1Gi", "cpu": "2"}}


def _check_resources_null(objs):
    assert container(objs)["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}}


def _check_node_selector(objs):
    assert pod_spec(objs)["nodeSelector"] == {"pool": "system"}


TOLERATION = {"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}


def _check_tolerations(objs):
    assert pod_spec(objs)["tolerations"] == [TOLERATION]


NODE_AFFINITY = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]}}


def _check_affinity_replaced(objs):
    assert pod_spec(objs)["affinity"] == {"nodeAffinity": NODE_AFFINITY}


def _check_affinity_none(objs):
    assert "affinity" not in pod_spec(objs)


def _check_priority_class(objs):
    assert pod_spec(objs)["priorityClassName"] == "system-cluster-critical"


def _check_pod_security_context(objs):
    assert pod_spec(objs)["securityContext"] == {**VALUES["podSecurityContext"], "runAsUser": 1000,
                                                 "fsGroup": 1000}


def _check_security_context(objs):
    sc = container(objs)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is False and sc["capabilities"] == {"drop": ["ALL"]}


def _check_pod_metadata(objs):
    dep = one(objs, "Deployment")
    meta = dep["spec"]["template"]["metadata"]
    assert meta["annotations"] == {"example.com/owner": "ml-platform"}
    assert meta["labels"]["team"] == "ml" and "team" not in dep["spec"]["selector"]["matchLabels"]
    assert "team" not in dep["metadata"]["labels"]


def _check_existing_service_account(objs):
    assert not [o for o in objs if o["kind"] == "ServiceAccount"]
    assert pod_spec(objs)["serviceAccountName"] == "ops-operator" and subjects(objs) == {"ops-operator"}


def _check_default_service_account(objs):
    assert not [o for o in objs if o["kind"] == "ServiceAccount"]
    assert pod_spec(objs)["serviceAccountName"] == "default" and subjects(objs) == {"default"}


def _check_named_service_account(objs):
    sa = one(objs, "ServiceAccount")
    assert sa["metadata"]["name"] == "ops-operator"
    assert sa["metadata"]["annotations"] == {"iam.example.com/role": "omnistage"}
    assert pod_spec(objs)["serviceAccountName"] == "ops-operator" and subjects(objs) == {"ops-operator"}


def _check_no_rbac(objs):
    assert not [o for o in objs if o["kind"] in RBAC_KINDS]
    assert one(objs, "ServiceAccount")


def _check_name_override(objs):
    dep = one(objs, "Deployment", "omnistage-operator-osto")
    assert dep["metadata"]["labels"]["app.kubernetes.io/name"] == "osto"
    assert dep["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "osto"}
    assert dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "osto"
    assert one(objs, "Service")["spec"]["selector"] == {"app.kubernetes.io/name": "osto"}
    assert one(objs, "PodDisruptionBudget")["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "osto"}
    }


def _check_fullname_override(objs):
    assert {o["metadata"]["name"] for o in objs} == {"osto", "osto-metrics", "osto-leader-election"}
    assert {o["roleRef"]["name"] for o in objs if "roleRef" in o} == {"osto", "osto-leader-election"}
    assert subjects(objs) == {"osto"} and pod_spec(objs)["serviceAccountName"] == "osto"
    assert one(objs, "Deployment")["metadata"]["labels"]["app.kubernetes.io/name"] == "omnistage-operator"


def _check_monitoring(objs):
    sm, pm = one(objs, "ServiceMonitor"), one(objs, "PodMonitor")
    rule, dashboard = one(objs, "PrometheusRule"), one(objs, "ConfigMap", f"{RELEASE}-dashboard")
    for m in (sm, pm, rule, dashboard):
        assert m["metadata"]["namespace"] == "monitoring" and m["metadata"]["labels"]["release"] == "kps"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NS]}
    assert [e["interval"] for e in sm["spec"]["endpoints"]] == ["1m"]
    assert [e["interval"] for e in pm["spec"]["podMetricsEndpoints"]] == ["5s"]
    # The operator's own objects stay in the release namespace.
    assert one(objs, "Deployment")["metadata"]["namespace"] == NS


CASES = [
    (
        {"image": {"repository": "registry.example/ml/operator", "tag": "9.9.9", "pullPolicy": "Always"}},
        _check_image,
    ),
    ({"imagePullSecrets": [{"name": "regcred"}]}, _check_pull_secrets),
    ({"engineImage": "registry.example/ml/engine:9.9.9"}, _check_engine_image),
    ({"allowedHostPaths": ["/mnt/models", "/data/weights"]}, _check_allowed_host_paths),
    ({"bindAddress": "0.0.0.0"}, _check_bind_address),
    ({}, _check_bind_address_default),
    ({"namespaced": True}, _check_namespaced),
    ({"namespaced": True, "watchNamespaces": ["team-a", "team-b"]}, _check_watch_namespaces_namespaced),
    ({"watchNamespaces": ["team-a"]}, _check_watch_namespaces_cluster_wide),
    ({"replicaCount": 1}, _check_replicas),
    ({"resources": {"limits": {"memory": "1Gi", "cpu": "2"}}}, _check_resources_merge),
    ({"resources": {"limits": None}}, _check_resources_null),
    ({"nodeSelector": {"pool": "system"}}, _check_node_selector),
    ({"tolerations": [TOLERATION]}, _check_tolerations),
    ({"affinity": {"podAntiAffinity": None, "nodeAffinity": NODE_AFFINITY}}, _check_affinity_replaced),
    ({"affinity": None}, _check_affinity_none),
    ({"priorityClassName": "system-cluster-critical"}, _check_priority_class),
    ({"podSecurityContext": {"runAsUser": 1000, "fsGroup": 1000}}, _check_pod_security_context),
    ({"securityContext": {"readOnlyRootFilesystem": False}}, _check_security_context),
    (
        {"podAnnotations": {"example.com/owner": "ml-platform"}, "podLabels": {"team": "ml"}},
        _check_pod_metadata,
    ),
    ({"serviceAccount": {"create": False, "name": "ops-operator"}}, _check_existing_service_account),
    ({"serviceAccount": {"create": False}}, _check_default_service_account),
    (
        {"serviceAccount": {"name": "ops-operator", "annotations": {"iam.example.com/role": "omnistage"}}},
        _check_named_service_account,
    ),
    ({"rbac": {"create": False}}, _check_no_rbac),
    ({"rbac": {"create": False}, "namespaced": True}, _check_no_rbac),
    ({"nameOverride": "osto"}, _check_name_override),
    ({"fullnameOverride": "osto"}, _check_fullname_override),
    (
        {
            "monitoring": {
                "enabled": True,
                "namespace": "monitoring",
                "labels": {"release": "kps"},
                "operatorInterval": "1m",
                "engineInterval": "5s",
            }
        },
        _check_monitoring,
    ),
]


@pytest.mark.parametrize("values,check", CASES, ids=[c[1].__name__.removeprefix("_check_") for c in CASES])
def test_value_renders(render, values, check):
    check(render(values))


def _leaves(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for name, prop in schema["properties"].items():
        out |= _leaves(prop, f"{prefix}{name}.") if "properties" in prop else {prefix + name}
    return out


def _set_keys(values: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for name, value in values.items():
        prop = schema["properties"][name]
        out |= (_set_keys(value, prop, f"{prefix}{name}.") if "properties" in prop else {prefix + name})
    return out


def test_every_value_is_rendered_by_a_case():
    covered = set().union(*(_set_keys(values, SCHEMA) for values, _ in CASES))
    assert _leaves(SCHEMA) - covered == set(), "values without a case in CASES"


def test_monitoring_templates_pass_through_as_written(render):
    # Prometheus' and Grafana's own {{ }} templates are escaped by the generator, not executed by Helm.
    objs = render(None, "--set", "monitoring.enabled=true")
    manifests = ROOT / "manifests" / "monitoring"
    dashboard = one(objs, "ConfigMap", f"{RELEASE}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["omnistage.json"] == (manifests / "dashboards" / "omnistage.json").read_text()
    want = yaml.safe_load((manifests / "prometheusrule.yaml").read_text())["spec"]
    assert one(objs, "PrometheusRule")["spec"] == want


# ----- the schema ------------------------------------------------------------------------------------------

# What the ecosystem review (2026-12-01) tried first; all eight were refused before.
COMMON_OVERRIDES = ["replicaCount=1", "image.pullPolicy=Always", "imagePullSecrets[0].name=regcred",
                    "resources.limits.memory=1Gi", "nodeSelector.pool=system", "serviceAccount.create=false",
                    "monitoring.labels.release=kps", "fullnameOverride=osto"]


@pytest.mark.parametrize("override", COMMON_OVERRIDES)
def test_common_overrides_are_accepted(render, override):
    render(None, "--set", override)


@pytest.mark.parametrize("override,named", [
    ("replicaCont=1", "replicaCont"),                   # a typo at the top level
    ("image.pullpolicy=Always", "pullpolicy"),          # ... in a group
    ("serviceAccount.creat=false", "creat"),
    ("rbac.enabled=false", "enabled"),
    ("monitoring.label.release=kps", "label"),
    ("replicaCount=two", "replicaCount"),               # wrong types and values
    ("image.pullPolicy=Sometimes", "pullPolicy"),
    ("watchNamespaces[0]=Team_A", "watchNamespaces"),  # not a namespace name
    ("allowedHostPaths[0]=models", "allowedHostPaths"),  # not absolute
    ("monitoring.operatorInterval=30", "operatorInterval"),
    ("namespaced=yes", "namespaced"),
    ("nodeSelector.pool=1", "pool"),                    # label values are strings (--set-string)
    # The selector's label is the chart's (helm names the refused key, not always the value's path).
    ("podLabels.app\\.kubernetes\\.io/name=x", "app.kubernetes.io/name"),
    ("fullnameOverride=Not_A_Name", "fullnameOverride"),
])
def test_schema_refuses(helm, override, named):
    proc = helm("template", RELEASE, str(CHART), "--set", override)
    assert proc.returncode != 0 and named in proc.stderr, proc.stderr


def _has_null(values: Any) -> bool:
    return values is None or isinstance(values, dict) and any(_has_null(v) for v in values.values())


def test_helm_lint_strict_with_every_value_set(helm):
    everything: dict[str, Any] = {}
    for values, _ in CASES:
        if not _has_null(values):  # a null removes a default; lint the values that add
            everything = _merge(everything, values)
    proc = helm("lint", "--strict", str(CHART), "--namespace", NS, values=everything)
    assert proc.returncode == 0 and "0 chart(s) failed" in proc.stdout, proc.stdout + proc.stderr


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ----- the README and values.yaml, without helm ---------------------------------------------------------

def test_chart_readme_is_generated_from_the_schema():
    want = generator().readme(SCHEMA, VALUES)
    assert (CHART / "README.md").read_text() == want, \
        "charts/omnistage-operator/README.md drifted from values.schema.json: run `make chart`"


def test_values_yaml_and_the_schema_name_the_same_values():
    assert _leaves(SCHEMA) == _set_keys(VALUES, SCHEMA)
