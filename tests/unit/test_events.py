"""Events aggregated like client-go's correlator, without patching (runtime/events.py): a refusal
repeated every pass makes a handful of Events carrying its count, not one per pass."""

from __future__ import annotations

import itertools

import pytest
from omnistage.runtime import events, handlers, kube

OBJ = {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStage",
       "metadata": {"name": "qwen3-omni", "namespace": "serving", "uid": "u-1"}}
REFUSED = ("Warning", "CreateRefused", 'pods "qwen3-omni-replica-1" is forbidden: exceeded quota: gpus')


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def posted():
    return []


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def correlator(posted, clock):
    def post(involved, etype, reason, message, count, first_timestamp):
        posted.append({"type": etype, "reason": reason, "message": message, "count": count,
                       "first": first_timestamp, "at": clock.now})
    return events.Correlator(post=post, clock=clock, wall=lambda: f"wall-{clock.now:.0f}")


def test_an_hour_of_one_refusal_every_pass_is_a_handful_of_events(correlator, posted, clock):
    for _ in range(720):  # one pass every 5 s for an hour, each refusing the same pod the same way
        correlator.emit(OBJ, *REFUSED)
        clock.now += 5
    assert [p["count"] for p in posted] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert {p["first"] for p in posted} == {"wall-1000"}, "every Event dates the series from its first occurrence"
    assert {(p["type"], p["reason"], p["message"]) for p in posted} == {REFUSED}


def test_a_problem_that_persists_always_has_a_live_event(correlator, posted, clock):
    """After the doubling slows, one every REPOST_SECONDS: the API server expires Events after an hour."""
    for _ in range(12 * 720):  # twelve hours
        correlator.emit(OBJ, *REFUSED)
        clock.now += 5
    gaps = [b["at"] - a["at"] for a, b in itertools.pairwise(posted)]
    assert max(gaps) <= events.REPOST_SECONDS
    assert len(posted) <= 10 + 12 * 3600 / events.REPOST_SECONDS


def test_a_different_message_reason_or_object_is_its_own_series(correlator, posted):
    correlator.emit(OBJ, *REFUSED)
    correlator.emit(OBJ, "Warning", "CreateRefused", "another refusal")
    correlator.emit(OBJ, "Normal", "Joined", REFUSED[2])
    correlator.emit({**OBJ, "metadata": {**OBJ["metadata"], "uid": "u-2"}}, *REFUSED)  # re-created
    assert [p["count"] for p in posted] == [1, 1, 1, 1]


def test_a_repeat_after_a_quiet_spell_is_news(correlator, posted, clock):
    for _ in range(3):
        correlator.emit(OBJ, "Normal", "ConfigRendered", "ConfigMap qwen3-omni-config rendered")
        clock.now += events.QUIET_SECONDS + 1
    assert [p["count"] for p in posted] == [1, 1, 1]


def test_forget_and_the_bound(correlator, posted, monkeypatch):
    correlator.emit(OBJ, *REFUSED)
    correlator.forget("serving", "qwen3-omni")
    correlator.emit(OBJ, *REFUSED)
    assert [p["count"] for p in posted] == [1, 1], "a forgotten OmniStage starts over"
    monkeypatch.setattr(events, "MAX_KEYS", 3)
    for i in range(5):
        correlator.emit(OBJ, "Warning", "CreateRefused", f"refusal {i}")
    assert len(correlator._series) == 3


def test_the_operators_emitter_aggregates_a_refusal_repeated_every_pass(monkeypatch):
    """What a reconcile pass calls (handlers._emitter): ten passes refusing the same pod post 4
    Events (counts 1, 2, 4, 8) through kube.post_event, not ten."""
    sent = []
    monkeypatch.setattr(kube, "post_event", lambda *a, **kw: sent.append((a[1:], kw["count"])))
    monkeypatch.setattr(handlers, "EVENTS", events.Correlator())
    emit = handlers._emitter(OBJ)
    for _ in range(10):
        emit(*REFUSED)
    assert sent == [(REFUSED, 1), (REFUSED, 2), (REFUSED, 4), (REFUSED, 8)]
