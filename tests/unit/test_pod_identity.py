"""An OmniStage's pods are found by their controller ownerReference, not by label (issue 27 item 5,
weakness 6 bullet 4 and weakness 7 bullet 1): a pod whose labels someone removed stays the
OmniStage's and gets them back, a pod that carries them without the reference is not adopted (never
the head, never sent the token), and a create refused with 409 by such a pod says so.

Before: the pods' store was fed by a label selector and a pod's role label said what it was. A head
without its role label was out of view (its Service had no endpoint, the operator's create got a
409 that kube.create swallowed); the newest pod labelled role=head was "the head" and was dialled
with the bearer token.
"""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException
from omnistage import names
from omnistage.api.conditions import EventReason
from omnistage.control import identity, pods
from omnistage.control.actions import DeletePod, Observed, PostEvent, RestoreLabels, Stray
from omnistage.control.plan import plan
from omnistage.render import render_head_pod
from omnistage.render.pods import head_pod_name
from omnistage.runtime import kube, memory, reconcile
from omnistage.runtime.informer import STATE, Informer

from .test_plan import AT, head, omnistage, replica, situation
from .test_plan import of as actions_of


def t_():
    from omnistage.render import target_from
    return target_from(omnistage(3))


def stripped(pod, *keys):
    pod["metadata"]["labels"] = {k: v for k, v in pod["metadata"]["labels"].items() if k not in keys}
    return pod


# ---- which pod is what, and its labels back ------------------------------------------------------

def test_a_head_without_its_role_label_is_the_head_and_gets_it_back():
    t = t_()
    h = stripped(head(t), names.L_ROLE)
    placed, strays = identity.sort_out(t, [h], set())
    assert [pods.role(p) for p in placed] == [names.ROLE_HEAD]
    assert [(s.labels, s.why) for s in strays] == [({names.L_ROLE: names.ROLE_HEAD},
                                                    f"its labels were changed ({names.L_ROLE} removed)")]


def test_a_replica_stripped_of_every_operator_label_is_placed_by_its_name():
    t = t_()
    r = stripped(replica(t, 2), *identity.OPERATOR_POD_LABELS)
    r["metadata"]["labels"]["team"] = "theirs"
    placed, strays = identity.sort_out(t, [r], set())
    assert placed[0]["metadata"]["labels"] == {**replica(t, 2)["metadata"]["labels"], "team": "theirs"}
    assert strays[0].labels == {k: v for k, v in replica(t, 2)["metadata"]["labels"].items()
                                if k in identity.OPERATOR_POD_LABELS}


def test_a_replica_relabelled_as_the_head_stays_a_replica():
    t = t_()
    r = replica(t, 1)
    r["metadata"]["labels"][names.L_ROLE] = names.ROLE_HEAD
    r["metadata"]["labels"][names.L_POOL] = "speech"
    placed, strays = identity.sort_out(t, [head(t), r], set())
    assert [pods.role(p) for p in placed] == [names.ROLE_HEAD, names.ROLE_REPLICA]
    assert names.L_POOL not in placed[1]["metadata"]["labels"]
    assert strays[0].labels == {names.L_ROLE: names.ROLE_REPLICA, names.L_POOL: None}


def test_an_owned_pod_the_operator_does_not_make_is_not_trusted():
    t = t_()
    odd = replica(t, 1)
    odd["metadata"]["name"] = "qwen3-omni-sidecar"
    placed, strays = identity.sort_out(t, [odd], set())
    assert placed == [] and strays[0].labels is None and "no name the operator gives" in strays[0].why


def test_a_successor_head_whose_hash_is_not_its_name_s_is_not_trusted():
    t = t_()
    h = head(t)
    want = pods.template_hash(h)
    h["metadata"]["name"] = head_pod_name(t, "abcdef" + want[6:])
    placed, strays = identity.sort_out(t, [h], set())
    assert (
        placed == []
        and strays[0].labels is None
        and "made for a template hash starting abcdef" in strays[0].why
    )
    h["metadata"]["name"] = head_pod_name(t, want)
    assert identity.sort_out(t, [h], set()) == ([h], ())


