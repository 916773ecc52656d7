"""The GPU tier's own logic, without a cluster (runs in every `make test`): which settings start it, what
it installs, the OmniStage it applies, and the multi-stage tests' decisions (multistage.py): the
pipeline they apply, when it is converged, the speech answer, and the verdict on a load while scaling."""

from __future__ import annotations

import base64
import http.server
import io
import json
import subprocess
import threading
import time
import wave

import pytest
import yaml
from omnistage import api
from omnistage.api.validation import validate_omnistage
from omnistage.control import pools
from omnistage.known_pipelines import PIPELINES
from omnistage.render import target_from
from omnistage.render.pods import render_head_pod, render_pool_pod

from . import multistage as ms
from .checks import operator_leader
from .support import (
    ENGINE_IMAGE_ENV,
    ROOT,
    SAMPLE,
    SPEECH_SAMPLE,
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


def test_the_operator_leader_is_the_lease_holder():
    # manifests/ run two Ready operator pods; the tier reads metrics and logs from the one leading.
    calls = []

    def kubectl(*args, check=True):
        calls.append(args)
        lease = {"spec": {"holderIdentity": "omnistage-operator-7d9c-abcde"}}
        return subprocess.CompletedProcess(args, 0 if "omnistage-system" in args else 1, json.dumps(lease), "")

    assert operator_leader(kubectl, "omnistage-system") == "omnistage-operator-7d9c-abcde"
    assert calls[0][:3] == ("get", "lease", "omnistage-operator")
    assert operator_leader(kubectl, "elsewhere") is None


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


# ----- the multi-stage tests' logic (multistage.py) ----------------------------------------------------

def _speech_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(SPEECH_SAMPLE.read_text()) if d]


def test_multistage_runs_only_when_asked():
    assert Settings.from_env(REQUESTED).multistage == ()
    assert Settings.from_env({**REQUESTED, "OMNISTAGE_GPU_MULTISTAGE": "1"}).multistage == ("network", "sameNode")
    assert Settings.from_env({**REQUESTED, "OMNISTAGE_GPU_MULTISTAGE": "network"}).multistage == ("network",)
    # Without the cluster variables nothing runs, whatever OMNISTAGE_GPU_MULTISTAGE says.
    assert Settings.from_env({"OMNISTAGE_GPU_MULTISTAGE": "1"}).multistage == ()
    s = Settings.from_env({**REQUESTED, "OMNISTAGE_GPU_MULTISTAGE": "1"})
    assert s.multistage_sample == SPEECH_SAMPLE and s.multistage_clients == 4


