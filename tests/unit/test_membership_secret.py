"""The membership Secret (issue 27 item 5): re-created from the token the operator holds when an engine
pod is about to mount it and it is gone, or on the resync's full pass (issue 40 item 11), and adopted only
when its ownerReferences name this OmniStage's uid. No API server: kube.read and kube.create are
monkeypatched, and count the requests."""

from __future__ import annotations

import base64
import copy

import pytest
from omnistage.api.conditions import Reason, Type
from omnistage.control.actions import BesideServing, CreatePod, DeletePod, EnsureChild, OnSuccessor, PostEvent
from omnistage.control.plan import plan
from omnistage.render import render_secret, target_from
from omnistage.runtime import act as act_module
from omnistage.runtime import handlers, memory, reconcile

from tests.support.repo import SAMPLE

from .test_plan import AT, cond, head, replica, situation

UID = "ost-uid"
NAME = "qwen3-omni-membership"


def target():
    obj = copy.deepcopy(SAMPLE)
    obj["metadata"].update(namespace="serving", uid=UID)
    return target_from(obj)


def secret(token: str, owner_uid: str | None = UID, owner: str = "qwen3-omni") -> dict:
    obj = render_secret(target(), token)
    obj["metadata"]["ownerReferences"] = [] if owner_uid is None else [
        {**obj["metadata"]["ownerReferences"][0], "uid": owner_uid, "name": owner}]
    return obj


class FakeSecrets:
    """The one Secret of the namespace, and every request made for it."""

    def __init__(self, monkeypatch, stored: dict | None):
        self.stored, self.requests, self.events = stored, [], []
        monkeypatch.setattr(memory, "TOKENS", memory.Tokens())
        monkeypatch.setattr(reconcile.kube, "read", self.read)
        monkeypatch.setattr(reconcile.kube, "create", self.create)

    def read(self, kind, namespace, name):
        assert (kind, namespace, name) == ("Secret", "serving", NAME)
        self.requests.append("get")
        return copy.deepcopy(self.stored)

    def create(self, obj):
        self.requests.append("create")
        if self.stored is not None:  # 409: kube.create hands back the one that exists
            return copy.deepcopy(self.stored), False
        self.stored = copy.deepcopy(obj)
        return copy.deepcopy(obj), True

    def emit(self, etype, reason, message):
        self.events.append((etype, reason, message))

    def token(self) -> str:
        return base64.b64decode(self.stored["data"]["token"]).decode()


def test_no_secret_one_is_created_and_its_token_held(monkeypatch):
    api = FakeSecrets(monkeypatch, None)
    token, refused = reconcile.ensure_token(target(), api.emit)
    assert refused is None and token == api.token() and api.requests == ["get", "create"]
    assert memory.TOKENS.held("serving", "qwen3-omni", UID) == token
    # held: free
    assert reconcile.ensure_token(target(), api.emit) == (token, None) and len(api.requests) == 2


def test_its_own_secret_is_adopted(monkeypatch):
    api = FakeSecrets(monkeypatch, secret("t0k3n"))
    assert reconcile.ensure_token(target(), api.emit) == ("t0k3n", None) and api.requests == ["get"]


@pytest.mark.parametrize("owner_uid, owner, earlier", [
    (None, "", False), ("someone-elses-uid", "another", False), ("old-uid", "qwen3-omni", True)])
def test_a_secret_the_omnistage_does_not_own_is_refused_not_adopted(monkeypatch, owner_uid, owner, earlier):
    api = FakeSecrets(monkeypatch, secret("planted", owner_uid, owner))
    token, refused = reconcile.ensure_token(target(), api.emit)
    assert token is None and refused is not None and api.requests == ["get"]
    assert memory.TOKENS.held("serving", "qwen3-omni", UID) is None
    assert f"Secret {NAME} is not this OmniStage's" in refused and f"delete Secret {NAME}" in refused
    assert "another name" in refused and ("garbage collector" in refused) == earlier


