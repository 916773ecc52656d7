"""hack/gpu-repro.py, the GPU cluster's serving reproduction, against stand-ins on 127.0.0.1.

The script's client logic runs for real: a stand-in `kubectl` (a small Python program, selected with
OMNISTAGE_KUBECTL as users select theirs) keeps an OmniStage in a JSON file, scales it, and for
`port-forward` serves a stand-in engine head (OpenAI chat, /metrics with per-replica vllm:* series,
/health) on a random 127.0.0.1 port after a delay, printing kubectl's "Forwarding from" line first.
Nothing is dialled outside 127.0.0.0/8.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.repo import ROOT, hack_script

SCRIPT = ROOT / "hack" / "gpu-repro.py"


repro = hack_script(SCRIPT.name)

FAKE_KUBECTL = textwrap.dedent('''\
    """Stand-in kubectl: get/scale an OmniStage kept in $FAKE_KUBECTL_STATE; port-forward serves a head."""
    import json, os, socket, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    STATE = os.environ["FAKE_KUBECTL_STATE"]
    args = sys.argv[1:]

    def load():
        with open(STATE) as f:
            return json.load(f)

    def save(s):
        with open(STATE + ".tmp", "w") as f:
            json.dump(s, f)
        os.replace(STATE + ".tmp", STATE)

    s = load()
    if "get" in args:
        n = s["replicas"]
        cond = [{"type": "Ready", "status": "True"}]
        print(json.dumps({"metadata": {"name": s["name"], "generation": s["generation"]},
                          "spec": {"model": "Qwen/Qwen3-Omni-30B-A3B-Instruct", "replicas": n,
                                   "engine": {"httpPort": s["port"], "extraArgs": s["extra_args"]}},
                          "status": {"observedGeneration": s["generation"], "readyReplicas": n,
                                     "registeredReplicas": n, "conditions": cond}}))
    elif "scale" in args:
        n = int(next(a for a in args if a.startswith("--replicas=")).split("=", 1)[1])
        s["scales"].append(n)
        s["replicas"], s["generation"] = n, s["generation"] + 1
        while len(s["ids"]) < n:          # the head assigns ids, never reused
            s["ids"].append(s["next_id"]); s["ever"].append(s["next_id"]); s["next_id"] += 1
        del s["ids"][n:]
        save(s)
    elif "port-forward" in args:
        s["port_forward_argv"] = args
        save(s)
        if s.get("pf_fail"):
            print('error: services "%s" not found' % s["name"], flush=True)
            sys.exit(1)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        print("Forwarding from 127.0.0.1:%d -> %s" % (port, args[-1].lstrip(":")), flush=True)
        time.sleep(s["serve_after"])      # like a forward whose far end is not up yet
        lock, seen = threading.Lock(), {"chats": 0}

        class Head(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, status, body, ctype="application/json"):
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    return self.reply(503, "{}")   # a stage without a live replica: still an answer
                if self.path == "/metrics":
                    st = load()
                    ids = st["ever"] if st.get("stale_metrics") else st["ids"]
                    lines = ['vllm:num_requests_running{stage="0",replica="%d"} 0' % i for i in ids]
                    lines += ['vllm:mm_cache_hits_total{stage="0",replica="frontend"} 3',
                              'vllm:num_requests_running{stage="1",replica="7"} 0', "# HELP x y"]
                    return self.reply(200, "\\n".join(lines) + "\\n", "text/plain")
                self.reply(404, "{}")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert body["messages"][0]["content"][0]["input_audio"]["data"]
                with lock:
                    seen["chats"] += 1
                    n = seen["chats"]
                if s["chat"] == "http500":
                    return self.reply(500, '{"error": "boom"}')
                later_turn = len(body["messages"]) > 1
                finish = "error" if (s["chat"] == "defect" and n % 2 == 0
                                     or s["chat"] == "multi-turn" and later_turn) else "stop"
                content = "" if finish == "error" else "a pure tone"
                self.reply(200, json.dumps({"model": body["model"], "choices": [
                    {"finish_reason": finish, "message": {"role": "assistant", "content": content}}]}))

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # 16 concurrent clients must not overflow the listen backlog

        Server(("127.0.0.1", port), Head).serve_forever()
''')


@pytest.fixture
def fake_kubectl(tmp_path, monkeypatch):
    """(state file, write(**changes)): the stand-in kubectl on OMNISTAGE_KUBECTL for the script and the
    tests."""
    exe = tmp_path / "kubectl"
    exe.write_text(f"#!{sys.executable}\n{FAKE_KUBECTL}")
    exe.chmod(0o755)
    state = tmp_path / "state.json"

    def write(**changes):
        base = {"name": "qwen3-omni", "generation": 1, "replicas": 1, "port": 9123, "extra_args": [],
                "ids": [0], "ever": [0], "next_id": 1, "scales": [], "serve_after": 0.6, "chat": "ok"}
        if state.exists():
            base = json.loads(state.read_text())
        base.update(changes)
        if "replicas" in changes:
            base["ids"] = base["ever"] = list(range(changes["replicas"]))
            base["next_id"] = changes["replicas"]
        state.write_text(json.dumps(base))

    write()
    monkeypatch.setenv("OMNISTAGE_KUBECTL", str(exe))
    monkeypatch.setenv("FAKE_KUBECTL_STATE", str(state))
    return state, write


def run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--namespace", "serving", "--name", "qwen3-omni", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def state_of(path: Path) -> dict:
    return json.loads(path.read_text())


# ----- the whole script, as a user runs it -----------------------------------------------------------

def test_passes_against_a_healthy_head_and_restores_the_replica_count(fake_kubectl):
    state, write = fake_kubectl
    write(replicas=3, port=9123)
    proc = run_script()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("PASS")
    s = state_of(state)
    # The port comes from spec.engine.httpPort, the forward is to the API Service on 127.0.0.1 only.
    argv = s["port_forward_argv"]
    assert argv[-2:] == ["svc/qwen3-omni", ":9123"] and argv[argv.index("--address") + 1] == "127.0.0.1"
    assert ["-n", "serving"] == argv[:2]
    # 2, 1, 2, 1 for the checks, then back to the 3 it found.
    assert s["scales"] == [2, 1, 2, 1, 3] and s["replicas"] == 3
    assert "model Qwen/Qwen3-Omni-30B-A3B-Instruct" in proc.stdout


def test_waits_for_the_port_forward_to_answer_instead_of_sleeping(fake_kubectl):
    _state, write = fake_kubectl
    write(serve_after=1.5)  # the old script slept a fixed 3 s; a slower forward would have failed
    start = time.monotonic()
    proc = run_script()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "answers (/health: HTTP 503)" in proc.stdout
    assert time.monotonic() - start >= 1.5


def test_the_defect_fails_the_run(fake_kubectl):
    state, write = fake_kubectl
    write(chat="defect")
    proc = run_script()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "FAIL" in proc.stdout
        and "same audio three times" in proc.stdout
        and "64 concurrent repeats" in proc.stdout
    )
    assert state_of(state)["replicas"] == 1


def test_errors_on_later_turns_of_a_conversation_fail_the_run(fake_kubectl):
    """A cache that survives single requests but not a conversation re-sending its history (the
    mirror of a replica-aware head out of step with its replica) is caught by the multi-turn check."""
    _state, write = fake_kubectl
    write(chat="multi-turn")
    proc = run_script()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "multi-turn conversations: 24 of 32 turns finished with finish_reason=error" in proc.stdout
    assert "64 concurrent repeats: 0 errors" in proc.stdout


def test_series_of_a_departed_replica_fail_the_run(fake_kubectl):
    _state, write = fake_kubectl
    write(stale_metrics=True)
    proc = run_script()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "departed replica ['2'] are still on /metrics" in proc.stdout


def test_replica_count_is_restored_when_a_step_fails(fake_kubectl):
    state, write = fake_kubectl
    write(replicas=3, chat="http500")
    proc = run_script()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "HTTPError" in proc.stdout
    s = state_of(state)
    assert s["scales"] == [2, 3] and s["replicas"] == 3, s["scales"]
    assert "restoring qwen3-omni to 3 replicas (found 2)" in proc.stdout


def test_a_port_forward_that_exits_is_reported_and_nothing_is_scaled(fake_kubectl):
    state, write = fake_kubectl
    write(pf_fail=True)
    proc = run_script(timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'services "qwen3-omni" not found' in proc.stdout
    assert state_of(state)["scales"] == []


# ----- the pieces ----------------------------------------------------------------------------------

def test_port_and_model_are_read_from_the_spec():
    obj = {"spec": {"model": "m", "engine": {"httpPort": 9000}}}
    assert repro.http_port(obj) == 9000 and repro.served_model(obj) == "m"
    assert repro.http_port({"spec": {"model": "m"}}) == repro.DEFAULT_HTTP_PORT
    assert (
        repro.served_model({"spec": {"model": "m", "engine": {"extraArgs": ["--served-model-name", "omni"]}}})
        == "omni"
    )
    assert (
        repro.served_model({"spec": {"model": "m", "engine": {"extraArgs": ["--served-model-name=o2"]}}})
        == "o2"
    )


def test_replica_series_reads_stage_zero_replicas_only():
    text = """\
