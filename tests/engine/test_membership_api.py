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

With ``OMNISTAGE_DISABLE_PATCHES=membership`` every test that runs a stand-in head fails (503
``MembershipPatchDisabled``: the ``head`` fixture itself waits for the listing). The two listing
tests on fake head objects (``tests/bench/bench_listing.fake_head``) pass either way: they drive
``membership_ops``' listing code directly, not the patch's hooks. The patch's negative control runs
test_membership_hooks.py instead, whose tests fail for what each hook does.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)")

from omnistage_engine_patches import contract, report
from omnistage_engine_patches.contract import ENDPOINT_PLUGIN as PLUGIN_NAME
from omnistage_engine_patches.contract import MEMBERSHIP_PATH as BASE_PATH
from omnistage_engine_patches.membership_ops import LiveHead
from omnistage_engine_patches.patches import membership
from omnistage_engine_patches.patches.membership import draining_of, held_of, state_of

from tests.bench.bench_listing import fake_head
from tests.standin.engine import (
    HttpServerThread,
    StandinEngineClient,
    build_http_app,
    build_vllm_config,
    standin_head,
    wait_quietly,
)
from tests.standin.replica import SimulatedReplica
from tests.support.loopback import loopback_ip
from tests.support.ports import free_port
from tests.support.tiny_models import build_config_only_model

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "membership-token-for-tests"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy



class Api:
    """The operator's side of the wire: JSON over HTTP with a bearer token. `url` is the head's public
    (vLLM) port, `membership` its membership port: the paths under contract.API_PREFIX go there, the
    liveness and everything else to the public port (as the operator and the kubelet dial them)."""

    def __init__(self, url: str, membership: str | None = None, token: str | None = TOKEN) -> None:
        self.url, self.membership, self.token = url, membership or url, token

    def base(self, path: str) -> str:
        on_membership = path.startswith(contract.API_PREFIX) and not path.startswith(contract.LIVE_PATH)
        return self.membership if on_membership else self.url

    def call(self, method: str, path: str, body: Any = None, *, token: Any = "default", raw: bytes | None = None,
             headers: dict[str, str] | None = None, timeout: float = 60,
             base: str | None = None) -> tuple[int, dict[str, Any]]:
        token = self.token if token == "default" else token
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request((base or self.base(path)) + path, data=data, method=method)
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

    def hold(self, **body: Any) -> tuple[int, dict[str, Any]]:
        return self.call("POST", BASE_PATH + "/hold", {"stage": 0, **body})

    def metrics(self) -> str:
        with _OPENER.open(self.url + "/metrics", timeout=30) as resp:
            return resp.read().decode()


def replica_lines(metrics_text: str, replica_id: int) -> list[str]:
    return [ln for ln in metrics_text.splitlines()
            if ln.startswith("vllm:") and f'replica="{replica_id}"' in ln and "_created" not in ln]


@pytest.fixture(scope="module")
def text_config(tmp_path_factory):
    return build_vllm_config(build_config_only_model(tmp_path_factory.mktemp("standin-model")), "tiny")


@pytest.fixture
def token_file(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")  # a mounted Secret may end with a newline
    monkeypatch.setenv("OMNISTAGE_MEMBERSHIP_TOKEN_FILE", str(path))
    monkeypatch.delenv("OMNISTAGE_MEMBERSHIP_TOKEN", raising=False)
    return path


def _allow_endpoint_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's build_app mounts our endpoint only when VLLM_PLUGINS names it."""
    listed = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    monkeypatch.setenv("VLLM_PLUGINS", ",".join(dict.fromkeys([*listed, PLUGIN_NAME])))


def serve_head_app(engine_client: Any, ip: str, monkeypatch: pytest.MonkeyPatch) -> tuple[HttpServerThread, Api]:
    """vLLM's app for `engine_client` on `ip` (a free public port), with the plugin's membership port
    (contract.MEMBERSHIP_PORT_ENV: a free port of `ip` too); started."""
    monkeypatch.setenv(contract.MEMBERSHIP_PORT_ENV, str(free_port(ip)))
    server = HttpServerThread(build_http_app(engine_client, ip, 0), ip, free_port(ip))
    server.__enter__()
    return server, Api(server.url, f"http://{ip}:{os.environ[contract.MEMBERSHIP_PORT_ENV]}")


@pytest.fixture
def http_app(token_file, monkeypatch):
    """Factory: ``http_app(engine_client) -> api``: vLLM's app with our endpoint for any engine
    client (None: the server has no engine yet), served on a loopback address."""
    _allow_endpoint_plugin(monkeypatch)
    servers: list[HttpServerThread] = []

    def make(engine_client: Any) -> Api:
        server, api = serve_head_app(engine_client, loopback_ip(), monkeypatch)
        servers.append(server)
        return api

    yield make
    for server in reversed(servers):
        server.__exit__(None, None, None)


@pytest.fixture
def head(text_config, token_file, monkeypatch):
    """Factory: ``head(**standin_options) -> (engine, api)``: a stand-in head with its HTTP app."""
    _allow_endpoint_plugin(monkeypatch)
    stack: list[Any] = []

    def make(**options: Any) -> tuple[Any, Api]:
        ip = loopback_ip()
        ctx = standin_head(text_config, ip, **options)
        engine = ctx.__enter__()
        stack.append(ctx)
        server, api = serve_head_app(StandinEngineClient(engine), ip, monkeypatch)
        stack.append(server)
        # The coordinator has published the head-local replica: the head is fully up.
        wait_quietly("the local replica UP",
                     lambda: api.members().get(0, {}).get("coordinatorStatus") == "up",
                     10)
        return engine, api

    yield make
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)