def test_one_created_by_someone_else_in_between_is_checked_too(monkeypatch):
    api = FakeSecrets(monkeypatch, None)
    monkeypatch.setattr(reconcile.kube, "read", lambda *a: api.requests.append("get") or api.__setattr__(
        "stored", secret("raced", None)))  # gone when read, there when created: a 409
    token, refused = reconcile.ensure_token(target(), api.emit)
    assert token is None and "is not this OmniStage's" in refused and api.requests == ["get", "create"]


def test_a_deleted_secret_is_re_created_from_the_held_token_when_a_pod_mounts_it(monkeypatch):
    api = FakeSecrets(monkeypatch, secret("held-token"))
    assert reconcile.ensure_token(target(), api.emit) == ("held-token", None)
    api.stored = None  # kubectl delete secret
    assert reconcile.ensure_token(target(), api.emit) == ("held-token", None)  # no pod needs it: no request
    assert api.requests == ["get"]
    assert reconcile.ensure_token(target(), api.emit, read=True) == ("held-token", None)
    assert api.requests == ["get", "get", "create"] and api.token() == "held-token"
    assert api.stored["metadata"]["ownerReferences"][0]["uid"] == UID
    assert [(e[0], e[1]) for e in api.events] == [("Normal", "ChildSynced")] and NAME in api.events[0][2]
    assert reconcile.ensure_token(target(), api.emit, read=True) == ("held-token", None)
    assert api.requests[-1] == "get" and len(api.events) == 1  # there: read, nothing written


def test_a_planted_secret_is_refused_even_with_the_token_held(monkeypatch):
    api = FakeSecrets(monkeypatch, secret("held-token"))
    reconcile.ensure_token(target(), api.emit)
    api.stored = secret("planted", None)  # deleted, and one without an owner put in its place
    token, refused = reconcile.ensure_token(target(), api.emit, read=True)
    assert token == "held-token" and "is not this OmniStage's" in refused  # running engines keep theirs


# ----- the plan: when a pass reads the Secret, and what a refused one holds --------------------------------

def test_the_secret_is_read_only_when_a_pod_is_about_to_mount_it(monkeypatch):
    """A pod scheduled and mounting its volumes is seen by the pass (reconcile._mounting); a pod the
    decision creates is made sure of by act, once per step, just before the first one."""
    t, o = situation(3)
    assert not reconcile._mounting(o)  # at rest: no request
    starting = replica(t, 2, ready=False, phase="Pending")  # scheduled, its kubelet mounting volumes
    t, o = situation(3, pods_=lambda t: [replica(t, 1), starting])
    assert reconcile._mounting(o)
    unscheduled = {**starting, "spec": {}}
    t, o = situation(3, pods_=lambda t: [replica(t, 1), unscheduled])
    assert not reconcile._mounting(o)

    created, checks = [], []
    monkeypatch.setattr(act_module.kube, "create",
                        lambda obj: (created.append(obj["metadata"]["name"]) or obj, True))
    monkeypatch.setattr(act_module.credentials, "ensure", lambda pod, token, emit: None)
    monkeypatch.setattr(act_module.STATE, "wrote", lambda obj: None)

    def membership(why=None):
        return lambda: checks.append(why) or ("held-token", why)

    pod = lambda n: {"kind": "Pod", "metadata": {"name": n}}
    act_module.act("serving", [PostEvent("Normal", "r", "m")], None, lambda *e: None, "o",
                   membership=membership())
    assert checks == []  # no pod created: no request
    act_module.act("serving", [CreatePod(pod("a"), "r", "m"), OnSuccessor((CreatePod(pod("b"), "r", "m"),))],
                   None, lambda *e: None, "o", membership=membership())
    assert checks == [None] and created == ["a", "b"]  # once for the step, the successor's set included
    acted = act_module.act("serving", [CreatePod(pod("c"), "r", "m")], None, lambda *e: None, "o",
                           membership=membership("not this OmniStage's"))
    assert created == ["a", "b"] and acted.problems == ["pod c not created: not this OmniStage's"]


