"""Drift the operator did not see (issue 40 item 11), decided without an API server: a reserved label on
a Service (kube-proxy drops a Service labelled `service.kubernetes.io/service-proxy-name`: an outage) and a
ConfigMap made `immutable: true` (every later change refused for good). Before, drift.drifted compared only
the rendered labels (others' were left, these too), and the ConfigMap's `immutable` was no field the
operator owned. The membership Secret deleted while no pod needs it: tests/unit/test_membership_secret.py.
The cluster tier tampers the same on a real API server (tests/cluster/test_tamper.py).
"""

from __future__ import annotations

import copy

import pytest
from omnistage.api import child_kinds
from omnistage.api.child_kinds import BY_KIND
from omnistage.control.actions import EnsureChild
from omnistage.runtime import act as act_module
from omnistage.runtime import drift
from omnistage.runtime.act import Acted
from omnistage.runtime.informer import Informer

from .test_kube import FakeServer, rendered, served

PROXY_NAME = "service.kubernetes.io/service-proxy-name"
OWNED = {kind: c.owned_fields for kind, c in BY_KIND.items()}


@pytest.mark.parametrize("key, reserved", [
    (PROXY_NAME, True),
    ("service.kubernetes.io/headless", True),
    ("service.kubernetes.io/topology-mode", True),
    ("kubernetes.io/anything", True),
    ("endpointslice.kubernetes.io/skip-mirror", True),
    ("x.k8s.io/y", True),
    ("app.kubernetes.io/part-of", False),  # the recommended labels describe; Helm and Argo CD write them
    ("kubectl.kubernetes.io/last-applied-configuration", False),  # kubectl apply's own record
    ("team.example.com/cost-centre", False),
    ("notkubernetes.io/x", False),
    ("plain", False),
])
def test_which_keys_are_kubernetes_own(key, reserved):
    assert child_kinds.reserved_key(key) is reserved


@pytest.mark.parametrize("which", ["api", "master"])
def test_a_reserved_label_someone_added_to_a_service_has_drifted(which):
    obj = rendered(which)
    have = served(obj)
    have["metadata"]["labels"][PROXY_NAME] = "nobody"
    assert drift.drifted(obj, have, OWNED["Service"]) == [
        f'metadata.labels.{PROXY_NAME}: "nobody", not rendered']


def test_others_labels_and_annotations_stay_theirs():
    obj = rendered("api")
    have = served(obj)  # a team's label
    have["metadata"]["labels"]["app.kubernetes.io/part-of"] = "shop"
    have["metadata"].setdefault("annotations", {})["kubectl.kubernetes.io/last-applied-configuration"] = "{}"
    have["metadata"]["labels"]["monitoring.example.com/scrape"] = "true"  # a ServiceMonitor's selector
    assert drift.drifted(obj, have, OWNED["Service"]) == []


def test_a_reserved_label_is_removed_by_one_json_patch_and_nothing_else(monkeypatch):
    monkeypatch.setattr(drift, "UNRESTORABLE", {})
    obj = rendered("api")
    have = served(obj)
    have["spec"]["clusterIP"] = "10.0.0.7"
    have["metadata"]["labels"][PROXY_NAME] = "nobody"
    have["metadata"].setdefault("annotations", {})["service.kubernetes.io/topology-mode"] = "Auto"

    def answer(kind, ops):
        out = copy.deepcopy(have)
        for op in ops:
            assert op["op"] == "remove"
            field, key = op["path"].split("/")[2:]
            del out["metadata"][field][key.replace("~1", "/").replace("~0", "~")]
        return out

    server = FakeServer(monkeypatch, answer)
    done = drift.apply(obj, OWNED["Service"], have)
    assert server.calls == [("json", [
        {"op": "remove", "path": "/metadata/labels/service.kubernetes.io~1service-proxy-name"},
        {"op": "remove", "path": "/metadata/annotations/service.kubernetes.io~1topology-mode"},
    ])]  # the spec is as rendered: not written; the rendered labels are there: no apply
    assert done.result == "updated" and done.left == () and len(done.drift) == 2
    assert PROXY_NAME not in done.obj["metadata"]["labels"]
    assert done.obj["metadata"]["labels"]["team.example.com/cost-centre"] == "42"  # another's, kept


def test_an_immutable_configmap_has_drifted():
    obj = rendered("ConfigMap")
    have = {**served(obj), "immutable": True}
    assert drift.drifted(obj, have, OWNED["ConfigMap"]) == ["immutable: true, not absent"]
    assert drift.frozen(obj, have) == ["immutable: true"]
    assert drift.frozen(obj, {**have, "immutable": False}) == []  # false freezes nothing: patched away


def test_an_immutable_configmap_is_deleted_and_created_again(monkeypatch):
    monkeypatch.setattr(drift, "UNRESTORABLE", {})
    obj = rendered("ConfigMap")
    have = {**served(obj), "immutable": True}
    have["data"] = {**have["data"], "deploy.yaml": "stale"}  # a change it refused
    fresh = {**served(obj), "metadata": {**served(obj)["metadata"], "uid": "new-uid"}}
    server = FakeServer(monkeypatch, lambda kind, body: fresh)
    deleted = []

    def deleter(kind):
        return lambda name, namespace, body, _preload_content: deleted.append((kind, namespace, name, body))

    monkeypatch.setattr(drift, "_deleter", deleter)
    done = drift.apply(obj, OWNED["ConfigMap"], have)
    # Only the ConfigMap it found frozen: its uid is the delete's precondition.
    assert deleted == [("ConfigMap", "serving", obj["metadata"]["name"],
                        {"preconditions": {"uid": "child-uid"}})]
    assert [kind for kind, _ in server.calls] == ["apply"] and server.calls[0][1] == obj
    assert done.result == "replaced" and done.left == () and done.obj["metadata"]["uid"] == "new-uid"
    assert "immutable: true, not absent" in done.drift


