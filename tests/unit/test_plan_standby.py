"""Warm standbys (spec.standby, control/standby.py, issue 30) on the plan's table: a standby is created
and held unjoined, a scale-up joins it first and refills it, a scale-down keeps a replica as one (by
its label if it never joined, and the head's hold if it did: never a leave, which detaches for good),
extra standbys go without a drain, rollouts and head changes replace them first, a stalled standby is
replaced, and status, the disruption budget and the metrics count serving replicas apart from them.

On main's code every test here fails: spec.standby is an unknown field there (InvalidSpec), and
render_replica_pod takes no role."""

from __future__ import annotations

from dataclasses import replace

import pytest
from omnistage import names
from omnistage.api.conditions import Progress, Type
from omnistage.api.validation import InvalidSpec, validate_omnistage
from omnistage.control import pods
from omnistage.control.actions import (
    Annotate,
    CreatePod,
    DeletePod,
    Join,
    MarkJoined,
    Observed,
    PostEvent,
    RestoreLabels,
    SetRole,
    StartLeave,
)
from omnistage.control.identity import sort_out
from omnistage.control.plan import plan
from omnistage.render import render_disruption_budget, target_from
from omnistage.runtime import metrics
from omnistage_engine_patches import contract

from .test_headswap import inner, observed, old_head, old_set, successor
from .test_plan import (
    AT,
    changes,
    cond,
    head,
    listing,
    member,
    of,
    omnistage,
    registered,
    replica,
    report,
)


def standby(t, i, *, warm=True, template="same"):
    """A standby pod: its engine runs (ContainersReady), NotReady (its joined gate False)."""
    pod = replica(t, i, ready=False, containers=warm, joined=False, template=template)
    pod["metadata"]["labels"][names.L_ROLE] = names.ROLE_STANDBY
    return pod


def situation(replicas, standbys, pods_, members, **kw):
    obj = omnistage(replicas, standby=standbys, **kw)
    t = target_from(obj)
    rs = pods_(t)
    o = Observed(obj=obj, head=head(t), replicas=tuple(rs), head_addressable=True, report=report(t),
                 listing=listing(*members(rs)))
    return t, o


def roles(actions):
    return [(a.name, a.role) for a in of(actions, SetRole)]


def created(actions, made=None):
    """(name, role) of each pod created (`made`: the CreatePods, default the serving set's)."""
    made = of(actions, CreatePod) if made is None else made
    return [(c.obj["metadata"]["name"], c.obj["metadata"]["labels"][names.L_ROLE]) for c in made]


def events(actions, reason):
    return [e.message for e in of(actions, PostEvent) if e.reason == reason]


# ---- a standby is created, held unjoined, and counted apart ---------------------------------------

def test_a_missing_standby_is_created_as_a_standby():
    t, o = situation(2, 1, lambda t: [replica(t, 1)], lambda rs: [member(rs[0], 1)])
    actions, _, _ = plan(t, o, AT)
    assert created(actions) == [("qwen3-omni-replica-2", names.ROLE_STANDBY)]
    assert of(actions, CreatePod)[0].reason == Progress.REFILLING_STANDBY
    assert of(actions, Join) == [] and of(actions, StartLeave) == []


def test_a_registered_standby_is_not_joined_and_status_counts_it_apart():
    t, o = situation(2, 1, lambda t: [replica(t, 1), standby(t, 2)],
                     lambda rs: [member(rs[0], 1), registered(rs[1], 2)])
    actions, status, _ = plan(t, o, AT)
    assert changes(actions) == []  # at rest: no join, no MarkJoined True, nothing created
    assert status["replicas"] == 2 and status["readyReplicas"] == 2  # head + replica 1: not the standby
    assert status["standbyReplicas"] == 1 and status["readyStandbyReplicas"] == 1
    assert [(m["pod"], m["state"], m.get("standby")) for m in status["members"]] == [
        ("qwen3-omni-replica-1", "Joined", None), ("qwen3-omni-replica-2", "Standby", True)]
    # The standby's registration is held on purpose: membership is in sync, the OmniStage Ready.
    assert cond(status, Type.MEMBERSHIP_SYNCED)["status"] == "True"
    assert cond(status, Type.READY)["status"] == "True"