def start_replica(engine: Any, *, seen_up: bool = True) -> SimulatedReplica:
    replica = SimulatedReplica(engine._omni_master_address, engine._omni_master_port, loopback_ip()).start()
    wait_quietly("attach", lambda: replica.replica_id in engine.attached_replica_ids(), 10)
    if seen_up:
        # vllm-omni's watcher detaches a replica only after it has seen it UP (see
        # test_replica_metrics.join); a live replica is in that state.
        controller = engine.orchestrator._membership
        addr = engine.stage0.clients[replica.replica_id].client_addresses["input_address"]
        wait_quietly("the watcher to see it UP", lambda: (0, addr) in controller._observed_up_attached_addrs,
                     10)
    return replica


def bind_request(engine: Any, replica_id: int, request_id: str, *, stage_id: int = 0) -> None:
    """Route a request the way the orchestrator does (``StagePool.pick``) until it lands on
    ``replica_id``; requests that landed elsewhere are finished (``release_binding``)."""
    pool = engine.stage_pools[stage_id]
    for n in range(8):  # round robin over a handful of replicas: bounded
        rid = f"{request_id}-probe{n}"
        picked = engine.on_loop(lambda rid=rid: pool.pick(rid))
        if picked == replica_id:
            engine.on_loop(lambda rid=rid: pool.bind(request_id, pool._affinity.pop(rid)))
            return
        engine.on_loop(lambda rid=rid: pool.release_binding(rid))
    raise AssertionError(f"the load balancer never picked replica {replica_id}")


def fresh_picks(engine: Any, n: int, *, stage_id: int = 0) -> list[int]:
    pool = engine.stage_pools[stage_id]
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
    assert body["bootId"] == report.BOOT_ID and len(body["bootId"]) == 32
    assert isinstance(body["epoch"], int) and body["distributed"] is True and body["metricsEnabled"] is True
    assert body["next"] is None
    (local,) = body["stages"]["0"]
    assert local == {
        "stage": 0, "replicaId": 0, "host": engine._omni_master_address, "pod": None, "local": True,
        "state": "attached", "registered": True, "attached": True, "held": False, "coordinatorStatus": "up",
        "queueLength": 0, "inFlight": 0, "draining": False, "metricsRegistered": True,
    }
    # The same head answers with the same boot id, errors included (but 401, see below).
    assert api.call("POST", BASE_PATH + "/leave", {"stage": 0, "replicaId": 99})[1]["bootId"] == body["bootId"]


def test_authentication(head, token_file, monkeypatch):
    _, api = head()
    status, body = api.call("GET", BASE_PATH, token=None)
    # A caller without the token learns nothing about the head: not even its boot id.
    assert (status, body) == (401, {"error": "Unauthorized", "message": "missing or wrong bearer token"})
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


# ---- the membership port and the pods' credentials (issue 27 item 6) ------------------------


def test_membership_routes_answer_on_the_membership_port_only(head):
    """Every token route is on the membership port; vLLM's public port (open to everyone) answers
    them 404. The liveness stays on the public port, where the kubelet probes it."""
    _, api = head()
    assert api.membership != api.url
    for path in (BASE_PATH, contract.ENGINE_PATH):
        assert api.call("GET", path)[0] == 200, path
        status, _ = api.call("GET", path, base=api.url)
        assert status == 404, f"the public port answers {path}: {status}"
    for path in (contract.JOIN_PATH, contract.LEAVE_PATH):
        assert api.call("POST", path, {"stage": 0, "replicaId": 99})[0] in (404, 422), path  # the head's answer
        assert api.call("POST", path, {"stage": 0, "replicaId": 99}, base=api.url)[0] == 404, path
    assert api.call("GET", contract.LIVE_PATH, token=None)[0] == 200
    assert api.call("GET", contract.LIVE_PATH, token=None, base=api.membership)[0] == 404


