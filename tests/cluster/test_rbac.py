"""Least privilege, proven on the API server (issue 9 section 3).

* The ClusterRole in manifests/base/rbac.yaml is exactly the reviewed set below, each grant with
  the code that needs it: adding a verb means saying here who uses it.
* The operator's own token (TokenRequest API; conftest.py operator_identity) is granted each of
  them and refused the verbs that were dropped or never needed. The whole operator suite
  (test_operator.py) runs under this identity and fails on any RBAC refusal in the operator log.
* Namespaced mode (manifests/overlays/namespaced): an operator restricted to its namespace
  reconciles an OmniStage there, is refused a Secret in another namespace (kubectl and the
  operator's own client) and leaves an OmniStage there alone.
* Children carry blockOwnerDeletion: with OwnerReferencesPermissionEnforcement (OpenShift) that
  needs omnistages/finalizers update; checked when the API server runs the plugin.
* Leader election (issue 10 section 4): a Role in the operator's own namespace, in both modes,
  grants create on Leases and get/update on the one Lease `omnistage-operator`; any other Lease,
  namespace or verb is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.standin.harness import TESTS_PROBE_HEADS_EVERY, OperatorProcess, converged
from tests.standin.runtime import StandinRuntime

ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "manifests" / "base" / "rbac.yaml"
ROLE = ROOT / "manifests" / "overlays" / "namespaced" / "role.yaml"
SAMPLE = ROOT / "manifests" / "samples" / "omnistage.yaml"
GROUP = "serving.omnistage.io"
CRDS = "customresourcedefinitions.apiextensions.k8s.io"
READY_TIMEOUT = 300

# (API group, resource, verb) -> who needs it. The ClusterRole must be exactly these.
REVIEWED: dict[tuple[str, str, str], str] = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"): "kopf: CRD observer",
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"): "kopf: CRD observer",
    ("", "namespaces", "list"): "kopf: --namespace globs",
    ("", "namespaces", "watch"): "kopf: --namespace globs",
    (GROUP, "omnistages", "get"): "kube.get_omnistage (one the watch has not delivered yet)",
    (GROUP, "omnistages", "list"): "informer.py",
    (GROUP, "omnistages", "watch"): "informer.py",
    (GROUP, "omnistages/status", "patch"): "kube.patch_status",
    (GROUP, "omnistages/finalizers", "update"): "children's blockOwnerDeletion",
    (GROUP, "omnistagepools", "list"): "informer.py",
    (GROUP, "omnistagepools", "watch"): "informer.py",
    (GROUP, "omnistagepools/status", "patch"): "kube.patch_status (the OmniStage's pass writes its pools' status)",
    ("", "pods", "get"): "kube.read (a pod whose create answered 409)",
    ("", "pods", "list"): "informer.py (engine pods)",
    ("", "pods", "watch"): "informer.py (engine pods)",
    ("", "pods", "create"): "kube.create (head, replicas)",
    ("", "pods", "patch"): "kube.patch_pod_annotations (leaving)",
    ("", "pods", "delete"): "kube.delete_pod",
    ("", "pods/status", "patch"): "kube.patch_pod_condition (the joined readiness gate)",
    ("", "configmaps", "list"): "informer.py",
    ("", "configmaps", "watch"): "informer.py",
    ("", "configmaps", "create"): "drift.apply (server-side apply creating it)",
    ("", "configmaps", "patch"): "drift.apply",
    ("", "configmaps", "delete"): "drift.apply (a ConfigMap made immutable: deleted and created again)",
    ("", "services", "list"): "informer.py",
    ("", "services", "watch"): "informer.py",
    ("", "services", "create"): "drift.apply (server-side apply creating it)",
    ("", "services", "patch"): "drift.apply",
    ("", "secrets", "get"): "kube.read (membership token: memory.TOKENS; again each full resync)",
    ("", "secrets", "create"): "kube.create (membership token)",
    ("networking.k8s.io", "networkpolicies", "list"): "informer.py",
    ("networking.k8s.io", "networkpolicies", "watch"): "informer.py",
    ("networking.k8s.io", "networkpolicies", "create"): "drift.apply (server-side apply creating it)",
    ("networking.k8s.io", "networkpolicies", "patch"): "drift.apply",
    ("", "events", "create"): "kube.post_event (the operator's Events)",
    ("policy", "poddisruptionbudgets", "list"): "informer.py",
    ("policy", "poddisruptionbudgets", "watch"): "informer.py",
    ("policy", "poddisruptionbudgets", "create"): "drift.apply (server-side apply creating it)",
    ("policy", "poddisruptionbudgets", "patch"): "drift.apply",
}

# The leader-election Role (rbac.yaml, in the operator's namespace): (group, resource, verb,
# resourceNames) -> who needs it. The Role must be exactly these.
LEASE = "omnistage-operator"
REVIEWED_LEASE: dict[tuple[str, str, str, tuple[str, ...]], str] = {
    ("coordination.k8s.io", "leases", "create", ()): "lease.create_lease (first replica up)",
    ("coordination.k8s.io", "leases", "get", (LEASE,)): "lease.read_lease (first look, after a conflict)",
    ("coordination.k8s.io", "leases", "update", (LEASE,)): "lease.replace_lease (renew, take over, release)",
    ("coordination.k8s.io", "leases", "watch", (LEASE,)): "lease.watch_lease (a follower, metadata.name selector)",
}
LEASES = "leases.coordination.k8s.io"

# Dropped in issue 9 (secrets patch, events patch, events.k8s.io, omnistages/status get) or never
# needed; each must be refused to the operator's token.
REFUSED: list[tuple[str, str, str | None]] = [
    ("patch", "secrets", None), ("update", "secrets", None), ("list", "secrets", None),
    ("watch", "secrets", None), ("delete", "secrets", None),
    ("patch", "events", None), ("create", "events.events.k8s.io", None), ("patch", "events.events.k8s.io", None),
    ("get", f"omnistages.{GROUP}", "status"), ("update", f"omnistages.{GROUP}", "status"),
    ("create", f"omnistages.{GROUP}", None), ("update", f"omnistages.{GROUP}", None),
    ("patch", f"omnistages.{GROUP}", None),  # kopf's progress annotations: kopf watches nothing now
    ("delete", f"omnistages.{GROUP}", None),
    ("update", "pods", None), ("create", "pods", "exec"), ("get", "pods", "log"),
    ("delete", "services", None), ("delete", "networkpolicies.networking.k8s.io", None),
    # Issue 10: the children come from watches; a direct read is no longer needed.
    ("get", "configmaps", None), ("get", "services", None), ("get", "networkpolicies.networking.k8s.io", None),
    ("get", "nodes", None), ("create", "namespaces", None), ("delete", "namespaces", None),
    ("create", CRDS, None), ("create", "roles.rbac.authorization.k8s.io", None),
    ("create", "rolebindings.rbac.authorization.k8s.io", None),
    ("escalate", "clusterroles.rbac.authorization.k8s.io", None), ("impersonate", "serviceaccounts", None),
]


def _expand(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule.get("apiGroups", [])
            for r in rule.get("resources", []) for v in rule.get("verbs", [])}


def _expand_named(rules: list[dict]) -> set[tuple[str, str, str, tuple[str, ...]]]:
    return {(g, r, v, tuple(rule.get("resourceNames") or ())) for rule in rules for g in rule.get("apiGroups", [])
            for r in rule.get("resources", []) for v in rule.get("verbs", [])}


def _kubectl_resource(group: str, resource: str) -> tuple[str, str | None]:
    """("", "pods/status") -> ("pods", "status"); groups are spelled out (pods.v1 is ambiguous)."""
    name, _, sub = resource.partition("/")
    return (f"{name}.{group}" if group else name), (sub or None)


def _sample(replicas: int) -> dict:
    doc = next(d for d in yaml.safe_load_all(SAMPLE.read_text()) if d and d.get("kind") == "OmniStage")
    doc["spec"]["replicas"] = replicas
    return doc


def test_cluster_role_is_exactly_the_reviewed_set():
    docs = [d for d in yaml.safe_load_all(RBAC.read_text()) if d]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    granted = _expand(role["rules"])
    assert not any("*" in t for t in granted), f"wildcards in the ClusterRole: {sorted(t for t in granted if '*' in t)}"
    assert granted - REVIEWED.keys() == set(), "granted but not reviewed (say here which code needs it)"
    assert REVIEWED.keys() - granted == set(), "reviewed but not granted"
    # The namespaced overlay adds only kopf's CRD discovery cluster-wide.
    extra = [d for d in yaml.safe_load_all(ROLE.read_text()) if d and d["kind"] == "ClusterRole"]
    assert [_expand(d["rules"]) for d in extra] == [{("apiextensions.k8s.io", "customresourcedefinitions", "list"),
                                                     ("apiextensions.k8s.io", "customresourcedefinitions", "watch")}]
    # Leases: one namespaced Role, bound in the operator's namespace only, never cluster-wide.
    roles = [d for d in docs if d["kind"] == "Role"]
    assert [d["metadata"]["name"] for d in roles] == ["omnistage-operator-leader-election"]
    assert roles[0]["metadata"]["namespace"] == "omnistage-system"
    assert _expand_named(roles[0]["rules"]) == REVIEWED_LEASE.keys()
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["metadata"]["namespace"] == "omnistage-system" and binding["roleRef"]["kind"] == "Role"
    assert not any("leases" in r.get("resources", []) for r in role["rules"]), "Leases in the ClusterRole"


def test_operator_token_has_exactly_the_granted_verbs(operator_identity, namespace):
    ident = operator_identity("base")
    print(f"\n[rbac] as {ident.user} (TokenRequest token) in namespace {namespace}:")
    wrong = []
    for (group, resource, verb), why in sorted(REVIEWED.items()):
        name, sub = _kubectl_resource(group, resource)
        cluster_scoped = resource in ("customresourcedefinitions", "namespaces")
        yes = ident.can_i(verb, name, None if cluster_scoped else namespace, sub)
        print(f"[rbac]   {'yes' if yes else 'NO ':3} {verb:7} {resource + ('.' + group if group else ''):45} {why}")
        if not yes:
            wrong.append(f"{verb} {resource} refused")
    home = ident.namespace  # the Lease lives in the operator's own namespace
    for (group, resource, verb, names), why in sorted(REVIEWED_LEASE.items()):
        target = f"{resource}.{group}" + (f"/{names[0]}" if names else "")
        yes = ident.can_i(verb, target, home)
        print(f"[rbac]   {'yes' if yes else 'NO ':3} {verb:7} {target + ' -n ' + home:45} {why}")
        if not yes:
            wrong.append(f"{verb} {target} in {home} refused")
    for verb, target, where in [("list", LEASES, home), ("watch", LEASES, home), ("delete", f"{LEASES}/{LEASE}", home),
                                ("patch", f"{LEASES}/{LEASE}", home), ("get", f"{LEASES}/kube-scheduler", home),
                                ("update", f"{LEASES}/other", home), ("watch", f"{LEASES}/other", home),
                                ("create", LEASES, namespace),
                                ("get", f"{LEASES}/{LEASE}", namespace), ("update", f"{LEASES}/{LEASE}", namespace),
                                ("update", f"{LEASES}/kube-controller-manager", "kube-system")]:
        yes = ident.can_i(verb, target, where)
        print(f"[rbac]   {'YES' if yes else 'no ':3} {verb:7} {target + ' -n ' + where:45} (must be refused)")
        if yes:
            wrong.append(f"{verb} {target} in {where} granted")
    for verb, name, sub in REFUSED:
        yes = ident.can_i(verb, name, None if name in ("nodes", "namespaces", CRDS) or "rbac" in name else namespace,
                          sub)
        print(f"[rbac]   {'YES' if yes else 'no ':3} {verb:7} {name + ('/' + sub if sub else ''):45} (must be refused)")
        if yes:
            wrong.append(f"{verb} {name}{'/' + sub if sub else ''} granted")
    assert not wrong, wrong


def test_namespaced_operator_reconciles_its_namespace_and_cannot_reach_another(
        kubectl, kubeconfig, wait_for, operator_identity, local_cluster, tmp_path):
    suffix = uuid.uuid4().hex[:5]
    # Not t-*: the operator suite's operator and stand-in runtime (here or in another session on the
    # same cluster) watch t-*, and must not be the ones that reconcile here.
    home, other = f"omnistage-ns-{suffix}", f"omnistage-other-{suffix}"
    kubectl("create", "namespace", other)
    try:
        ident = operator_identity("namespaced", namespace=home)  # the overlay's Namespace creates `home`
        for ns in (home, other):
            wait_for(f"default ServiceAccount in {ns}", lambda ns=ns: kubectl(
                "get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0, timeout=60)
        kubectl("create", "secret", "generic", "not-yours", "-n", other, "--from-literal=token=keep-out")

        print(f"\n[rbac] namespaced identity {ident.user}:")
        checks = [  # (verb, resource, namespace or None for all/cluster, subresource, expected)
            ("get", "secrets", home, None, True), ("create", "pods", home, None, True),
            ("patch", f"omnistages.{GROUP}", home, "status", True),
            ("list", CRDS, None, None, True),  # kopf's CRD observer (the overlay's discovery role)
            ("update", f"{LEASES}/{LEASE}", home, None, True), ("create", LEASES, home, None, True),
            ("update", f"{LEASES}/{LEASE}", other, None, False), ("create", LEASES, other, None, False),
            ("get", "secrets", other, None, False), ("list", "pods", other, None, False),
            ("create", "pods", other, None, False), ("list", f"omnistages.{GROUP}", other, None, False),
            ("list", f"omnistages.{GROUP}", None, None, False), ("list", "namespaces", None, None, False),
        ]
        wrong = []
        for verb, res, ns, sub, want in checks:
            got = ident.can_i(verb, res, ns, sub)
            print(f"[rbac]   can-i {verb} {res}{'/' + sub if sub else ''} {'-n ' + ns if ns else '-A'}: "
                  f"{'yes' if got else 'no'} (want {'yes' if want else 'no'})")
            if got != want:
                wrong.append((verb, res, ns, sub, got))
        assert not wrong, wrong

        # The forbidden action itself, twice: kubectl with the operator's kubeconfig, and the
        # operator's own API client (omnistage.runtime.kube) in a process that has only that kubeconfig.
        proc = ident.kubectl("get", "secret", "not-yours", "-n", other, check=False)
        print(f"[rbac]   kubectl get secret not-yours -n {other}: exit {proc.returncode}: {proc.stderr.strip()}")
        assert proc.returncode != 0 and "forbidden" in proc.stderr.lower(), proc
        script = ("import sys\nfrom kubernetes.client.exceptions import ApiException\nfrom omnistage.runtime import kube\n"
                  "try:\n    kube.read('Secret', sys.argv[1], 'not-yours')\n    print('read it')\n"
                  "except ApiException as e:\n    print(e.status)\n")
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(ident.kubeconfig)
        out = subprocess.run([sys.executable, "-c", script, other], capture_output=True, text=True, env=env,
                             timeout=60, check=False)
        print(f"[rbac]   omnistage.runtime.kube.read('Secret', {other!r}, 'not-yours') as the operator: {out.stdout.strip()}")
        assert out.stdout.strip() == "403", out

        # Restricted to `home`, the operator reconciles there under this identity...
        standin = (StandinRuntime(kubeconfig=kubeconfig, namespaces=[home], state_dir=tmp_path / "standin")
                   if local_cluster else contextlib.nullcontext())
        with standin:
            # With the Deployment's downward-API environment, so it also elects itself leader through
            # the namespaced Lease grant (a refusal would show in its log, checked below).
            op = OperatorProcess(ident.kubeconfig, tmp_path / "operator.log", namespaces=[home],
                                 env={**ident.env, "POD_NAMESPACE": home, "POD_NAME": "omnistage-operator-0"},
                                 probe_heads_every=TESTS_PROBE_HEADS_EVERY)
            op.start()
            try:
                for ns in (home, other):
                    kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(_sample(replicas=1)))
                wait_for(f"the OmniStage in {home} Ready with its head", lambda: converged(
                    kubectl, home, "qwen3-omni", 1), timeout=READY_TIMEOUT, interval=1)
                lease = kubectl.json("get", "lease", LEASE, "-n", home)["spec"]
                assert lease["holderIdentity"] == "omnistage-operator-0", lease

                # ... and leaves the OmniStage in `other` alone: nothing rendered, no status, for two
                # full resync periods after `home` converged (a negative needs a bounded look).
                def touched() -> list[str]:
                    found = [f"{kind}/{item['metadata']['name']}" for kind in ("pods", "configmaps", "services",
                                                                               "secrets")
                             for item in kubectl.json("get", kind, "-n", other, "-l",
                                                      f"{GROUP}/omnistage=qwen3-omni")["items"]]
                    status = kubectl.json("get", "omnistage", "qwen3-omni", "-n", other).get("status")
                    return found + (["status"] if status else [])

                deadline = time.monotonic() + 12
                while time.monotonic() < deadline:
                    assert touched() == [], f"the namespaced operator reconciled {other}: {touched()}"
                    time.sleep(1)
                # The only refusal it met is kopf's namespace listing, which it answers by watching
                # exactly the --namespace it was given (by design of the overlay).
                denied = op.rbac_denials()
                print(f"[rbac]   refusals in the operator log: {sorted(denied)}")
                assert denied <= {("list", "namespaces", ""), ("watch", "namespaces", "")}, (denied, op.tail(60))
            finally:
                op.stop()
    finally:
        for ns in (home, other):
            kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


def test_chart_watch_namespaces_bind_the_operator_where_it_watches(kubectl, kubeconfig, helm, wait_for,
                                                                  service_account_kubeconfig, omnistage_crd,
                                                                  local_cluster, tmp_path):
    """The chart's watchNamespaces with namespaced=true (issue 21 item 2): the operator runs in its
    release namespace, watches another, and holds its rights there and nowhere else. Its RBAC and
    arguments come from `helm template`; the operator runs here under the chart's ServiceAccount."""
    suffix = uuid.uuid4().hex[:5]
    home, watched, other = (f"omnistage-w{k}-{suffix}" for k in ("home", "watched", "other"))
    release = f"omnistage-operator-{suffix}"  # the fullname: the release name, which holds the chart name
    rendered = [d for d in yaml.safe_load_all(helm(
        "template", release, str(ROOT / "charts" / "omnistage-operator"), "--namespace", home,
        "--set", "namespaced=true", "--set", f"watchNamespaces={{{watched}}}").stdout) if d]
    identity = [d for d in rendered if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                                                       "RoleBinding")]
    deployment = next(d for d in rendered if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert [a for a in container["args"] if a.startswith("--namespace")] == [f"--namespace={watched}"]
    assert sorted((d["kind"], d["metadata"].get("namespace")) for d in identity if d["kind"] == "RoleBinding") == [
        ("RoleBinding", home), ("RoleBinding", watched)]  # the leader-election one at home, the operator's there
    for ns in (home, watched, other):
        kubectl("create", "namespace", ns)
    try:
        kubectl("apply", "--server-side", "--field-manager=omnistage-tests-identity", "-f", "-",
                input=json.dumps({"apiVersion": "v1", "kind": "List", "items": identity}))
        as_operator = type(kubectl)(kubectl.binary, service_account_kubeconfig(release, home))

        def can_i(verb: str, resource: str, ns: str | None, sub: str | None = None) -> bool:
            where = ["-n", ns] if ns else ["--all-namespaces"]
            proc = as_operator("auth", "can-i", verb, resource, *where,
                               *([f"--subresource={sub}"] if sub else []), check=False)
            return proc.stdout.strip().startswith("yes")

        wait_for("the chart's RoleBinding in effect", lambda: can_i("list", f"omnistages.{GROUP}", watched), timeout=60)
        checks = [("list", f"omnistages.{GROUP}", watched, None, True), ("create", "pods", watched, None, True),
                  ("patch", f"omnistages.{GROUP}", watched, "status", True), ("get", "secrets", watched, None, True),
                  ("update", f"{LEASES}/{LEASE}", home, None, True),
                  ("list", f"omnistages.{GROUP}", home, None, False), ("create", "pods", home, None, False),
                  ("list", f"omnistages.{GROUP}", other, None, False), ("get", "secrets", other, None, False),
                  ("list", f"omnistages.{GROUP}", None, None, False)]
        got = [(verb, res, ns, sub, can_i(verb, res, ns, sub)) for verb, res, ns, sub, _ in checks]
        print("\n[rbac] chart identity, watchNamespaces=[watched]:", got)
        assert [g[-1] for g in got] == [c[-1] for c in checks], got

        standin = (StandinRuntime(kubeconfig=kubeconfig, namespaces=[watched], state_dir=tmp_path / "standin")
                   if local_cluster else contextlib.nullcontext())
        with standin:
            op = OperatorProcess(as_operator.kubeconfig, tmp_path / "operator.log", namespaces=[watched],
                                 env={"POD_NAMESPACE": home, "POD_NAME": f"{release}-0"},
                                 probe_heads_every=TESTS_PROBE_HEADS_EVERY)
            op.start()
            try:
                for ns in (watched, other):
                    kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(_sample(replicas=1)))
                wait_for(f"the OmniStage in {watched} Ready with its head", lambda: converged(
                    kubectl, watched, "qwen3-omni", 1), timeout=READY_TIMEOUT, interval=1)
                assert kubectl.json("get", "lease", LEASE, "-n", home)["spec"]["holderIdentity"] == f"{release}-0"
                assert not kubectl.json("get", "omnistage", "qwen3-omni", "-n", other).get("status")
                denied = op.rbac_denials()
                assert denied <= {("list", "namespaces", ""), ("watch", "namespaces", "")}, (denied, op.tail(60))
            finally:
                op.stop()
    finally:
        for ns in (home, watched, other):
            kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)
        for d in identity:
            if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                kubectl("delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found", "--wait=false",
                        check=False)


