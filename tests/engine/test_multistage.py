"""Issue 12, engine tier: the whole pipeline with stages 1..n in their own pods.

Real here (vllm 0.30.0 / vllm-omni 0.30.0 on the CPU, with this project's patches): the head's
startup for a three-stage pipeline shaped like Qwen3-Omni (thinker 0 in the head, talker 1 and
code2wav 2 remote) through vllm-omni's own ``StageRuntime.initialize``, ``_start_omni_master_server``
(``OmniMasterServer`` with pre-allocated slots for every stage, the forked coordinator) and
``_initialize_remote_replica`` (the stage-init wait) for stages 1 and 2; the real ``Orchestrator``
(admission, per-stage picks, forwarding 0 -> 1 -> 2, async-chunk prewarm, ``payload_sender_info``,
abort on replica loss), ``MembershipController`` (dynamic attach per stage, the DOWN watcher),
``StagePool``; the head-side stage client class ``StageEngineCoreClientBase`` (endpoint and port
arithmetic, ``process_engine_inputs``); replicas register and heartbeat through
``register_stage_with_omni_master`` / ``create_stage_coord_client``, each from its own loopback
pod IP (127.76.x.y); the membership operations are ``membership_ops.LiveHead`` (what the
endpoint serves), and ``/health`` is vllm-omni's handler in vLLM's app.

Stood in (``tests/standin/multistage.py``): stage planning from a deploy YAML, the EngineCore
processes and the ZMQ transport under the head-side client (``_create_remote_replica_client``
builds the real client class over a transport that records requests and emits finished outputs).

Cost: about 1-2 s per head start (the coordinator is a forked process); the kill test waits out
an 8 s heartbeat timeout.

Negative controls: with ``OMNISTAGE_DISABLE_PATCHES=membership`` the tests that list, join or leave
fail (503 ``MembershipPatchDisabled``); with ``OMNISTAGE_DISABLE_PATCHES=connector_ports``
``test_connector_port_of_replica_id_16`` fails (replica 16 never attaches). The routing tests
expect the port the installed arithmetic gives (``sender_port``), so they hold either way.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)")

from omnistage_engine_patches import contract
from omnistage_engine_patches.membership_ops import LiveHead, MembershipError

from tests.engine.test_membership_api import bind_request, fresh_picks
from tests.standin.engine import (
    HttpServerThread,
    StandinEngineClient,
    build_http_app,
    wait_quietly,
)
from tests.standin.multistage import (
    CONNECTOR_BASE_PORT,
    MultiStageOptions,
    PipelineHead,
    qwen3_omni_like,
    stage_vllm_config,
)
from tests.support.engine_env import patch_applied
from tests.support.loopback import loopback_ip
from tests.support.ports import free_port
from tests.support.tiny_models import build_config_only_model

pytestmark = pytest.mark.engine




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_config_only_model(tmp_path_factory.mktemp("multistage-model"))


@pytest.fixture
def pipeline(model_dir):
    """Factory: ``pipeline(replicas=(1, 1, 1), async_chunk=False, stage_init_timeout=60,
    start=True, **engine_kwargs) -> PipelineHead``. With ``start`` the initial remote slots are
    filled (one replica per planned slot of stages 1 and 2, each from its own IP) and the head is
    up; without it the test drives the startup."""
    heads: list[PipelineHead] = []

    def make(replicas=(1, 1, 1), *, async_chunk: bool = False, stage_init_timeout: int = 60, start: bool = True,
             **engine_kwargs: Any) -> PipelineHead:
        specs = qwen3_omni_like(replicas)
        options = MultiStageOptions(
            specs, [stage_vllm_config(model_dir, s, len(specs), async_chunk=async_chunk) for s in specs],
            stage_init_timeout=stage_init_timeout, async_chunk=async_chunk,
        )
        head = PipelineHead(options, loopback_ip(), **engine_kwargs)
        heads.append(head)
        head.start()
        if start:
            for spec in specs[1:]:
                for _ in range(spec.num_replicas):
                    head.replica(spec.stage_id, loopback_ip())
            head.wait_started(120)
        return head

    yield make
    for head in reversed(heads):
        head.stop()


def live(engine) -> LiveHead:
    """The head's membership operations once its orchestrator runs: on a busy machine it starts a
    moment after the fixture returns (503 EngineNotReady until then; CI saw it)."""
    found: list[LiveHead] = []

    def located() -> bool:
        try:
            found.append(LiveHead.locate(StandinEngineClient(engine)))
        except MembershipError as err:
            if err.code != "EngineNotReady":
                raise
        return bool(found)

    wait_quietly("the head's orchestrator running", located, 30)
    return found[-1]


def listing(engine, **kwargs) -> dict[str, dict[int, dict[str, Any]]]:
    body = asyncio.run(live(engine).snapshot(**kwargs))
    return {stage: {m["replicaId"]: m for m in members} for stage, members in body["stages"].items()}


def attach(head: PipelineHead, stage_id: int, ip: str | None = None):
    """A dynamic replica of ``stage_id``: registers (auto-assign past the planned slots), the head
    attaches it through ``on_register``, the watcher sees it UP (then DOWN detaches it)."""
    engine = head.engine
    replica = head.replica(stage_id, ip or loopback_ip())
    rid = replica.replica_id
    wait_quietly(f"stage {stage_id} replica {rid} attach",
                 lambda: rid in engine.attached_replica_ids(stage_id), 15)
    addr = engine.client(stage_id, rid).client_addresses["input_address"]
    controller = engine.orchestrator._membership
    wait_quietly("the watcher to see it UP",
                 lambda: (stage_id, addr) in controller._observed_up_attached_addrs, 15)
    return replica


def hub_sees_up(engine, stage_id: int, replica_id: int) -> bool:
    """The head's coordinator hub (what the load balancer picks from) lists the replica UP."""
    addr = engine.client(stage_id, replica_id).client_addresses["input_address"]
    hub = engine.orchestrator._membership._hub
    replicas = engine.on_loop(lambda: hub.get_replica_list().replicas)
    return any((rep.stage_id, rep.input_addr) == (stage_id, addr) for rep in replicas)


