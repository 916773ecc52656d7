"""The OmniStage API on a real API server, before any operator runs, driven by the real kubectl.

Users run `kubectl apply / get / explain / scale` literally; so do these tests. The invalid specs
are refused by the API server itself (OpenAPI and CEL rules of the committed CRD), and the GPU
pods show that the simulated H200 nodes are what the scheduler sees.
"""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from omnistage.api.child_names import MAX_OMNISTAGE_NAME, MAX_POOL_NAME

from tests.support.patches import apply_merge_patch

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "omnistage.yaml"
PRODUCTION_SAMPLE = ROOT / "manifests" / "samples" / "omnistage-production.yaml"
GPU = "nvidia.com/gpu"
H200_LABEL = "nvidia.com/gpu.product"
# kwok never pulls it; on kind it is already on every node (the kubelet's sandbox image).
POD_IMAGE = "registry.k8s.io/pause:3.10"


def _sample() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(SAMPLE.read_text()) if d and d.get("kind") == "OmniStage"]
    assert len(docs) == 1, f"{SAMPLE} should hold exactly one OmniStage"
    return docs[0]


@pytest.fixture
def sample(omnistage_crd, kubectl, namespace) -> dict[str, Any]:
    """The committed sample, applied into the test namespace as a user would."""
    out = kubectl("apply", "-n", namespace, "-f", str(SAMPLE))
    assert re.search(r"omnistage\.serving\.omnistage\.io/\S+ created", out.stdout), out.stdout
    return _sample()


def test_apply_sample(sample, kubectl, namespace):
    name = sample["metadata"]["name"]
    obj = kubectl.json("get", "omnistage", name, "-n", namespace)
    assert obj["apiVersion"] == "serving.omnistage.io/v1alpha1"
    assert obj["spec"]["model"] == sample["spec"]["model"]
    # Defaults from the schema are filled in by the API server.
    assert obj["spec"]["cache"]["mode"]
    # Applying the same file again changes nothing.
    again = kubectl("apply", "-n", namespace, "-f", str(SAMPLE))
    assert "unchanged" in again.stdout, again.stdout


