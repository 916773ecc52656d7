"""Container-runtime stand-in for the local control plane (test and demo tooling only).

kwok is the kubelet of the simulated H200 nodes: it binds pods, marks them Running/Ready and gives
them loopback IPs, but it runs no containers. This process is the missing container runtime for the
engine pods: it watches the pods labelled serving.omnistage.io/component in (engine,pool) and, for
every running pod with a pod IP, starts the matching stand-in process bound to that IP:

  role=head     python -m tests.standin.head --bind-ip <podIP> --http-port <--port> \\
                    --master-port <--omni-master-port> --token-file <token from <name>-membership> \\
                    [--stages N --startup-timeout <--stage-init-timeout>]
  role=replica  python -m tests.standin.replica --master-ip <--omni-master-address> \\
                    --master-port <--omni-master-port> --bind-ip <podIP>
  role=pool     python -m tests.standin.replica --master-ip <--omni-master-address> \\
                    --master-port <--omni-master-port> --bind-ip <podIP> --stage-id K [--stage-id K ...]

A head's N is len(stages) of its deploy config (`--deploy-config`, read from the ConfigMap the pod
mounts there, through the API as the kubelet would): N > 1 starts the multi-stage stand-in head,
which serves nothing (not Ready) until one replica of each of stages 1..N-1 registered and exits 1
after the stage-init timeout. A pool pod (issue 12: `python3 -m omnistage_engine_patches.stages
--stage-id K ... -- vllm serve ... --headless`) gets ONE process for all its stages (the import
cost of vLLM once per pod on a small machine): the stage ids are the `--stage-id` values before
`--`, the master address and port come after it.

Pod deleted (deletionTimestamp set, gone, or replaced under the same name with a new UID) ->
SIGTERM to the process group, SIGKILL after a bound. It also does the kubelet duties kwok
cannot, because kwok knows nothing about the process:

  * restartPolicy: a process that dies while its pod exists is restarted (Always/OnFailure, with
    the kubelet's growing back-off; the restarted head has a new boot id) or its pod is marked
    Failed (Never: replicas), with restartCount / lastState / Ready written like a kubelet does.
  * preStop: a deleted pod's container preStop exec hook runs before SIGTERM (the replica and
    pool pods' hook drains them at the head), bounded by the grace period.
  * readiness: a container with an httpGet readinessProbe is Ready only while the probe answers
    2xx (kwok marks every pod Ready at once, which would make "head Ready" meaningless), and a pod
    with spec.readinessGates (replica and pool pods: the operator's joined condition) is Ready only
    while its containers are and every gate's condition is True, as the kubelet computes it. kwok
    also writes True into every readiness gate at start-up; the runtime takes that back when it
    starts the process, so a replica stays NotReady until its stand-in registered and was joined.
  * liveness: a container with an httpGet livenessProbe is probed once it has started (its readiness
    probe succeeded once, or without one its liveness probe); failureThreshold failures in a row
    (refused, timed out, not 2xx/3xx) -> SIGTERM (the preStop hook is not run), SIGKILL after the
    bound of a stop, and the restart policy above.

`kill(namespace, pod)` (or `python -m tests.standin.runtime kill NS/POD`) SIGKILLs a pod's
process the way an OOM kill would; the restart policy above then applies: the head comes back with
a new boot id, a replica pod turns Failed.

NETWORK RULE (DESIGN.md section 7): only 127.0.0.0/8. Pod IPs and master addresses outside it are
refused (logged and skipped), the API server must be on loopback, probes dial pod IPs only, and
proxy variables are stripped from children so nothing is sent through a proxy.

REAL MODE (`image=EngineImage(...)`, or `--engine-env VENV --model NAME=DIR`: realpod.cpu_engine_image): instead of
a stand-in, each engine pod runs its OWN container command and args with its own environment and
mounts (tests/standin/realpod.py has the mapping: the image is a venv on this machine, spec.model a
local directory). Probes, restart policy and kill are the same; a deleted pod's process gets the
pod's terminationGracePeriodSeconds (capped at REAL_GRACE_CAP) after SIGTERM, and engines run niced.

Usage:
  python -m tests.standin.runtime [--namespace NS|GLOB ...] [--kubeconfig F] [--state-dir D]
  python -m tests.standin.runtime --engine-env ~/.cache/omnistage/venv-cpu --model NAME=DIR ...
  python -m tests.standin.runtime kill NS/POD [--state-dir D]
  with StandinRuntime(namespaces=[ns]) as rt: ...          (pytest fixtures)

Product code in operator/ must never import this module.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import fnmatch
import ipaddress
import json
import math
import os
import posixpath
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlparse

import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException
from omnistage_engine_patches import contract

from tests.standin import NO_CUDA_ENV, realpod, zygote
from tests.standin.realpod import EngineImage

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
L_COMPONENT = "serving.omnistage.io/component"
L_ROLE = "serving.omnistage.io/role"
HEAD_ROLES = ("head", "next-head", "old-head")  # omnistage.names.HEAD_ROLES
L_OMNISTAGE = "serving.omnistage.io/omnistage"
# Stage-0 pods (head, replicas) and the pods of stages >= 1 (pools).
COMPONENTS = ("engine", "pool")
SELECTOR = f"{L_COMPONENT} in ({','.join(COMPONENTS)})"
DEFAULT_STATE_DIR = Path(os.environ.get("OMNISTAGE_STANDIN_DIR", "/tmp/omnistage-standin"))
HEAD_MODULE = "tests.standin.head"
REPLICA_MODULE = "tests.standin.replica"

# Bounds. The kubelet honours terminationGracePeriodSeconds (60 s and more for these pods); the
# stand-ins exit on SIGTERM in well under a second, so a tighter bound keeps test teardown short.
STOP_TIMEOUT = 10.0
WATCH_TIMEOUT = 60          # server-side watch timeout; the watch is simply re-opened afterwards
MAX_WATCH_FAILURES = 30     # consecutive failed (re)connects before the runtime gives up loudly
TICK = 0.2                  # supervisor period: process exits, pending starts, probes
PROBE_PERIOD_CAP = 1.0      # probe at least this often (faster than the pods' 5 s: tests wait less)
PROBE_TIMEOUT_CAP = 10.0    # a probe's timeoutSeconds (default 1, as the kubelet's), at most this
PRE_STOP_CAP = 60.0          # a stand-in's preStop hook (its replica serves nothing: the leave is quick)
GATE_DEBOUNCE = 1.0         # a Ready rewritten for a gate waits this long for the watch before another
START_RETRY = 2.0           # a pod that could not be started yet (no Secret yet) is retried this often
BACKOFF_FIRST, BACKOFF_BASE, BACKOFF_CAP = 1.0, 10.0, 60.0  # kubelet-like crash back-off
# Real mode: a deleted pod's engine gets its terminationGracePeriodSeconds after SIGTERM, as from a
# kubelet, up to this bound (the operator drains before it deletes; vLLM's own shutdown is seconds).
REAL_GRACE_CAP = 120.0
# Real engines run below the operator, the API server and the tests on a 2-core machine.
REAL_NICE = 10


def _now() -> str:
    return dt.datetime.now().strftime("%H:%M:%S.%f")[:-3]


def _rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_loopback(ip: str | None) -> bool:
    try:
        return ip is not None and ipaddress.ip_address(ip) in LOOPBACK
    except ValueError:
        return False


def _arg(args: list[str], flag: str) -> str | None:
    """Value of `flag` in a container's args (`--flag value` or `--flag=value`)."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _arg_values(args: list[str], flag: str) -> list[str]:
    """Every value of a repeatable `flag` (`--flag value` or `--flag=value`), in order."""
    out = []
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
    return out


