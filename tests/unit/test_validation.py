"""What the operator and `omnistage render` refuse, and how they say it."""

import pytest
import yaml
from omnistage.api.validation import InvalidSpec, validate_omnistage

from tests.support.repo import ROOT, SAMPLE
from tests.support.specs import refused_exactly, with_spec_changes


def with_spec(**changes):
    return with_spec_changes(SAMPLE, changes, sep="__")


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
    (
        "gpu-below-tp",
        with_spec(gpu__count=1, engine__tensorParallelSize=2),
        "spec.gpu.count",
        "tensorParallelSize",
    ),
    ("owned-flag", with_spec(engine__extraArgs=["--stage-id=1"]), "spec.engine.extraArgs[0]", "--stage-id"),
    (
        "owned-stage-key",
        with_spec(engine__stageOverrides={"num_replicas": 3}),
        "spec.engine.stageOverrides.num_replicas",
        "spec.replicas",
    ),
    ("same-ports", with_spec(engine__masterPort=8000), "spec.engine.masterPort", "must differ"),
    (
        "utilization",
        with_spec(engine__gpuMemoryUtilization=1.5),
        "spec.engine.gpuMemoryUtilization",
        "less than",
    ),
    ("shm-size", with_spec(shmSize="lots"), "spec.shmSize", "pattern"),
    ("unknown-field", with_spec(replicaCount=3), "spec.replicaCount", "Extra inputs"),
    (
        "two-volumes",
        with_spec(modelVolume={"pvc": {"claimName": "w"}, "hostPath": {"path": "/w"}}),
        "spec.modelVolume",
        "exactly one",
    ),
    ("no-model", with_spec(model=""), "spec.model", "at least 1 character"),
    # The head would wait forever for stages 1..n this operator does not start.
    (
        "multi-stage-pipeline",
        with_spec(pipeline="qwen3_omni_moe"),
        "spec.pipeline",
        "qwen3_omni_moe_thinker_only",
    ),
    ("pipeline-too-long", with_spec(pipeline="p" * 129), "spec.pipeline", "at most 128"),
]


