"""Names another OmniStage needs (issue 40 item 10), on the real API server with the operator running:
an OmniStage named NAME-master, created after NAME, would apply NAME's master Service as its own OpenAI
Service (selecting its own pods: NAME's replicas would register with the wrong head), and one named
NAME-replica-3 would create Secret NAME-replica-3-membership, the credential of NAME's third replica.
Each is refused on the newer object (Ready=False reason NameCollision, naming both, and a Warning
Event), writes no child, not even its membership Secret, and NAME's Service stays NAME's. Before, the
newer object's pass applied them. The decision's table: tests/unit/test_name_collisions.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.status import condition

from .test_operator import NAME, apply, engine_pods, events, get_stage, sample

pytestmark = pytest.mark.usefixtures("operator_log_on_failure")


def _refused(kubectl, wait_for, namespace: str, name: str) -> dict:
    def check():
        c = condition(get_stage(kubectl, namespace, name) or {}, "Ready")
        return c if (c.get("status"), c.get("reason")) == ("False", "NameCollision") else None
    return wait_for(f"{name} Ready=False reason NameCollision", check, timeout=90)


def _absent(kubectl, namespace: str, kind: str, name: str) -> bool:
    return kubectl("get", kind, name, "-n", namespace, check=False).returncode != 0


def test_the_newer_omnistage_of_a_colliding_name_is_refused_and_takes_nothing(
        kubectl, wait_for, namespace, tmp_path: Path):
    apply(kubectl, namespace, tmp_path, sample(replicas=1, membership="static"))
    wait_for(f"Service {NAME}-master", lambda: not _absent(kubectl, namespace, "service", f"{NAME}-master"),
             timeout=60)
    owner = get_stage(kubectl, namespace)["metadata"]["uid"]
    time.sleep(1.1)  # creation times have one-second resolution: the others are newer

    for other, shared in ((f"{NAME}-master", f"Service {NAME}-master"),
                          (f"{NAME}-replica-3", f"Secret {NAME}-replica-3-membership")):
        doc = sample(replicas=1, membership="static")
        doc["metadata"]["name"] = other
        apply(kubectl, namespace, tmp_path, doc)
        c = _refused(kubectl, wait_for, namespace, other)
        print(f"{other} Ready:", c)
        assert f"OmniStage {other} would write {shared}, which the older OmniStage {NAME} writes" in c["message"]
        assert condition(get_stage(kubectl, namespace, other), "ConfigRendered")["reason"] == "NameCollision"
        assert any(e.get("reason") == "NameCollision" and e.get("type") == "Warning"
                   and e["involvedObject"]["name"] == other for e in events(kubectl, namespace)), "no Event"
        # It wrote nothing: no pod, no ConfigMap, no membership Secret of its own.
        assert engine_pods(kubectl, namespace, other) == []
        assert _absent(kubectl, namespace, "configmap", f"{other}-config")
        assert _absent(kubectl, namespace, "secret", f"{other}-membership")

    # NAME's master Service is NAME's and selects NAME's head, and NAME still serves.
    service = kubectl.json("get", "service", f"{NAME}-master", "-n", namespace)
    assert [r["uid"] for r in service["metadata"]["ownerReferences"]] == [owner]
    assert service["spec"]["selector"]["serving.omnistage.io/omnistage"] == NAME
    assert condition(get_stage(kubectl, namespace), "ConfigRendered")["reason"] == "Rendered"
