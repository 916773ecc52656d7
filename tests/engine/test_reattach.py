"""Patch ``reattach`` on the engine tier: the head answers a replica's ping, and the old head's
input thread of an engine core is stopped for good.

Real here (vllm 0.30.0 / vllm-omni 0.30.0 on the CPU, the plugin loaded through vLLM's plugin
loader by conftest's ``engine_patches``): vllm-omni's ``OmniMasterServer`` on a loopback port and
its own ``register_stage_with_omni_master`` (as a headless launcher calls it, so through the
plugin's wrappers); vLLM's own ``EngineCoreProc.process_input_sockets`` thread, connected to a ZMQ
ROUTER that stands for the head's input socket. Stood in: the engine core object around that thread
(no executor, no model: the thread reads only the queues and the ready response this test gives it).
The whole re-attach of a real engine core under a stream runs in the real-engine tier
(tests/cluster/real/test_head_failure.py).

Negative control (tests/engine/negative_controls.py): with ``OMNISTAGE_DISABLE_PATCHES=reattach``
the two regression tests fail (the ping gets no answer; the input thread never stops).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)")

import zmq
from omnistage_engine_patches import contract, reattach_engine
from omnistage_engine_patches.patches import reattach
from vllm.v1.engine.core import EngineCoreProc
from vllm_omni.engine import stage_engine_startup

from tests.support.loopback import loopback_ip
from tests.support.ports import free_port

pytestmark = pytest.mark.engine


@pytest.fixture
def master(engine_patches, monkeypatch):
    for key in (reattach_engine.ENV_MASTER, reattach_engine.ENV_STAGE, reattach_engine.ENV_REPLICA,
                reattach_engine.ENV_INSTANCE, reattach_engine.ENV_BIND):
        monkeypatch.delenv(key, raising=False)
    ip = loopback_ip()
    server = stage_engine_startup.OmniMasterServer(ip, free_port(ip), [0], {0: 1}, head_local_replicas={0: [0]})
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_regression_the_head_answers_a_replica_s_ping_about_its_registration(master):
    """A headless launcher's registration carries an instance and leaves the master's address for the
    engine core; a ping with that instance is `registered`, any other `unknown` (a new head process
    answers that way for every replica of the old one)."""
    response = stage_engine_startup.register_stage_with_omni_master(
        omni_master_address=master._address, omni_master_port=master._port, omni_stage_id=0,
        omni_stage_config={"model": "tiny"}, replica_id=None, replica_bind_address=loopback_ip())
    att = reattach_engine.from_environment()
    assert att is not None, "the registration left no attachment for the engine core's watchdog"
    assert (att.master, att.stage, att.replica) == ((master._address, master._port), 0, response.replica_id)
    ctx = zmq.Context()
    try:
        answer = reattach_engine.ping(ctx, att)
        assert answer is not None and answer["state"] == contract.REATTACH_REGISTERED
        assert reattach_engine.should_reattach(att, answer) is False and att.head_boot == answer["bootId"]
        stranger = reattach_engine.Attachment(att.master, 0, att.replica, "another-instance", None)
        assert reattach_engine.ping(ctx, stranger)["state"] == contract.REATTACH_UNKNOWN
    finally:
        ctx.term()
    # What the registration stored for the head is untouched but for the instance (the report's key too).
    stored = master._stage_configs[(0, response.replica_id)]
    assert stored["model"] == "tiny" and stored[contract.REATTACH_INSTANCE_KEY] == att.instance


def test_a_new_head_that_does_not_know_the_replica_starts_a_reattach_only_when_ready():
    att = reattach_engine.Attachment(("127.0.0.1", 1), 0, 1, "i", None, head_boot="boot-1")
    unknown = {"bootId": "boot-2", "state": contract.REATTACH_UNKNOWN}
    assert reattach_engine.should_reattach(att, None) is False                      # restarting, or a blip
    assert reattach_engine.should_reattach(att, {**unknown, "ready": False}) is False  # its engine still loads
    assert reattach_engine.should_reattach(att, {**unknown, "ready": True}) is True
    # The same head that no longer knows it (it left): not a new head, nothing to re-attach to.
    assert reattach_engine.should_reattach(att, {**unknown, "bootId": "boot-1", "ready": True}) is False


def test_a_head_loading_again_at_the_old_address_does_not_hold_the_replica_back():
    """A restart in place: the new process at the old address answers "unknown, not ready" for the
    minutes its engine loads. That is as good as silence for the master Service lookup: a spare head
    that took over (spec.head.standby) is where to go. The same head that knows the replica, or a new
    one that is ready, is not lost."""
    unknown = {"bootId": "boot-2", "state": contract.REATTACH_UNKNOWN}
    assert reattach_engine.lost(None) and reattach_engine.lost({**unknown, "ready": False})
    assert not reattach_engine.lost({**unknown, "ready": True})
    assert not reattach_engine.lost({"bootId": "boot-1", "state": contract.REATTACH_REGISTERED, "ready": True})


def _core() -> SimpleNamespace:
    """What EngineCoreProc.process_input_sockets reads of its engine (no executor, no scheduler)."""
    core = SimpleNamespace(tensor_ipc_receiver=None, input_queue=queue.Queue(), aborts_queue=queue.Queue())
    core._make_ready_response = lambda: {"ready": True}
    return core


def test_regression_the_old_head_s_input_thread_stops_for_good(monkeypatch):
    """The input thread of the old head blocks in poll() for ever and keeps redialling the old
    address; after stop_input_thread it is gone and nothing dials that address again (a new head may
    have given the port to another replica)."""
    ip = loopback_ip()
    att = reattach_engine.Attachment((ip, 1), 0, 1, "i", None)
    monkeypatch.setattr(reattach, "_attachment", att)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port(f"tcp://{ip}")
    ready = threading.Event()
    thread = threading.Thread(target=EngineCoreProc.process_input_sockets,
                              args=(_core(), [f"tcp://{ip}:{port}"], None, b"\x00\x00", ready), daemon=True)
    thread.start()
    try:
        assert ready.wait(10) and router.poll(10_000), "the input thread sent no ready payload"
        router.recv_multipart()
        router.close(0)  # the head dies
        reattach_engine.stop_input_thread(att)
        assert not thread.is_alive()
        with socket.create_server((ip, port)) as old_port:  # a new head's socket on the old port
            old_port.settimeout(1.5)  # ZMQ redials every 100 ms
            with pytest.raises(TimeoutError):
                old_port.accept()
    finally:
        if thread.is_alive() and att.input_ctx is not None:
            att.input_ctx.destroy(0)
        ctx.destroy(0)


def test_a_registration_that_is_not_a_headless_stage_0_launcher_s_is_left_alone(master):
    """The head's own slots (a planned id) and other stages carry no instance and leave no attachment."""
    stage_engine_startup.register_stage_with_omni_master(
        omni_master_address=master._address, omni_master_port=master._port, omni_stage_id=0,
        omni_stage_config={"model": "tiny"}, replica_id=0, replica_bind_address=master._address)
    assert reattach_engine.ENV_INSTANCE not in os.environ
    assert contract.REATTACH_INSTANCE_KEY not in master._stage_configs[(0, 0)]


