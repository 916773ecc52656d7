"""The head's membership endpoint (``omnistage_engine_patches.membership_api``) over HTTP.

Real here (vllm 0.30.0 / vllm-omni 0.30.0 on the CPU): the head's ``OmniMasterServer`` and
``OmniCoordinator`` (child process) bound on a loopback "pod IP", the real ``Orchestrator`` and
``MembershipController`` (attach, the watcher's DOWN detach, ``handle_unregister``), the
``StagePool`` (load balancer, affinity = requests in flight), the stat logger; the HTTP app is
vLLM's own ``build_app`` with the endpoint mounted by vLLM's endpoint-plugin loader from our
``vllm.endpoint_plugins`` entry point (``VLLM_PLUGINS``), served by uvicorn and called over
loopback HTTP with the operator's request shapes. Replicas register and heartbeat through
vllm-omni's own client code (``register_stage_with_omni_master``, ``create_stage_coord_client``).
The last test runs the stand-in head and replica as processes, as the cluster tests do.

Stood in (no GPU, no weights): the EngineCore processes (``StandinStageClient``; the head-side
attach returns it instead of doing the engine handshake, optionally after a delay). Requests in
flight are made the way the orchestrator makes them: ``StagePool.pick`` binds a request to a
replica, ``release_binding`` ends it. See ``tests/standin/__init__.py``.

With ``OMNISTAGE_DISABLE_PATCHES=membership`` every test here fails (503
``MembershipPatchDisabled``): the endpoint depends on the patch's hooks.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)")

from omnistage_engine_patches import membership
from omnistage_engine_patches.membership_api import BASE_PATH, PLUGIN_NAME

from tests.standin.engine import (
    HttpServerThread,
    StandinEngineClient,
    build_http_app,
    build_vllm_config,
    free_port,
    standin_head,
    wait_for,
    write_tiny_model,
)
from tests.standin.replica import SimulatedReplica

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "membership-token-for-tests"
_ips = (f"127.75.{(os.getpid() % 200) + 1}.{n}" for n in itertools.count(1))
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy


def _ip() -> str:
    return next(_ips)


class Api:
    """The operator's side of the wire: JSON over HTTP with a bearer token."""

    def __init__(self, url: str, token: str | None = TOKEN) -> None:
        self.url, self.token = url, token

    def call(self, method: str, path: str, body: Any = None, *, token: Any = "default", raw: bytes | None = None,
             headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, dict[str, Any]]:
        token = self.token if token == "default" else token
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            self.last_headers = dict(err.headers)
            return err.code, json.loads(err.read() or b"{}")

    def list(self, all: bool = False) -> dict[str, Any]:
        status, body = self.call("GET", BASE_PATH + ("?all=true" if all else ""))
        assert status == 200, body
        return body

    def members(self, all: bool = False) -> dict[int, dict[str, Any]]:
        return {m["replicaId"]: m for m in self.list(all)["stages"]["0"]}

    def join(self, pod: str, ip: str, **extra: Any) -> tuple[int, dict[str, Any]]:
        return self.call("POST", BASE_PATH + "/join", {"stage": 0, "pod": pod, "ip": ip, **extra})

    def leave(self, **body: Any) -> tuple[int, dict[str, Any]]:
        return self.call("POST", BASE_PATH + "/leave", {"stage": 0, **body})

    def metrics(self) -> str:
        with _OPENER.open(self.url + "/metrics", timeout=30) as resp:
            return resp.read().decode()


def replica_lines(metrics_text: str, replica_id: int) -> list[str]:
    return [ln for ln in metrics_text.splitlines()
            if ln.startswith("vllm:") and f'replica="{replica_id}"' in ln and "_created" not in ln]


@pytest.fixture(scope="module")
def text_config(tmp_path_factory):
    return build_vllm_config(write_tiny_model(tmp_path_factory.mktemp("standin-model")), "tiny")


@pytest.fixture
def token_file(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")  # a mounted Secret may end with a newline
    monkeypatch.setenv("OMNISTAGE_MEMBERSHIP_TOKEN_FILE", str(path))
    monkeypatch.delenv("OMNISTAGE_MEMBERSHIP_TOKEN", raising=False)
    return path


@pytest.fixture
def head(text_config, token_file, monkeypatch):
    """Factory: ``head(**standin_options) -> (engine, api)``: a stand-in head with its HTTP app."""
    listed = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    monkeypatch.setenv("VLLM_PLUGINS", ",".join(dict.fromkeys([*listed, PLUGIN_NAME])))
    stack: list[Any] = []

    def make(**options: Any) -> tuple[Any, Api]:
        ip = _ip()
        ctx = standin_head(text_config, ip, **options)
        engine = ctx.__enter__()
        stack.append(ctx)
        server = HttpServerThread(build_http_app(StandinEngineClient(engine), ip, 0), ip, free_port(ip))
        server.__enter__()
        stack.append(server)
        api = Api(server.url)
        # The coordinator has published the head-local replica: the head is fully up.
        wait_for(lambda: api.members().get(0, {}).get("coordinatorStatus") == "up", 10, what="the local replica UP")
        return engine, api

    yield make
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)


