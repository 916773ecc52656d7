"""Engine liveness in the decision (issue 26): status, readiness gates, victims and Events follow
what the head lists as live (attached, heartbeats on time), never the pods alone.

Each test was checked against the code before the change: the status ones read Ready 3/3 there,
the scale-down one removed the only live engine, the detached one left the pod in place.
"""

from __future__ import annotations

from omnistage.api.conditions import EventReason, Reason, Type
from omnistage.control.actions import Annotate, DeletePod, MarkJoined, PostEvent, StartLeave
from omnistage.control.plan import plan
from omnistage_engine_patches import contract

from .test_plan import AT, HEAD_IP, cond, listing, member, of, replica, situation


def head_member(coordinator=contract.COORD_UP, state=contract.ATTACHED, **extra):
    return {"replicaId": 0, "local": True, "host": HEAD_IP, "state": state, "coordinatorStatus": coordinator,
            **extra}


def with_head(coordinator=contract.COORD_UP, state=contract.ATTACHED, members=(), **extra):
    lst = listing(*members)
    lst["stages"]["0"][0] = head_member(coordinator, state, **extra)
    return lst


def events(actions, reason):
    return [a for a in of(actions, PostEvent) if a.reason == reason]


def first_replica_silent():
    """The listing of situation(3) with replica-1's heartbeats late."""
    _, o = situation(3)
    rs = o.replicas
    return with_head(members=[member(rs[0], 1, coordinator=contract.COORD_SILENT), member(rs[1], 2)])


def test_a_silent_replica_is_not_counted_and_its_gate_is_cleared():
    t, o = situation(3, listing=first_replica_silent())
    actions, status, _ = plan(t, o, AT)
    assert status["readyReplicas"] == 2 and status["registeredReplicas"] == 2
    assert [m["state"] for m in status["members"]] == ["Silent", "Joined"]
    assert [(a.pod, a.joined) for a in of(actions, MarkJoined)] == [("qwen3-omni-replica-1", False)]
    assert of(actions, DeletePod) == [] and of(actions, StartLeave) == []  # kept: it may come back
    assert cond(status, Type.READY)["status"] == "False"
    assert len(events(actions, EventReason.ENGINE_SILENT)) == 1


def test_a_silent_replica_is_announced_once_and_its_return_too():
    silent = first_replica_silent()
    t, o = situation(3, listing=silent)
    _, status, _ = plan(t, o, AT)
    obj = {**o.obj, "status": status}
    t, o = situation(3, listing=silent, obj=obj)
    assert events(plan(t, o, AT).actions, EventReason.ENGINE_SILENT) == []  # said once
    t, o = situation(3, obj=obj)  # heartbeats resumed
    resumed = plan(t, o, AT)
    assert len(events(resumed.actions, EventReason.ENGINE_RESUMED)) == 1
    assert resumed.status["readyReplicas"] == 3


def test_a_head_whose_own_engine_is_silent_is_not_a_serving_replica():
    t, o = situation(3, listing=None)
    t, o = situation(
        3,
        listing=with_head(
            contract.COORD_SILENT,
            members=[member(r, i) for i, r in enumerate(o.replicas, 1)],
            silentSeconds=12.5,
        ),
    )
    actions, status, _ = plan(t, o, AT)
    assert status["readyReplicas"] == 2 and status["registeredReplicas"] == 2
    head_ready = cond(status, Type.HEAD_READY)
    assert (head_ready["status"], head_ready["reason"]) == ("False", Reason.HEAD_ENGINE_SILENT)
    assert "12.5s" in head_ready["message"]
    assert len(events(actions, Reason.HEAD_ENGINE_SILENT)) == 1
    assert cond(status, Type.READY)["status"] == "False"


def test_a_head_whose_own_engine_is_gone_says_so():
    t, o = situation(2, listing=None)
    t, o = situation(2, listing=with_head(contract.COORD_ABSENT, contract.PENDING,
                                          members=[member(r, i) for i, r in enumerate(o.replicas, 1)]))
    _, status, _ = plan(t, o, AT)
    head_ready = cond(status, Type.HEAD_READY)
    assert (head_ready["status"], head_ready["reason"]) == ("False", Reason.HEAD_ENGINE_GONE)
    assert status["readyReplicas"] == 1


def test_scale_down_never_removes_the_last_live_engine():
    """issue 26's demo: the head's engine was silent and `kubectl scale --replicas=1` removed replica-1,
    the only live engine. Now replica-1 stays, and the pass says why."""
    t, o = situation(2)
    lst = with_head(contract.COORD_SILENT, members=[member(r, i) for i, r in enumerate(o.replicas, 1)])
    t, o = situation(1, pods_=lambda t: [replica(t, 1)], listing=lst)
    actions, status, _ = plan(t, o, AT)
    assert of(actions, StartLeave) == [] and of(actions, DeletePod) == [] and of(actions, Annotate) == []
    synced = cond(status, Type.MEMBERSHIP_SYNCED)
    assert synced["reason"] == Reason.SCALE_DOWN_HELD and "qwen3-omni-replica-1" in synced["message"]
    assert len(events(actions, Reason.SCALE_DOWN_HELD)) == 1
    # The head's engine serves again: the scale-down goes on.
    t, o = situation(1, pods_=lambda t: [replica(t, 1)], listing=with_head(members=lst["stages"]["0"][1:]))
    assert [a.pod for a in of(plan(t, o, AT).actions, StartLeave)] == ["qwen3-omni-replica-1"]


