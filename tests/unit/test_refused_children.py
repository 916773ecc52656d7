"""Every pass ends in a condition (issue 27): a child the API server refuses is said in a Warning Event
naming it and the API's words (bounded) and in ReplicaFailure=True reason ChildRefused, while the
children after it are still applied; a pass that raises for any other reason leaves ReplicaFailure=True
reason PassFailed and a Warning Event saying why. Before, one refused child raised out of the pass:
nothing after it was applied and the only trace was a log line. No API server: kube is monkeypatched
(the cluster tier refuses a child through a ResourceQuota: tests/cluster/test_refusals.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from kubernetes.client.exceptions import ApiException
from omnistage.api.conditions import Reason, Type
from omnistage.control.actions import CreatePod, EnsureChild
from omnistage.control.plan import decision, plan, plan_with_report
from omnistage.runtime import act as act_module
from omnistage.runtime import reconcile as reconcile_module
from omnistage.runtime.act import API_MESSAGE_LIMIT, act
from omnistage.runtime.drift import Applied

from .test_plan import AT, cond, situation


def api_error(status: int, message: str) -> ApiException:
    err = ApiException(status=status, reason="Refused")
    err.body = json.dumps({"kind": "Status", "message": message})
    return err


def child(kind: str, name: str) -> dict:
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": "ns"}, "spec": {}}


CHILDREN = [child("ConfigMap", "o-config"), child("Service", "o"), child("Service", "o-master"),
            child("NetworkPolicy", "o-head-engine")]


@pytest.fixture
def cluster(monkeypatch):
    """drift.apply refuses whatever `refuse` names (name -> ApiException); records what it applied."""
    state = {"refuse": {}, "applied": []}

    def apply(obj, compare, existing):
        err = state["refuse"].get(obj["metadata"]["name"])
        if err is not None:
            raise err
        state["applied"].append(obj["metadata"]["name"])
        return Applied("created", obj)

    monkeypatch.setattr(act_module.drift, "apply", apply)
    monkeypatch.setattr(act_module.STATE, "wrote", lambda obj: None)
    return state


def test_a_refused_child_is_an_event_and_the_children_after_it_are_applied(cluster):
    long_words = "Service \"o-master\" is invalid: " + "spec.ports[0]: Invalid value " * 40
    cluster["refuse"]["o-master"] = api_error(422, long_words)
    events = []
    ensure = [EnsureChild(c, ("spec",), "ChildSynced") for c in CHILDREN]
    acted = act("ns", ensure, None, lambda *e: events.append(e), "o")
    assert cluster["applied"] == ["o-config", "o", "o-head-engine"]
    [why] = acted.refused
    assert why.startswith('Service o-master: 422 Service "o-master" is invalid') and why.endswith("...")
    assert len(why) < API_MESSAGE_LIMIT + 40  # the API's words are bounded
    warnings = [e for e in events if e[0] == "Warning"]
    assert warnings == [("Warning", Reason.CHILD_REFUSED, f"the API server refused {why}")]


@pytest.mark.parametrize("status", [404, 409, 403])
def test_any_api_error_of_a_child_is_recorded_not_raised(cluster, status):
    cluster["refuse"]["o"] = api_error(status, "namespaces \"ns\" not found" if status == 404 else "no")
    acted = act("ns", [EnsureChild(c, ("spec",), "ChildSynced") for c in CHILDREN], None,
                lambda *e: None, "o")
    assert [w.split(":")[0] for w in acted.refused] == ["Service o"] and len(cluster["applied"]) == 3


def test_a_terminating_namespace_still_stops_the_pass(cluster):
    err = api_error(403, "unable to create new content in namespace ns because it is being terminated")
    err.body += " being terminated"
    cluster["refuse"]["o-config"] = err
    with pytest.raises(ApiException):
        act("ns", [EnsureChild(c, ("spec",), "ChildSynced") for c in CHILDREN], None, lambda *e: None, "o")


def test_a_refused_pod_is_a_refused_child_too(monkeypatch, cluster):
    def create(obj):
        raise api_error(409, "object is being deleted: pods \"o-head\" already exists")
    monkeypatch.setattr(act_module.kube, "create", create)
    acted = act("ns", [CreatePod(child("Pod", "o-head"), "CreatedHead", "created {pod}"),
                       EnsureChild(CHILDREN[0], ("data",), "ConfigRendered")], None, lambda *e: None, "o")
    assert (
        acted.refused
        == acted.problems
        == ['Pod o-head: 409 object is being deleted: pods "o-head" already exists']
    )
    assert cluster["applied"] == ["o-config"]


def test_status_says_which_children_were_refused():
    refused = tuple(f"Service o-{i}: 403 exceeded quota: q, requested: services=1" for i in range(6))
    t, o = situation(3, refused=refused)
    _, status, _ = plan(t, o, AT)
    c = cond(status, Type.REPLICA_FAILURE)
    assert (c["status"], c["reason"]) == ("True", Reason.CHILD_REFUSED)
    assert c["message"].startswith("the API server refused Service o-0: 403 exceeded quota")
    assert c["message"].endswith("and 2 more children")
    # Once nothing is refused, the condition says so again.
    _, status, _ = plan(t, situation(3)[1], AT)
    assert cond(status, Type.REPLICA_FAILURE)["reason"] == Reason.NO_FAILURE


@pytest.mark.parametrize("problems, refused", [
    ((), ()),
    (("replica pod o-replica-1 has not joined yet: not registered",), ()),
    ((), ("Service o: 403 exceeded quota: q, requested: services=1",)),
    (("Pod o-replica-3: 403 forbidden",), ("Pod o-replica-3: 403 forbidden",)),
])
def test_a_pass_describes_its_own_decision_with_what_act_could_not_do(problems, refused):
    """reconcile describes a pass that wrote no pod with the decision it acted on, told act's report
    (plan.plan_with_report), instead of observing and deciding again: the same status a second plan said."""
    for t, o in (situation(3), situation(2, pods_=lambda t: []), situation(4)):
        assert plan_with_report(decision(t, o, AT), problems, refused) == plan(
            t, replace(o, problems=problems, refused=refused), AT)


class _Store:
    def __init__(self, obj):
        self.obj, self.written = obj, []
        self.omnistages = self

    def synced(self, timeout):
        return True

    def get(self, namespace, name):
        return self.obj

    def wrote(self, obj):
        self.written.append(obj)


def test_a_pass_that_raises_leaves_a_condition_and_an_event(monkeypatch):
    _, o = situation(3)
    obj = {**o.obj, "status": {"conditions": []}}
    store = _Store(obj)
    patched = []
    monkeypatch.setattr(reconcile_module, "STATE", store)
    monkeypatch.setattr(reconcile_module.kube, "patch_status",
                        lambda ns, name, status, previous: patched.append(status) or {"status": status})

    def broken(obj, emit):
        raise ValueError("replica-index annotation 'abc' is not a number" + "!" * 500)

    monkeypatch.setattr(reconcile_module, "_reconcile", broken)
    events = []
    with pytest.raises(ValueError):
        reconcile_module.reconcile("serving", obj["metadata"]["name"], lambda *e: events.append(e))
    [status] = patched
    c = cond(status, Type.REPLICA_FAILURE)
    assert (c["status"], c["reason"]) == ("True", Reason.PASS_FAILED)
    assert "ValueError: replica-index annotation 'abc' is not a number" in c["message"]
    assert len(c["message"]) < 400  # bounded
    [(etype, reason, message)] = events
    assert (etype, reason) == ("Warning", Reason.PASS_FAILED) and "is not a number" in message