@pytest.mark.parametrize("change, message", [
    ({"OMNISTAGE_GPU_MULTISTAGE": "yes"}, "OMNISTAGE_GPU_MULTISTAGE is 'yes'; use 0, 1 or network"),
    ({"OMNISTAGE_GPU_MULTISTAGE": "1", "OMNISTAGE_GPU_MULTISTAGE_SAMPLE": "nope.yaml"}, "is not a file"),
    ({"OMNISTAGE_GPU_MULTISTAGE_CLIENTS": "0"}, "OMNISTAGE_GPU_MULTISTAGE_CLIENTS is '0'"),
])
def test_a_multistage_run_that_cannot_run_names_the_variable(change, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_env({**REQUESTED, **change})


def test_the_speech_sample_is_a_valid_pipeline_and_pool():
    stage, pools = ms.split_sample(_speech_docs())
    spec = validate_omnistage(stage)
    assert spec.pipeline == "qwen3_omni_moe" and spec.replicas == 2 and spec.transport.mode == "network"
    assert [s.id for s in spec.stages] == list(range(1, len(PIPELINES["qwen3_omni_moe"])))
    assert [s.name for s in spec.stages] == list(PIPELINES["qwen3_omni_moe"][1:])
    (pool,) = pools
    pool_spec = api.OmniStagePoolSpec.model_validate(pool["spec"])
    assert pool_spec.omni_stage == stage["metadata"]["name"] and pool_spec.stage_ids == [1, 2]
    assert pool_spec.replicas == 1 and pool_spec.gpu.count == 1
    assert ms.remote_stage_ids(pools) == {1: "qwen3-omni-speech", 2: "qwen3-omni-speech"}
    assert ms.gpus_for([stage, *pools]) == 3 and ms.gpus_for([stage, *pools], {"qwen3-omni-speech": 1}) == 4
    assert ms.memory_budget(stage, [1, 2]) == 0.7


def test_split_sample_wants_one_omnistage_and_its_pools():
    stage, pool = _speech_docs()
    with pytest.raises(ValueError, match="found 1 OmniStage, 0 OmniStagePool"):
        ms.split_sample([stage])
    with pytest.raises(ValueError, match="do not name the OmniStage"):
        ms.split_sample([stage, {**pool, "spec": {**pool["spec"], "omniStage": "other"}}])
    with pytest.raises(ValueError, match="ConfigMap"):
        ms.split_sample([stage, pool, {"kind": "ConfigMap"}])


def test_the_applied_pipeline_is_the_sample_on_the_configured_gpus():
    docs = _speech_docs()
    s = Settings.from_env({**REQUESTED, "OMNISTAGE_GPU_PRODUCT": "NVIDIA-H100-80GB-HBM3"})
    stage, pool = ms.speech_for_test(docs, s, "ns-a")
    assert stage["metadata"]["namespace"] == pool["metadata"]["namespace"] == "ns-a"
    assert stage["spec"]["gpu"]["product"] == pool["spec"]["gpu"]["product"] == "NVIDIA-H100-80GB-HBM3"
    assert stage["spec"]["transport"]["mode"] == "network" and stage["spec"]["replicas"] == 2
    assert "image" not in stage["spec"]["engine"]
    rdma = [{**docs[0], "spec": {**docs[0]["spec"], "transport": {"mode": "network", "protocol": "rdma"}}}, docs[1]]
    stage, pool = ms.speech_for_test(rdma, s, "ns-b", mode=ms.SAME_NODE, thinker_replicas=1, pool_replicas=1)
    assert stage["spec"]["transport"] == {"mode": "sameNode", "protocol": "tcp"}
    assert stage["spec"]["replicas"] == 1 and pool["spec"]["replicas"] == 1
    existing = Settings.from_env({**REQUESTED, "OMNISTAGE_GPU_OPERATOR": "existing",
                                  "OMNISTAGE_GPU_ENGINE_IMAGE": "registry.example.com/omnistage-engine:dev"})
    assert ms.speech_for_test(docs, existing, "ns")[0]["spec"]["engine"]["image"] == \
        "registry.example.com/omnistage-engine:dev"
    assert docs == _speech_docs(), "the sample must not change"


def test_memory_budget_and_gpus_per_node():
    stage = {"spec": {"pipeline": "qwen3_omni_moe", "stages": [{"id": 1, "engine": {"gpuMemoryUtilization": 0.5}}]}}
    assert ms.memory_budget(stage, [1, 2]) == 0.6  # 0.5 given, code2wav's shipped 0.1
    assert ms.memory_budget({"spec": {"pipeline": "qwen3_omni_moe"}}, [2]) == 0.1
    nodes = [{"metadata": {"name": "a"}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}},
             {"metadata": {"name": "b"}, "spec": {"unschedulable": True}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}},
             {"metadata": {"name": "c"}, "status": {"allocatable": {}}}]
    assert ms.gpus_per_node(nodes, "nvidia.com/gpu") == {"a": 8, "c": 0}


def _ready(*types: str) -> list[dict]:
    return [{"type": t, "status": "True", "reason": "Ok"} for t in types]


def _pod(name: str, ip: str) -> dict:
    return {"metadata": {"name": name}, "status": {"phase": "Running", "podIP": ip,
                                                   "conditions": [{"type": "Ready", "status": "True"}]}}


