"""The security model (docs/security.md, issue 27 items 1 and 2): what an OmniStage editor may not
ask of the operator, refused with the exact field named. Each refusal is also applied to the real
API server in tests/cluster/test_api.py (the CEL rules, the field rules and the patterns); the
host-directory allow-list is the operator's alone."""

from __future__ import annotations

import copy

import pytest
import yaml
from omnistage.api import OmniStagePoolSpec, podtemplate, security
from omnistage.api.crd import build_crd, build_pool_crd
from omnistage.api.validation import SPEC_RULES, InvalidSpec, validate_omnistage
from omnistage.cli import build_parser
from omnistage.render import render_head_pod, render_replica_pod, target_from
from omnistage.render.common import Pool
from omnistage.render.pods import render_pool_pod
from pydantic import ValidationError

from tests.support.repo import ROOT, SAMPLE
from tests.support.specs import refused_exactly, with_spec_changes

from .test_cli import omnistage

ALLOWED_ENV = security.ALLOWED_HOST_PATHS_ENV


def spec(**changes):
    return with_spec_changes(SAMPLE, changes, sep="__")


def pod(**pod_spec):
    return spec(template={"spec": pod_spec})


def container(field="containers", **fields):
    """A sidecar first, so the refused container is at index 1 of `field`."""
    return pod(
        **{
            field: [
                {"name": "sidecar", "image": "x"},
                {
                    "name": "engine" if field == "containers" else "init",
                    **({} if field == "containers" else {"image": "x"}),
                    **fields,
                },
            ]
        }
    )


def security_context(field="containers", **context):
    return container(field, securityContext=context)


def secret_env(name, field="containers"):
    return container(
        field,
        env=[
            {"name": "A", "value": "1"},
            {"name": "T", "valueFrom": {"secretKeyRef": {"name": name, "key": "token"}}},
        ],
    )


def volumes(*vols):
    return pod(volumes=[{"name": "scratch", "emptyDir": {}}, *vols])


def host_path(path):
    return spec(modelVolume={"mountPath": "/models", "hostPath": {"path": path}})


MEMBERSHIP = "qwen3-omni-membership"  # the sample's own token Secret
OTHER_MEMBERSHIP = "another-omnistage-membership"

