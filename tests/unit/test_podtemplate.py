"""spec.template: the strategic merge, what it may not touch, its generated schema, and the engine image
default."""

import copy
import json
import re
import tomllib

import pytest
import yaml
from omnistage import api
from omnistage.api import podtemplate
from omnistage.api.crd import build_crd
from omnistage.api.validation import SPEC_RULES, validate_omnistage
from omnistage.names import A_TEMPLATE_HASH
from omnistage.render import render_head_pod, render_replica_pod, target_from

from tests.support.repo import ROOT, SAMPLE, hack_script
from tests.support.specs import refused_exactly

from .test_cli import omnistage

HEAD_IP, HEAD_UID = "127.77.0.10", "uid-1"
GPU = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}


def stage_with(template=None, **spec):
    obj = copy.deepcopy(SAMPLE)
    obj["metadata"].update(namespace="serving", uid="ost-uid")
    obj["spec"].update(spec)
    if template is not None:
        obj["spec"]["template"] = template
    return obj


def pods(template=None, **spec):
    t = target_from(stage_with(template, **spec))
    return render_head_pod(t), render_replica_pod(t, 1, HEAD_IP, HEAD_UID)


def engine(pod):
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    return c


def env_of(pod):
    return {e["name"]: e for e in engine(pod)["env"]}


def hash_of(pod):
    return pod["metadata"]["annotations"][A_TEMPLATE_HASH]


# ---- the merge rules come from the schema, which comes from the Kubernetes OpenAPI document ----------

def test_merge_keys_are_the_kubernetes_ones():
    spec = podtemplate.subschema("spec")["properties"]
    container = spec["containers"]["items"]["properties"]
    marks = {
        name: (node.get("x-kubernetes-patch-strategy"), node.get("x-kubernetes-patch-merge-key"))
        for name, node in [
            ("containers", spec["containers"]),
            ("volumes", spec["volumes"]),
            ("imagePullSecrets", spec["imagePullSecrets"]),
            ("tolerations", spec["tolerations"]),
            ("topologySpreadConstraints", spec["topologySpreadConstraints"]),
            ("env", container["env"]),
            ("envFrom", container["envFrom"]),
            ("volumeMounts", container["volumeMounts"]),
            ("args", container["args"]),
        ]
    }
    assert marks == {
        "containers": ("merge", "name"), "volumes": ("merge,retainKeys", "name"),
        "imagePullSecrets": ("merge", "name"), "tolerations": (None, None),
        "topologySpreadConstraints": ("merge", "topologyKey"), "env": ("merge", "name"),
        "envFrom": (None, None), "volumeMounts": ("merge", "mountPath"), "args": (None, None),
    }


def test_merge_follows_whatever_the_schema_says():
    """Nothing is hard-coded: the same lists merge differently under another schema."""
    by_key = {"type": "array", "x-kubernetes-patch-strategy": "merge", "x-kubernetes-patch-merge-key": "id",
              "items": {"type": "object", "properties": {"id": {"type": "string"}, "v": {"type": "integer"}}}}
    atomic = {"type": "array", "items": by_key["items"]}
    set_like = {"type": "array", "x-kubernetes-patch-strategy": "merge", "items": {"type": "string"}}
    schema = {"type": "object", "properties": {"a": by_key, "b": atomic, "c": set_like}}
    original = {"a": [{"id": "x", "v": 1}, {"id": "y", "v": 2}], "b": [{"id": "x", "v": 1}], "c": ["p", "q"]}
    patch = {"a": [{"id": "y", "v": 3}, {"id": "z", "v": 4}], "b": [{"id": "z", "v": 4}], "c": ["q", "r"]}
    assert podtemplate.strategic_merge(original, patch, schema) == {
        "a": [{"id": "x", "v": 1}, {"id": "y", "v": 3}, {"id": "z", "v": 4}],
        "b": [{"id": "z", "v": 4}],
        "c": ["p", "q", "r"],
    }
    assert original["a"][1]["v"] == 2, "the inputs are not mutated"


def test_maps_merge_key_by_key_and_null_deletes():
    schema = podtemplate.schema()
    original = {"spec": {"nodeSelector": {"a": "1", "b": "2"}, "enableServiceLinks": False}}
    patch = {"spec": {"nodeSelector": {"b": "3", "c": "4"}, "enableServiceLinks": None}}
    assert podtemplate.strategic_merge(original, patch, schema) == {
        "spec": {"nodeSelector": {"a": "1", "b": "3", "c": "4"}}}


