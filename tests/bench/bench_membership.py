"""Membership benchmark on the local control plane: prints figures, asserts nothing.

  1. seconds from `kubectl scale omnistage --replicas=4` (from 2) until every new replica pod exists
     (and, for context, until the OmniStage is Ready with all four registered);
  2. seconds from `kubectl delete pod <replica>` until the engine head no longer routes to it (its
     entry in GET /omnistage/v1/membership?all=true is `left` after the operator's leave, or
     `detached` when the replica's own DOWN on SIGTERM came first; polled every 50 ms), and until
     the replacement has joined;
  3. seconds from kill -9 of a replica's engine process (no DOWN reaches the head) until the head
     records the operator's `leave` (the engine alone would wait for its 30 s heartbeat timeout).

It runs its own operator (`omnistage run`) and stand-in container runtime, both limited to a fresh
namespace, so a running `make demo` or test session is not disturbed. Usage (from the repo root):

  python tests/bench/bench_membership.py [--rounds 3] [--keep]

KUBECONFIG selects the cluster; without it the local control plane is used (started with
hack/cluster-up.sh if it is not running). Network rule: only loopback is dialled.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # runnable as a script: `python tests/bench/bench_membership.py`

from kubernetes import client, config, watch

from tests.standin.harness import (
    L_COMPONENT,
    L_OMNISTAGE,
    L_ROLE,
    HeadEndpoint,
    OperatorProcess,
    converged,
    left_at_head,
    stage0,
)
from tests.standin.runtime import StandinRuntime
from tests.support.kubectl import Kubectl, cached_binary
from tests.support.waits import wait_for

NAME = "qwen3-omni"
SAMPLE = ROOT / "manifests" / "samples" / "omnistage.yaml"
CLUSTER_DIR = Path(os.environ.get("OMNISTAGE_CLUSTER_DIR", "/tmp/omnistage-cluster"))
READY_TIMEOUT = 300.0


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# A bench polls every 50 ms: its figures are seconds measured by these waits.
wait = functools.partial(wait_for, timeout=READY_TIMEOUT, interval=0.05, say="bench")


class PodCreations:
    """Records when each pod of the namespace was first seen (watch), so creation times are not
    limited by how often kubectl can be polled."""

    def __init__(self, api: client.CoreV1Api, namespace: str):
        self.api, self.namespace = api, namespace
        self.first_seen: dict[str, float] = {}   # uid -> monotonic time
        self.pods: dict[str, dict[str, Any]] = {}  # uid -> {"name", "role", "deleted"}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        sel = f"{L_OMNISTAGE}={NAME},{L_COMPONENT}=engine"
        failures = 0
        while not self._stop.is_set() and failures < 20:  # bounded reconnects
            try:
                for ev in watch.Watch().stream(self.api.list_namespaced_pod, self.namespace, label_selector=sel,
                                               timeout_seconds=30):
                    pod = ev["object"]
                    uid = pod.metadata.uid
                    self.first_seen.setdefault(uid, time.monotonic())
                    self.pods[uid] = {"name": pod.metadata.name, "role": (pod.metadata.labels or {}).get(L_ROLE),
                                      "deleted": ev["type"] == "DELETED" or bool(pod.metadata.deletion_timestamp)}
                    if self._stop.is_set():
                        return
                failures = 0
            except Exception as err:  # noqa: BLE001 -- reconnect, bounded
                failures += 1
                log(f"pod watch failed ({failures}/20): {err}")
                time.sleep(1)

    def replicas(self) -> dict[str, dict[str, Any]]:
        return {u: p for u, p in self.pods.items() if p["role"] == "replica" and not p["deleted"]}


def out_of_routing(head: HeadEndpoint, replica_id: int) -> dict[str, Any] | None:
    """The head's entry for this replica once it is out of routing: left (leave) or detached (DOWN)."""
    return next((m for m in stage0(head.listing(include_all=True)) if m.get("replicaId") == replica_id
                 and str(m.get("state")).lower() in ("left", "detached")), None)


def ready(kubectl: Kubectl, namespace: str, n: int) -> dict[str, Any] | None:
    return converged(kubectl, namespace, NAME, n)


