"""A head change without an outage (control/headswap.py, issue 19 item 5), on the plan's table: a
successor head beside the serving one, its first replicas, the Services moved by the role labels,
the old set drained, and the in-place fallback said before it happens. On the code before it, every
head change deleted the serving head at once (test_a_head_change_starts_a_successor_and_keeps_the_head
fails there: the plan emitted DeletePod qwen3-omni-head)."""

from __future__ import annotations

from omnistage import names
from omnistage.api.conditions import Reason, Type
from omnistage.control import pods
from omnistage.control.actions import (
    BesideServing,
    CreatePod,
    DeletePod,
    Join,
    Observed,
    PostEvent,
    SetRole,
    StartLeave,
)
from omnistage.control.plan import plan
from omnistage.render import render_head_pod, render_replica_pod, target_from

from .test_plan import AT, HEAD_UID, cond, head, listing, member, of, omnistage, ready_status, replica, report

NEXT_IP, NEXT_UID = "127.77.1.10", "next-uid"


def successor(t, *, ready=True, role=names.ROLE_NEXT_HEAD, unschedulable=False):
    pod = render_head_pod(t, "qwen3-omni-head-abcdef", role)
    pod["metadata"].update(uid=NEXT_UID, creationTimestamp="2026-11-30T11:00:00Z")
    if unschedulable:
        pod["status"] = {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}
    else:
        pod["spec"]["nodeName"] = "h200-9"
        pod["status"] = ready_status(NEXT_IP, ready)
    return pod


def new_replica(t, i, **kw):
    """A replica bound to the successor."""
    pod = replica(t, i, head_uid=NEXT_UID, **kw)
    fresh = render_replica_pod(t, i, NEXT_IP, NEXT_UID)
    pod["spec"] = {**fresh["spec"], "nodeName": f"h200-{i}"}
    pod["metadata"]["annotations"][names.A_TEMPLATE_HASH] = pods.template_hash(fresh)
    return pod


def old_head(t, role=names.ROLE_HEAD, **kw):
    pod = head(t, template="old", **kw)
    pod["metadata"]["labels"][names.L_ROLE] = role
    return pod


def observed(t, obj, h, replicas=(), members=(), beside=None, drains=None):
    """One head and its replicas as a pass reads them: what a Ready head says (its own replica at its
    IP), `beside` the set beside the serving one during a head change (the successor's or the
    predecessor's)."""
    serves = h is not None and pods.ready(h)
    ls = listing(*members)
    if serves:
        ls["stages"]["0"][0]["host"] = pods.ip(h)
    return Observed(obj=obj, head=h, replicas=tuple(replicas), head_addressable=serves,
                    report=report(t) if serves else None, listing=ls if serves else None, beside=beside,
                    drains=drains or {})


def new_set(t, obj, beside, drains=None):
    """The successor as the head the Services select, with no replicas yet, beside `beside` (its
    predecessor's set)."""
    return observed(t, obj, successor(t, role=names.ROLE_HEAD), beside=beside, drains=drains)


def old_set(t, n=3):
    return [replica(t, i, template="old") for i in range(1, n)]


def inner(actions, kind):
    return [a for o in of(actions, BesideServing) for a in o.actions if isinstance(a, kind)]


def test_a_head_change_starts_a_successor_and_keeps_the_head():
    obj = omnistage(3)
    t = target_from(obj)
    rs = old_set(t)
    actions, status, _ = plan(
        t, observed(t, obj, old_head(t), rs, [member(r, i) for i, r in enumerate(rs, 1)]), AT
    )
    created = of(actions, CreatePod)
    assert [c.obj["metadata"]["name"] for c in created] == [
        f"qwen3-omni-head-{pods.template_hash(created[0].obj)[:6]}"
    ]
    assert created[0].obj["metadata"]["labels"][names.L_ROLE] == names.ROLE_NEXT_HEAD
    # The serving set is untouched: no head deleted, no replica drained or rolled.
    assert of(actions, DeletePod) == [] and of(actions, StartLeave) == []
    surge = cond(status, Type.ROLLOUT_SURGE)
    assert surge["status"] == "True" and "starting a successor beside qwen3-omni-head" in surge["message"]
    assert "SurgingHead" in cond(status, Type.PROGRESSING)["reason"]


def test_the_successor_gets_its_first_replicas_within_max_surge_and_the_services_wait_for_them():
    obj = omnistage(3, rollout={"maxSurge": 2})
    t = target_from(obj)
    rs = old_set(t)
    ms = [member(r, i) for i, r in enumerate(rs, 1)]
    o = observed(t, obj, old_head(t), rs, ms, beside=observed(t, obj, successor(t)))
    actions, status, _ = plan(t, o, AT)
    made = inner(actions, CreatePod)
    # maxSurge 2: the successor and one replica, bound to it, under a name the old set does not use.
    assert [c.obj["metadata"]["name"] for c in made] == ["qwen3-omni-replica-3"]
    assert made[0].obj["metadata"]["annotations"][names.A_HEAD_UID] == NEXT_UID
    assert NEXT_IP in made[0].obj["spec"]["containers"][0]["args"]
    assert of(actions, SetRole) == [] and of(actions, DeletePod) == []
    surge = cond(status, Type.ROLLOUT_SURGE)
    assert surge["status"] == "True" and "0/1 of its first replicas joined" in surge["message"]
    # That replica joined at the successor: the Services move, successor first.
    nr = new_replica(t, 3)
    o = observed(t, obj, old_head(t), rs, ms, beside=observed(t, obj, successor(t), [nr], [member(nr, 1)]))
    actions, _, _ = plan(t, o, AT)
    assert of(actions, SetRole) == [SetRole("qwen3-omni-head-abcdef", NEXT_UID, names.ROLE_HEAD),
                                    SetRole("qwen3-omni-head", HEAD_UID, names.ROLE_OLD_HEAD)]
    assert any(isinstance(a, PostEvent) and a.reason == "MovedService" for a in actions)


