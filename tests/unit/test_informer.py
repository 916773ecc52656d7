"""informer.Informer's store: watch events, the operator's own writes (write-through) and their order.
The list + watch loop itself runs against the real API server in the cluster tier."""

from __future__ import annotations

from omnistage.names import GROUP, L_OMNISTAGE
from omnistage.runtime.informer import Informer


def pod(name: str, rv: int, owner: str = "s1", **extra) -> dict:
    """A pod the OmniStage `owner` controls (the pods' store keeps no other)."""
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": str(rv),
            "labels": {L_OMNISTAGE: owner},
            "managedFields": [{"manager": "x"}],
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/v1alpha1",
                    "kind": "OmniStage",
                    "name": owner,
                    "uid": f"{owner}-uid",
                    "controller": True,
                }
            ],
            **extra,
        },
    }


def informer(changes: list | None = None) -> Informer:
    inf = Informer("Pod", lambda scope: (None, ()), None, lambda o: o["metadata"]["labels"].get(L_OMNISTAGE))
    if changes is not None:
        inf.on_change = lambda ns, name: changes.append((ns, name))
    return inf


def test_events_index_by_omnistage_and_trim_managed_fields():
    changes: list = []
    inf = informer(changes)
    inf._event("ADDED", pod("a", 1))
    inf._event("ADDED", pod("b", 2, owner="s2"))
    assert [p["metadata"]["name"] for p in inf.owned("ns", "s1")] == ["a"]
    assert "managedFields" not in inf.get("ns", "a")["metadata"]
    inf._event("DELETED", pod("a", 3))
    assert inf.get("ns", "a") is None and inf.owned("ns", "s1") == []
    assert changes == [("ns", "s1"), ("ns", "s2"), ("ns", "s1")]


def test_a_write_is_seen_at_once_unless_the_watch_already_has_newer():
    inf = informer()
    inf._event("ADDED", pod("a", 5))
    inf.wrote(pod("a", 7, deletionTimestamp="now"))  # our delete: the next pass must not delete again
    assert inf.get("ns", "a")["metadata"]["deletionTimestamp"] == "now"
    inf._event("MODIFIED", pod("a", 6))  # a late, older event does not undo it
    assert inf.get("ns", "a")["metadata"]["resourceVersion"] == "7"
    inf._event("DELETED", pod("a", 8))
    inf.wrote(pod("a", 7))  # a write answered before the deletion arrives after it: no ghost
    assert inf.get("ns", "a") is None
    inf.wrote(pod("a", 9))  # a new incarnation under the same name is taken
    assert inf.get("ns", "a")["metadata"]["resourceVersion"] == "9"


def test_a_relist_replaces_the_scope():
    inf = informer()
    inf._event("ADDED", pod("a", 1))
    inf._replace("ns", [pod("b", 2)])
    assert inf.get("ns", "a") is None and inf.get("ns", "b") is not None


def test_an_omnistage_is_queued_for_a_new_generation_not_for_its_status():
    from omnistage.runtime.informer import ClusterState

    changes: list = []
    inf = ClusterState().omnistages
    inf.on_change = lambda ns, name: changes.append(name)

    def stage(rv: int, generation: int, status: dict | None = None) -> dict:
        return {"kind": "OmniStage", "metadata": {"name": "s1", "namespace": "ns", "resourceVersion": str(rv),
                                                  "generation": generation}, "status": status or {}}

    inf._event("ADDED", stage(1, 1))
    inf._event("MODIFIED", stage(2, 1, {"replicas": 1}))  # the operator's own status write
    inf._event("MODIFIED", stage(3, 2))  # kubectl scale
    inf._event("DELETED", stage(4, 2))
    assert changes == ["s1", "s1", "s1"]


def test_a_pod_is_kept_without_its_spec_but_where_it_runs():
    """Only spec.nodeName is read back (pods.scheduled); the rest of a pod's spec is half its memory."""
    from omnistage.runtime.informer import STATE
    full = pod("a", 1)
    full["spec"] = {
        "nodeName": "h200-0",
        "containers": [{"name": "engine", "image": "x", "env": [{"name": "A"}]}],
    }
    STATE.pods._event("ADDED", full)
    try:
        assert STATE.pods.get("ns", "a")["spec"] == {"nodeName": "h200-0"}
        unscheduled = pod("a", 2)
        unscheduled["spec"] = {"containers": []}
        STATE.pods.wrote(unscheduled)
        assert STATE.pods.get("ns", "a")["spec"] == {}
    finally:
        STATE.pods._delete(("ns", "a"), 3)


def test_a_listed_omnistage_is_queued_at_once_when_asked():
    """After a start (or on becoming leader) every OmniStage gets a pass as soon as the list is in,
    as kopf's resume handler did; the pods' and children's lists queue nothing."""
    import json as _json
    from types import SimpleNamespace

    body = {"metadata": {"resourceVersion": "9"}, "items": [
        {"metadata": {"name": "a", "namespace": "ns", "resourceVersion": "3"}},
        {"metadata": {"name": "b", "namespace": "ns", "resourceVersion": "4"}}]}

    def lister(scope):
        return (lambda *args, **kwargs: SimpleNamespace(data=_json.dumps(body).encode())), ()

    for notify, want in ((True, [("ns", "a"), ("ns", "b")]), (False, [])):
        changes: list = []
        inf = Informer("OmniStage", lister, None, lambda o: o["metadata"]["name"], notify_listed=notify)
        inf.on_change = lambda ns, name, changes=changes: changes.append((ns, name))
        assert inf._list("ns") == "9" and inf.get("ns", "b") is not None
        assert changes == want


def test_a_child_is_queued_for_what_the_operator_renders_not_for_its_status():
    """The disruption controller rewrites a PodDisruptionBudget's status whenever a replica's readiness
    or the selector changes: each was a pass (the tamper test counted 4 passes for one restore)."""
    from omnistage.runtime.informer import ClusterState

    changes: list = []
    inf = ClusterState().children["PodDisruptionBudget"]
    inf.on_change = lambda ns, name: changes.append(name)

    def pdb(rv: int, selector: dict, healthy: int = 0) -> dict:
        return {"kind": "PodDisruptionBudget",
                "metadata": {"name": "s1-replicas", "namespace": "ns", "resourceVersion": str(rv),
                             "labels": {"serving.omnistage.io/omnistage": "s1"}},
                "spec": {"selector": {"matchLabels": selector}}, "status": {"currentHealthy": healthy}}

    inf._event("ADDED", pdb(1, {"role": "replica"}))
    inf._event("MODIFIED", pdb(2, {"role": "replica"}, healthy=1))  # the disruption controller
    inf._event("MODIFIED", pdb(3, {"role": "replica", "tamper": "x"}, healthy=1))  # someone's edit
    inf.wrote(pdb(4, {"role": "replica"}, healthy=1))  # the operator's restore, answered
    inf._event("MODIFIED", pdb(4, {"role": "replica"}, healthy=1))  # and its watch event
    inf._event("DELETED", pdb(5, {"role": "replica"}))
    assert changes == ["s1", "s1", "s1"]