def kubectl_binary() -> str:
    found = cached_binary("kubectl", "OMNISTAGE_KUBECTL")
    if found is None:
        sys.exit("no cached Kubernetes binaries: run `make k8s-bins` (or set OMNISTAGE_KUBECTL)")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="leave the namespace (and its OmniStage) behind")
    args = ap.parse_args()

    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig:
        if subprocess.run(["bash", str(ROOT / "hack" / "cluster-up.sh"), "--check"], check=False,
                          timeout=60).returncode != 0:
            log("starting the local control plane (hack/cluster-up.sh)")
            subprocess.run(["bash", str(ROOT / "hack" / "cluster-up.sh")], check=True, timeout=1800,
                           stdout=subprocess.DEVNULL)
        kubeconfig = str(CLUSTER_DIR / "admin.kubeconfig")
    kubectl = Kubectl(kubectl_binary(), kubeconfig)
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=omnistage-bench",
            "-f", str(ROOT / "crds" / "omnistage.serving.omnistage.io.yaml"))
    kubectl("wait", "--for=condition=Established", "crd/omnistages.serving.omnistage.io", "--timeout=60s",
            timeout=70)

    ns = f"bench-{uuid.uuid4().hex[:6]}"
    state = Path(f"/tmp/omnistage-bench/{ns}")
    kubectl("create", "namespace", ns)
    wait("the default ServiceAccount", lambda: kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0,
         timeout=60, interval=0.5)
    api = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
    creations = PodCreations(api, ns)
    creations.start()
    runtime = StandinRuntime(kubeconfig=kubeconfig, namespaces=[ns], state_dir=state / "standin", quiet=True)
    operator = OperatorProcess(kubeconfig, state / "operator.log", namespaces=[ns])
    results: list[dict[str, float]] = []
    paths: list[str] = []
    try:
        runtime.start()
        operator.start()
        head = HeadEndpoint(kubectl, ns, NAME)
        log(f"namespace {ns}; operator log {operator.log_path}; engine logs {state / 'standin' / 'logs'}")
        kubectl("apply", "-n", ns, "-f", str(SAMPLE))
        t = time.monotonic()
        wait("the sample Ready with 2 registered", lambda: ready(kubectl, ns, 2), interval=0.2)
        log(f"sample Ready (2 replicas) after {time.monotonic() - t:.1f}s")

        for i in range(1, args.rounds + 1):
            r: dict[str, float] = {}
            before = set(creations.replicas())
            t0 = time.monotonic()
            kubectl("scale", "omnistage", NAME, "-n", ns, "--replicas=4")
            new = wait("3 replica pods", lambda b=before: len(creations.replicas()) == 3 and set(creations.replicas()) - b)
            r["scale_to_pods_created"] = max(creations.first_seen[u] for u in new) - t0
            wait("Ready with 4 registered", lambda: ready(kubectl, ns, 4), interval=0.1)
            r["scale_to_all_joined"] = time.monotonic() - t0

            # Graceful delete: the operator's leave races the replica's own DOWN (SIGTERM); either
            # takes it out of routing. The figure is until the head no longer routes to it.
            obj = ready(kubectl, ns, 4)
            victim = max(obj["status"]["members"], key=lambda m: m["pod"])
            t0 = time.monotonic()
            kubectl("delete", "pod", victim["pod"], "-n", ns, "--wait=false")
            rec = wait(f"the head to stop routing to replica {victim['replicaId']}",
                       lambda rid=victim["replicaId"]: out_of_routing(head, rid), timeout=60)
            r["delete_to_out_of_routing"] = time.monotonic() - t0
            paths.append("leave" if rec.get("state") == "left" else "DOWN")
            wait("the replacement joined", lambda: ready(kubectl, ns, 4), interval=0.1)
            r["delete_to_replacement_joined"] = time.monotonic() - t0

            # Hard kill (kill -9 of the engine, e.g. OOM): no DOWN, only the operator's leave beats the
            # engine's 30 s heartbeat timeout.
            obj = ready(kubectl, ns, 4)
            victim = max(obj["status"]["members"], key=lambda m: m["pod"])
            t0 = time.monotonic()
            runtime.kill(ns, victim["pod"])
            wait(f"the head's leave record for replica {victim['replicaId']}",
                 lambda rid=victim["replicaId"]: left_at_head(head.listing(include_all=True), rid), timeout=60)
            r["kill9_to_leave"] = time.monotonic() - t0
            wait("the replacement joined", lambda: ready(kubectl, ns, 4), interval=0.1)
            r["kill9_to_replacement_joined"] = time.monotonic() - t0

            t0 = time.monotonic()
            kubectl("scale", "omnistage", NAME, "-n", ns, "--replicas=2")
            wait("Ready with 2 registered", lambda: ready(kubectl, ns, 2), interval=0.1)
            r["scale_down_to_2_registered"] = time.monotonic() - t0
            results.append(r)
            log(f"round {i}: " + "  ".join(f"{k}={v:.2f}s" for k, v in r.items()))
    except BaseException:
        # What the engines' runtime and the operator did, for the reader of a failed run.
        for ev in runtime.events[-25:]:
            log(f"  runtime: {time.strftime('%H:%M:%S', time.localtime(ev['time']))} {ev['action']} {ev['pod']} "
                f"uid={ev['uid'][:8]} ip={ev['ip']} pid={ev['pid']}")
        log("events:\n" + kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False).stdout)
        raise
    finally:
        creations.stop()
        if not args.keep:
            # While the operator still runs, in case a finalizer ever comes back.
            kubectl("delete", "namespace", ns, "--wait=false", check=False)
            try:
                wait(f"namespace {ns} to be gone", lambda: kubectl("get", "namespace", ns, check=False).returncode,
                     timeout=120, interval=0.5)
            except TimeoutError:
                log(f"namespace {ns} is still terminating (operator finalizer?); see {operator.log_path}")
        operator.stop()
        runtime.stop()

    print()
    print(f"membership benchmark, {len(results)} round(s), local control plane + stand-in engine")
    print(f"{'figure':<32} {'median':>8} {'min':>8} {'max':>8}   (seconds)")
    for key in results[0] if results else []:
        vals = [r[key] for r in results]
        print(f"{key:<32} {statistics.median(vals):8.2f} {min(vals):8.2f} {max(vals):8.2f}")
    if paths:
        print(f"graceful deletes taken out of routing by: {', '.join(paths)} (leave = the operator's call, "
              f"DOWN = the replica's own on SIGTERM)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
