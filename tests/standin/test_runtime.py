"""The stand-in container runtime's pure parts: argument reading and the network rule (no cluster)."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest
from kubernetes.client.rest import ApiException

from tests.standin import commands, podwatch, processes, runtime
from tests.standin.harness import http_get, left_at_head, remote_members, replica_series
from tests.support.ports import free_port


def _pod(role: str, args: list[str], ip: str = "127.77.1.5", **container) -> dict:
    return {
        "metadata": {"name": f"x-{role}", "namespace": "ns", "uid": "u1",
                     "labels": {commands.L_ROLE: role, commands.L_OMNISTAGE: "x"}},
        "spec": {"containers": [{"name": "engine", "args": args, **container}], "volumes": [], "restartPolicy": "Never"},
        "status": {"phase": "Running", "podIP": ip},
    }


def test_arg_forms():
    assert commands._arg(["--port", "8000"], "--port") == "8000"
    assert commands._arg(["--port=8001"], "--port") == "8001"
    assert commands._arg(["--portx", "1"], "--port") is None


@pytest.mark.parametrize(("ip", "ok"), [("127.0.0.1", True), ("127.77.3.9", True), ("203.0.113.9", False),
                                        ("198.18.0.1", False), ("::1", False), ("", False), (None, False)])
def test_loopback_only(ip, ok):
    assert commands.is_loopback(ip) is ok


def test_replica_command_from_pod_args():
    rt = runtime.StandinRuntime(kubeconfig="unused", quiet=True)
    pod = _pod("replica", ["serve", "m", "--headless", "--omni-master-address", "127.77.1.2",
                           "--omni-master-port", "25000", "--omni-replica-address", "$(POD_IP)"])
    argv = rt._command(pod, "replica", "127.77.1.5")
    assert argv[1:] == ["-m", "tests.standin.replica", "--master-ip", "127.77.1.2", "--master-port", "25000",
                        "--bind-ip", "127.77.1.5"]


def test_replica_with_non_loopback_master_is_refused():
    rt = runtime.StandinRuntime(kubeconfig="unused", quiet=True)
    pod = _pod("replica", ["--omni-master-address", "203.0.113.7", "--omni-master-port", "25000"])
    with pytest.raises(commands._Refused, match="network rule"):
        rt._command(pod, "replica", "127.77.1.5")


def test_head_master_address_expands_pod_ip():
    pod = _pod("head", ["--omni-master-address", "$(POD_IP)"])
    assert commands._expand("$(POD_IP)", pod) == "127.77.1.5"


def test_exit_codes_like_a_container():
    assert processes._exit_code(-9) == 137
    assert processes._exit_code(-15) == 143
    assert processes._exit_code(3) == 3


def test_http_get_refuses_other_hosts():
    with pytest.raises(ValueError, match="network rule"):
        http_get("http://203.0.113.1:8000/health")
    with pytest.raises(ValueError, match="network rule"):
        http_get("http://example.com/")


def test_listing_readers():
    listing = {"bootId": "b", "stages": {"0": [
        {"replicaId": 0, "local": True, "state": "attached"},
        {"replicaId": 1, "pod": "p1", "state": "attached"},
        {"replicaId": 2, "pod": "p2", "state": "left"},
    ]}}
    assert [m["replicaId"] for m in remote_members(listing)] == [1]
    assert left_at_head(listing, 2)["pod"] == "p2"
    assert left_at_head(listing, 1) is None
    text = ('vllm:num_requests_running{engine="0",stage="0",replica="1"} 0\n'
            'vllm:x{stage="1",replica="0"} 0\n# HELP replica="9"\n')
    assert replica_series(text) == {"1"}


# ----- issue 12: multi-stage heads and pool pods (the command lines; the processes run in
# ----- test_multistage_processes.py) ------------------------------------------------------------

CONFIG = "/etc/omnistage/deploy.yaml"  # podtemplate.CONFIG_DIR + render.config.CONFIG_KEY
STAGES_3 = """\
stages:
- stage_id: 0
  runtime: {devices: '0'}
- stage_id: 1
  num_replicas: 1
- stage_id: 2
  num_replicas: 1
