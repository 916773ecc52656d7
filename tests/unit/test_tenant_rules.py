"""The second round of the security model (issue 40 items 5, 6, 7, 9 and the "should, not must"
paragraph): what an OmniStage editor still could ask of the operator, refused with the exact field
named, by the API server (CEL) and the operator alike unless said otherwise. Before this round every
object of REFUSED was accepted. The pods the operator renders are test_hardening.py's; the operator's
ServiceAccount, test_service_account.py's."""

from __future__ import annotations

import pytest
from omnistage.api.validation import InvalidSpec, validate_omnistage

from tests.support.specs import refused_exactly

from .test_podtemplate import GPU, pods
from .test_security import MEMBERSHIP, _enforced_by, container, pod, spec, volumes

NVIDIA_ALL = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}


def sidecar(**fields):
    return pod(containers=[{"name": "proxy", "image": "x", **fields}])


# (id, object, the exact field the problem names, words of its message, who: "api" a CEL rule too)
REFUSED = [
    # item 6: the GPU fence, in every env list the operator builds
    ("engine-env-nvidia", spec(engine__env=[{"name": "HF_HOME", "value": "/m"}, NVIDIA_ALL]),
     "spec.engine.env[1].name", "every GPU of the node", "api"),
    ("transport-env-nvidia",
     spec(transport={"env": [{"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "all"}]}),
     "spec.transport.env[0].name", "NVIDIA_*", "api"),
    ("sidecar-env-nvidia", sidecar(env=[NVIDIA_ALL]),
     "spec.template.spec.containers[0].env[0].name", "other tenants'", "api"),
    ("engine-template-env-nvidia-require",
     container(env=[{"name": "NVIDIA_REQUIRE_CUDA", "value": "cuda>=12"}]),
     "spec.template.spec.containers[1].env[0].name", "NVIDIA_VISIBLE_DEVICES", "api"),
    ("init-env-nvidia-mig",
     container("initContainers", env=[{"name": "NVIDIA_MIG_CONFIG_DEVICES", "value": "all"}]),
     "spec.template.spec.initContainers[1].env[0].name", "device plugin", "api"),
    ("env-from-without-prefix",
     container(envFrom=[{"prefix": "HF_", "secretRef": {"name": "hf"}},
                        {"configMapRef": {"name": "tuning"}}]),
     "spec.template.spec.containers[1].envFrom[1].prefix", "must set a prefix", "api"),
    ("env-from-prefix-spells-nvidia", sidecar(envFrom=[{"prefix": "NV", "configMapRef": {"name": "c"}}]),
     "spec.template.spec.containers[0].envFrom[0].prefix", "not N or NVIDIA_", "api"),
    ("env-from-nvidia-prefix",
     container("initContainers", envFrom=[{"prefix": "NVIDIA_", "secretRef": {"name": "s"}}]),
     "spec.template.spec.initContainers[1].envFrom[0].prefix", "prefix", "api"),
    ("env-from-empty-prefix", sidecar(envFrom=[{"prefix": "", "configMapRef": {"name": "c"}}]),
     "spec.template.spec.containers[0].envFrom[0].prefix", "prefix", "api"),
    # item 9: volume sources outside the allow-list, the operator's Secrets through a plugin
    ("git-repo", volumes({"name": "src", "gitRepo": {"repository": "https://example.com/x.git"}}),
     "spec.template.spec.volumes[1].gitRepo", "CVE-2024-10220", "api"),
    ("cephfs-secret",
     volumes({"name": "c", "cephfs": {"monitors": ["m:6789"], "secretRef": {"name": MEMBERSHIP}}}),
     "spec.template.spec.volumes[1].cephfs", "PersistentVolumeClaim", "api"),
    ("flex-volume-secret",
     volumes({"name": "f", "flexVolume": {"driver": "x/y", "secretRef": {"name": MEMBERSHIP}}}),
     "spec.template.spec.volumes[1].flexVolume", "volume sources", "api"),
    ("rbd-secret",
     volumes({"name": "r", "rbd": {"monitors": ["m"], "image": "i", "secretRef": {"name": "x"}}}),
     "spec.template.spec.volumes[1].rbd", "Secret the kubelet reads", "api"),
    ("iscsi", volumes({"name": "i", "iscsi": {"targetPortal": "10.0.0.1:3260", "iqn": "iqn.x", "lun": 0,
                                               "chapAuthSession": True, "secretRef": {"name": MEMBERSHIP}}}),
     "spec.template.spec.volumes[1].iscsi", "server the spec names", "api"),
    ("azure-file", volumes({"name": "a", "azureFile": {"secretName": MEMBERSHIP, "shareName": "s"}}),
     "spec.template.spec.volumes[1].azureFile", "volume sources", "api"),
    ("scale-io",
     volumes({"name": "s", "scaleIO": {"gateway": "g", "system": "s", "secretRef": {"name": MEMBERSHIP}}}),
     "spec.template.spec.volumes[1].scaleIO", "volume sources", "api"),
    ("storageos", volumes({"name": "s", "storageos": {"volumeName": "v", "secretRef": {"name": MEMBERSHIP}}}),
     "spec.template.spec.volumes[1].storageos", "volume sources", "api"),
    ("nfs", volumes({"name": "n", "nfs": {"server": "10.0.0.2", "path": "/"}}),
     "spec.template.spec.volumes[1].nfs", "volume sources", "api"),
    ("csi-membership", volumes({"name": "c", "csi": {"driver": "smb.csi.k8s.io",
                                                     "nodePublishSecretRef": {"name": MEMBERSHIP}}}),
     "spec.template.spec.volumes[1].csi.nodePublishSecretRef.name", "membership token", "api"),
    # item 5: a projected token of the pod's ServiceAccount (the operator's, in its namespace)
    ("projected-service-account-token",
     volumes({"name": "t", "projected": {"sources": [{"configMap": {"name": "c"}},
                                                      {"serviceAccountToken": {"path": "token"}}]}}),
     "spec.template.spec.volumes[1].projected.sources[1].serviceAccountToken", "API credential", "api"),
    ("projected-pod-certificate",
     volumes({"name": "t", "projected": {"sources": [
         {"podCertificate": {"signerName": "x/y", "keyType": "ED25519", "credentialBundlePath": "b"}}]}}),
     "spec.template.spec.volumes[1].projected.sources[0].podCertificate", "identity", "api"),
    # should, not must: decided as refusals
    ("share-process-namespace", pod(shareProcessNamespace=True),
     "spec.template.spec.shareProcessNamespace", "/proc/PID/root", "api"),
    ("scheduling-gates", pod(schedulingGates=[{"name": "example.com/hold"}]),
     "spec.template.spec.schedulingGates", "Pending", "api"),
    ("sidecar-port-http", sidecar(ports=[{"name": "metrics", "containerPort": 9090},
                                         {"name": "http", "containerPort": 8080}]),
     "spec.template.spec.containers[0].ports[1].name", "every client", "api"),
    ("sidecar-port-master", sidecar(ports=[{"name": "master", "containerPort": 25001}]),
     "spec.template.spec.containers[0].ports[0].name", "name the port otherwise", "api"),
    ("native-sidecar-port-membership",
     container("initContainers", restartPolicy="Always",
               ports=[{"name": "membership", "containerPort": 8091}]),
     "spec.template.spec.initContainers[1].ports[0].name", "NetworkPolicy", "api"),
]


@pytest.mark.parametrize(("case", "obj", "field", "words", "who"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_with_the_field_named(case, obj, field, words, who):
    refused_exactly(obj, field, words)
    _enforced_by(field, who)


ACCEPTED = [
    ("gpu-words-elsewhere", container(env=[{"name": "CUDA_VISIBLE_DEVICES", "value": "0"},
                                           {"name": "MY_NVIDIA_VISIBLE_DEVICES", "value": "all"}])),
    ("engine-env-like",
     spec(engine__env=[{"name": "NVIDIA", "value": "1"}, {"name": "NVIDIAX", "value": "1"}])),
    ("env-from-prefixes", sidecar(envFrom=[{"prefix": "HF_", "secretRef": {"name": "hf"}},
                                           {"prefix": "NVX", "configMapRef": {"name": "c"}},
                                           {"prefix": "X_NVIDIA_", "configMapRef": {"name": "c"}}])),
    ("allowed-volume-sources", volumes(
        {"name": "a", "configMap": {"name": "c"}},
        {"name": "b", "secret": {"secretName": "hf"}},
        {"name": "c",
         "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
        {"name": "d", "persistentVolumeClaim": {"claimName": "weights"}},
        {"name": "e", "ephemeral": {"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"]}}}},
        {"name": "f",
         "csi": {"driver": "secrets-store.csi.k8s.io", "nodePublishSecretRef": {"name": "creds"}}},
        {"name": "g", "image": {"reference": "example.com/weights:1"}},
        {"name": "h", "projected": {"sources": [
            {"configMap": {"name": "c"}}, {"secret": {"name": "tls"}},
            {"downwardAPI": {"items": [{"path": "n", "fieldRef": {"fieldPath": "metadata.name"}}]}},
            {"clusterTrustBundle": {"path": "ca.pem", "signerName": "example.com/ca"}}]}},
    )),
    ("sidecar-ports-of-its-own", sidecar(ports=[{"name": "metrics", "containerPort": 9090},
                                                {"containerPort": 9091}])),
    ("process-namespace-unshared", pod(shareProcessNamespace=False)),
]


@pytest.mark.parametrize("obj", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_near_miss_is_accepted(obj):
    validate_omnistage(obj)


# ---- item 7: host directories of a type that is a way onto the node ---------------------------------

@pytest.mark.parametrize("kind", ["Socket", "CharDevice", "BlockDevice"])
def test_an_allowed_host_directory_is_refused_as_a_socket_or_a_device(monkeypatch, kind):
    monkeypatch.setenv("OMNISTAGE_ALLOWED_HOST_PATHS", "/run")
    obj = volumes({"name": "cri", "hostPath": {"path": "/run/containerd/containerd.sock", "type": kind}})
    refused_exactly(obj, "spec.template.spec.volumes[1].hostPath.type", "even mounted read-only")
    _enforced_by("spec.template.spec.volumes[1].hostPath.type", "api")


@pytest.mark.parametrize("kind", ["", "Directory", "DirectoryOrCreate", "File", "FileOrCreate"])
def test_an_allowed_host_directory_of_another_type_passes(monkeypatch, kind):
    monkeypatch.setenv("OMNISTAGE_ALLOWED_HOST_PATHS", "/opt/engines")
    validate_omnistage(volumes({"name": "venv", "hostPath": {"path": "/opt/engines/venv", "type": kind}}))


# ---- should, not must: control-plane placement, decided as documented (pod-create-equivalent) --------

CONTROL_PLANE = "node-role.kubernetes.io/control-plane"


def test_control_plane_placement_is_the_editors_and_keeps_the_pods_on_gpu_nodes():
    """Tolerating the control plane's taint and selecting its nodes is what any pod of the namespace may
    do (docs/security.md): accepted, on the template, the placement and a pool alike. What keeps the
    engine pods off a control-plane node without GPUs stays the operator's: the GPU request and the
    product selector, which neither can remove."""
    toleration = {"key": CONTROL_PLANE, "operator": "Exists", "effect": "NoSchedule"}
    template = {"spec": {"tolerations": [toleration], "nodeSelector": {CONTROL_PLANE: ""}}}
    validate_omnistage(spec(template=template))
    validate_omnistage(spec(placement={"tolerations": [toleration], "nodeSelector": {CONTROL_PLANE: ""}}))
    for p in pods(template):
        engine = next(c for c in p["spec"]["containers"] if c["name"] == "engine")
        assert engine["resources"]["limits"][GPU] == "1"
        assert p["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200", CONTROL_PLANE: ""}
        assert toleration in p["spec"]["tolerations"]


def test_every_refusal_names_what_to_change():
    """Each message of this round says what to do instead (the house rule for errors)."""
    for _, obj, field, _, _ in REFUSED:
        with pytest.raises(InvalidSpec) as err:
            validate_omnistage(obj)
        message = dict(err.value.problems)[field]
        instead = ("use ", "set ", "mount a", "name the port", "takes a ServiceAccount", "read another",
                   "remove")
        assert any(w in message for w in instead), (field, message)