def test_a_loading_standby_is_pending_and_its_gate_stays_false():
    def pods_(t):
        s = standby(t, 2, warm=False)
        for c in s["status"]["conditions"]:
            if c["type"] == names.C_JOINED:
                c["status"] = "True"  # kwok's start-up word
        return [replica(t, 1), s]
    t, o = situation(2, 1, pods_, lambda rs: [member(rs[0], 1)])
    actions, status, _ = plan(t, o, AT)
    assert of(actions, MarkJoined) == [MarkJoined("qwen3-omni-replica-2", "uid-r2", False)]
    assert status["standbyReplicas"] == 1 and status["readyStandbyReplicas"] == 0
    assert status["members"][1]["state"] == "Pending"


# ---- scale-up: standbys first, a join only; then the refill ---------------------------------------

def test_scale_up_joins_a_standby_first_and_refills_it():
    t, o = situation(3, 1, lambda t: [replica(t, 1), standby(t, 2)],
                     lambda rs: [member(rs[0], 1), registered(rs[1], 2)])
    actions, status, _ = plan(t, o, AT)
    assert roles(actions) == [("qwen3-omni-replica-2", names.ROLE_REPLICA)]
    assert [(a.pod, a.ip, a.stages, a.mark) for a in of(actions, Join)] == [
        ("qwen3-omni-replica-2", pods.ip(o.replicas[1]), (0,), True)]  # marked joined when it lands
    # No new replica: the new capacity is the standby. One new pod refills the standby count.
    assert created(actions) == [("qwen3-omni-replica-3", names.ROLE_STANDBY)]
    assert events(actions, Progress.JOINED_STANDBY)
    assert {Progress.JOINED_STANDBY, Progress.REFILLING_STANDBY} <= set(
        cond(status, Type.PROGRESSING)["reason"].split(","))
    # The label moves before the join: the relabelled pod is joined in this very pass.
    kinds = [type(a) for a in actions if isinstance(a, SetRole | Join)]
    assert kinds == [SetRole, Join]


def test_scale_up_beyond_the_standbys_creates_replicas_then_standbys():
    t, o = situation(4, 1, lambda t: [replica(t, 1), standby(t, 2)],
                     lambda rs: [member(rs[0], 1), registered(rs[1], 2)])
    actions, _, _ = plan(t, o, AT)
    assert roles(actions) == [("qwen3-omni-replica-2", names.ROLE_REPLICA)]
    assert created(actions) == [("qwen3-omni-replica-3", names.ROLE_REPLICA),
                                ("qwen3-omni-replica-4", names.ROLE_STANDBY)]


def test_scale_up_joins_the_warm_standby_before_a_loading_one():
    t, o = situation(3, 2, lambda t: [replica(t, 1), standby(t, 2, warm=False), standby(t, 3)],
                     lambda rs: [member(rs[0], 1), registered(rs[2], 3)])
    actions, _, _ = plan(t, o, AT)
    assert roles(actions) == [("qwen3-omni-replica-3", names.ROLE_REPLICA)]
    assert [j.pod for j in of(actions, Join)] == ["qwen3-omni-replica-3"]


# ---- scale-down: a replica is kept as a standby (held if it joined) while the standbys are short ---

def test_scale_down_keeps_a_replica_that_never_joined_as_a_standby():
    def pods_(t):
        loading = replica(t, 3, ready=False, containers=True, joined=False)
        return [replica(t, 1), replica(t, 2), loading]
    t, o = situation(3, 1, pods_, lambda rs: [member(rs[0], 1), member(rs[1], 2), registered(rs[2], 3)])
    actions, status, _ = plan(t, o, AT)
    assert roles(actions) == [("qwen3-omni-replica-3", names.ROLE_STANDBY)]
    assert of(actions, StartLeave) == [] and of(actions, Annotate) == [] and of(actions, CreatePod) == []
    assert events(actions, Progress.KEPT_STANDBY)
    assert status["standbyReplicas"] == 1


