"""Events aggregated like client-go's correlator, without patching (runtime/events.py): a refusal
repeated every pass makes a handful of Events carrying its count, not one per pass; one that says
something different every time is combined after MAX_SIMILAR different messages."""

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
    assert {p["first"] for p in posted} == {"wall-1000"}, (
        "every Event dates the series from its first occurrence"
    )
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


def refusal(i: int) -> tuple[str, str, str]:
    return "Warning", "CreateRefused", f'pods "qwen3-omni-replica-{i}" is forbidden: exceeded quota: gpus'


def test_thirty_different_refusals_in_ten_minutes_are_combined(correlator, posted, clock):
    """One refused pod after another, each message its own: the first MAX_SIMILAR - 1 get Events of
    their own, the rest one combined series with the newest message and a running count."""
    for i in range(1, 31):  # one every 20 s: 30 in 10 minutes, never QUIET_SECONDS apart
        correlator.emit(OBJ, *refusal(i))
        clock.now += 20
    alone = events.MAX_SIMILAR - 1
    assert [p["message"] for p in posted[:alone]] == [refusal(i)[2] for i in range(1, alone + 1)]
    assert [p["count"] for p in posted[:alone]] == [1] * alone
    combined = posted[alone:]
    assert [p["count"] for p in combined] == [1, 2, 4, 8, 16]  # 21 combined occurrences
    assert [p["message"] for p in combined] == [
        events.COMBINED_PREFIX + refusal(alone + c)[2] for c in (1, 2, 4, 8, 16)
    ], "the newest message each time"
    assert {p["first"] for p in combined} == {f"wall-{1000 + 20 * alone:.0f}"}, (
        "dated from the first combined one"
    )
    assert len(posted) == alone + 5


def test_a_combined_group_keeps_combining_even_its_earlier_messages(correlator, posted):
    for i in range(1, events.MAX_SIMILAR + 1):
        correlator.emit(OBJ, *refusal(i))
    correlator.emit(OBJ, *refusal(1))  # said before, on its own; now the combined series' second
    assert [(p["count"], p["message"].startswith(events.COMBINED_PREFIX)) for p in posted[-2:]] == [
        (1, True), (2, True)]


def test_different_reasons_types_and_objects_are_not_combined(correlator, posted):
    other = {**OBJ, "metadata": {**OBJ["metadata"], "uid": "u-2"}}  # re-created under the same name
    for i in range(events.MAX_SIMILAR - 1):
        correlator.emit(OBJ, "Warning", "CreateRefused", f"refusal {i}")
        correlator.emit(OBJ, "Warning", "LeaveFailed", f"leave {i}")
        correlator.emit(OBJ, "Normal", "CreateRefused", f"normal {i}")
        correlator.emit(other, "Warning", "CreateRefused", f"refusal {i}")
    assert len(posted) == 4 * (events.MAX_SIMILAR - 1)
    assert not any(p["message"].startswith(events.COMBINED_PREFIX) for p in posted)


def test_a_quiet_spell_starts_the_group_over(correlator, posted, clock):
    for i in range(events.MAX_SIMILAR - 1):
        correlator.emit(OBJ, *refusal(i))
    clock.now += events.QUIET_SECONDS
    for i in range(100, 100 + events.MAX_SIMILAR - 1):  # with the first nine these would be combined
        correlator.emit(OBJ, *refusal(i))
    assert len(posted) == 2 * (events.MAX_SIMILAR - 1)
    assert not any(p["message"].startswith(events.COMBINED_PREFIX) for p in posted)
    correlator.emit(OBJ, *refusal(200))  # the tenth different message since the quiet spell
    assert posted[-1]["message"] == events.COMBINED_PREFIX + refusal(200)[2]


def test_forget_and_the_bound(correlator, posted, monkeypatch):
    correlator.emit(OBJ, *REFUSED)
    correlator.forget("serving", "qwen3-omni")
    correlator.emit(OBJ, *REFUSED)
    assert [p["count"] for p in posted] == [1, 1], "a forgotten OmniStage starts over"
    monkeypatch.setattr(events, "MAX_KEYS", 3)
    for i in range(5):
        correlator.emit(OBJ, "Warning", f"Reason{i}", f"refusal {i}")
    assert len(correlator._series) == 3
    assert len(correlator._groups) == 3


def test_forget_drops_the_similar_messages_too(correlator, posted):
    for i in range(events.MAX_SIMILAR - 1):
        correlator.emit(OBJ, *refusal(i))
    correlator.forget("serving", "qwen3-omni")
    correlator.emit(OBJ, *refusal(100))
    assert posted[-1]["message"] == refusal(100)[2], "a forgotten OmniStage's group starts over"


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