@pytest.mark.parametrize(("case", "obj", "field", "words"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_names_field(case, obj, field, words):
    with pytest.raises(InvalidSpec) as err:
        validate_omnistage(obj)
    fields = [f for f, _ in err.value.problems]
    assert field in fields, err.value.problems
    assert words in dict(err.value.problems)[field]


def test_static_single_may_keep_sender_caches():
    for mode in ("lru", "shm"):
        spec = validate_omnistage(with_spec(replicas=1, membership="static", cache__mode=mode))
        assert spec.cache.mode == mode


def test_every_problem_is_reported_at_once():
    with pytest.raises(InvalidSpec) as err:
        validate_omnistage(with_spec(cache__mode="lru", engine__masterPort=8000))
    assert {f for f, _ in err.value.problems} == {"spec.cache.mode", "spec.engine.masterPort"}


def args(*a):
    return with_spec(engine__extraArgs=["--trust-remote-code", *a])  # the refused one is at index 1


def env(name):
    return with_spec(engine__env=[{"name": "HF_HOME", "value": "/models"}, {"name": name, "value": "x"}])


def stage(overrides):
    return with_spec(engine__stageOverrides=overrides)


# Every path to the frontend cache, the replica count or the engine plugin that the spec offers:
# (id, object, the exact field the problem names, words of the message). "abbrev" cases are the
# operator's alone (the API server accepts them, tests/cluster/test_api.py shows which it refuses).
REFUSED = [
    # extraArgs: the cache flags in every form vLLM's parser reads
    ("cache-type-eq", args("--mm-processor-cache-type=shm"), "spec.engine.extraArgs[1]", "spec.cache"),
    (
        "cache-type-sep",
        args("--mm-processor-cache-type", "shm"),
        "spec.engine.extraArgs[1]",
        "--mm-processor-cache-type",
    ),
    ("cache-gb-eq", args("--mm-processor-cache-gb=0"), "spec.engine.extraArgs[1]", "--mm-processor-cache-gb"),
    (
        "cache-gb-sep",
        args("--mm-processor-cache-gb", "8"),
        "spec.engine.extraArgs[1]",
        "--mm-processor-cache-gb",
    ),
    (
        "cache-type-underscores",
        args("--mm_processor_cache_type=lru"),
        "spec.engine.extraArgs[1]",
        "with - or _",
    ),
    ("cache-type-abbrev", args("--mm-processor-cache-t=shm"), "spec.engine.extraArgs[1]", "abbreviation"),
    (
        "cache-gb-abbrev-underscores",
        args("--mm_processor_cache_g", "0"),
        "spec.engine.extraArgs[1]",
        "abbreviation",
    ),
    ("cache-type-mixed", args("--mm_processor-cache_type=lru"), "spec.engine.extraArgs[1]", "mixed - and _"),
    # extraArgs: swapping or overriding the rendered stage config
    (
        "stage-overrides-json",
        args('--stage-overrides={"0": {"num_replicas": 3}}'),
        "spec.engine.extraArgs[1]",
        "--stage-overrides",
    ),
    (
        "stage-overrides-dotted",
        args("--stage-overrides.0.mm_processor_cache_type=lru"),
        "spec.engine.extraArgs[1]",
        "--flag.key=value",
    ),
    (
        "stage-overrides-abbrev",
        args("--stage-o", '{"0": {"num_replicas": 3}}'),
        "spec.engine.extraArgs[1]",
        "abbreviation",
    ),
    ("deploy-config", args("--deploy-config=/tmp/mine.yaml"), "spec.engine.extraArgs[1]", "--deploy-config"),
    ("config-file", args("--config", "/models/args.yaml"), "spec.engine.extraArgs[1]", "--config"),
    # extraArgs: more than one API process (vLLM then picks the frontend cache itself)
    ("api-server-count", args("--api-server-count=2"), "spec.engine.extraArgs[1]", "--api-server-count"),
    ("api-server-count-alias", args("-asc", "2"), "spec.engine.extraArgs[1]", "-asc"),
    # extraArgs: membership flags, aliases and abbreviations included
    ("master-address-alias", args("-oma=127.0.0.9"), "spec.engine.extraArgs[1]", "-oma"),
    (
        "master-address-abbrev",
        args("--omni-master-a", "127.0.0.9"),
        "spec.engine.extraArgs[1]",
        "abbreviation",
    ),
    ("replica-address-abbrev", args("-or", "127.0.0.9"), "spec.engine.extraArgs[1]", "abbreviation"),
    ("headless", args("--headless"), "spec.engine.extraArgs[1]", "--headless"),
    ("port", args("--port=8001"), "spec.engine.extraArgs[1]", "spec.engine.httpPort"),
    (
        "heartbeat",
        args("--omni-heartbeat-timeout", "60"),
        "spec.engine.extraArgs[1]",
        "spec.engine.heartbeatTimeoutSeconds",
    ),
    ("omni-again", args("--omni"), "spec.engine.extraArgs[1]", "--omni"),
    # env: the plugin allow-list and the plugin's own switches
    ("vllm-plugins", env("VLLM_PLUGINS"), "spec.engine.env[1].name", "VLLM_PLUGINS"),
    (
        "disable-patches",
        env("OMNISTAGE_DISABLE_PATCHES"),
        "spec.engine.env[1].name",
        "switch the engine plugin",
    ),
    ("frontend-cache-env", env("OMNISTAGE_FRONTEND_CACHE"), "spec.engine.env[1].name", "spec.cache"),
    ("route-joined-only", env("OMNISTAGE_ROUTE_JOINED_ONLY"), "spec.engine.env[1].name", "OMNISTAGE_*"),
    ("token", env("OMNISTAGE_MEMBERSHIP_TOKEN"), "spec.engine.env[1].name", "membership token"),
    ("token-file", env("OMNISTAGE_MEMBERSHIP_TOKEN_FILE"), "spec.engine.env[1].name", "OMNISTAGE_*"),
    ("any-omnistage-env", env("OMNISTAGE_SOMETHING_NEW"), "spec.engine.env[1].name", "OMNISTAGE_*"),
    # env: the engine's address (the head binds the master address on $(POD_IP))
    ("pod-ip", env("POD_IP"), "spec.engine.env[1].name", "POD_IP"),
    ("vllm-host-ip", env("VLLM_HOST_IP"), "spec.engine.env[1].name", "VLLM_HOST_IP"),
    # stageOverrides: cache and replica keys at any depth, and stage env carrying the operator's variables
    (
        "nested-replicas",
        stage({"runtime": {"num_replicas": 3}}),
        "spec.engine.stageOverrides.runtime.num_replicas",
        "spec.replicas",
    ),
    (
        "nested-cache-type",
        stage({"engine_args": {"mm_processor_cache_type": "lru"}}),
        "spec.engine.stageOverrides.engine_args.mm_processor_cache_type",
        "spec.cache",
    ),
    (
        "nested-cache-gb",
        stage({"engine_extras": {"mm_processor_cache_gb": 0}}),
        "spec.engine.stageOverrides.engine_extras.mm_processor_cache_gb",
        "at any depth",
    ),
    (
        "top-cache-gb",
        stage({"mm_processor_cache_gb": 0}),
        "spec.engine.stageOverrides.mm_processor_cache_gb",
        "spec.cache",
    ),
    ("stage-id", stage({"stage_id": 1}), "spec.engine.stageOverrides.stage_id", "stage_id"),
    (
        "dp-size-local",
        stage({"runtime": {"omni_dp_size_local": 2}}),
        "spec.engine.stageOverrides.runtime.omni_dp_size_local",
        "omni_dp_size_local",
    ),
    (
        "dashed-key",
        stage({"engine_args": {"mm-processor-cache-type": "shm"}}),
        "spec.engine.stageOverrides.engine_args.mm-processor-cache-type",
        "mm_processor_cache_type",
    ),
    (
        "in-a-list",
        stage({"extra": [{"ok": 1}, {"num_replicas": 2}]}),
        "spec.engine.stageOverrides.extra[1].num_replicas",
        "num_replicas",
    ),
    (
        "stage-env-plugins",
        stage({"env": {"VLLM_PLUGINS": "vllm_omni_register_models"}}),
        "spec.engine.stageOverrides.env.VLLM_PLUGINS",
        "VLLM_PLUGINS",
    ),
    (
        "runtime-env-patches",
        stage({"runtime": {"env": {"OMNISTAGE_DISABLE_PATCHES": "all"}}}),
        "spec.engine.stageOverrides.runtime.env.OMNISTAGE_DISABLE_PATCHES",
        "OMNISTAGE_*",
    ),
]


@pytest.mark.parametrize(("case", "obj", "field", "words"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_path_is_named_exactly(case, obj, field, words):
    refused_exactly(obj, field, words)


# Near misses: what looks like a refused path but changes neither the cache nor the plugin.
ACCEPTED = [
    ("mm-processor-kwargs", args('--mm-processor-kwargs={"max_pixels": 1003520}')),
    ("mm-processor-kwargs-dotted", args("--mm-processor-kwargs.max_pixels=1003520")),
    ("mm-processor-kwargs-sep", args("--mm-processor-kwargs", '{"fps": 2}')),
    ("shm-object-size", args("--mm-shm-cache-max-object-size-mb=64")),
    ("tensor-ipc", args("--mm-tensor-ipc=direct_rpc")),
    ("lb-policy", args("--omni-lb-policy=round-robin")),  # starts like --omni, is another flag
    ("config-format", args("--config-format=hf")),  # starts like --config, is another flag
    ("portfolio", args("--portfolio")),  # starts like --port; vLLM would refuse it, the operator need not
    ("stage-init-timeout", args("--stage-init-timeout=900")),
    ("served-model-name", args("--served-model-name", "qwen")),
    ("negative-value", args("--seed", "-1")),
    ("max-model-len", args("--max-model-len=32768", "--enforce-eager")),
    ("hf-token", env("HF_TOKEN")),
    ("vllm-logging", env("VLLM_LOGGING_LEVEL")),
    ("standin-knob", env("OMNISTAGE_STANDIN_FRONTEND_CACHE")),
    ("lowercase", env("omnistage_frontend_cache")),  # the plugin reads the upper-case name only
    ("suffix", env("MY_OMNISTAGE_SETTING")),
    ("batched-tokens", stage({"max_num_batched_tokens": 8192})),
    (
        "nested-harmless",
        stage({"runtime": {"devices": "0"}, "engine_args": {"mm_shm_cache_max_object_size_mb": 64}}),
    ),
    ("stage-env-harmless", stage({"env": {"HF_HOME": "/models"}})),
    ("owned-name-as-value", stage({"default_sampling_params": {"note": "num_replicas"}})),
    ("similar-key", stage({"engine_args": {"num_replicas_hint": 2, "mm_processor_kwargs": {"fps": 1}}})),
]


@pytest.mark.parametrize("obj", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_near_miss_is_accepted(obj):
    validate_omnistage(obj)


def test_every_problem_names_its_own_item():
    obj = with_spec(engine__extraArgs=["--port=1", "--enforce-eager", "--mm-processor-cache-t=lru"],
                    engine__env=[{"name": "VLLM_PLUGINS"}, {"name": "OMNISTAGE_FRONTEND_CACHE"}],
                    engine__stageOverrides={"num_replicas": 2, "runtime": {"num_replicas": 2}})
    with pytest.raises(InvalidSpec) as err:
        validate_omnistage(obj)
    assert [f for f, _ in err.value.problems] == [
        "spec.engine.extraArgs[0]",
        "spec.engine.extraArgs[2]",
        "spec.engine.env[0].name",
        "spec.engine.env[1].name",
        "spec.engine.stageOverrides.num_replicas",
        "spec.engine.stageOverrides.runtime.num_replicas",
    ]


def test_operator_only_rules_cover_what_cel_cannot():
    """The API server sees the literal spellings; the rule without CEL takes the rest, never the same arg."""
    from omnistage.api.validation import SPEC_RULES

    flag_rules = [r for r in SPEC_RULES if r.field == ".engine.extraArgs"]
    assert [r.cel is None for r in flag_rules] == [False, True, False]  # the third: $( (tested below)
    assert [r.message for r in SPEC_RULES if r.cel is None and r.field == ".engine.stageOverrides"]
    literal, respelled, _ = flag_rules
    spec = validate_omnistage(SAMPLE).model_copy(deep=True)
    spec.engine.extra_args = ["--mm-processor-cache-type=shm", "--mm-processor-cache-t=shm"]
    assert literal.broken(spec) == ["[0]"] and respelled.broken(spec) == ["[1]"]


def test_sample_file_is_the_fixture():
    assert SAMPLE == yaml.safe_load((ROOT / "manifests/samples/omnistage.yaml").read_text())


@pytest.mark.parametrize("pipeline", ["qwen3_omni_moe_thinker_only", "qwen2_5_omni_thinker_only",
                                      "my_org_out_of_tree_pipeline"])
def test_single_stage_and_unknown_pipelines_are_accepted(pipeline):
    """An unknown key may be an out-of-tree pipeline the engine image registers: the operator cannot
    know its stages, so it does not refuse it (the head's own error says more than a guess would)."""
    assert validate_omnistage(with_spec(pipeline=pipeline)).pipeline == pipeline