def watcher_saw_up(engine, stage_id: int, replica_id: int) -> None:
    """Wait until the membership watcher has seen the replica UP. vllm-omni detaches an initial
    slot (a client it does not track) only when a tick saw it UP and a later one does not; a DOWN
    before the watcher's next 0.5 s tick after the UP goes unnoticed (upstream, 0.30.0)."""
    wait_quietly(f"stage {stage_id} replica {replica_id} UP",
                 lambda: hub_sees_up(engine, stage_id, replica_id), 15)
    controller = engine.orchestrator._membership
    seen = controller._watch_generation
    wait_quietly("two watcher ticks", lambda: controller._watch_generation >= seen + 2, 15)


# ---- startup: the head waits for every remote stage -------------------------------------------


def test_head_blocks_until_each_remote_stage_registered(pipeline):
    """The real bootstrap path: the head's constructor (``_wait_for_orchestrator_init``) does not
    return while stage 2 has no replica, although stage 1's slot registered and got its client;
    a stage-2 registration unblocks it. Each headless registration fills its stage's pre-allocated
    slot 0 (auto-assign, no ``on_register``: exactly one head-side client per slot), and the
    client carries the registrant's pod IP as ``replica_host``."""
    head = pipeline(start=False)
    talker_ip, code2wav_ip = loopback_ip(), loopback_ip()
    talker = head.replica(1, talker_ip)
    assert talker.replica_id == 0  # the planned slot, not a fresh id
    # The stage-1 slot is bootstrapped: its head-side client exists ...
    wait_quietly("the stage-1 head-side client",
                 lambda: head.runtimes and any(c.stage_id == 1 for c in head.runtimes[0].clients_created),
                 30)
    # ... and the head still blocks on stage 2 (bounded wait: it would be up within it otherwise).
    head.thread.join(2.0)
    assert head.thread.is_alive() and head.engine is None and head.error is None
    code2wav = head.replica(2, code2wav_ip)
    assert code2wav.replica_id == 0
    engine = head.wait_started(60)
    assert [pool.live_replica_ids() for pool in engine.stage_pools] == [[0], [0], [0]]
    created = head.runtimes[0].clients_created
    assert sorted((c.stage_id, c.replica_id) for c in created) == [(0, 0), (1, 0), (2, 0)]  # no duplicates
    assert [engine.client(s, 0) for s in range(3)] == sorted(created, key=lambda c: c.stage_id)
    assert engine.client(1, 0).client_addresses["replica_host"] == talker_ip
    assert engine.client(2, 0).client_addresses["replica_host"] == code2wav_ip
    assert engine.master.get_replica_host(1, 0) == talker_ip


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the head's thread fails
def test_head_fails_after_the_stage_init_timeout(pipeline):
    """``--stage-init-timeout``: with stage 1 registered and stage 2 never, the real
    ``get_stage_config`` wait times out and the head's startup fails with that error; the runtime
    cleans up (master and coordinator stopped, the stage-1 client shut down)."""
    head = pipeline(start=False, stage_init_timeout=2)
    head.replica(1, loopback_ip())
    with pytest.raises(RuntimeError, match="Orchestrator initialization failed") as failed:
        head.wait_started(60)
    assert "Timed out waiting for stage config for stage 2 replica 0" in str(failed.value)
    runtime = head.runtimes[0]
    assert runtime._omni_master_server is None and runtime._coordinator_runtime is None
    (talker,) = [c for c in runtime.clients_created if c.stage_id == 1]
    assert talker.shut_down.is_set()