def test_a_refused_secret_creates_and_deletes_nothing_and_says_so_once():
    why = f"Secret {NAME} is not this OmniStage's: delete Secret {NAME}"
    t, o = situation(
        3,
        pods_=lambda t: [replica(t, 1), replica(t, 2, template="old")],
        head=lambda t: head(t),
        secret_refused=why,
    )
    actions, status, _ = plan(t, o, AT)
    assert not [a for a in actions if isinstance(a, CreatePod | DeletePod | BesideServing)]
    assert [a.obj["kind"] for a in actions if isinstance(a, EnsureChild)] == [
        "ConfigMap",
        "Service",
        "Service",
        "NetworkPolicy",
        "PodDisruptionBudget",
    ]  # tampered children still come back
    assert [(a.type, a.reason, a.message) for a in actions if isinstance(a, PostEvent)] == [
        ("Warning", Reason.NOT_SYNCED, why)]
    synced, ready = cond(status, Type.MEMBERSHIP_SYNCED), cond(status, Type.READY)
    assert (synced["status"], synced["reason"], synced["message"]) == ("False", "NotSynced", why)
    assert ready["status"] == "False" and why in ready["message"]
    again = plan(t, type(o)(**{**o.__dict__, "obj": {**o.obj, "status": status}}), AT)
    assert not [a for a in again.actions if isinstance(a, PostEvent)]  # said once


# ----- deleted while no pod needs it (issue 40 item 11): read again on the resync's full pass ------------
# Before, a held token was never checked against the Secret until a pod was about to mount it: a deleted
# Secret stayed gone, and an operator restarted meanwhile made a new token the running head refuses.

def test_a_deleted_secret_is_re_created_on_the_full_resync_with_no_pod_mounting_it(monkeypatch):
    api = FakeSecrets(monkeypatch, secret("held-token"))
    assert reconcile.ensure_token(target(), api.emit) == ("held-token", None)
    api.stored = None  # kubectl delete secret: no event reaches the operator
    assert reconcile.ensure_token(target(), api.emit) == ("held-token", None) and api.requests == ["get"]
    memory.TOKENS.recheck("serving", "qwen3-omni")  # the resync's full pass
    assert reconcile.ensure_token(target(), api.emit) == ("held-token", None)
    assert api.requests == ["get", "get", "create"] and api.token() == "held-token"
    assert [e[1] for e in api.events] == ["ChildSynced"] and "re-created" in api.events[0][2]
    assert reconcile.ensure_token(target(), api.emit) == ("held-token", None)
    assert len(api.requests) == 3  # once: held again, no request until the next full pass


def test_a_secret_planted_in_its_place_is_read_until_it_is_gone(monkeypatch):
    api = FakeSecrets(monkeypatch, secret("held-token"))
    reconcile.ensure_token(target(), api.emit)
    api.stored = secret("planted", None)
    memory.TOKENS.recheck("serving", "qwen3-omni")
    for _ in range(2):  # each pass says so again (MembershipSynced=False), not only the first
        token, refused = reconcile.ensure_token(target(), api.emit)
        assert token == "held-token" and "is not this OmniStage's" in refused


def test_the_resync_full_pass_rechecks_the_secret(monkeypatch):
    """Every FULL_RESYNC_SECONDS each OmniStage's full pass is queued with its Secret marked to be read."""
    monkeypatch.setattr(memory, "TOKENS", memory.Tokens())
    stage = {"metadata": {"namespace": "serving", "name": "qwen3-omni"}}
    monkeypatch.setattr(handlers.STATE.omnistages, "all", lambda: [stage])
    monkeypatch.setattr(handlers.leader, "is_leading", lambda: True)
    queued = []
    monkeypatch.setattr(handlers, "_run",
                        lambda ns, name: queued.append((ns, name, memory.TOKENS.due(ns, name))))
    monkeypatch.setattr(handlers.PROBES, "enqueue", lambda ns, name: None)
    ticks = round(handlers.FULL_RESYNC_SECONDS / handlers.RESYNC_SECONDS)

    def sleep(_):
        if len(sleeps) == ticks:
            raise StopIteration
        sleeps.append(1)

    sleeps: list[int] = []
    monkeypatch.setattr(handlers.time, "sleep", sleep)
    with pytest.raises(StopIteration):
        handlers._resync_forever()
    assert queued == [("serving", "qwen3-omni", True)]  # once per period, with the Secret to read