def test_blockownerdeletion_needs_omnistages_finalizers(kubectl, namespace, operator_identity,
                                                        service_account_kubeconfig, wait_for):
    """What an identity without `omnistages/finalizers: update` meets on a cluster that enforces
    owner-reference permissions, and that the operator's does not."""
    ident = operator_identity("base")
    stage = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "OmniStage", "metadata": {"name": "owner"},
             "spec": {"model": "probe"}}
    kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(stage))
    uid = kubectl("get", "omnistage", "owner", "-n", namespace, "-o", "jsonpath={.metadata.uid}").stdout

    def child(name: str) -> str:
        return json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "ownerReferences": [
            {"apiVersion": f"{GROUP}/v1alpha1", "kind": "OmniStage", "name": "owner", "uid": uid,
             "controller": True, "blockOwnerDeletion": True}]}})

    # The same rules minus the finalizers grant, for a second ServiceAccount in this namespace.
    role = next(d for d in ident.objects if d["kind"] == "ClusterRole")
    rules = [r for r in role["rules"] if "omnistages/finalizers" not in r.get("resources", [])]
    assert len(rules) == len(role["rules"]) - 1
    kubectl("create", "serviceaccount", "no-finalizers", "-n", namespace)
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "no-finalizers", "namespace": namespace}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "no-finalizers", "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "no-finalizers"},
         "subjects": [{"kind": "ServiceAccount", "name": "no-finalizers", "namespace": namespace}]}]}))
    lacking = type(kubectl)(kubectl.binary, service_account_kubeconfig("no-finalizers", namespace))
    wait_for("the no-finalizers Role in effect", lambda: lacking(
        "auth", "can-i", "create", "configmaps", "-n", namespace, check=False).stdout.strip() == "yes", timeout=60)

    refused = lacking("create", "-n", namespace, "-f", "-", input=child("without-grant"), check=False)
    assert ident.kubectl("create", "-n", namespace, "-f", "-", input=child("operator-child"),
                         check=False).returncode == 0, "the operator's identity could not create an owned child"
    if refused.returncode == 0:
        pytest.skip("the API server does not run OwnerReferencesPermissionEnforcement (enable it with "
                    "--enable-admission-plugins=OwnerReferencesPermissionEnforcement to check this); the "
                    "operator's identity holds omnistages/finalizers update regardless (previous test)")
    print(f"\n[rbac] without omnistages/finalizers: {refused.stderr.strip()}")
    assert "blockOwnerDeletion" in refused.stderr, refused.stderr
