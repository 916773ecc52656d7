"""plan() for a multi-stage OmniStage and its OmniStagePools (issue 12): pool pods created once the
head has an IP, joined per (stage, pod), scaled down with one drain per stage of the pod, rolled with
the head, refused pools that keep their pods, and the status both sides say. No API server, no head:
observations as in test_plan.py."""

from __future__ import annotations

import copy

import pytest
from omnistage import names
from omnistage.api.conditions import Reason, Type
from omnistage.control import pods
from omnistage.control.actions import (
    CreatePod,
    DeletePod,
    Join,
    LeaveDeparted,
    Observed,
    StartLeave,
)
from omnistage.control.plan import plan
from omnistage.control.pool_status import pool_status
from omnistage.control.pools import fit, parse
from omnistage.render import target_from
from omnistage.render.pods import render_pool_pod
from omnistage_engine_patches import contract

from .test_plan import (
    AT,
    HEAD_UID,
    changes,
    cond,
    head,
    listing,
    member,
    omnistage,
    ready_status,
    replica,
    report,
)

STAGES = [{"id": 1, "name": "talker"}, {"id": 2, "name": "code2wav"}]


def pipeline(replicas=2):
    obj = omnistage(replicas, pipeline="qwen3_omni_moe", stages=copy.deepcopy(STAGES))
    return obj, target_from(obj)


def pool_obj(name="speech", stage_ids=(1, 2), replicas=1, created="2026-11-30T00:00:00Z", **spec):
    return {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStagePool",
            "metadata": {"name": name, "namespace": "serving", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": created},
            "spec": {"omniStage": "qwen3-omni", "stageIds": list(stage_ids), "replicas": replicas, **spec}}


def pool_pod(t, pool, i, *, ready=True, head_uid=HEAD_UID, leaving=None, phase="Running", containers=None,
             joined=None):
    pod = render_pool_pod(t, parse(pool), i, "127.77.0.10", head_uid)
    pod["metadata"].update(
        uid=f"uid-{pool['metadata']['name']}-{i}", creationTimestamp=f"2026-11-30T0{i}:30:00Z"
    )
    if leaving:
        pod["metadata"]["annotations"][names.A_LEAVING] = leaving
    pod["spec"]["nodeName"] = f"h200-{i}"
    pod["status"] = ready_status(f"127.77.1.{i}", ready, phase, containers=containers, joined=joined)
    return pod


def stage_listing(stage0, by_stage):
    out = listing(*stage0)
    out["stages"].update({str(k): v for k, v in by_stage.items()})
    return out


def observe(obj, t, *, replicas=(), pool_pods=(), pools=(), stage0=None, by_stage=None, **kw):
    replicas = list(replicas)
    o = {
        "obj": obj,
        "head": head(t),
        "replicas": tuple(replicas + list(pool_pods)),
        "head_addressable": True,
        "report": report(t),
        "pools": tuple(pools),
        "listing": stage_listing(
            stage0 if stage0 is not None else [member(r, i) for i, r in enumerate(replicas, 1)],
            by_stage or {},
        ),
    }
    o.update(kw)
    return Observed(**o)


def joined_everywhere(pool_pods):
    """The head lists every pool pod's replica of each of its stages under the pod's name."""
    return {k: [member(p, i) for i, p in enumerate(pool_pods) if k in pods.stage_ids(p)] for k in (1, 2)}


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_at_rest_with_a_speech_pool_is_ready_and_says_where_each_stage_runs():
    obj, t = pipeline()
    pool = pool_obj()
    pp = [pool_pod(t, pool, 1)]
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], by_stage=joined_everywhere(pp))
    actions, status, pool_statuses = plan(t, o, AT)
    assert changes(actions) == []
    assert cond(status, Type.READY)["status"] == "True"
    assert cond(status, Type.STAGES_COVERED)["message"] == "stage 1: pool speech; stage 2: pool speech"
    assert cond(status, Type.STAGES_READY)["status"] == "True"
    assert status["stages"] == [
        {"id": 1, "name": "talker", "pool": "speech", "desired": 1, "ready": 1, "registered": 1},
        {"id": 2, "name": "code2wav", "pool": "speech", "desired": 1, "ready": 1, "registered": 1}]
    # Stage-0 counts stay stage 0's: the scale subresource must not count pool pods.
    assert status["replicas"] == 2 and status["registeredReplicas"] == 2
    [written] = pool_statuses.values()
    assert written["registeredReplicas"] == 1 and written["selector"].endswith("role=pool")
    assert written["members"] == [{"pod": "speech-1", "ip": "127.77.1.1", "state": "Joined",
                                   "replicaIds": {"1": 0, "2": 0}}]
    assert next(c for c in written["conditions"] if c["type"] == Type.READY)["status"] == "True"


