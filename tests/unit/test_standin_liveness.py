"""The stand-in runtime's liveness probes (tests/standin/runtime.py), without a cluster: its supervisor
runs a pod's process whose httpGet livenessProbe asks a small HTTP server on the pod's loopback IP.
Once started, failureThreshold failures in a row kill it and the restart policy brings it back; a
process still starting up is never killed."""

from __future__ import annotations

import functools
import http.server
import sys
import threading

import pytest

from tests.standin import commands, kubelet, podstatus, runtime
from tests.support.waits import wait_for

IP = "127.77.9.1"
KEY = ("ns", "x-head")
LIVE = {"httpGet": {"path": "/live", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 10,
        "failureThreshold": 3}  # the head's, as the operator renders it
READY = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3}


class Engine:
    """The pod's HTTP answers: a status per path (None: the port is closed), and the paths asked."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {"/ready": 200, "/live": 200}
        self.asked: list[str] = []
        self.location = ""
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                engine.asked.append(self.path)
                self.send_response(engine.codes.get(self.path, 404))
                if engine.location:
                    self.send_header("Location", engine.location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((IP, 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.close()


def _pod(port: int, readiness: bool = True) -> dict:
    container = {"name": "engine", "ports": [{"name": "http", "containerPort": port}], "livenessProbe": LIVE}
    if readiness:
        container["readinessProbe"] = READY
    running = {"name": "engine", "restartCount": 0,
               "state": {"running": {"startedAt": "2025-01-01T00:00:00Z"}}}
    labels = {commands.L_ROLE: "head"}
    return {"metadata": {"name": KEY[1], "namespace": KEY[0], "uid": "u1", "labels": labels},
            "spec": {"containers": [container], "restartPolicy": "Always"},
            "status": {"phase": "Running", "podIP": IP, "containerStatuses": [running]}}


@pytest.fixture
def run(tmp_path, monkeypatch):
    """start(pod) -> the runtime supervising that pod (no API server: status patches are recorded)."""
    monkeypatch.setattr(podstatus, "PROBE_PERIOD_CAP", 0.1)
    monkeypatch.setattr(kubelet, "TICK", 0.05)
    rt = runtime.StandinRuntime(kubeconfig="unused", state_dir=tmp_path, quiet=True, stop_timeout=5)
    for sub in ("logs", "pids"):
        (tmp_path / sub).mkdir()
    rt.patched = []
    rt._patch_status = lambda p, status: rt.patched.append(status) or True
    rt._command = lambda pod, role, ip: [sys.executable, "-c", "import time; time.sleep(120)"]

    def start(pod: dict) -> runtime.StandinRuntime:
        rt._pods[KEY] = pod
        supervisor = threading.Thread(target=rt._supervise_loop, daemon=True)
        supervisor.start()
        rt._threads.append(supervisor)
        return rt

    yield start
    rt.stop()


_wait = functools.partial(wait_for, timeout=30.0, interval=0.05, say=None)


def _actions(rt: runtime.StandinRuntime) -> list[str]:
    return [e["action"] for e in rt.events]


def test_probe_spec_keeps_the_threshold_and_caps_period_and_timeout():
    rt = runtime.StandinRuntime(kubeconfig="unused", quiet=True)
    container = _pod(8000)["spec"]["containers"][0]
    assert rt._probe_spec(container, IP, "livenessProbe") == {
        "url": f"http://{IP}:8000/live", "period": podstatus.PROBE_PERIOD_CAP, "failure_threshold": 3,
        "timeout": 10.0}
    assert rt._probe_spec(container, IP)["timeout"] == 1.0  # the kubelet's default timeoutSeconds
    container["livenessProbe"] = {**LIVE, "timeoutSeconds": 60}
    assert rt._probe_spec(container, IP, "livenessProbe")["timeout"] == podstatus.PROBE_TIMEOUT_CAP
    container["livenessProbe"] = {"tcpSocket": {"port": "http"}}  # not an httpGet probe: not probed
    assert rt._probe_spec(container, IP, "livenessProbe") is None


def test_failed_liveness_kills_and_the_restart_policy_restarts(engine, run):
    rt = run(_pod(engine.port))
    p = _wait('rt.process(*KEY)', lambda: rt.process(*KEY))
    _wait("three /live probes", lambda: engine.asked.count("/live") >= 3)  # live and ready: left running
    first_pid = p.pid
    assert p.alive() and p.starts == 1 and "unhealthy" not in _actions(rt)

    engine.codes["/live"] = 503  # the head's own engine is gone
    event = _wait("an unhealthy event",
                  lambda: next((e for e in rt.events if e["action"] == "unhealthy"), None))
    assert event["why"] == f"liveness probe failed 3 times (http://{IP}:{engine.port}/live): restarting"
    engine.codes["/live"] = 200
    _wait('p.starts == 2 and p.alive()', lambda: p.starts == 2 and p.alive())
    assert p.pid != first_pid
    actions = _actions(rt)
    assert [a for a in actions if a in ("unhealthy", "stop", "exited", "restart")] == [
        "unhealthy", "stop", "exited", "restart"]
    assert next(e for e in rt.events if e["action"] == "stop")["signal"] == "SIGTERM"
    restarted = next(cs for s in rt.patched for cs in s["containerStatuses"] if cs.get("restartCount"))
    assert restarted["restartCount"] == 1
    assert restarted["lastState"]["terminated"]["exitCode"] == 143  # SIGTERM, as from a kubelet


def test_a_container_is_not_liveness_probed_before_its_readiness_probe_succeeded(engine, run):
    engine.codes.update({"/ready": 503, "/live": 503})
    rt = run(_pod(engine.port))
    p = _wait('rt.process(*KEY)', lambda: rt.process(*KEY))
    _wait("engine.asked.count('/ready') >= 8", lambda: engine.asked.count("/ready") >= 8)
    assert "/live" not in engine.asked and p.alive() and p.starts == 1

    engine.codes["/ready"] = 200  # started: from now on its liveness counts
    _wait("'unhealthy' in _actions(rt)", lambda: "unhealthy" in _actions(rt))


def test_without_a_readiness_probe_liveness_counts_from_its_first_success(engine, run):
    engine.codes["/live"] = 503
    rt = run(_pod(engine.port, readiness=False))
    p = _wait('rt.process(*KEY)', lambda: rt.process(*KEY))
    _wait("engine.asked.count('/live') >= 8", lambda: engine.asked.count("/live") >= 8)
    assert p.alive() and p.starts == 1 and "unhealthy" not in _actions(rt)  # still starting up

    engine.codes["/live"] = 200
    _wait('p.started', lambda: p.started)
    engine.close()  # connection refused is a failure too
    _wait("'unhealthy' in _actions(rt)", lambda: "unhealthy" in _actions(rt))
    _wait('p.starts == 2', lambda: p.starts == 2)


def test_a_redirect_is_the_answer_not_followed(engine):
    """A probe dials the pod's IP only: a 3xx is a success, its Location is not visited."""
    engine.codes["/live"] = 302
    engine.location = "http://203.0.113.9:1/elsewhere"
    assert podstatus._probe_ok({"url": f"http://{IP}:{engine.port}/live", "timeout": 5})