# ---- membership for every stage ---------------------------------------------------------------


def test_listing_covers_every_stage_and_the_initial_remote_slots(pipeline):
    """The membership listing of a three-stage head: the head-local stage-0 replica, the initial
    remote slots of stages 1 and 2 (attached by the bootstrap path, never through ``on_register``)
    and dynamic replicas of stages 1 and 2, each with its pod IP, attached and UP."""
    head = pipeline()
    engine = head.engine
    extra_talker, extra_code2wav = attach(head, 1), attach(head, 2)
    initial = {r.stage_id: r for r in head.replicas[:2]}
    wait_quietly("the initial slots UP", lambda: all(hub_sees_up(engine, s, 0) for s in (1, 2)), 15)
    stages = listing(engine)
    assert sorted(stages) == ["0", "1", "2"]
    assert list(stages["0"]) == [0] and stages["0"][0]["local"] is True
    for stage_id, extra in ((1, extra_talker), (2, extra_code2wav)):
        members = stages[str(stage_id)]
        assert sorted(members) == [0, extra.replica_id] == [0, 1]
        assert members[0]["host"] == initial[stage_id].bind_ip and members[1]["host"] == extra.bind_ip
        for m in members.values():
            assert (m["stage"], m["local"], m["state"], m["attached"], m["coordinatorStatus"]) == (
                stage_id, False, "attached", True, "up"), m
    everything = listing(engine, include_all=True)
    assert {s: sorted(m) for s, m in everything.items()} == {"0": [0], "1": [0, 1], "2": [0, 1]}