def test_scale_down_holds_a_joined_replica_as_a_standby():
    """Standbys short: the joined victim is relabelled, NotReady, and the head holds it (drained,
    attached, unroutable): no leave, no deletion, no new pod."""
    t, o = situation(2, 1, lambda t: [replica(t, 1), replica(t, 2)],
                     lambda rs: [member(rs[0], 1), member(rs[1], 2)])
    actions, status, _ = plan(t, o, AT)
    assert roles(actions) == [("qwen3-omni-replica-2", names.ROLE_STANDBY)]
    assert [(a.pod, a.leaves, a.drain_seconds, a.hold) for a in of(actions, StartLeave)] == [
        ("qwen3-omni-replica-2", ((0, 2),), t.spec.engine.drain_timeout_seconds, True)]
    assert MarkJoined("qwen3-omni-replica-2", "uid-r2", False) in of(actions, MarkJoined)
    assert of(actions, DeletePod) == [] and of(actions, CreatePod) == [] and of(actions, Annotate) == []
    assert "drained and held unroutable by the head" in events(actions, Progress.KEPT_STANDBY)[0]
    assert status["replicas"] == 2 and status["standbyReplicas"] == 1
    # Its hold is under way: not one join away yet.
    assert status["readyStandbyReplicas"] == 0


def test_a_standby_the_head_routes_to_is_held_again_and_once_held_it_stands_by():
    """A standby still joined under its name (an operator restart cut its hold short, or a pod
    relabelled by hand) is held; while the hold runs nothing more; once the head holds it, at rest."""
    def joined_standby(t):
        return [replica(t, 1), standby(t, 2)]
    t, o = situation(2, 1, joined_standby, lambda rs: [member(rs[0], 1), member(rs[1], 2)])
    actions, _, _ = plan(t, o, AT)
    assert [(a.pod, a.hold) for a in of(actions, StartLeave)] == [("qwen3-omni-replica-2", True)]
    assert of(actions, Join) == [] and of(actions, DeletePod) == []
    running = replace(o, drains={"uid-r2": "running"})
    assert of(plan(t, running, AT)[0], StartLeave) == []
    t, o = situation(2, 1, joined_standby, lambda rs: [member(rs[0], 1), registered(rs[1], 2)])
    actions, status, _ = plan(t, o, AT)
    assert changes(actions) == [] and status["readyStandbyReplicas"] == 1


def test_a_standby_whose_hold_failed_is_replaced():
    t, o = situation(2, 1, lambda t: [replica(t, 1), standby(t, 2)],
                     lambda rs: [member(rs[0], 1), member(rs[1], 2)])
    failed = replace(o, drains={"uid-r2": "failed"})
    actions, _, _ = plan(t, failed, AT)
    assert [(d.name, d.reason) for d in of(actions, DeletePod)] == [
        ("qwen3-omni-replica-2", Progress.REPLACED_REPLICA)]
    assert any("its hold failed" in e for e in events(actions, Progress.REPLACED_REPLICA))


def test_scale_down_with_the_standbys_full_drains_and_deletes():
    """Beyond spec.standby a scale-down makes the replica leave, as without standbys."""
    t, o = situation(2, 1, lambda t: [replica(t, 1), replica(t, 2), standby(t, 3)],
                     lambda rs: [member(rs[0], 1), member(rs[1], 2), registered(rs[2], 3)])
    actions, _, _ = plan(t, o, AT)
    assert [(a.pod, a.hold) for a in of(actions, StartLeave)] == [("qwen3-omni-replica-2", False)]
    assert roles(actions) == [] and of(actions, CreatePod) == []


def test_a_silent_victim_is_not_kept_as_a_standby():
    t, o = situation(2, 1, lambda t: [replica(t, 1), replica(t, 2)],
                     lambda rs: [member(rs[0], 1), member(rs[1], 2, coordinator=contract.COORD_SILENT)])
    actions, _, _ = plan(t, o, AT)
    assert roles(actions) == []
    assert [(a.pod, a.hold) for a in of(actions, StartLeave)] == [("qwen3-omni-replica-2", False)]


# ---- too many standbys: they go without a drain ----------------------------------------------------

def test_extra_standbys_leave_without_a_drain_the_coldest_first():
    t, o = situation(2, 1, lambda t: [replica(t, 1), standby(t, 2), standby(t, 3, warm=False)],
                     lambda rs: [member(rs[0], 1), registered(rs[1], 2)])
    actions, status, _ = plan(t, o, AT)
    # The loading one is not registered: nothing to tell the head, it is deleted at once.
    assert [(d.name, d.reason) for d in of(actions, DeletePod)] == [
        ("qwen3-omni-replica-3", Progress.STANDBY_SCALED_DOWN)]
    assert "deleted standby pod qwen3-omni-replica-3: spec.standby is 1" in of(actions, DeletePod)[0].message
    assert of(actions, StartLeave) == [] and of(actions, CreatePod) == []
    assert status["standbyReplicas"] == 1


