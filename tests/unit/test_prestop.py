"""The replica pod's preStop hook (omnistage_engine_patches.prestop) and how it is rendered: whoever
deletes a replica or pool pod, the kubelet first has the head drain it (issue 19)."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from omnistage.control.pools import parse
from omnistage.render import render_head_pod, render_replica_pod, target_from
from omnistage.render.pods import SHUTDOWN_SECONDS, render_pool_pod
from omnistage_engine_patches import contract, prestop

from .test_plan import HEAD_IP, HEAD_UID, omnistage
from .test_plan_pools import pipeline, pool_obj


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]):
    """`handler` on a free port of 127.0.0.1: its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


class Quiet(BaseHTTPRequestHandler):
    def reply(self, code: int, out: bytes = b"") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def head():
    """A head on 127.0.0.1 that records each leave it is asked for."""
    calls: list[dict] = []

    class Handler(Quiet):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
            self.reply(200, json.dumps({"drained": True}).encode())

    with serving(Handler) as base:
        yield base, calls


def test_the_hook_leaves_every_stage_of_the_pod_drained(head, tmp_path, monkeypatch):
    base, calls = head
    (tmp_path / "token").write_text("s3cret\n")
    monkeypatch.setenv(contract.HEAD_URL_ENV, base)
    monkeypatch.setenv(contract.TOKEN_FILE_ENV, str(tmp_path / "token"))
    monkeypatch.setenv(contract.DRAIN_SECONDS_ENV, "45")
    monkeypatch.setenv("POD_NAME", "speech-1")
    assert prestop.main(["--stage-id", "1", "--stage-id", "2"]) == 0
    assert sorted((c["stage"], c["pod"], c["drainTimeoutSeconds"], c["path"], c["auth"]) for c in calls) == [
        (1, "speech-1", 45.0, contract.LEAVE_PATH, "Bearer s3cret"),
        (2, "speech-1", 45.0, contract.LEAVE_PATH, "Bearer s3cret")]


def test_the_hook_never_fails_the_pod_s_termination(monkeypatch, capsys):
    monkeypatch.setenv(contract.HEAD_URL_ENV, "http://127.0.0.1:9")  # nothing listens
    monkeypatch.setenv(contract.TOKEN_ENV, "t")
    monkeypatch.setenv(contract.DRAIN_SECONDS_ENV, "1")
    monkeypatch.setenv("POD_NAME", "x-replica-1")
    monkeypatch.delenv(contract.TOKEN_FILE_ENV, raising=False)
    assert prestop.main([]) == 0
    assert "no answer from the head" in capsys.readouterr().out


def _engine(pod):
    return pod["spec"]["containers"][0]


def test_replica_and_pool_pods_leave_on_stop_and_the_head_waits_for_its_requests():
    """Fails on replica pods without a preStop hook (evicted replicas were cut off mid-request)."""
    t = target_from(omnistage(2))
    replica = render_replica_pod(t, 1, HEAD_IP, HEAD_UID)
    assert _engine(replica)["lifecycle"]["preStop"]["exec"]["command"] == [
        "python3", "-m", "omnistage_engine_patches.prestop", "--stage-id", "0"]
    env = {e["name"]: e.get("value") for e in _engine(replica)["env"]}
    # The head's membership port, with the pod's own credential (issue 27 item 6), never the master token.
    assert env[contract.HEAD_URL_ENV] == f"http://{HEAD_IP}:{t.spec.engine.membership_port}"
    assert env[contract.DRAIN_SECONDS_ENV] == str(t.spec.engine.drain_timeout_seconds)
    assert contract.TOKEN_FILE_ENV in env
    secrets = [v["secret"]["secretName"] for v in replica["spec"]["volumes"] if "secret" in v]
    assert secrets == ["qwen3-omni-replica-1-membership"]
    assert (
        replica["spec"]["terminationGracePeriodSeconds"]
        == t.spec.engine.drain_timeout_seconds + SHUTDOWN_SECONDS
    )
    # The head's own hook waits for its requests in flight (a head change deletes the old head).
    head_pod = _engine(render_head_pod(t))
    assert head_pod["lifecycle"]["preStop"]["exec"]["command"][-1] == "--head"
    env = {e["name"]: e.get("value") for e in head_pod["env"]}
    assert env[contract.HEAD_URL_ENV] == f"http://$(POD_IP):{t.spec.engine.membership_port}"
    assert env[contract.API_URL_ENV] == f"http://$(POD_IP):{t.spec.engine.http_port}"  # a static head's gauge

    _, pt = pipeline()
    pool = parse(pool_obj(stage_ids=(1, 2)))
    pool_pod = render_pool_pod(pt, pool, 1, HEAD_IP, HEAD_UID)
    hook = _engine(pool_pod)["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[-4:] == ["--stage-id", "1", "--stage-id", "2"]
    secrets = [v["secret"]["secretName"] for v in pool_pod["spec"]["volumes"] if "secret" in v]
    assert secrets == [f"{pool.pod_name(1)}-membership"]


def test_a_template_cannot_replace_the_hook():
    from omnistage.api.validation import InvalidSpec

    obj = omnistage(2, template={"spec": {"containers": [{"name": "engine", "lifecycle": {"preStop": {
        "exec": {"command": ["true"]}}}}]}})
    with pytest.raises(InvalidSpec, match="lifecycle"):
        target_from(obj)


def test_a_head_s_hook_waits_until_nothing_is_in_flight_several_polls_in_a_row(monkeypatch):
    """Fails on a hook that returns at the first idle poll (a request sent just before the Service's
    endpoints reached every proxy would be cut off) or that does not wait at all."""
    seen = iter([3, 1, 0, 2, 0, 0, 0, 5])
    monkeypatch.setattr(prestop, "in_flight", lambda base, token, api=None: next(seen))
    polls = []
    assert prestop.wait_idle("http://127.0.0.1:9", "t", 60, sleep=polls.append) == \
        "idle (3 requests were in flight when it stopped)"
    assert len(polls) == 6  # 3, 1, 0, 2, 0, 0 slept after; the third 0 in a row returns


def test_a_head_s_hook_gives_up_at_the_drain_timeout_and_without_a_listing(monkeypatch):
    now = iter(range(0, 1000, 10))
    monkeypatch.setattr(prestop, "in_flight", lambda base, token, api=None: 4)
    assert "4 requests still in flight after the 30s" in prestop.wait_idle(
        "http://127.0.0.1:9", "t", 30, clock=lambda: next(now), sleep=lambda s: None)
    monkeypatch.setattr(prestop, "in_flight", lambda base, token, api=None: None)
    assert (
        prestop.wait_idle("http://127.0.0.1:9", "t", 30, sleep=lambda s: None)
        == "no membership listing and no num_requests_running: not waiting"
    )


def test_a_static_head_s_requests_in_flight_come_from_vllm_s_gauge():
    """A static single-replica head has no membership listing (409 NotDistributed): the hook reads
    vLLM's num_requests_running instead, summed over its series."""
    class Handler(Quiet):
        def do_GET(self):
            if self.path == contract.MEMBERSHIP_PATH:
                self.reply(409)
                return
            self.reply(200, b'# TYPE vllm:num_requests_running gauge\n'
                            b'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
                            b'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
                            b'vllm:num_requests_waiting{engine="0",model_name="m"} 7.0\n')

    with serving(Handler) as base:
        assert prestop.in_flight(base, "t") == 3