def _converged() -> tuple[dict, list[dict], list[dict], dict, dict]:
    stage = {"metadata": {"name": "qwen3-omni", "generation": 3}, "spec": {"replicas": 2},
             "status": {"observedGeneration": 3, "replicas": 2, "readyReplicas": 2, "registeredReplicas": 2,
                        "conditions": _ready("Ready", "StagesCovered", "StagesReady"),
                        "stages": [{"id": 1, "name": "talker", "pool": "speech", "desired": 1, "ready": 1,
                                    "registered": 1},
                                   {"id": 2, "name": "code2wav", "pool": "speech", "desired": 1, "ready": 1,
                                    "registered": 1}]}}
    pool = {"metadata": {"name": "speech", "generation": 1}, "spec": {"stageIds": [1, 2], "replicas": 1},
            "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "registeredReplicas": 1,
                       "conditions": _ready("Ready"),
                       "members": [{"pod": "speech-1", "ip": "127.77.2.5", "state": "Joined",
                                    "replicaIds": {"1": 0, "2": 0}}]}}
    stage_pods = [_pod("qwen3-omni-head", "127.77.1.4"), _pod("qwen3-omni-replica-1", "127.77.1.9")]
    pool_pods = {"speech": [_pod("speech-1", "127.77.2.5")]}
    listing = {"stages": {"0": [{"replicaId": 0, "local": True, "state": "attached"},
                                {"replicaId": 1, "host": "127.77.1.9", "state": "attached"}],
                          "1": [{"replicaId": 0, "host": "127.77.2.5", "state": "attached"}],
                          "2": [{"replicaId": 0, "host": "127.77.2.5", "state": "attached"},
                                {"replicaId": 1, "host": "127.77.2.7", "state": "left"}]}}
    return stage, [pool], stage_pods, pool_pods, listing


def test_a_converged_pipeline_has_no_problems():
    assert ms.pipeline_problems(*_converged()) == []


def _break(change) -> list[str]:
    parts = _converged()
    change(*parts)
    return ms.pipeline_problems(*parts)


@pytest.mark.parametrize("change, expected", [
    (lambda s, p, sp, pp, lst: s["status"]["conditions"][2].update(status="False", reason="WaitingForStage"),
     "StagesReady=False (WaitingForStage"),
    (lambda s, p, sp, pp, lst: s["metadata"].update(generation=4), "status is for generation 3"),
    (lambda s, p, sp, pp, lst: s["status"].update(registeredReplicas=1), "registered 1, want 2"),
    (lambda s, p, sp, pp, lst: sp.pop(), "1/1 thinker pods Ready, want 2"),
    (lambda s, p, sp, pp, lst: lst["stages"]["0"].pop(), "lists 0 remote thinker replicas, want 1"),
    (lambda s, p, sp, pp, lst: s["status"]["stages"][1].update(registered=0), "status.stages {'id': 2"),
    (lambda s, p, sp, pp, lst: s["status"]["stages"].pop(), "status.stages has no entry for stage 2"),
    (lambda s, p, sp, pp, lst: p[0]["status"]["conditions"][0].update(status="False", reason="StageInTwoPools"),
     "pool speech Ready=False (StageInTwoPools"),
    (lambda s, p, sp, pp, lst: p[0]["spec"].update(replicas=2), "pool speech: replicas 1, ready 1, registered 1, want 2"),
    (lambda s, p, sp, pp, lst: pp["speech"][0]["status"]["conditions"][0].update(status="False"),
     "pool speech: 0/1 pods Ready"),
    (lambda s, p, sp, pp, lst: p[0]["status"]["members"][0]["replicaIds"].pop("2"), "want Joined for stages 1, 2"),
    (lambda s, p, sp, pp, lst: lst["stages"]["1"][0].update(state="left"),
     "lists stage 1 replicas at [], pool speech's pods are at ['127.77.2.5']"),
    (lambda s, p, sp, pp, lst: lst["stages"]["2"].append({"replicaId": 2, "host": "127.77.2.9", "state": "attached"}),
     "lists stage 2 replicas at ['127.77.2.5', '127.77.2.9']"),
])
def test_every_way_a_pipeline_is_not_converged_is_named(change, expected):
    found = _break(change)
    assert any(expected in f for f in found), found