def test_standby_zero_tells_the_head_then_deletes_with_no_drain():
    t, o = situation(2, 0, lambda t: [replica(t, 1), standby(t, 2)],
                     lambda rs: [member(rs[0], 1), registered(rs[1], 2)])
    actions, _, _ = plan(t, o, AT)
    assert [(a.pod, a.leaves, a.drain_seconds) for a in of(actions, StartLeave)] == [
        ("qwen3-omni-replica-2", ((0, 2),), 0)]
    assert Annotate("qwen3-omni-replica-2", {names.A_LEAVING: Progress.STANDBY_SCALED_DOWN}) in of(
        actions, Annotate)


# ---- rollouts and head changes ---------------------------------------------------------------------

def test_a_rollout_replaces_standbys_first():
    t, o = situation(2, 1, lambda t: [replica(t, 1, template="old"), standby(t, 2, template="old")],
                     lambda rs: [member(rs[0], 1), registered(rs[1], 2)])
    actions, _, _ = plan(t, o, AT)
    # The outdated standby leaves at once (no drain); the only serving replica waits for its replacement.
    assert [(a.pod, a.drain_seconds) for a in of(actions, StartLeave)] == [("qwen3-omni-replica-2", 0)]
    assert created(actions) == [("qwen3-omni-replica-3", names.ROLE_REPLICA),
                                ("qwen3-omni-replica-4", names.ROLE_STANDBY)]


def test_a_rollout_joins_a_current_standby_as_its_surge_replacement():
    t, o = situation(2, 1, lambda t: [replica(t, 1, template="old"), standby(t, 2)],
                     lambda rs: [member(rs[0], 1), registered(rs[1], 2)])
    actions, _, _ = plan(t, o, AT)
    assert roles(actions) == [("qwen3-omni-replica-2", names.ROLE_REPLICA)]
    assert [j.pod for j in of(actions, Join)] == ["qwen3-omni-replica-2"]
    assert created(actions) == [("qwen3-omni-replica-3", names.ROLE_STANDBY)]
    assert of(actions, StartLeave) == []  # the outdated replica drains once its replacement serves


def test_a_head_change_brings_the_standbys_up_beside_the_successor():
    obj = omnistage(3, standby=1, rollout={"maxSurge": 2})
    t = target_from(obj)
    rs = old_set(t)
    spare = standby(t, 3, template="old")
    ms = [*(member(r, i) for i, r in enumerate(rs, 1)), registered(spare, 3)]
    o = observed(t, obj, old_head(t), [*rs, spare], ms, beside=observed(t, obj, successor(t)))
    actions, _, _ = plan(t, o, AT)
    # The serving set's standby goes at once (it serves nothing); its replicas keep serving.
    assert [(a.pod, a.drain_seconds) for a in of(actions, StartLeave)] == [("qwen3-omni-replica-3", 0)]
    # The successor's set: its first replica, then its standby.
    made = created(actions, inner(actions, CreatePod))
    assert [role for _, role in made] == [names.ROLE_REPLICA, names.ROLE_STANDBY]


# ---- liveness and evictions ------------------------------------------------------------------------

@pytest.mark.parametrize("state, coordinator, said", [
    (contract.ATTACHED, contract.COORD_SILENT, "heard no heartbeat"),
    (contract.DETACHED, contract.COORD_ABSENT, "dropped its engine"),
])
def test_a_stalled_standby_is_replaced_not_kept(state, coordinator, said):
    def members(rs):
        reg = registered(rs[1], 2)
        reg.update(state=state, coordinatorStatus=coordinator)
        return [member(rs[0], 1), reg]
    t, o = situation(2, 1, lambda t: [replica(t, 1), standby(t, 2)], members)
    actions, status, _ = plan(t, o, AT)
    # The head is told (a detached one turns left), nothing is drained, and the Warning says why at once.
    assert [(a.pod, a.drain_seconds) for a in of(actions, StartLeave)] == [("qwen3-omni-replica-2", 0)]
    [warning] = [e for e in of(actions, PostEvent) if e.reason == Progress.REPLACED_REPLICA]
    assert warning.type == "Warning" and said in warning.message and "qwen3-omni-replica-2" in warning.message
    leaving = Annotate("qwen3-omni-replica-2", {names.A_LEAVING: Progress.REPLACED_REPLICA})
    assert leaving in of(actions, Annotate)
    assert [(m["pod"], m["state"]) for m in status["members"]][1] == ("qwen3-omni-replica-2", "Leaving")
    assert created(actions) == [("qwen3-omni-replica-3", names.ROLE_STANDBY)]  # refilled at once


