"""The committed CRDs (OmniStage, OmniStagePool) are exactly what the models generate, and have what
kubectl and HPA need."""

import pytest
import yaml
from omnistage.api.crd import build_crd, build_pool_crd, crd_yaml

from tests.support.repo import ROOT

CRD_PATH = ROOT / "crds/omnistage.serving.omnistage.io.yaml"


def test_committed_crd_matches_models():
    assert CRD_PATH.read_text() == crd_yaml(), "crds/ is stale: run `make crd` and commit the result"


@pytest.mark.parametrize("build", [build_crd, build_pool_crd])
def test_scale_subresource_selects_counted_pods(build):
    version = build()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]


def test_printer_columns_and_short_name():
    crd = build_crd()
    cols = [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert cols == ["Desired", "Ready", "Registered", "Standby", "Cache", "Status", "Reason", "Age"]
    assert crd["spec"]["names"]["shortNames"] == ["ost"]


@pytest.mark.parametrize("build", [build_crd, build_pool_crd])
def test_conditions_are_a_map_keyed_by_type(build):
    status = build()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    conditions = status["properties"]["conditions"]
    assert (conditions["x-kubernetes-list-type"], conditions["x-kubernetes-list-map-keys"]) == (
        "map",
        ["type"],
    )
    assert "type" in conditions["items"]["required"]  # a map key must be required


def test_pool_printer_columns_and_short_name():
    crd = build_pool_crd()
    cols = [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert cols == ["OmniStage", "Stages", "Desired", "Ready", "Registered", "Standby", "Status", "Reason",
                    "Age"]
    assert (
        crd["spec"]["names"]["shortNames"] == ["osp"]
        and crd["metadata"]["name"] == "omnistagepools.serving.omnistage.io"
    )


def test_pool_replicas_and_stage_ids_are_bounded_by_the_schema():
    spec = build_pool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["replicas"]["minimum"] == 1  # the head waits for one replica of each stage
    assert spec["properties"]["stageIds"]["items"]["minimum"] == 1  # stage 0 is the OmniStage's
    assert spec["properties"]["stageIds"]["x-kubernetes-list-type"] == "set"
    assert set(spec["required"]) == {"omniStage", "stageIds"}


def test_stage_ids_of_an_omnistage_are_a_map_keyed_by_id():
    stages = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["stages"]
    assert stages["x-kubernetes-list-type"] == "map" and stages["x-kubernetes-list-map-keys"] == ["id"]


def _walk(schema, path):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")


@pytest.mark.parametrize("build", [build_crd, build_pool_crd])
def test_every_spec_field_is_described_and_structural(build):
    spec = build()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for path, node in _walk(spec, "spec"):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields") \
            or node.get("x-kubernetes-int-or-string"), path
        if not path.endswith("[]"):
            assert node.get("description"), f"{path} has no description (kubectl explain shows nothing)"
        for banned in ("$ref", "anyOf", "allOf", "title"):
            assert banned not in node, f"{path} has {banned}"
        assert node.get("additionalProperties") is not False, path


def test_every_rule_has_a_message_and_field():
    rules = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"]
    assert len(rules) >= 5
    for r in rules:
        assert r["rule"] and r["message"].startswith("spec.") and r["fieldPath"].startswith(".")


def test_crd_is_valid_yaml():
    docs = list(yaml.safe_load_all(CRD_PATH.read_text()))
    assert [d["kind"] for d in docs] == ["CustomResourceDefinition"] * 2
    assert [d["spec"]["names"]["kind"] for d in docs] == ["OmniStage", "OmniStagePool"]