# Who refuses it besides the operator: "api" a CEL rule of SPEC_RULES, "field" the field's own schema
# (a FieldRule or a pattern, for OmniStage and OmniStagePool alike), "operator" nobody else.
# (id, object, the exact field the problem names, words of its message, who)
REFUSED = [
    # host namespaces
    ("host-pid", pod(hostPID=True), "spec.template.spec.hostPID", "/proc", "api"),
    ("host-ipc", pod(hostIPC=True), "spec.template.spec.hostIPC", "shared memory", "api"),
    ("host-network", pod(hostNetwork=True), "spec.template.spec.hostNetwork", "must not be true", "api"),
    # privilege, in the engine, a sidecar, an init container and a native sidecar (an init container
    # with restartPolicy Always)
    (
        "privileged-engine",
        security_context(privileged=True),
        "spec.template.spec.containers[1].securityContext.privileged",
        "root on the node",
        "api",
    ),
    (
        "privileged-sidecar",
        pod(containers=[{"name": "proxy", "image": "x", "securityContext": {"privileged": True}}]),
        "spec.template.spec.containers[0].securityContext.privileged",
        "root on the node",
        "api",
    ),
    (
        "privileged-init",
        security_context("initContainers", privileged=True),
        "spec.template.spec.initContainers[1].securityContext.privileged",
        "remove them",
        "api",
    ),
    (
        "privileged-native-sidecar",
        container("initContainers", restartPolicy="Always", securityContext={"privileged": True}),
        "spec.template.spec.initContainers[1].securityContext.privileged",
        "root on the node",
        "api",
    ),
    (
        "escalation-engine",
        security_context(allowPrivilegeEscalation=True),
        "spec.template.spec.containers[1].securityContext.allowPrivilegeEscalation",
        "privilege escalation",
        "api",
    ),
    (
        "escalation-init",
        security_context("initContainers", allowPrivilegeEscalation=True),
        "spec.template.spec.initContainers[1].securityContext.allowPrivilegeEscalation",
        "hardening",
        "api",
    ),
    # capabilities beyond IPC_LOCK and SYS_NICE
    (
        "cap-sys-admin",
        security_context(capabilities={"add": ["IPC_LOCK", "SYS_ADMIN"]}),
        "spec.template.spec.containers[1].securityContext.capabilities.add[1]",
        "IPC_LOCK and SYS_NICE",
        "api",
    ),
    (
        "cap-net-admin-init",
        security_context("initContainers", capabilities={"add": ["NET_ADMIN"]}),
        "spec.template.spec.initContainers[1].securityContext.capabilities.add[0]",
        "SYS_NICE",
        "api",
    ),
    (
        "cap-prefixed",
        security_context(capabilities={"add": ["CAP_SYS_PTRACE"]}),
        "spec.template.spec.containers[1].securityContext.capabilities.add[0]",
        "step towards the node",
        "api",
    ),
    (
        "cap-all",
        security_context(capabilities={"drop": ["ALL"], "add": ["ALL"]}),
        "spec.template.spec.containers[1].securityContext.capabilities.add[0]",
        "IPC_LOCK",
        "api",
    ),
    # host directories: none in the template, the model volume's only where the operator allows
    (
        "template-host-root",
        volumes({"name": "host", "hostPath": {"path": "/"}}),
        "spec.template.spec.volumes[1].hostPath",
        "onto the node",
        "operator",
    ),
    (
        "template-runtime-socket",
        volumes({"name": "cri", "hostPath": {"path": "/run/containerd/containerd.sock"}}),
        "spec.template.spec.volumes[1].hostPath",
        "spec.modelVolume",
        "operator",
    ),
    ("model-volume-root", host_path("/"), "spec.modelVolume.hostPath.path", "other than /", "field"),
    (
        "model-volume-dot-dot",
        host_path("/mnt/models/../../etc"),
        "spec.modelVolume.hostPath.path",
        "'..'",
        "field",
    ),
    ("model-volume-dot", host_path("/mnt/./models"), "spec.modelVolume.hostPath.path", "segments", "field"),
    ("model-volume-double-slash", host_path("//etc"), "spec.modelVolume.hostPath.path", "'//'", "field"),
    ("model-volume-relative", host_path("models"), "spec.modelVolume.hostPath.path", "pattern", "field"),
    (
        "model-volume-not-allowed",
        host_path("/mnt/models"),
        "spec.modelVolume.hostPath.path",
        "OMNISTAGE_ALLOWED_HOST_PATHS",
        "operator",
    ),
    # scheduling and lifecycle
    ("node-name", pod(nodeName="h200-0"), "spec.template.spec.nodeName", "past the scheduler", "api"),
    (
        "template-node-critical",
        pod(priorityClassName="system-node-critical"),
        "spec.template.spec.priorityClassName",
        "preempt",
        "api",
    ),
    (
        "template-cluster-critical",
        pod(priorityClassName="system-cluster-critical"),
        "spec.template.spec.priorityClassName",
        "PriorityClass of your own",
        "api",
    ),
    (
        "placement-node-critical",
        spec(placement={"priorityClassName": "system-node-critical"}),
        "spec.placement.priorityClassName",
        "preempt",
        "field",
    ),
    (
        "grace-period",
        pod(terminationGracePeriodSeconds=5),
        "spec.template.spec.terminationGracePeriodSeconds",
        "drainTimeoutSeconds",
        "api",
    ),
    (
        "grace-period-zero",
        pod(terminationGracePeriodSeconds=0),
        "spec.template.spec.terminationGracePeriodSeconds",
        "lifecycle",
        "api",
    ),
    (
        "active-deadline",
        pod(activeDeadlineSeconds=3600),
        "spec.template.spec.activeDeadlineSeconds",
        "without a drain",
        "api",
    ),
    # the operator's Secrets (NAME-membership, this OmniStage's or another's)
    (
        "engine-env-membership",
        spec(
            engine__env=[
                {"name": "HF_HOME", "value": "/models"},
                {"name": "T", "valueFrom": {"secretKeyRef": {"name": OTHER_MEMBERSHIP, "key": "token"}}},
            ]
        ),
        "spec.engine.env[1].valueFrom.secretKeyRef.name",
        "membership token",
        "api",
    ),
    (
        "transport-env-membership",
        spec(
            transport={
                "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": MEMBERSHIP, "key": "token"}}}]
            }
        ),
        "spec.transport.env[0].valueFrom.secretKeyRef.name",
        "-membership",
        "api",
    ),
    (
        "template-env-membership",
        secret_env(MEMBERSHIP),
        "spec.template.spec.containers[1].env[1].valueFrom.secretKeyRef.name",
        "membership token",
        "api",
    ),
    (
        "init-env-membership",
        secret_env(OTHER_MEMBERSHIP, "initContainers"),
        "spec.template.spec.initContainers[1].env[1].valueFrom.secretKeyRef.name",
        "read another Secret",
        "api",
    ),
    (
        "template-env-from-membership",
        container(envFrom=[{"prefix": "T_", "configMapRef": {"name": "tuning"}},
                           {"prefix": "T_", "secretRef": {"name": MEMBERSHIP}}]),
        "spec.template.spec.containers[1].envFrom[1].secretRef.name",
        "join and leave",
        "api",
    ),
    (
        "secret-volume-membership",
        volumes({"name": "t", "secret": {"secretName": OTHER_MEMBERSHIP}}),
        "spec.template.spec.volumes[1].secret.secretName",
        "membership token",
        "api",
    ),
    (
        "projected-membership",
        volumes(
            {
                "name": "t",
                "projected": {
                    "sources": [{"configMap": {"name": "tuning"}}, {"secret": {"name": MEMBERSHIP}}]
                },
            }
        ),
        "spec.template.spec.volumes[1].projected.sources[1].secret.name",
        "membership token",
        "api",
    ),
    (
        "sidecar-mounts-the-token",
        pod(
            containers=[
                {
                    "name": "proxy",
                    "image": "x",
                    "volumeMounts": [
                        {"name": "scratch", "mountPath": "/tmp"},
                        {"name": "membership-token", "mountPath": "/steal"},
                    ],
                }
            ]
        ),
        "spec.template.spec.containers[0].volumeMounts[1].name",
        "only the engine container",
        "api",
    ),
    (
        "init-mounts-the-token",
        container("initContainers", volumeMounts=[{"name": "membership-token", "mountPath": "/t"}]),
        "spec.template.spec.initContainers[1].volumeMounts[0].name",
        "membership token",
        "api",
    ),
    (
        "env-from-owned-prefix",
        container(envFrom=[{"prefix": "OMNISTAGE_", "configMapRef": {"name": "tuning"}}]),
        "spec.template.spec.containers[1].envFrom[0].prefix",
        "OMNISTAGE_*",
        "api",
    ),
    # the command line the operator builds
    (
        "extra-args-expansion",
        spec(engine__extraArgs=["--served-model-name", "$(HF_TOKEN)"]),
        "spec.engine.extraArgs[1]",
        "$(",
        "api",
    ),
    (
        "extra-args-escaped-expansion",
        spec(engine__extraArgs=["--chat-template=$$(X)"]),
        "spec.engine.extraArgs[0]",
        "literally",
        "api",
    ),
    ("model-flag", spec(model="--mm-processor-cache-type=lru"), "spec.model", "pattern", "field"),
    ("model-whitespace", spec(model="Qwen/Qwen3 Omni"), "spec.model", "pattern", "field"),
    ("model-newline", spec(model="Qwen/Qwen3-Omni\n--port=1"), "spec.model", "pattern", "field"),
    ("model-expansion", spec(model="$(HF_TOKEN)"), "spec.model", "pattern", "field"),
    # GPU resources outside the allow-list
    *(
        (
            f"gpu-{name.split('/')[-1]}",
            spec(gpu__resource=name),
            "spec.gpu.resource",
            "must name a GPU",
            "field",
        )
        for name in ("cpu", "memory", "ephemeral-storage", "hugepages-2Mi", "gpu", "squat.ai/kvm", "rdma/hca")
    ),
]


