"""Issue 12: the processes the stand-in container runtime starts for a three-stage OmniStage, run
without a cluster: the head of a Qwen3-Omni-shaped pipeline and one pool pod hosting stages 1 and 2.

The command lines are the runtime's own (``commands.head_argv`` / ``commands.pool_argv`` from pod
args shaped like render/pods.py's, the environment from ``commands._child_env``), so this is what a
head pod with a three-stage deploy config and a pool pod get on the local control plane.

REAL in those processes (vllm 0.30.0 / vllm-omni 0.30.0 and this project's patches, see
``tests/standin/multistage.py``): the head's startup for three stages (``StageRuntime.initialize``,
the ``OmniMasterServer`` and forked coordinator on the head's loopback IP, the stage-init wait
``get_stage_config`` that keeps it from serving, and fails it, until stages 1 and 2 registered), the
``Orchestrator`` and ``MembershipController``, ``/health`` (vllm-omni's ``OmniBase.check_health``:
503 while any stage that had replicas has none live), the membership endpoint (vLLM's plugin
loader); in the pool process, ``register_stage_with_omni_master`` and ``create_stage_coord_client``
(UP, heartbeats, DOWN) once per stage, from the pod's loopback IP.

STOOD IN: the EngineCore processes (no model, no GPU), stage planning (``multistage.chain_specs``).

Cost: every test starts processes that import vLLM (15-25 s of CPU each on a small machine); the
pool process is started only once the head is seen blocking, so a test takes about a minute.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from tests.standin import commands
from tests.support.ports import free_port

# Slow and real: processes with vLLM and vllm-omni (engine tier), not the pure runtime tests.
pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(420),
    pytest.mark.skipif(find_spec("vllm_omni") is None, reason="needs vllm_omni 0.30.0 (run hack/setup.sh)"),
]

ROOT = Path(__file__).resolve().parents[2]
MEMBERSHIP_PATH = "/omnistage/v1/membership"  # contract.MEMBERSHIP_PATH
ENGINE_PATH = "/omnistage/v1/engine"  # contract.ENGINE_PATH
TOKEN = "standin-token"
STARTUP_BOUND = 120.0  # a vLLM import on a busy 2-core machine, plus the head's startup
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def _loopback_addresses():
    """Pod IPs on 127.74/16 (engine tier: 127.76, local clusters: 127.77-78), a /24 per process."""
    block = os.getpid() % 250 + 1
    for i in itertools.count(1):
        yield f"127.74.{block}.{i}"


_IPS = _loopback_addresses()


def status(url: str, token: str | None = None) -> int | None:
    """HTTP status of a GET (loopback only); None when nothing answers."""
    assert commands.is_loopback(urllib.parse.urlparse(url).hostname), f"network rule: {url}"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with _OPENER.open(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return None


def get_json(url: str) -> Any:
    with _OPENER.open(urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"}), timeout=5) as resp:
        return json.loads(resp.read())


def listing(base: str, include_all: bool = False) -> dict[str, list[dict[str, Any]]]:
    """The head's membership listing per stage (``?all=true``: with the replicas it dropped)."""
    return get_json(base + MEMBERSHIP_PATH + ("?all=true" if include_all else ""))["stages"]


def wait(what: str, predicate: Callable[[], bool], bound: float, proc: Proc | None = None) -> float:
    """Poll until ``predicate()``; bounded, progress every 10 s. Fails at once if ``proc`` exits."""
    started = time.monotonic()
    report = started + 10
    while not predicate():
        now = time.monotonic()
        if proc is not None and proc.popen.poll() is not None:
            pytest.fail(f"{proc.name} exited with {proc.popen.returncode} while waiting for {what}:\n{proc.tail()}")
        if now - started > bound:
            pytest.fail(f"no {what} after {bound:.0f}s" + (f"\n{proc.tail()}" if proc else ""))
        if now >= report:
            print(f"  ... {now - started:.0f}s waiting for {what}", flush=True)
            report = now + 10
        time.sleep(0.25)
    elapsed = time.monotonic() - started
    print(f"{what}: after {elapsed:.1f}s", flush=True)
    return elapsed


class Proc:
    """One stand-in container process, started as the runtime starts it (own session, log file)."""

    def __init__(self, name: str, argv: list[str], ip: str, pod: dict[str, Any], log: Path):
        self.name, self.log = name, log
        with open(log, "wb") as f:
            self.popen = subprocess.Popen(argv, cwd=ROOT, env=commands._child_env(ip, pod), stdin=subprocess.DEVNULL,
                                          stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        print(f"started {name} pid {self.popen.pid}: {' '.join(argv[1:])}", flush=True)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def terminate(self, bound: float = 30.0) -> int:
        """SIGTERM to the process (the runtime signals the group; the process handles it the same)."""
        self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(bound)

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


@pytest.fixture
def start(tmp_path):
    """``start(name, argv, ip, pod) -> Proc``; every process is SIGKILLed (group) at the end."""
    procs: list[Proc] = []

    def make(name: str, argv: list[str], ip: str, pod: dict[str, Any]) -> Proc:
        procs.append(Proc(name, argv, ip, pod, tmp_path / f"{name}.log"))
        return procs[-1]

    yield make
    for proc in reversed(procs):
        proc.kill()


def _pod(name: str, ip: str, args: list[str], env: list[dict[str, str]] = ()) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns"}, "status": {"podIP": ip},
            "spec": {"containers": [{"name": "engine", "args": args, "env": list(env)}]}}


