"""A warm spare head (spec.head.standby, control/spare.py, issue 39 item 5) on the plan's table: kept
beside the serving head, it takes the Services when the head's engine dies (a container restart, a
deleted or failed pod) and never on a readiness blip; the replicas are re-attached to it, not rolled,
within the bound counted from the take-over; the dead head is the next spare, or a new one is made.
On the code before it, a head whose container restarted kept the Services through its reload, and a
deleted head's successor was a new pod (test_a_ready_spare_takes_over_when_the_head_restarted fails
there: no SetRole)."""

from __future__ import annotations

import pytest
from omnistage import names
from omnistage.api.validation import InvalidSpec, validate_omnistage
from omnistage.control import pods, reattach
from omnistage.control.actions import (
    Annotate,
    CreatePod,
    DeletePod,
    Join,
    MarkJoined,
    Observed,
    PostEvent,
    SetRole,
)
from omnistage.control.plan import plan
from omnistage.render import render_head_pod, target_from
from omnistage_engine_patches import contract

from .test_plan import (
    AT,
    head,
    listing,
    member,
    of,
    omnistage,
    ready_status,
    registered,
    replica,
    report,
    restarted,
)

SPARE_IP, SPARE_UID = "127.77.1.20", "spare-uid"


def spare(t, *, ready=True, role=names.ROLE_SPARE_HEAD, template="same", name=None):
    pod = render_head_pod(t, name or f"qwen3-omni-head-{pods.template_hash(render_head_pod(t))[:6]}", role)
    pod["metadata"].update(uid=SPARE_UID, creationTimestamp="2026-11-30T01:00:00Z")
    if template != "same":
        pod["metadata"]["annotations"][names.A_TEMPLATE_HASH] = "old"
    pod["spec"]["nodeName"] = "h200-9"
    pod["status"] = ready_status(SPARE_IP, ready)
    return pod


def dead_head(t):
    """The head after its container was killed: restarted once, its engine loading (not started)."""
    pod = restarted(head(t, ready=False))
    pod["status"]["containerStatuses"][0].update(started=False, state={"running": {}})
    return pod


def capable(t, i):
    pod = replica(t, i)
    pod["metadata"]["annotations"][names.A_REATTACH] = contract.APPLIED
    return pod


def observed(t, obj, h, spares=(), replicas=None, members=None, **kw):
    rs = tuple(replicas if replicas is not None else [capable(t, i) for i in range(1, t.spec.replicas)])
    talks = h is not None and pods.ready(h)
    ms = members if members is not None else [member(r, i) for i, r in enumerate(rs, 1)]
    o = {"obj": obj, "head": h, "replicas": rs, "spares": tuple(spares), "head_addressable": talks,
         "report": report(t) if talks else None, "listing": listing(*ms) if talks else None}
    return Observed(**{**o, **kw})


def with_spare(replicas=3, **spec):
    obj = omnistage(replicas, head={"standby": 1}, **spec)
    return obj, target_from(obj)


def roles(actions):
    return {a.name: a.role for a in of(actions, SetRole)}


def test_a_spare_is_created_beside_a_serving_head_and_is_outside_the_services():
    obj, t = with_spare()
    actions, status, _ = plan(t, observed(t, obj, head(t)), AT)
    [created] = of(actions, CreatePod)
    meta = created.obj["metadata"]
    assert meta["labels"][names.L_ROLE] == names.ROLE_SPARE_HEAD
    assert meta["name"] == f"qwen3-omni-head-{pods.template_hash(created.obj)[:6]}"
    assert pods.template_hash(created.obj) == pods.template_hash(render_head_pod(t))
    assert roles(actions) == {} and of(actions, DeletePod) == []
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert "CreatingSpareHead" in progressing["reason"]


def test_a_kept_spare_is_left_alone_and_said_in_status():
    obj, t = with_spare()
    actions, status, _ = plan(t, observed(t, obj, head(t), [spare(t)]), AT)
    assert of(actions, CreatePod) == [] and of(actions, DeletePod) == [] and roles(actions) == {}
    assert status["head"]["spare"] == spare(t)["metadata"]["name"] and status["head"]["spareReady"] is True


