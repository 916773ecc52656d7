"""Issue 10 section 3: one slow head or a 30 s drain never delays another OmniStage.

The work queue (one pass per OmniStage at a time, a bounded pool across OmniStages), the drain
executor (a draining leave runs off the reconcile workers and is finished by a later pass), and
the removal of a deleted OmniStage's metric series."""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import replace

from omnistage.control.actions import DRAIN_DONE, DRAIN_FAILED, DRAIN_RUNNING, Annotate, StartLeave
from omnistage.runtime import act as act_module
from omnistage.runtime import metrics
from omnistage.runtime.act import act
from omnistage.runtime.drains import Drains
from omnistage.runtime.head_client import HeadClient, HeadUnreachable
from omnistage.runtime.workqueue import WorkQueue
from prometheus_client import REGISTRY

from tests.support.waits import wait_for

HEAD = HeadClient("127.0.0.1", 9, "token")


wait = functools.partial(wait_for, timeout=5.0, interval=0.01, say=None)


# ---- the work queue ------------------------------------------------------------------------------

def test_a_slow_omnistage_does_not_delay_another():
    release, done = threading.Event(), []

    def work(ns, name):
        if name == "slow":
            release.wait(10)  # a head that does not answer
        done.append(name)

    q = WorkQueue(work, workers=2)
    q.enqueue("ns", "slow")
    q.enqueue("ns", "fast")
    # Measured in work, not seconds (a loaded machine stretches any): 'fast' finished while 'slow'
    # still held its worker, so it waited for nothing of 'slow'.
    assert wait("'fast' in done", lambda: "fast" in done)
    assert "slow" not in done
    release.set()
    assert wait("'slow' in done", lambda: "slow" in done)


def test_one_omnistage_is_never_reconciled_twice_at_once_and_no_trigger_is_lost():
    running, overlaps, runs = set(), [], []
    gate = threading.Event()

    def work(ns, name):
        if name in running:
            overlaps.append(name)
        running.add(name)
        runs.append(name)
        gate.wait(5)
        running.discard(name)

    q = WorkQueue(work, workers=4)
    assert q.enqueue("ns", "a") is True
    assert wait("runs == ['a']", lambda: runs == ["a"])
    # Three triggers while it runs: one more pass afterwards, not three, and never in parallel.
    assert [q.enqueue("ns", "a") for _ in range(3)] == [False, False, False]
    gate.set()
    assert wait('len(runs) == 2 and q.pending() == 0', lambda: len(runs) == 2 and q.pending() == 0)
    time.sleep(0.1)
    assert runs == ["a", "a"] and overlaps == []


def test_a_failing_pass_does_not_stop_the_worker():
    runs = []

    def work(ns, name):
        runs.append(name)
        raise RuntimeError("API server said no")

    q = WorkQueue(work, workers=1)
    q.enqueue("ns", "a")
    assert wait("runs == ['a'] and q.pending() == 0", lambda: runs == ["a"] and q.pending() == 0)
    q.enqueue("ns", "b")
    assert wait("runs == ['a', 'b']", lambda: runs == ["a", "b"])


# ---- drains --------------------------------------------------------------------------------------

def test_a_30s_drain_does_not_block_the_reconcile_pass(monkeypatch):
    """The act step returns while the leave still drains; the leave runs on the drain pool, its end is
    recorded and the OmniStage queued again, and the next pass (tests/unit/test_plan.py) deletes the pod."""
    monkeypatch.setattr(act_module.kube, "patch_pod_annotations", lambda *a: None)
    drains, finished, events, release = Drains(workers=2), [], [], threading.Event()
    drains.on_done = lambda ns, name: finished.append((ns, name))
    calls, returned = [], []

    def slow_leave(client, replica_id, drain_seconds, stage=0, hold=False):
        calls.append((replica_id, drain_seconds))
        release.wait(10)  # stands in for the head draining for up to drain_seconds
        returned.append(replica_id)
        return {"drained": True}

    monkeypatch.setattr(act_module.head_client, "leave", slow_leave)
    leave = StartLeave("r-2", "uid-r2", ((0, 2),), 30)
    problems = act("ns", [Annotate("r-2", {"serving.omnistage.io/leaving": "ScaledDown"}), leave], HEAD,
                   lambda *e: events.append(e), "ost", drains=drains).problems
    # Not a time bound (a loaded machine stretches any): the leave cannot return before `release`, so
    # an act that had waited for it would come back after it returned.
    assert problems == [] and returned == [], "act waited for the drain to end"
    assert wait('calls == [(2, 30)]', lambda: calls == [(2, 30)])
    assert drains.states("ns", "ost") == {"uid-r2": DRAIN_RUNNING}
    # A second pass while it drains does not start a second leave.
    act("ns", [leave], HEAD, lambda *e: None, "ost", drains=drains)
    release.set()
    assert wait("the drain of uid-r2 DRAIN_DONE",
                lambda: drains.states("ns", "ost") == {"uid-r2": DRAIN_DONE})
    assert calls == [(2, 30)] and finished == [("ns", "ost")]
    assert events == [("Normal", "Left", "replica 2 (r-2) left the engine")]