def test_join_and_leave_per_stage_and_replica_id(pipeline):
    """Join and leave address a (stage, replica id): the initial talker slot joins by its IP;
    leaving stage 1 replica 0 drains its in-flight request (no fresh picks, the bound request
    still there) and detaches it, while stage 2 replica 0 (same replica id, another stage) and
    the other talker stay attached and keep their requests."""
    head = pipeline()
    engine = head.engine
    ops = live(engine)
    talker0 = head.replicas[0]
    extra = attach(head, 1)
    wait_quietly("the initial talker UP", lambda: hub_sees_up(engine, 1, 0), 15)
    joined = asyncio.run(ops.join(1, "talker-0", talker0.bind_ip))
    assert (joined["stage"], joined["replicaId"], joined["pod"], joined["state"]) == (1, 0, "talker-0", "attached")
    assert joined["metricsRegistered"] is True  # the talker's vllm:* series, as for a stage-0 replica
    assert asyncio.run(ops.join(2, "code2wav-0", head.replicas[1].bind_ip))["replicaId"] == 0
    talkers, code2wav = engine.stage_pools[1], engine.stage_pools[2]
    bind_request(engine, 0, "chat-1", stage_id=1)
    bind_request(engine, 0, "chat-2", stage_id=2)
    result: dict[str, Any] = {}
    leaving = threading.Thread(target=lambda: result.update(asyncio.run(
        ops.leave(1, pod="talker-0", drain_timeout=30))))
    leaving.start()
    wait_quietly("draining", lambda: listing(engine)["1"][0]["draining"], 15)
    assert set(fresh_picks(engine, 6, stage_id=1)) == {extra.replica_id}  # no new requests to the drained one
    assert engine.on_loop(lambda: talkers.get_bound_replica_id("chat-1")) == 0  # the bound one stays
    engine.on_loop(lambda: talkers.release_binding("chat-1"))  # it finishes
    leaving.join(30)
    assert (result["stage"], result["replicaId"], result["state"], result["drained"], result["detached"]) == (
        1, 0, "left", True, True)
    assert engine.attached_replica_ids(1) == [extra.replica_id]
    assert engine.attached_replica_ids(2) == [0]
    assert engine.on_loop(lambda: code2wav.get_bound_replica_id("chat-2")) == 0
    stages = listing(engine, include_all=True)
    assert stages["1"][0]["state"] == "left" and stages["2"][0]["state"] == "attached"
    # Idempotent, and per stage: the same replica id in stage 2 is another replica.
    assert asyncio.run(ops.leave(1, replica_id=0, drain_timeout=0))["alreadyLeft"] is True
    # The pod name is per (stage, replica): stage 2 replica 0 belongs to another pod.
    with pytest.raises(MembershipError, match="belongs to pod 'code2wav-0'"):
        asyncio.run(ops.leave(2, replica_id=0, pod="talker-0", drain_timeout=0))


def test_a_pod_hosting_two_stages_leaves_both(pipeline):
    """A speech pod runs talker (stage 1) and code2wav (stage 2), two headless processes on one pod
    IP (qwen3_omni_moe.yaml puts both on one GPU). The operator joins and leaves each (stage, pod);
    both leave before the pod is deleted, and only that pod's replicas go."""
    head = pipeline()
    engine = head.engine
    ops = live(engine)
    speech_ip = loopback_ip()
    talker, code2wav = attach(head, 1, speech_ip), attach(head, 2, speech_ip)
    for stage_id, replica in ((1, talker), (2, code2wav)):
        body = asyncio.run(ops.join(stage_id, "speech-a", speech_ip))
        assert (body["stage"], body["replicaId"], body["host"]) == (stage_id, replica.replica_id, speech_ip)
    left = [asyncio.run(ops.leave(s, pod="speech-a", drain_timeout=5)) for s in (1, 2)]
    assert [(r["stage"], r["replicaId"], r["detached"]) for r in left] == [
        (1, talker.replica_id, True), (2, code2wav.replica_id, True)]
    assert engine.attached_replica_ids(1) == [0] and engine.attached_replica_ids(2) == [0]
    stages = listing(engine)
    assert sorted(stages["1"]) == [0] and sorted(stages["2"]) == [0]