def test_engine_container_merged_by_name_sidecar_appended():
    template = {"spec": {"containers": [
        {"name": "sidecar", "image": "busybox"},
        {"name": "engine", "resources": {"requests": {"cpu": "16"}, "limits": {"memory": "300Gi"}},
         "env": [{"name": "HF_HOME", "value": "/models/hf"},
                 {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
         "envFrom": [{"prefix": "EXTRA_", "secretRef": {"name": "extra"}}],
         "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
         "securityContext": {"allowPrivilegeEscalation": False}},
    ], "volumes": [{"name": "scratch", "emptyDir": {}}]}}
    for pod in pods(template, engine={"env": [{"name": "HF_HOME", "value": "/cache/hf"}]}):
        names = [c["name"] for c in pod["spec"]["containers"]]
        assert names == ["engine", "sidecar"], "the engine container stays first, a new one is appended"
        c = engine(pod)
        assert c["command"] == ["vllm"] and c["args"][0] == "serve" and c["image"]
        # Resources merge key by key: the template's cpu and memory limit, the operator's memory request and
        # GPU.
        assert c["resources"] == {"limits": {GPU: "1", "memory": "300Gi"},
                                  "requests": {"cpu": "16", "memory": "64Gi", "ephemeral-storage": "100Gi"}}
        env = env_of(pod)
        assert env["HF_HOME"] == {"name": "HF_HOME", "value": "/models/hf"}, (
            "template beats spec.engine.env by name"
        )
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert [e["name"] for e in c["env"]].count("HF_HOME") == 1
        assert c["envFrom"] == [{"prefix": "EXTRA_", "secretRef": {"name": "extra"}}]
        assert c["volumeMounts"][-1] == {"name": "scratch", "mountPath": "/scratch"}
        assert {"name": "config", "mountPath": "/etc/omnistage", "readOnly": True} in c["volumeMounts"]
        # The template's securityContext merges over the operator's defaults.
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        assert pod["spec"]["volumes"][-1] == {"name": "scratch", "emptyDir": {}}


def test_engine_pods_are_hardened_by_default_and_the_template_can_loosen_it():
    for pod in pods({}):
        assert engine(pod)["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
        assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    loosened = {
        "spec": {
            "securityContext": {"seccompProfile": {"type": "Unconfined"}},
            "containers": [{"name": "engine", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}],
        }
    }
    for pod in pods(loosened):
        assert engine(pod)["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "Unconfined"}}


def test_pod_fields_labels_and_annotations():
    template = {
        "metadata": {"labels": {"team": "mm"}, "annotations": {"example.com/owner": "mm"}},
        "spec": {
            "serviceAccountName": "engine",
            "runtimeClassName": "nvidia",
            "priorityClassName": "high",
            "imagePullSecrets": [{"name": "regcred"}],
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
            ],
            "nodeSelector": {"zone": "a"},
        },
    }
    for pod in pods(template):
        spec, meta = pod["spec"], pod["metadata"]
        assert meta["labels"]["team"] == "mm" and meta["labels"]["serving.omnistage.io/component"] == "engine"
        assert meta["annotations"]["example.com/owner"] == "mm" and A_TEMPLATE_HASH in meta["annotations"]
        assert spec["serviceAccountName"] == "engine" and spec["runtimeClassName"] == "nvidia"
        assert spec["priorityClassName"] == "high" and spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200", "zone": "a"}
    head, replica = pods(template)
    assert head["spec"]["restartPolicy"] == "Always" and replica["spec"]["restartPolicy"] == "Never"


def test_tolerations_are_replaced_and_the_gpu_toleration_put_back():
    mine = {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
    for pod in pods({"spec": {"tolerations": [mine]}}):
        assert pod["spec"]["tolerations"] == [GPU_TOLERATION, mine]
    for pod in pods({"spec": {"tolerations": [GPU_TOLERATION, mine]}}):
        assert pod["spec"]["tolerations"] == [GPU_TOLERATION, mine], "not added twice"


def test_default_requests_scale_with_gpus():
    c = engine(pods(gpu={"count": 4})[0])
    assert c["resources"] == {
        "limits": {GPU: "4"},
        "requests": {"cpu": "32", "memory": "256Gi", "ephemeral-storage": "100Gi"},
    }


def test_nulls_are_absent_as_at_the_api_server():
    template = {"spec": {"priorityClassName": None, "containers": [{"name": "engine", "workingDir": None}]}}
    validate_omnistage(stage_with(template))
    assert pods(template) == pods()


def test_no_template_renders_as_before():
    assert pods(template={}) == pods()
    assert pods(template={"spec": {}}) == pods()


def test_template_changes_roll_pods_and_scaling_does_not():
    plain = pods()
    for template in ({"metadata": {"labels": {"team": "a"}}}, {"metadata": {"annotations": {"x": "1"}}},
                     {"spec": {"containers": [{"name": "engine", "resources": {"requests": {"cpu": "9"}}}]}},
                     {"spec": {"serviceAccountName": "other"}}):
        changed = pods(template)
        for before, after in zip(plain, changed, strict=True):
            assert hash_of(before) != hash_of(after), template
    label = {"metadata": {"labels": {"team": "a"}}}
    assert [hash_of(p) for p in pods(label, replicas=2)] == [hash_of(p) for p in pods(label, replicas=5)]


def test_merge_is_pure_and_deterministic():
    template = {"spec": {"containers": [{"name": "engine", "env": [{"name": "A", "value": "1"}]}]}}
    obj = stage_with(template)
    before = copy.deepcopy(obj)
    assert pods(template) == pods(template)
    t = target_from(obj)
    render_head_pod(t)
    assert obj == before and t.spec.template == template


# ---- what the template may not touch --------------------------------------------------------------

def refused(template, **spec):
    return stage_with(template, **spec)


def engine_with(**fields):
    return {"spec": {"containers": [{"name": "sidecar", "image": "x"}, {"name": "engine", **fields}]}}


# (id, object, the exact field the problem names, words of the message, CEL at the API server or the
# operator only)
REFUSED = [
    (
        "command",
        refused(engine_with(command=["sh"])),
        "spec.template.spec.containers[1].command",
        "spec.engine",
        True,
    ),
    (
        "args",
        refused(engine_with(args=["--port=1"])),
        "spec.template.spec.containers[1].args",
        "extraArgs",
        True,
    ),
    (
        "image",
        refused(engine_with(image="mine:1")),
        "spec.template.spec.containers[1].image",
        "spec.engine.image",
        True,
    ),
    (
        "ports",
        refused(engine_with(ports=[{"containerPort": 9}])),
        "spec.template.spec.containers[1].ports",
        "httpPort",
        True,
    ),
    (
        "readiness",
        refused(engine_with(readinessProbe={"tcpSocket": {"port": 1}})),
        "spec.template.spec.containers[1].readinessProbe",
        "readinessProbe",
        True,
    ),
    (
        "gpu-limit",
        refused(engine_with(resources={"limits": {GPU: "2"}})),
        f"spec.template.spec.containers[1].resources.limits[{GPU}]",
        "spec.gpu.count",
        True,
    ),
    (
        "gpu-request-sidecar",
        refused({"spec": {"containers": [{"name": "s", "resources": {"requests": {GPU: 1}}}]}}),
        f"spec.template.spec.containers[0].resources.requests[{GPU}]",
        "GPU resource",
        True,
    ),
    (
        "gpu-init",
        refused({"spec": {"initContainers": [{"name": "dl", "resources": {"limits": {GPU: 1}}}]}}),
        f"spec.template.spec.initContainers[0].resources.limits[{GPU}]",
        "GPU resource",
        True,
    ),
    (
        "env-plugins",
        refused(engine_with(env=[{"name": "HF_HOME", "value": "x"}, {"name": "VLLM_PLUGINS"}])),
        "spec.template.spec.containers[1].env[1].name",
        "VLLM_PLUGINS",
        True,
    ),
    (
        "env-cache",
        refused(engine_with(env=[{"name": "OMNISTAGE_FRONTEND_CACHE", "value": "lru"}])),
        "spec.template.spec.containers[1].env[0].name",
        "frontend cache",
        True,
    ),
    (
        "env-master-address",
        refused(engine_with(env=[{"name": "POD_IP", "value": "127.0.0.9"}])),
        "spec.template.spec.containers[1].env[0].name",
        "address",
        True,
    ),
    (
        "mount-config",
        refused(engine_with(volumeMounts=[{"name": "x", "mountPath": "/etc/omnistage"}])),
        "spec.template.spec.containers[1].volumeMounts[0].mountPath",
        "deploy config",
        False,
    ),
    (
        "mount-under-token",
        refused(engine_with(volumeMounts=[{"name": "x", "mountPath": "/var/run/secrets/omnistage/t"}])),
        "spec.template.spec.containers[1].volumeMounts[0].mountPath",
        "mount elsewhere",
        False,
    ),
    (
        "mount-shm-slash",
        refused(engine_with(volumeMounts=[{"name": "x", "mountPath": "/dev/shm/"}])),
        "spec.template.spec.containers[1].volumeMounts[0].mountPath",
        "/dev/shm",
        False,
    ),
    (
        "mount-model",
        refused(
            engine_with(volumeMounts=[{"name": "x", "mountPath": "/weights"}]),
            modelVolume={"mountPath": "/weights", "pvc": {"claimName": "w"}},
        ),
        "spec.template.spec.containers[1].volumeMounts[0].mountPath",
        "modelVolume",
        False,
    ),
    (
        "volume-config",
        refused({"spec": {"volumes": [{"name": "config", "emptyDir": {}}]}}),
        "spec.template.spec.volumes[0].name",
        "deploy config",
        True,
    ),
    (
        "restart-policy",
        refused({"spec": {"restartPolicy": "OnFailure"}}),
        "spec.template.spec.restartPolicy",
        "registers",
        True,
    ),
    # Every engine pod binds the same ports: two on one node's network would collide.
    (
        "host-network",
        refused({"spec": {"hostNetwork": True}}),
        "spec.template.spec.hostNetwork",
        "collide",
        True,
    ),
    (
        "product-selector",
        refused({"spec": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B200"}}}),
        "spec.template.spec.nodeSelector[nvidia.com/gpu.product]",
        "spec.gpu.product",
        True,
    ),
    (
        "operator-label",
        refused({"metadata": {"labels": {"serving.omnistage.io/role": "head"}}}),
        "spec.template.metadata.labels[serving.omnistage.io/role]",
        "scale selector",
        True,
    ),
    (
        "app-label",
        refused({"metadata": {"labels": {"app.kubernetes.io/name": "mine"}}}),
        "spec.template.metadata.labels[app.kubernetes.io/name]",
        "app.kubernetes.io/name",
        True,
    ),
    (
        "operator-annotation",
        refused({"metadata": {"annotations": {"serving.omnistage.io/template-hash": "x"}}}),
        "spec.template.metadata.annotations[serving.omnistage.io/template-hash]",
        "hash",
        True,
    ),
    (
        "placement-and-template-tolerations",
        refused({"spec": {"tolerations": []}}, placement={"tolerations": []}),
        "spec.placement.tolerations",
        "one place",
        True,
    ),
    (
        "placement-and-template-priority",
        refused({"spec": {"priorityClassName": "a"}}, placement={"priorityClassName": "b"}),
        "spec.placement.priorityClassName",
        "one place",
        True,
    ),
    (
        "env-value-and-source",
        refused(
            None,
            engine={
                "env": [{"name": "A", "value": "x", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
            },
        ),
        "spec.engine.env[0]",
        "not both",
        True,
    ),
    # The schema, where no API server checked it (omnistage render): types, unknown and required fields.
    (
        "type",
        refused({"spec": {"priorityClassName": 5}}),
        "spec.template.spec.priorityClassName",
        "type string",
        None,
    ),
    (
        "quantity",
        refused(engine_with(resources={"requests": {"cpu": "lots"}})),
        "spec.template.spec.containers[1].resources.requests[cpu]",
        "quantity",
        None,
    ),
    (
        "unknown-field",
        refused(engine_with(resource={})),
        "spec.template.spec.containers[1].resource",
        "unknown field",
        None,
    ),
    (
        "container-name",
        refused({"spec": {"containers": [{"image": "x"}]}}),
        "spec.template.spec.containers[0].name",
        "required",
        None,
    ),
    (
        "boolean",
        refused(engine_with(stdin="yes")),
        "spec.template.spec.containers[1].stdin",
        "type boolean",
        None,
    ),
    (
        "duplicate-env",
        refused(engine_with(env=[{"name": "A"}, {"name": "A"}])),
        "spec.template.spec.containers[1].env[1]",
        "duplicate",
        None,
    ),
    (
        "metadata-name",
        refused({"metadata": {"name": "mine"}}),
        "spec.template.metadata.name",
        "unknown field",
        None,
    ),
    (
        "value-from-unknown",
        refused(None, engine={"env": [{"name": "A", "valueFrom": {"secretRef": {"name": "s"}}}]}),
        "spec.engine.env[0].valueFrom.secretRef",
        "unknown field",
        None,
    ),
]


@pytest.mark.parametrize(("case", "obj", "field", "words", "cel"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_template_path_is_named_exactly(case, obj, field, words, cel):
    refused_exactly(obj, field, words)
    if cel is not None:  # which enforcer: the API server too (CEL), or the operator alone (InvalidSpec)
        rule_fields = {f".{r.field.lstrip('.')}" for r in SPEC_RULES if (r.cel is not None) == cel}
        assert any(field.startswith(f"spec{f}") for f in rule_fields), (field, cel)


ACCEPTED = [
    (
        "sidecar-ports-and-probes",
        {
            "spec": {
                "containers": [
                    {
                        "name": "proxy",
                        "image": "envoy",
                        "ports": [{"containerPort": 9901}],
                        "readinessProbe": {"tcpSocket": {"port": 9901}},
                    }
                ]
            }
        },
    ),
    (
        "hf-cache-below-the-cache-dir",
        engine_with(volumeMounts=[{"name": "hf", "mountPath": "/root/.cache/hf"}]),
    ),
    ("standin-knob", engine_with(env=[{"name": "OMNISTAGE_STANDIN_FRONTEND_CACHE", "value": "lru"}])),
    ("integer-quantity", engine_with(resources={"requests": {"cpu": 16, "memory": "200Gi"}})),
    ("other-extended-resource", engine_with(resources={"limits": {"rdma/hca": 1}})),
    ("label-like-ours", {"metadata": {"labels": {"example.com/role": "head", "omnistage": "x"}}}),
    (
        "operator-volume-name-as-mount-name",
        engine_with(volumeMounts=[{"name": "config", "mountPath": "/srv"}]),
    ),
    ("imagePullPolicy", engine_with(imagePullPolicy="Always")),
    ("host-network-false", {"spec": {"hostNetwork": False}}),
]


@pytest.mark.parametrize("template", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_template_near_miss_is_accepted(template):
    validate_omnistage(stage_with(template))


def test_operator_only_template_rules_are_the_ones_over_the_cel_budget():
    """Engine mount paths sit in a list inside the containers list that the schema leaves unbounded, and
    the rule compares each with spec.modelVolume.mountPath too: the operator checks them (InvalidSpec, pods
    untouched). hostPath volumes follow the operator's allow-list, which the API server cannot see (and a
    check of each volume's path, a string with no bound, costs past the budget). Everything else is
    refused by the API server too (the lists the other rules walk are bounded:
    hack/gen-podtemplate-schema.py's BOUNDS)."""
    from omnistage.api import template_checks, template_volumes

    operator_only = [r.broken for r in SPEC_RULES if r.cel is None and r.field.startswith(".template")]
    assert sorted(operator_only, key=lambda f: f.__name__) == [template_checks.engine_owned_mount_items,
                                                                template_volumes.host_path_volume_items]


# ---- the schema: generated from the Kubernetes OpenAPI document, embedded in the CRD ----------------

def _generator():
    return hack_script("gen-podtemplate-schema.py")


def test_schema_is_from_the_kubernetes_version_the_project_builds():
    gen = _generator()
    assert podtemplate.source() == {
        "module": f"k8s.io/kubernetes@{gen.k8s_version()}",
        "file": gen.DOC_IN_MODULE,
        "definition": "io.k8s.api.core.v1.PodTemplateSpec",
        "generator": "hack/gen-podtemplate-schema.py",
    }


def test_committed_schema_matches_a_regeneration():
    """Skipped where the Go module cache lacks the document; hack/build-k8s-bins.sh (run by the cluster
    tier and `make k8s-bins`, so in CI) downloads k8s.io/kubernetes into it."""
    gen = _generator()
    path = gen.document_path()
    if not path.exists():
        pytest.skip(f"{path} is missing (hack/build-k8s-bins.sh downloads it)")
    assert gen.render(path, gen.k8s_version()) == podtemplate.SCHEMA_FILE.read_text(), \
        "podtemplate.schema.json is stale: run hack/gen-podtemplate-schema.py, then `make crd`"


def test_schema_file_ships_in_the_package():
    """The operator reads the schema at run time (merge rules, CRD): the wheel must carry it."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "omnistage"
    ]
    name = podtemplate.SCHEMA_FILE.name
    assert any(re.fullmatch(p.replace(".", r"\.").replace("*", ".*"), name) for p in patterns), \
        f"add {name!r} (or '*.json') to [tool.setuptools.package-data] omnistage in pyproject.toml"


def _crd_template():
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["template"], spec


def test_crd_embeds_the_real_schema_without_patch_markers():
    template, spec = _crd_template()
    text = json.dumps(template)
    assert "x-kubernetes-patch" not in text and "x-kubernetes-preserve-unknown-fields" not in text
    containers = template["properties"]["spec"]["properties"]["containers"]
    assert containers["x-kubernetes-list-type"] == "map" and containers["x-kubernetes-list-map-keys"] == [
        "name"
    ]
    resources = containers["items"]["properties"]["resources"]
    assert resources["properties"]["requests"]["additionalProperties"]["x-kubernetes-int-or-string"] is True
    assert set(template["properties"]["metadata"]["properties"]) == {"labels", "annotations"}
    assert "ephemeralContainers" not in template["properties"]["spec"]["properties"]
    assert "required" not in template["properties"]["spec"], "an overlay need not list containers"
    value_from = spec["properties"]["engine"]["properties"]["env"]["items"]["properties"]["valueFrom"]
    assert set(value_from["properties"]) >= {"secretKeyRef", "configMapKeyRef", "fieldRef"}


def test_no_defaults_in_the_overlay_but_map_list_keys():
    """A defaulted field would be stored in the OmniStage and override what the operator renders."""
    template, _ = _crd_template()
    found = []

    def walk(node, path):
        if "default" in node:
            found.append(path)
        for k, v in node.get("properties", {}).items():
            walk(v, f"{path}.{k}")
        for k in ("items", "additionalProperties"):
            if isinstance(node.get(k), dict):
                walk(node[k], f"{path}[]")

    walk(template, "template")
    assert found and all(p.endswith(("ports[].protocol", "imagePullSecrets[].name")) for p in found), found


def test_crd_stays_well_under_the_api_server_limits():
    size = len((ROOT / "crds/omnistage.serving.omnistage.io.yaml").read_bytes())
    assert size < 600_000, f"the CRD is {size} bytes"


# ---- the engine image: the operator's default, never a CRD default ----------------------------------

def test_engine_image_has_no_crd_default_and_is_reported_in_status():
    crd = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    assert "default" not in crd["spec"]["properties"]["engine"]["properties"]["image"]
    assert crd["status"]["properties"]["engineImage"]["type"] == "string"


def test_engine_image_comes_from_spec_then_operator_then_builtin(monkeypatch):
    assert target_from(stage_with()).engine_image == api.DEFAULT_ENGINE_IMAGE
    monkeypatch.setenv(api.ENGINE_IMAGE_ENV, "registry.example/engine:2")
    t = target_from(stage_with())
    assert t.engine_image == "registry.example/engine:2" == engine(render_head_pod(t))["image"]
    assert target_from(stage_with(), default_image="flag/engine:3").engine_image == "flag/engine:3"
    pinned = target_from(stage_with(engine={"image": "pinned/engine:1"}), default_image="flag/engine:3")
    assert pinned.engine_image == "pinned/engine:1"


def test_operator_upgrade_rolls_unpinned_pods(monkeypatch):
    before = hash_of(pods()[0])
    monkeypatch.setenv(api.ENGINE_IMAGE_ENV, "ghcr.io/omnistage/omnistage-engine:0.2.0")
    assert hash_of(pods()[0]) != before


def test_render_engine_image_flag_and_env():
    out = omnistage("render", "-f", "manifests/samples/omnistage.yaml", "--engine-image", "flag/engine:9")
    assert out.returncode == 0, out.stderr
    heads = [d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "Pod"]
    assert {engine(p)["image"] for p in heads} == {"flag/engine:9"}
    assert "engine image flag/engine:9" in out.stderr


def test_run_has_an_engine_image_flag():
    from omnistage.cli import build_parser

    args = build_parser().parse_args(["run", "--engine-image", "x/y:1"])
    assert args.engine_image == "x/y:1"


# ---- the production sample ----------------------------------------------------------------------------

def test_production_sample_renders_secret_env_pull_secret_pvc_and_resources():
    out = omnistage("render", "-f", "manifests/samples/omnistage-production.yaml")
    assert out.returncode == 0, out.stderr
    head = next(d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "Pod")
    c = engine(head)
    assert env_of(head)["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert head["spec"]["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "qwen3-omni-weights", "readOnly": True}} \
        in head["spec"]["volumes"]
    assert (
        c["resources"]["requests"] == {"cpu": "16", "memory": "128Gi"}
        and c["resources"]["limits"][GPU] == "1"
    )
    assert c["image"] == "registry.example.com/ml/omnistage-engine:0.1.0"
