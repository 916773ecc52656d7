"""plan() after a restart of the head's engine (issue 39): a replica whose engine reported patch
`reattach` applied is kept and re-joined once the new head lists it; one that did not, or that does
not come back within control.reattach.REATTACH_SECONDS of the head's Ready, is rolled as before."""

from __future__ import annotations

from omnistage import names
from omnistage.control import reattach
from omnistage.control.actions import Annotate, CreatePod, DeletePod, Join, MarkJoined, PostEvent
from omnistage.control.plan import plan
from omnistage_engine_patches import contract

from .test_plan import AT, head, listing, member, of, registered, replica, restarted, situation


def capable(t, i, outcome=contract.APPLIED):
    pod = replica(t, i)
    pod["metadata"]["annotations"][names.A_REATTACH] = outcome
    return pod


def head_ready_since(ts):
    def make(t):
        pod = restarted(head(t))
        next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")["lastTransitionTime"] = ts
        return pod
    return make


def test_a_reattachable_replica_is_kept_and_not_joined_while_the_new_head_does_not_list_it():
    t, o = situation(3, pods_=lambda t: [capable(t, 1), capable(t, 2)], members=lambda rs: [],
                     listing=listing(boot="boot-2"), head=head_ready_since("2026-11-30T11:59:50Z"))
    actions, status, _ = plan(t, o, AT)
    assert of(actions, DeletePod) == [] and of(actions, CreatePod) == [] and of(actions, Join) == []
    # Not serving until it registered again: NotReady, said in Progressing.
    assert {a.pod for a in of(actions, MarkJoined) if not a.joined} == {"qwen3-omni-replica-1",
                                                                          "qwen3-omni-replica-2"}
    assert "Reattaching" in next(c for c in status["conditions"] if c["type"] == "Progressing")["reason"]
    assert not any(e.reason == "HeadRestarted" for e in of(actions, PostEvent))


def test_a_reattached_replica_is_re_annotated_and_joined_without_a_new_pod():
    t, o = situation(3, pods_=lambda t: [capable(t, 1), capable(t, 2)],
                     members=lambda rs: [registered(rs[0], 5), registered(rs[1], 6)],
                     head=head_ready_since("2026-11-30T11:59:50Z"))
    actions, _, _ = plan(t, o, AT)
    assert of(actions, DeletePod) == [] and of(actions, CreatePod) == []
    assert {a.name for a in of(actions, Annotate) if a.annotations.get(names.A_HEAD_RESTARTS) == "1"} == {
        "qwen3-omni-replica-1", "qwen3-omni-replica-2"}
    assert sum(e.reason == "Reattached" for e in of(actions, PostEvent)) == 2


def test_a_replica_that_does_not_come_back_within_the_bound_is_rolled():
    late = f"2026-11-30T11:{59 - reattach.REATTACH_SECONDS // 60}:00Z"
    t, o = situation(3, pods_=lambda t: [capable(t, 1), capable(t, 2)], members=lambda rs: [],
                     listing=listing(boot="boot-2"), head=head_ready_since(late))
    actions, _, _ = plan(t, o, AT)
    assert {a.name for a in of(actions, DeletePod)} == {"qwen3-omni-replica-1", "qwen3-omni-replica-2"}
    assert any(e.reason == "HeadRestarted" for e in of(actions, PostEvent))


def test_a_replica_without_the_patch_is_rolled_at_once():
    """The negative control of the decision: `skipped` (another vLLM) or no annotation rolls, as before."""
    t, o = situation(3, pods_=lambda t: [capable(t, 1, contract.SKIPPED), replica(t, 2)],
                     members=lambda rs: [],
                     listing=listing(boot="boot-2"), head=head_ready_since("2026-11-30T11:59:50Z"))
    actions, _, _ = plan(t, o, AT)
    assert {a.name for a in of(actions, DeletePod)} == {"qwen3-omni-replica-1", "qwen3-omni-replica-2"}


def test_the_outcome_a_replica_reports_is_kept_on_its_pod():
    def members(rs):
        reported = {contract.REATTACH: contract.APPLIED}
        return [{**member(r, i), "patches": reported} for i, r in enumerate(rs, 1)]
    t, o = situation(3, members=members)
    actions, _, _ = plan(t, o, AT)
    assert {a.name for a in of(actions, Annotate) if a.annotations == {names.A_REATTACH: "applied"}} == {
        "qwen3-omni-replica-1", "qwen3-omni-replica-2"}


def test_a_replica_s_template_hash_does_not_name_its_head():
    """A replica that re-attached to a replaced head pod keeps the old pod's IP in its args and uid
    in its annotations: that is no template change (it would be rolled as outdated)."""
    from omnistage.render import render_replica_pod, target_from

    from .test_plan import omnistage

    t = target_from(omnistage(3))
    a = render_replica_pod(t, 1, "127.77.0.10", "uid-a", 0)
    b = render_replica_pod(t, 1, "127.77.0.99", "uid-b", 4)
    assert a["spec"]["containers"][0]["args"] != b["spec"]["containers"][0]["args"]
    hashes = {p["metadata"]["annotations"][names.A_TEMPLATE_HASH] for p in (a, b)}
    assert len(hashes) == 1
    env = {e["name"]: e.get("value") for e in a["spec"]["containers"][0]["env"]}
    assert env[contract.MASTER_SERVICE_ENV] == "qwen3-omni-master.serving.svc"


def test_a_reattachable_replica_of_a_replaced_head_pod_waits_instead_of_rolling():
    def new_head(t):
        pod = head_ready_since("2026-11-30T11:59:50Z")(t)
        pod["metadata"]["uid"] = "head-uid-2"
        return pod
    t, o = situation(3, pods_=lambda t: [capable(t, 1), capable(t, 2)], members=lambda rs: [],
                     listing=listing(boot="boot-2"), head=new_head)
    actions, _, _ = plan(t, o, AT)
    assert of(actions, DeletePod) == [] and of(actions, CreatePod) == []
    t, o = situation(3, pods_=lambda t: [capable(t, 1), capable(t, 2)],
                     members=lambda rs: [registered(rs[0], 5), registered(rs[1], 6)], head=new_head)
    actions, _, _ = plan(t, o, AT)
    assert {a.name for a in of(actions, Annotate) if a.annotations.get(names.A_HEAD_UID) == "head-uid-2"} == {
        "qwen3-omni-replica-1", "qwen3-omni-replica-2"}
    assert of(actions, DeletePod) == []