def test_route_joined_only_holds_dynamic_replicas_of_every_stage(pipeline, monkeypatch):
    """With the operator's gate (``OMNISTAGE_ROUTE_JOINED_ONLY=1``) a talker or code2wav replica
    that registers after startup is attached but gets no fresh picks until it is joined under its
    (stage, pod); the initial remote slots, which the head's startup waited for, stay routable."""
    monkeypatch.setenv(contract.ROUTE_JOINED_ONLY_ENV, "1")
    head = pipeline()
    engine = head.engine
    ops = live(engine)
    talker, code2wav = attach(head, 1), attach(head, 2)
    wait_quietly("the initial slots UP", lambda: hub_sees_up(engine, 1, 0) and hub_sees_up(engine, 2, 0), 15)
    stages = listing(engine)
    for stage_id, replica in ((1, talker), (2, code2wav)):
        assert stages[str(stage_id)][replica.replica_id]["held"] is True
        assert stages[str(stage_id)][0]["held"] is False
        assert set(fresh_picks(engine, 6, stage_id=stage_id)) == {0}
        asyncio.run(ops.join(stage_id, f"pod-{stage_id}", replica.bind_ip))
        assert set(fresh_picks(engine, 6, stage_id=stage_id)) == {0, replica.replica_id}


def test_down_and_kill_per_stage(pipeline):
    """Stages >= 1 per stage: a stage-2 replica's DOWN detaches it at once (``detached`` in the
    listing); a stage-1 replica whose heartbeats stop without DOWN is timed out by the coordinator
    (8 s heartbeat timeout here) and kept, silent and unroutable (patch engine_liveness: its process
    may be alive; the operator makes it leave once its pod is gone). The other stage keeps its
    replicas."""
    head = pipeline(heartbeat_timeout=8.0)
    engine = head.engine
    talker, code2wav = attach(head, 1), attach(head, 2)
    code2wav.down()
    wait_quietly("the DOWN detach", lambda: code2wav.replica_id not in engine.attached_replica_ids(2), 15)
    assert engine.attached_replica_ids(1) == [0, talker.replica_id]
    talker.kill()
    wait_quietly("the heartbeat timeout",
                 lambda: listing(engine, include_all=True)["1"][talker.replica_id]["coordinatorStatus"] == "silent",
                 40, interval=0.2)
    assert engine.attached_replica_ids(1) == [0, talker.replica_id]  # kept, not shut down
    assert engine.attached_replica_ids(2) == [0]
    stages = listing(engine, include_all=True)
    assert stages["1"][talker.replica_id]["state"] == "attached"
    assert stages["2"][code2wav.replica_id]["state"] == "detached"
    assert stages["1"][0]["state"] == stages["2"][0]["state"] == "attached"


# ---- routing through the real Orchestrator ----------------------------------------------------


def submit(engine, request_id: str) -> None:
    """What ``AsyncOmniEngine.add_request`` enqueues for a token prompt that runs every stage."""
    from vllm import SamplingParams
    from vllm_omni.engine.messages import StageSubmissionMessage
    from vllm_omni.engine.orchestrator import build_engine_core_request_from_tokens

    prompt = {"prompt_token_ids": [1, 2, 3]}
    params = [SamplingParams(max_tokens=4, detokenize=False) for _ in engine.stage_pools]
    request = build_engine_core_request_from_tokens(request_id, prompt, params[0],
                                                    model_config=engine.stage_vllm_configs[0].model_config)
    request.external_req_id = request_id
    engine.request_queue.sync_q.put(StageSubmissionMessage(
        type="add_request", request_id=request_id, prompt=request, original_prompt=prompt,
        output_prompt_text=None, sampling_params_list=params, final_stage_id=len(engine.stage_pools) - 1,
        preprocess_ms=0.0, request_timestamp=time.time(), enqueue_ts=0.0,
    ))