"""
STAGES_1 = "stages:\n- stage_id: 0\n"


def _head_pod(ip: str = "127.74.251.5") -> dict:
    """A head pod as render/pods.py renders it: the deploy config from the `config` volume."""
    args = ["serve", "Qwen/Qwen3-Omni", "--omni", "--deploy-config", CONFIG, "--host", "0.0.0.0", "--port", "8000",
            "--stage-id", "0", "--omni-master-address", "$(POD_IP)", "--omni-master-port", "25000",
            "--stage-init-timeout", "600", "--init-timeout", "600"]
    pod = _pod("head", args, ip, volumeMounts=[{"name": "config", "mountPath": "/etc/omnistage", "readOnly": True}])
    pod["spec"]["volumes"] = [{"name": "config", "configMap": {"name": "x-config"}},
                              {"name": "membership-token", "secret": {"secretName": "x-membership"}}]
    return pod


def _pool_pod(master: str = "127.77.1.2") -> dict:
    args = ["--stage-id", "1", "--stage-id", "2", "--", "vllm", "serve", "Qwen/Qwen3-Omni", "--omni", "--headless",
            "--deploy-config", CONFIG, "--omni-master-address", master, "--omni-master-port", "25000",
            "--omni-replica-address", "$(POD_IP)", "--worker-backend", "multi_process"]
    pod = _pod("pool", args, command=["python3", "-m", "omnistage_engine_patches.stages"])
    pod["metadata"]["labels"].update({commands.L_COMPONENT: "pool", "serving.omnistage.io/pool": "x-talker"})
    return pod


class FakeApi:
    """The two reads the runtime makes for a head pod (its ConfigMap and its Secret)."""

    def __init__(self, configmaps: dict[str, dict[str, str]]):
        self.configmaps = configmaps
        self.reads: list[str] = []

    def read_namespaced_config_map(self, name, namespace, **_):
        self.reads.append(f"configmap/{namespace}/{name}")
        if name not in self.configmaps:
            raise ApiException(status=404)
        return SimpleNamespace(data=self.configmaps[name])

    def read_namespaced_secret(self, name, namespace, **_):
        self.reads.append(f"secret/{namespace}/{name}")
        return SimpleNamespace(data={"token": base64.b64encode(b"t0k").decode()})


def _runtime(tmp_path, api: FakeApi) -> runtime.StandinRuntime:
    rt = runtime.StandinRuntime(kubeconfig="unused", state_dir=tmp_path, quiet=True)
    (tmp_path / "tokens").mkdir()
    rt._api = api
    return rt


def test_pod_watch_selects_engine_and_pool_pods():
    assert podwatch.SELECTOR == "serving.omnistage.io/component in (engine,pool)"


def test_three_stage_configmap_starts_a_three_stage_head(tmp_path):
    api = FakeApi({"x-config": {"deploy.yaml": STAGES_3}})
    argv = _runtime(tmp_path, api)._command(_head_pod(), "head", "127.74.251.5")
    token = str(tmp_path / "tokens" / "ns_x-head_u1")
    assert argv[1:] == ["-m", "tests.standin.head", "--bind-ip", "127.74.251.5", "--master-port", "25000",
                        "--http-port", "8000", "--token-file", token, "--stages", "3", "--startup-timeout", "600"]
    assert api.reads == ["configmap/ns/x-config", "secret/ns/x-membership"]  # the mounted volume's ConfigMap


def test_single_stage_head_command_is_unchanged(tmp_path):
    argv = _runtime(tmp_path, FakeApi({"x-config": {"deploy.yaml": STAGES_1}}))._command(
        _head_pod(), "head", "127.74.251.5")
    assert "--stages" not in argv and "--startup-timeout" not in argv


def test_head_waits_for_its_configmap(tmp_path):
    rt = _runtime(tmp_path, FakeApi({}))
    with pytest.raises(commands._NotYet, match="ConfigMap ns/x-config: not found yet"):
        rt._command(_head_pod(), "head", "127.74.251.5")


def test_deploy_config_source():
    pod = _head_pod()
    assert commands.deploy_config_source(pod) == ("x-config", "deploy.yaml")
    pod["spec"]["volumes"][0]["configMap"]["items"] = [{"key": "pipeline.yaml", "path": "deploy.yaml"}]
    assert commands.deploy_config_source(pod) == ("x-config", "pipeline.yaml")
    pod["spec"]["containers"][0]["volumeMounts"] = []  # no mount there: the operator's naming
    assert commands.deploy_config_source(pod) == ("x-config", "deploy.yaml")
    assert commands.deploy_config_source(_pod("head", ["serve", "m"])) is None
    assert commands.count_stages(STAGES_3) == 3
    assert commands.count_stages(STAGES_1) == 1
    assert commands.count_stages("pipeline: qwen3_omni_moe\n") == 1


def test_pool_pod_runs_one_replica_process_for_all_its_stages():
    pod = _pool_pod()
    argv = runtime.StandinRuntime(kubeconfig="unused", quiet=True)._command(pod, "pool", "127.77.1.5")
    assert argv[1:] == ["-m", "tests.standin.replica", "--master-ip", "127.77.1.2", "--master-port", "25000",
                        "--bind-ip", "127.77.1.5", "--stage-id", "1", "--stage-id", "2"]


def test_pool_pod_refusals():
    with pytest.raises(commands._Refused, match="network rule"):
        commands.pool_argv("py", "m", _pool_pod("203.0.113.7")["spec"]["containers"][0]["args"], "127.77.1.5")
    with pytest.raises(commands._Refused, match="no '--'"):
        commands.pool_argv("py", "m", ["--stage-id", "1", "vllm", "serve"], "127.77.1.5")
    with pytest.raises(commands._Refused, match="no valid --stage-id"):
        commands.pool_argv("py", "m", ["--", "vllm", "--stage-id", "1", "--omni-master-address", "127.0.0.1",
                                      "--omni-master-port", "1"], "127.77.1.5")


GATE = "serving.omnistage.io/joined"


def _gated_runtime(conditions: list[dict]) -> tuple[runtime.StandinRuntime, processes.Proc, list[dict]]:
    rt = runtime.StandinRuntime(kubeconfig="unused", quiet=True)
    pod = _pod("replica", [])
    pod["spec"]["readinessGates"] = [{"conditionType": GATE}]
    pod["status"]["conditions"] = conditions
    rt._pods[("ns", "x-replica")] = pod
    p = processes.Proc(namespace="ns", pod="x-replica", uid="u1", role="replica", ip="127.77.1.5", argv=[],
                     log_path=None, restart_policy="Never")
    sent: list[dict] = []
    rt._patch_status = lambda proc, status: sent.append(status) or True
    return rt, p, sent


def _conds(status: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status["conditions"]}


def test_a_gated_pod_starts_not_ready_and_kwoks_gate_is_taken_back():
    # kwok's pod-ready stage: Ready, ContainersReady and every gate True at once.
    rt, p, sent = _gated_runtime([{"type": t, "status": "True"} for t in ("Ready", "ContainersReady", GATE)])
    rt._patch_ready(p, True, "started", reset_gates=True)
    assert _conds(sent[-1]) == {"Ready": "False", "ContainersReady": "True", GATE: "False"}


def test_a_gated_pod_is_ready_only_while_its_gate_is_true():
    rt, p, sent = _gated_runtime([{"type": "Ready", "status": "False"}, {"type": "ContainersReady", "status": "True"},
                                  {"type": GATE, "status": "True"}])
    rt._sync_gates(p, now=1e9)
    assert _conds(sent[-1]) == {"Ready": "True", "ContainersReady": "True"}
    rt._pods[("ns", "x-replica")]["status"]["conditions"] = [
        {"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}, {"type": GATE, "status": "False"}]
    rt._sync_gates(p, now=2e9)
    assert _conds(sent[-1]) == {"Ready": "False", "ContainersReady": "True"}


def test_a_deleted_pod_s_pre_stop_hook_runs_before_sigterm(tmp_path):
    import subprocess
    import sys

    rt = runtime.StandinRuntime(kubeconfig="unused", quiet=True, state_dir=tmp_path)
    marker = tmp_path / "hook-ran"
    p = processes.Proc(namespace="ns", pod="x-replica", uid="u1", role="replica", ip="127.77.1.5", argv=[],
                     log_path=tmp_path / "log", restart_policy="Never")
    p.popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    p.pre_stop, p.pre_stop_env, p.pre_stop_grace = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"], {}, 10
    rt._terminate(p, "pod terminating")
    assert marker.exists() and not p.alive()
    assert [e["action"] for e in rt.events][:3] == ["prestop", "prestopped", "stop"]


def test_a_force_deleted_pod_gets_the_forced_grace_even_when_its_successor_is_already_there(tmp_path, monkeypatch):
    """`kubectl delete pod --grace-period=0 --force` of a head the operator re-creates at once under the
    same name: the supervisor may first see the successor (a new UID), not the pod gone. A kubelet gives
    the old container the forced minimum either way; before, the runtime read it as a replacement and
    ran the full pre-stop hook and grace (15 s + 2 s of the old head still answering at its address)."""
    import subprocess
    import sys
    import time

    rt = runtime.StandinRuntime(kubeconfig="unused", quiet=True, state_dir=tmp_path, probes=False)
    p = processes.Proc(namespace="ns", pod="x-head", uid="u1", role="head", ip="127.77.1.5", argv=[],
                       log_path=tmp_path / "log", restart_policy="Always")
    p.popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    p.grace = p.pre_stop_grace = 30
    stopped: list = []
    monkeypatch.setattr(rt, "_terminate",
                        lambda proc, reason: stopped.append((reason, proc.grace, proc.pre_stop_grace)))
    monkeypatch.setattr(rt, "_not_started_yet", lambda *a, **k: None)
    successor = _pod("head", [])
    successor["metadata"]["uid"] = "u2"
    rt._pods[p.key], rt._procs[p.key] = successor, p
    rt.force_deleted.add("u1")
    try:
        rt._supervise_once()
        deadline = time.monotonic() + 10
        while not stopped and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stopped == [("pod force-deleted", processes.FORCED_GRACE, processes.FORCED_GRACE)], stopped
    finally:
        p.popen.kill()
        p.popen.wait(10)


# The "container" of the test below: a leader that starts a child holding a port in its own process
# group (as vLLM's engine core does) and a grandchild that left the group with setsid, then waits.
_TREE = r"""
import socket, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import socket, sys, time\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); print('bound', flush=True); time.sleep(600)", sys.argv[1]],
    stdout=sys.stdout)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