def test_pool_pods_are_created_once_the_head_has_an_ip_not_once_it_is_ready():
    obj, t = pipeline()
    pool = pool_obj(replicas=2)
    o = observe(
        obj, t, pools=[pool], head=head(t, ready=False), head_addressable=True, report=None, listing=None
    )
    actions, status, _ = plan(t, o, AT)
    created = [a.obj["metadata"]["name"] for a in of(actions, CreatePod)]
    assert created == ["qwen3-omni-replica-1", "speech-1", "speech-2"]
    pod = next(a.obj for a in of(actions, CreatePod) if a.obj["metadata"]["name"] == "speech-1")
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python3", "-m", "omnistage_engine_patches.stages"]
    assert container["args"][:5] == ["--stage-id", "1", "--stage-id", "2", "--"]
    assert {"name": contract.CONNECTOR_PORTS_ENV, "value": contract.PORTS_PER_POD} in container["env"]
    assert cond(status, Type.STAGES_READY)["status"] == "False"
    assert cond(status, Type.READY)["status"] == "False"


def test_no_pool_pod_without_a_head_ip():
    obj, t = pipeline()
    no_ip = head(t, ready=False)
    no_ip["status"].pop("podIP")
    o = observe(obj, t, pools=[pool_obj()], head=no_ip, head_addressable=False, report=None, listing=None)
    actions, _, _ = plan(t, o, AT)
    assert of(actions, CreatePod) == []


def test_every_stage_of_a_ready_pool_pod_is_joined_and_the_initial_slot_by_its_ip():
    obj, t = pipeline()
    pool = pool_obj()
    pp = [pool_pod(t, pool, 1)]
    # The head registered the pod's initial talker and code2wav slots by IP (no pod name yet).
    by_stage = {
        1: [
            {
                "replicaId": 0,
                "host": "127.77.1.1",
                "state": contract.ATTACHED,
                "coordinatorStatus": contract.COORD_UP,
            }
        ],
        2: [
            {
                "replicaId": 0,
                "host": "127.77.1.1",
                "state": contract.ATTACHED,
                "coordinatorStatus": contract.COORD_UP,
            }
        ],
    }
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], by_stage=by_stage)
    actions, status, _ = plan(t, o, AT)
    assert [(a.pod, a.ip, a.stages, a.said) for a in of(actions, Join)] == [
        ("speech-1", "127.77.1.1", (1, 2), "pool pod speech-1 joined stage {stage} as replica {replica}")]
    assert status["stages"][0]["registered"] == 0


def test_stage_joins_do_not_wait_for_the_stage0_cache_verdict():
    obj, t = pipeline()
    pool = pool_obj()
    pp = [pool_pod(t, pool, 1)]
    bad = report(t, cache_class="MultiModalProcessorSenderCache")
    o = observe(
        obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], stage0=[], by_stage={}, report=bad
    )
    actions, _, _ = plan(t, o, AT)
    assert [(a.pod, a.ip, a.stages) for a in of(actions, Join)] == [("speech-1", "127.77.1.1", (1, 2))]


def test_scale_down_drains_every_stage_of_the_newest_pool_pod():
    obj, t = pipeline()
    pool = pool_obj(replicas=1)
    pp = [pool_pod(t, pool, 1), pool_pod(t, pool, 2)]
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], by_stage=joined_everywhere(pp))
    actions, status, _ = plan(t, o, AT)
    assert of(actions, StartLeave) == [StartLeave("speech-2", "uid-speech-2", ((1, 1), (2, 1)), 300)]
    assert of(actions, DeletePod) == []
    assert status["stages"][0]["desired"] == 1 and cond(status, Type.PROGRESSING)["reason"] == "ScaledDown"


def test_a_drained_pool_pod_is_deleted_with_its_pools_reason():
    obj, t = pipeline()
    pool = pool_obj(replicas=1)
    pp = [pool_pod(t, pool, 1), pool_pod(t, pool, 2, leaving="ScaledDown")]
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], by_stage=joined_everywhere(pp),
                drains={"uid-speech-2": "done"})
    actions, _, _ = plan(t, o, AT)
    assert of(actions, DeletePod) == [DeletePod("speech-2", "uid-speech-2", "ScaledDown",
                                                "deleted pool pod speech-2: its pool's spec.replicas is 1")]


def test_a_pool_pod_gone_from_the_cluster_is_forgotten_for_each_stage():
    obj, t = pipeline()
    pool = pool_obj()
    pp = [pool_pod(t, pool, 1)]
    by_stage = joined_everywhere(pp)
    for k in (1, 2):
        by_stage[k].append(
            {
                "replicaId": 4,
                "pod": "speech-9",
                "host": "127.77.1.9",
                "state": contract.ATTACHED,
                "coordinatorStatus": contract.COORD_UP,
            }
        )
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], by_stage=by_stage)
    actions, _, _ = plan(t, o, AT)
    assert of(actions, LeaveDeparted) == [LeaveDeparted(4, "speech-9", 1), LeaveDeparted(4, "speech-9", 2)]


