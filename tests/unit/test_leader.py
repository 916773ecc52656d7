"""Leader election rules (operator/omnistage/runtime/leader.py): the pure decisions, then the Elector against
an in-memory Lease store with the API server's optimistic concurrency and a fake clock."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
from omnistage.runtime import leader
from omnistage.runtime.leader import ACQUIRE, CREATE, RENEW, WAIT, Elector, Timing, leading, lease_action


def lease(holder: str | None, version: str = "1", duration: int = 15) -> dict:
    return {"metadata": {"resourceVersion": version}, "spec": {"holderIdentity": holder,
                                                               "leaseDurationSeconds": duration}}


@pytest.mark.parametrize("record, observed_at, now, want", [
    (None, 0, 0, CREATE),                          # no Lease yet
    (lease("me"), 0, 100, RENEW),                  # mine, however old
    (lease("other"), 10, 10, WAIT),                # just seen changing
    (lease("other"), 10, 24.9, WAIT),              # unchanged for less than its duration
    (lease("other"), 10, 25, ACQUIRE),             # unchanged for its duration: expired
    (lease("other", duration=30), 10, 25, WAIT),   # the Lease's own duration counts, not ours
    (lease(None), 10, 10, ACQUIRE),                # released by a clean shutdown
    (lease(""), 10, 10, ACQUIRE),
])
def test_lease_action(record, observed_at, now, want):
    assert lease_action("me", record, observed_at, now) == want


@pytest.mark.parametrize("renewed_at, now, want", [
    (None, 0, False), (0, 0, True), (0, 9.9, True), (0, 10, False), (5, 14, True)])
def test_leading_lapses_after_the_renew_deadline(renewed_at, now, want):
    assert leading(renewed_at, now, 10) is want


def test_timing_must_stop_a_leader_before_a_follower_may_start():
    Timing()  # the defaults hold
    with pytest.raises(ValueError):
        Timing(duration=10, renew_deadline=10)
    with pytest.raises(ValueError):
        Timing(renew_period=10, renew_deadline=10)


class Store:
    """One Lease with resourceVersion preconditions (409 -> None, as lease.py returns). It cannot be
    watched, so a follower reads it every round (the polling fallback)."""

    def __init__(self):
        self.obj: dict | None = None
        self.version = 0
        self.fail = False
        self.calls: Counter = Counter()

    def _check(self):
        if self.fail:
            raise ConnectionError("API server unreachable")

    def read_lease(self, namespace, name):
        self.calls["read"] += 1
        self._check()
        return copy.deepcopy(self.obj)

    def _write(self, spec):
        self.version += 1
        self.obj = {"metadata": {"resourceVersion": str(self.version)}, "spec": copy.deepcopy(spec)}
        return copy.deepcopy(self.obj)

    def create_lease(self, namespace, name, spec):
        self.calls["create"] += 1
        self._check()
        return None if self.obj is not None else self._write(spec)

    def replace_lease(self, namespace, name, resource_version, spec):
        self.calls["replace"] += 1
        self._check()
        if self.obj is None or self.obj["metadata"]["resourceVersion"] != resource_version:
            return None
        return self._write(spec)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def pair():
    store, clock = Store(), Clock()
    a = Elector("ns", "a", client=store, clock=clock, wall=lambda: "T")
    b = Elector("ns", "b", client=store, clock=clock, wall=lambda: "T")
    return store, clock, a, b


def test_first_creates_and_leads_second_follows():
    store, _, a, b = pair()
    assert a.step() == leader.RENEW_PERIOD and a.is_leading()
    assert b.step() == leader.RETRY_PERIOD and not b.is_leading()
    assert store.obj["spec"]["holderIdentity"] == "a" and store.obj["spec"]["leaseTransitions"] == 0


def test_follower_takes_over_only_after_the_lease_duration_of_silence():
    store, clock, a, b = pair()
    a.step()
    b.step()                       # b first sees a's Lease at t0
    t0 = clock.t
    # a dies (SIGKILL): nobody renews. b looks every RETRY_PERIOD.
    while clock.t - t0 < leader.LEASE_DURATION - 0.01:
        clock.t += 1
        b.step()
        assert not b.is_leading() or clock.t - t0 >= leader.LEASE_DURATION, clock.t - t0
    clock.t = t0 + leader.LEASE_DURATION
    b.step()
    assert b.is_leading() and store.obj["spec"]["holderIdentity"] == "b"
    assert store.obj["spec"]["leaseTransitions"] == 1
    # a comes back (same identity would renew; a new one) and follows: it saw a new version.
    assert not a.is_leading()
    a.step()
    assert not a.is_leading() and store.obj["spec"]["holderIdentity"] == "b"


def test_renewals_keep_the_follower_waiting():
    _, clock, a, b = pair()
    a.step()
    b.step()
    for _ in range(20):            # 100 s of renewals every RENEW_PERIOD, b looking in between
        clock.t += leader.RENEW_PERIOD / 2
        b.step()
        clock.t += leader.RENEW_PERIOD / 2
        a.step()
        assert a.is_leading() and not b.is_leading()


def test_a_leader_cut_off_stops_before_anybody_may_start():
    store, clock, a, b = pair()
    a.step()
    b.step()
    renewed = clock.t
    store.fail = True              # a cannot reach the API server; b, elsewhere, can
    clock.t += leader.RENEW_DEADLINE - 0.1
    assert a.step() == leader.RETRY_PERIOD and a.is_leading()
    clock.t = renewed + leader.RENEW_DEADLINE
    a.step()
    assert not a.is_leading()      # stopped acting at renewed + RENEW_DEADLINE...
    store.fail = False
    clock.t = renewed + leader.LEASE_DURATION - 0.1
    b.step()
    assert not b.is_leading()      # ...before b may start at (b's first look) + LEASE_DURATION
    clock.t = renewed + leader.LEASE_DURATION
    b.step()
    assert b.is_leading()


def test_of_two_racing_for_an_expired_lease_exactly_one_wins():
    store, clock, a, b = pair()
    c = Elector("ns", "c", client=store, clock=clock, wall=lambda: "T")
    c.step()                       # c led, then died
    a.step()
    b.step()
    clock.t += leader.LEASE_DURATION
    # Both read the same version; a writes first, b's PUT carries the stale version.
    stale = store.read_lease("ns", "x")
    a.step()
    real_read = store.read_lease
    store.read_lease = lambda ns, name: stale
    b.step()
    store.read_lease = real_read
    assert a.is_leading() and not b.is_leading()
    assert store.obj["spec"]["holderIdentity"] == "a"


def test_release_hands_over_at_the_next_look():
    store, clock, a, b = pair()
    a.step()
    b.step()
    a.release()
    assert not a.is_leading() and not store.obj["spec"]["holderIdentity"]
    clock.t += leader.RETRY_PERIOD
    b.step()
    assert b.is_leading()


def test_no_election_means_leading():
    leader.configure(None)
    assert leader.is_leading()
    _, _, a, _ = pair()
    leader.configure(a)
    try:
        assert not leader.is_leading()
        a.step()
        assert leader.is_leading()
    finally:
        leader.configure(None)


def test_default_namespace_and_identity(monkeypatch, tmp_path):
    monkeypatch.setenv("POD_NAMESPACE", "ops")
    monkeypatch.setenv("POD_NAME", "omnistage-operator-abc")
    assert leader.default_namespace() == "ops" and leader.default_identity() == "omnistage-operator-abc"
    monkeypatch.delenv("POD_NAMESPACE")
    monkeypatch.delenv("POD_NAME")
    monkeypatch.setattr(leader, "SA_NAMESPACE_FILE", str(tmp_path / "absent"))
    assert leader.default_namespace() is None  # outside a cluster: no election
    (tmp_path / "ns").write_text("omnistage-system\n")
    monkeypatch.setattr(leader, "SA_NAMESPACE_FILE", str(tmp_path / "ns"))
    assert leader.default_namespace() == "omnistage-system"
    assert leader.default_identity().endswith(f"-{__import__('os').getpid()}")


# ----- at rest: what the Lease costs the API server ---------------------------------------------------

class WatchedStore(Store):
    """A Store that can also be watched. A watch plays `script`: "renew" (the leader renews after
    RENEW_PERIOD, delivered as an event), "release" (the leader releases, delivered), "end" (the
    server closes the watch) or "silence" (nothing for the idle timeout: the read times out)."""

    def __init__(self, clock, script):
        super().__init__()
        self.clock, self.script, self.leader = clock, list(script), None

    def watch_lease(self, namespace, name, resource_version, idle_timeout):
        self.calls["watch"] += 1
        while self.script:
            step = self.script.pop(0)
            if step == "end":
                return
            if step == "silence":
                self.clock.t += idle_timeout
                raise TimeoutError("read timed out")
            if step == "error":
                raise RuntimeError("410 Gone")
            if step == "renew":
                self.clock.t += leader.RENEW_PERIOD
                self.leader.step()
            elif step == "release":
                self.leader.release()
            yield copy.deepcopy(self.obj)
        raise AssertionError("the follower watched beyond the script")


def watched_pair(script):
    clock = Clock()
    store = WatchedStore(clock, script)
    a = Elector("ns", "a", client=store, clock=clock, wall=lambda: "T")
    b = Elector("ns", "b", client=store, clock=clock, wall=lambda: "T")
    store.leader = a
    a.step()
    b.step()
    return store, clock, a, b


def test_a_leader_at_rest_writes_once_per_renewal_and_never_reads():
    store, clock, a, _ = pair()
    a.step()
    calls = Counter(store.calls)
    for _ in range(int(60 / leader.RENEW_PERIOD)):
        clock.t += leader.RENEW_PERIOD
        assert a.step() == leader.RENEW_PERIOD and a.is_leading()
    per_minute = store.calls - calls
    assert per_minute == Counter(replace=60 / leader.RENEW_PERIOD), per_minute
    assert sum(per_minute.values()) < 10  # issue 10: < 10 API requests a minute at rest, in total


def test_a_watching_follower_makes_no_request_per_renewal():
    store, clock, _a, b = watched_pair(["renew"] * 12 + ["end"] + ["renew"] * 6 + ["silence"])
    before = Counter(store.calls)
    t0 = clock.t
    assert b.follow() == 0.0      # 18 renewals (3 minutes), then the leader fell silent
    assert Counter(store.calls) - before == Counter(watch=2, replace=18), store.calls - before
    assert not b.is_leading() and clock.t - t0 >= 18 * leader.RENEW_PERIOD + leader.LEASE_DURATION
    b.step()                      # silent for the whole lease: taken over without a read
    assert b.is_leading() and store.obj["spec"]["holderIdentity"] == "b"
    assert store.calls["read"] == 2  # a's and b's first looks only


def test_a_watching_follower_never_takes_over_while_renewals_arrive():
    store, _clock, a, b = watched_pair(["renew"] * 30 + ["end"])
    b._stop.set()                  # ends follow() once the script is played (its loop checks it)
    b.follow()
    b._stop.clear()
    b.step()
    assert a.is_leading() and not b.is_leading() and store.obj["spec"]["holderIdentity"] == "a"


def test_the_watch_sees_a_release_at_once():
    _store, clock, _a, b = watched_pair(["release"])
    t0 = clock.t
    assert b.follow() == 0.0
    b.step()
    assert b.is_leading() and clock.t == t0  # no lease duration waited


def test_a_failed_watch_makes_the_follower_read():
    store, _, _a, b = watched_pair(["error"])
    assert b.follow() == leader.RETRY_PERIOD
    b.step()
    assert store.calls["read"] == 3 and not b.is_leading()  # a's and b's first looks, then b's read


def test_a_follower_that_saw_a_renewal_misses_nothing_on_a_stale_write():
    """A 409 (someone wrote after what this replica knew) never makes it lead, and it reads next."""
    store, _clock, a, b = watched_pair(["silence"])
    b.follow()                     # b's watch timed out, but a renewed over a connection b never saw
    a.step()
    b.step()                       # b acts on its stale record: PUT with the old version -> 409
    assert not b.is_leading() and store.obj["spec"]["holderIdentity"] == "a"
    b.step()
    assert store.calls["read"] == 3 and not b.is_leading()  # the first looks, then b's read