def start_replica(engine: Any, *, seen_up: bool = True) -> SimulatedReplica:
    replica = SimulatedReplica(engine._omni_master_address, engine._omni_master_port, _ip()).start()
    wait_for(lambda: replica.replica_id in engine.attached_replica_ids(), 10, what="attach")
    if seen_up:
        # vllm-omni's watcher detaches a replica only after it has seen it UP (see
        # test_replica_metrics.join); a live replica is in that state.
        controller = engine.orchestrator._membership
        addr = engine.stage0.clients[replica.replica_id].client_addresses["input_address"]
        wait_for(lambda: (0, addr) in controller._observed_up_attached_addrs, 10, what="the watcher to see it UP")
    return replica


def bind_request(engine: Any, replica_id: int, request_id: str) -> None:
    """Route a request the way the orchestrator does (``StagePool.pick``) until it lands on
    ``replica_id``; requests that landed elsewhere are finished (``release_binding``)."""
    pool = engine.stage0
    for n in range(8):  # round robin over a handful of replicas: bounded
        rid = f"{request_id}-probe{n}"
        picked = engine.on_loop(lambda rid=rid: pool.pick(rid))
        if picked == replica_id:
            engine.on_loop(lambda rid=rid: pool.bind(request_id, pool._affinity.pop(rid)))
            return
        engine.on_loop(lambda rid=rid: pool.release_binding(rid))
    raise AssertionError(f"the load balancer never picked replica {replica_id}")


def fresh_picks(engine: Any, n: int) -> list[int]:
    pool = engine.stage0
    picks = []
    for i in range(n):
        rid = f"fresh-{time.monotonic_ns()}-{i}"
        picks.append(engine.on_loop(lambda rid=rid: pool.pick(rid)))
        engine.on_loop(lambda rid=rid: pool.release_binding(rid))
    return picks


# ---- listing and authentication ------------------------------------------------------------


def test_listing_shape(head):
    engine, api = head()
    body = api.list()
    assert body["bootId"] == membership.BOOT_ID and len(body["bootId"]) == 32
    assert isinstance(body["epoch"], int) and body["distributed"] is True and body["metricsEnabled"] is True
    (local,) = body["stages"]["0"]
    assert local == {
        "stage": 0, "replicaId": 0, "host": engine._omni_master_address, "pod": None, "local": True,
        "state": "attached", "registered": True, "attached": True, "coordinatorStatus": "up", "queueLength": 0,
        "inFlight": 0, "draining": False, "metricsRegistered": True,
    }
    # The same head answers with the same boot id, errors included.
    assert api.call("GET", BASE_PATH, token="wrong")[1]["bootId"] == body["bootId"]


def test_authentication(head, token_file, monkeypatch):
    _, api = head()
    status, body = api.call("GET", BASE_PATH, token=None)
    assert (status, body["error"]) == (401, "Unauthorized") and body["bootId"] == membership.BOOT_ID
    assert api.last_headers.get("www-authenticate") == "Bearer"
    assert api.call("GET", BASE_PATH, token="wrong")[0] == 401
    assert api.call("GET", BASE_PATH, token=None, headers={"Authorization": f"Basic {TOKEN}"})[0] == 401
    assert api.call("POST", BASE_PATH + "/leave", {"stage": 0, "replicaId": 0}, token="wrong")[0] == 401
    assert api.call("GET", BASE_PATH)[0] == 200
    # A rotated Secret takes effect without a restart.
    token_file.write_text("rotated")
    assert api.call("GET", BASE_PATH)[0] == 401
    assert api.call("GET", BASE_PATH, token="rotated")[0] == 200
    # The environment variable is the fallback when no file is configured.
    monkeypatch.delenv("OMNISTAGE_MEMBERSHIP_TOKEN_FILE")
    monkeypatch.setenv("OMNISTAGE_MEMBERSHIP_TOKEN", "from-env")
    assert api.call("GET", BASE_PATH, token="from-env")[0] == 200
    # Nothing configured: refused, never open.
    monkeypatch.delenv("OMNISTAGE_MEMBERSHIP_TOKEN")
    status, body = api.call("GET", BASE_PATH, token="from-env")
    assert (status, body["error"]) == (503, "TokenNotConfigured")