def test_a_new_head_rolls_pool_pods_too():
    obj, t = pipeline()
    pool = pool_obj()
    pp = [pool_pod(t, pool, 1, head_uid="old-head")]
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], by_stage={})
    actions, _, _ = plan(t, o, AT)
    assert [a.name for a in of(actions, DeletePod)] == ["speech-1"]


def test_a_failed_pool_pod_is_replaced():
    obj, t = pipeline()
    pool = pool_obj()
    pp = [pool_pod(t, pool, 1, ready=False, phase="Failed")]
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], by_stage={})
    actions, _status, _ = plan(t, o, AT)
    assert [a.name for a in of(actions, DeletePod)] == ["speech-1"]
    assert [a.obj["metadata"]["name"] for a in of(actions, CreatePod)] == ["speech-2"]


def test_a_deleted_pool_drains_and_removes_its_pods_and_uncovers_its_stages():
    obj, t = pipeline()
    pool = pool_obj()
    pp = [pool_pod(t, pool, 1)]
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[], by_stage=joined_everywhere(pp))
    actions, status, _ = plan(t, o, AT)
    assert of(actions, StartLeave) == [StartLeave("speech-1", "uid-speech-1", ((1, 0), (2, 0)), 300)]
    assert cond(status, Type.STAGES_COVERED)["reason"] == "Uncovered"
    assert "stage 1, 2 runs in no OmniStagePool" in cond(status, Type.STAGES_COVERED)["message"]
    assert cond(status, Type.READY)["status"] == "False"


def test_a_stage_in_two_pools_stays_with_the_older_one_and_the_newer_keeps_its_pods():
    obj, t = pipeline()
    older, newer = pool_obj("speech"), pool_obj("talkers", (1,), created="2026-11-30T05:00:00Z")
    pp = [pool_pod(t, older, 1), pool_pod(t, newer, 1)]
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[newer, older],
                by_stage=joined_everywhere(pp))
    actions, status, written = plan(t, o, AT)
    assert of(actions, DeletePod) == [] and of(actions, StartLeave) == []  # a mistake loses nothing
    ready = next(c for c in written["talkers"]["conditions"] if c["type"] == Type.READY)
    assert (ready["status"], ready["reason"]) == ("False", Reason.STAGE_IN_TWO_POOLS)
    assert "stage 1 already runs in pool speech" in ready["message"]
    assert cond(status, Type.STAGES_COVERED)["status"] == "True"
    assert "pool talkers: stage 1 already runs in pool speech" in cond(status, Type.STAGES_COVERED)["message"]


@pytest.mark.parametrize(
    "stages, pool, reason, fragment",
    [
        (None, pool_obj(), Reason.NOT_MULTI_STAGE, "has no spec.stages"),
        (STAGES, pool_obj(stage_ids=(1, 3)), Reason.UNKNOWN_STAGE, "has no stage 3 in spec.stages"),
        (
            [{"id": 1, "engine": {"tensorParallelSize": 2}}, {"id": 2}],
            pool_obj(gpu={"count": 1}),
            Reason.TOO_FEW_GPUS,
            "spec.gpu.count 1 is less than the tensorParallelSize 2",
        ),
        # The shipped talker (0.6) and code2wav (0.1) fit one GPU; 0.95 for the talker does not.
        (
            [{"id": 1, "engine": {"gpuMemoryUtilization": 0.95}}, {"id": 2}],
            pool_obj(),
            Reason.GPU_MEMORY_OVERCOMMITTED,
            "adds up to more than 1 (stage 1 0.95, stage 2 0.1)",
        ),
    ],
)
def test_a_pool_that_cannot_run_says_what_to_change(stages, pool, reason, fragment):
    spec = {"pipeline": "qwen3_omni_moe", "stages": stages} if stages else {}
    t = target_from(omnistage(2, **spec))
    [fitted] = fit(t, "qwen3-omni", [pool])
    assert fitted.problem[0] == reason and fragment in fitted.problem[1]


def test_a_pool_without_its_omnistage_says_so():
    [fitted] = fit(None, "qwen3-omni", [pool_obj()])
    status = pool_status(fitted, None, [], at=AT)
    ready = status["conditions"][0]
    assert (ready["status"], ready["reason"]) == ("False", Reason.OMNISTAGE_NOT_FOUND)
    assert "OmniStage qwen3-omni does not exist" in ready["message"] and status["replicas"] == 0


