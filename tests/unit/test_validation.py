"""What the operator and `omnistage render` refuse, and how they say it."""

import copy

import pytest
import yaml
from omnistage.validation import InvalidSpec, validate_omnistage

from .conftest import ROOT, SAMPLE


def with_spec(**changes):
    obj = copy.deepcopy(SAMPLE)
    for dotted, value in changes.items():
        node = obj["spec"]
        *path, last = dotted.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return obj


def test_sample_is_valid():
    spec = validate_omnistage(SAMPLE)
    assert spec.replicas == 2 and spec.cache.mode == "auto"


INVALID = [
    ("replicas-zero", with_spec(replicas=0), "spec.replicas", "greater than or equal to 1"),
    ("lru-dynamic", with_spec(cache__mode="lru"), "spec.cache.mode", "membership: static"),
    ("shm-two-pods", with_spec(cache__mode="shm", membership="static"), "spec.cache.mode", "replicas: 1"),
    ("bad-mode", with_spec(cache__mode="fast"), "spec.cache.mode", "'auto'"),
    ("negative-size", with_spec(cache__sizeGiB=-1), "spec.cache.sizeGiB", "greater than or equal to 0"),
    ("gpu-zero", with_spec(gpu__count=0), "spec.gpu.count", "greater than or equal to 1"),
    ("gpu-below-tp", with_spec(gpu__count=1, engine__tensorParallelSize=2), "spec.gpu.count", "tensorParallelSize"),
    ("owned-flag", with_spec(engine__extraArgs=["--stage-id=1"]), "spec.engine.extraArgs", "--stage-id"),
    ("owned-stage-key", with_spec(engine__stageOverrides={"num_replicas": 3}), "spec.engine.stageOverrides",
     "spec.replicas"),
    ("same-ports", with_spec(engine__masterPort=8000), "spec.engine.masterPort", "must differ"),
    ("utilization", with_spec(engine__gpuMemoryUtilization=1.5), "spec.engine.gpuMemoryUtilization", "less than"),
    ("shm-size", with_spec(shmSize="lots"), "spec.shmSize", "pattern"),
    ("unknown-field", with_spec(replicaCount=3), "spec.replicaCount", "Extra inputs"),
    ("two-volumes", with_spec(modelVolume={"pvc": {"claimName": "w"}, "hostPath": {"path": "/w"}}),
     "spec.modelVolume", "exactly one"),
    ("no-model", with_spec(model=""), "spec.model", "at least 1 character"),
]


@pytest.mark.parametrize(("case", "obj", "field", "words"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_names_field(case, obj, field, words):
    with pytest.raises(InvalidSpec) as err:
        validate_omnistage(obj)
    fields = [f for f, _ in err.value.problems]
    assert field in fields, err.value.problems
    assert words in dict(err.value.problems)[field]


def test_long_name_rejected():
    obj = copy.deepcopy(SAMPLE)
    obj["metadata"]["name"] = "x" * 41
    with pytest.raises(InvalidSpec, match="at most 40 characters"):
        validate_omnistage(obj)


def test_static_single_may_keep_sender_caches():
    for mode in ("lru", "shm"):
        spec = validate_omnistage(with_spec(replicas=1, membership="static", cache__mode=mode))
        assert spec.cache.mode == mode


def test_every_problem_is_reported_at_once():
    with pytest.raises(InvalidSpec) as err:
        validate_omnistage(with_spec(cache__mode="lru", engine__masterPort=8000))
    assert {f for f, _ in err.value.problems} == {"spec.cache.mode", "spec.engine.masterPort"}


def test_sample_file_is_the_fixture():
    assert SAMPLE == yaml.safe_load((ROOT / "manifests/samples/omnistage.yaml").read_text())
