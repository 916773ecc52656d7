"""The stand-in runtime's kubelet: it watches the engine pods kwok runs (labelled
serving.omnistage.io/component in (engine, pool)) and, every TICK, stops the processes of pods that
are gone, replaced or terminating, applies the restart policy to those that exited, starts the
running pods that have none, and probes. A pod is held back (NotReady, not started) while the pod IP
it got, or its head's address, is still held by a stopping process: kwok hands a deleted pod's IP to
its successor at once, which a kubelet's CNI would not. runtime.py's docstring says what it does and
why; the parts it mixes in: podwatch.py (the watch), containers.py (the argv), lifecycle.py (processes), podstatus.py (status).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlparse

from kubernetes import client, config

from tests.standin import cluster_dns, zygote
from tests.standin.commands import (
    HEAD_MODULE,
    HEAD_ROLES,
    L_OMNISTAGE,
    L_POOL,
    L_ROLE,
    REPLICA_MODULE,
    ROLE_STANDBY,
    ROOT,
    _arg,
    _base_env,
    _engine_container,
    _expand,
    _NotYet,
    _Refused,
    is_loopback,
)
from tests.standin.containers import Containers
from tests.standin.lifecycle import Lifecycle
from tests.standin.podstatus import PodStatus
from tests.standin.podwatch import PodWatch
from tests.standin.processes import (
    FORCED_GRACE,
    REAL_GRACE_CAP,
    STOP_TIMEOUT,
    Proc,
    _killpg,
    _now,
    container_marker,
    kill_container,
)
from tests.standin.realpod import EngineImage

DEFAULT_STATE_DIR = Path(os.environ.get("OMNISTAGE_STANDIN_DIR", "/tmp/omnistage-standin"))
TICK = 0.2                  # supervisor period: process exits, pending starts, probes
START_RETRY = 2.0           # a pod that could not be started yet (no Secret yet) is retried this often


def warm_fork_server(log_path: str | os.PathLike, python: str = sys.executable) -> zygote.Zygote | None:
    """Start the stand-ins' fork server now, in the background, for the runtimes this process starts
    later (zygote.shared: the one they get). Its imports take 27-31 s of one core; started by the first
    runtime instead, that runtime's first OmniStage's pods start plain meanwhile (28 s each to Ready)."""
    if not zygote.enabled():
        return None
    return zygote.shared(python, _base_env(), str(ROOT), log_path)


class StandinRuntime(PodWatch, Containers, Lifecycle, PodStatus):
    """Watches engine pods and runs a stand-in process per running pod. Thread-based; see runtime.py."""

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
        self.force_deleted: set[str] = set()  # pod uids deleted with grace 0 (podwatch.py)
        self._dns: dict[str, str] = {}  # the master Service names this runtime wrote (cluster_dns.py)

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

    def _sync_dns(self, entries: dict[str, str]) -> None:
        if entries != self._dns:
            if not cluster_dns.write(entries, f"r{id(self):x}"):
                self.log(f"cannot write {cluster_dns.HOSTS}: master Service names do not resolve")
            self._dns = entries

    def stop(self) -> None:
        self._stop.set()
        if self._dns:
            cluster_dns.write({}, f"r{id(self):x}")
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
        if self.image is not None:  # real engines resolve their master Service's name (cluster_dns.py)
            self._sync_dns(cluster_dns.names(pods, L_OMNISTAGE, L_ROLE, HEAD_ROLES[0]))
        # 1. processes whose pod is gone, terminating or replaced (new UID) -> stop
        for key, p in procs.items():
            pod = pods.get(key)
            reason = None
            # Force-deleted first: the pod's successor of the same name (new UID) may already be in the
            # store, and a kubelet gives the old one the forced minimum either way.
            if (pod is None or pod["metadata"]["uid"] != p.uid) and p.uid in self.force_deleted:
                reason = "pod force-deleted"
                p.grace = p.pre_stop_grace = FORCED_GRACE  # the hook and SIGTERM share the kubelet's minimum
            elif pod is None:
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
            # A container dies whole: what its main process started goes with it, before any
            # restart (a surviving engine core would keep the head's ports: Address already in use).
            if left := kill_container(p.pid, container_marker(p)):
                self._event("kill", p, reason="processes_left_after_the_leader", signal="SIGKILL", count=left)
            self._on_exit(p, pods.get(key), code)
        # 3. restarts that are due
        for key, p in procs.items():
            if p.restart_at is not None and now >= p.restart_at and not p.stopping:
                pod = pods.get(key)
                if pod is None or pod["metadata"]["uid"] != p.uid:
                    continue
                if kill_container(p.pid, container_marker(p)):
                    continue  # the old run's processes are still dying: restart when none is left
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
        # A head change's second head (next-head, old-head) is a head, and a standby a replica (a pool's
        # standby a pool pod): the label picks the Services and the disruption budget, not the process.
        role = labels.get(L_ROLE, "")
        standby_of = "pool" if labels.get(L_POOL) else "replica"
        role = "head" if role in HEAD_ROLES else standby_of if role == ROLE_STANDBY else role
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


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")