def test_no_listing_is_a_problem_and_leaves_are_found():
    stage, pools, sp, pp, listing = _converged()
    assert "the head's membership listing did not answer" in ms.pipeline_problems(stage, pools, sp, pp, None)
    assert [m["replicaId"] for m in ms.live_members(listing, 0)] == [1]
    assert [m["replicaId"] for m in ms.live_members(listing, 2)] == [0]
    assert [m["replicaId"] for m in ms.left_members(listing, 2, "127.77.2.7")] == [1]
    assert ms.left_members(listing, 1, "127.77.2.7") == [] and ms.live_members(listing, 5) == []


def _wav(seconds: float = 0.5, rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(seconds * rate))
    return buf.getvalue()


def test_the_speech_request_asks_for_text_and_audio():
    body = ms.speech_request("Qwen/Qwen3-Omni-30B-A3B-Instruct", "Hello?")
    assert body["modalities"] == ["text", "audio"] and body["temperature"] == 0.0
    assert body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "Hello?"}]}]
    with_audio = ms.speech_request("m", "What is this?", max_tokens=8, temperature=0.7, audio_b64="UklGRg==")
    assert with_audio["messages"][0]["content"][0]["type"] == "input_audio" and with_audio["max_tokens"] == 8


def test_a_spoken_answer_is_parsed_from_one_choice_or_two():
    wav = _wav()
    audio = {"id": "audio-1", "data": base64.b64encode(wav).decode(), "expires_at": 0, "transcript": ""}
    merged = {"choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant", "content": "Paris.", "audio": audio}}]}
    speech = ms.parse_speech(merged)
    assert speech == ms.Speech("Paris.", wav, ("stop",)) and not speech.failed
    assert ms.wav_seconds(speech.audio) == pytest.approx(0.5)
    split = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "Paris."}},
                         {"index": 0, "finish_reason": "stop", "message": {"content": None, "audio": audio}}]}
    assert ms.parse_speech(split).text == "Paris." and ms.parse_speech(split).audio == wav
    error = {"choices": [{"index": 0, "finish_reason": "error", "message": {"content": ""}}]}
    assert ms.parse_speech(error).failed and ms.parse_speech(error).audio == b""
    assert ms.parse_speech({"choices": [{"message": {"audio": {"data": "not base64!"}}}]}).audio == b""
    assert ms.wav_seconds(b"RIFF, but not really") == 0.0 and ms.wav_seconds(_wav(0)) == 0.0


def test_text_differences_say_where_the_answers_part():
    assert ms.first_divergence("abc", "abc") is None
    assert ms.first_divergence("abc", "abd") == 2 and ms.first_divergence("ab", "abc") == 2
    ref = {"p1": "Paris is the capital.", "p2": "one two three"}
    assert ms.text_differences(ref, dict(ref)) == []
    found = ms.text_differences(ref, {"p1": "Paris is a capital."})
    assert len(found) == 2 and "differs at character 9" in found[0] and "no answer" in found[1]


def _o(start: float, end: float, ok: bool = True, detail: str = "") -> ms.Outcome:
    return ms.Outcome(start, end, ok, detail)


def test_load_verdict_allows_failures_only_for_a_leave_that_timed_out():
    oks = [_o(t, t + 5) for t in range(0, 100, 5)]
    assert ms.load_problems(oks, [(50, 70)], False, 4) == []
    during = [_o(55, 60, False, "finish_reason error"), _o(58, 66, False, "HTTP 500: stage replica disappeared")]
    # Drained (Left): nothing may fail, even while the replica left.
    assert "2 requests failed while a replica was leaving, at most 0" in ms.load_problems(oks + during, [(50, 70)],
                                                                                            False, 4)[0]
    # The drain timed out: the requests still bound to it may fail, at most one per client.
    assert ms.load_problems(oks + during, [(50, 70)], True, 4) == []
    assert ms.load_problems(oks + during * 3, [(50, 70)], True, 4) != []
    outside = ms.load_problems(oks + [_o(10, 20, False, "connection: reset")], [(50, 70)], True, 4)
    assert outside == ["1 requests failed outside a scale-down: connection: reset"]
    assert ms.load_problems([_o(0, 1, False, "x")], [], False, 1)[0] == "none of 1 requests succeeded"


