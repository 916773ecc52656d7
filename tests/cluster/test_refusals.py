"""Every pass ends in a condition (issue 27, item 4), on the real API server with the operator running:

* a spec whose deploy config would not fit in its ConfigMap (a 1.1 MB spec.engine.stageOverrides; the
  OmniStage itself may hold 1.5 MiB) is refused with ConfigRendered=False reason ConfigTooLarge and an
  Event, and what runs is not touched. Before, every pass failed on the ConfigMap's apply, silently;
* a child the API server refuses (here a ResourceQuota allowing one Service refuses the master Service)
  is said in ReplicaFailure=True reason ChildRefused and a Warning Event with the API's words, and the
  children after it (the NetworkPolicy, the PodDisruptionBudget, the head pod) are still applied.
  Before, the pass raised at the refused Service and nothing after it was ever applied.

Names the children could not carry are refused at admission: tests/cluster/test_api.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.status import condition

from .test_operator import NAME, apply, engine_pods, events, get_stage, sample

pytestmark = pytest.mark.usefixtures("operator_log_on_failure")


def _wait_condition(kubectl, wait_for, namespace: str, ctype: str, status: str, reason: str,
                    timeout: float = 90) -> dict:
    def check():
        c = condition(get_stage(kubectl, namespace), ctype)
        return c if (c.get("status"), c.get("reason")) == (status, reason) else None
    return wait_for(f"{ctype}={status} reason {reason}", check, timeout=timeout)


def test_a_config_too_large_for_its_configmap_is_refused_and_nothing_running_is_touched(
        kubectl, wait_for, namespace, tmp_path: Path):
    apply(kubectl, namespace, tmp_path, sample(replicas=1, membership="static"))
    wait_for("the head pod", lambda: engine_pods(kubectl, namespace), timeout=60)
    _wait_condition(kubectl, wait_for, namespace, "ConfigRendered", "True", "Rendered")
    head = engine_pods(kubectl, namespace)[0]["metadata"]["uid"]
    config = kubectl.json("get", "configmap", f"{NAME}-config", "-n", namespace)["metadata"]["resourceVersion"]

    patch = tmp_path / "big.json"  # a file: 1.1 MB is past what one command-line argument may hold
    patch.write_text(json.dumps({"spec": {"engine": {"stageOverrides": {"notes": "x" * 1_100_000}}}}))
    kubectl("patch", "omnistage", NAME, "-n", namespace, "--type=merge", "--patch-file", str(patch))

    c = _wait_condition(kubectl, wait_for, namespace, "ConfigRendered", "False", "ConfigTooLarge")
    print("ConfigRendered:", c)
    assert "spec.engine.stageOverrides" in c["message"] and "1,048,576 bytes" in c["message"], c
    assert condition(get_stage(kubectl, namespace), "Ready")["reason"] == "ConfigTooLarge"
    assert any(e.get("reason") == "ConfigTooLarge" and e.get("type") == "Warning"
               for e in events(kubectl, namespace)), "no Event says why"
    assert [p["metadata"]["uid"] for p in engine_pods(kubectl, namespace)] == [head]
    assert kubectl.json("get", "configmap", f"{NAME}-config", "-n", namespace)["metadata"][
        "resourceVersion"] == config


def test_a_refused_child_is_a_condition_and_an_event_and_the_others_are_applied(
        kubectl, wait_for, namespace, tmp_path: Path):
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "one-service"},
             "spec": {"hard": {"services": "1"}}}
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(quota))
    # The quota admits nothing until its controller has counted what the namespace holds.
    wait_for("the quota to be counted", lambda: kubectl.json("get", "resourcequota", "one-service", "-n", namespace)
             .get("status", {}).get("hard"), timeout=60)

    apply(kubectl, namespace, tmp_path, sample(replicas=1, membership="static"))
    c = _wait_condition(kubectl, wait_for, namespace, "ReplicaFailure", "True", "ChildRefused")
    print("ReplicaFailure:", c)
    assert f"Service {NAME}-master: 403" in c["message"] and "exceeded quota" in c["message"], c
    warned = [e for e in events(kubectl, namespace) if e.get("reason") == "ChildRefused"]
    assert warned and f"Service {NAME}-master" in warned[0]["message"], warned
    # The children after the refused one were applied all the same.
    for kind, name in (("service", NAME), ("networkpolicy", f"{NAME}-head-engine"),
                       ("poddisruptionbudget", f"{NAME}-replicas"), ("configmap", f"{NAME}-config")):
        kubectl("get", kind, name, "-n", namespace)
    assert engine_pods(kubectl, namespace), "no head pod: the pass stopped at the refused child"

    kubectl("delete", "resourcequota", "one-service", "-n", namespace)
    _wait_condition(kubectl, wait_for, namespace, "ReplicaFailure", "False", "NoFailure")
    kubectl("get", "service", f"{NAME}-master", "-n", namespace)