def test_a_pod_credential_makes_only_its_own_pod_leave(head):
    """A replica pod's preStop hook holds contract.pod_credential(master, its name): the head takes
    it for that pod's own leave by name and nothing else (403), a forged one not at all (401); the
    master token (the operator's) still does everything."""
    engine, api = head()
    a, b = start_replica(engine), start_replica(engine)
    assert api.join("pod-a", a.bind_ip)[0] == 200 and api.join("pod-b", b.bind_ip)[0] == 200
    ids = {m["pod"]: m["replicaId"] for m in api.members().values() if m["pod"]}
    cred = contract.pod_credential(TOKEN, "pod-a")
    refused = [
        ("GET", BASE_PATH, None), ("GET", contract.ENGINE_PATH, None),
        ("POST", contract.JOIN_PATH, {"stage": 0, "pod": "pod-a", "ip": a.bind_ip}),
        ("POST", contract.LEAVE_PATH, {"stage": 0, "pod": "pod-b"}),  # another pod
        ("POST", contract.LEAVE_PATH, {"stage": 0, "replicaId": ids["pod-b"]}),
        ("POST", contract.LEAVE_PATH, {"stage": 0, "ip": b.bind_ip}),
        ("POST", contract.LEAVE_PATH, {"stage": 0, "pod": "pod-a", "replicaId": ids["pod-b"]}),
        ("POST", contract.LEAVE_PATH, {"stage": 0, "pod": "pod-a", "ip": b.bind_ip}),
    ]
    for method, path, body in refused:
        status, answer = api.call(method, path, body, token=cred)
        assert (status, answer.get("error")) == (403, "Forbidden"), (method, path, body, answer)
        assert "bootId" not in answer
    forged = [cred[:-4] + "0000", cred.replace("pod-a", "pod-b"), contract.pod_credential("another", "pod-b"),
              contract.pod_credential(TOKEN, "pod-a") + "x", "pod:", "pod::"]
    for token in forged:
        status, answer = api.call("POST", contract.LEAVE_PATH, {"stage": 0, "pod": "pod-b"}, token=token)
        assert (status, answer.get("error")) == (401, "Unauthorized"), (token, answer)
    assert {m["pod"] for m in api.members().values() if m["state"] == "attached"} >= {"pod-a", "pod-b"}
    status, answer = api.call("POST", contract.LEAVE_PATH, {"stage": 0, "pod": "pod-a", "drainTimeoutSeconds": 5},
                              token=cred)
    assert (status, answer["state"], answer["replicaId"]) == (200, "left", ids["pod-a"]), answer
    states = {m["pod"]: m["state"] for m in api.members(all=True).values() if m["pod"]}
    assert states == {"pod-a": "left", "pod-b": "attached"}
    # The master token: another pod's leave, by id.
    status, answer = api.leave(replicaId=ids["pod-b"], drainTimeoutSeconds=5)
    assert (status, answer["state"]) == (200, "left"), answer


# ---- join ----------------------------------------------------------------------------------


def test_join_returns_the_assigned_id_and_registers_series(head):
    engine, api = head()
    ip = loopback_ip()
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
    ip = loopback_ip()
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
        wait_quietly("draining", lambda: api.members()[rid]["draining"], 10)
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
            assert answer["bootId"] == report.BOOT_ID and answer["message"]
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
            # A 500 reveals nothing: no exception text (it is in the head's log), no boot id.
            assert "injected" not in json.dumps(body) and "bootId" not in body
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
    ip = loopback_ip()
    replica = SimulatedReplica(engine._omni_master_address, engine._omni_master_port, ip).start()
    rid = replica.replica_id
    try:
        status, body = api.leave(ip=ip, drainTimeoutSeconds=5)
        assert (status, body["state"], body["detached"]) == (200, "left", False)
        # The attach that was in flight completes, and the head detaches it at once.
        wait_quietly("the attach to complete", lambda: engine._runtime.remote_clients, 10)
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
    # Listed detached until a leave (the operator replaces its pod, then tells the head to forget it).
    wait_quietly("the head to drop it", lambda: api.members().get(rid, {}).get("state") == "detached", 10)
    assert api.members(all=True)[rid]["state"] == "detached"
    assert replica_lines(api.metrics(), rid) == []
    status, body = api.join("replica-a", replica.bind_ip, waitSeconds=0)
    assert (status, body["error"]) == (409, "ReplicaDetached")
    status, body = api.leave(pod="replica-a", replicaId=rid, drainTimeoutSeconds=30)
    assert (status, body["state"], body["detached"], body["drained"]) == (200, "left", False, True)