def test_a_ping_never_reaches_the_registration_path(master):
    """A ping is answered by the wrapper and never allocates a route (a registration would)."""
    routes = dict(master._stage_routes)
    ctx = zmq.Context()
    try:
        for _ in range(3):
            reattach_engine.ping(ctx, reattach_engine.Attachment((master._address, master._port), 0, 7, "x", None))
    finally:
        ctx.term()
    time.sleep(0.1)
    assert master._stage_routes == routes


def test_regression_a_head_pod_replaced_is_found_through_the_master_service(master, monkeypatch):
    """The registered address is silent (the old pod is gone); the master Service's name resolves to
    the new head pod, whose master answers "unknown to me, ready": that is where to re-attach. The
    name is resolved by the system resolver (cluster DNS in a pod), stood in here by getaddrinfo."""
    import socket as socket_module

    from omnistage_engine_patches.patches import membership

    monkeypatch.setattr(membership, "running_orchestrators", lambda: [object()])
    asked = []

    def resolve(host, port, *args, **kwargs):
        asked.append(host)
        return [(socket_module.AF_INET, socket_module.SOCK_STREAM, 6, "", (master._address, port))]
    monkeypatch.setattr(reattach_engine.socket, "getaddrinfo", resolve)
    gone = loopback_ip()
    att = reattach_engine.Attachment((gone, master._port), 0, 3, "old-instance", None,
                                     service="x-master.ns.svc", head_boot="the-dead-head")
    ctx = zmq.Context()
    try:
        found = reattach_engine.moved_head(ctx, att)
        assert asked == ["x-master.ns.svc"]
        assert found is not None and found[0] == (master._address, master._port)
        assert reattach_engine.should_reattach(dataclasses.replace(att, master=found[0]), found[1])
        # No name to ask: the replica waits for its head at the old address (an in-place restart).
        assert reattach_engine.moved_head(ctx, dataclasses.replace(att, service=None)) is None
        # The Service still lists the address it is attached to (a blip, or a head change's surge
        # listing both heads): that head is the serving one, and the replica stays.
        both = [(socket_module.AF_INET, socket_module.SOCK_STREAM, 6, "", (ip, master._port))
                for ip in (gone, master._address)]
        monkeypatch.setattr(reattach_engine.socket, "getaddrinfo", lambda *a, **k: both)
        assert reattach_engine.moved_head(ctx, att) is None
    finally:
        ctx.term()