# ---- join ----------------------------------------------------------------------------------


def test_join_returns_the_assigned_id_and_registers_series(head):
    engine, api = head()
    ip = _ip()
    status, body = api.join("replica-a", ip, waitSeconds=0)
    assert (status, body["error"]) == (404, "ReplicaNotRegistered") and body["ip"] == ip
    replica = SimulatedReplica(engine._omni_master_address, engine._omni_master_port, ip).start()
    try:
        status, body = api.join("replica-a", ip)  # the operator's body: {stage, pod, ip}
        assert status == 200, body
        assert body["replicaId"] == replica.replica_id == 1  # what the master assigned
        assert body["replicaIds"] == [1]
        assert (body["pod"], body["host"], body["state"], body["attached"]) == ("replica-a", ip, "attached", True)
        assert body["metricsRegistered"] is True
        # Series exist now, zero-valued, although the replica has served nothing.
        lines = replica_lines(api.metrics(), 1)
        assert any(ln.startswith('vllm:num_requests_running{') and ln.endswith(" 0.0") for ln in lines)
        assert len(lines) > 30
        epoch = body["epoch"]
        again_status, again = api.join("replica-a", ip)
        assert (again_status, again["replicaId"], again["epoch"]) == (200, 1, epoch)  # idempotent
        status, body = api.join("replica-b", ip)
        assert (status, body["error"], body["pod"]) == (409, "ReplicaOwnedByOtherPod", "replica-a")
        assert api.members()[1]["pod"] == "replica-a"
    finally:
        replica.down()


def test_join_waits_for_the_head_side_attach(head):
    engine, api = head(attach_delay=1.5)
    ip = _ip()
    replica = SimulatedReplica(engine._omni_master_address, engine._omni_master_port, ip).start()
    try:
        status, body = api.join("replica-a", ip, waitSeconds=0)
        assert (status, body["error"], body["replicaId"]) == (409, "ReplicaNotAttached", replica.replica_id)
        assert api.members()[replica.replica_id]["state"] == "registered"
        status, body = api.join("replica-a", ip, waitSeconds=10)
        assert status == 200 and body["replicaId"] == replica.replica_id and body["attached"] is True
    finally:
        replica.down()


# ---- leave ---------------------------------------------------------------------------------


def test_leave_drains_in_flight_requests_then_detaches(head):
    engine, api = head()
    replica = start_replica(engine)
    rid = replica.replica_id
    try:
        assert api.join("replica-a", replica.bind_ip)[0] == 200
        bind_request(engine, rid, "chat-1")
        assert api.members()[rid]["inFlight"] == 1
        result: dict[str, Any] = {}
        leaving = threading.Thread(
            target=lambda: result.update(zip(("status", "body"), api.leave(pod="replica-a", replicaId=rid,
                                                                             drainTimeoutSeconds=20))))
        leaving.start()
        wait_for(lambda: api.members()[rid]["draining"], 10, what="draining")
        assert api.members()[rid]["state"] == "draining"
        # New requests are no longer routed there; the in-flight one still is (sticky).
        assert rid not in fresh_picks(engine, 6)
        assert engine.on_loop(lambda: engine.stage0.pick("chat-1")) == rid
        time.sleep(0.3)
        assert leaving.is_alive(), "leave waits while a request is in flight"
        engine.on_loop(lambda: engine.stage0.release_binding("chat-1"))  # the request finished
        leaving.join(30)
        status, body = result["status"], result["body"]
        assert status == 200, body
        assert (body["state"], body["drained"], body["timedOut"], body["detached"]) == ("left", True, False, True)
        assert body["inFlightAtDetach"] == 0 and body["waitedSeconds"] >= 0.3
        assert (body["replicaId"], body["pod"], body["metricsRegistered"]) == (rid, "replica-a", False)
        assert rid not in engine.attached_replica_ids()
        assert replica_lines(api.metrics(), rid) == []
        assert rid not in api.members()
        assert api.members(all=True)[rid]["state"] == "left"
        assert set(fresh_picks(engine, 3)) == {0}
    finally:
        replica.down()


