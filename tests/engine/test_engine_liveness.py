"""Patch ``engine_liveness``: a stage-0 engine whose heartbeats stop while its process lives is kept,
unroutable, and routable again when they resume; the head's liveness path fails only once its own
engine is gone (issue 26).

Real here (vllm 0.30.0 / vllm-omni 0.30.0 on the CPU): the head's ``OmniCoordinator`` (a child
process forked from this one, with the plugin's wrapper inherited), its heartbeat timeout and
ERROR marking, the ``MembershipController`` watcher and ``handle_unregister``, the ``StagePool``
load balancer and request affinity, the HTTP app with the plugin's routes. Replicas register and
heartbeat through vllm-omni's own client code. Stood in: the EngineCore processes (see
``tests/standin/__init__.py``); a stall is made by holding the coordinator client's heartbeats,
which is what the coordinator sees of a SIGSTOPped, paused or partitioned engine (the real-engine
tier SIGSTOPs real engine cores: tests/cluster/real/test_engine_liveness.py).

Negative control (``python -m tests.engine.negative_controls engine_liveness``): with the patch
off every regression test here fails: upstream detaches the silent replica (and shuts the head's
own engine down), and the liveness path does not judge.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)")

from omnistage_engine_patches import contract

from tests.engine import test_membership_api as shared
from tests.engine.test_membership_api import _OPENER, _get_with_etag, bind_request, fresh_picks, start_replica
from tests.standin.engine import wait_quietly

# The membership tests' fixtures: a stand-in head with its HTTP app.
text_config, token_file, http_app, head = shared.text_config, shared.token_file, shared.http_app, shared.head

pytestmark = pytest.mark.engine

# Heartbeats come every 5 s (vllm-omni's stage client) and the coordinator checks every
# max(1, min(timeout/2, 5)) s: 8 s never times out a healthy replica and keeps each stall short.
TIMEOUT = 8.0


@contextlib.contextmanager
def heartbeats_held(coord: Any):
    """What the coordinator sees of a stalled engine (SIGSTOP, a paused VM, a partition): its
    heartbeats stop; its process, sockets and head-side client stay."""
    send = coord._send_event
    coord._send_event = lambda event_type: None if event_type == "heartbeat" else send(event_type)
    try:
        yield
    finally:
        del coord._send_event  # the class's method again


def live(api) -> tuple[int, dict[str, Any]]:
    try:
        with _OPENER.open(api.url + contract.LIVE_PATH, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_regression_a_silent_replica_is_kept_unroutable_and_serves_again(head):
    engine, api = head(heartbeat_timeout=TIMEOUT)
    replica = start_replica(engine)
    rid = replica.replica_id
    assert api.join("replica-a", replica.bind_ip)[0] == 200
    bind_request(engine, rid, "in-flight-1")  # a request the stall catches on it
    epoch = api.list()["epoch"]
    pool = engine.stage0
    t0 = time.monotonic()
    with heartbeats_held(replica.coord):
        wait_quietly("the replica to be listed silent",
                     lambda: api.members(all=True)[rid]["coordinatorStatus"] == contract.COORD_SILENT,
                     3 * TIMEOUT)
        went_silent = time.monotonic() - t0
        wait_quietly("its silence to be timed", lambda: "silentSeconds" in api.members()[rid], 2)
        m = api.members()[rid]
        assert (m["state"], m["attached"], m["pod"]) == (contract.ATTACHED, True, "replica-a")
        assert m["silentSeconds"] >= 0
        assert api.list()["epoch"] > epoch  # the operator's conditional probe sees it
        assert set(fresh_picks(engine, 6)) == {0}  # unroutable: new requests go to the live engine
        # Its request in flight waits for it (not failed as "stage replica disappeared").
        assert engine.on_loop(lambda: pool.get_bound_replica_id("in-flight-1")) == rid
        time.sleep(2 * 0.5)  # two more watcher ticks: still kept
        assert rid in engine.attached_replica_ids()
    t1 = time.monotonic()
    wait_quietly("its heartbeats to resume",
                 lambda: api.members()[rid]["coordinatorStatus"] == contract.COORD_UP,
                 2 * TIMEOUT)
    back = time.monotonic() - t1
    assert rid in set(fresh_picks(engine, 6))  # routable again
    print(f"silent after {went_silent:.1f}s without heartbeats (timeout {TIMEOUT}s); serving {back:.1f}s after "
          f"they resumed")


def test_a_leave_detaches_a_silent_replica(head):
    """The operator makes a silent replica leave when its pod is gone (or replaced): the leave
    detaches it at once and fails what was bound to it, whatever the watcher keeps."""
    engine, api = head(heartbeat_timeout=TIMEOUT)
    replica = start_replica(engine)
    rid = replica.replica_id
    assert api.join("replica-a", replica.bind_ip)[0] == 200
    replica.kill()  # no DOWN: heartbeats stop for good
    wait_quietly("the replica to be listed silent",
                 lambda: api.members()[rid]["coordinatorStatus"] == contract.COORD_SILENT,
                 3 * TIMEOUT)
    status, body = api.leave(pod="replica-a", replicaId=rid, drainTimeoutSeconds=0)
    assert (status, body["state"], body["detached"]) == (200, "left", True), body
    assert rid not in engine.attached_replica_ids()


def test_regression_the_head_s_own_engine_is_not_killed_by_a_stall(head):
    """issue 26: vllm-omni's watcher took the head's own late engine for a departure and shut it down."""
    engine, api = head(heartbeat_timeout=TIMEOUT)
    local = engine.stage0.clients[0]
    _, _, etag = _get_with_etag(api, contract.MEMBERSHIP_PATH, None)
    with heartbeats_held(engine._runtime.local_coord_client):
        wait_quietly("the head's own engine to be listed silent",
                     lambda: api.members()[0]["coordinatorStatus"] == contract.COORD_SILENT,
                     3 * TIMEOUT)
        # The operator's conditional probe sees it: the ETag it holds no longer matches.
        assert _get_with_etag(api, contract.MEMBERSHIP_PATH, etag)[0] == 200
        assert engine.stage0.clients[0] is local and not local.shut_down.is_set()
        status, body = live(api)
        assert (status, body["localEngine"]) == (200, contract.LOCAL_SILENT), body
    wait_quietly("its heartbeats to resume",
                 lambda: api.members()[0]["coordinatorStatus"] == contract.COORD_UP,
                 2 * TIMEOUT)
    assert engine.stage0.clients[0] is local
    assert live(api) == (200, {"localEngine": contract.LOCAL_LIVE, "reason": "stage-0 replica 0 attached"})


def health(api) -> int:
    """The head's /health: its pod's readiness probe."""
    try:
        with _OPENER.open(api.url + "/health", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_regression_the_head_is_ready_only_while_it_can_route_to_a_live_engine(head):
    """The head's readiness (/health) means "a request can be routed to a live stage-0 engine"
    (issue 26): 503 while its only engine is silent, 200 again once it resumes, and 200 throughout
    a silence of its own engine while a joined replica serves. Fails on a /health that counts a
    silent (kept) engine as live: the head stayed Ready, each request got "no live replica"."""
    engine, api = head(heartbeat_timeout=TIMEOUT)
    assert health(api) == 200
    with heartbeats_held(engine._runtime.local_coord_client):
        wait_quietly("the head's own engine to be listed silent",
                     lambda: api.members()[0]["coordinatorStatus"] == contract.COORD_SILENT,
                     3 * TIMEOUT)
        assert health(api) == 503
    wait_quietly("/health 200 once its heartbeats resume", lambda: health(api) == 200, 2 * TIMEOUT)
    replica = start_replica(engine)
    assert api.join("replica-a", replica.bind_ip)[0] == 200
    wait_quietly("the replica's first heartbeat",
                 lambda: api.members()[replica.replica_id]["coordinatorStatus"] == contract.COORD_UP,
                 2 * TIMEOUT)
    with heartbeats_held(engine._runtime.local_coord_client):
        wait_quietly("the head's own engine to be listed silent again",
                     lambda: api.members()[0]["coordinatorStatus"] == contract.COORD_SILENT,
                     3 * TIMEOUT)
        assert health(api) == 200  # the replica serves: still routable


def test_regression_the_liveness_path_fails_once_the_head_s_engine_is_gone(head):
    engine, api = head()
    assert live(api)[0] == 200
    engine.on_loop(lambda: engine.stage0.evict_replica(0))  # what the orchestrator does with a dead engine
    status, body = live(api)
    assert (status, body["localEngine"]) == (503, contract.LOCAL_GONE), body
    assert "bootId" not in body  # no token: it says nothing else about the head


def test_a_replica_that_said_down_is_detached_and_listed_until_it_leaves(head):
    """A graceful exit (DOWN) is not a stall: detached at once, as upstream does, and listed
    ``detached`` so the operator replaces its pod; a leave makes the head forget it."""
    engine, api = head(heartbeat_timeout=TIMEOUT)
    replica = start_replica(engine)
    rid = replica.replica_id
    assert api.join("replica-a", replica.bind_ip)[0] == 200
    replica.down()
    wait_quietly("the detach", lambda: api.members().get(rid, {}).get("state") == contract.DETACHED, 10)
    assert rid not in engine.attached_replica_ids()
    assert api.leave(pod="replica-a", replicaId=rid, drainTimeoutSeconds=0)[0] == 200
    assert rid not in api.members()