def head(start, tmp_path, stage_init_timeout: int) -> tuple[Proc, str, str, int, str]:
    """The head pod's process: (proc, ip, base URL, master port, membership base URL)."""
    ip = next(_IPS)
    http_port, master_port, membership_port = free_port(ip), free_port(ip), free_port(ip)
    args = ["serve", "Qwen/Qwen3-Omni", "--omni", "--deploy-config", "/etc/omnistage/deploy.yaml",
            "--host", "0.0.0.0", "--port", str(http_port), "--stage-id", "0", "--omni-master-address", "$(POD_IP)",
            "--omni-master-port", str(master_port), "--stage-init-timeout", str(stage_init_timeout),
            "--init-timeout", str(stage_init_timeout)]
    # As the operator renders it: the plugin's membership port (OMNISTAGE_MEMBERSHIP_PORT).
    pod = _pod("x-head", ip, args, [{"name": "OMNISTAGE_MEMBERSHIP_PORT", "value": str(membership_port)}])
    token = tmp_path / "token"
    token.write_text(TOKEN)
    args = [commands._expand(a, pod) for a in args]
    argv = commands.head_argv(sys.executable, commands.HEAD_MODULE, args, ip, token, stages=3)
    argv += ["--model-dir", str(tmp_path / "model")]
    return start("head", argv, ip, pod), ip, f"http://{ip}:{http_port}", master_port, f"http://{ip}:{membership_port}"


def head_blocks(proc: Proc) -> bool:
    """The head's master is up and its startup waits for the remote stages (its own log line)."""
    return "OmniMasterServer started for stages [0, 1, 2]" in proc.log.read_text(errors="replace")


def test_three_stage_head_serves_once_the_pool_pod_registered_stages_1_and_2(start, tmp_path):
    head_proc, head_ip, base, master_port, members = head(start, tmp_path, stage_init_timeout=300)
    wait("the head's master up, stages 1 and 2 awaited", lambda: head_blocks(head_proc), STARTUP_BOUND, head_proc)
    assert status(base + "/health") is None  # no HTTP at all while the startup waits

    pool_ip = next(_IPS)
    pool_args = ["--stage-id", "1", "--stage-id", "2", "--", "vllm", "serve", "Qwen/Qwen3-Omni", "--omni",
                 "--headless", "--deploy-config", "/etc/omnistage/deploy.yaml", "--omni-master-address", head_ip,
                 "--omni-master-port", str(master_port), "--omni-replica-address", "$(POD_IP)",
                 "--worker-backend", "multi_process"]
    pod = _pod("x-talker-0", pool_ip, pool_args)
    argv = commands.pool_argv(sys.executable, commands.REPLICA_MODULE, [commands._expand(a, pod) for a in pool_args],
                             pool_ip)
    pool = start("pool", argv, pool_ip, pod)
    # The pool process imports vLLM before it registers: the head must stay dark all that time.
    health_seen: list[int | None] = []
    serving = wait("/health 200", lambda: health_seen.append(status(base + "/health")) or health_seen[-1] == 200,
                   STARTUP_BOUND, head_proc)
    assert set(health_seen[:-1]) <= {None}, f"the head answered before it was up: {set(health_seen)}"
    print(f"  /health polled {len(health_seen) - 1} times unanswered before the 200 ({serving:.1f}s)")
    # The same app as a one-stage head: the engine report (stage 0's frontend as the plugin chose
    # it for a distributed head) and /metrics.
    report = get_json(members + ENGINE_PATH)
    print("engine report:", {k: report[k] for k in ("distributed", "frontendCache")})
    assert report["distributed"] is True and report["frontendCache"]["mode"] == "processor-only"
    assert status(base + "/metrics") == 200

    def both_stages_up() -> bool:
        stages = listing(members)
        return all(any(m["host"] == pool_ip and m["state"] == "attached" and m["coordinatorStatus"] == "up"
                       for m in stages.get(k, [])) for k in ("1", "2"))

    wait("stages 1 and 2 attached and UP from the pool pod's IP", both_stages_up, 30, head_proc)
    stages = listing(members)
    print("listing:", {k: [(m["replicaId"], m["host"], m["state"]) for m in v] for k, v in stages.items()})
    assert [m["host"] for m in stages["0"]] == [head_ip] and stages["0"][0]["local"]
    # vllm-omni's watcher detaches an initial slot only after one of its 0.5 s ticks saw it UP
    # (a DOWN before that goes unnoticed upstream): give it a few ticks.
    time.sleep(2)

    assert pool.terminate() == 0  # SIGTERM: DOWN for each stage, exit 0
    assert "stage 1 replica 0 sent DOWN" in pool.log.read_text() and "stage 2 replica 0 sent DOWN" in pool.log.read_text()
    wait("/health 503 after the pool's DOWN", lambda: status(base + "/health") == 503, 20, head_proc)
    # The initial slots, dropped by the head on DOWN: listed as detached (until a leave), routed to by none.
    for stages in (listing(members), listing(members, include_all=True)):
        assert [(m["host"], m["state"]) for k in ("1", "2") for m in stages[k]] == [(pool_ip, "detached")] * 2
    assert head_proc.terminate() == 0


def test_three_stage_head_exits_non_zero_after_the_stage_init_timeout(start, tmp_path):
    head_proc, _, base, _, _ = head(start, tmp_path, stage_init_timeout=3)
    wait("the head's master up, stages 1 and 2 awaited", lambda: head_blocks(head_proc), STARTUP_BOUND, head_proc)
    wait("the head to exit", lambda: head_proc.popen.poll() is not None, 60)
    log = head_proc.log.read_text(errors="replace")
    print(head_proc.tail(5))
    assert head_proc.popen.returncode == 1
    assert "Timed out waiting for stage config for stage" in log
    assert "stand-in head ready" not in log and status(base + "/health") is None