time.sleep(600)
"""


def test_a_container_whose_main_process_was_killed_dies_whole_before_its_restart(tmp_path, monkeypatch):
    """Kill only the leader of a pod's process tree, as `kill -9 <vllm serve pid>` does: the runtime's
    own supervisor pass must leave nothing of the old tree alive (a container's cgroup dies with it),
    so the restart can bind the same port. Before: the child kept the port (Address already in use)."""
    import os
    import signal
    import socket
    import sys
    import time

    port = free_port()
    rt = runtime.StandinRuntime(kubeconfig="unused", quiet=True, state_dir=tmp_path, probes=False)
    (tmp_path / "pids").mkdir()
    monkeypatch.setattr(rt, "_patch_ready", lambda *a, **k: None)
    monkeypatch.setattr(rt, "_patch_restarted", lambda *a, **k: None)
    pod = _pod("head", [], restartPolicy="Always")
    pod["spec"]["restartPolicy"] = "Always"
    p = processes.Proc(namespace="ns", pod="x-head", uid="u1", role="head", ip="127.0.0.1",
                       argv=[sys.executable, "-c", _TREE, str(port)], log_path=tmp_path / "log",
                       restart_policy="Always", env={**os.environ, "HOME": str(tmp_path)})
    rt._spawn(p, pod, restart=False)
    rt._pods[p.key], rt._procs[p.key] = pod, p
    try:
        deadline = time.monotonic() + 60
        while len(processes.container_pids(p.pid, processes.container_marker(p))) < 3 or b"bound" not in p.log_path.read_bytes():
            assert time.monotonic() < deadline, f"the tree did not start: {p.log_path.read_text()}"
            time.sleep(0.1)
        tree = processes.container_pids(p.pid, processes.container_marker(p))
        leader = p.pid
        os.kill(leader, signal.SIGKILL)
        p.popen.wait(10)
        assert processes.container_pids(leader, processes.container_marker(p)) == tree - {leader}, \
            "the leader's death alone left its children running (the defect a container runtime has not)"
        rt._supervise_once()  # the pass that sees the exit
        deadline = time.monotonic() + 10
        while (left := {pid for pid in tree if processes._pid_alive(pid) and _not_zombie(pid)}):
            assert time.monotonic() < deadline, f"still alive after the runtime saw the exit: {left}"
            time.sleep(0.05)
        with socket.socket() as s:  # the restarted head binds its port again
            s.bind(("127.0.0.1", port))
        assert [e["action"] for e in rt.events][-2:] == ["exited", "kill"] and rt.events[-1]["count"] == 2
        assert p.restart_at is not None, "a restart is due"
    finally:
        processes.kill_container(p.pid, processes.container_marker(p))


def _not_zombie(pid: int) -> bool:
    from pathlib import Path
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
