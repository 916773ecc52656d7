"""Each replica and pool pod's own membership credential (issue 27 item 6): act writes Secret
POD-membership (contract.pod_credential of the master token) before it creates the pod, never mounts
one the OmniStage does not own, and a pass re-creates a deleted one while its pod is still mounting
it. No API server: kube.create is monkeypatched and records every request."""

from __future__ import annotations

import base64
import copy

from omnistage.control.actions import CreatePod
from omnistage.render import render_head_pod, render_replica_pod, target_from
from omnistage.runtime import act as act_module
from omnistage.runtime import credentials
from omnistage_engine_patches import contract

from tests.support.repo import SAMPLE

from .test_plan import HEAD_IP, HEAD_UID, replica

MASTER = "master-token"


def target():
    obj = copy.deepcopy(SAMPLE)
    obj["spec"]["replicas"] = 3
    obj["metadata"].update(namespace="serving", uid="ost-uid")
    return target_from(obj)


class FakeApi:
    """Creates objects into `stored` (by kind and name); a create of a stored name answers it (409)."""

    def __init__(self, monkeypatch, stored=()):
        self.stored = {(o["kind"], o["metadata"]["name"]): copy.deepcopy(o) for o in stored}
        self.requests: list[tuple[str, str]] = []
        self.events: list[tuple[str, str, str]] = []
        monkeypatch.setattr(act_module.kube, "create", self.create)

    def create(self, obj):
        key = (obj["kind"], obj["metadata"]["name"])
        self.requests.append(key)
        if key in self.stored:
            return copy.deepcopy(self.stored[key]), False
        self.stored[key] = copy.deepcopy(obj)
        return copy.deepcopy(obj), True

    def emit(self, etype, reason, message):
        self.events.append((etype, reason, message))

    def token(self, name):
        return base64.b64decode(self.stored[("Secret", name)]["data"]["token"]).decode()


def create(api: FakeApi, pod, token=MASTER) -> list[str]:
    return act_module.act(
        "serving", [CreatePod(pod, "ScaledUp", "created {pod}")], None, api.emit, "qwen3-omni", token=token
    ).problems


def test_a_replica_pod_s_credential_is_written_before_the_pod(monkeypatch):
    api, t = FakeApi(monkeypatch), target()
    assert create(api, render_replica_pod(t, 2, HEAD_IP, HEAD_UID)) == []
    assert api.requests == [("Secret", "qwen3-omni-replica-2-membership"), ("Pod", "qwen3-omni-replica-2")]
    assert api.token("qwen3-omni-replica-2-membership") == contract.pod_credential(
        MASTER, "qwen3-omni-replica-2"
    )
    # A head mounts the master token (NAME-membership, reconcile.ensure_token): no credential of its own.
    assert create(api, render_head_pod(t)) == [] and api.requests[-1] == ("Pod", "qwen3-omni-head")
    # The same name again (a replaced pod): the Secret is kept, it holds the same credential.
    assert create(api, render_replica_pod(t, 2, HEAD_IP, HEAD_UID)) == [] and api.events[-1][0] == "Normal"


def test_a_secret_of_that_name_the_omnistage_does_not_own_is_never_mounted(monkeypatch):
    """Fails on a create that takes whatever Secret answers the 409: the name is also the master
    Secret of an OmniStage named like the pod, whose token the replica would then hold."""
    t = target()
    pod = render_replica_pod(t, 1, HEAD_IP, HEAD_UID)
    foreign = {"kind": "Secret", "metadata": {"name": "qwen3-omni-replica-1-membership", "ownerReferences": [
        {"kind": "OmniStage", "name": "qwen3-omni-replica-1", "uid": "another-uid"}]},
        "data": {"token": base64.b64encode(b"another-master-token").decode()}}
    api = FakeApi(monkeypatch, [foreign])
    [why] = create(api, pod)
    assert "Secret qwen3-omni-replica-1-membership" in why and "OmniStage qwen3-omni-replica-1" in why
    assert ("Pod", "qwen3-omni-replica-1") not in api.requests
    assert api.events and api.events[-1][0] == "Warning"
    # Without a master token there is nothing to derive the credential from: no pod either.
    api = FakeApi(monkeypatch)
    [why] = create(api, pod, token=None)
    assert "holds no membership token" in why and api.requests == []


def test_an_earlier_token_s_credential_is_said_and_the_pod_still_made(monkeypatch):
    t = target()
    pod = render_replica_pod(t, 1, HEAD_IP, HEAD_UID)
    from omnistage.render.network import render_pod_credential

    stale = render_pod_credential(pod, "an-earlier-master-token")
    api = FakeApi(monkeypatch, [stale])
    assert create(api, pod) == [] and api.requests[-1] == ("Pod", "qwen3-omni-replica-1")
    assert "earlier membership token" in api.events[0][2] and api.events[0][0] == "Warning"


def test_a_deleted_credential_is_written_again_while_its_pod_mounts_it(monkeypatch):
    t = target()
    api = FakeApi(monkeypatch)
    mounting = replica(t, 1, phase="Pending", ready=False)
    running = replica(t, 2)
    assert credentials.ensure_mounting([mounting, running, None], MASTER, api.emit) == []
    assert api.requests == [("Secret", "qwen3-omni-replica-1-membership")]
