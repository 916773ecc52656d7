"""Capacity through disruptions (issue 19), on the local control plane with stand-in engines.

A replica pod is Ready only once the head routes to it (its readiness gate, set by the operator on
join; the stand-in runtime computes Ready from the gate as a kubelet does), a template change
surges (a replacement joins before an old replica drains), and a replica pod deleted by someone
else is drained within its grace. Each stand-in replica here "loads the model" for a few seconds
before it registers (tests.standin.replica.LOAD_KNOB), so a replica that is counted too early, or
a roll that does not wait for its replacement, shows.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest

from tests.cluster.test_operator import (
    NAME,
    READY_TIMEOUT,
    apply,
    engine_pods,
    get_stage,
    names,
    sample,
    wait_ready,
)
from tests.standin.harness import HeadEndpoint, remote_members, service_addresses, serving_at_head, stage0
from tests.standin.replica import LOAD_KNOB

pytestmark = pytest.mark.usefixtures("operator_log_on_failure")

JOINED = "serving.omnistage.io/joined"
LOAD_SECONDS = 6  # each stand-in replica registers this long after its process started


def _loading_sample(replicas: int, **changes: Any) -> dict[str, Any]:
    return sample(replicas=replicas, **{"engine.env": [{"name": LOAD_KNOB, "value": str(LOAD_SECONDS)}]}, **changes)


def _cond(pod: dict[str, Any], ctype: str) -> str | None:
    return next((c.get("status") for c in (pod.get("status") or {}).get("conditions") or []
                 if c.get("type") == ctype), None)


def _joined_at_head(listing: dict[str, Any] | None) -> set[str] | None:
    """The pods the head routes to; None when it did not answer (a busy head on a small machine)."""
    return None if listing is None else {m["pod"] for m in remote_members(listing) if m.get("pod")}


class Floor:
    """Samples the serving engines (harness.serving_at_head) and every replica pod's Ready while a
    disruption runs; each sample checks that a Ready replica pod is one the head routes to."""

    def __init__(self, kubectl, namespace: str, standin=None):
        self.kubectl, self.namespace, self.standin = kubectl, namespace, standin
        self.head = HeadEndpoint(kubectl, namespace, NAME)
        self.min_serving: int | None = None
        self.at_min: list[tuple] = []  # what the head listed at the lowest sample: a failure names it
        self.lies: list[str] = []
        self.unanswered = 0  # samples the head did not answer (not counted)

    def sample(self) -> int | None:
        """A lie is a pod whose Ready and joined condition say True while the head routes to it
        neither just before nor just after the pods were read (the operator clears the condition
        before a leave and sets it after a join, so one of the two listings agrees with an honest
        pod). Not counted: terminating pods (Kubernetes counts none as ready), and pods before the
        runtime took back kwok's start-up True."""
        # The uids the runtime took back, read before the pods: read after, a pod read with kwok's
        # start-up True would count as taken back once the runtime's patch lands a moment later.
        taken_back = {e["uid"] for e in list(self.standin.events) if e["action"] in ("ready", "notready")} \
            if self.standin else None
        first = self.head.listing()
        pods = engine_pods(self.kubectl, self.namespace, role="replica", include_terminating=True)
        last = self.head.listing()
        before, after = _joined_at_head(first), _joined_at_head(last)
        if before is None or after is None:
            self.unanswered += 1
            return None
        for p in pods:
            name, uid = p["metadata"]["name"], p["metadata"]["uid"]
            counted = (taken_back is None or uid in taken_back) and not p["metadata"].get("deletionTimestamp")
            if counted and _cond(p, JOINED) == "True" and _cond(p, "Ready") == "True" \
                    and name not in before and name not in after:
                seen = [(m.get("replicaId"), m.get("pod"), m.get("state"), m.get("coordinatorStatus"))
                        for lst in (first, last) for m in stage0(lst)]
                self.lies.append(f"{name} Ready (joined condition True) but not joined at the head; the head "
                                 f"listed (replica, pod, state, coordinator) {seen}")
        serving = min(serving_at_head(first), serving_at_head(last))
        if self.min_serving is None or serving < self.min_serving:
            self.min_serving = serving
            self.at_min = [(m.get("replicaId"), m.get("pod"), m.get("state"), m.get("coordinatorStatus"))
                           for lst in (first, last) for m in stage0(lst)]
        return serving


