"""The GPU tier's own logic, without a cluster (runs in every `make test`): which settings start it, what
it installs, and the OmniStage it applies."""

from __future__ import annotations

import pytest
import yaml

from .support import (
    ENGINE_IMAGE_ENV,
    ROOT,
    SAMPLE,
    Settings,
    SettingsError,
    allocatable_gpus,
    gpus_needed,
    install_objects,
    object_ref,
    omnistage_for_test,
    operator_container,
)

REQUESTED = {"OMNISTAGE_GPU_CLUSTER": "1", "OMNISTAGE_USE_EXISTING_CLUSTER": "1", "KUBECONFIG": "/tmp/gpu.kubeconfig"}


def test_not_requested_means_skipped_whatever_else_is_set():
    assert not Settings.from_env({}).requested
    assert not Settings.from_env({"OMNISTAGE_USE_EXISTING_CLUSTER": "1", "KUBECONFIG": "/x"}).requested


def test_defaults():
    s = Settings.from_env(REQUESTED)
    assert s.requested and s.operator == "install" and s.operator_image is None and s.engine_image is None
    assert (s.product, s.product_label, s.resource) == ("NVIDIA-H200", "nvidia.com/gpu.product", "nvidia.com/gpu")
    assert s.sample == SAMPLE and s.replicas == 2 and s.ready_timeout == 3600 and not s.keep
    assert s.kubectl == "kubectl" and s.namespace is None and s.omnistage is None


@pytest.mark.parametrize("change, message", [
    ({"OMNISTAGE_USE_EXISTING_CLUSTER": ""}, "OMNISTAGE_USE_EXISTING_CLUSTER=1 is required"),
    ({"KUBECONFIG": ""}, "KUBECONFIG must name the GPU cluster"),
    ({"OMNISTAGE_GPU_OPERATOR": "helm"}, "OMNISTAGE_GPU_OPERATOR is 'helm'"),
    ({"OMNISTAGE_GPU_REPLICAS": "0"}, "OMNISTAGE_GPU_REPLICAS is '0'"),
    ({"OMNISTAGE_GPU_READY_TIMEOUT": "soon"}, "OMNISTAGE_GPU_READY_TIMEOUT is 'soon'"),
    ({"OMNISTAGE_GPU_OMNISTAGE": "just-a-name"}, "use NAMESPACE/NAME"),
    ({"OMNISTAGE_GPU_SAMPLE": "manifests/samples/missing.yaml"}, "is not a file"),
])
def test_a_requested_tier_that_cannot_run_names_the_variable(change, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_env({**REQUESTED, **change})


def test_an_existing_omnistage_implies_the_existing_operator():
    s = Settings.from_env({"OMNISTAGE_GPU_OMNISTAGE": "serving/qwen3-omni", "OMNISTAGE_USE_EXISTING_CLUSTER": "1",
                           "KUBECONFIG": "/x", "OMNISTAGE_GPU_OPERATOR": "install"})
    assert s.requested and s.omnistage == ("serving", "qwen3-omni") and s.operator == "existing"


def _rendered() -> list[dict]:
    """manifests/base as `kubectl kustomize` renders it, approximated by reading its files."""
    docs = []
    for name in ("namespace.yaml", "rbac.yaml", "deployment.yaml"):
        docs += [d for d in yaml.safe_load_all((ROOT / "manifests/base" / name).read_text()) if d]
    return docs


def test_install_objects_replace_only_the_two_images():
    rendered = _rendered()
    out = install_objects(rendered, "registry.example.com/omnistage-operator:dev",
                          "registry.example.com/omnistage-engine:dev")
    container = operator_container(out)
    assert container["image"] == "registry.example.com/omnistage-operator:dev"
    assert {e["name"]: e.get("value") for e in container["env"]}[ENGINE_IMAGE_ENV] == \
        "registry.example.com/omnistage-engine:dev"
    assert operator_container(rendered)["image"] != container["image"], "the input must not change"
    assert [o["kind"] for o in out] == [o["kind"] for o in rendered]
    assert install_objects(rendered, None, None) == rendered


def test_object_refs_name_kind_group_and_namespace():
    assert object_ref({"apiVersion": "apps/v1", "kind": "Deployment",
                       "metadata": {"name": "omnistage-operator", "namespace": "omnistage-system"}}) == \
        ["deployment.apps", "omnistage-operator", "-n", "omnistage-system"]
    assert object_ref({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "omnistage-system"}}) == \
        ["namespace", "omnistage-system"]


def test_the_applied_omnistage_is_the_sample_on_the_configured_gpus():
    sample = yaml.safe_load(SAMPLE.read_text())
    s = Settings.from_env({**REQUESTED, "OMNISTAGE_GPU_PRODUCT": "NVIDIA-H100-80GB-HBM3", "OMNISTAGE_GPU_REPLICAS": "3",
                           "OMNISTAGE_GPU_ENGINE_IMAGE": "registry.example.com/omnistage-engine:dev"})
    obj = omnistage_for_test(sample, s, "omnistage-gpu-abcde")
    assert obj["metadata"]["namespace"] == "omnistage-gpu-abcde" and obj["spec"]["replicas"] == 3
    assert obj["spec"]["gpu"]["product"] == "NVIDIA-H100-80GB-HBM3"
    # Installed by the tier: the engine image is the operator's default, not written into the spec.
    assert "image" not in obj["spec"].get("engine", {})
    existing = Settings.from_env({**REQUESTED, "OMNISTAGE_GPU_OPERATOR": "existing",
                                  "OMNISTAGE_GPU_ENGINE_IMAGE": "registry.example.com/omnistage-engine:dev"})
    assert omnistage_for_test(sample, existing, "ns")["spec"]["engine"]["image"] == \
        "registry.example.com/omnistage-engine:dev"
    assert sample["spec"]["replicas"] == 2, "the sample must not change"


def test_gpu_capacity():
    nodes = [{"status": {"allocatable": {"nvidia.com/gpu": "8"}}},
             {"spec": {"unschedulable": True}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}},
             {"status": {"allocatable": {}}}]
    assert allocatable_gpus(nodes, "nvidia.com/gpu") == 8
    assert gpus_needed({"spec": {"gpu": {"count": 2}}}, 3) == 6 and gpus_needed({"spec": {}}, 3) == 3