def test_an_evicted_standby_is_not_drained_and_is_refilled():
    def pods_(t):
        s = standby(t, 2)
        s["metadata"]["deletionTimestamp"] = "2026-11-30T12:05:00Z"
        return [replica(t, 1), s]
    t, o = situation(2, 1, pods_, lambda rs: [member(rs[0], 1), registered(rs[1], 2)])
    actions, _, _ = plan(t, o, AT)
    assert of(actions, StartLeave) == []  # never joined: nothing routed to it, nothing to drain
    assert created(actions) == [("qwen3-omni-replica-3", names.ROLE_STANDBY)]


def test_the_disruption_budget_counts_serving_replicas_only():
    t = target_from(omnistage(3, standby=2))
    pdb = render_disruption_budget(t)
    assert pdb["spec"]["minAvailable"] == t.replica_pods - t.spec.disruption_budget.max_unavailable
    selector = pdb["spec"]["selector"]["matchLabels"]
    # A standby is outside it: unready, it never blocks an eviction; evicted, it takes nothing out of serving.
    assert not selector.items() <= standby(t, 3)["metadata"]["labels"].items()
    assert selector.items() <= replica(t, 1)["metadata"]["labels"].items()


# ---- identity, validation, metrics -----------------------------------------------------------------

def test_a_standby_keeps_its_role_and_one_that_lost_it_is_restored_by_its_gate():
    t = target_from(omnistage(2, standby=1))
    kept, lost, joined = standby(t, 2), standby(t, 3), replica(t, 1)
    del lost["metadata"]["labels"][names.L_ROLE]
    del joined["metadata"]["labels"][names.L_ROLE]
    for pod in (kept, lost, joined):
        pod["metadata"]["ownerReferences"] = [{"uid": t.uid, "controller": True}]
    out, strays = sort_out(t, [kept, lost, joined], set())
    assert [pods.role(p) for p in out] == [names.ROLE_STANDBY, names.ROLE_STANDBY, names.ROLE_REPLICA]
    assert [(pods.name(s.pod), s.labels) for s in strays] == [
        ("qwen3-omni-replica-3", {names.L_ROLE: names.ROLE_STANDBY}),
        ("qwen3-omni-replica-1", {names.L_ROLE: names.ROLE_REPLICA})]
    actions, _, _ = plan(t, Observed(obj=omnistage(2, standby=1), strays=strays), AT)
    assert len(of(actions, RestoreLabels)) == 2


@pytest.mark.parametrize("spec, words", [
    ({"standby": 17}, "less than or equal to 16"),
    ({"standby": -1}, "greater than or equal to 0"),
    ({"standby": 1, "membership": "static"}, "spec.standby needs spec.membership dynamic"),
])
def test_spec_standby_is_bounded_and_needs_dynamic_membership(spec, words):
    assert validate_omnistage(omnistage(2, standby=16)).standby == 16
    with pytest.raises(InvalidSpec) as err:
        validate_omnistage(omnistage(2, **spec))
    [(field, message)] = err.value.problems
    assert field == "spec.standby" and words in message


def test_the_metrics_count_standbys():
    metrics.STATUS.observe("serving", "standby-metrics", {"replicas": 2, "standbyReplicas": 2,
                                                          "readyStandbyReplicas": 1})
    try:
        family = next(f for f in metrics.STATUS.collect() if f.name == "omnistage_replicas")
        got = {s.labels["state"]: s.value for s in family.samples if s.labels["name"] == "standby-metrics"}
        assert got == {"existing": 2, "standby": 2, "standby_ready": 1}
    finally:
        metrics.STATUS.observe("serving", "standby-metrics", None)
