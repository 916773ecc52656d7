"""What spec.template cannot loosen in the pods the operator renders (issue 40 items 7 and 8,
render/hardening.py): every container drops every capability and may not escalate, and every mount
of a host directory is read-only. Before, `capabilities: {drop: []}` on the engine brought back the
runtime's default capabilities (NET_RAW...), sidecars and init containers kept them with
allowPrivilegeEscalation unset, and an allow-listed host directory was mounted read-write."""

from __future__ import annotations

import pytest
import yaml
from omnistage.api import OmniStagePoolSpec
from omnistage.render import render_head_pod, render_replica_pod, target_from
from omnistage.render.common import Pool
from omnistage.render.pods import render_pool_pod

from tests.support.repo import ROOT

from .test_podtemplate import HEAD_IP, HEAD_UID, stage_with

HARDENED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
SPEECH = [d for d in yaml.safe_load_all((ROOT / "manifests/samples/qwen3-omni-speech.yaml").read_text()) if d]


def every_pod(template, **spec):
    """Head, replica and pool pod of an OmniStage with `template` (the speech sample: it has a pool)."""
    ost = next(d for d in SPEECH if d["kind"] == "OmniStage")
    pool_doc = next(d for d in SPEECH if d["kind"] == "OmniStagePool")
    obj = stage_with(template, **spec)
    obj["spec"].update(pipeline=ost["spec"]["pipeline"], stages=ost["spec"]["stages"])
    t = target_from(obj)
    pool = Pool(pool_doc["metadata"]["name"], "p", 1, OmniStagePoolSpec.model_validate(pool_doc["spec"]))
    return [render_head_pod(t), render_replica_pod(t, 1, HEAD_IP, HEAD_UID),
            render_pool_pod(t, pool, 0, HEAD_IP, HEAD_UID)]


def containers(pod):
    return {c["name"]: c for field in ("containers", "initContainers") for c in pod["spec"].get(field, [])}


LOOSENING = {
    "spec": {
        "initContainers": [
            {"name": "fetch", "image": "x"},
            {"name": "native-sidecar", "image": "x", "restartPolicy": "Always",
             "securityContext": {"capabilities": {"drop": []}}},
        ],
        "containers": [
            {"name": "engine", "securityContext": {"capabilities": {"drop": [], "add": ["IPC_LOCK"]}}},
            {"name": "proxy", "image": "x",
             "securityContext": {"runAsUser": 1000, "capabilities": {"drop": []}}},
            {"name": "metrics", "image": "x", "securityContext": {"allowPrivilegeEscalation": False,
                                                                  "capabilities": {"drop": ["NET_RAW"]}}},
            {"name": "plain", "image": "x"},
        ],
    }
}


def test_every_container_drops_every_capability_and_cannot_escalate_whatever_the_template_says():
    for pod in every_pod(LOOSENING):
        found = containers(pod)
        assert sorted(found) == ["engine", "fetch", "metrics", "native-sidecar", "plain", "proxy"]
        for name, c in found.items():
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, (pod["metadata"]["name"], name)
            assert ctx["capabilities"]["drop"][0] == "ALL", (pod["metadata"]["name"], name, ctx)
        # What the template may set is kept: the one addition allowed, another drop, the user.
        assert found["engine"]["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert found["metrics"]["securityContext"]["capabilities"] == {"drop": ["ALL", "NET_RAW"]}
        assert found["proxy"]["securityContext"]["runAsUser"] == 1000
        assert found["plain"]["securityContext"] == HARDENED


def test_a_null_security_context_does_not_undo_it():
    template = {"spec": {"containers": [{"name": "engine", "securityContext": None}]}}
    for pod in every_pod(template):
        assert containers(pod)["engine"]["securityContext"] == HARDENED


# ---- host directories: mounted read-only, in every container (item 7) ----------------------------------

@pytest.fixture
def allowed(monkeypatch):
    monkeypatch.setenv("OMNISTAGE_ALLOWED_HOST_PATHS", "/mnt/models,/opt/engines")


def test_every_mount_of_a_host_directory_is_read_only(allowed):
    template = {"spec": {
        "volumes": [{"name": "venv", "hostPath": {"path": "/opt/engines/venv", "type": "Directory"}},
                    {"name": "scratch", "emptyDir": {}}],
        "containers": [
            {"name": "engine", "volumeMounts": [{"name": "venv", "mountPath": "/venv", "readOnly": False},
                                                {"name": "scratch", "mountPath": "/scratch"}]},
            # a sidecar of the model volume (the operator's, a host directory here) and of the template's
            {"name": "planter", "image": "x", "volumeMounts": [{"name": "model", "mountPath": "/m"},
                                                               {"name": "venv", "mountPath": "/v"}]},
        ],
        "initContainers": [{"name": "init", "image": "x",
                            "volumeMounts": [{"name": "venv", "mountPath": "/v"}]}],
    }}
    model = {"mountPath": "/models", "hostPath": {"path": "/mnt/models/qwen3-omni"}}
    for pod in every_pod(template, modelVolume=model):
        found = containers(pod)
        host = {"venv", "model"}
        mounts = [(c, m) for c in found.values() for m in c.get("volumeMounts", []) if m["name"] in host]
        assert len(mounts) == 5, mounts
        assert all(m.get("readOnly") is True for _, m in mounts), mounts
        scratch = next(m for m in found["engine"]["volumeMounts"] if m["name"] == "scratch")
        assert "readOnly" not in scratch, "other volumes stay as the template mounts them"


def test_the_same_node_shared_memory_stays_writable():
    """sameNode's /dev/shm is a host directory of the operator's own (/dev/shm/omnistage/NS/NAME): the
    stages' shared memory, written by design."""
    for pod in every_pod(None, transport={"mode": "sameNode"}):
        shm = next(m for m in containers(pod)["engine"]["volumeMounts"] if m["name"] == "dshm")
        assert "readOnly" not in shm
        assert next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")["hostPath"]