# ---- hardening -----------------------------------------------------------------------------


def _raw_post(url: str, path: str, body_chunks: list[bytes], *, token: str | None = TOKEN,
              length: int | None = None) -> tuple[int, dict[str, Any]]:
    """POST with http.client: a declared Content-Length, or (length None) chunked transfer
    encoding, which declares no length at all."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        if token is not None:
            conn.putheader("Authorization", f"Bearer {token}")
        if length is None:
            conn.putheader("Transfer-Encoding", "chunked")
        else:
            conn.putheader("Content-Length", str(length))
        conn.endheaders()
        try:
            for chunk in body_chunks:
                conn.send(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if length is None else chunk)
            if length is None:
                conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the head answered and closed before the whole body was sent: the point
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def test_body_limits_and_nesting(head):
    """Bodies are read at most contract.MAX_BODY_BYTES into memory, declared or not (refused
    before the engine is looked up); deep nesting is a 400, never a RecursionError and a 500;
    authorization comes first."""
    _, api = head()
    big = json.dumps({"stage": 0, "pod": "p", "ip": "127.0.0.1", "pad": "x" * contract.MAX_BODY_BYTES}).encode()
    status, body = api.call("POST", BASE_PATH + "/join", raw=big)  # urllib declares Content-Length
    assert (status, body["error"]) == (413, "BodyTooLarge") and body["bootId"] == report.BOOT_ID
    # Chunked: no length up front; the head stops reading past the limit.
    chunks = [b'{"stage": 0, "pod": "p", "pad": "'] + [b"x" * 4096] * 8 + [b'"}']
    status, body = _raw_post(api.membership, BASE_PATH + "/join", chunks)
    assert (status, body["error"]) == (413, "BodyTooLarge")
    # A small chunked body is read normally (the limit is not a refusal of chunked encoding).
    status, body = _raw_post(api.membership, BASE_PATH + "/leave", [b'{"stage": 0, ', b'"replicaId": 99}'])
    assert (status, body["error"]) == (404, "UnknownReplica")
    # Deeply nested JSON within the size limit: the C parser would raise RecursionError.
    deep = b'{"pod": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert len(deep) < contract.MAX_BODY_BYTES
    status, body = api.call("POST", BASE_PATH + "/join", raw=deep)
    assert (status, body["error"]) == (400, "BadRequest") and "nested" in body["message"]
    nested = {"stage": 0, "pod": "p", "ip": "127.0.0.1", "x": [[[[[[[[[1]]]]]]]]]}  # depth 10 > 8
    status, body = api.call("POST", BASE_PATH + "/join", nested)
    assert (status, body["error"]) == (400, "BadRequest")
    status, body = api.call("POST", BASE_PATH + "/join", raw=b"\xff\xfe{")
    assert (status, body["error"]) == (400, "BadRequest")
    # Without the token a large body is a 401: nothing is read before authorization.
    status, body = _raw_post(api.membership, BASE_PATH + "/join", [big], token="wrong", length=len(big))
    assert (status, body["error"]) == (401, "Unauthorized") and "bootId" not in body


def test_internal_error_reveals_nothing(head, monkeypatch):
    """An unexpected exception is a 500 with a stable code and no exception text or boot id; the
    head's log has the traceback."""
    _, api = head()

    async def broken(self, *args, **kwargs):
        raise RuntimeError("secret-internal-detail")

    monkeypatch.setattr(LiveHead, "snapshot", broken)
    status, body = api.call("GET", BASE_PATH)
    assert (status, body) == (500, {"error": "InternalError", "message": "internal error, see the head's log"})