# HELP vllm:num_requests_running running
vllm:num_requests_running{engine="0",model_name="m",replica="0",stage="0"} 1.0
vllm:generation_tokens_total{replica="3",stage="0"} 10.0
vllm:mm_cache_hits_total{replica="frontend",stage="0"} 2.0
vllm:num_requests_running{replica="9",stage="1"} 0.0
omnistage_condition{replica="5",stage="0"} 1.0
"""
    assert repro.replica_series(text) == {"0", "3"}


def test_only_loopback_is_dialled():
    with pytest.raises(ValueError, match="only talks to its port-forward"):
        repro.http_status("http://192.0.2.1:8000/health")
    with pytest.raises(ValueError):
        repro.chat("http://example.invalid:8000", "m", "AAAA")


def test_wait_until_answers_gives_up_on_a_closed_port():
    port = free_port()  # closed again: nothing answers there
    with pytest.raises(TimeoutError):
        repro.wait_until_answers(f"http://127.0.0.1:{port}/health", timeout=0.5)
    with pytest.raises(RuntimeError, match="port-forward exited"):
        repro.wait_until_answers(f"http://127.0.0.1:{port}/health", timeout=5, alive=lambda: False)


class FakeStage:
    namespace, name = "serving", "qwen3-omni"

    def __init__(self, replicas: int, converge_after: int = 0):
        self.replicas, self.generation, self.converge_after, self.gets, self.scales = (
            replicas,
            1,
            converge_after,
            0,
            [],
        )

    def get(self):
        self.gets += 1
        done = self.gets > self.converge_after
        st = {"observedGeneration": self.generation if done else self.generation - 1,
              "readyReplicas": self.replicas, "registeredReplicas": self.replicas,
              "conditions": [{"type": "Ready", "status": "True" if done else "False"}]}
        return {
            "metadata": {"generation": self.generation},
            "spec": {"model": "m", "replicas": self.replicas},
            "status": st,
        }

    def scale(self, n):
        self.scales.append(n)
        self.replicas, self.generation = n, self.generation + 1


def test_wait_converged_needs_the_current_generation_ready_and_registered():
    stage, now, sleeps = FakeStage(2, converge_after=3), [0.0], []

    def sleep(s):
        sleeps.append(s)
        now[0] += s

    repro.wait_converged(
        stage, 2, timeout=100, interval=10, log=lambda m: None, clock=lambda: now[0], sleep=sleep
    )
    assert stage.gets == 4 and sleeps == [10, 10, 10]
    stage = FakeStage(2, converge_after=100)
    with pytest.raises(TimeoutError):
        repro.wait_converged(
            stage, 2, timeout=25, interval=10, log=lambda m: None, clock=lambda: now[0], sleep=sleep
        )


def test_replicas_restored_on_interrupt():
    stage = FakeStage(4)
    with pytest.raises(KeyboardInterrupt), repro.replicas_restored(stage, log=lambda m: None) as original:
        assert original == 4
        stage.scale(2)
        raise KeyboardInterrupt
    assert stage.scales == [2, 4]
    untouched = FakeStage(2)
    with repro.replicas_restored(untouched, log=lambda m: None):
        pass
    assert untouched.scales == []