def test_a_pool_pod_is_placed_by_its_pool_s_name():
    t = t_()
    p = stripped(replica(t, 1), *identity.OPERATOR_POD_LABELS)
    p["metadata"]["name"] = "speech-3"
    placed, _ = identity.sort_out(t, [p], {"speech"})
    assert pods.role(placed[0]) == names.ROLE_POOL and pods.pool(placed[0]) == "speech"


@pytest.mark.parametrize(("other_role", "current", "restored"), [
    (None, True, names.ROLE_HEAD),  # alone: the head
    (names.ROLE_NEXT_HEAD, False, names.ROLE_HEAD),  # beside a successor: the head it succeeds
    (names.ROLE_OLD_HEAD, True, names.ROLE_HEAD),  # beside a draining old head: the head that took over
    (names.ROLE_HEAD, True, names.ROLE_NEXT_HEAD),  # beside the head, running the template now: the successor
    (names.ROLE_HEAD, False, names.ROLE_OLD_HEAD),  # beside the head, outdated: the old head, which drains
])
def test_a_head_that_lost_its_role_takes_the_one_its_head_change_leaves_it(other_role, current, restored):
    t = t_()
    lost = stripped(head(t, template="same" if current else "old"), names.L_ROLE)
    lost["metadata"]["name"] = (
        head_pod_name(t, pods.template_hash(lost)) if current else lost["metadata"]["name"]
    )
    heads = [lost]
    if other_role is not None:
        other = head(t, template="old" if current else "same")
        other["metadata"].update(
            uid="other-uid",
            name=head_pod_name(t, pods.template_hash(render_head_pod(t)))
            if not current
            else head_pod_name(t),
        )
        other["metadata"]["labels"][names.L_ROLE] = other_role
        heads.append(other)
    assert identity.restore_head_roles(t, heads) == {pods.uid(lost): restored}


def test_the_plan_writes_the_labels_back_first_and_deletes_the_untrusted():
    t, o = situation(3)
    untrusted = replica(t, 9)
    o = Observed(
        **{
            **o.__dict__,
            "strays": (
                Stray(o.head, {names.L_ROLE: names.ROLE_HEAD}, "its labels were changed"),
                Stray(untrusted, None, "not one the operator makes"),
            ),
        }
    )
    actions, _, _ = plan(t, o, AT)
    pod_actions = [a for a in actions if not isinstance(a, PostEvent) and type(a).__name__ != "EnsureChild"]
    assert pod_actions[:2] == [
        RestoreLabels(pods.name(o.head), pods.uid(o.head), {names.L_ROLE: names.ROLE_HEAD}),
        DeletePod(pods.name(untrusted), pods.uid(untrusted)),
    ]
    said = {(e.type, e.reason) for e in actions_of(actions, PostEvent)}
    assert {("Warning", EventReason.LABELS_RESTORED), ("Warning", EventReason.STRAY_POD)} <= said


# ---- the store keeps pods by owner, and observe dials only the OmniStage's head --------------------

def foreign(pod):
    """The pod as someone else would make it: the labels, no ownerReference."""
    pod["metadata"].pop("ownerReferences", None)
    return pod


def _owned_by(pod, name="qwen3-omni", uid="ost-uid"):
    pod["metadata"]["ownerReferences"] = [{"apiVersion": f"{names.GROUP}/v1alpha1", "kind": "OmniStage",
                                           "name": name, "uid": uid, "controller": True}]
    pod["metadata"]["resourceVersion"] = "1"
    return pod