def test_an_invalid_pool_spec_is_refused_by_field():
    [fitted] = fit(None, "qwen3-omni", [pool_obj(replicas=0)])
    assert fitted.pool is None and fitted.problem[0] == "InvalidSpec" and "spec.replicas" in fitted.problem[1]


def test_a_head_container_restart_rolls_the_pool_even_while_the_head_answers_nothing():
    """A restarted multi-stage head serves nothing (not even /health) until a replica of every remote
    stage registered, and the old pool pods never register again: the restart is read from the head
    pod's restartCount, not from its boot id."""
    obj, t = pipeline()
    obj["status"]["head"]["restarts"] = 0
    pool = pool_obj()
    pp = [pool_pod(t, pool, 1)]
    restarted = head(t, ready=False)
    restarted["status"]["containerStatuses"] = [{"name": "engine", "restartCount": 1}]
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], head=restarted, report=None,
                listing=None)
    actions, status, _ = plan(t, o, AT)
    assert sorted(a.name for a in of(actions, DeletePod)) == ["qwen3-omni-replica-1", "speech-1"]
    assert any(a.reason == "HeadRestarted" and "restartCount 0 -> 1" in a.message for a in actions
               if hasattr(a, "reason") and a.reason == "HeadRestarted")
    # The dead process's boot id is forgotten, so the new one's first answer is no second restart.
    assert status["head"]["restarts"] == 1 and "bootId" not in status["head"]


def test_an_unchanged_restart_count_rolls_nothing():
    obj, t = pipeline()
    obj["status"]["head"]["restarts"] = 1
    pool = pool_obj()
    pp = [pool_pod(t, pool, 1)]
    same = head(t)
    same["status"]["containerStatuses"] = [{"name": "engine", "restartCount": 1}]
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], head=same,
                by_stage=joined_everywhere(pp))
    actions, status, _ = plan(t, o, AT)
    assert of(actions, DeletePod) == [] and status["head"]["bootId"] == "boot-1"


def reported(pool_pods, outcomes):
    """The head's listing with every pool pod's replicas carrying the patch report they registered with."""
    by_stage = joined_everywhere(pool_pods)
    for members in by_stage.values():
        for m in members:
            m["patches"] = dict(outcomes)
    return by_stage


def test_stage_pods_patch_outcomes_are_in_status():
    obj, t = pipeline()
    pool = pool_obj()
    pp = [pool_pod(t, pool, 1)]
    applied = {name: contract.APPLIED for name in contract.PATCHES}
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], by_stage=reported(pp, applied))
    _, status, _ = plan(t, o, AT)
    assert status["stages"][0]["patches"] == dict(sorted(applied.items()))
    assert (
        cond(status, Type.STAGES_READY)["status"] == "True" and cond(status, Type.READY)["status"] == "True"
    )


def test_a_stage_pod_without_connector_ports_holds_stages_ready_false():
    """A stage replica whose connector ports keep the replica term binds elsewhere than the head
    advertises: the data path would break. Said on StagesReady (and Ready), with the pod."""
    obj, t = pipeline()
    pool = pool_obj()
    pp = [pool_pod(t, pool, 1)]
    outcomes = {name: contract.APPLIED for name in contract.PATCHES} | {
        contract.CONNECTOR_PORTS: contract.SKIPPED
    }
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], by_stage=reported(pp, outcomes))
    actions, status, _ = plan(t, o, AT)
    ready = cond(status, Type.STAGES_READY)
    assert (ready["status"], ready["reason"]) == ("False", "PatchNotApplied")
    assert "stage 1: connector_ports skipped in speech-1" in ready["message"]
    assert cond(status, Type.READY)["status"] == "False"
    assert status["stages"][0]["patches"][contract.CONNECTOR_PORTS] == contract.SKIPPED
    assert "patchProblem" not in status["stages"][0]
    assert any(getattr(a, "reason", None) == "PatchNotApplied" for a in actions)


def test_each_running_pool_gets_a_disruption_budget_over_its_pods():
    from omnistage.control.actions import EnsureChild

    obj, t = pipeline()
    pool = pool_obj(replicas=3, disruptionBudget={"maxUnavailable": 1})
    pp = [pool_pod(t, pool, i) for i in (1, 2, 3)]
    o = observe(obj, t, replicas=[replica(t, 1)], pool_pods=pp, pools=[pool], by_stage=joined_everywhere(pp))
    budgets = {a.obj["metadata"]["name"]: a.obj["spec"] for a in plan(t, o, AT).actions
               if isinstance(a, EnsureChild) and a.obj["kind"] == "PodDisruptionBudget"}
    assert budgets["speech-pool"]["minAvailable"] == 2
    assert budgets["speech-pool"]["selector"]["matchLabels"][names.L_POOL] == "speech"
    assert budgets["qwen3-omni-replicas"]["minAvailable"] == 0  # one replica: nothing protects it
