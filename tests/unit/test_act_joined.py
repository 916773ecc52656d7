"""act(): the joined condition (the replica pods' readiness gate) is set only after every join of
the pod in the same run landed (issue 19). No API server, no head: both are monkeypatched."""

from __future__ import annotations

from omnistage.control.actions import Join, MarkJoined
from omnistage.runtime import act as act_module
from omnistage.runtime.act import act
from omnistage.runtime.head_client import HeadClient, HeadRefused

HEAD = HeadClient("127.0.0.1", 9, "token")


def _run(monkeypatch, refuse: set[str]) -> list[tuple[str, bool]]:
    marked: list[tuple[str, bool]] = []

    def join(client, pod, ip, stage=0):
        if pod in refuse:
            raise HeadRefused("join", 409, {"error": "ReplicaNotRegistered", "message": "not registered yet"})
        return {"replicaId": 7}

    monkeypatch.setattr(act_module.head_client, "join", join)
    monkeypatch.setattr(act_module.kube, "patch_pod_condition",
                        lambda ns, pod, uid, ctype, status, reason, message="": marked.append((pod, status)))
    act("ns", [Join("r-1", "u1", "127.0.0.11", (0,), "joined", mark=True),
               Join("r-2", "u2", "127.0.0.12", (0,), "joined", mark=True), MarkJoined("r-3", "u3", False)],
        HEAD, lambda *e: None, "ost")
    return marked


def test_a_pod_is_marked_joined_only_when_its_join_landed(monkeypatch):
    assert _run(monkeypatch, refuse={"r-2"}) == [("r-1", True), ("r-3", False)]
    assert _run(monkeypatch, refuse=set()) == [("r-1", True), ("r-2", True), ("r-3", False)]


def test_a_pool_pod_is_marked_joined_only_when_every_stage_joined(monkeypatch):
    marked, events = [], []

    def join(client, pod, ip, stage=0):
        if stage == 2:
            raise HeadRefused("join", 409, {"error": "ReplicaNotRegistered", "message": "not registered yet"})
        return {"replicaId": 4}

    monkeypatch.setattr(act_module.head_client, "join", join)
    monkeypatch.setattr(act_module.kube, "patch_pod_condition",
                        lambda ns, pod, uid, ctype, status, reason, message="": marked.append((pod, status)))
    said = "speech-1 joined stage {stage} as {replica}"
    acted = act("ns", [Join("speech-1", "u", "127.0.0.21", (1, 2), said, mark=True)], HEAD,
                lambda *e: events.append(e), "ost")
    assert marked == [] and [e[2] for e in events] == ["speech-1 joined stage 1 as 4"]
    assert acted.problems and "speech-1 has not joined yet" in acted.problems[0]
