"""Warm standbys (spec.standby, issue 30) on a real control plane, with the stand-in engines
(tests/standin: the real vllm-omni master server and coordinator with this project's membership
endpoint at the head, replicas registering through vllm-omni's own client code): a standby is
registered and held unjoined by the head, `kubectl scale` up joins it (the same pod: no new pod for
the first replica), a new standby refills, and a scale-down while the standbys are short makes the
head hold a joined replica as a standby (the same pod again). One OmniStage for the whole sequence:
each step starts from the state the last one left.

Timings are printed, never asserted. Network rule: only loopback is dialled.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.cluster.test_operator import NAME, READY_TIMEOUT, apply, describe, get_stage, sample
from tests.standin.harness import L_ROLE, HeadEndpoint, engine_pods, stage0
from tests.support import external_metrics
from tests.support.status import is_true

pytestmark = pytest.mark.usefixtures("operator_log_on_failure")


def _standby_line(obj: dict[str, Any] | None) -> str:
    st = (obj or {}).get("status") or {}
    return (f"{describe(obj)} standby={st.get('standbyReplicas')} "
            f"readyStandby={st.get('readyStandbyReplicas')}")


def _settled(kubectl, namespace: str, head: HeadEndpoint, replicas: int, standbys: int, last: dict[str, str]):
    """The OmniStage Ready with `replicas` serving (head included) and `standbys` standby pods one join
    away, the head agreeing: every replica pod joined under its name, every standby registered from its
    address, held and joined under no name. Returns (the OmniStage, the listing, the pods by role)."""
    obj = get_stage(kubectl, namespace)
    line = _standby_line(obj)
    if line != last.get("line"):
        print(f"    {NAME}: {line}", flush=True)
        last["line"] = line
    st = (obj or {}).get("status") or {}
    if not (obj and is_true(obj, "Ready") and st.get("observedGeneration") == obj["metadata"]["generation"]
            and st.get("replicas") == replicas and st.get("readyReplicas") == replicas
            and st.get("standbyReplicas") == standbys and st.get("readyStandbyReplicas") == standbys):
        return None
    by_role = {role: engine_pods(kubectl, namespace, NAME, role) for role in ("replica", "standby")}
    if len(by_role["replica"]) != replicas - 1 or len(by_role["standby"]) != standbys:
        return None
    listing = head.listing()
    remote = [m for m in stage0(listing) if not m.get("local") and m.get("state") not in ("left", "detached")]
    joined = {m.get("pod") for m in remote if m.get("pod")}
    held = {m.get("host") for m in remote if not m.get("pod") and m.get("held")}
    if joined != {p["metadata"]["name"] for p in by_role["replica"]}:
        return None
    if held != {(p.get("status") or {}).get("podIP") for p in by_role["standby"]}:
        return None
    return obj, listing, by_role


def test_a_standby_is_held_a_scale_up_joins_it_it_refills_and_a_scale_down_holds_a_replica(
        kubectl, wait_for, namespace, operator, standin, tmp_path):
    apply(kubectl, namespace, tmp_path, sample(replicas=2, standby=1))
    head = HeadEndpoint(kubectl, namespace, NAME)
    last: dict[str, str] = {}
    obj, listing, by_role = wait_for(
        "2 serving and 1 standby registered, held and unjoined",
        lambda: _settled(kubectl, namespace, head, 2, 1, last), timeout=READY_TIMEOUT, interval=1.0)
    [spare] = by_role["standby"]
    spare_name, spare_uid = spare["metadata"]["name"], spare["metadata"]["uid"]
    # Held by the head, in no serving count: not Ready (its joined gate False), not in status.replicas.
    assert not any(c["type"] == "Ready" and c["status"] == "True" for c in spare["status"].get("conditions", []))
    assert [m for m in obj["status"]["members"] if m.get("standby")] == [
        {"pod": spare_name, "ip": spare["status"]["podIP"], "replicaId": next(
            m["replicaId"] for m in stage0(listing) if m.get("host") == spare["status"]["podIP"]),
         "state": "Standby", "standby": True}]
    pdb = kubectl.json("get", "poddisruptionbudget", f"{NAME}-replicas", "-n", namespace)
    assert pdb["spec"]["selector"]["matchLabels"][L_ROLE] == "replica"
    print(f"standby {spare_name} held at the head; PDB selects role=replica only")

    started = time.monotonic()
    kubectl("scale", "omnistage", NAME, "-n", namespace, "--replicas=3")

    def standby_joined():
        pods = {p["metadata"]["uid"]: p for p in engine_pods(kubectl, namespace, NAME, "replica")}
        lst = head.listing()
        return spare_uid in pods and any(m.get("pod") == spare_name for m in stage0(lst)) and pods[spare_uid]

    joined_pod = wait_for(f"the standby {spare_name} to turn replica and be joined", standby_joined, timeout=60,
                          interval=0.2)
    joined_at = time.monotonic() - started
    assert joined_pod["metadata"]["name"] == spare_name  # the same pod: no new pod for the first replica
    obj, listing, by_role = wait_for(
        "3 serving and the standby refilled", lambda: _settled(kubectl, namespace, head, 3, 1, last),
        timeout=READY_TIMEOUT, interval=1.0)
    refilled_at = time.monotonic() - started
    [refill] = by_role["standby"]
    assert refill["metadata"]["uid"] != spare_uid
    reasons = {e.get("reason") for e in kubectl.json("get", "events", "-n", namespace)["items"]}
    assert {"JoinedStandby", "RefillingStandby"} <= reasons, sorted(reasons)
    print(f"kubectl scale 2 -> 3: standby {spare_name} joined at the head after {joined_at:.1f}s "
          f"(stand-in engines); a new standby {refill['metadata']['name']} one join away after {refilled_at:.1f}s")

    # Scale-down while the standbys are short (spec.standby 1 -> 2): a joined replica is held by the head,
    # not made to leave: the same pod, no new one, a standby one join away.
    victims = {p["metadata"]["uid"]: p["metadata"]["name"] for p in by_role["replica"]}
    started = time.monotonic()
    kubectl("patch", "omnistage", NAME, "-n", namespace, "--type", "merge", "-p",
            '{"spec": {"replicas": 2, "standby": 2}}')
    obj, listing, by_role = wait_for(
        "2 serving and 2 standbys, one of them the replica the scale-down held",
        lambda: _settled(kubectl, namespace, head, 2, 2, last), timeout=READY_TIMEOUT, interval=1.0)
    held_at = time.monotonic() - started
    kept = [p for p in by_role["standby"] if p["metadata"]["uid"] in victims]
    assert len(kept) == 1, "the scale-down kept a joined replica as a standby (the same pod)"
    ids = {p["metadata"]["uid"] for p in by_role["replica"] + by_role["standby"]}
    assert ids <= set(victims) | {refill["metadata"]["uid"]}, "no new pod: a hold, not a refill"
    reasons = {e.get("reason") for e in kubectl.json("get", "events", "-n", namespace)["items"]}
    assert {"KeptStandby", "StandingBy"} <= reasons, sorted(reasons)
    print(f"kubectl patch replicas 3 -> 2, standby 1 -> 2: replica {kept[0]['metadata']['name']} held as a standby "
          f"after {held_at:.1f}s (no pod created or deleted)")


def test_the_hpa_controller_scales_through_the_standby(kubectl, wait_for, namespace, operator, standin, tmp_path):
    """The local control plane's real HPA controller (kube-controller-manager) scales the OmniStage
    through its scale subresource on an external metric (tests/support/external_metrics.py: the
    metrics adapter, the one test-only part), and the scale-up it writes joins the standby: whoever
    scales, a standby joins first."""
    apply(kubectl, namespace, tmp_path, sample(replicas=1, standby=1))
    head = HeadEndpoint(kubectl, namespace, NAME)
    last: dict[str, str] = {}
    _, _, by_role = wait_for("1 serving and 1 standby held", lambda: _settled(kubectl, namespace, head, 1, 1, last),
                             timeout=READY_TIMEOUT, interval=1.0)
    [spare] = by_role["standby"]
    load = {"in_flight": 1.0}
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": NAME, "namespace": namespace},
           "spec": {"scaleTargetRef": {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStage",
                                       "name": NAME},
                    "minReplicas": 1, "maxReplicas": 2,
                    "metrics": [{"type": "External", "external": {
                        "metric": {"name": "omnistage_in_flight"},
                        "target": {"type": "AverageValue", "averageValue": "2"}}}]}}
    with external_metrics.serving(kubectl, namespace, tmp_path,
                                  lambda ns, metric: load["in_flight"] if ns == namespace else None) as asked:
        kubectl("apply", "-f", "-", input=json.dumps(hpa))
        wait_for("the HPA controller read the metric", lambda: asked, timeout=90, interval=0.5)
        load["in_flight"] = 4.0  # a burst: 4 in flight at 2 per replica wants 2 replicas
        started = time.monotonic()
        wait_for("the HPA wrote spec.replicas 2", lambda: get_stage(kubectl, namespace)["spec"]["replicas"] == 2,
                 timeout=90, interval=0.5)
        scaled_at = time.monotonic() - started
        wait_for(f"the standby {spare['metadata']['name']} joined", lambda: any(
            m.get("pod") == spare["metadata"]["name"] for m in stage0(head.listing())), timeout=60, interval=0.2)
        joined_at = time.monotonic() - started
        hpa_status = kubectl.json("get", "hpa", NAME, "-n", namespace)["status"]
        kubectl("delete", "hpa", NAME, "-n", namespace)
    assert hpa_status.get("desiredReplicas") == 2, hpa_status
    print(f"HPA on an external metric (4 in flight, 2 per replica): spec.replicas 2 after {scaled_at:.1f}s "
          f"(the controller's 15 s sync period), the standby joined after {joined_at:.1f}s")