def test_summary_of_a_run():
    assert ms.summary([]) == {"requests": 0, "failed": 0, "per_second": 0.0, "median_s": 0.0}
    run = [_o(0, 2), _o(0, 4), _o(1, 10), _o(2, 3, False)]
    assert ms.summary(run) == {"requests": 4, "failed": 1, "per_second": 0.3, "median_s": 4}


def test_what_a_pool_pod_shows():
    pod = {"spec": {"containers": [{"name": "sidecar"}, {
        "name": "engine", "command": ["python3", "-m", "omnistage_engine_patches.stages"],
        "args": ["--stage-id", "1", "--stage-id=2", "--", "vllm", "serve", "m", "--stage-id", "9",
                 "--stage-init-timeout", "1800", "--init-timeout=900"],
        "env": [{"name": "UCX_TLS", "value": "tcp,sm,self"}, {"name": "VLLM_ENGINE_READY_TIMEOUT_S", "value": "1800"}],
        "startupProbe": {"periodSeconds": 10, "failureThreshold": 180},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}],
        "volumes": [{"name": "shm", "hostPath": {"path": "/dev/shm/omnistage/ns/qwen3-omni", "type": "DirectoryOrCreate"}}]},
        "status": {"containerStatuses": [{"restartCount": 1}, {"restartCount": 2}]}}
    assert ms.engine_container(pod)["name"] == "engine"
    assert ms.stage_ids_of(ms.engine_container(pod)) == [1, 2]
    assert ms.shm_volume(pod)["hostPath"]["path"] == "/dev/shm/omnistage/ns/qwen3-omni"
    assert ms.shm_volume({"spec": {"containers": [{"name": "engine"}]}}) == {}
    assert ms.startup_timeouts(pod) == {"--stage-init-timeout": 1800.0, "--init-timeout": 900.0,
                                        "VLLM_ENGINE_READY_TIMEOUT_S": 1800.0, "startupProbe": 1800.0}
    assert ms.env_value(pod, "UCX_TLS") == "tcp,sm,self" and ms.env_value(pod, "UCX_NET_DEVICES") is None
    assert ms.restarts(pod) == 3


def test_nvidia_smi_df_and_log_lines_are_read():
    assert ms.parse_gpu_memory("0, 98304, 143771\nNo devices were found\n") == [(0, 98304.0, 143771.0)]
    assert ms.parse_gpu_memory("") == []
    df = "Filesystem     1K-blocks  Used Available Use% Mounted on\nshm             16777216  1024  16776192   1% /dev/shm\n"
    assert ms.parse_df_kib(df) == 16777216 and ms.parse_df_kib("df: /dev/shm: No such file") is None
    log = "INFO stage_id=1 initializing\nnoise\nINFO registered with the master as replica 0\nINFO NIXL agent up\n"
    assert ms.log_highlights(log) == ["INFO stage_id=1 initializing", "INFO registered with the master as replica 0",
                                      "INFO NIXL agent up"]


@pytest.mark.parametrize("mode", ["network", "sameNode"])
def test_the_readers_read_the_pods_the_operator_renders_for_the_sample(mode):
    """The helpers above against the operator's own renders of the speech sample, not hand-made pods."""
    docs = ms.speech_for_test(_speech_docs(), Settings.from_env(REQUESTED), "serving", mode=mode)
    t = target_from(docs[0], default_image="registry.example.com/omnistage-engine:dev")
    head = render_head_pod(t)
    pod = render_pool_pod(t, pools.parse(docs[1]), 1, "127.77.1.4", "head-uid")
    assert pod["metadata"]["name"] == "qwen3-omni-speech-1"
    assert ms.stage_ids_of(ms.engine_container(pod)) == [1, 2]
    assert ms.startup_timeouts(head)["--stage-init-timeout"] == ms.startup_timeouts(head)["startupProbe"] == 1800
    for p in (head, pod):
        shm = ms.shm_volume(p)
        if mode == "sameNode":
            assert shm["hostPath"] == {"path": "/dev/shm/omnistage/serving/qwen3-omni", "type": "DirectoryOrCreate"}
            assert ms.env_value(p, "UCX_TLS") is None
        else:
            assert "hostPath" not in shm and shm["emptyDir"]["medium"] == "Memory"
            assert ms.env_value(p, "UCX_TLS") == "tcp,sm,self"