def test_leave_times_out_and_fails_what_is_still_in_flight(head):
    engine, api = head()
    replica = start_replica(engine)
    rid = replica.replica_id
    try:
        bind_request(engine, rid, "chat-stuck")
        status, body = api.leave(replicaId=rid, drainTimeoutSeconds=0.3)
        assert status == 200, body
        assert (body["drained"], body["timedOut"], body["inFlightAtDetach"], body["detached"]) == (False, True, 1, True)
        assert 0.3 <= body["waitedSeconds"] < 5
        assert "chat-stuck" not in engine.stage0._affinity
        # vllm-omni's detach path failed the request that was still bound there.
        msg = engine.output_queue.sync_q.get(timeout=5)
        assert (msg.request_id, msg.error) == ("chat-stuck", "stage replica disappeared")
    finally:
        replica.down()


def test_leave_is_idempotent_and_rejects_bad_calls(head):
    engine, api = head()
    replica = start_replica(engine)
    rid = replica.replica_id
    try:
        assert api.join("replica-a", replica.bind_ip)[0] == 200
        status, body = api.leave(pod="replica-b", replicaId=rid)
        assert (status, body["error"], body["pod"]) == (409, "PodMismatch", "replica-a")
        status, first = api.leave(pod="replica-a", drainTimeoutSeconds=0)
        assert (status, first["state"], first["alreadyLeft"]) == (200, "left", False)
        status, second = api.leave(pod="replica-a", replicaId=rid, drainTimeoutSeconds=0)
        assert (status, second["state"], second["alreadyLeft"], second["replicaId"]) == (200, "left", True, rid)
        assert second["drained"] == first["drained"] and second["epoch"] == first["epoch"]
        assert api.leave(ip=replica.bind_ip)[1]["alreadyLeft"] is True

        cases = [
            ({"replicaId": 99}, 404, "UnknownReplica"),
            ({"pod": "nobody"}, 404, "UnknownReplica"),
            ({"replicaId": 0}, 409, "HeadLocalReplica"),
            ({"stage": 7, "replicaId": 1}, 404, "UnknownStage"),
            ({}, 422, "InvalidBody"),
            ({"replicaId": 1, "drainTimeoutSeconds": -1}, 422, "InvalidBody"),
            ({"replicaId": "one"}, 422, "InvalidBody"),
            ({"replicaId": 1, "surprise": True}, 422, "InvalidBody"),
        ]
        for body, want_status, want_error in cases:
            status, answer = api.leave(**body)
            assert (status, answer["error"]) == (want_status, want_error), (body, answer)
            assert answer["bootId"] == membership.BOOT_ID and answer["message"]
        status, answer = api.call("POST", BASE_PATH + "/leave", raw=b"{not json")
        assert (status, answer["error"]) == (400, "BadRequest")
        status, answer = api.call("POST", BASE_PATH + "/leave", [0, 1])
        assert (status, answer["error"]) == (400, "BadRequest")
        status, answer = api.call("POST", BASE_PATH + "/join", {"stage": 0, "ip": "127.0.0.9"})
        assert (status, answer["error"]) == (422, "InvalidBody") and answer["fields"][0]["field"] == "pod"
    finally:
        replica.down()


def test_failed_detach_restores_routing(head):
    engine, api = head()
    replica = start_replica(engine)
    rid = replica.replica_id
    controller = engine.orchestrator._membership

    async def broken(stage_id, input_addr, *args, **kwargs):
        raise RuntimeError("injected detach failure")

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(controller, "handle_unregister", broken)
            status, body = api.leave(replicaId=rid, drainTimeoutSeconds=0)
            assert (status, body["error"]) == (500, "DetachFailed") and "routing restored" in body["message"]
            member = api.members()[rid]
            assert (member["attached"], member["draining"], member["state"]) == (True, False, "attached")
            assert rid in fresh_picks(engine, 4), "routed to again"
        # The detach works again: the operator's retry succeeds.
        status, body = api.leave(replicaId=rid, drainTimeoutSeconds=0)
        assert (status, body["state"], body["alreadyLeft"]) == (200, "left", False)
    finally:
        replica.down()


def test_leave_during_attach_leaves_no_zombie(head):
    engine, api = head(attach_delay=1.0)
    ip = _ip()
    replica = SimulatedReplica(engine._omni_master_address, engine._omni_master_port, ip).start()
    rid = replica.replica_id
    try:
        status, body = api.leave(ip=ip, drainTimeoutSeconds=5)
        assert (status, body["state"], body["detached"]) == (200, "left", False)
        # The attach that was in flight completes, and the head detaches it at once.
        wait_for(lambda: engine._runtime.remote_clients, 10, what="the attach to complete")
        time.sleep(0.3)
        assert rid not in engine.attached_replica_ids()
        assert engine._runtime.remote_clients[0].shut_down.is_set()
        assert replica_lines(api.metrics(), rid) == []
        assert api.members(all=True)[rid]["state"] == "left"
    finally:
        replica.down()