def _schema_at(path):
    """The CRD's schema node at spec.a.b (list items stepped through)."""
    node = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for part in path.split("."):
        while node.get("type") == "array":
            node = node["items"]
        node = node["properties"][part]
    return node


def _enforced_by(field, who):
    if who == "field":
        node = _schema_at(field.split("[")[0])
        assert node.get("x-kubernetes-validations") or node.get("pattern"), field
        return
    rules = [
        r for r in SPEC_RULES if field.startswith(f"spec{r.field}") and (r.cel is not None) == (who == "api")
    ]
    assert rules, (field, who)


@pytest.mark.parametrize(("case", "obj", "field", "words", "who"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_with_the_field_named(case, obj, field, words, who):
    refused_exactly(obj, field, words)
    _enforced_by(field, who)


# Near misses: what the security model leaves to the editor.
ACCEPTED = [
    (
        "pinned-memory-and-numa",
        security_context(capabilities={"drop": ["ALL"], "add": ["IPC_LOCK", "SYS_NICE"]}),
    ),
    ("init-ipc-lock", security_context("initContainers", capabilities={"add": ["IPC_LOCK"]})),
    ("not-privileged", security_context(privileged=False, allowPrivilegeEscalation=False, runAsNonRoot=True)),
    ("host-namespaces-false", pod(hostPID=False, hostIPC=False, hostNetwork=False)),
    ("other-secrets", secret_env("hf-token")),
    (
        "names-like-membership",
        volumes(
            {"name": "a", "secret": {"secretName": "membership"}},
            {"name": "b", "secret": {"secretName": "membership-token"}},
            {"name": "c", "projected": {"sources": [{"secret": {"name": "tls"}}]}},
        ),
    ),
    (
        "env-from-prefixes",
        container(
            envFrom=[
                {"prefix": "HF_", "secretRef": {"name": "hf"}},
                {"prefix": "OMNISTAGE_STANDIN_", "configMapRef": {"name": "knobs"}},
            ]
        ),
    ),
    (
        "sidecar-owned-prefix",
        pod(
            containers=[
                {
                    "name": "proxy",
                    "image": "x",
                    "envFrom": [{"prefix": "OMNISTAGE_", "configMapRef": {"name": "c"}}],
                }
            ]
        ),
    ),
    (
        "sidecar-mounts-other-volumes",
        pod(
            containers=[
                {
                    "name": "proxy",
                    "image": "x",
                    "volumeMounts": [
                        {"name": "config", "mountPath": "/srv/config"},
                        {"name": "model", "mountPath": "/srv/model"},
                    ],
                }
            ]
        ),
    ),
    ("own-priority", pod(priorityClassName="inference-high")),
    ("own-placement-priority", spec(placement={"priorityClassName": "system-ish"})),
    ("automount-asked", pod(automountServiceAccountToken=True, serviceAccountName="engine")),
    (
        "dollar-without-paren",
        spec(engine__extraArgs=["--served-model-name", "qwen$1", "--chat-template={{ x }}"]),
    ),
    *(
        (f"model-{i}", spec(model=m))
        for i, m in enumerate(
            (
                "Qwen/Qwen3-Omni-30B-A3B-Instruct",
                "/models",
                "/models/Qwen3-Omni-30B-A3B-Instruct",
                "omnistage-test/tiny-qwen2.5-omni-thinker",
                "./weights",
                "Qwen/Qwen2.5-Omni-7B-AWQ",
            )
        )
    ),
    *(
        (f"gpu-{i}", spec(gpu__resource=r))
        for i, r in enumerate(
            (
                "nvidia.com/gpu",
                "amd.com/gpu",
                "nvidia.com/gpu.shared",
                "nvidia.com/mig-1g.18gb",
                "nvidia.com/mig-7g.141gb",
            )
        )
    ),
]


@pytest.mark.parametrize("obj", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_near_miss_is_accepted(obj):
    validate_omnistage(obj)


@pytest.mark.parametrize("path", ["tests/cpu_engine/omnistage.yaml", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "manifests/samples").glob("*.yaml"))])
def test_samples_stay_valid(path):
    for doc in yaml.safe_load_all((ROOT / path).read_text()):
        if doc and doc.get("kind") == "OmniStage":
            validate_omnistage(doc)


# ---- the host-directory allow-list: the operator's configuration --------------------------------------

@pytest.mark.parametrize(("allowed", "path", "ok"), [
    ("/mnt/models", "/mnt/models", True),
    ("/mnt/models", "/mnt/models/", True),
    ("/mnt/models/", "/mnt/models/qwen3-omni", True),
    ("/data, /mnt/models", "/mnt/models/a/b", True),
    ("/", "/anything", True),
    ("/mnt/models", "/mnt/models-private", False),  # a prefix is a directory, not a string
    ("/mnt/models", "/mnt", False),
    ("/mnt/models", "/etc", False),
    ("", "/mnt/models", False),
])
def test_model_volume_host_path_follows_the_allow_list(monkeypatch, allowed, path, ok):
    monkeypatch.setenv(ALLOWED_ENV, allowed)
    if ok:
        assert validate_omnistage(host_path(path)).model_volume.host_path.path == path
    else:
        with pytest.raises(InvalidSpec, match="administrator allows"):
            validate_omnistage(host_path(path))


@pytest.mark.parametrize(("allowed", "path", "ok"), [
    ("/opt/engines", "/opt/engines/venv", True),
    ("/opt/engines", "/run/containerd/containerd.sock", False),
    ("/opt/engines", "/opt/engines/../../etc", False),
    ("", "/opt/engines/venv", False),
])
def test_template_host_path_volumes_follow_the_same_allow_list(monkeypatch, allowed, path, ok):
    """Issue 27: "hostPath, unless an operator-level allow-list admits it": the template's volumes
    too (the kind tier mounts the engine's venv from its nodes this way)."""
    monkeypatch.setenv(ALLOWED_ENV, allowed)
    obj = volumes({"name": "host", "hostPath": {"path": path}})
    if ok:
        validate_omnistage(obj)
    else:
        with pytest.raises(InvalidSpec, match="administrator allows"):
            validate_omnistage(obj)


@pytest.mark.parametrize("bad", ["models", "/mnt/../etc", "/mnt//models", "/mnt/./x"])
def test_allow_list_entries_must_be_plain_absolute_directories(bad):
    with pytest.raises(ValueError, match=ALLOWED_ENV):
        security.parse_allowed_host_paths(f"/data,{bad}")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--allowed-host-paths", bad])


def test_allow_list_is_normalised():
    assert security.parse_allowed_host_paths(" /data/ , ,/mnt/models,/") == ("/data", "/mnt/models", "/")


def test_render_and_run_take_the_allow_list(tmp_path):
    path = tmp_path / "ost.yaml"
    path.write_text(yaml.safe_dump(host_path("/mnt/models/qwen3-omni")))
    refused = omnistage("render", "-f", str(path))
    assert refused.returncode == 2 and "spec.modelVolume.hostPath.path" in refused.stderr, refused.stderr
    out = omnistage("render", "-f", str(path), "--allowed-host-paths", "/data,/mnt/models")
    assert out.returncode == 0, out.stderr
    head = next(d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "Pod")
    model = {"name": "model", "hostPath": {"path": "/mnt/models/qwen3-omni", "type": "Directory"}}
    assert model in head["spec"]["volumes"]
    args = build_parser().parse_args(["run", "--allowed-host-paths", "/mnt/models"])
    assert args.allowed_host_paths == "/mnt/models"


def test_install_manifests_set_the_allow_list_empty():
    deployment = next(d for d in yaml.safe_load_all((ROOT / "manifests/base/deployment.yaml").read_text())
                      if d["kind"] == "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": ALLOWED_ENV, "value": ""} in env


# ---- OmniStagePool: the same field rules ---------------------------------------------------------------

@pytest.mark.parametrize(("change", "field"), [
    ({"gpu": {"resource": "ephemeral-storage"}}, "gpu.resource"),
    ({"placement": {"priorityClassName": "system-cluster-critical"}}, "placement.priorityClassName"),
])
def test_pool_field_rules(change, field):
    with pytest.raises(ValidationError) as err:
        OmniStagePoolSpec.model_validate({"omniStage": "speech", "stageIds": [1], **change})
    assert [".".join(map(str, e["loc"])) for e in err.value.errors()] == [field]
    schema = build_pool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    node = schema
    for part in field.split("."):
        node = node["properties"][part]
    assert node["x-kubernetes-validations"][0]["message"] in str(err.value)


# ---- the lists the CEL rules walk are bounded (hack/gen-podtemplate-schema.py's BOUNDS) ----------------

def test_template_lists_the_rules_walk_are_bounded():
    container = podtemplate.subschema("spec.containers")
    assert podtemplate.subschema("spec")["properties"]["containers"]["maxItems"] == 64
    assert container["items"]["properties"]["env"]["maxItems"] == 1024
    many = {"spec": {"containers": [{"name": f"c{i}"} for i in range(65)]}}
    problems = podtemplate.schema_problems(many, podtemplate.schema(), "spec.template")
    assert problems == [("spec.template.spec.containers", "must have at most 64 items (got 65)")]
    with pytest.raises(InvalidSpec, match="at most 64 items"):
        validate_omnistage(spec(template=many))


# ---- engine pods: no ServiceAccount token unless asked ---------------------------------------------

def _pods(obj):
    obj = copy.deepcopy(obj)
    obj["metadata"].update(namespace="serving", uid="ost-uid")
    t = target_from(obj)
    return [render_head_pod(t), render_replica_pod(t, 1, "127.0.0.9", "uid-1")]


def test_engine_pods_mount_no_service_account_token_unless_asked():
    assert [p["spec"]["automountServiceAccountToken"] for p in _pods(SAMPLE)] == [False, False]
    asked = _pods(pod(serviceAccountName="engine", automountServiceAccountToken=True))
    assert [p["spec"]["automountServiceAccountToken"] for p in asked] == [True, True]


def test_pool_pods_mount_no_service_account_token():
    obj = yaml.safe_load_all((ROOT / "manifests/samples/qwen3-omni-speech.yaml").read_text())
    docs = [d for d in obj if d]
    ost = next(d for d in docs if d["kind"] == "OmniStage")
    pool_doc = next(d for d in docs if d["kind"] == "OmniStagePool")
    t = target_from({**ost, "metadata": {**ost["metadata"], "namespace": "serving", "uid": "u"}})
    pool = Pool(pool_doc["metadata"]["name"], "p", 1, OmniStagePoolSpec.model_validate(pool_doc["spec"]))
    assert render_pool_pod(t, pool, 0, "127.0.0.9", "uid-1")["spec"]["automountServiceAccountToken"] is False