def test_a_successor_that_is_not_ready_moves_nothing_and_is_joined_to_by_nobody():
    obj = omnistage(3)
    t = target_from(obj)
    rs = old_set(t)
    o = observed(t, obj, old_head(t), rs, [member(r, i) for i, r in enumerate(rs, 1)],
                 beside=observed(t, obj, successor(t, ready=False)))
    actions, _, _ = plan(t, o, AT)
    assert of(actions, SetRole) == [] and of(actions, DeletePod) == [] and inner(actions, Join) == []
    # maxSurge 1 by default: the successor is the surge; its first replicas come after the move.
    assert inner(actions, CreatePod) == [] and of(actions, CreatePod) == []


def test_the_old_set_drains_all_at_once_and_the_new_set_grows_into_its_gpus():
    obj = omnistage(3)
    t = target_from(obj)
    old = old_head(t, names.ROLE_OLD_HEAD)
    rs = old_set(t)
    o = new_set(t, obj, observed(t, obj, old, rs, [member(r, i) for i, r in enumerate(rs, 1)]))
    actions, status, _ = plan(t, o, AT)
    leaves = inner(actions, StartLeave)
    assert sorted(a.pod for a in leaves) == ["qwen3-omni-replica-1", "qwen3-omni-replica-2"]
    assert {a.drain_seconds for a in leaves} == {t.spec.engine.drain_timeout_seconds}
    # 3 old pods still hold GPUs, maxSurge 1: 3 + 1 (new head) is the bound; no new replica yet.
    assert of(actions, CreatePod) == [] and of(actions, DeletePod) == []
    assert "moved to qwen3-omni-head-abcdef" in cond(status, Type.ROLLOUT_SURGE)["message"]
    # One old replica gone: one new replica, bound to the new head.
    o = new_set(t, obj, observed(t, obj, old, rs[1:], [member(rs[1], 2)]), drains={"uid-r2": "running"})
    actions, _, _ = plan(t, o, AT)
    made = of(actions, CreatePod)
    assert [c.obj["metadata"]["name"] for c in made] == ["qwen3-omni-replica-1"]
    assert made[0].obj["metadata"]["annotations"][names.A_HEAD_UID] == NEXT_UID
    # Every old replica gone: the old head is deleted (its preStop waits for what it accepted).
    o = new_set(t, obj, observed(t, obj, old))
    actions, _, _ = plan(t, o, AT)
    assert [(a.name, a.reason) for a in of(actions, DeletePod)] == [("qwen3-omni-head", "RetiredHead")]


def test_no_gpu_for_a_successor_head_says_so_then_replaces_the_head_in_place():
    obj = omnistage(3)
    t = target_from(obj)
    rs = old_set(t)
    ms = [member(r, i) for i, r in enumerate(rs, 1)]
    o = observed(t, obj, old_head(t), rs, ms, beside=observed(t, obj, successor(t, unschedulable=True)))
    actions, status, _ = plan(t, o, AT)
    assert of(actions, DeletePod) == []  # said first, in status and an Event
    surge = cond(status, Type.ROLLOUT_SURGE)
    assert (surge["status"], surge["reason"]) == ("False", Reason.NO_CAPACITY_FOR_SURGE)
    assert "Insufficient nvidia.com/gpu" in surge["message"] and "in place" in surge["message"]
    assert any(isinstance(a, PostEvent) and a.type == "Warning" for a in actions)
    # The next pass (the condition written): the old head goes; the pending successor gets its GPU.
    obj = {**obj, "status": status}
    o = observed(t, obj, old_head(t), rs, ms, beside=observed(t, obj, successor(t, unschedulable=True)))
    actions, _, _ = plan(t, o, AT)
    assert [a.name for a in of(actions, DeletePod)] == ["qwen3-omni-head"]


def test_max_surge_zero_replaces_the_head_in_place_after_saying_so():
    obj = omnistage(3, rollout={"maxSurge": 0, "maxUnavailable": 1})
    t = target_from(obj)
    rs = old_set(t)
    ms = [member(r, i) for i, r in enumerate(rs, 1)]
    actions, status, _ = plan(t, observed(t, obj, old_head(t), rs, ms), AT)
    assert of(actions, DeletePod) == [] and of(actions, CreatePod) == []
    surge = cond(status, Type.ROLLOUT_SURGE)
    assert (surge["status"], surge["reason"]) == ("False", Reason.HEAD_IN_PLACE) and "maxSurge is 0" in surge[
        "message"
    ]
    actions, status, _ = plan(t, observed(t, {**obj, "status": status}, old_head(t), rs, ms), AT)
    assert [a.name for a in of(actions, DeletePod)] == ["qwen3-omni-head"]
    assert "RollingHead" in cond(status, Type.PROGRESSING)["reason"]


def test_a_successor_whose_head_died_is_the_head_at_once():
    obj = omnistage(3)
    t = target_from(obj)
    gone = old_head(t)
    gone["metadata"]["deletionTimestamp"] = "2026-11-30T11:59:00Z"
    o = observed(t, obj, gone, [], [], beside=observed(t, obj, successor(t)))
    actions, _, _ = plan(t, o, AT)
    assert of(actions, SetRole) == [SetRole("qwen3-omni-head-abcdef", NEXT_UID, names.ROLE_HEAD)]
    assert of(actions, CreatePod) == []  # no NAME-head beside it