def test_replica_dropped_by_the_head(head):
    """DOWN (or a heartbeat timeout) detaches a replica without a leave: it drops out of the
    listing, joining it again is refused (restart it), and a leave for it is a 200."""
    engine, api = head()
    replica = start_replica(engine)
    rid = replica.replica_id
    assert api.join("replica-a", replica.bind_ip)[0] == 200
    replica.down()
    wait_for(lambda: rid not in api.members(), 10, what="the head to drop it")
    assert api.members(all=True)[rid]["state"] == "detached"
    assert replica_lines(api.metrics(), rid) == []
    status, body = api.join("replica-a", replica.bind_ip, waitSeconds=0)
    assert (status, body["error"]) == (409, "ReplicaDetached")
    status, body = api.leave(pod="replica-a", replicaId=rid, drainTimeoutSeconds=30)
    assert (status, body["state"], body["detached"], body["drained"]) == (200, "left", False, True)


def test_distributed_head_shutdown_completes(text_config):
    """A distributed head stops: orchestrator thread gone, master and coordinator closed.

    vllm-omni 0.30.0 alone never finishes ``OrchestratorBase.run`` on a distributed head (the
    membership watcher it gathers stops only on an event set after the gather): shutdown gives up
    after 30 s and defers the runtime cleanup to a thread that waits forever. The membership
    patch sets that event when the orchestrator's shutdown begins."""
    with standin_head(text_config, _ip()) as engine:
        replica = start_replica(engine)
        runtime = engine._runtime
        coordinator = runtime._coordinator_runtime
    assert not engine.orchestrator_thread.is_alive()
    assert runtime._omni_master_server is None and runtime._coordinator_runtime is None
    assert not coordinator._proc.is_alive()
    replica.down()


# ---- the stand-in as processes (what the cluster tests and the demo run) -------------------


def test_standin_processes(tmp_path):
    """``python -m tests.standin.head`` and ``python -m tests.standin.replica`` on loopback pod
    IPs: register, join, metrics, DOWN on SIGTERM, clean head exit on SIGTERM."""
    head_ip, replica_ip = _ip(), _ip()
    master_port, http_port = free_port(head_ip), free_port(head_ip)
    (tmp_path / "token").write_text(TOKEN)
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("VLLM_PLUGINS", None)  # the head sets its own allow-list

    def spawn(args: list[str], name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    head = spawn(["tests.standin.head", "--bind-ip", head_ip, "--master-port", str(master_port), "--http-port",
                  str(http_port), "--token-file", str(tmp_path / "token")], "head")
    replica = spawn(["tests.standin.replica", "--master-ip", head_ip, "--master-port", str(master_port),
                     "--bind-ip", replica_ip], "replica")
    api = Api(f"http://{head_ip}:{http_port}")
    try:
        def healthy() -> bool:
            try:
                with _OPENER.open(api.url + "/health", timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False

        wait_for(healthy, 180, 0.5, what=f"the head's /health (log: {tmp_path / 'head.log'})")
        wait_for(lambda: any(m["host"] == replica_ip for m in api.members().values()), 180, 0.5,
                 what=f"the replica to register (log: {tmp_path / 'replica.log'})")
        status, body = api.join("replica-a", replica_ip)
        assert status == 200 and body["replicaId"] == 1 and body["local"] is False
        assert replica_lines(api.metrics(), 1)
        replica.send_signal(signal.SIGTERM)
        assert replica.wait(30) == 0
        wait_for(lambda: 1 not in api.members(), 15, what="the head to detach the replica after its DOWN")
        assert api.leave(pod="replica-a", drainTimeoutSeconds=5)[1]["state"] == "left"
        children = [int(pid) for pid in subprocess.run(["ps", "-o", "pid=", "--ppid", str(head.pid)],
                                                          check=False, capture_output=True, text=True).stdout.split()]
        assert children, "the coordinator runs as the head's child process"
        head.send_signal(signal.SIGTERM)
        assert head.wait(60) == 0

        def gone(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        wait_for(lambda: all(gone(pid) for pid in children), 10, what="the coordinator process to exit")
    finally:
        for proc in (replica, head):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