def test_a_replica_pod_is_ready_only_once_joined(kubectl, wait_for, namespace, operator, standin, tmp_path):
    """Fails on a replica pod that is Ready as soon as its container starts (no readiness gate)."""
    apply(kubectl, namespace, tmp_path, _loading_sample(2))
    floor = Floor(kubectl, namespace, standin)
    seen_loading = []

    def serving() -> Any:
        floor.sample()
        obj = get_stage(kubectl, namespace) or {}
        st = obj.get("status") or {}
        states = [m.get("state") for m in st.get("members") or []]
        if states and states[0] in ("Pending", "Joining"):
            seen_loading.append((states[0], st.get("readyReplicas")))
        return st.get("registeredReplicas") == 2 and st.get("readyReplicas") == 2

    wait_for("the replica loaded, joined and Ready", serving, timeout=READY_TIMEOUT, interval=0.5)
    assert floor.lies == [], floor.lies
    # While it loaded, the OmniStage counted at most the head as ready.
    assert seen_loading and all((ready or 0) <= 1 for _, ready in seen_loading), seen_loading
    replica = engine_pods(kubectl, namespace, role="replica")[0]
    assert _cond(replica, JOINED) == "True" and _cond(replica, "Ready") == "True"
    wait_ready(kubectl, wait_for, namespace, 2)


def test_pod_readiness_gate_is_the_operator_s_condition(kubectl, namespace, operator, tmp_path, wait_for):
    apply(kubectl, namespace, tmp_path, sample(replicas=2))
    wait_ready(kubectl, wait_for, namespace, 2)
    replica = engine_pods(kubectl, namespace, role="replica")[0]
    assert {"conditionType": JOINED} in replica["spec"]["readinessGates"]
    head = engine_pods(kubectl, namespace, role="head")[0]
    assert "readinessGates" not in head["spec"]
    print(json.dumps(replica["status"]["conditions"], indent=1))
    assert names([replica]) == {f"{NAME}-replica-1"}


def test_a_template_change_surges_and_serving_never_drops(kubectl, wait_for, namespace, operator, standin,
                                                          tmp_path):
    """A template change of the replica pods only (what an operator upgrade that renders replicas
    differently does; played here by rewriting their template hash) rolls them replacement first,
    each joined before an outdated replica drains: the head routes to spec.replicas replicas
    throughout. Fails on a roll that drains an outdated replica while its replacement loads."""
    apply(kubectl, namespace, tmp_path, _loading_sample(3))
    wait_ready(kubectl, wait_for, namespace, 3)
    before = {p["metadata"]["uid"] for p in engine_pods(kubectl, namespace, role="replica")}
    head_uid = engine_pods(kubectl, namespace, role="head")[0]["metadata"]["uid"]
    for p in engine_pods(kubectl, namespace, role="replica"):
        kubectl("annotate", "pod", p["metadata"]["name"], "-n", namespace, "--overwrite",
                "serving.omnistage.io/template-hash=previous-operator")
    floor = Floor(kubectl, namespace, standin)
    t0 = time.monotonic()

    def rolled() -> bool:
        floor.sample()
        now = engine_pods(kubectl, namespace, role="replica", include_terminating=True)
        return len(now) == 2 and not ({p["metadata"]["uid"] for p in now} & before)

    wait_for("every replica replaced", rolled, timeout=READY_TIMEOUT, interval=0.5)
    print(f"roll: {time.monotonic() - t0:.0f}s, serving floor {floor.min_serving}/3")
    assert floor.lies == [], floor.lies
    assert floor.min_serving == 3, f"serving fell to {floor.min_serving} of 3 during the roll: {floor.at_min}"
    obj = wait_ready(kubectl, wait_for, namespace, 3)
    assert engine_pods(kubectl, namespace, role="head")[0]["metadata"]["uid"] == head_uid
    rollout = next(c for c in obj["status"]["conditions"] if c["type"] == "RolloutSurge")
    assert rollout["status"] == "True" and rollout["reason"] == "NotRolling", rollout