def test_engine_report(head, http_app):
    """GET contract.ENGINE_PATH (which does not need the membership patch) is authorised like
    the rest and answers on a distributed head, on a head that is not distributed, and on a
    server whose engine is not built yet."""
    _, api = head()
    status, body = api.call("GET", contract.ENGINE_PATH, token=None)
    assert (status, body["error"]) == (401, "Unauthorized") and "bootId" not in body
    status, body = api.call("GET", contract.ENGINE_PATH)
    assert status == 200, body
    assert set(body) == set(contract.EngineReport.__annotations__)
    assert body["bootId"] == report.BOOT_ID and body["distributed"] is True
    assert body["vllmVersion"] and body["vllmOmniVersion"]
    assert set(body["patches"]) == set(contract.PATCHES)
    assert all(p["outcome"] in contract.OUTCOMES and p["reason"] for p in body["patches"].values())
    for client, distributed in ((None, None), (SimpleNamespace(engine=SimpleNamespace(single_stage_mode=False)), False)):
        other = http_app(client)
        status, body = other.call("GET", contract.ENGINE_PATH)
        assert (status, body["distributed"], body["frontendCache"]) == (200, distributed, None), body
        # The membership routes answer on the same server, with the reason they cannot serve.
        status, body = other.call("GET", BASE_PATH)
        assert status == 503 and body["error"] in ("EngineNotReady", "MembershipPatchDisabled"), body