def test_a_ready_spare_takes_over_when_the_head_restarted():
    obj, t = with_spare()
    s, h = spare(t), dead_head(t)
    actions, status, _ = plan(t, observed(t, obj, h, [s]), AT)
    assert roles(actions) == {pods.name(s): names.ROLE_HEAD, "qwen3-omni-head": names.ROLE_SPARE_HEAD}
    # When it took over is written before the Services move (a pass that reads the new head reads it
    # too), and the spare turns head before the dead head leaves them (never no head).
    order = [(type(a).__name__, a.name) for a in actions if isinstance(a, SetRole | Annotate)]
    assert order == [("Annotate", pods.name(s)), ("SetRole", pods.name(s)), ("SetRole", "qwen3-omni-head")]
    assert [a.annotations for a in of(actions, Annotate) if a.name == pods.name(s)] == [
        {names.A_SERVING_SINCE: AT}]
    # Nothing is made or rolled: no new head, no new spare (the restarting head is the next), and the
    # replicas wait to re-attach to the spare, NotReady meanwhile, joined nowhere.
    assert of(actions, CreatePod) == [] and of(actions, DeletePod) == [] and of(actions, Join) == []
    assert {a.pod for a in of(actions, MarkJoined) if not a.joined} == {"qwen3-omni-replica-1",
                                                                          "qwen3-omni-replica-2"}
    [said] = [e for e in of(actions, PostEvent) if e.reason == "SpareTookOver"]
    assert "restartCount 1" in said.message and pods.name(s) in said.message
    assert status["head"]["pod"] == pods.name(s) and status["head"]["spare"] == "qwen3-omni-head"


def test_a_deleted_head_hands_over_and_a_new_spare_follows_once_it_is_gone():
    obj, t = with_spare()
    s, h = spare(t), head(t)
    h["metadata"]["deletionTimestamp"] = "2026-11-30T11:59:59Z"
    actions, _, _ = plan(t, observed(t, obj, h, [s]), AT)
    # Out of the Services even while it stops (two heads labelled head would read as a head change).
    assert roles(actions) == {pods.name(s): names.ROLE_HEAD, "qwen3-omni-head": names.ROLE_SPARE_HEAD}
    assert of(actions, CreatePod) == []
    # It went: the spare that took over serves, and a new spare takes the free name.
    new_head = spare(t, role=names.ROLE_HEAD)
    new_head["metadata"]["annotations"][names.A_SERVING_SINCE] = AT
    actions, _, _ = plan(t, observed(t, obj, new_head, replicas=[]), AT)
    assert [(c.obj["metadata"]["name"], c.obj["metadata"]["labels"][names.L_ROLE])
            for c in of(actions, CreatePod)
            if c.obj["metadata"]["labels"][names.L_ROLE] == names.ROLE_SPARE_HEAD] == [
        ("qwen3-omni-head", names.ROLE_SPARE_HEAD)]


@pytest.mark.parametrize("why", ["not ready, no restart", "spare loading", "spare outdated",
                                 "no spare wanted"])
def test_no_take_over_without_a_dead_head_and_a_ready_current_spare(why):
    obj, t = with_spare() if why != "no spare wanted" else (omnistage(3), target_from(omnistage(3)))
    h = head(t, ready=False) if why == "not ready, no restart" else dead_head(t)
    s = spare(t, ready=why != "spare loading", template="old" if why == "spare outdated" else "same")
    actions, _, _ = plan(t, observed(t, obj, h, [s]), AT)
    assert names.ROLE_HEAD not in roles(actions).values()
    assert not any(e.reason == "SpareTookOver" for e in of(actions, PostEvent))


