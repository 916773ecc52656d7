"""Victim choice, replica naming and condition merging: pure functions of API objects."""

from omnistage.api.conditions import Cond, merge, ready
from omnistage.control import pods
from omnistage.names import A_LEAVING


def pod(name, index, created, *, node="h200-0", ready_=True, leaving=False):
    annotations = {"serving.omnistage.io/replica-index": str(index)}
    if leaving:
        annotations[A_LEAVING] = "ScaledDown"
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "creationTimestamp": created,
            "annotations": annotations,
        },
        "spec": {"nodeName": node} if node else {},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready_ else "False"}]},
    }


OLD = pod("r-1", 1, "2026-11-30T01:00:00Z")
NEW = pod("r-2", 2, "2026-11-30T02:00:00Z")
NEWEST = pod("r-3", 3, "2026-11-30T03:00:00Z")
UNSCHEDULED = pod("r-4", 4, "2026-11-30T00:00:00Z", node=None, ready_=False)
NOT_READY = pod("r-5", 5, "2026-11-30T00:30:00Z", ready_=False)


def names(ps):
    return [pods.name(p) for p in ps]


def test_newest_leaves_first():
    assert names(pods.choose_victims([OLD, NEWEST, NEW], 2)) == ["r-3", "r-2"]


def test_unscheduled_then_not_ready_before_newest():
    assert names(pods.choose_victims([OLD, NEWEST, UNSCHEDULED, NOT_READY], 3)) == ["r-4", "r-5", "r-3"]


def test_a_started_leave_is_finished_first():
    """After a crash mid-scale the same victim is picked again, not a second one."""
    leaving = pod("r-1", 1, "2026-11-30T01:00:00Z", leaving=True)
    assert names(pods.choose_victims([leaving, NEWEST, NEW], 1)) == ["r-1"]


def test_no_victims_for_zero():
    assert pods.choose_victims([OLD], 0) == []


def test_free_indices_fill_gaps_deterministically():
    assert pods.free_indices([OLD, NEWEST], 3) == [2, 4, 5]
    assert pods.free_indices([], 2) == [1, 2]


def test_unschedulable_message():
    p = {"metadata": {"name": "x"}, "spec": {}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}
    assert pods.unschedulable(p) == "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    assert pods.unschedulable(OLD) is None


def test_merge_moves_transition_time_only_on_change():
    first = merge([], [Cond("Ready", False, "Waiting")], 1, "t1")
    same = merge(first, [Cond("Ready", False, "Waiting", "still")], 2, "t2")
    flipped = merge(same, [Cond("Ready", True, "AllReplicasServing")], 2, "t3")
    assert same[0]["lastTransitionTime"] == "t1" and same[0]["message"] == "still"
    assert flipped[0]["lastTransitionTime"] == "t3" and flipped[0]["observedGeneration"] == 2


def test_merge_keeps_other_types():
    both = merge([], [Cond("Ready", True, "x"), Cond("HeadReady", True, "y")], 1, "t1")
    only_ready = merge(both, [Cond("Ready", False, "InvalidSpec")], 2, "t2")
    assert {c["type"]: c["status"] for c in only_ready} == {"Ready": "False", "HeadReady": "True"}


def test_ready_needs_every_condition():
    assert ready(True, True, True, True).status
    assert ready(True, True, False, True).message == "waiting for MembershipSynced"
    assert ready(True, True, True, False).message == "waiting for CacheConsistent"
    assert not ready(True, True, True, False).status
