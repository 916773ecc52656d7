"""What "converged" means on a GPU cluster, read the way a user reads it: kubectl for the OmniStage and
its pods, and the head's own membership listing through `kubectl port-forward` (127.0.0.1 only)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from omnistage.runtime import leader
from omnistage_engine_patches import contract

from tests.standin.harness import HeadEndpoint, converged
from tests.support.waits import wait_for


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


def stage_converged(kubectl: Any, stage: GpuOmniStage, replicas: int) -> dict[str, Any] | None:
    """harness.converged for a GPU stage: through its own ports, with the cache guarantee proven
    (CacheConsistent True), and a progress line while not there (its waits are minutes long)."""
    return converged(kubectl, stage.namespace, stage.name, replicas, head=head(kubectl, stage),
                     also=("CacheConsistent",), say="gpu")


# The GPU tier polls every 10 s: each poll runs kubectl and reads the head through a port-forward.
wait_gpu = functools.partial(wait_for, interval=10, say="gpu")