def _expand(value: str | None, pod: dict[str, Any]) -> str | None:
    """Expand the $(VAR) references the kubelet would (only the downward-API ones the renderer uses)."""
    if value is None:
        return None
    return (value.replace("$(POD_IP)", pod["status"].get("podIP") or "")
                 .replace("$(POD_NAME)", pod["metadata"]["name"]))


def _engine_container(pod: dict[str, Any]) -> dict[str, Any]:
    containers = pod["spec"].get("containers") or [{}]
    return next((c for c in containers if c.get("name") == "engine"), containers[0])


# ----- stand-in command lines from a pod's (expanded) container args: pure -------------------------

def _head_ports(args: list[str]) -> tuple[str, str]:
    """(HTTP port, master port) of a head's `vllm serve` args."""
    master_port = _arg(args, "--omni-master-port")
    if not master_port:
        raise _Refused("head pod has no --omni-master-port in its args")
    return _arg(args, "--port") or "8000", master_port


def head_argv(python: str, module: str, args: list[str], ip: str, token_file: str | os.PathLike,
              stages: int = 1) -> list[str]:
    """The stand-in head for a head pod whose deploy config has `stages` stages. With more than one
    the head pod's `--stage-init-timeout` bounds the wait for the remote stages, as in vllm-omni."""
    http_port, master_port = _head_ports(args)
    argv = [python, "-m", module, "--bind-ip", ip, "--master-port", master_port, "--http-port", http_port,
            "--token-file", str(token_file)]
    if stages > 1:
        argv += ["--stages", str(stages)]
        timeout = _arg(args, "--stage-init-timeout")
        if timeout:
            argv += ["--startup-timeout", timeout]
    return argv


def _master(args: list[str], what: str) -> tuple[str, str]:
    master_ip = _arg(args, "--omni-master-address")
    master_port = _arg(args, "--omni-master-port")
    if not master_ip or not master_port:
        raise _Refused(f"{what} lacks --omni-master-address/--omni-master-port in its args")
    if not is_loopback(master_ip):
        raise _Refused(f"master address {master_ip} is not in 127.0.0.0/8 (network rule); not started")
    return master_ip, master_port


def replica_argv(python: str, module: str, args: list[str], ip: str) -> list[str]:
    """The stand-in replica for a stage-0 replica pod (`vllm serve --headless --stage-id 0`)."""
    master_ip, master_port = _master(args, "replica pod")
    return [python, "-m", module, "--master-ip", master_ip, "--master-port", master_port, "--bind-ip", ip]


def pool_argv(python: str, module: str, args: list[str], ip: str) -> list[str]:
    """One stand-in replica process for a pool pod: `--stage-id K ... -- vllm serve ... --headless
    --omni-master-address A --omni-master-port P ...` (the supervisor's args) registers a replica of
    every K with A:P. Stage ids after `--` (if any) belong to the supervised command, not the pod."""
    if "--" not in args:
        raise _Refused("pool pod args have no '--' between its stage ids and the command")
    split = args.index("--")
    ids, command = args[:split], args[split + 1:]
    stage_ids = _arg_values(ids, "--stage-id")
    if not stage_ids or not all(k.isdigit() for k in stage_ids):
        raise _Refused(f"pool pod has no valid --stage-id before '--': {ids}")
    master_ip, master_port = _master(command, "pool pod")
    return [python, "-m", module, "--master-ip", master_ip, "--master-port", master_port, "--bind-ip", ip,
            *(a for k in stage_ids for a in ("--stage-id", k))]