def test_get_prints_printer_columns(sample, kubectl, namespace):
    name = sample["metadata"]["name"]
    for resource in ("omnistage", "omnistages", "ost"):  # singular, plural, short name
        out = kubectl("get", resource, "-n", namespace).stdout
        print(out)
        header, *rows = out.strip().splitlines()
        assert header.split() == ["NAME", "DESIRED", "READY", "REGISTERED", "STANDBY", "CACHE", "STATUS", "REASON",
                                  "AGE"]
        assert len(rows) == 1
        row = rows[0].split()
        assert row[0] == name
        assert row[1] == str(sample["spec"].get("replicas", 1))
    everywhere = kubectl("get", "omnistage", "-A").stdout
    assert everywhere.split()[:2] == ["NAMESPACE", "NAME"] and namespace in everywhere
    # Status and Reason are the Ready condition's (written here as the operator would).
    ready = {"type": "Ready", "status": "False", "reason": "HeadPending", "message": "the head pod is not Ready",
             "lastTransitionTime": "2026-12-01T00:00:00Z"}
    kubectl("patch", "omnistage", name, "-n", namespace, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": {"conditions": [ready]}}))
    header, row = kubectl("get", "ost", name, "-n", namespace).stdout.splitlines()[:2]
    # By column position: an empty cell (no operator writes CACHE in this module) prints as blanks.
    starts = [header.index(h) for h in header.split()]
    cells = {h: row[a:b].strip() for h, a, b in zip(header.split(), starts, [*starts[1:], None], strict=True)}
    assert (cells.get("STATUS"), cells.get("REASON")) == ("False", "HeadPending"), row


def test_conditions_are_keyed_by_type(sample, kubectl, namespace):
    ready = {"type": "Ready", "status": "False", "reason": "HeadPending", "message": "m",
             "lastTransitionTime": "2026-12-01T00:00:00Z"}
    proc = kubectl("patch", "omnistage", sample["metadata"]["name"], "-n", namespace, "--subresource=status",
                   "--type=merge", "-p", json.dumps({"status": {"conditions": [ready, {**ready, "status": "True"}]}}),
                   check=False)
    assert proc.returncode != 0 and "Duplicate value" in proc.stderr, proc.stderr


def _spec_properties(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def _walk(props: dict[str, Any], prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name, schema in props.items():
        out.append((prefix + name, schema))
        out += _walk(schema.get("properties", {}), f"{prefix}{name}.")
        out += _walk(schema.get("items", {}).get("properties", {}), f"{prefix}{name}.")
    return out


def test_explain_describes_every_spec_field(omnistage_crd, kubectl):
    out = kubectl("explain", "omnistage.spec").stdout
    print(out)
    assert re.search(r"^KIND:\s+OmniStage$", out, re.MULTILINE) and "serving.omnistage.io" in out
    flat = " ".join(out.split())  # explain wraps long descriptions
    props = _spec_properties(omnistage_crd)
    assert {"model", "replicas", "cache", "membership", "engine", "gpu", "placement"} <= set(props)
    for name, schema in props.items():
        assert re.search(rf"^  {re.escape(name)}\s+<", out, re.MULTILINE), f"explain omnistage.spec lacks {name}"
        description = schema.get("description", "")
        assert description, f"spec.{name} has no description"
        assert " ".join(description.split())[:60] in flat, f"explain omnistage.spec lacks the description of {name}"
    # Nested fields are described too, all the way down.
    recursive = kubectl("explain", "omnistage.spec", "--recursive").stdout
    for path, schema in _walk(props):
        assert schema.get("description"), f"spec.{path} has no description"
        assert re.search(rf"^\s+{re.escape(path.rsplit('.', 1)[-1])}\s+<", recursive, re.MULTILINE), path
    mode = kubectl("explain", "omnistage.spec.cache.mode").stdout
    assert "processor-only" in mode


def test_explain_template_field(omnistage_crd, kubectl):
    """spec.template carries the real core/v1 schema (generated from the Kubernetes OpenAPI document),
    not preserve-unknown-fields: kubectl explain walks into it like into a Deployment's template."""
    out = kubectl("explain", "omnistage.spec.template.spec.containers.resources").stdout
    print(out)
    assert re.search(r"^FIELD:\s+resources <Object>", out, re.MULTILINE), out
    assert "Compute Resources required by this container." in out
    for field in ("claims", "limits", "requests"):
        assert re.search(rf"^  {field}\s+<", out, re.MULTILINE), f"explain lacks {field}"
    env = kubectl("explain", "omnistage.spec.template.spec.containers.env.valueFrom.secretKeyRef").stdout
    assert re.search(r"^  key\s+<string> -required-", env, re.MULTILINE), env
    value_from = kubectl("explain", "omnistage.spec.engine.env.valueFrom").stdout
    assert "secretKeyRef" in value_from and "configMapKeyRef" in value_from


def test_production_sample_passes_server_side_validation(omnistage_crd, kubectl, namespace):
    """The GPU-cluster sample (PVC weights, HF_TOKEN from a Secret, imagePullSecret, pod template) is
    valid for the API server. Dry run: its PVC, Secrets and RuntimeClass exist only on a real cluster."""
    out = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(PRODUCTION_SAMPLE), check=False)
    assert out.returncode == 0, out.stderr
    assert "created (server dry run)" in out.stdout, out.stdout
    out = kubectl("apply", "--dry-run=server", "--server-side", "-n", namespace, "-f", str(PRODUCTION_SAMPLE),
                  check=False)
    assert out.returncode == 0, out.stderr


def test_scale_subresource(sample, kubectl, namespace):
    name = sample["metadata"]["name"]
    out = kubectl("scale", "omnistage", name, "-n", namespace, "--replicas=3")
    assert f"omnistage.serving.omnistage.io/{name} scaled" in out.stdout
    assert kubectl.json("get", "omnistage", name, "-n", namespace)["spec"]["replicas"] == 3
    scale = json.loads(kubectl(
        "get", "--raw", f"/apis/serving.omnistage.io/v1alpha1/namespaces/{namespace}/omnistages/{name}/scale").stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    # The scale subresource checks its precondition against .spec.replicas too.
    stale = kubectl("scale", "omnistage", name, "-n", namespace, "--current-replicas=2", "--replicas=5", check=False)
    assert stale.returncode != 0 and "Expected replicas to be 2, was 3" in stale.stderr
    # Validation holds through the scale subresource as well.
    zero = kubectl("scale", "omnistage", name, "-n", namespace, "--replicas=0", check=False)
    assert zero.returncode != 0 and "spec.replicas" in zero.stderr, zero.stderr


def test_rbac_is_enforced(omnistage_crd, kubectl, namespace):
    """RBAC is on: a ServiceAccount without bindings may do nothing (the operator's Role is tested later)."""
    who = f"--as=system:serviceaccount:{namespace}:default"
    for verb, resource in (("create", "omnistages.serving.omnistage.io"), ("list", "pods"), ("patch", "nodes")):
        out = kubectl("auth", "can-i", verb, resource, "-n", namespace, who, check=False)
        assert out.stdout.strip() == "no", (verb, resource, out.stdout, out.stderr)
    denied = kubectl("get", "omnistages", "-n", namespace, who, check=False)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr, denied.stderr


_DELETE = None  # a JSON merge patch's null: the field is removed

# (id, change to the sample's spec, text the API server's answer must contain: the field, and
# for the CEL rules the start of the rule's message, which says what to change).
INVALID = [
    ("model-missing", {"model": _DELETE}, ["spec.model", "Required value"]),
    ("model-empty", {"model": ""}, ["spec.model"]),
    ("replicas-zero", {"replicas": 0}, ["spec.replicas", "greater than or equal to 1"]),
    ("replicas-too-many", {"replicas": 1000}, ["spec.replicas", "less than or equal to 256"]),
    ("replicas-not-a-number", {"replicas": "two"}, ["spec.replicas", "integer"]),
    ("cache-mode-unknown", {"cache": {"mode": "fifo"}}, ["spec.cache.mode", "Unsupported value"]),
    ("cache-size-negative", {"cache": {"sizeGiB": -1}}, ["spec.cache.sizeGiB"]),
    ("membership-unknown", {"membership": "sometimes"}, ["spec.membership", "Unsupported value"]),
    ("gpu-memory-utilization-above-1", {"engine": {"gpuMemoryUtilization": 1.5}},
     ["spec.engine.gpuMemoryUtilization"]),
    ("tensor-parallel-zero", {"engine": {"tensorParallelSize": 0}}, ["spec.engine.tensorParallelSize"]),
    ("http-port-out-of-range", {"engine": {"httpPort": 70000}}, ["spec.engine.httpPort"]),
    ("pull-policy-unknown", {"engine": {"imagePullPolicy": "Sometimes"}}, ["spec.engine.imagePullPolicy"]),
    ("shm-size-not-a-quantity", {"shmSize": "lots"}, ["spec.shmSize"]),
    ("host-path-relative", {"modelVolume": {"hostPath": {"path": "models"}}}, ["spec.modelVolume.hostPath.path"]),
    ("unknown-field", {"replica": 2}, ['unknown field "spec.replica"']),
    # CEL rules (operator/omnistage/api/validation.py)
    ("lru-with-dynamic-membership", {"membership": "dynamic", "cache": {"mode": "lru"}},
     ["spec.cache.mode", "processor-only"]),
    ("standby-with-static-membership", {"membership": "static", "standby": 1},
     ["spec.standby", "needs spec.membership dynamic"]),
    ("spare-head-with-static-membership", {"membership": "static", "head": {"standby": 1}},
     ["spec.head.standby", "needs spec.membership dynamic"]),
    ("spare-head-above-one", {"head": {"standby": 2}}, ["spec.head.standby"]),
    ("spare-head-with-stages", {"pipeline": "qwen3_omni_moe", "head": {"standby": 1},
                                "stages": [{"id": 1, "name": "talker"}, {"id": 2, "name": "code2wav"}]},
     ["spec.head.standby", "needs a single-stage pipeline"]),
    ("shm-with-two-replicas", {"membership": "static", "replicas": 2, "cache": {"mode": "shm"}},
     ["spec.cache.mode"]),
    ("gpu-count-below-tensor-parallel", {"gpu": {"count": 1}, "engine": {"tensorParallelSize": 2}},
     ["spec.gpu.count", "must be at least spec.engine.tensorParallelSize"]),
    ("ports-collide", {"engine": {"httpPort": 9000, "masterPort": 9000}},
     ["spec.engine.masterPort", "must differ"]),
    ("membership-port-collides", {"engine": {"httpPort": 9000, "membershipPort": 9000}},
     ["spec.engine.membershipPort", "must differ from spec.engine.httpPort"]),
    ("multi-stage-pipeline", {"pipeline": "qwen2_5_omni"}, ["spec.pipeline", "multi-stage vllm-omni pipeline"]),
    ("operator-owned-flag", {"engine": {"extraArgs": ["--omni-master-address=127.0.0.9"]}},
     ["spec.engine.extraArgs", "must not set flags the operator manages"]),
    # The frontend cache, the rendered stage config and the engine plugin are the operator's too.
    ("cache-type-flag", {"engine": {"extraArgs": ["--trust-remote-code", "--mm-processor-cache-type=shm"]}},
     ["spec.engine.extraArgs", "must not set flags the operator manages"]),
    ("cache-size-flag-separate-value", {"engine": {"extraArgs": ["--mm-processor-cache-gb", "0"]}},
     ["spec.engine.extraArgs", "must not set flags the operator manages"]),
    ("cache-type-flag-underscores", {"engine": {"extraArgs": ["--mm_processor_cache_type=lru"]}},
     ["spec.engine.extraArgs", "must not set flags the operator manages"]),
    ("stage-overrides-flag-dotted", {"engine": {"extraArgs": ["--stage-overrides.0.num_replicas=3"]}},
     ["spec.engine.extraArgs", "must not set flags the operator manages"]),
    ("config-file-flag", {"engine": {"extraArgs": ["--config", "/models/args.yaml"]}},
     ["spec.engine.extraArgs", "must not set flags the operator manages"]),
    ("api-server-count-alias", {"engine": {"extraArgs": ["-asc=2"]}},
     ["spec.engine.extraArgs", "must not set flags the operator manages"]),
    ("vllm-plugins-env", {"engine": {"env": [{"name": "VLLM_PLUGINS", "value": "vllm_omni_register_models"}]}},
     ["spec.engine.env", "must not set variables the operator manages"]),
    ("patch-switch-env", {"engine": {"env": [{"name": "HF_TOKEN", "value": "t"},
                                             {"name": "OMNISTAGE_DISABLE_PATCHES", "value": "all"}]}},
     ["spec.engine.env", "must not set variables the operator manages"]),
    ("frontend-cache-env", {"engine": {"env": [{"name": "OMNISTAGE_FRONTEND_CACHE", "value": "lru"}]}},
     ["spec.engine.env", "must not set variables the operator manages"]),
    ("model-volume-two-sources",
     {"modelVolume": {"pvc": {"claimName": "weights"}, "hostPath": {"path": "/models"}}},
     ["spec.modelVolume", "exactly one of pvc or hostPath"]),
    ("model-volume-no-source", {"modelVolume": {"mountPath": "/models"}},
     ["spec.modelVolume", "exactly one of pvc or hostPath"]),
    ("env-value-and-value-from", {"engine": {"env": [{"name": "HF_TOKEN", "value": "t", "valueFrom": {
        "secretKeyRef": {"name": "hf-token", "key": "token"}}}]}}, ["spec.engine.env", "value or valueFrom"]),
    # spec.template: the core/v1 schema (types, unknown fields, quantities, list keys) ...
    ("template-field-wrong-type", {"template": {"spec": {"containers": [
        {"name": "engine", "resources": {"requests": {"cpu": True}}}]}}},
     ["spec.template.spec.containers[0].resources.requests.cpu", "must be of type integer,string"]),
    ("template-string-field-wrong-type", {"template": {"spec": {"priorityClassName": 5}}},
     ["spec.template.spec.priorityClassName", "must be of type string"]),
    ("template-bad-quantity", {"template": {"spec": {"containers": [
        {"name": "engine", "resources": {"limits": {"memory": "lots"}}}]}}},
     ["spec.template.spec.containers[0].resources.limits.memory", "should match"]),
    ("template-unknown-field", {"template": {"spec": {"containers": [{"name": "engine", "resource": {}}]}}},
     ['unknown field "spec.template.spec.containers[0].resource"']),
    ("template-container-without-name", {"template": {"spec": {"containers": [{"image": "x"}]}}},
     ["spec.template.spec.containers[0].name", "Required value"]),
    ("template-duplicate-env", {"template": {"spec": {"containers": [
        {"name": "engine", "env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}]}}},
     ["spec.template.spec.containers[0].env[1]", "Duplicate value"]),
    # ... and what the operator owns in it (CEL rules, operator/omnistage/api/validation.py)
    ("template-operator-label", {"template": {"metadata": {"labels": {"serving.omnistage.io/role": "head"}}}},
     ["spec.template.metadata.labels", "must not set the operator's labels"]),
    ("template-operator-annotation", {"template": {"metadata": {"annotations": {
        "serving.omnistage.io/template-hash": "0"}}}}, ["spec.template.metadata.annotations", "must not set"]),
    ("template-engine-command", {"template": {"spec": {"containers": [{"name": "engine", "command": ["sh"]}]}}},
     ["spec.template.spec.containers", "the engine container (name: engine) must not set"]),
    ("template-engine-image", {"template": {"spec": {"containers": [{"name": "engine", "image": "mine:1"}]}}},
     ["spec.template.spec.containers", "use spec.engine.image"]),
    ("template-gpu-limit", {"template": {"spec": {"containers": [
        {"name": "engine", "resources": {"limits": {"nvidia.com/gpu": 2}}}]}}},
     ["spec.template.spec.containers", "must not request the GPU resource"]),
    ("template-gpu-init-container", {"template": {"spec": {"initContainers": [
        {"name": "fetch", "image": "x", "resources": {"requests": {"nvidia.com/gpu": 1}}}]}}},
     ["spec.template.spec.initContainers", "must not request the GPU resource"]),
    ("template-operator-volume", {"template": {"spec": {"volumes": [{"name": "config", "emptyDir": {}}]}}},
     ["spec.template.spec.volumes", "must not use the operator's volume names"]),
    ("template-restart-policy", {"template": {"spec": {"restartPolicy": "Always"}}},
     ["spec.template.spec.restartPolicy", "is the operator's"]),
    ("template-host-network", {"template": {"spec": {"hostNetwork": True}}},
     ["spec.template.spec.hostNetwork", "must not be true"]),
    ("template-gpu-product-selector", {"template": {"spec": {"nodeSelector": {
        "nvidia.com/gpu.product": "NVIDIA-B200"}}}}, ["spec.template.spec.nodeSelector", "use spec.gpu.product"]),
    ("placement-and-template-tolerations", {"placement": {"tolerations": [{"key": "a", "operator": "Exists"}]},
                                            "template": {"spec": {"tolerations": []}}},
     ["spec.placement", "must not both set"]),
    ("template-engine-env-owned", {"template": {"spec": {"containers": [
        {"name": "engine", "env": [{"name": "OMNISTAGE_FRONTEND_CACHE", "value": "lru"}]}]}}},
     ["spec.template.spec.containers", "the engine container's env must not set variables the operator manages"]),
    ("template-too-many-containers", {"template": {"spec": {"containers": [{"name": f"c{i}"} for i in range(65)]}}},
     ["spec.template.spec.containers", "must have at most 64 items"]),
    # The security model (docs/security.md, tests/unit/test_security.py): host access ...
    *((f"template-{field}", {"template": {"spec": {field: True}}}, [f"spec.template.spec.{field}", "must not be true"])
      for field in ("hostPID", "hostIPC")),
    *((f"template-{field}-{flag}", {"template": {"spec": {field: [
        {"name": "side", "image": "x"}, {"name": "x", "image": "x", "securityContext": {flag: True}}]}}},
       [f"spec.template.spec.{field}", "no container may set securityContext.privileged or allowPrivilegeEscalation"])
      for field in ("containers", "initContainers") for flag in ("privileged", "allowPrivilegeEscalation")),
    *((f"template-{field}-capability", {"template": {"spec": {field: [
        {"name": "x", "image": "x", "securityContext": {"capabilities": {"add": ["IPC_LOCK", "SYS_ADMIN"]}}}]}}},
       [f"spec.template.spec.{field}", "securityContext.capabilities.add may hold only IPC_LOCK and SYS_NICE"])
      for field in ("containers", "initContainers")),
    *((f"model-volume-host-path-{i}", {"modelVolume": {"hostPath": {"path": path}}},
       ["spec.modelVolume.hostPath.path", "must be an absolute directory other than /"])
      for i, path in enumerate(("/", "/mnt/models/../../etc", "//etc", "/mnt/./models"))),
    ("template-node-name", {"template": {"spec": {"nodeName": "h200-0"}}},
     ["spec.template.spec.nodeName", "must not be set: it puts the pod on a node past the scheduler"]),
    ("template-system-priority", {"template": {"spec": {"priorityClassName": "system-node-critical"}}},
     ["spec.template.spec.priorityClassName", "must not be system-node-critical or system-cluster-critical"]),
    ("placement-system-priority", {"placement": {"priorityClassName": "system-cluster-critical"}},
     ["spec.placement.priorityClassName", "must not be system-node-critical or system-cluster-critical"]),
    ("template-grace-period", {"template": {"spec": {"terminationGracePeriodSeconds": 0}}},
     ["spec.template.spec.terminationGracePeriodSeconds", "is the operator's: the engine pods' lifecycle is"]),
    ("template-active-deadline", {"template": {"spec": {"activeDeadlineSeconds": 60}}},
     ["spec.template.spec.activeDeadlineSeconds", "is the operator's: the engine pods' lifecycle is"]),
    # ... the operator's Secrets (NAME-membership, this OmniStage's or another's) ...
    ("engine-env-membership-secret", {"engine": {"env": [{"name": "T", "valueFrom": {
        "secretKeyRef": {"name": "qwen3-omni-membership", "key": "token"}}}]}},
     ["spec.engine.env", "must not take a value from a Secret named *-membership"]),
    ("transport-env-membership-secret", {"transport": {"env": [{"name": "T", "valueFrom": {
        "secretKeyRef": {"name": "other-membership", "key": "token"}}}]}},
     ["spec.transport.env", "must not take a value from a Secret named *-membership"]),
    *((f"template-{field}-{how}-membership-secret",
       {"template": {"spec": {field: [{"name": "x", "image": "x", **ref}]}}},
       [f"spec.template.spec.{field}", "env valueFrom.secretKeyRef and envFrom secretRef must not refer to a Secret"])
      for field in ("containers", "initContainers") for how, ref in (
          ("env", {"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "a-membership", "key": "token"}}}]}),
          ("env-from", {"envFrom": [{"secretRef": {"name": "a-membership"}}]}))),
    *((f"template-{kind}-volume-membership-secret", {"template": {"spec": {"volumes": [{"name": "t", **source}]}}},
       ["spec.template.spec.volumes", "must not mount or hand the node a Secret named *-membership"])
      for kind, source in (("secret", {"secret": {"secretName": "qwen3-omni-membership"}}),
                           ("projected", {"projected": {"sources": [{"secret": {"name": "a-membership"}}]}}),
                           ("csi", {"csi": {"driver": "x", "nodePublishSecretRef": {"name": "a-membership"}}}))),
    *((f"template-{field}-mounts-the-token", {"template": {"spec": {field: [
        {"name": "x", "image": "x", "volumeMounts": [{"name": "membership-token", "mountPath": "/steal"}]}]}}},
       [f"spec.template.spec.{field}", "only the engine container may mount the operator's volume membership-token"])
      for field in ("containers", "initContainers")),
    ("template-env-from-owned-prefix", {"template": {"spec": {"containers": [
        {"name": "engine", "envFrom": [{"prefix": "OMNISTAGE_", "configMapRef": {"name": "tuning"}}]}]}}},
     ["spec.template.spec.containers", "the engine container's envFrom must not use a prefix"]),
    # ... the second round (issue 40, tests/unit/test_tenant_rules.py): the GPU fence ...
    *((f"{path}-nvidia", {path: {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}},
       [f"spec.{path}.env", "must not set the GPU runtime's variables"]) for path in ("engine", "transport")),
    *((f"template-{field}-{how}-nvidia", {"template": {"spec": {field: [{"name": "x", "image": "x", **env}]}}},
       [f"spec.template.spec.{field}", "no container may set the GPU runtime's variables"])
      for field in ("containers", "initContainers") for how, env in (
          ("env", {"env": [{"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "all"}]}),
          ("env-from", {"envFrom": [{"prefix": "NV", "configMapRef": {"name": "c"}}]}))),
    # ... volumes, identity, ports, namespaces, gates ...
    ("template-host-path-socket", {"template": {"spec": {"volumes": [
        {"name": "cri", "hostPath": {"path": "/run/containerd/containerd.sock", "type": "Socket"}}]}}},
     ["spec.template.spec.volumes", "hostPath.type must not be Socket, CharDevice, BlockDevice"]),
    ("template-git-repo", {"template": {"spec": {"volumes": [
        {"name": "src", "gitRepo": {"repository": "https://example.com/x.git"}}]}}},
     ["spec.template.spec.volumes", "may use only the volume sources"]),
    ("template-projected-token", {"template": {"spec": {"volumes": [
        {"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}]}}},
     ["spec.template.spec.volumes", "projected volumes may hold only"]),
    *((f"template-{field}-port-http", {"template": {"spec": {field: [
        {"name": "proxy", "image": "x", "ports": [{"name": "http", "containerPort": 8080}]}]}}},
       [f"spec.template.spec.{field}", "ports may not be named http, master, membership"])
      for field in ("containers", "initContainers")),
    ("template-share-process-namespace", {"template": {"spec": {"shareProcessNamespace": True}}},
     ["spec.template.spec.shareProcessNamespace", "must not be true"]),
    ("template-scheduling-gates", {"template": {"spec": {"schedulingGates": [{"name": "example.com/hold"}]}}},
     ["spec.template.spec.schedulingGates", "must not be set: the operator decides when its pods start"]),
    # ... and the command line the operator builds, the GPU resource.
    ("extra-args-expansion", {"engine": {"extraArgs": ["--served-model-name", "$(HF_TOKEN)"]}},
     ["spec.engine.extraArgs", "must not contain $("]),
    *((f"model-{i}", {"model": model}, ["spec.model", "should match"])
      for i, model in enumerate(("--mm-processor-cache-type=lru", "Qwen/Qwen3 Omni", "$(HF_TOKEN)"))),
    *((f"gpu-resource-{name}", {"gpu": {"resource": name}}, ["spec.gpu.resource", "must name a GPU"])
      for name in ("cpu", "ephemeral-storage", "hugepages-2Mi", "squat.ai/kvm")),
]


@pytest.mark.parametrize(("change", "expected"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_omnistage_is_rejected(omnistage_crd, kubectl, namespace, change, expected):
    obj = _sample()
    obj["spec"] = apply_merge_patch(obj["spec"], change)
    obj["metadata"] = {"name": "invalid"}
    out = kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=False)
    print(out.stderr)
    assert out.returncode != 0, f"the API server accepted an invalid OmniStage: {out.stdout}"
    for text in expected:
        assert text in out.stderr
    assert kubectl("get", "omnistage", "invalid", "-n", namespace, check=False).returncode != 0


def _field_rules(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """(field, rule) of every CEL rule below spec: its own (with their fieldPath) and its fields'."""
    out = [(path + rule.get("fieldPath", ""), rule) for rule in node.get("x-kubernetes-validations", [])]
    for name, sub in (node.get("properties") or {}).items():
        out += _field_rules(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _field_rules(node["items"], path)
    return out


def _covered(cases: list[tuple[str, Any, list[str]]], field: str, message: str) -> bool:
    """A case expects the field and a part of the rule's message (rules on one field differ by it)."""
    return any(field in expected and any(t != field and t in message for t in expected) for _, _, expected in cases)


def test_every_cel_rule_has_a_rejection_case(omnistage_crd, kubectl):
    pool_crd = kubectl.json("get", "crd", "omnistagepools.serving.omnistage.io")
    for crd, cases in ((omnistage_crd, INVALID), (pool_crd, POOL_INVALID)):
        (version,) = crd["spec"]["versions"]
        for field, rule in _field_rules(version["schema"]["openAPIV3Schema"]["properties"]["spec"], "spec"):
            assert _covered(cases, field, rule["message"]), \
                f"no rejection case of {crd['spec']['names']['kind']} for the CEL rule {rule['rule']!r} on {field}"


# The OmniStagePool shares the GPU and placement models and their rules.
POOL_INVALID = [
    ("pool-gpu-resource", {"gpu": {"resource": "memory"}}, ["spec.gpu.resource", "must name a GPU"]),
    ("pool-system-priority", {"placement": {"priorityClassName": "system-node-critical"}},
     ["spec.placement.priorityClassName", "must not be system-node-critical or system-cluster-critical"]),
]


@pytest.mark.parametrize(("change", "expected"), [c[1:] for c in POOL_INVALID], ids=[c[0] for c in POOL_INVALID])
def test_invalid_pool_is_rejected(omnistage_crd, kubectl, namespace, change, expected):
    obj = {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStagePool", "metadata": {"name": "invalid"},
           "spec": {"omniStage": "qwen3-omni", "stageIds": [1], **change}}
    out = kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=False)
    print(out.stderr)
    assert out.returncode != 0, f"the API server accepted an invalid OmniStagePool: {out.stdout}"
    for text in expected:
        assert text in out.stderr


# What the API server lets through: near misses that change neither the cache nor the plugin, and
# the spellings only the operator refuses (nested stageOverrides keys, abbreviated flags), which it
# answers with Ready=False reason InvalidSpec (tests/unit/test_validation.py, test_operator.py).
ACCEPTED = [
    ("mm-processor-kwargs", {"engine": {"extraArgs": ['--mm-processor-kwargs={"max_pixels": 1003520}',
                                                      "--mm-processor-kwargs.fps=2"]}}),
    ("flags-that-start-alike", {"engine": {"extraArgs": ["--omni-lb-policy=round-robin", "--config-format=hf",
                                                         "--portfolio"]}}),
    ("hf-token-and-standin-knob", {"engine": {"env": [{"name": "HF_TOKEN", "value": "t"},
                                                      {"name": "OMNISTAGE_STANDIN_FRONTEND_CACHE", "value": "lru"}]}}),
    ("batched-tokens", {"engine": {"stageOverrides": {"max_num_batched_tokens": 8192}}}),
    ("operator-only-nested-key", {"engine": {"stageOverrides": {"runtime": {"num_replicas": 3}}}}),
    ("operator-only-abbreviation", {"engine": {"extraArgs": ["--mm-processor-cache-t=shm"]}}),
    ("env-value-from-secret", {"engine": {"env": [{"name": "HF_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "hf-token", "key": "token"}}}]}}),
    ("template-resources-and-identity", {"template": {
        "metadata": {"labels": {"team": "mm"}, "annotations": {"example.com/owner": "mm"}},
        "spec": {"serviceAccountName": "engine", "runtimeClassName": "nvidia", "priorityClassName": "high",
                 "imagePullSecrets": [{"name": "regcred"}], "securityContext": {"runAsNonRoot": True},
                 "containers": [{"name": "engine", "resources": {"requests": {"cpu": 16, "memory": "200Gi"}},
                                 "envFrom": [{"prefix": "VLLM_", "secretRef": {"name": "tuning"}}]},
                                {"name": "sidecar", "image": "x", "ports": [{"containerPort": 9901}]}]}}}),
    # The engine's mount paths are beyond the API server's CEL cost budget: the operator refuses them
    # (Ready=False InvalidSpec; tests/unit/test_podtemplate.py).
    ("operator-only-template-mount", {"template": {"spec": {"containers": [
        {"name": "engine", "volumeMounts": [{"name": "x", "mountPath": "/etc/omnistage"}]}]}}}),
    # The host directories the operator allows are its configuration: it refuses the others
    # (InvalidSpec; tests/unit/test_security.py), the API server only what is never allowed.
    ("operator-only-model-host-path", {"modelVolume": {"hostPath": {"path": "/mnt/models/qwen3-omni"}}}),
    # What the security model leaves to the editor (docs/security.md).
    ("security-near-misses", {"engine": {"extraArgs": ["--served-model-name", "qwen$1"]}, "template": {"spec": {
        "hostPID": False, "automountServiceAccountToken": True, "priorityClassName": "inference-high",
        "containers": [{"name": "engine", "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK", "SYS_NICE"]}},
            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}],
            "envFrom": [{"prefix": "OMNISTAGE_STANDIN_", "configMapRef": {"name": "knobs"}}]}],
        "volumes": [{"name": "a", "secret": {"secretName": "membership-token"}},
                    {"name": "b", "projected": {"sources": [{"secret": {"name": "tls"}}]}}]}}}),
    *((f"gpu-{name}", {"gpu": {"resource": name}}) for name in ("amd.com/gpu", "nvidia.com/mig-3g.71gb")),
    ("model-path", {"model": "/models/Qwen3-Omni-30B-A3B-Instruct"}),
]


@pytest.mark.parametrize("change", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_api_server_accepts(omnistage_crd, kubectl, namespace, change):
    obj = _sample()
    obj["spec"] = apply_merge_patch(obj["spec"], change)
    obj["metadata"] = {"name": "accepted"}
    out = kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert out.returncode == 0, out.stderr


def _pool(name: str) -> dict[str, Any]:
    return {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStagePool", "metadata": {"name": name},
            "spec": {"omniStage": "qwen3-omni", "stageIds": [1]}}


def _named(name: str) -> dict[str, Any]:
    obj = _sample()
    obj["metadata"] = {"name": name}
    return obj


# Names the children named after them could not carry (api/child_names.py): refused at admission, with the
# maximum, by the root's CEL rules on metadata.name (the operator refuses them too: tests/unit/test_child_names.py).
NAME_CASES = [
    ("omnistage-51", _named("n" * (MAX_OMNISTAGE_NAME + 1)), f"metadata.name must be at most {MAX_OMNISTAGE_NAME}"),
    ("omnistage-dot", _named("omni.v2"), "DNS-1035"),
    ("omnistage-digit", _named("1st-omni"), "DNS-1035"),
    # A 64-character pool name once gave a PodDisruptionBudget selector the API server refused.
    ("pool-64", _pool("p" * 64), f"metadata.name must be at most {MAX_POOL_NAME}"),
    ("pool-59", _pool("p" * (MAX_POOL_NAME + 1)), f"metadata.name must be at most {MAX_POOL_NAME}"),
]


@pytest.mark.parametrize(("obj", "expected"), [c[1:] for c in NAME_CASES], ids=[c[0] for c in NAME_CASES])
def test_name_its_children_cannot_carry_is_rejected(omnistage_crd, kubectl, namespace, obj, expected):
    out = kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert out.returncode != 0, out.stdout
    assert expected in out.stderr, out.stderr


def test_the_longest_names_are_accepted(omnistage_crd, kubectl, namespace):
    for obj in (_named("n" * MAX_OMNISTAGE_NAME), _pool("p" * MAX_POOL_NAME)):
        out = kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=False)
        assert out.returncode == 0, out.stderr


# --- the simulated GPU nodes, seen through the scheduler ------------------------------------

def _gpu_pod(name: str, gpus: int) -> str:
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"containers": [{
            "name": "engine", "image": POD_IMAGE, "imagePullPolicy": "IfNotPresent",
            "resources": {"limits": {GPU: str(gpus)}},
        }]},
    })


def _condition(pod: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in pod.get("status", {}).get("conditions", []) if c["type"] == kind), None)


def _max_gpus_per_node(kubectl) -> int:
    nodes = kubectl.json("get", "nodes")["items"]
    return max(int(n["status"].get("allocatable", {}).get(GPU, "0")) for n in nodes)


def test_pod_needing_more_gpus_than_any_node_stays_pending(kubectl, namespace, wait_for):
    most = _max_gpus_per_node(kubectl)
    assert most >= 8, f"no node offers 8 {GPU}"
    kubectl("create", "-n", namespace, "-f", "-", input=_gpu_pod("too-big", most + 1))

    def unschedulable():
        pod = kubectl.json("get", "pod", "too-big", "-n", namespace)
        cond = _condition(pod, "PodScheduled")
        return (pod, cond) if cond and cond["status"] == "False" else None

    pod, cond = wait_for("the scheduler to give up on too-big", unschedulable, timeout=60)
    print(cond)
    assert cond["reason"] == "Unschedulable"
    assert f"Insufficient {GPU}" in cond["message"]
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    events = kubectl.json("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=too-big")
    failed = [e for e in events["items"] if e["reason"] == "FailedScheduling"]
    assert failed and f"Insufficient {GPU}" in failed[0]["message"]


def test_pod_that_fits_runs_on_an_h200_node(kubectl, namespace, wait_for, local_cluster):
    kubectl("create", "-n", namespace, "-f", "-", input=_gpu_pod("fits", 8))

    def running():
        pod = kubectl.json("get", "pod", "fits", "-n", namespace)
        return pod if pod["status"].get("phase") == "Running" else None

    pod = wait_for("pod fits to be Running", running, timeout=120)
    node = kubectl.json("get", "node", pod["spec"]["nodeName"])
    assert node["metadata"]["labels"].get(H200_LABEL) == "NVIDIA-H200"
    assert _condition(pod, "Ready")["status"] == "True"
    if local_cluster:
        # Network rule: every pod IP of the local cluster is loopback, inside its node's pod CIDR.
        ip = ipaddress.ip_address(pod["status"]["podIP"])
        assert ip.is_loopback and ip in ipaddress.ip_network(node["spec"]["podCIDR"]), ip
