"""Warm standbys of an OmniStagePool (its spec.standby, control/standby.py, issue 30) on the plan's
table: a standby pool pod is created and held unjoined for every stage it runs, counted apart in the
pool's status, joined first by a pool scale-up and refilled, kept on a scale-down by the head's hold
of each of its stages, trimmed without a drain, replaced when one of its stages goes silent, and its
role label kept by the pod-identity check. No API server, no head: observations as in test_plan_pools.

On the code before pool standbys every test here fails: OmniStagePool spec.standby is an unknown field
there (the pool does not parse), and a pool had no standbys."""

from __future__ import annotations

from omnistage import names
from omnistage.api.conditions import Progress
from omnistage.control import pods
from omnistage.control.actions import CreatePod, DeletePod, Join, PostEvent, SetRole, StartLeave
from omnistage.control.identity import sort_out
from omnistage.control.plan import plan
from omnistage.render.common import pool_selector
from omnistage_engine_patches import contract

from .test_plan import AT, member, registered, replica
from .test_plan_pools import joined_everywhere, observe, of, pipeline, pool_obj, pool_pod

POOL = "speech"


def pool_standby(t, pool, i, *, warm=True):
    """A pool pod whose role label is standby: its engines run (ContainersReady), NotReady."""
    pod = pool_pod(t, pool, i, ready=False, containers=warm, joined=False)
    pod["metadata"]["labels"][names.L_ROLE] = names.ROLE_STANDBY
    return pod


def held_everywhere(standbys, first_id=10, coordinator=contract.COORD_UP):
    """Every standby's replica of stages 1 and 2 registered from its address, joined under no name."""
    out = {1: [], 2: []}
    for n, s in enumerate(standbys):
        for k in (1, 2):
            out[k].append({**registered(s, first_id + 10 * n + k), "coordinatorStatus": coordinator})
    return out


def at(replicas=1, standby=1, serving=1, standbys=1, warm=True, stage2_coordinator=contract.COORD_UP):
    """A pipeline with one stage-0 replica, `serving` joined pool pods and `standbys` standby pool pods."""
    obj, t = pipeline()
    pool = pool_obj(replicas=replicas, standby=standby)
    pp = [pool_pod(t, pool, i) for i in range(1, serving + 1)]
    sb = [pool_standby(t, pool, i, warm=warm) for i in range(serving + 1, serving + standbys + 1)]
    by_stage = joined_everywhere(pp)
    if warm:
        held = held_everywhere(sb)
        held[2] = [{**mm, "coordinatorStatus": stage2_coordinator} for mm in held[2]]
        by_stage = {k: by_stage[k] + held[k] for k in (1, 2)}
    r1 = replica(t, 1)
    o = observe(obj, t, replicas=[r1], pool_pods=pp + sb, pools=[pool], stage0=[member(r1, 1)],
                by_stage=by_stage)
    return t, o, pp, sb


def created(actions):
    return [(c.obj["metadata"]["name"], c.obj["metadata"]["labels"][names.L_ROLE],
             c.obj["metadata"]["labels"][names.L_COMPONENT]) for c in of(actions, CreatePod)]


def retired(actions):
    """The pods this pass deletes or starts to make leave."""
    return {d.name for d in of(actions, DeletePod)} | {a.pod for a in of(actions, StartLeave)}


def test_a_missing_pool_standby_is_created_as_a_standby_pool_pod():
    t, o, _, _ = at(standbys=0)
    actions, _, _ = plan(t, o, AT)
    assert created(actions) == [(f"{POOL}-2", names.ROLE_STANDBY, names.COMPONENT_POOL)]
    assert of(actions, CreatePod)[0].reason == Progress.REFILLING_STANDBY
    assert "OmniStagePool speech spec.standby 1" in of(actions, CreatePod)[0].message


def test_a_held_pool_standby_is_not_joined_and_the_pool_counts_it_apart():
    t, o, _, [sb] = at()
    actions, _, pool_statuses = plan(t, o, AT)
    assert of(actions, Join) == [] and of(actions, CreatePod) == [] and of(actions, DeletePod) == []
    written = pool_statuses[POOL]
    assert (written["replicas"], written["registeredReplicas"]) == (1, 1)  # the serving pod only
    assert (written["standbyReplicas"], written["readyStandbyReplicas"]) == (1, 1)
    [m] = [m for m in written["members"] if m.get("standby")]
    assert (m["pod"], m["state"], m["replicaIds"]) == (pods.name(sb), "Standby", {"1": 11, "2": 12})
    # The scale subresource's selector counts the pool's serving pods only (role=pool).
    assert written["selector"] == pool_selector(t, POOL) and written["selector"].endswith("role=pool")


def test_a_pool_scale_up_joins_the_standby_first_for_each_stage_and_refills_it():
    t, o, _, [sb] = at(replicas=2)
    actions, _, _ = plan(t, o, AT)
    assert [(a.name, a.role) for a in of(actions, SetRole)] == [(pods.name(sb), names.ROLE_POOL)]
    assert [j.stages for j in of(actions, Join) if j.pod == pods.name(sb)] == [(1, 2)]
    # The new capacity is the standby: the one pod created refills the pool's standby count.
    assert created(actions) == [(f"{POOL}-3", names.ROLE_STANDBY, names.COMPONENT_POOL)]


def test_a_pool_scale_down_holds_each_stage_of_a_joined_pod_while_the_standbys_are_short():
    t, o, pp, _ = at(replicas=1, standby=1, serving=2, standbys=0)
    actions, _, _ = plan(t, o, AT)
    [victim] = [r for r in pp if (pods.name(r), names.ROLE_STANDBY) in
                [(a.name, a.role) for a in of(actions, SetRole)]]
    [hold] = of(actions, StartLeave)
    assert hold.pod == pods.name(victim) and hold.hold and sorted(s for s, _ in hold.leaves) == [1, 2]
    assert of(actions, DeletePod) == [] and of(actions, CreatePod) == []
    assert any(e.reason == Progress.KEPT_STANDBY and "OmniStagePool speech" in e.message
               for e in of(actions, PostEvent))


def test_pool_standbys_beyond_its_spec_standby_go_without_a_drain():
    t, o, _, [sb] = at(standby=0)
    actions, _, _ = plan(t, o, AT)
    assert [(a.pod, a.drain_seconds) for a in of(actions, StartLeave)] in ([], [(pods.name(sb), 0)])
    assert pods.name(sb) in retired(actions)
    assert of(actions, Join) == []


def test_a_pool_standby_with_one_silent_stage_is_replaced():
    t, o, _, [sb] = at(stage2_coordinator=contract.COORD_SILENT)
    actions, _, _ = plan(t, o, AT)
    assert pods.name(sb) in retired(actions)
    assert any(e.reason == Progress.REPLACED_REPLICA and "stage 2" in e.message
               for e in of(actions, PostEvent))


def test_the_identity_check_keeps_a_pool_standbys_role():
    t, _, _, [sb] = at()
    placed, strays = sort_out(t, [sb], {POOL})
    assert strays == () and pods.role(placed[0]) == names.ROLE_STANDBY and pods.pool(placed[0]) == POOL