def test_a_node_drain_evicts_replicas_one_at_a_time_through_the_budget(kubectl, wait_for, namespace, operator,
                                                                     standin, tmp_path):
    """kubectl drain of the node with the most replicas (the head's pod excluded by selector: it is in
    no budget) evicts them through the PodDisruptionBudget NAME-replicas: one at a time, the next
    only once a replacement joined, each drained (Event Disrupted, or its preStop hook). Fails without a budget: the
    drain evicts every replica of the node at once."""
    apply(kubectl, namespace, tmp_path, _loading_sample(4))
    wait_ready(kubectl, wait_for, namespace, 4)
    pdb = kubectl.json("get", "pdb", f"{NAME}-replicas", "-n", namespace)
    assert pdb["spec"]["minAvailable"] == 2, pdb["spec"]
    wait_for("the budget allows one disruption", lambda: kubectl.json(
        "get", "pdb", f"{NAME}-replicas", "-n", namespace)["status"].get("disruptionsAllowed") == 1, timeout=60)
    by_node: dict[str, int] = {}
    for p in engine_pods(kubectl, namespace, role="replica"):
        by_node[p["spec"]["nodeName"]] = by_node.get(p["spec"]["nodeName"], 0) + 1
    node = max(by_node, key=by_node.get)
    evicted = {p["metadata"]["uid"]: p["metadata"]["name"] for p in engine_pods(kubectl, namespace, role="replica")
               if p["spec"]["nodeName"] == node}
    print(f"replicas per node: {by_node}; draining {node}")
    floor = Floor(kubectl, namespace, standin)
    t0 = time.monotonic()
    drain = subprocess.Popen(
        [kubectl.binary, f"--kubeconfig={kubectl.kubeconfig}", "drain", node, "--ignore-daemonsets",
         "--delete-emptydir-data", f"--pod-selector=serving.omnistage.io/role=replica,serving.omnistage.io/omnistage={NAME}",
         "--timeout=240s"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while drain.poll() is None:
            floor.sample()
            time.sleep(0.5)
        out = drain.stdout.read()
        print(out)
        assert drain.returncode == 0, out
        wait_ready(kubectl, wait_for, namespace, 4)
    finally:
        kubectl("uncordon", node)
        if drain.poll() is None:
            drain.kill()
    print(f"drain of {node}: {time.monotonic() - t0:.0f}s, serving floor {floor.min_serving}/4")
    assert floor.lies == [], floor.lies
    assert floor.min_serving >= 3, f"serving fell to {floor.min_serving} of 4 during the drain: {floor.at_min}"
    assert "would violate" in out or by_node[node] == 1, "the budget never held an eviction back"
    # Each evicted replica drained: by the operator (Event Disrupted, when its pass saw the pod
    # Terminating) or by its preStop hook's leave (kwok removes an evicted pod at once, so the
    # operator may only see it gone; under a kubelet it stays Terminating: the kind tier's drain).
    disrupted = [e.get("message", "") for e in kubectl.json("get", "events", "-n", namespace)["items"]
                 if e.get("reason") == "Disrupted"]
    hooked = {e["uid"] for e in list(standin.events) if e["action"] == "prestopped" and e.get("code") == 0}
    undrained = [name for uid, name in evicted.items() if uid not in hooked and not any(name in m for m in disrupted)]
    assert not undrained, f"evicted without a drain: {undrained} (Disrupted: {disrupted})"


def _service_endpoints(kubectl, namespace: str) -> list[str]:
    return service_addresses(kubectl, namespace, NAME)


def test_a_head_change_moves_the_service_to_a_successor_without_an_outage(kubectl, wait_for, namespace, operator,
                                                                          standin, tmp_path):
    """A change that reaches the head (an env var of spec.engine) starts a successor head beside the
    serving one (NAME-head-<hash>); the Service NAME keeps a Ready endpoint throughout, moves to the
    successor once it serves, and the old head and its replicas drain and go; the new head's
    replicas follow. Fails on a head replaced in place (the code before issue 19 item 5): the
    Service has no Ready endpoint from the old head's deletion until the new head is Ready; and on a
    head behind the Service that answers while nothing serves behind it (its own engine not live, no
    replica joined yet): the serving floor counts the head's engine from its listing."""
    env = [{"name": LOAD_KNOB, "value": str(LOAD_SECONDS)}]
    apply(kubectl, namespace, tmp_path, sample(replicas=3, **{"engine.env": env}))
    wait_ready(kubectl, wait_for, namespace, 3)
    [old_head] = engine_pods(kubectl, namespace, role="head")
    old = {p["metadata"]["uid"] for p in engine_pods(kubectl, namespace)}
    endpoints_before = _service_endpoints(kubectl, namespace)
    assert endpoints_before == [old_head["status"]["podIP"]], endpoints_before
    head = HeadEndpoint(kubectl, namespace, NAME)
    fewest: dict[str, int | None] = {"endpoints": len(endpoints_before), "serving": None}
    seen: dict[str, float] = {}
    t0 = time.monotonic()
    apply(kubectl, namespace, tmp_path, sample(replicas=3, **{"engine.env": [*env, {"name": "GENERATION", "value": "2"}]}))

    def done() -> bool:
        eps = _service_endpoints(kubectl, namespace)
        fewest["endpoints"] = min(fewest["endpoints"], len(eps))
        serving = serving_at_head(head.listing())  # the head the Services select: the successor once they moved
        if serving is not None:
            fewest["serving"] = serving if fewest["serving"] is None else min(fewest["serving"], serving)
        now = engine_pods(kubectl, namespace, include_terminating=True)
        for p in now:
            role = p["metadata"]["labels"].get("serving.omnistage.io/role")
            if p["metadata"]["uid"] not in old and role in ("next-head", "head"):
                seen.setdefault(f"successor {role}", time.monotonic() - t0)
        if old_head["status"]["podIP"] not in eps and eps:
            seen.setdefault("Service moved", time.monotonic() - t0)
        return not ({p["metadata"]["uid"] for p in now} & old) and len(now) == 3

    wait_for("the old head and its replicas gone, three new engine pods", done, timeout=READY_TIMEOUT, interval=0.5)
    obj = wait_ready(kubectl, wait_for, namespace, 3)
    took = time.monotonic() - t0
    print(f"head change: {took:.0f}s, {seen}, fewest Ready endpoints of Service {NAME} {fewest['endpoints']}, "
          f"fewest serving behind it {fewest['serving']}/3")
    assert fewest["endpoints"] >= 1, "the Service had no Ready endpoint during the head change: an outage"
    assert fewest["serving"] is not None, "the head behind the Service never answered"
    assert fewest["serving"] >= 1, f"nothing served behind the Service at a sample: {fewest}"
    [new_head] = engine_pods(kubectl, namespace, role="head")
    assert new_head["metadata"]["name"].startswith(f"{NAME}-head-"), new_head["metadata"]["name"]
    assert obj["status"]["head"]["pod"] == new_head["metadata"]["name"]
    assert _service_endpoints(kubectl, namespace) == [new_head["status"]["podIP"]]
    assert {p["metadata"]["annotations"]["serving.omnistage.io/head-uid"]
            for p in engine_pods(kubectl, namespace, role="replica")} == {new_head["metadata"]["uid"]}
    reasons = [e.get("reason") for e in kubectl.json("get", "events", "-n", namespace)["items"]]
    assert {"SurgingHead", "MovedService", "RetiredHead"} <= set(reasons), reasons
    rollout = next(c for c in obj["status"]["conditions"] if c["type"] == "RolloutSurge")
    assert rollout["reason"] == "NotRolling", rollout
