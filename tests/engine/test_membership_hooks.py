"""The membership patch's hooks in a distributed vllm-omni head, without the HTTP API: its negative control.

Real here (vllm 0.30.0 / vllm-omni 0.30.0 on the CPU), as in test_membership_api.py: the head's
``OmniMasterServer`` and ``OmniCoordinator``, the real ``Orchestrator``, ``MembershipController`` and
``StagePool``; replicas register and heartbeat through vllm-omni's own client code. Stood in: the
EngineCore processes (``tests/standin``).

Each test sets what the endpoint's operations set (a draining or held mark, a leave's record) or what
happens to a head (an attach that fails or is still running, a replica's DOWN, a shutdown) and reads
what only the patch's wrappers make of it: fresh picks (``StagePool._collect_serviceable_replicas``),
the attach and detach bookkeeping (``MembershipController._do_register`` and ``_detach_replica``), the
end of ``OrchestratorBase.run``. test_membership_api.py cannot be the control: with the patch off every
route answers 503 MembershipPatchDisabled, so its tests would fail for that, whatever the hooks do.

Negative control (tests/engine/negative_controls.py): with ``OMNISTAGE_DISABLE_PATCHES=membership`` every
regression test here fails (upstream routes to a draining or unjoined replica, keeps a replica attached
after it was told to leave, records no replica the head dropped, and its distributed head never stops:
its shutdown gives up after 30 s, here and at the end of the module's shared head).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)")

from omnistage_engine_patches import contract
from omnistage_engine_patches.patches.membership import draining_of, held_of, state_of

from tests.engine.test_membership_api import bind_request, fresh_picks, start_replica
from tests.standin.engine import build_vllm_config, standin_head, wait_quietly
from tests.standin.replica import SimulatedReplica
from tests.support.engine_env import patch_applied
from tests.support.loopback import loopback_ip
from tests.support.tiny_models import build_config_only_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def text_config(tmp_path_factory):
    return build_vllm_config(build_config_only_model(tmp_path_factory.mktemp("standin-model")), "tiny")


@pytest.fixture(scope="module")
def engine(text_config):
    """One stand-in head for the module: each test's replicas go down at its end, and a head's shutdown
    without the patch waits out upstream's 30 s once instead of once per test."""
    with standin_head(text_config, loopback_ip()) as head:
        yield head


def departed(engine: Any, replica_id: int) -> str | None:
    """What the patch's state says of a replica of stage 0 that departed (LEFT, DETACHED), else None."""
    return engine.on_loop(lambda: state_of(engine.orchestrator).departed.get((0, replica_id)))


def test_the_patch_is_applied(engine_patches):
    assert patch_applied(contract.MEMBERSHIP)


def test_regression_a_draining_replica_gets_no_fresh_picks(engine):
    """regression: a leave marks the replica draining; new requests go elsewhere while the one bound to
    it (sticky affinity) still goes there."""
    replica = start_replica(engine)
    rid, pool = replica.replica_id, engine.stage0
    try:
        bind_request(engine, rid, "chat-1")
        assert rid in fresh_picks(engine, 6), "routed to before the leave"
        engine.on_loop(lambda: draining_of(pool).add(rid))
        assert rid not in fresh_picks(engine, 6), "a draining replica got a new request"
        assert engine.on_loop(lambda: pool.pick("chat-1")) == rid, "its request in flight moved"
    finally:
        engine.on_loop(lambda: (draining_of(pool).discard(rid), pool.release_binding("chat-1")))
        replica.down()


def test_regression_a_replica_registered_behind_the_gate_is_held(engine, monkeypatch):
    """regression: with contract.ROUTE_JOINED_ONLY_ENV=1 (the operator sets it) a replica's own
    registration attaches it held: fresh picks never choose it before the operator joins it."""
    monkeypatch.setenv(contract.ROUTE_JOINED_ONLY_ENV, "1")
    replica = start_replica(engine)
    rid = replica.replica_id
    try:
        assert rid in engine.attached_replica_ids()
        assert engine.on_loop(lambda: rid in held_of(engine.stage0)), "attached without the hold"
        assert rid not in fresh_picks(engine, 8), "an unjoined replica got a new request"
    finally:
        engine.on_loop(lambda: held_of(engine.stage0).discard(rid))
        replica.down()