def test_replacing_says_why(monkeypatch):
    obj = rendered("ConfigMap")
    applied = drift.Applied("replaced", obj, ("immutable: true, not absent",))
    monkeypatch.setattr(act_module.drift, "apply", lambda *a: applied)
    monkeypatch.setattr(act_module.STATE, "wrote", lambda o: None)
    events = []
    act_module.act("serving", [EnsureChild(obj, OWNED["ConfigMap"], "ConfigRendered")], None,
                   lambda *e: events.append(e), "o")
    [(etype, reason, message)] = events
    assert etype == "Normal" and reason == "ConfigRendered"
    name = obj["metadata"]["name"]
    assert message.startswith(f"ConfigMap {name} replaced (it had immutable: true, not absent)")
    assert "deleted it and created it" in message


def test_a_deletion_the_watch_delivers_after_a_re_create_does_not_drop_the_new_one():
    """drift.apply's re-create is written through (rv 9) before the watch delivers the old one's deletion
    (rv 8): the store keeps the new ConfigMap, so the next pass does not create it again."""
    inf = Informer("ConfigMap", lambda scope: (None, ()), None, lambda o: "o")

    def cm(rv: int) -> dict:
        meta = {"name": "o-config", "namespace": "ns", "resourceVersion": str(rv)}
        return {"kind": "ConfigMap", "metadata": meta}

    inf._event("ADDED", cm(5))
    inf.wrote(cm(9))
    inf._event("DELETED", cm(8))
    assert inf.get("ns", "o-config")["metadata"]["resourceVersion"] == "9"
    inf._event("DELETED", cm(10))  # a later deletion still deletes
    assert inf.get("ns", "o-config") is None


# ----- while the spec is invalid ---------------------------------------------------------------------
# A spec the API server takes and the operator refuses (a host directory its administrator did not allow:
# the one rule the API server cannot check) rendered nothing, so no child was restored while it stood: a
# NetworkPolicy peer given `namespaceSelector: {}` stayed (the cluster tier: not restored in 20 s). The
# children are kept as the last valid spec rendered them.

def _invalid(obj: dict) -> tuple[dict, Exception]:
    from omnistage.api.validation import InvalidSpec
    from omnistage.render import target_from

    bad = copy.deepcopy(obj)
    bad["metadata"]["generation"] = 2
    bad["spec"]["modelVolume"] = {"mountPath": "/models", "hostPath": {"path": "/srv/models"}}
    with pytest.raises(InvalidSpec) as err:
        target_from(bad)
    return bad, err.value


def test_an_invalid_spec_keeps_the_children_the_last_valid_one_rendered():
    from omnistage.control.actions import Observed
    from omnistage.control.plan import plan

    from .test_plan import AT, cond, situation

    t, o = situation(3)
    valid = [a for a in plan(t, o, AT).actions if isinstance(a, EnsureChild)]
    bad, err = _invalid(o.obj)
    kept = plan(err, Observed(bad, last_valid=t), AT)
    assert [a for a in kept.actions if isinstance(a, EnsureChild)] == valid
    assert [a.obj["kind"] for a in valid] == ["ConfigMap", "Service", "Service", "NetworkPolicy",
                                              "PodDisruptionBudget"]
    assert cond(kept.status, "Ready")["reason"] == "InvalidSpec"  # and it still says why
    # No valid spec seen (a new OmniStage, or an operator restarted meanwhile): nothing to keep.
    assert not [a for a in plan(err, Observed(bad), AT).actions if isinstance(a, EnsureChild)]


def test_a_pass_of_an_invalid_spec_applies_the_last_valid_children(monkeypatch):
    from omnistage.runtime import memory, reconcile

    from .test_plan import situation

    t, o = situation(3)
    bad, _ = _invalid(o.obj)
    # Its last valid pass (raising=False: the store is new, and the code before it kept nothing).
    monkeypatch.setattr(memory, "LAST_VALID", {(t.namespace, t.name): o.obj}, raising=False)
    acted = []
    monkeypatch.setattr(reconcile.act_step, "act", 
                        lambda ns, actions, *a, **kw: acted.extend(actions) or Acted([], []))
    reconcile._reconcile(bad, lambda *e: None)
    assert [a.obj["metadata"]["name"] for a in acted if isinstance(a, EnsureChild)] == [
        f"{t.name}-config", t.name, f"{t.name}-master", f"{t.name}-head-engine", f"{t.name}-replicas"]
    # Another OmniStage of that name (a new uid) keeps nothing of the last one.
    acted.clear()
    reconcile._reconcile({**bad, "metadata": {**bad["metadata"], "uid": "another"}}, lambda *e: None)
    assert not [a for a in acted if isinstance(a, EnsureChild)]