def collect(engine, done, timeout: float = 30.0) -> list[Any]:
    """Output and error messages from the orchestrator until ``done(messages)`` (bounded)."""
    messages: list[Any] = []
    deadline = time.monotonic() + timeout
    while not done(messages):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"orchestrator messages so far: {messages}")
        try:
            msg = engine.output_queue.sync_q.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            continue
        if msg.type in ("output", "error"):
            messages.append(msg)
    return messages


def finished_outputs(messages: list[Any]) -> dict[str, Any]:
    return {m.request_id: m for m in messages if m.type == "output" and m.finished}


def sender_port(from_stage: int, replica_id: int) -> int:
    """The connector port vllm-omni advertises for a sender, with the operator's per-pod setting
    (the replica term left out) when the connector_ports patch is in effect."""
    per_pod = patch_applied(contract.CONNECTOR_PORTS) and os.environ.get(contract.CONNECTOR_PORTS_ENV) == \
        contract.PORTS_PER_POD
    return CONNECTOR_BASE_PORT + from_stage + (0 if per_pod else 1024 * replica_id)


def test_orchestrator_routes_every_stage_with_the_bound_upstream_endpoint(pipeline, monkeypatch):
    """The real ``Orchestrator`` routes 0 -> 1 -> 2 (without async chunks: each stage's finished
    output is forwarded through ``process_engine_inputs`` to a replica the next stage's pool
    picks), and each downstream request carries the ``payload_sender_info`` of the upstream
    replica it is bound to: host = that replica's registered pod IP, port = vllm-omni's arithmetic
    with the per-pod setting (``connector_ports``). Two talkers: the picks spread over both."""
    monkeypatch.setenv(contract.CONNECTOR_PORTS_ENV, contract.PORTS_PER_POD)
    head = pipeline()
    engine = head.engine
    extra = attach(head, 1)
    wait_quietly("the initial slots UP", lambda: hub_sees_up(engine, 1, 0) and hub_sees_up(engine, 2, 0), 15)
    ids = [f"req-{i}" for i in range(4)]
    for rid in ids:
        submit(engine, rid)
    messages = collect(engine, lambda ms: set(finished_outputs(ms)) >= set(ids) or any(m.type == "error" for m in ms))
    assert [m for m in messages if m.type == "error"] == []
    final = finished_outputs(messages)
    assert all(final[rid].stage_id == 2 for rid in ids)
    talker_ips = {0: head.replicas[0].bind_ip, extra.replica_id: extra.bind_ip}
    received = {s: {r.request_id: (c.replica_id, r) for c in engine.stage_pools[s].clients if c is not None
                    for r in c.received} for s in range(3)}
    assert all(set(received[s]) == set(ids) for s in range(3))
    assert {received[1][rid][0] for rid in ids} == {0, extra.replica_id}  # both talkers served
    for rid in ids:
        thinker_rid, _ = received[0][rid]
        talker_rid, talker_req = received[1][rid]
        code2wav_rid, code2wav_req = received[2][rid]
        print(f"ROUTE {rid}: thinker replica {thinker_rid} -> talker replica {talker_rid} "
              f"(sender {talker_req.payload_sender_info}) -> code2wav replica {code2wav_rid} "
              f"(sender {code2wav_req.payload_sender_info})")
        assert talker_req.payload_sender_info == {"host": head.bind_ip, "zmq_port": sender_port(0, thinker_rid)}
        assert code2wav_req.payload_sender_info == {"host": talker_ips[talker_rid],
                                                    "zmq_port": sender_port(1, talker_rid)}
        assert list(talker_req.prompt_token_ids) == [7, 8]  # the thinker's output tokens


