"""What the cluster tiers' tests share besides fixtures: a test namespace on a cluster, and a
container's environment as its pod would have it, for an operator process run on this machine."""

from __future__ import annotations

import re
import uuid
from typing import Any

from tests.support.kubectl import Kubectl
from tests.support.waits import wait_for

# The ServiceAccount the install manifests use (manifests/base).
OPERATOR_SA = "omnistage-operator"
# The downward API's fields an operator run on this machine answers itself: its "pod IP" is loopback
# (the Deployment binds /metrics and the probes to $(POD_IP): OMNISTAGE_BIND_ADDRESS).
LOCAL_FIELDS = {"status.podIP": "127.0.0.1", "spec.serviceAccountName": OPERATOR_SA}


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as its pod would have it, for a process run here: values, the
    downward API fields of LOCAL_FIELDS, and $(VAR) expanded from earlier variables as the kubelet
    does. Other valueFrom entries are left out (POD_NAMESPACE, POD_NAME: the harness sets its own)."""
    out: dict[str, str] = {}
    for e in container.get("env") or []:
        field = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m[1], m[0]), e["value"])
        elif field in LOCAL_FIELDS:
            out[e["name"]] = LOCAL_FIELDS[field]
    return out


def create_test_namespace(kubectl: Kubectl, title: str) -> str:
    """A new namespace named after `title` (t-..., what the tests' operators watch), ready for pods."""
    stem = re.sub(r"[^a-z0-9-]+", "-", title.lower()).strip("-")[:40].strip("-")
    name = f"t-{stem}-{uuid.uuid4().hex[:5]}"
    kubectl("create", "namespace", name)
    kubectl("label", "namespace", name, "omnistage.io/test=true")
    # Pods are refused until the controller manager has created the namespace's default ServiceAccount.
    wait_for(f"default ServiceAccount in {name}", lambda: kubectl(
        "get", "serviceaccount", "default", "-n", name, check=False).returncode == 0, timeout=60)
    return name