class _Chat(http.server.BaseHTTPRequestHandler):
    """A stand-in head's /v1/chat/completions on 127.0.0.1: the prompt picks the answer."""

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"][-1]["text"]
        audio = {"data": base64.b64encode(_wav(0.2)).decode()}
        if prompt == "fail with 500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "stage replica disappeared"}')
            return
        choice = {"index": 0, "finish_reason": "stop", "message": {"content": f"echo: {prompt}", "audio": audio}}
        if prompt == "no audio":
            del choice["message"]["audio"]
        if prompt == "error":
            choice = {"index": 0, "finish_reason": "error", "message": {"content": ""}}
        out = json.dumps({"choices": [choice]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def chat_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_speech_client_against_a_stand_in_head(chat_server):
    from . import pipeline as pl

    ok, speech = pl.ask(chat_server, ms.speech_request("m", "hello"))
    assert ok.ok and speech.text == "echo: hello" and ms.wav_seconds(speech.audio) == pytest.approx(0.2)
    assert pl.ask(chat_server, ms.speech_request("m", "no audio"))[0].detail == "no audio (0 bytes)"
    assert pl.ask(chat_server, ms.speech_request("m", "error"))[0].detail == "finish_reason error"
    assert pl.ask(chat_server, ms.speech_request("m", "fail with 500"))[0].detail.startswith("HTTP 500: ")
    with pytest.raises(ValueError, match="only talks to its port-forward on 127.0.0.1"):
        pl.ask("http://qwen3-omni.serving.svc:8000", ms.speech_request("m", "hello"))  # a name: refused, never resolved
    answers, outcomes = pl.answers(chat_server, "m")
    assert list(answers) == list(ms.PROMPTS) and all(o.ok for o in outcomes)
    assert len(pl.burst(chat_server, "m", 2, per_client=2)) == 4
    with pl.Load(chat_server, "m", 2) as load:
        deadline = time.monotonic() + 10
        while load.ok() < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert load.ok() >= 4 and all(o.ok for o in load.outcomes)


def test_a_load_that_only_fails_stops_the_wait(chat_server):
    from . import pipeline as pl

    load = pl.Load(chat_server, "m", 2)
    load.outcomes.extend([ms.Outcome(0, 1, False, "connection: refused")] * 6)
    with pytest.raises(AssertionError, match="the last 6 requests failed: connection: refused"):
        load.reached(1)
    load.outcomes.append(ms.Outcome(1, 2, True))
    assert load.reached(1) and not load.reached(2)


def test_the_network_run_keeps_thinkers_and_speech_pods_on_different_nodes():
    from . import pipeline as pl

    s = Settings.from_env(REQUESTED)
    objects = ms.speech_for_test(_speech_docs(), s, "ns")
    assert pl._cross_node(objects, "qwen3-omni", {"a": 8, "b": 8})
    term = {"labelSelector": {"matchLabels": {"serving.omnistage.io/omnistage": "qwen3-omni",
                                              "serving.omnistage.io/role": "head"}},
            "topologyKey": "kubernetes.io/hostname"}
    assert objects[0]["spec"]["placement"]["affinity"] == {
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    assert objects[1]["spec"]["placement"]["affinity"] == {
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    validate_omnistage(objects[0])  # the operator accepts the placement
    assert not pl._cross_node(ms.speech_for_test(_speech_docs(), s, "ns"), "qwen3-omni", {"a": 8, "b": 0})
    assert not pl._cross_node(ms.speech_for_test(_speech_docs(), s, "ns"), "qwen3-omni", {"a": 1, "b": 1})
    assert not pl._cross_node(objects, "qwen3-omni", {"a": 8, "b": 8}), "the sample's own affinity stays"