def test_async_chunk_prewarm_binds_downstream_replicas_at_admission(pipeline, monkeypatch):
    """With ``async_chunk`` (the Qwen3-Omni default) the real ``Orchestrator`` pre-submits stages 1
    and 2 when it admits a request, before stage 0 produced anything: every stage's replica is
    bound then, and each downstream request names its bound upstream replica's endpoint. The
    request finishes when every stage finished."""
    monkeypatch.setenv(contract.CONNECTOR_PORTS_ENV, contract.PORTS_PER_POD)
    head = pipeline(async_chunk=True)
    engine = head.engine
    wait_quietly("the initial slots UP", lambda: hub_sees_up(engine, 1, 0) and hub_sees_up(engine, 2, 0), 15)
    clients = [engine.client(s, 0) for s in range(3)]
    for client in clients:
        client.auto_finish = False
    submit(engine, "chunked")
    wait_quietly("admission to reach every stage", lambda: all(c.request_ids == ["chunked"] for c in clients),
                 15)
    bound = [engine.on_loop(lambda p=p: p.get_bound_replica_id("chunked")) for p in engine.stage_pools]
    assert bound == [0, 0, 0]
    talker_req, code2wav_req = clients[1].received[0], clients[2].received[0]
    assert talker_req.payload_sender_info == {"host": head.bind_ip, "zmq_port": sender_port(0, 0)}
    assert code2wav_req.payload_sender_info == {"host": head.replicas[0].bind_ip, "zmq_port": sender_port(1, 0)}
    for client in clients:
        engine.on_loop(lambda c=client: c.finish("chunked"))
    final = finished_outputs(collect(engine, lambda ms: "chunked" in finished_outputs(ms)))
    assert final["chunked"].stage_id == 2


def test_losing_a_stage2_replica_fails_exactly_its_requests(pipeline):
    """Two code2wav replicas; four admitted requests (async-chunk prewarm binds each to one of
    them). The replica with requests sends DOWN: the real ``MembershipController`` fails exactly
    the requests bound to it ("stage replica disappeared") and the orchestrator aborts them in
    every stage; the other requests are untouched and still finish."""
    head = pipeline(async_chunk=True)
    engine = head.engine
    extra = attach(head, 2)
    wait_quietly("the initial slots UP", lambda: hub_sees_up(engine, 1, 0) and hub_sees_up(engine, 2, 0), 15)
    for pool in engine.stage_pools:
        for client in pool.clients:
            client.auto_finish = False
    ids = [f"req-{i}" for i in range(4)]
    for rid in ids:
        submit(engine, rid)
    code2wav = engine.stage_pools[2]
    wait_quietly("admission of every request", lambda: sum(len(c.received) for c in code2wav.clients) == 4,
                 15)
    bound = {rid: engine.on_loop(lambda rid=rid: code2wav.get_bound_replica_id(rid)) for rid in ids}
    lost = {rid for rid, r in bound.items() if r == extra.replica_id}
    kept = set(ids) - lost
    assert lost and kept, bound  # round robin over two replicas
    extra.down()
    errors = collect(engine, lambda ms: {m.request_id for m in ms if m.type == "error"} >= lost)
    assert {m.request_id for m in errors if m.type == "error"} == lost
    assert all(m.error == "stage replica disappeared" and m.stage_id == 2 for m in errors if m.type == "error")
    thinker, talker = engine.client(0, 0), engine.client(1, 0)
    assert set(thinker.aborted) == lost and set(talker.aborted) == lost
    assert engine.client(2, 0).aborted == []
    # The others finish through every stage.
    for rid in sorted(kept):
        for stage_id in range(3):
            engine.on_loop(lambda rid=rid, s=stage_id: engine.client(s, 0).finish(rid))
    final = finished_outputs(collect(engine, lambda ms: set(finished_outputs(ms)) >= kept))
    assert set(final) == kept


