"""The stand-in container runtime's pure parts: argument reading and the network rule (no cluster)."""

from __future__ import annotations

import pytest

from tests.standin import runtime
from tests.standin.harness import http_get, left_at_head, remote_members, replica_series


def _pod(role: str, args: list[str], ip: str = "127.77.1.5") -> dict:
    return {
        "metadata": {"name": f"x-{role}", "namespace": "ns", "uid": "u1",
                     "labels": {runtime.L_ROLE: role, runtime.L_OMNISTAGE: "x"}},
        "spec": {"containers": [{"name": "engine", "args": args}], "volumes": [], "restartPolicy": "Never"},
        "status": {"phase": "Running", "podIP": ip},
    }


def test_arg_forms():
    assert runtime._arg(["--port", "8000"], "--port") == "8000"
    assert runtime._arg(["--port=8001"], "--port") == "8001"
    assert runtime._arg(["--portx", "1"], "--port") is None


@pytest.mark.parametrize(("ip", "ok"), [("127.0.0.1", True), ("127.77.3.9", True), ("203.0.113.9", False),
                                        ("198.18.0.1", False), ("::1", False), ("", False), (None, False)])
def test_loopback_only(ip, ok):
    assert runtime.is_loopback(ip) is ok


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
    with pytest.raises(runtime._Refused, match="network rule"):
        rt._command(pod, "replica", "127.77.1.5")


def test_head_master_address_expands_pod_ip():
    pod = _pod("head", ["--omni-master-address", "$(POD_IP)"])
    assert runtime._expand("$(POD_IP)", pod) == "127.77.1.5"


def test_exit_codes_like_a_container():
    assert runtime._exit_code(-9) == 137
    assert runtime._exit_code(-15) == 143
    assert runtime._exit_code(3) == 3


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