def test_the_store_keeps_pods_by_their_controller_not_their_labels():
    t = t_()
    inf, told = STATE.pods.__class__("Pod", lambda scope: (None, ()), None, STATE.pods._owner,
                                     owned_only=True), []
    inf.on_change = lambda ns, name: told.append(name)
    look_alike = foreign(head(t))  # every label of the head, no ownerReference
    look_alike["metadata"].update(name="fake-head", resourceVersion="1")
    inf._event("ADDED", look_alike)
    ours = _owned_by(stripped(replica(t, 1), *identity.OPERATOR_POD_LABELS))
    ours["metadata"]["namespace"] = "serving"
    inf._event("ADDED", ours)
    assert [pods.name(p) for p in inf.owned("serving", "qwen3-omni")] == [pods.name(ours)]
    assert inf.get("serving", "fake-head") is None and told == ["qwen3-omni"]
    # Its ownerReference removed: no longer the OmniStage's, gone from its view, and its pass is told.
    orphan = {**ours, "metadata": {**ours["metadata"], "ownerReferences": [], "resourceVersion": "2"}}
    inf._event("MODIFIED", orphan)
    assert inf.owned("serving", "qwen3-omni") == [] and told == ["qwen3-omni", "qwen3-omni"]


def test_a_list_is_read_in_pages_and_keeps_only_owned_pods():
    calls = []

    class Resp:
        def __init__(self, data):
            self.data = json.dumps(data)

    def list_pods(**kw):
        calls.append(kw.get("_continue"))
        if kw.get("_continue") is None:
            return Resp({"metadata": {"continue": "page2", "resourceVersion": "5"},
                         "items": [_owned_by({"metadata": {"name": "a", "namespace": "ns"}})]})
        return Resp(
            {"metadata": {"resourceVersion": "5"}, "items": [{"metadata": {"name": "b", "namespace": "ns"}}]}
        )

    inf = Informer("Pod", lambda scope: (list_pods, ()), None, STATE.pods._owner, owned_only=True)
    assert inf._list("ns") == "5"
    assert calls == [None, "page2"] and [p["metadata"]["name"] for p in inf.all()] == ["a"]


@pytest.fixture
def stored():
    """Pods put in the operator's store for one test, taken out after it."""
    keys = []

    def put(pod):
        STATE.pods._event("ADDED", pod)
        keys.append((pod["metadata"]["namespace"], pods.name(pod)))
    yield put
    for key in keys:
        STATE.pods._delete(key, None)


def test_observe_never_takes_a_look_alike_for_the_head(stored, monkeypatch):
    """A pod someone labelled role=head, newer than the OmniStage's head: the head client (which
    carries the bearer token) is built for the OmniStage's own head. Before: for the look-alike."""
    obj = omnistage(3)
    t = t_()
    ours = _owned_by(head(t, ready=False))
    ours["status"]["podIP"] = "127.77.9.1"
    fake = foreign(head(t, ready=False))
    fake["metadata"].update(name="lookalike", uid="fake-uid", creationTimestamp="2026-12-01T00:00:00Z",
                            resourceVersion="1")
    fake["status"]["podIP"] = "127.77.9.2"
    stored(ours)
    stored(fake)
    monkeypatch.setattr(reconcile.drains_step.DRAINS, "states", lambda *a: {})
    observed, (client, _) = reconcile.observe(obj, t, "the-token")
    memory.forget(t.namespace, t.name)
    assert pods.name(observed.head) == pods.name(ours) and client is not None and client.ip == "127.77.9.1"


# ---- a 409 from a pod the OmniStage does not own is said, not swallowed -----------------------------

def test_a_create_refused_by_someone_else_s_pod_of_that_name_raises_saying_whose(monkeypatch):
    t = t_()
    want = render_head_pod(t)

    def conflict(namespace, obj):
        raise ApiException(status=409, reason="Conflict")
    monkeypatch.setattr(kube, "_creator", lambda kind: conflict)
    theirs = foreign(head(t))  # the same name and labels, made by someone else
    monkeypatch.setattr(kube, "read", lambda kind, ns, name: theirs)
    with pytest.raises(ApiException) as err:
        kube.create(want)
    assert err.value.status == 409
    said = kube.reason_of(err.value)
    assert said.startswith(f"pod {pods.name(want)} already exists and is not OmniStage qwen3-omni's: it has "
                           "no controller") and "delete or rename" in said
    ours = _owned_by(head(t))  # ours after all (a create retried before the watch delivered it)
    monkeypatch.setattr(kube, "read", lambda kind, ns, name: ours)
    assert kube.create(want) == ({**ours, "kind": "Pod"}, False)