def test_a_hold_runs_on_the_drain_pool_and_leaves_no_record_once_done(monkeypatch):
    """A standby's hold (StartLeave.hold): the head's hold path, off the reconcile worker; once it
    returned the record is dropped (the pod stays), and a failed one is recorded failed (the plan
    replaces that standby)."""
    drains, finished, events, calls = Drains(workers=1), [], [], []
    drains.on_done = lambda ns, name: finished.append((ns, name))

    def leave(client, replica_id, drain_seconds, stage=0, hold=False):
        calls.append((replica_id, hold))
        if replica_id == 3:
            raise HeadUnreachable("hold at head: timed out")
        return {"drained": True, "held": hold}

    monkeypatch.setattr(act_module.head_client, "leave", leave)
    hold = StartLeave("r-2", "uid-r2", ((0, 2),), 30, hold=True)
    act("ns", [hold], HEAD, lambda *e: events.append(e), "ost", drains=drains)
    assert wait("the hold returned", lambda: finished == [("ns", "ost")])
    assert calls == [(2, True)] and drains.states("ns", "ost") == {}
    assert events == [("Normal", "StandingBy", "replica 2 (r-2) stands by: held unroutable by the head")]
    act("ns", [replace(hold, pod="r-3", uid="uid-r3", leaves=((0, 3),))], HEAD, lambda *e: None, "ost",
        drains=drains)
    assert wait("the failed hold recorded", lambda: drains.states("ns", "ost") == {"uid-r3": "failed"})


def test_a_leave_the_head_cannot_take_is_recorded_failed(monkeypatch):
    drains, events = Drains(workers=1), []

    def unreachable(client, replica_id, drain_seconds, stage=0, hold=False):
        raise HeadUnreachable("leave at head: timed out")

    monkeypatch.setattr(act_module.head_client, "leave", unreachable)
    act(
        "ns",
        [StartLeave("r-2", "uid-r2", ((0, 2),), 30)],
        HEAD,
        lambda *e: events.append(e),
        "ost",
        drains=drains,
    )
    assert wait("the drain of uid-r2 DRAIN_FAILED",
                lambda: drains.states("ns", "ost") == {"uid-r2": DRAIN_FAILED})
    assert events[0][:2] == ("Warning", "LeaveFailed")


def test_a_pool_pods_stages_drain_side_by_side(monkeypatch):
    """A pool pod running stages 1 and 2: both leaves at once (the pod waits for the slower, not the
    sum), an Event for each, and the pod's drain DONE only when both returned."""
    drains, events, calls, both = Drains(workers=1), [], [], threading.Barrier(2, timeout=10)

    def leave(client, replica_id, drain_seconds, stage=0, hold=False):
        calls.append((stage, replica_id))
        both.wait()  # returns only when the other stage's leave runs at the same time
        return {"drained": True}

    monkeypatch.setattr(act_module.head_client, "leave", leave)
    act("ns", [StartLeave("speech-2", "uid-s2", ((1, 4), (2, 4)), 300)], HEAD, lambda *e: events.append(e),
        "ost", drains=drains)
    assert wait("the drain of uid-s2 DRAIN_DONE",
                lambda: drains.states("ns", "ost") == {"uid-s2": DRAIN_DONE})
    assert sorted(calls) == [(1, 4), (2, 4)]
    assert sorted(events) == [
        ("Normal", "Left", f"replica 4 of stage {k} (speech-2) left the engine") for k in (1, 2)
    ]