def deploy_config_source(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(ConfigMap name, key) behind the engine container's `--deploy-config` file: the configMap
    volume mounted at the file's directory (as the operator renders it), else `<omnistage>-config`.
    None when the container names no deploy config."""
    container = _engine_container(pod)
    path = _arg(container.get("args") or [], "--deploy-config")
    if not path:
        return None
    directory, key = posixpath.split(path)
    mount = next((m for m in container.get("volumeMounts") or []
                  if (m.get("mountPath") or "").rstrip("/") == directory), None)
    volume = next((v for v in pod["spec"].get("volumes") or [] if mount and v.get("name") == mount.get("name")), None)
    source = (volume or {}).get("configMap")
    if source is None:
        owner = (pod["metadata"].get("labels") or {}).get(L_OMNISTAGE)
        if not owner:
            raise _Refused(f"no configMap volume at {directory} and no omnistage label")
        return f"{owner}-config", key
    # `items` maps keys to other file names.
    key = next((i["key"] for i in source.get("items") or [] if i.get("path") == key), key)
    return source["name"], key


def count_stages(deploy_yaml: str) -> int:
    """len(stages) of a vllm-omni deploy config (1, stage 0 only, when it has no stages list)."""
    try:
        config_ = yaml.safe_load(deploy_yaml)
    except yaml.YAMLError as err:
        raise _Refused(f"deploy config is not YAML: {err}") from None
    stages = config_.get("stages") if isinstance(config_, dict) else None
    return len(stages) if isinstance(stages, list) and stages else 1


# Container variables passed to the stand-in process: the engine plugin's contract (operator-
# rendered) and the stand-in's own knobs. The rest (VLLM_CACHE_ROOT, VLLM_HOST_IP, ...) name
# paths and addresses of a real pod and are set here for the process instead.
PASSED_ENV_PREFIX = "OMNISTAGE_"


def _container_env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: _expand(e.get("value", ""), pod) for e in _engine_container(pod).get("env") or []
            if e.get("name", "").startswith(PASSED_ENV_PREFIX) and "valueFrom" not in e}


def _base_env() -> dict[str, str]:
    """The runtime's environment as its stand-ins get it: no proxy variables, this tree importable."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(NO_CUDA_ENV)
    # Offline from the first import: huggingface_hub reads HF_HUB_OFFLINE once, at import, which for
    # a child of the fork server happened in the server, before head.py's own setting.
    env.update(realpod.OFFLINE_ENV)
    env.update({"PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    return env


def _child_env(ip: str, pod: dict[str, Any]) -> dict[str, str]:
    base = _base_env()
    env = {**base, **_container_env(pod)}  # the pod's contract variables win over the runtime's own
    env.update({
        "PYTHONUNBUFFERED": base["PYTHONUNBUFFERED"],  # ... but not over these
        "PYTHONPATH": base["PYTHONPATH"],
        # vLLM / vllm-omni otherwise find their address with a UDP route probe to a public IP.
        "VLLM_HOST_IP": ip,
        "POD_IP": ip,
        "POD_NAME": pod["metadata"]["name"],
        "POD_NAMESPACE": pod["metadata"]["namespace"],
    })
    return env


@dataclass
class Proc:
    """One pod's stand-in container process."""

    namespace: str
    pod: str
    uid: str
    role: str
    ip: str
    argv: list[str]
    log_path: Path
    restart_policy: str
    popen: subprocess.Popen | zygote.ZygoteChild | None = None
    started_at: float = 0.0
    starts: int = 0            # 1 + restarts; each start is a new head boot id
    restart_at: float | None = None
    backoff: float = BACKOFF_FIRST
    failed: bool = False       # restartPolicy Never and the process exited: never started again
    last_exit: int | None = None  # container exit code of the previous run (128+signal if killed)
    stopping: bool = False
    probe: dict[str, Any] | None = None  # readiness: {"url", "period", "failure_threshold", "timeout"}
    ready: bool | None = None
    probe_failures: int = 0
    next_probe: float = 0.0
    liveness: dict[str, Any] | None = None  # the livenessProbe, as `probe`
    started: bool = False      # this run passed its start-up (a first probe success): liveness counts
    live_failures: int = 0
    next_live: float = 0.0     # inf while a liveness probe is under way, and after its kill
    history: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one terminator at a time
    terminated: bool = False
    env: dict[str, str] | None = None    # real mode: the container's environment (realpod.pod_process)
    grace: float | None = None           # real mode: the pod's terminationGracePeriodSeconds (capped)
    gate_patched_at: float = 0.0         # last time Ready was rewritten for a readiness gate change
    pre_stop: list[str] | None = None    # the container's preStop exec hook, as this machine runs it
    pre_stop_env: dict[str, str] | None = None
    pre_stop_grace: float = 0.0          # what the pod's grace period leaves the hook

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.pod)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class StandinRuntime:
    """Watches engine pods and runs a stand-in process per running pod. Thread-based; see module doc."""

    def __init__(self, kubeconfig: str | os.PathLike | None = None, namespaces: list[str] | None = None,
                 state_dir: str | os.PathLike | None = None, python: str = sys.executable,
                 probes: bool = True, stop_timeout: float = STOP_TIMEOUT, quiet: bool = False,
                 head_module: str = HEAD_MODULE, replica_module: str = REPLICA_MODULE,
                 image: EngineImage | None = None, grace_cap: float = REAL_GRACE_CAP):
        self.kubeconfig = str(kubeconfig or os.environ.get("KUBECONFIG") or "")
        self.namespaces = list(namespaces or [])
        self.state_dir = Path(state_dir or DEFAULT_STATE_DIR)
        self.python = python
        self.probes = probes
        self.stop_timeout = stop_timeout
        self.quiet = quiet
        self.head_module, self.replica_module = head_module, replica_module
        # Real mode: run each engine pod's own command in this image (tests/standin/realpod.py).
        self.image, self.grace_cap = image, grace_cap
        self._lock = threading.RLock()
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}   # latest object per pod (watch)
        self._procs: dict[tuple[str, str], Proc] = {}
        self._refused: set[tuple[str, str, str]] = set()          # (ns, pod, uid) logged once
        self.refusals: dict[tuple[str, str], str] = {}              # (ns, pod) -> why it was not started
        self._start_errors: dict[tuple[str, str, str], str] = {}
        self._next_start_try: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._synced: set[str] = set()
        self.error: BaseException | None = None
        self.events: list[dict[str, Any]] = []   # every start/stop/exit, for tests and benchmarks
        self._pending_env: dict[tuple[str, str, str], dict[str, str]] = {}  # real mode, until the Proc exists
        self._zygote: zygote.Zygote | None = None  # stand-in mode: the fork server (tests/standin/zygote.py)
        self._zygote_said = False
        self._held_not_ready: set[str] = set()  # pod uids taken back from kwok's Ready before their start

    # ----- logging -----------------------------------------------------------------------------

    def log(self, msg: str) -> None:
        line = f"[runtime {_now()}] {msg}"
        if not self.quiet:
            print(line, flush=True)
        # Also in the state dir, beside the stand-ins' logs: a passing test's output is not kept, and
        # a later failure (or a slow run) is read from here.
        with contextlib.suppress(OSError), open(self.state_dir / "runtime.log", "a") as f:
            f.write(line + "\n")

    def _event(self, action: str, p: Proc, **extra: Any) -> None:
        ev = {"time": time.time(), "action": action, "namespace": p.namespace, "pod": p.pod, "uid": p.uid,
              "role": p.role, "ip": p.ip, "pid": p.pid, **extra}
        self.events.append(ev)
        p.history.append((ev["time"], action))
        detail = " ".join(f"{k}={v}" for k, v in extra.items())
        self.log(f"{action:<8} {p.role:<7} {p.namespace}/{p.pod} uid={p.uid[:8]} ip={p.ip} pid={p.pid} {detail}"
                 .rstrip())

    # ----- lifecycle ---------------------------------------------------------------------------

    def start(self, sync_timeout: float = 30.0) -> Self:
        self._connect()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for sub in ("logs", "pids", "tokens"):
            (self.state_dir / sub).mkdir(exist_ok=True)
        self._reap_stale()
        if self.image is None and zygote.enabled():
            # Imports torch and vLLM once for every stand-in of this process (zygote.py says why).
            self._zygote = zygote.shared(self.python, _base_env(), str(ROOT), self.state_dir / "logs" / "zygote.log")
        scopes = self._scopes()
        for ns in scopes:
            t = threading.Thread(target=self._watch_loop, args=(ns,), name=f"watch-{ns or 'all'}", daemon=True)
            t.start()
            self._threads.append(t)
        sup = threading.Thread(target=self._supervise_loop, name="supervisor", daemon=True)
        sup.start()
        self._threads.append(sup)
        mode = (f"real engines from {self.image.bin_dir.parent}" if self.image else "stand-in engines")
        self.log(f"watching engine pods in {', '.join(self.namespaces) or 'all namespaces'} ({mode}); "
                 f"state in {self.state_dir}")
        deadline = time.monotonic() + sync_timeout
        while len(self._synced) < len(scopes):
            if self.error:
                raise RuntimeError(f"stand-in runtime failed: {self.error}") from self.error
            if time.monotonic() > deadline:
                raise TimeoutError(f"stand-in runtime: initial pod list not done after {sync_timeout:.0f}s")
            time.sleep(0.05)
        return self

    def _scopes(self) -> list[str]:
        """Namespaces to watch: each exact name, or everything ("") when none or a glob is given."""
        if not self.namespaces or any(_is_glob(n) for n in self.namespaces):
            return [""]
        return list(self.namespaces)

    def _wanted(self, ns: str) -> bool:
        return not self.namespaces or any(fnmatch.fnmatchcase(ns, n) for n in self.namespaces)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            procs = list(self._procs.values())
        threads = [threading.Thread(target=self._terminate, args=(p, "runtime stopping"), daemon=True) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.stop_timeout + 5)
        for t in self._threads:
            # A watch thread sits in a long poll until the next event; it is a daemon and only
            # reads, so do not wait for it long.
            t.join(5 if t.name == "supervisor" else 0.5)
        self.log("stopped")  # the fork server is the process's, closed at its exit (zygote.shared)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _connect(self) -> None:
        cfg = client.Configuration()
        config.load_kube_config(config_file=self.kubeconfig or None, client_configuration=cfg)
        host = urlparse(cfg.host).hostname or ""
        if host != "localhost" and not is_loopback(host):
            # Network rule: this tool is for the local control plane only.
            raise RuntimeError(f"refusing API server {cfg.host}: the stand-in runtime only talks to loopback")
        self._watch_api = client.CoreV1Api(client.ApiClient(cfg))
        self._api = client.CoreV1Api(client.ApiClient(cfg))
        self._serialize = client.ApiClient(cfg).sanitize_for_serialization

    # ----- queries for tests -------------------------------------------------------------------

    def process(self, namespace: str, pod: str) -> Proc | None:
        with self._lock:
            return self._procs.get((namespace, pod))

    def processes(self) -> dict[tuple[str, str], Proc]:
        with self._lock:
            return dict(self._procs)

    def log_path(self, namespace: str, pod: str) -> Path | None:
        p = self.process(namespace, pod)
        return p.log_path if p else None

    def wait_running(self, namespace: str, pod: str, timeout: float = 60, uid: str | None = None,
                     min_starts: int = 1) -> Proc:
        """Bounded wait until the pod's process runs (of pod UID `uid`, started at least min_starts times)."""
        deadline, report = time.monotonic() + timeout, time.monotonic() + 5
        while True:
            p = self.process(namespace, pod)
            if p and p.alive() and (uid is None or p.uid == uid) and p.starts >= min_starts:
                return p
            if self.error:
                raise RuntimeError(f"stand-in runtime failed: {self.error}") from self.error
            if time.monotonic() > deadline:
                raise TimeoutError(f"no running stand-in process for {namespace}/{pod} after {timeout:.0f}s")
            if time.monotonic() > report:
                self.log(f"  still waiting for a process for {namespace}/{pod}")
                report = time.monotonic() + 5
            time.sleep(0.1)

    def kill(self, namespace: str, pod: str) -> int:
        """SIGKILL the pod's process group (like an OOM kill); the restart policy then applies.

        Returns the killed pid. A head (restartPolicy Always) comes back as a new process with a new
        boot id; a replica (restartPolicy Never) leaves its pod Failed."""
        p = self.process(namespace, pod)
        if not p or not p.alive():
            raise LookupError(f"no running stand-in process for {namespace}/{pod}")
        pid = p.pid
        self._event("kill", p, signal="SIGKILL")
        _killpg(pid, signal.SIGKILL)
        return pid

    # ----- watch -------------------------------------------------------------------------------

    def _list(self, ns: str) -> tuple[list[dict[str, Any]], str]:
        if ns:
            res = self._watch_api.list_namespaced_pod(ns, label_selector=SELECTOR, _request_timeout=30)
        else:
            res = self._watch_api.list_pod_for_all_namespaces(label_selector=SELECTOR, _request_timeout=30)
        return [self._serialize(p) for p in res.items], res.metadata.resource_version

    def _watch_loop(self, ns: str) -> None:
        failures, rv = 0, None
        while not self._stop.is_set():
            try:
                if rv is None:
                    pods, rv = self._list(ns)
                    self._replace_scope(ns, pods)
                    self._synced.add(ns)
                w = watch.Watch()
                fn = self._watch_api.list_namespaced_pod if ns else self._watch_api.list_pod_for_all_namespaces
                kwargs: dict[str, Any] = {"label_selector": SELECTOR, "resource_version": rv,
                                          "timeout_seconds": WATCH_TIMEOUT, "allow_watch_bookmarks": True,
                                          "_request_timeout": WATCH_TIMEOUT + 10}
                if ns:
                    kwargs["namespace"] = ns
                for ev in w.stream(fn, **kwargs):
                    if self._stop.is_set():
                        w.stop()
                        break
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        raw = obj if isinstance(obj, dict) else self._serialize(obj)
                        if raw.get("code") == 410:
                            rv = None  # history compacted: list again
                            break
                        raise RuntimeError(f"watch error: {raw}")
                    pod = self._serialize(obj)
                    rv = pod["metadata"].get("resourceVersion") or rv
                    if ev["type"] == "BOOKMARK":
                        continue
                    self._on_pod(ev["type"], pod)
                failures = 0
            except ApiException as err:
                if err.status == 410:
                    rv = None
                    continue
                failures = self._watch_failed(ns, failures, err)
            except Exception as err:  # noqa: BLE001 -- connection reset, API server restarting, ...
                failures = self._watch_failed(ns, failures, err)
            if failures > MAX_WATCH_FAILURES:
                self.error = RuntimeError(f"pod watch in {ns or 'all namespaces'} failed {failures} times in a row")
                self.log(f"giving up: {self.error}")
                return

    def _watch_failed(self, ns: str, failures: int, err: BaseException) -> int:
        failures += 1
        self.log(f"pod watch ({ns or 'all namespaces'}) failed ({failures}/{MAX_WATCH_FAILURES}): "
                 f"{type(err).__name__}: {str(err)[:200]}; reconnecting")
        self._stop.wait(min(5.0, 0.5 * failures))
        return failures

    def _replace_scope(self, ns: str, pods: list[dict[str, Any]]) -> None:
        """A fresh list is the whole truth for its scope: forget pods that disappeared meanwhile."""
        with self._lock:
            fresh = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods
                     if self._wanted(p["metadata"]["namespace"])}
            for key in [k for k in self._pods if (not ns or k[0] == ns) and k not in fresh]:
                del self._pods[key]
            self._pods.update(fresh)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        if not self._wanted(key[0]):
            return
        with self._lock:
            if kind == "DELETED":
                cur = self._pods.get(key)
                if cur is not None and cur["metadata"]["uid"] == pod["metadata"]["uid"]:
                    del self._pods[key]
            else:
                self._pods[key] = pod

    # ----- supervisor --------------------------------------------------------------------------

    def _supervise_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._supervise_once()
            except Exception as err:  # noqa: BLE001 -- keep supervising; a bug here must be visible, not fatal
                self.log(f"supervisor error: {type(err).__name__}: {err}")
            self._stop.wait(TICK)

    def _supervise_once(self) -> None:
        now = time.monotonic()
        with self._lock:
            pods = dict(self._pods)
            procs = dict(self._procs)
        # 1. processes whose pod is gone, terminating or replaced (new UID) -> stop
        for key, p in procs.items():
            pod = pods.get(key)
            reason = None
            if pod is None:
                reason = "pod deleted"
            elif pod["metadata"]["uid"] != p.uid:
                reason = "pod replaced (new UID)"
            elif pod["metadata"].get("deletionTimestamp"):
                reason = "pod terminating"
            if reason and not p.stopping:
                p.stopping = True
                threading.Thread(target=self._terminate, args=(p, reason), daemon=True).start()
        # 2. processes that exited on their own (or were killed) -> restart policy
        for key, p in procs.items():
            if p.stopping or p.failed or p.popen is None or p.alive() or p.restart_at is not None:
                continue
            code = p.popen.returncode
            self._event("exited", p, code=code)
            self._on_exit(p, pods.get(key), code)
        # 3. restarts that are due
        for key, p in procs.items():
            if p.restart_at is not None and now >= p.restart_at and not p.stopping:
                pod = pods.get(key)
                if pod is None or pod["metadata"]["uid"] != p.uid:
                    continue
                p.restart_at = None
                self._spawn(p, pod, restart=True)
        # 4. running pods without a process -> start
        stale_ips = {p.ip for key, p in procs.items()
                     if p.alive() and (key not in pods or pods[key]["metadata"]["uid"] != p.uid)}
        for key, pod in pods.items():
            if key in procs and procs[key].uid == pod["metadata"]["uid"]:
                continue
            if key in procs:  # old incarnation still stopping; start the new one once it is gone
                self._not_started_yet(pod, "the previous pod of this name is still stopping")
                continue
            ip = (pod.get("status") or {}).get("podIP")
            if ip and any(p.ip == ip and p.alive() for p in procs.values()):
                # pod IPs are reused: wait until the previous holder released the address
                self._not_started_yet(pod, "the previous holder of its IP is still stopping")
                continue
            master = stale_ips and _expand(_arg(_engine_container(pod).get("args") or [], "--omni-master-address"), pod)
            if master in stale_ips:
                # kwok gave a deleted head's IP to its successor while the old process still stops; a
                # kubelet's CNI would not have (the IP is freed with the sandbox). Dialled now, the old
                # head would take the registration.
                self._not_started_yet(pod, f"its head's address {master} is still held by a stopping process")
                continue
            if now < self._next_start_try.get(key, 0):
                continue
            self._maybe_start(key, pod)
        # 5. readiness and liveness probes, then readiness gates (Ready = containers ready, every gate True)
        if self.probes:
            for p in procs.values():
                if p.probe and p.alive() and not p.stopping and now >= p.next_probe:
                    self._probe(p)
            for p in procs.values():
                if (p.liveness and p.alive() and not p.stopping and (p.started or not p.probe)
                        and now >= p.next_live):
                    # In a thread: its timeout (up to 10 s) and the kill must not hold up the supervisor.
                    p.next_live = math.inf
                    threading.Thread(target=self._live_probe, args=(p, p.starts), daemon=True).start()
            for p in procs.values():
                if p.alive() and not p.stopping and not p.failed and p.restart_at is None:
                    self._sync_gates(p, now)

    def _not_started_yet(self, pod: dict[str, Any], why: str) -> None:
        """A pod waiting for its container is not Ready, as the kubelet reports it; kwok said Ready
        (readiness gates included) the moment it bound it. Left alone, a PodDisruptionBudget counts it
        healthy and lets a node drain evict a second replica while the first one's replacement waits
        for the old process to stop. Once per pod incarnation."""
        meta = pod["metadata"]
        uid = meta["uid"]
        if uid in self._held_not_ready or not self._runnable(pod):
            return
        self._held_not_ready.add(uid)
        ns, name = meta["namespace"], meta["name"]
        if not self._patch_pod_status(ns, name, uid, {"conditions": _readiness(pod, False, False, reset_gates=True)}):
            return
        self.log(f"notready {pod['metadata'].get('labels', {}).get(L_ROLE, '?'):<7} {ns}/{name} uid={uid[:8]} "
                 f"why=container_not_started:_{why.replace(' ', '_')}")

    def _runnable(self, pod: dict[str, Any]) -> bool:
        st = pod.get("status") or {}
        return (st.get("phase") == "Running" and bool(st.get("podIP"))
                and not pod["metadata"].get("deletionTimestamp"))

    def _maybe_start(self, key: tuple[str, str], pod: dict[str, Any]) -> None:
        if not self._runnable(pod):
            return
        ns, name = key
        uid = pod["metadata"]["uid"]
        labels = pod["metadata"].get("labels") or {}
        # A head change's second head (next-head, old-head) is a head: the label picks the Services, not the process.
        role = "head" if labels.get(L_ROLE, "") in HEAD_ROLES else labels.get(L_ROLE, "")
        ip = pod["status"]["podIP"]
        once = (ns, name, uid)
        if not is_loopback(ip):
            if once not in self._refused:
                self._refused.add(once)
                self.log(f"REFUSED {ns}/{name}: pod IP {ip} is not in 127.0.0.0/8 (network rule); not started")
            return
        try:
            argv = self._command(pod, role, ip)
        except _NotYet as err:
            self._next_start_try[key] = time.monotonic() + START_RETRY
            if self._start_errors.get(once) != str(err):
                self._start_errors[once] = str(err)
                self.log(f"waiting   {role or '?':<7} {ns}/{name}: {err} (retrying every {START_RETRY:.0f}s)")
            return
        except _Refused as err:
            if once not in self._refused:
                self._refused.add(once)
                self.refusals[key] = str(err)
                self.log(f"REFUSED {ns}/{name}: {err}")
            return
        container = _engine_container(pod)
        p = Proc(namespace=ns, pod=name, uid=uid, role=role, ip=ip, argv=argv,
                 log_path=self.state_dir / "logs" / f"{ns}_{name}_{uid[:8]}.log",
                 restart_policy=pod["spec"].get("restartPolicy") or "Always",
                 probe=self._probe_spec(container, ip), env=self._pending_env.pop(once, None),
                 liveness=self._probe_spec(container, ip, "livenessProbe"))
        if p.env is not None:
            p.grace = min(float(pod["spec"].get("terminationGracePeriodSeconds", 30)), self.grace_cap)
        self._prepare_pre_stop(p, pod, container)
        with self._lock:
            self._procs[key] = p
        self._spawn(p, pod, restart=False)

    def _command(self, pod: dict[str, Any], role: str, ip: str) -> list[str]:
        container = _engine_container(pod)
        args = [_expand(a, pod) or "" for a in container.get("args") or []]
        if role == "head":
            # A single-engine head (membership static, 1 replica) has no master port: only its HTTP port
            # and the plugin's membership port (the container port of that name).
            membership = next((str(p["containerPort"]) for p in container.get("ports") or []
                               if p.get("name") == contract.MEMBERSHIP_PORT_NAME), None)
            for port in filter(None, (_arg(args, "--port") or "8000", _arg(args, "--omni-master-port"), membership)):
                if not _port_free(ip, int(port)):
                    # Not one of ours (we wait for our own previous holder of an IP): most likely another
                    # local cluster on this machine whose nodes have the same loopback pod CIDRs.
                    raise _NotYet(f"{ip}:{port} is already in use by a process this runtime did not start "
                                  f"(another local cluster with the same pod CIDRs?)")
        if self.image is not None:
            return self._real_process(pod, role, args).argv
        if role == "head":
            stages = self._stage_count(pod)
            return head_argv(self.python, self.head_module, args, ip, self._token_file(pod), stages)
        if role == "replica":
            return replica_argv(self.python, self.replica_module, args, ip)
        if role == "pool":
            return pool_argv(self.python, self.replica_module, args, ip)
        raise _Refused(f"unknown role {role!r} (label {L_ROLE})")

    def _real_process(self, pod: dict[str, Any], role: str, args: list[str]) -> realpod.PodProcess:
        """Real mode: the pod's own container as a process (realpod.pod_process), its ConfigMap and
        Secret volumes written to the pod's directory. The environment waits on the Proc (_spawn)."""
        if role not in ("head", "replica", "pool"):
            raise _Refused(f"unknown role {role!r} (label {L_ROLE})")
        if role != "head":
            _master(args if role == "replica" else args[args.index("--") + 1:] if "--" in args else args,
                    f"{role} pod")  # the network rule: the master it dials must be a loopback address
        ns, meta = pod["metadata"]["namespace"], pod["metadata"]
        readers = {"ConfigMap": self._api.read_namespaced_config_map, "Secret": self._api.read_namespaced_secret}

        def lookup(kind: str, name: str) -> dict[str, Any] | None:
            try:
                if kind == "ServiceAccountToken":  # as the kubelet does: a token bound to this pod
                    body = {"spec": {"audiences": [name] if name else None, "expirationSeconds": 3600,
                                     "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                                                        "uid": meta["uid"]}}}
                    sa = pod["spec"].get("serviceAccountName") or "default"
                    out = self._api.create_namespaced_service_account_token(sa, ns, body, _request_timeout=10)
                    return {"token": out.status.token}
                return self._serialize(readers[kind](name, ns, _request_timeout=10))
            except ApiException as err:
                if err.status == 404:
                    return None
                raise _NotYet(f"{kind} {ns}/{name}: HTTP {err.status} reading it") from None

        proc = realpod.pod_process(pod, lookup, self.image, self.pod_root(ns, meta["name"], meta["uid"]),
                                   tmp=Path("/tmp") / f"omnistage-pod-{meta['uid'][:8]}")
        for d in proc.dirs:
            d.mkdir(parents=True, exist_ok=True)
        for path, (content, mode) in proc.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(content)
        self._pending_env[(ns, meta["name"], meta["uid"])] = proc.env
        return proc

    def pod_root(self, namespace: str, pod: str, uid: str) -> Path:
        """Real mode: the pod's own directory (its volumes, HOME and TMPDIR)."""
        return self.state_dir / "pods" / f"{namespace}_{pod}_{uid[:8]}"

    def _stage_count(self, pod: dict[str, Any]) -> int:
        """Stages of the head's pipeline: len(stages) of the deploy config its pod mounts (ConfigMap)."""
        source = deploy_config_source(pod)
        if source is None:
            return 1
        ns, (name, key) = pod["metadata"]["namespace"], source
        cm = _read_or_not_yet(self._api.read_namespaced_config_map, "ConfigMap", ns, name)
        text = (cm.data or {}).get(key)
        if text is None:
            raise _NotYet(f"ConfigMap {ns}/{name} has no key {key!r} yet")
        return count_stages(text)

    def _token_file(self, pod: dict[str, Any]) -> Path:
        """The membership token, as the kubelet would mount it: from the pod's Secret volume."""
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        secret_name = None
        for v in pod["spec"].get("volumes") or []:
            if (v.get("secret") or {}).get("secretName", "").endswith("-membership"):
                secret_name = v["secret"]["secretName"]
        if not secret_name:
            owner = (pod["metadata"].get("labels") or {}).get(L_OMNISTAGE)
            if not owner:
                raise _Refused("head pod has neither a membership Secret volume nor an omnistage label")
            secret_name = f"{owner}-membership"
        secret = _read_or_not_yet(self._api.read_namespaced_secret, "Secret", ns, secret_name)
        raw = (secret.data or {}).get("token")
        if not raw:
            raise _NotYet(f"Secret {ns}/{secret_name} has no key 'token' yet")
        path = self.state_dir / "tokens" / f"{ns}_{name}_{pod['metadata']['uid'][:8]}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64decode(raw))
        return path

    def _probe_spec(self, container: dict[str, Any], ip: str,
                    kind: str = "readinessProbe") -> dict[str, Any] | None:
        """The container's httpGet `kind` probe (readinessProbe, livenessProbe), or None."""
        probe = container.get(kind) or {}
        get = probe.get("httpGet")
        if not get:
            return None
        port = get.get("port")
        if isinstance(port, str) and not port.isdigit():
            port = next((cp["containerPort"] for cp in container.get("ports") or [] if cp.get("name") == port), None)
        if port is None:
            return None
        return {"url": f"http://{ip}:{int(port)}{get.get('path') or '/'}",
                "period": min(float(probe.get("periodSeconds") or 10), PROBE_PERIOD_CAP),
                "failure_threshold": int(probe.get("failureThreshold") or 3),
                "timeout": min(float(probe.get("timeoutSeconds") or 1), PROBE_TIMEOUT_CAP)}

    # ----- processes ---------------------------------------------------------------------------

    def _spawn(self, p: Proc, pod: dict[str, Any], restart: bool) -> None:
        p.starts += 1
        with open(p.log_path, "ab") as logf:
            logf.write(f"\n===== [runtime {_now()}] start #{p.starts}: {' '.join(p.argv)}\n".encode())
            logf.flush()
            # Own session: SIGTERM/SIGKILL reach every process the stand-in forks, and a Ctrl-C in the
            # runtime's terminal does not hit the engines before the runtime stops them in order.
            real = p.env is not None
            p.popen = None if real else self._fork(p, pod)
            if p.popen is None:
                p.popen = subprocess.Popen(p.argv, cwd=p.env["HOME"] if real else ROOT,
                                           env=p.env if real else _child_env(p.ip, pod), stdin=subprocess.DEVNULL,
                                           stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        if p.env is not None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, p.popen.pid, REAL_NICE)  # before it spawns its engine core
        p.started_at = time.monotonic()
        p.ready, p.probe_failures, p.next_probe = None, 0, time.monotonic() + 0.5
        p.started, p.live_failures, p.next_live = False, 0, p.next_probe
        self._write_pid(p)
        self._event("restart" if restart else "start", p, start=p.starts, log=str(p.log_path))
        if restart:
            self._patch_restarted(p, pod)
        elif self.probes and _gates(pod):
            # kwok wrote True into the readiness gates; the kubelet never writes them (their owner,
            # the operator, does): take kwok's word back, the pod is Ready once the operator says so.
            self._patch_ready(p, p.probe is None, "waiting for the readiness gates", reset_gates=True)
        elif p.probe and self.probes:
            # The kubelet reports Ready only after the first successful readiness probe; kwok already
            # said Ready, so take it back until the stand-in answers.
            self._patch_ready(p, False, "waiting for the first readiness probe")

    def _fork(self, p: Proc, pod: dict[str, Any]) -> zygote.ZygoteChild | None:
        """The stand-in forked from the fork server, or None (not ready yet, gone, or not a
        `python -m` command): the caller starts a plain process, which behaves the same, slower."""
        z = self._zygote
        if z is None or p.argv[:2] != [self.python, "-m"]:
            return None
        if z.ready and not self._zygote_said:
            self._zygote_said = True
            self.log(f"fork server ready after {z.startup_seconds}s: stand-ins start from its imports")
        try:
            return z.spawn(p.argv[2], p.argv[3:], _child_env(p.ip, pod), str(ROOT), p.log_path)
        except zygote.Refused as why:
            self.log(f"plain    {p.role:<7} {p.namespace}/{p.pod}: the fork server refused it ({why})")
            return None
        except (OSError, RuntimeError) as err:
            self.log(f"fork server failed ({err}): plain processes from now on")
            self._zygote = None
            return None

    def _on_exit(self, p: Proc, pod: dict[str, Any] | None, code: int | None) -> None:
        p.last_exit = _exit_code(code)
        if p.restart_policy == "Always" or (p.restart_policy == "OnFailure" and code != 0):
            ran = time.monotonic() - p.started_at
            if ran > 2 * BACKOFF_CAP:
                p.backoff = BACKOFF_FIRST  # the kubelet resets the back-off after a long healthy run
            delay = p.backoff
            p.backoff = BACKOFF_BASE if p.backoff < BACKOFF_BASE else min(p.backoff * 2, BACKOFF_CAP)
            p.restart_at = time.monotonic() + delay
            self.log(f"backoff  {p.role:<7} {p.namespace}/{p.pod}: restart in {delay:.0f}s (restartPolicy {p.restart_policy})")
            if pod is not None:
                self._patch_ready(p, False, f"container exited with code {p.last_exit}")
        else:
            p.failed = True
            if pod is not None:
                self._patch_failed(p, pod, code)

    def _terminate(self, p: Proc, reason: str) -> None:
        p.stopping = True
        p.restart_at = None
        with p.lock:  # the pod's deletion and the runtime's own stop may both ask
            if not p.terminated:
                self._terminate_locked(p, reason)
                p.terminated = True

    def _prepare_pre_stop(self, p: Proc, pod: dict[str, Any], container: dict[str, Any]) -> None:
        """A kubelet runs the container's preStop exec hook before SIGTERM when the pod is deleted
        (the engine pods' drains the replica: omnistage_engine_patches.prestop). Real mode: the hook
        as written, in the container's environment (python3 is the image's). Stand-in mode: with
        this runtime's Python, the pod's OMNISTAGE_* variables and its membership token."""
        command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")
        if not command:
            return
        grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        if p.env is not None:
            p.pre_stop, p.pre_stop_env, p.pre_stop_grace = list(command), p.env, min(grace, self.grace_cap)
            return
        try:
            env = {**_child_env(p.ip, pod), "OMNISTAGE_MEMBERSHIP_TOKEN_FILE": str(self._token_file(pod))}
        except (_NotYet, _Refused) as err:
            self.log(f"no preStop hook for {p.namespace}/{p.pod}: {err}")
            return
        p.pre_stop = [self.python if command[0] == "python3" else command[0], *command[1:]]
        p.pre_stop_env, p.pre_stop_grace = env, min(grace, PRE_STOP_CAP)

    def _run_pre_stop(self, p: Proc) -> None:
        self._event("prestop", p, command=" ".join(p.pre_stop))
        with open(p.log_path, "ab") as logf:
            try:
                code: int | str = subprocess.run(
                    p.pre_stop, check=False, env=p.pre_stop_env, cwd=p.pre_stop_env.get("HOME") if p.env is not None else ROOT,
                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                    timeout=p.pre_stop_grace).returncode
            except (OSError, subprocess.TimeoutExpired) as err:
                code = type(err).__name__
        self._event("prestopped", p, code=code)

    def _terminate_locked(self, p: Proc, reason: str) -> None:
        if p.alive() and p.pre_stop and not self._stop.is_set():
            # The kubelet's order: the hook, then SIGTERM. Also for a pod already gone or replaced
            # under its name: kwok removes a deleted pod's object at once, without its grace.
            self._run_pre_stop(p)
        if p.alive():
            self._sigterm(p, reason)
        elif p.popen is not None:
            _killpg(p.pid, signal.SIGKILL)  # stragglers of an exited leader
        with self._lock:
            if self._procs.get(p.key) is p:
                del self._procs[p.key]
        for path in (self.state_dir / "pids" / f"{p.namespace}_{p.pod}.json",
                     self.state_dir / "tokens" / f"{p.namespace}_{p.pod}_{p.uid[:8]}"):
            path.unlink(missing_ok=True)

    def _sigterm(self, p: Proc, reason: str) -> None:
        """Stop the process as a kubelet stops a container: SIGTERM to its group, SIGKILL after the
        grace (the pod's in real mode, else stop_timeout)."""
        self._event("stop", p, reason=reason.replace(" ", "_"), signal="SIGTERM")
        _killpg(p.pid, signal.SIGTERM)
        grace = self.stop_timeout if p.grace is None or self._stop.is_set() else p.grace
        try:
            p.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self._event("kill", p, reason=f"no_exit_within_{grace:.0f}s", signal="SIGKILL")
            _killpg(p.pid, signal.SIGKILL)
            p.popen.wait(5)
        self._event("stopped", p, code=p.popen.returncode)

    def _write_pid(self, p: Proc) -> None:
        info = {"namespace": p.namespace, "pod": p.pod, "uid": p.uid, "role": p.role, "ip": p.ip, "pid": p.pid,
                "log": str(p.log_path), "starts": p.starts, "runtimePid": os.getpid(), "argv": p.argv}
        path = self.state_dir / "pids" / f"{p.namespace}_{p.pod}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(path)

    def _reap_stale(self) -> None:
        """Stop stand-ins left behind by a runtime that was killed (pid files of a dead runtime)."""
        for f in (self.state_dir / "pids").glob("*.json"):
            try:
                info = json.loads(f.read_text())
            except (OSError, ValueError):
                f.unlink(missing_ok=True)
                continue
            if _pid_alive(info.get("runtimePid")) and info.get("runtimePid") != os.getpid():
                continue  # another live runtime owns it
            pid = info.get("pid")
            if pid and _is_standin(pid, info.get("argv")):
                self.log(f"stopping stale stand-in pid {pid} of {info.get('namespace')}/{info.get('pod')}")
                _killpg(pid, signal.SIGKILL)
            f.unlink(missing_ok=True)

    # ----- kubelet-like status -----------------------------------------------------------------

    def _probe(self, p: Proc) -> None:
        probe = p.probe
        p.next_probe = time.monotonic() + probe["period"]
        if _probe_ok(probe):
            p.probe_failures, p.started = 0, True
            if p.ready is not True:
                self._patch_ready(p, True, "readiness probe succeeded")
        else:
            p.probe_failures += 1
            if p.ready is True and p.probe_failures >= probe["failure_threshold"]:
                self._patch_ready(p, False, f"readiness probe failed {p.probe_failures} times ({probe['url']})")

    def _live_probe(self, p: Proc, run: int) -> None:
        """One liveness probe of run `run` (p.starts); the kubelet's kill after failureThreshold failures
        in a row, the restart policy then applies to the exit (supervisor step 2)."""
        spec = p.liveness
        ok = _probe_ok(spec)
        if p.starts != run or not p.alive():
            return  # that run is over; its successor probes afresh
        p.next_live = time.monotonic() + spec["period"]
        if ok:
            p.live_failures, p.started = 0, True
            return
        if not p.started:
            return  # still starting up: never killed for that
        p.live_failures += 1
        if p.live_failures >= spec["failure_threshold"]:
            p.next_live = math.inf  # no more probes of this run
            why = f"liveness probe failed {p.live_failures} times ({spec['url']}): restarting"
            self._event("unhealthy", p, why=why)
            self._sigterm(p, "liveness probe failed")

    def _patch_status(self, p: Proc, status: dict[str, Any]) -> bool:
        return self._patch_pod_status(p.namespace, p.pod, p.uid, status)

    def _patch_pod_status(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> bool:
        """Patch that incarnation's status (uid precondition); False when it is gone or replaced."""
        try:
            self._api.patch_namespaced_pod_status(name, namespace, {"metadata": {"uid": uid}, "status": status},
                                                  _request_timeout=10)
            return True
        except ApiException as err:
            if err.status not in (404, 409, 422):
                self.log(f"status patch of {namespace}/{name} failed: HTTP {err.status}")
            return False

    def _container_statuses(self, p: Proc, pod: dict[str, Any], ready: bool, **change: Any) -> list[dict]:
        out = []
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            cs = dict(cs)
            if cs.get("name") == _engine_container(pod).get("name"):
                cs["ready"] = ready
                cs.update(change)
            out.append(cs)
        return out

    def _fresh_pod(self, p: Proc) -> dict[str, Any] | None:
        with self._lock:
            pod = self._pods.get(p.key)
        return pod if pod and pod["metadata"]["uid"] == p.uid else None

    def _patch_ready(self, p: Proc, ready: bool, why: str, reset_gates: bool = False) -> None:
        """`ready`: the container's readiness. The pod's Ready also needs every readiness gate True
        (reset_gates: write them False first, undoing kwok's start-up True)."""
        pod = self._fresh_pod(p)
        if pod is None:
            return
        pod_ready = ready and (not _gates(pod) or (not reset_gates and _gates_true(pod)))
        # `started` as the kubelet writes it: after the first probe success (of a probed container),
        # kept across readiness flips until a restart (the operator reads a started head: pods.answers).
        started = {"started": p.started} if p.probe else {}
        status = {"conditions": _readiness(pod, pod_ready, ready, reset_gates),
                  "containerStatuses": self._container_statuses(p, pod, ready, **started)}
        if self._patch_status(p, status):
            p.ready = ready
            p.gate_patched_at = time.monotonic()
            self._event("ready" if pod_ready else "notready", p, why=why.replace(" ", "_"))

    def _sync_gates(self, p: Proc, now: float) -> None:
        """A gated pod's Ready follows its gates' conditions (the operator's joined condition)."""
        pod = self._fresh_pod(p)
        if pod is None or not _gates(pod) or now - p.gate_patched_at < GATE_DEBOUNCE:
            return
        containers = p.ready is True if p.probe else True
        want = containers and _gates_true(pod)
        have = any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (pod.get("status") or {}).get("conditions") or [])
        if want != have:
            self._patch_ready(p, containers, "readiness gates " + ("true" if want else "not all true"))

    def _patch_restarted(self, p: Proc, pod: dict[str, Any]) -> None:
        cs = next((c for c in (pod.get("status") or {}).get("containerStatuses") or []), {})
        t = _rfc3339()
        prev_start = ((cs.get("state") or {}).get("running") or {}).get("startedAt") or t
        change = {"restartCount": int(cs.get("restartCount") or 0) + 1, "started": not p.probe,
                  "state": {"running": {"startedAt": t}},
                  "lastState": {"terminated": {"exitCode": p.last_exit or 0,
                                               "reason": "Error" if p.last_exit else "Completed",
                                               "startedAt": prev_start, "finishedAt": t}}}
        status = {"conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": t},
                                 {"type": "ContainersReady", "status": "False", "lastTransitionTime": t}],
                  "containerStatuses": self._container_statuses(p, pod, False, **change)}
        if self._patch_status(p, status):
            p.ready = False if p.probe else None
        if not p.probe:
            self._patch_ready(p, True, "restarted (no readiness probe)")

    def _patch_failed(self, p: Proc, pod: dict[str, Any], code: int | None) -> None:
        t = _rfc3339()
        exit_code = _exit_code(code)
        reason = "Completed" if exit_code == 0 else "Error"
        cs = next((c for c in (pod.get("status") or {}).get("containerStatuses") or []), {})
        started = ((cs.get("state") or {}).get("running") or {}).get("startedAt") or t
        change = {"started": False, "state": {"terminated": {"exitCode": exit_code, "reason": reason,
                                                             "startedAt": started, "finishedAt": t}}}
        status = {"phase": "Failed" if exit_code else "Succeeded",
                  "conditions": [{"type": "Ready", "status": "False", "reason": "PodFailed", "lastTransitionTime": t},
                                 {"type": "ContainersReady", "status": "False", "reason": "PodFailed",
                                  "lastTransitionTime": t}],
                  "containerStatuses": self._container_statuses(p, pod, False, **change)}
        if self._patch_status(p, status):
            self._event("failed", p, phase=status["phase"], exitCode=exit_code)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *_: Any) -> None:
        return None  # the 3xx itself is the answer (a redirect could lead off the pod's IP)