def test_draining_a_talker_waits_for_the_whole_request(pipeline):
    """A request stays bound to every replica it went through until it finishes the last stage
    (the orchestrator releases bindings at request cleanup): leaving the talker that already
    forwarded a request to code2wav keeps draining until code2wav finished it, then detaches it
    with nothing in flight. (The operator's grace period for a talker pod must cover the rest of
    the pipeline, not only the talker's own step.)"""
    head = pipeline()
    engine = head.engine
    ops = live(engine)
    wait_quietly("the initial slots UP", lambda: hub_sees_up(engine, 1, 0) and hub_sees_up(engine, 2, 0), 15)
    code2wav = engine.client(2, 0)
    code2wav.auto_finish = False
    submit(engine, "long")
    wait_quietly("the request to reach code2wav", lambda: code2wav.request_ids == ["long"], 15)
    assert "long" in engine.client(1, 0).request_ids  # the talker's step is done
    result: dict[str, Any] = {}
    leaving = threading.Thread(target=lambda: result.update(asyncio.run(ops.leave(1, replica_id=0,
                                                                                  drain_timeout=60))))
    leaving.start()
    wait_quietly("draining", lambda: listing(engine)["1"][0]["draining"], 15)
    assert listing(engine)["1"][0]["inFlight"] == 1
    leaving.join(1.0)
    assert leaving.is_alive()  # still draining: the request is bound to the talker until it finishes
    engine.on_loop(lambda: code2wav.finish("long"))
    assert "long" in finished_outputs(collect(engine, lambda ms: "long" in finished_outputs(ms)))
    leaving.join(30)
    assert (result["drained"], result["timedOut"], result["inFlightAtDetach"], result["detached"]) == (
        True, False, 0, True)


def test_health_is_503_while_a_stage_has_no_live_replica(pipeline, monkeypatch):
    """vllm-omni's ``/health`` (``OmniBase.check_health``) in vLLM's app: 200 with every stage
    live, 503 once stage 2's only replica sent DOWN, 200 again after a new code2wav registered."""
    head = pipeline()
    engine = head.engine
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def health() -> int:
        try:
            with opener.open(server.url + "/health", timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as err:
            return err.code

    ip = head.bind_ip
    with HttpServerThread(build_http_app(StandinEngineClient(engine), ip, 0), ip, free_port(ip)) as server:
        watcher_saw_up(engine, 2, 0)
        assert health() == 200
        head.replicas[1].down()  # the only code2wav
        wait_quietly("the head to drop it", lambda: engine.attached_replica_ids(2) == [], 15)
        assert health() == 503
        assert listing(engine, include_all=True)["2"][0]["state"] == "detached"  # an initial slot, dropped
        attach(head, 2)
        assert health() == 200


def test_connector_port_of_replica_id_16(pipeline, monkeypatch):
    """Replica ids are never reused, so a churned stage reaches id 16. With the operator's per-pod
    setting the ``connector_ports`` patch keeps the talker's advertised port at base + stage for
    every id, so replica 16 attaches; without it (upstream arithmetic) the head cannot build the
    client of a replica past id 15 (port > 65535) and records it as detached."""
    monkeypatch.setenv(contract.CONNECTOR_PORTS_ENV, contract.PORTS_PER_POD)
    head = pipeline()
    engine = head.engine
    for _ in range(16):  # ids 1..16 (0 is the planned slot)
        head.replica(1, loopback_ip(), up=False)
    wait_quietly("stage-1 replica 16 to attach", lambda: 16 in engine.attached_replica_ids(1), 30)
    info = engine.client(1, 16).get_payload_sender_info()
    assert info == {"host": head.replicas[-1].bind_ip, "zmq_port": CONNECTOR_BASE_PORT + 1}
    monkeypatch.delenv(contract.CONNECTOR_PORTS_ENV)  # a head without the operator's setting
    late = head.replica(1, loopback_ip(), up=False)
    assert late.replica_id == 17
    wait_quietly("the failed attach of replica 17",
                 lambda: listing(engine, include_all=True)["1"][17]["state"] == "detached",
                 30)
    assert 17 not in engine.attached_replica_ids(1)