def _get_with_etag(api: Api, path: str, etag: str | None = None, token: str | None = TOKEN) -> tuple[int, Any, str]:
    req = urllib.request.Request(api.base(path) + path, method="GET")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if etag is not None:
        req.add_header("If-None-Match", etag)
    try:
        with _OPENER.open(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("ETag")
    except urllib.error.HTTPError as err:
        return err.code, (err.read() or b"").decode(), err.headers.get("ETag")


def test_conditional_gets_are_the_operators_cheap_probe(head):
    """The operator probes every head every few seconds with the ETag of what it holds: 304 and no
    body while the listing's boot id and epoch (or the report) are unchanged, 200 with the new
    answer when they moved. Negative controls: a stale or foreign ETag, and no token, never get 304."""
    engine, api = head()
    status, body, etag = _get_with_etag(api, BASE_PATH)
    # The boot id, the epoch and a digest of the engines' liveness (up, silent) as the coordinator said it.
    assert status == 200 and etag.startswith(f'"{body["bootId"]}.{body["epoch"]}.')
    status, empty, same = _get_with_etag(api, BASE_PATH, etag)
    assert (status, empty, same) == (304, "", etag)
    replica = start_replica(engine)  # its attach bumps the epoch
    status, moved, etag2 = _get_with_etag(api, BASE_PATH, etag)
    assert status == 200 and moved["epoch"] > body["epoch"] and etag2 != etag
    assert replica.replica_id in {m["replicaId"] for m in moved["stages"]["0"]}
    assert _get_with_etag(api, BASE_PATH, etag2)[0] == 304
    replica.down()  # the head drops it: the epoch moves again
    wait_quietly("the detach to move the epoch", lambda: _get_with_etag(api, BASE_PATH, etag2)[0] == 200, 10)
    # Another boot of the head (same epoch) is a change; pages of every route are never 304.
    epoch = api.list()["epoch"]
    assert _get_with_etag(api, BASE_PATH, f'"{"0" * 32}.{epoch}"')[0] == 200
    status, _page, page_etag = _get_with_etag(api, BASE_PATH + "?all=true", f'"{report.BOOT_ID}.{epoch}"')
    assert status == 200 and page_etag is None
    # The report: 304 while it is the same document.
    status, rep, retag = _get_with_etag(api, contract.ENGINE_PATH)
    assert status == 200 and rep["bootId"] == report.BOOT_ID and retag
    assert _get_with_etag(api, contract.ENGINE_PATH, retag)[0] == 304
    assert _get_with_etag(api, contract.ENGINE_PATH, '"stale"')[0] == 200
    # Without the token the ETag reveals nothing: 401 first.
    assert _get_with_etag(api, BASE_PATH, etag2, token=None)[0] == 401
    assert _get_with_etag(api, contract.ENGINE_PATH, retag, token=None)[0] == 401


def test_listing_pages_with_all(head):
    engine, api = head()
    replicas = [start_replica(engine) for _ in range(2)]
    try:
        status, first = api.call("GET", BASE_PATH + "?all=true&limit=2")
        assert status == 200 and [m["replicaId"] for m in first["stages"]["0"]] == [0, 1]
        assert first["next"] == "0:1"
        status, rest = api.call("GET", BASE_PATH + f"?all=true&limit=2&after={first['next']}")
        assert [m["replicaId"] for m in rest["stages"]["0"]] == [2] and rest["next"] is None
        for query, field in (("limit=0", "limit"), ("limit=1001", "limit"), ("limit=x", "limit"),
                             ("after=7", "after"), ("after=0:-1", "after")):
            status, body = api.call("GET", BASE_PATH + f"?all=true&{query}")
            assert (status, body["error"], body["fields"][0]["field"]) == (422, "InvalidQuery", field), query
    finally:
        for replica in replicas:
            replica.down()


# ---- the join gate -------------------------------------------------------------------------


def test_route_joined_only_holds_a_replica_until_it_is_joined(head, monkeypatch):
    """Regression (the gate): with contract.ROUTE_JOINED_ONLY_ENV=1 a replica's own registration
    attaches it but fresh picks never choose it until the operator joins it; the head-local
    replica stays routable throughout."""
    monkeypatch.setenv(contract.ROUTE_JOINED_ONLY_ENV, "1")
    engine, api = head()
    replica = start_replica(engine)
    rid = replica.replica_id
    try:
        member = api.members()[rid]
        assert (member["state"], member["attached"], member["held"], member["pod"]) == ("attached", True, True, None)
        assert set(fresh_picks(engine, 8)) == {0}, "a held replica gets no new requests"
        status, body = api.join("replica-a", replica.bind_ip)
        assert status == 200 and (body["replicaId"], body["held"]) == (rid, False)
        assert set(fresh_picks(engine, 8)) == {0, rid}, "routable once joined"
    finally:
        replica.down()


def test_hold_makes_a_joined_replica_stand_by_and_a_join_routes_to_it_again(head, monkeypatch):
    """A standby from a scale-down (spec.standby): hold drains a joined replica, lets its request in
    flight finish where it is (nothing detached), drops its pod name and its metric series, and keeps
    it attached and held: fresh picks skip it. A join under another pod name routes to it again; a
    replica that left cannot stand by (a process registers once)."""
    monkeypatch.setenv(contract.ROUTE_JOINED_ONLY_ENV, "1")
    engine, api = head()
    replica = start_replica(engine)
    rid = replica.replica_id
    try:
        assert api.join("replica-a", replica.bind_ip)[0] == 200
        assert rid in fresh_picks(engine, 8)
        bind_request(engine, rid, "chat-1")
        result: dict[str, Any] = {}
        holding = threading.Thread(target=lambda: result.update(zip(("status", "body"), api.hold(
            replicaId=rid, drainTimeoutSeconds=20))))
        holding.start()
        wait_quietly("held", lambda: api.members()[rid]["held"], 10)
        assert rid not in fresh_picks(engine, 6), "a held replica gets no new request"
        assert engine.on_loop(lambda: engine.stage0.pick("chat-1")) == rid, "its request in flight stays"
        time.sleep(0.3)
        assert holding.is_alive(), "hold waits while a request is in flight"
        engine.on_loop(lambda: engine.stage0.release_binding("chat-1"))
        holding.join(30)
        status, body = result["status"], result["body"]
        assert status == 200, body
        assert (body["state"], body["held"], body["drained"], body["detached"], body["pod"]) == (
            "attached", True, True, False, None)
        assert body["inFlightAtHold"] == 0 and body["metricsRegistered"] is False
        member = api.members()[rid]
        assert (member["state"], member["attached"], member["held"], member["pod"]) == ("attached", True, True, None)
        assert rid in engine.attached_replica_ids() and replica_lines(api.metrics(), rid) == []
        assert set(fresh_picks(engine, 8)) == {0}
        assert api.hold(replicaId=rid, drainTimeoutSeconds=0)[0] == 200  # idempotent
        status, body = api.join("replica-b", replica.bind_ip)  # a scale-up joins the standby
        assert status == 200 and (body["replicaId"], body["held"], body["pod"]) == (rid, False, "replica-b")
        assert rid in fresh_picks(engine, 8)
        assert api.leave(replicaId=rid, drainTimeoutSeconds=0)[1]["state"] == "left"
        status, body = api.hold(replicaId=rid)
        assert (status, body["error"]) == (409, contract.E_REPLICA_LEFT), body
        assert api.hold(replicaId=0)[0] == 409  # the head's own replica
    finally:
        replica.down()


def test_a_pod_credential_cannot_hold(head):
    """Standing by is the operator's decision: a pod credential may only make its own pod leave."""
    _engine, api = head()
    pod_api = Api(api.url, api.membership, token=contract.pod_credential(TOKEN, "replica-a"))
    status, body = pod_api.hold(pod="replica-a")
    assert status == 403 and "bootId" not in body, body


def test_without_the_gate_registration_alone_routes(head, monkeypatch):
    """Negative control of the gate: without contract.ROUTE_JOINED_ONLY_ENV, upstream's
    behaviour: a registered, attached replica gets fresh picks before any join."""
    monkeypatch.delenv(contract.ROUTE_JOINED_ONLY_ENV, raising=False)
    engine, api = head()
    replica = start_replica(engine)
    try:
        assert api.members()[replica.replica_id]["held"] is False
        assert replica.replica_id in fresh_picks(engine, 8)
    finally:
        replica.down()


def test_join_refused_while_the_frontend_cache_is_unsafe(head, monkeypatch):
    """Regression: join answers 409 contract.E_FRONTEND_CACHE_UNSAFE, and joins nothing, while
    the engine report says the head's stage-0 frontend runs a sender cache."""
    monkeypatch.setenv(contract.ROUTE_JOINED_ONLY_ENV, "1")
    engine, api = head()
    replica = start_replica(engine)
    rid = replica.replica_id
    try:
        monkeypatch.setattr(report, "frontend_cache_unsafe", lambda client: "the frontend runs a sender cache")
        status, body = api.join("replica-a", replica.bind_ip)
        assert (status, body["error"], body["message"]) == (409, contract.E_FRONTEND_CACHE_UNSAFE,
                                                             "the frontend runs a sender cache")
        assert (api.members()[rid]["pod"], api.members()[rid]["held"]) == (None, True)
        assert rid not in fresh_picks(engine, 6)
        monkeypatch.setattr(report, "frontend_cache_unsafe", lambda client: None)  # the report is fixed
        assert api.join("replica-a", replica.bind_ip)[0] == 200
        assert rid in fresh_picks(engine, 6)
    finally:
        replica.down()


def test_a_failed_attach_is_recorded_as_detached(head):
    """Regression: a registration the head fails to attach (handshake error) is dropped, not left
    ``registered`` for the life of the head in every default listing; joining it says restart."""
    engine, api = head()
    controller = engine.orchestrator._membership

    def broken_factory(stage_id, replica_id):
        raise RuntimeError("injected handshake failure")

    ip = loopback_ip()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(controller, "_remote_replica_factory", broken_factory)
        replica = SimulatedReplica(engine._omni_master_address, engine._omni_master_port, ip).start()
        try:
            rid = replica.replica_id
            wait_quietly("the failed attach to be recorded",
                         lambda: api.members(all=True).get(rid, {}).get("state") == "detached",
                         10)
            # Listed detached until a leave (the newest 64 such): the operator sees what the head dropped.
            assert api.members()[rid]["state"] == "detached"
            status, body = api.join("replica-a", ip, waitSeconds=0)
            assert (status, body["error"]) == (409, contract.E_REPLICA_DETACHED)
        finally:
            replica.down()


# ---- the listing at scale (fake head objects, no engine) ---------------------------------


def test_listing_at_16k_routes_lists_the_right_entries():
    """LiveHead's listing on fake master/pool/hub objects (the benchmark's; not a timing test):
    at 16k routes the default listing has exactly the head-local, attached, draining and
    registered replicas with their in-flight counts, and ``?all=true`` pages cover every route
    once, in order, with the right states."""
    n, live = 16_000, 8
    loop = asyncio.new_event_loop()
    try:
        head = fake_head(LiveHead, n, live=live, in_flight=100, loop=loop, state_of=state_of)
        master, pool = head.master, head.orch.stage_pools[0]
        live_ids = [0, *range(n - live, n)]
        # One more of each other state: a registration still attaching, a pending slot.
        for rid, registered in ((n, True), (n + 1, False)):
            master._stage_routes[(0, rid)] = SimpleNamespace(replica_host="127.1.0.1",
                                                             input_bind_address=f"tcp://127.9.0.1:{40000 + rid}")
            if registered:
                master._stage_configs[(0, rid)] = None
        draining_of(pool).add(live_ids[1])
        held_of(pool).add(live_ids[2])

        body = loop.run_until_complete(head.snapshot())
        listed = {m["replicaId"]: m for m in body["stages"]["0"]}
        # The newest replicas the head detached on its own, until a leave answers them (bounded).
        detached = sorted(rid for _, rid in head.state.detached_open)
        assert len(detached) == membership.MAX_DETACHED_LISTED and detached[-1] == max(range(2, n - live, 2))
        assert sorted(listed) == sorted([*live_ids, n, *detached])
        assert all(listed[rid]["state"] == "detached" for rid in detached)
        listed = {rid: m for rid, m in listed.items() if rid not in detached}
        assert listed[0]["local"] and listed[n]["state"] == "registered"
        assert listed[live_ids[1]]["state"] == "draining" and listed[live_ids[2]]["held"] is True
        assert all(listed[rid]["state"] in ("attached", "draining") for rid in live_ids)
        # bench_listing spreads the requests round robin over the live replicas.
        expected = Counter(live_ids[i % len(live_ids)] for i in range(100))
        assert {rid: m["inFlight"] for rid, m in listed.items()} == {**expected, n: 0}

        seen, after, pages = [], None, 0
        while True:
            page = loop.run_until_complete(head.snapshot(include_all=True, limit=1000, after=after))
            seen.extend(page["stages"]["0"])
            pages += 1
            after = page["next"]
            if after is None:
                break
            assert pages < 100
        assert pages == 17 and [m["replicaId"] for m in seen] == list(range(n + 2))
        states = Counter(m["state"] for m in seen)
        departed = n - len(live_ids)
        assert states == {"left": departed // 2 + departed % 2, "detached": departed // 2, "attached": len(live_ids) - 1,
                          "draining": 1, "registered": 1, "pending": 1}
        assert all(m["state"] == ("left" if m["replicaId"] % 2 else "detached")
                   for m in seen if 0 < m["replicaId"] < n - live)
    finally:
        loop.close()


def test_departed_replicas_stay_departed_after_many_leaves(monkeypatch):
    """Regression: once more replicas left than the head keeps full leave records for, the
    oldest must still be listed as left (not ``registered`` again), and a repeated leave still
    answers ``alreadyLeft``."""
    monkeypatch.setattr(membership, "MAX_LEFT_RECORDS", 4)
    loop = asyncio.new_event_loop()
    try:
        head = fake_head(LiveHead, 40, live=2, in_flight=0, loop=loop, state_of=state_of)  # 37 departed
        assert len(head.state.left_records) == 4
        default = loop.run_until_complete(head.snapshot())
        detached = [rid for rid in range(1, 38) if rid % 2 == 0]  # the head's own detaches, no leave yet
        assert [m["replicaId"] for m in default["stages"]["0"]] == sorted([0, 38, 39, *detached])
        everything = loop.run_until_complete(head.snapshot(include_all=True))["stages"]["0"]
        assert [m["state"] for m in everything[1:38]] == ["left" if rid % 2 else "detached" for rid in range(1, 38)]
        again = loop.run_until_complete(head.leave(0, replica_id=1, drain_timeout=0))
        assert (again["alreadyLeft"], again["state"], again["replicaId"], again["recordExpired"]) == (True, "left", 1, True)
    finally:
        loop.close()


# ---- the stand-in as processes (what the cluster tests and the demo run) -------------------


def test_standin_processes(tmp_path):
    """``python -m tests.standin.head`` and ``python -m tests.standin.replica`` on loopback pod
    IPs: register, join, metrics, DOWN on SIGTERM, clean head exit on SIGTERM."""
    head_ip, replica_ip = loopback_ip(), loopback_ip()
    master_port, http_port, membership_port = free_port(head_ip), free_port(head_ip), free_port(head_ip)
    (tmp_path / "token").write_text(TOKEN)
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env[contract.MEMBERSHIP_PORT_ENV] = str(membership_port)  # as the operator renders it into the head pod
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
    api = Api(f"http://{head_ip}:{http_port}", f"http://{head_ip}:{membership_port}")
    try:
        def healthy() -> bool:
            try:
                with _OPENER.open(api.url + "/health", timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False

        wait_quietly(f"the head's /health (log: {tmp_path / 'head.log'})", healthy, 180, interval=0.5)
        wait_quietly(f"the replica to register (log: {tmp_path / 'replica.log'})",
                     lambda: any(m["host"] == replica_ip for m in api.members().values()),
                     180, interval=0.5)
        status, body = api.join("replica-a", replica_ip)
        assert status == 200 and body["replicaId"] == 1 and body["local"] is False
        assert replica_lines(api.metrics(), 1)
        # The head lists a replica as soon as it allocated its route, a moment before the replica has
        # read the reply; a SIGTERM in between exits without DOWN (nothing registered yet, as far as
        # the replica knows), and the head then waits out its 30 s heartbeat timeout (seen in CI).
        wait_quietly("the replica to log that it is up (then a signal leads to DOWN)",
                     lambda: b" up (coord=" in (tmp_path / "replica.log").read_bytes(),
                     60, interval=0.1)
        replica.send_signal(signal.SIGTERM)
        assert replica.wait(30) == 0
        # Within 20 s: more than a loaded 2-core machine needs (15 s was missed once in a full `make
        # test`), and short of the earliest detach without a DOWN (the head's 30 s heartbeat timeout
        # less the 5 s between heartbeats), so a DOWN that never arrived still fails here.
        wait_quietly("the head to detach the replica after its DOWN",
                     lambda: api.members().get(1, {}).get("state") == "detached", 20)
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

        wait_quietly("the coordinator process to exit", lambda: all(gone(pid) for pid in children), 10)
    finally:
        for proc in (replica, head):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
