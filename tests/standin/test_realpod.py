"""The real-mode runtime's translation of a rendered pod into a process (tests/standin/realpod.py):
pure, on the operator's own rendering of the pods (no cluster, no engine)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from omnistage.render import render_children, target_from

from tests.standin import realpod
from tests.standin.realpod import EngineImage, NotYet, Refused

MODEL = "omnistage-test/tiny"


def _omnistage(**spec) -> dict:
    return {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStage",
            "metadata": {"name": "tiny", "namespace": "ns", "uid": "u1", "generation": 1},
            "spec": {"model": MODEL, "pipeline": "qwen2_5_omni_thinker_only", "replicas": 2,
                     "gpu": {"resource": "nvidia.com/gpu", "count": 1, "product": "NVIDIA-H200"}, **spec}}


def _children(**spec) -> dict[tuple[str, str], dict]:
    out = {}
    t = target_from(_omnistage(**spec), default_image="engine:test")
    for obj in render_children(t, token="s3cret", head_ip="127.77.1.5", head_uid="hu").all():
        out[(obj["kind"], obj["metadata"]["name"])] = obj
    return out


def _pod(children, name: str, ip: str) -> dict:
    pod = children[("Pod", name)]
    pod["metadata"].update(namespace="ns", uid=f"uid-{name}")
    pod["status"] = {"podIP": ip, "hostIP": "127.0.0.1"}
    return pod


def _lookup(children):
    def lookup(kind, name):
        obj = children.get((kind, name))
        if obj is not None and kind == "Secret" and "stringData" in obj:
            obj = {**obj, "data": {k: base64.b64encode(v.encode()).decode() for k, v in obj["stringData"].items()}}
        return obj
    return lookup


IMAGE = EngineImage(bin_dir=Path("/opt/engine/bin"), models={MODEL: Path("/models/tiny")},
                    extra_plugins=("omnistage_cpu",))


def test_head_runs_its_rendered_command_with_mounts_mapped(tmp_path):
    children = _children()
    p = realpod.pod_process(_pod(children, "tiny-head", "127.77.1.5"), _lookup(children), IMAGE, tmp_path)
    assert p.argv[0] == "vllm", "the image's PATH resolves it (no /opt/engine here)"
    assert p.argv[1:4] == ["serve", "/models/tiny", "--omni"]
    args = dict(zip(p.argv[4::2], p.argv[5::2], strict=False))
    assert args["--deploy-config"] == str(tmp_path / "volumes" / "config" / "deploy.yaml")
    assert args["--host"] == "127.77.1.5", "0.0.0.0 becomes the pod's own IP"
    assert args["--omni-master-address"] == "127.77.1.5", "$(POD_IP) expanded"
    config = p.files[tmp_path / "volumes" / "config" / "deploy.yaml"][0].decode()
    assert config == children[("ConfigMap", "tiny-config")]["data"]["deploy.yaml"]
    token_file = Path(p.env["OMNISTAGE_MEMBERSHIP_TOKEN_FILE"])
    assert p.files[token_file] == (b"s3cret", 0o600)
    assert p.env["VLLM_HOST_IP"] == p.env["POD_IP"] == "127.77.1.5"
    assert p.env["VLLM_PLUGINS"].split(",")[-1] == "omnistage_cpu"
    assert p.env["VLLM_CACHE_ROOT"].startswith(str(tmp_path)), "the cache emptyDir is the pod's own directory"
    assert p.env["HF_HUB_OFFLINE"] == "1" and not any("proxy" in k.lower() for k in p.env)
    assert p.mounts["/dev/shm"] == "/dev/shm"


def test_replica_dials_the_head_it_was_rendered_for(tmp_path):
    children = _children()
    p = realpod.pod_process(_pod(children, "tiny-replica-1", "127.77.1.9"), _lookup(children), IMAGE, tmp_path)
    assert "--headless" in p.argv
    args = dict(zip(p.argv, p.argv[1:], strict=False))
    assert args["--omni-master-address"] == "127.77.1.5"
    assert args["--omni-replica-address"] == "127.77.1.9"


def test_user_env_from_secret_and_downward_api(tmp_path):
    children = _children(engine={"env": [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "WHERE", "value": "$(POD_NAME)-x $$(POD_NAME)"}]})
    children[("Secret", "hf")] = {"data": {"token": base64.b64encode(b"hf_abc").decode()}}
    p = realpod.pod_process(_pod(children, "tiny-head", "127.77.1.5"), _lookup(children), IMAGE, tmp_path)
    assert p.env["HF_TOKEN"] == "hf_abc"
    assert p.env["WHERE"] == "tiny-head-x $(POD_NAME)", "kubelet expansion: defined names, $$ escapes"


def test_missing_secret_is_not_yet(tmp_path):
    children = _children(engine={"env": [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]})
    with pytest.raises(NotYet, match="Secret hf"):
        realpod.pod_process(_pod(children, "tiny-head", "127.77.1.5"), _lookup(children), IMAGE, tmp_path)


def test_a_pvc_is_refused_with_what_to_change(tmp_path):
    children = _children(modelVolume={"mountPath": "/models", "pvc": {"claimName": "weights"}})
    with pytest.raises(Refused, match="persistentVolumeClaim"):
        realpod.pod_process(_pod(children, "tiny-head", "127.77.1.5"), _lookup(children), IMAGE, tmp_path)


@pytest.mark.parametrize("value, want", [
    ("$(A)", "1"), ("$(A)$(B)", "12"), ("$$(A)", "$(A)"), ("$(C)", "$(C)"), ("x$(A)y", "x1y")])
def test_expand_is_the_kubelets(value, want):
    assert realpod.expand(value, {"A": "1", "B": "2"}) == want


def test_tmpdir_is_short_enough_for_zmq_ipc_sockets(tmp_path):
    children = _children()
    deep = tmp_path / ("x" * 80)
    p = realpod.pod_process(_pod(children, "tiny-head", "127.77.1.5"), _lookup(children), IMAGE, deep,
                            tmp=Path("/tmp/omnistage-pod-abcdef12"))
    assert len(p.env["TMPDIR"] + "/" + "2dcbcf47-bfbf-4fdb-906f-fcadd0cd7244") < 107


def test_projected_service_account_volume(tmp_path):
    children = _children()
    pod = _pod(children, "tiny-head", "127.77.1.5")
    pod["spec"]["volumes"].append({"name": "kube-api-access-x", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}})
    pod["spec"]["containers"][0]["volumeMounts"].append(
        {"name": "kube-api-access-x", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"})
    children[("ConfigMap", "kube-root-ca.crt")] = {"data": {"ca.crt": "CA"}}
    base = _lookup(children)
    p = realpod.pod_process(pod, lambda k, n: {"token": "tok"} if k == "ServiceAccountToken" else base(k, n),
                            IMAGE, tmp_path)
    d = tmp_path / "volumes" / "kube-api-access-x"
    assert p.files[d / "token"] == (b"tok", 0o600)
    assert p.files[d / "ca.crt"][0] == b"CA" and p.files[d / "namespace"][0] == b"ns"


def test_the_cpu_engine_image_imports_this_checkouts_plugins(tmp_path):
    """The engine processes import the plugins of the tree under test, not the checkout the venv's
    editable install points at (a second worktree once tested main's plugin: the hold route 404'd)."""
    env = realpod.cpu_engine_image(tmp_path, {}).env
    first = [Path(d) for d in env["PYTHONPATH"].split(":")]
    root = Path(realpod.__file__).resolve().parents[2]
    assert (first[0] / "omnistage_engine_patches" / "__init__.py") == \
        root / "engine_patches" / "omnistage_engine_patches" / "__init__.py"
    assert (first[1] / "omnistage_cpu_platform" / "__init__.py").exists()


def test_the_container_image_picks_the_engine_image(tmp_path):
    """An engine upgrade walk: the pods of spec.engine.image "engine:next" run from the other image's
    venv, every other reference from the default one."""
    nxt = EngineImage(bin_dir=tmp_path / "next" / "bin", models={MODEL: Path("/models/tiny")})
    (tmp_path / "next" / "bin").mkdir(parents=True)
    (tmp_path / "next" / "bin" / "vllm").touch()
    image = EngineImage(bin_dir=IMAGE.bin_dir, models=IMAGE.models, others={"engine:next": nxt})
    for spec, bin_dir in (({}, IMAGE.bin_dir), ({"engine": {"image": "engine:next"}}, nxt.bin_dir)):
        children = _children(**spec)
        p = realpod.pod_process(_pod(children, "tiny-head", "127.77.1.5"), _lookup(children), image, tmp_path)
        assert p.env["PATH"].split(":")[0] == str(bin_dir), spec
    assert p.argv[0] == str(nxt.bin_dir / "vllm")
