"""What "converged" means on a GPU cluster, read the way a user reads it: kubectl for the OmniStage and
its pods, and the head's own membership listing through `kubectl port-forward` (127.0.0.1 only)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omnistage.runtime import leader
from omnistage_engine_patches import contract

from tests.standin.harness import HeadEndpoint, condition, engine_pods, is_true, pod_ready, remote_members


@dataclass
class GpuOmniStage:
    namespace: str
    name: str
    replicas: int  # spec.replicas as the tests leave it
    http_port: int  # spec.engine.httpPort
    gpus_per_pod: int
    created: bool  # False: OMNISTAGE_GPU_OMNISTAGE named one that was already there
    membership_port: int = contract.DEFAULT_MEMBERSHIP_PORT  # spec.engine.membershipPort


def head(kubectl: Any, stage: GpuOmniStage) -> HeadEndpoint:
    return HeadEndpoint(kubectl, stage.namespace, stage.name, http_port=stage.http_port,
                        membership_port=stage.membership_port)


def operator_leader(kubectl: Any, namespace: str) -> str | None:
    """The operator pod that holds the leader Lease in its namespace (the one that acts and exports the
    OmniStages' series; manifests/ run a second, idle one), or None."""
    proc = kubectl("get", "lease", leader.LEASE_NAME, "-n", namespace, "-o", "json", check=False)
    return json.loads(proc.stdout)["spec"].get("holderIdentity") if proc.returncode == 0 else None


def converged(kubectl: Any, stage: GpuOmniStage, replicas: int) -> dict[str, Any] | None:
    """The OmniStage when it is Ready for its current generation with `replicas` engine pods ready and
    registered, the cache guarantee proven, every replica Joined, and the head's own listing naming
    exactly those replicas; else None."""
    proc = kubectl("get", "omnistage", stage.name, "-n", stage.namespace, "-o", "json", check=False)
    if proc.returncode != 0:
        return None
    obj = json.loads(proc.stdout)
    st = obj.get("status") or {}
    pods = engine_pods(kubectl, stage.namespace, stage.name)
    if not (is_true(obj, "Ready") and is_true(obj, "CacheConsistent")
            and st.get("observedGeneration") == obj["metadata"]["generation"]
            and st.get("replicas") == st.get("registeredReplicas") == replicas
            and len(pods) == replicas and all(pod_ready(p) for p in pods)):
        print(f"[gpu]   {stage.name}: Ready={condition(obj, 'Ready').get('reason')} "
              f"ready {st.get('readyReplicas')}/{replicas} registered {st.get('registeredReplicas')} "
              f"CacheConsistent={condition(obj, 'CacheConsistent').get('reason')}", flush=True)
        return None
    members = {m.get("pod"): m.get("replicaId") for m in st.get("members") or []}
    if any(m.get("state") != "Joined" for m in st.get("members") or []) or len(members) != replicas - 1:
        return None
    listing = head(kubectl, stage).listing()
    at_head = {m.get("pod"): m.get("replicaId") for m in remote_members(listing)}
    return obj if listing is not None and at_head == members else None


def wait_for(description: str, predicate: Callable[[], Any], timeout: float, interval: float = 10) -> Any:
    """Poll until predicate() is truthy; prints progress; TimeoutError with the last value after `timeout`."""
    start = time.monotonic()
    print(f"[gpu] waiting for {description} (up to {timeout:.0f}s)", flush=True)
    while True:
        value = predicate()
        elapsed = time.monotonic() - start
        if value:
            print(f"[gpu] {description}: done after {elapsed:.0f}s", flush=True)
            return value
        if elapsed >= timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {description}; last value {value!r}")
        time.sleep(interval)