def test_scale_down_takes_a_silent_replica_before_a_serving_one():
    t, o = situation(3)
    rs = o.replicas
    lst = with_head(members=[member(rs[0], 1, coordinator=contract.COORD_SILENT), member(rs[1], 2)])
    t, o = situation(2, pods_=lambda t: list(rs), listing=lst)
    actions, _, _ = plan(t, o, AT)
    assert [a.pod for a in of(actions, StartLeave)] == [
        "qwen3-omni-replica-1"
    ]  # not the newest, the silent one


def test_a_replica_the_head_detached_while_its_pod_lives_is_replaced():
    t, o = situation(3)
    rs = o.replicas
    lst = with_head(members=[member(rs[0], 1, state=contract.DETACHED, coordinator=contract.COORD_ABSENT),
                             member(rs[1], 2)])
    t, o = situation(3, listing=lst)
    actions, status, _ = plan(t, o, AT)
    # Told to leave (the head forgets it: LEFT), then deleted on the pass after; its successor follows.
    assert [(a.pod, a.leaves, a.drain_seconds) for a in of(actions, StartLeave)] == [
        ("qwen3-omni-replica-1", ((0, 1),), 0)]
    assert [m["state"] for m in status["members"]] == ["Leaving", "Joined"]
    assert status["readyReplicas"] == 2



# ---- rendering: the heartbeat timeout and the head's liveness --------------------------------------

def _head_container(**engine):
    from omnistage.render import render_head_pod, target_from

    from .test_plan import omnistage as obj_of
    obj = obj_of(2)
    obj["spec"].setdefault("engine", {}).update(engine)
    return render_head_pod(target_from(obj))["spec"]["containers"][0]


def test_the_heartbeat_timeout_is_rendered_on_the_head_and_defaults_to_vllm_omni_s():
    args = _head_container()["args"]
    assert args[args.index("--omni-heartbeat-timeout") + 1] == "30"
    args = _head_container(heartbeatTimeoutSeconds=10)["args"]
    assert args[args.index("--omni-heartbeat-timeout") + 1] == "10"


def test_a_heartbeat_timeout_out_of_range_is_refused_naming_the_field():
    import pytest
    from omnistage.api.validation import InvalidSpec
    from omnistage.render import target_from

    from .test_plan import omnistage as obj_of
    for bad in (0, 600):
        obj = obj_of(2)
        obj["spec"].setdefault("engine", {})["heartbeatTimeoutSeconds"] = bad
        with pytest.raises(InvalidSpec, match="heartbeatTimeoutSeconds"):
            target_from(obj)


def test_the_head_s_liveness_asks_whether_its_own_engine_lives():
    probe = _head_container()["livenessProbe"]
    assert probe == {"httpGet": {"path": contract.LIVE_PATH, "port": "http"}, "periodSeconds": 10,
                     "timeoutSeconds": 10, "failureThreshold": 3}


def test_an_old_registration_from_a_pod_s_address_never_replaces_it():
    """Pod IPs come back: a detached registration that was never joined, from the address a new pod
    now has, is another pod's. The new pod is left alone (it joins as itself)."""
    t, o = situation(3)
    rs = o.replicas
    old = {**member(rs[0], 1, state=contract.DETACHED, coordinator=contract.COORD_ABSENT), "pod": None}
    t, o = situation(3, listing=with_head(members=[old, member(rs[1], 2)]))
    actions, _, _ = plan(t, o, AT)
    assert of(actions, Annotate) == [] and of(actions, DeletePod) == []


def started_head(t, ready=False, started=True):
    """The head pod as the kubelet writes it once its startup probe passed, its readiness (/health)
    now failing: no live engine serves stage 0."""
    from .test_plan import head

    pod = head(t, ready=ready)
    pod["status"]["containerStatuses"] = [{"name": "engine", "restartCount": 0, "started": started,
                                           "state": {"running": {"startedAt": "2026-11-30T00:00:00Z"}}}]
    return pod


def test_a_started_head_that_is_not_ready_is_still_read():
    """A head whose only engine is silent is not Ready (/health 503: it cannot route), yet the operator
    reads it, says why, and can join a replica that would serve. Fails on reading only a Ready head:
    HeadReady said HeadPending and no join happened."""
    from omnistage.control import pods
    from omnistage.control.actions import Join

    from .test_plan import loading, registered

    t, o = situation(2, pods_=lambda t: [loading(t, 1)], listing=None)
    lst = with_head(contract.COORD_SILENT, silentSeconds=40.0, members=[registered(o.replicas[0], 1)])
    t, o = situation(2, pods_=lambda t: [loading(t, 1)], listing=lst, head=lambda t: started_head(t))
    assert pods.answers(o.head) and not pods.ready(o.head)
    actions, status, _ = plan(t, o, AT)
    head_ready = cond(status, Type.HEAD_READY)
    assert (head_ready["status"], head_ready["reason"]) == ("False", Reason.HEAD_ENGINE_SILENT)
    assert [a.pod for a in of(actions, Join)] == ["qwen3-omni-replica-1"]


def test_a_head_that_never_started_or_is_going_is_not_read():
    from omnistage.control import pods

    t, _ = situation(2)
    assert not pods.answers(started_head(t, started=False))
    going = started_head(t)
    going["metadata"]["deletionTimestamp"] = "2026-11-30T00:00:00Z"
    assert not pods.answers(going)
    assert pods.answers(started_head(t, ready=True, started=False))  # Ready answers, whatever `started` says