def test_regression_a_replica_told_to_leave_while_attaching_is_detached_once_attached(engine, monkeypatch):
    """regression: the operator's leave comes while the head still attaches the replica (its EngineCore
    handshake); the attach completes afterwards, and the head detaches it at once instead of keeping a
    member nobody manages (a zombie)."""
    controller = engine.orchestrator._membership
    attach, release = controller._remote_replica_factory, threading.Event()

    def slow_attach(stage_id: int, replica_id: int) -> Any:
        release.wait(30)  # the handshake is still running when the leave is recorded
        return attach(stage_id, replica_id)

    monkeypatch.setattr(controller, "_remote_replica_factory", slow_attach)
    replica = SimulatedReplica(engine._omni_master_address, engine._omni_master_port, loopback_ip()).start()
    rid = replica.replica_id
    try:
        # What the endpoint's leave records for a replica it could not detach yet (membership_departures).
        engine.on_loop(lambda: state_of(engine.orchestrator).remember_left(
            (0, rid), {"stage": 0, "replicaId": rid, "state": contract.LEFT, "detached": False}))
        release.set()
        client = wait_quietly("the late attach", lambda: next(
            (c for c in engine._runtime.remote_clients if c.replica_id == rid), None), 10)
        wait_quietly("the head to detach it", client.shut_down.is_set, 10)
        assert rid not in engine.attached_replica_ids()
    finally:
        release.set()
        replica.down()


def test_regression_a_failed_attach_is_recorded_as_detached(engine, monkeypatch):
    """regression: a registration the head fails to attach (a handshake error) is recorded as dropped,
    not left registered for the life of the head."""
    controller = engine.orchestrator._membership

    def broken(stage_id: int, replica_id: int) -> Any:
        raise RuntimeError("injected handshake failure")

    monkeypatch.setattr(controller, "_remote_replica_factory", broken)
    replica = SimulatedReplica(engine._omni_master_address, engine._omni_master_port, loopback_ip()).start()
    try:
        wait_quietly("the failed attach recorded", lambda: departed(engine, replica.replica_id) == contract.DETACHED,
                     10)
    finally:
        replica.down()


def test_regression_a_replica_the_head_drops_is_recorded_and_unmarked(engine):
    """regression: the head detaches a replica on its own (its DOWN): the patch records it as detached
    (listed so the operator replaces its pod) and clears its draining and held marks."""
    replica = start_replica(engine)
    rid, pool = replica.replica_id, engine.stage0
    engine.on_loop(lambda: (draining_of(pool).add(rid), held_of(pool).add(rid)))
    replica.down()
    wait_quietly("the head to drop it", lambda: rid not in engine.attached_replica_ids(), 10)
    wait_quietly("the drop recorded", lambda: departed(engine, rid) == contract.DETACHED, 10)
    assert engine.on_loop(lambda: rid not in draining_of(pool) and rid not in held_of(pool))


def test_regression_a_distributed_head_shuts_down(text_config):
    """regression: a distributed head stops: orchestrator thread gone, master and coordinator closed.

    vllm-omni 0.30.0 alone never finishes ``OrchestratorBase.run`` on a distributed head (the
    membership watcher it gathers stops only on an event set after the gather): shutdown gives up
    after 30 s and defers the runtime cleanup to a thread that waits forever. The membership
    patch sets that event when the orchestrator's shutdown begins."""
    with standin_head(text_config, loopback_ip()) as head:
        replica = start_replica(head)
        runtime = head._runtime
        coordinator = runtime._coordinator_runtime
    try:
        assert not head.orchestrator_thread.is_alive()
        assert runtime._omni_master_server is None and runtime._coordinator_runtime is None
        assert not coordinator._proc.is_alive()
    finally:
        replica.down()