def test_replicas_re_attach_to_a_spare_within_the_bound_counted_from_the_take_over():
    """The spare was Ready for hours before it took over: the bound runs from the take-over."""
    obj, t = with_spare()
    new_head = spare(t, role=names.ROLE_HEAD)  # Ready since long before AT (no lastTransitionTime: now)
    next(c for c in new_head["status"]["conditions"] if c["type"] == "Ready")["lastTransitionTime"] = \
        "2026-11-30T01:00:00Z"
    rs = [capable(t, 1), capable(t, 2)]  # bound to the dead head's uid
    new_head["metadata"]["annotations"][names.A_SERVING_SINCE] = "2026-11-30T11:59:30Z"
    actions, _, _ = plan(t, observed(t, obj, new_head, replicas=rs, members=[]), AT)
    assert of(actions, DeletePod) == []
    # Past the bound from the take-over, they are rolled as before.
    late = f"2026-11-30T11:{59 - reattach.REATTACH_SECONDS // 60}:00Z"
    new_head["metadata"]["annotations"][names.A_SERVING_SINCE] = late
    actions, _, _ = plan(t, observed(t, obj, new_head, replicas=rs, members=[]), AT)
    assert {a.name for a in of(actions, DeletePod)} == {"qwen3-omni-replica-1", "qwen3-omni-replica-2"}
    # A serving-since someone wrote that is no time counts for nothing, and raises nothing.
    new_head["metadata"]["annotations"][names.A_SERVING_SINCE] = "yesterday"
    plan(t, observed(t, obj, new_head, replicas=rs, members=[]), AT)


def test_a_replica_that_re_attached_to_the_spare_is_joined_without_a_new_pod():
    obj, t = with_spare()
    new_head = spare(t, role=names.ROLE_HEAD)
    new_head["metadata"]["annotations"][names.A_SERVING_SINCE] = "2026-11-30T11:59:50Z"
    rs = [capable(t, 1), capable(t, 2)]
    actions, _, _ = plan(t, observed(t, obj, new_head, replicas=rs, members=[registered(r, i + 4) for i, r in
                                                                             enumerate(rs, 1)]), AT)
    assert of(actions, DeletePod) == []
    assert {a.name for a in of(actions, Annotate) if a.annotations.get(names.A_HEAD_UID) == SPARE_UID} == {
        "qwen3-omni-replica-1", "qwen3-omni-replica-2"}
    assert {a.pod for a in of(actions, Join)} == {"qwen3-omni-replica-1", "qwen3-omni-replica-2"}


@pytest.mark.parametrize("obj, why", [
    (omnistage(3), "spec.head.standby is 0"),
    (omnistage(3, head={"standby": 1}, engine={"image": "vllm/vllm-omni:v0.31.0"}), "a head change runs"),
])
def test_an_unwanted_spare_is_deleted(obj, why):
    t = target_from(obj)
    h = head(t, template="old") if "head change" in why else head(t)
    s = spare(t, template="old" if "head change" in why else "same")
    actions, _, _ = plan(t, observed(t, obj, h, [s]), AT)
    [gone] = [a for a in of(actions, DeletePod) if a.name == pods.name(s)]
    assert why in gone.message


@pytest.mark.parametrize("spec, words", [
    ({"head": {"standby": 2}}, "less than or equal to 1"),
    ({"head": {"standby": 1}, "membership": "static"}, "spec.head.standby needs spec.membership dynamic"),
    ({"head": {"standby": 1}, "pipeline": "qwen3_omni_moe", "stages": [{"id": 1, "name": "talker"},
                                                                         {"id": 2, "name": "code2wav"}]},
     "spec.head.standby needs a single-stage pipeline"),
])
def test_spec_head_standby_is_0_or_1_and_needs_dynamic_membership(spec, words):
    assert validate_omnistage(omnistage(2, head={"standby": 1})).head.standby == 1
    with pytest.raises(InvalidSpec) as err:
        validate_omnistage(omnistage(2, **spec))
    [(field, message)] = err.value.problems
    assert field == "spec.head.standby" and words in message