def _probe_ok(spec: dict[str, Any]) -> bool:
    """One httpGet probe: a 2xx/3xx answer within its timeout."""
    # No proxies: the probe dials the pod's loopback IP directly, nothing else.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)
    try:
        with opener.open(spec["url"], timeout=spec["timeout"]) as resp:
            return 200 <= resp.status < 400
    except urllib.error.HTTPError as err:
        err.close()
        return 200 <= err.code < 400
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _gates(pod: dict[str, Any]) -> list[str]:
    """The condition types of the pod's readiness gates."""
    return [g["conditionType"] for g in (pod.get("spec") or {}).get("readinessGates") or [] if g.get("conditionType")]


def _gates_true(pod: dict[str, Any]) -> bool:
    true = {c.get("type") for c in (pod.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}
    return all(g in true for g in _gates(pod))


def _cs(value: bool) -> str:
    return "True" if value else "False"


# The pod cannot be started yet (e.g. its Secret does not exist yet): retried. / The pod will never be
# started by this runtime (network rule, malformed args). One home for both: realpod raises them too.
_NotYet, _Refused = realpod.NotYet, realpod.Refused


def _read_or_not_yet(read: Any, kind: str, namespace: str, name: str) -> Any:
    """An object the pod mounts; missing or unreadable is "not yet" (the operator writes it first)."""
    try:
        return read(name, namespace, _request_timeout=10)
    except ApiException as err:
        why = "not found yet" if err.status == 404 else f"HTTP {err.status} reading it"
        raise _NotYet(f"{kind} {namespace}/{name}: {why}") from None


def _port_free(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of our own last run is fine
        try:
            s.bind((ip, port))
            return True
        except OSError:
            return False


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _readiness(pod: dict[str, Any], pod_ready: bool, containers_ready: bool,
               reset_gates: bool = False) -> list[dict[str, Any]]:
    """Ready and ContainersReady as the kubelet writes them; reset_gates: every readiness gate False
    too (undoing kwok's start-up True: the gates' owner, the operator, sets them)."""
    t = _rfc3339()
    gates = [{"type": g, "status": "False", "reason": "NotSetYet", "lastTransitionTime": t}
             for g in _gates(pod)] if reset_gates else []
    return [{"type": "Ready", "status": _cs(pod_ready), "lastTransitionTime": t},
            {"type": "ContainersReady", "status": _cs(containers_ready), "lastTransitionTime": t}, *gates]


def _exit_code(returncode: int | None) -> int:
    """Popen's returncode as a container exit code: a signal N becomes 128+N (SIGKILL -> 137)."""
    if returncode is None:
        return 0
    return 128 - returncode if returncode < 0 else returncode


def _killpg(pid: int | None, sig: int) -> None:
    if not pid:
        return
    try:
        os.killpg(pid, sig)  # the child leads its own session, so its pgid is its pid
    except ProcessLookupError:
        pass
    except PermissionError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _is_standin(pid: int, argv: list[str] | None) -> bool:
    """Guard against pid reuse: only signal a process whose command line is the one we started."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and [c.decode(errors="replace") for c in cmdline if c] == argv


# ----- command line --------------------------------------------------------------------------------

def _kill_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.standin.runtime kill",
                                 description="SIGKILL a pod's stand-in process (the running runtime applies the "
                                             "restart policy: the head restarts with a new boot id, a replica "
                                             "pod turns Failed).")
    ap.add_argument("target", help="NAMESPACE/POD")
    ap.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR))
    args = ap.parse_args(argv)
    ns, _, pod = args.target.partition("/")
    path = Path(args.state_dir) / "pids" / f"{ns}_{pod}.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        print(f"no stand-in process recorded for {args.target} in {path.parent}", file=sys.stderr)
        return 1
    pid = info["pid"]
    if not _is_standin(pid, info.get("argv")):
        print(f"pid {pid} of {args.target} is not a running stand-in", file=sys.stderr)
        return 1
    _killpg(pid, signal.SIGKILL)
    print(f"[runtime {_now()}] SIGKILL sent to {args.target} pid {pid}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["kill"]:
        return _kill_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m tests.standin.runtime", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--namespace", action="append", default=[],
                    help="watch only this namespace (repeatable; globs like 't-*' allowed); default: all")
    ap.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    ap.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR), help="process logs, pid files, token files")
    ap.add_argument("--no-probes", action="store_true", help="leave readiness to kwok (Ready at once)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the stand-in processes")
    ap.add_argument("--engine-env", metavar="VENV",
                    help="real mode: run each engine pod's own command in this environment (the CPU engine "
                         "environment of hack/real-engine-env.sh) instead of a stand-in")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                    help="real mode: serve DIR where a pod names spec.model NAME (repeatable)")
    ap.add_argument("--head-module", default=HEAD_MODULE, help=argparse.SUPPRESS)     # harness self-tests
    ap.add_argument("--replica-module", default=REPLICA_MODULE, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    image = None
    if args.engine_env:
        models = dict(m.split("=", 1) for m in args.model)
        image = realpod.cpu_engine_image(Path(args.engine_env), {k: Path(v) for k, v in models.items()})
    rt = StandinRuntime(kubeconfig=args.kubeconfig, namespaces=args.namespace, state_dir=args.state_dir,
                        python=args.python, probes=not args.no_probes,
                        head_module=args.head_module, replica_module=args.replica_module, image=image)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    rt.start()
    try:
        while not done.wait(1.0):
            if rt.error:
                print(f"[runtime {_now()}] fatal: {rt.error}", flush=True)
                return 1
    finally:
        rt.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