def test_many_slow_drains_leave_the_reconcile_workers_free(monkeypatch):
    """8 OmniStages each scaling down while their heads drain (2 drain workers, so 6 leaves wait in
    line): the passes of all of them finish while not one leave has returned."""
    release, returned = threading.Event(), []

    def slow_leave(client, replica_id, drain_seconds, stage=0, hold=False):
        release.wait(10)  # the head drains until the test ends
        returned.append(replica_id)
        return {"drained": True}

    monkeypatch.setattr(act_module.head_client, "leave", slow_leave)
    drains = Drains(workers=2)
    passes = []

    def work(ns, name):
        act(
            ns,
            [StartLeave(f"{name}-r", f"uid-{name}", ((0, 1),), 30)],
            HEAD,
            lambda *e: None,
            name,
            drains=drains,
        )
        passes.append(name)

    q = WorkQueue(work, workers=2)
    for i in range(8):
        q.enqueue("ns", f"ost-{i}")
    try:
        assert wait('len(passes) == 8', lambda: len(passes) == 8)
        # Counted, not timed: a pass that waited for a leave would finish only after that leave returned.
        assert returned == [], f"passes waited for {len(returned)} leaves"
    finally:
        release.set()


# ---- metrics -------------------------------------------------------------------------------------

def _series(name: str, namespace: str, ost: str) -> list:
    return [s for m in REGISTRY.collect() if m.name == name for s in m.samples
            if s.labels.get("namespace") == namespace and s.labels.get("name") == ost]


def test_series_of_a_deleted_omnistage_are_removed():
    ns, other = "metrics-ns", "kept"
    for ost in ("gone", other):
        metrics.RECONCILE_SECONDS.labels(ns, ost).observe(0.1)
        metrics.reconcile_failed(ns, ost, "ApiException")
        metrics.reconcile_failed(ns, ost, "TimeoutError")
        metrics.STATUS.observe(ns, ost, {"replicas": 2, "conditions": [{"type": "Ready", "status": "True"}]})
    for family in ("omnistage_reconcile_duration_seconds", "omnistage_reconcile_errors", "omnistage_replicas",
                   "omnistage_condition"):
        assert _series(family, ns, "gone"), f"negative control: no {family} series before the delete"
    metrics.forget(ns, "gone")
    for family in ("omnistage_reconcile_duration_seconds", "omnistage_reconcile_errors", "omnistage_replicas",
                   "omnistage_condition"):
        assert _series(family, ns, "gone") == [], f"{family} still has a series of the deleted OmniStage"
        assert _series(family, ns, other), f"{family} lost the series of an OmniStage that still exists"
    metrics.forget(ns, "gone")  # twice (a late pass after the last): harmless
    metrics.forget(ns, other)


def test_events_go_through_the_operators_client_and_a_refused_one_does_not_fail_the_pass(monkeypatch):
    """Events are created with the operator's own client (no kopf posting context needed: passes
    run before kopf's first handler); a refused Event (a terminating namespace) is logged, not raised."""
    from kubernetes.client.exceptions import ApiException
    from omnistage.runtime import handlers, kube

    posted = []

    class Core:
        def create_namespaced_event(self, namespace, body, _request_timeout=None):
            if body["reason"] == "Refused":
                raise ApiException(status=403, reason="Forbidden")
            posted.append((namespace, body))

    monkeypatch.setattr(kube, "core", Core)
    emit = handlers._emitter({"metadata": {"name": "ost", "namespace": "ns", "uid": "u"}})
    emit("Normal", "Joined", "replica pod r-1 joined")
    emit("Warning", "Refused", "not posted")  # must not raise
    [(namespace, body)] = posted
    assert namespace == "ns" and (body["type"], body["reason"], body["message"]) == (
        "Normal",
        "Joined",
        "replica pod r-1 joined",
    )
    assert body["involvedObject"] == {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStage",
                                      "name": "ost", "namespace": "ns", "uid": "u"}
    assert (
        body["source"] == {"component": "omnistage-operator"} and body["metadata"]["generateName"] == "ost."
    )


def test_watch_sets_the_namespaces_a_trigger_may_queue(monkeypatch):
    """`omnistage run -n 't-*'` reaches the handlers through watch(): a trigger elsewhere queues nothing."""
    from omnistage.runtime import handlers

    monkeypatch.setattr(handlers, "WATCHED_NAMESPACES", [])
    handlers.watch(["t-*", "prod"])
    assert handlers._watched("t-1") and handlers._watched("prod") and not handlers._watched("real-1")
    handlers.watch([])
    assert handlers._watched("real-1")  # no namespace given: all
