"""Shared pieces of the operator's cluster tests and benchmarks (test tooling, never product code).

* OperatorProcess: `omnistage run` from the venv as a subprocess, its log in a file; kill -9 and
  restart it like a crashed Deployment pod would be.
* HeadEndpoint: the engine head's membership endpoint and /metrics, read the way the operator
  reads them: the head pod's IP and the token from the `<name>-membership` Secret. On the local
  control plane pod IPs are loopback and dialled directly; any other IP is never dialled (network
  rule, DESIGN.md section 7): on a real cluster the call goes through `kubectl port-forward`,
  i.e. through the API server the user's KUBECONFIG names.
* Small readers: conditions, engine pods, members of the listing.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omnistage_engine_patches import contract

from tests.support.ports import free_port
from tests.support.status import condition, is_true, pod_ready

from .commands import is_loopback

ROOT = Path(__file__).resolve().parents[2]
GROUP = "serving.omnistage.io"
L_OMNISTAGE = f"{GROUP}/omnistage"
L_COMPONENT = f"{GROUP}/component"
L_ROLE = f"{GROUP}/role"
A_HEAD_UID = f"{GROUP}/head-uid"
MEMBERSHIP_PATH = contract.MEMBERSHIP_PATH

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def _stamp() -> str:
    return time.strftime("%H:%M:%S")


# ----- the operator as a process -------------------------------------------------------------------

def omnistage_command() -> list[str]:
    """`omnistage` from the interpreter's own venv (the console script pip installed)."""
    script = Path(sys.executable).parent / "omnistage"
    return [str(script)] if script.exists() else [sys.executable, "-m", "omnistage"]


# The cluster tier's operators probe their heads every second, not every 5 s: a registration is joined
# up to 4 s sooner in every wait for a replica, and a stand-in head answers a conditional GET in a
# millisecond. The benchmarks keep the operator's default (what they measure is what users run).
TESTS_PROBE_HEADS_EVERY = 1.0


class OperatorProcess:
    """`omnistage run` as users run it outside a cluster: KUBECONFIG in the environment.

    The cluster tier passes the kubeconfig of the operator's own ServiceAccount (conftest.py
    operator_identity) and the Deployment's environment (`env`), so the process has exactly the
    rights and settings the installed operator has."""

    def __init__(self, kubeconfig: str | os.PathLike, log_path: Path, namespaces: list[str] | None = None,
                 metrics_port: int = 0, probe_port: int = 0, env: dict[str, str] | None = None,
                 probe_heads_every: float | None = None, full_pass_every: float | None = None):
        self.kubeconfig = str(kubeconfig)
        self.log_path = Path(log_path)
        self.namespaces = list(namespaces or [])
        self.env = dict(env or {})
        self.probe_heads_every = probe_heads_every  # None: the operator's default
        self.full_pass_every = full_pass_every  # None: the operator's default
        self.metrics_port = metrics_port or free_port()
        self.probe_port = probe_port or free_port()
        self.popen: subprocess.Popen | None = None
        self.starts = 0

    @property
    def argv(self) -> list[str]:
        ns = [a for n in self.namespaces for a in ("--namespace", n)]
        return [*omnistage_command(), "run", *ns, "--metrics-port", str(self.metrics_port),
                "--probe-port", str(self.probe_port),
                *(["--probe-heads-every", str(self.probe_heads_every)] if self.probe_heads_every else []),
                *(["--full-pass-every", str(self.full_pass_every)] if self.full_pass_every else [])]

    def start(self, ready_timeout: float = 60) -> None:
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update(self.env)
        env["KUBECONFIG"] = self.kubeconfig
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as f:
            f.write(f"\n===== [harness {_stamp()}] start #{self.starts}: {' '.join(self.argv)}"
                    f" (KUBECONFIG={self.kubeconfig}, env {sorted(self.env)})\n".encode())
            f.flush()
            self.popen = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        print(f"[operator {_stamp()}] started pid {self.popen.pid} (log {self.log_path}, KUBECONFIG {self.kubeconfig})",
              flush=True)
        # Ready once kopf serves its liveness probe (the handlers are registered by then).
        deadline, report = time.monotonic() + ready_timeout, time.monotonic() + 5
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"the operator exited with {self.popen.returncode} at start-up:\n{self.tail(40)}")
            if http_get(f"http://127.0.0.1:{self.probe_port}/healthz", timeout=1) is not None:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"operator not live after {ready_timeout:.0f}s:\n{self.tail(40)}")
            if time.monotonic() > report:
                print(f"[operator {_stamp()}]   waiting for its liveness probe on :{self.probe_port}", flush=True)
                report = time.monotonic() + 5
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: no finalisers, no graceful shutdown, as when its node dies or it is OOM-killed."""
        if self.alive():
            print(f"[operator {_stamp()}] SIGKILL pid {self.popen.pid}", flush=True)
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self, timeout: float = 20) -> None:
        if not self.alive():
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        print(f"[operator {_stamp()}] stopped (exit {self.popen.returncode})", flush=True)

    def size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def tail(self, lines: int = 200, since: int = 0) -> str:
        if not self.log_path.exists():
            return "(no operator log)"
        with open(self.log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def metrics(self) -> str | None:
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2)

    def readiness(self) -> tuple[int, dict]:
        """/readyz: (HTTP status, body), 503 included (http_get hides non-2xx answers)."""
        try:
            with _OPENER.open(f"http://127.0.0.1:{self.probe_port}/readyz", timeout=2) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    # The API server's wording of an RBAC refusal, as it appears in the log (kopf and the kubernetes
    # client print the Status body, sometimes JSON-escaped). A namespace being deleted answers 403
    # too ("... because it is being terminated"): that is no RBAC refusal and does not match.
    _RBAC_DENIAL = re.compile(r'cannot (\w+) resource \\*"([^"\\]+)\\*" in API group \\*"([^"\\]*)\\*"')

    def rbac_denials(self) -> set[tuple[str, str, str]]:
        """(verb, resource, group) of every request the API server refused for lack of RBAC."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return set(self._RBAC_DENIAL.findall(text))


# ----- HTTP on loopback only -----------------------------------------------------------------------

def http_get(url: str, token: str | None = None, timeout: float = 5) -> str | None:
    """GET on a loopback URL; None when nothing answers 2xx. Refuses any other host."""
    host = urllib.parse.urlparse(url).hostname or ""
    if host != "localhost" and not is_loopback(host):
        raise ValueError(f"refusing to dial {url}: only 127.0.0.0/8 (network rule)")
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None


def http_post(url: str, body: dict[str, Any], token: str, timeout: float = 30) -> dict[str, Any] | None:
    """POST `body` as JSON to a loopback URL; the decoded 2xx answer, None when nothing answers 2xx.
    Refuses any other host."""
    host = urllib.parse.urlparse(url).hostname or ""
    if host != "localhost" and not is_loopback(host):
        raise ValueError(f"refusing to dial {url}: only 127.0.0.0/8 (network rule)")
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def membership_port(obj: dict[str, Any]) -> int:
    """An OmniStage's spec.engine.membershipPort (the CRD defaults it in every stored object)."""
    return int(((obj.get("spec") or {}).get("engine") or {}).get("membershipPort") or contract.DEFAULT_MEMBERSHIP_PORT)


class HeadEndpoint:
    """The head's membership endpoint (its membership port) and /metrics (its public port) for one
    OmniStage, with the master token (the operator's)."""

    def __init__(self, kubectl: Callable[..., Any], namespace: str, name: str, http_port: int = 8000,
                 membership_port: int = contract.DEFAULT_MEMBERSHIP_PORT):
        self.kubectl, self.namespace, self.name, self.http_port = kubectl, namespace, name, http_port
        self.membership_port = membership_port

    def token(self) -> str:
        secret = self.kubectl.json("get", "secret", f"{self.name}-membership", "-n", self.namespace)
        return base64.b64decode(secret["data"]["token"]).decode()

    def pod(self) -> dict[str, Any] | None:
        """The head the Services select (role label `head`: a head change moves it to a successor
        named NAME-head-<hash>), one not terminating first."""
        proc = self.kubectl("get", "pods", "-n", self.namespace, "-o", "json", "-l",
                            f"{L_OMNISTAGE}={self.name},{L_ROLE}=head", check=False)
        if proc.returncode != 0:
            return None
        heads = sorted(json.loads(proc.stdout)["items"], key=lambda p: bool(p["metadata"].get("deletionTimestamp")))
        return heads[0] if heads else None

    def ip(self) -> str | None:
        pod = self.pod()
        return ((pod.get("status") or {}).get("podIP") or None) if pod else None

    @contextlib.contextmanager
    def _base(self, port: int | None = None) -> Iterator[str | None]:
        """The head's `port` (default: its membership port), directly or through a port-forward."""
        port = port or self.membership_port
        ip = self.ip()
        if ip is None:
            yield None
        elif is_loopback(ip):
            yield f"http://{ip}:{port}"
        else:
            with port_forward(self.kubectl, self.namespace, f"pod/{(self.pod() or {}).get('metadata', {}).get('name')}",
                              port) as local:
                yield f"http://127.0.0.1:{local}" if local else None

    def report(self) -> dict[str, Any] | None:
        """GET the engine report (contract.ENGINE_PATH), or None when the head does not answer."""
        with self._base() as base:
            if base is None:
                return None
            try:
                body = http_get(base + contract.ENGINE_PATH, token=self.token(), timeout=5)
            except Exception:  # noqa: BLE001 -- not up yet: "no answer"
                return None
        return json.loads(body) if body else None

    def listing(self, include_all: bool = False) -> dict[str, Any] | None:
        """GET /omnistage/v1/membership, or None when the head does not answer (yet).

        include_all (?all=true) adds pending slots and the replicas that left (state "left", with
        the record of their leave) or that the head dropped by itself."""
        with self._base() as base:
            if base is None:
                return None
            try:
                query = "?all=true" if include_all else ""
                body = http_get(base + MEMBERSHIP_PATH + query, token=self.token(), timeout=5)
            except Exception:  # noqa: BLE001 -- Secret not there yet etc.: "no answer"
                return None
        return json.loads(body) if body else None

    def leave_record(self, replica_id: int, stage: int = 0) -> dict[str, Any] | None:
        """The head's record of a replica's leave, as it answered the operator (drained, inFlightAtDetach,
        waitedSeconds, detached): read by asking for the leave again, which the head answers with the
        record it kept (alreadyLeft) and nothing else. Asked only once the listing shows the replica left
        (a departure is never undone), so the POST is never a leave; None before, or with no answer."""
        if left_at_head(self.listing(include_all=True), replica_id) is None:
            return None
        with self._base() as base:
            if base is None:
                return None
            answer = http_post(base + contract.LEAVE_PATH,
                               {"stage": stage, "replicaId": replica_id, "drainTimeoutSeconds": 0}, self.token())
        assert answer is None or answer.get("alreadyLeft") is True, f"the POST made replica {replica_id} leave: {answer}"
        return answer

    def metrics(self) -> str | None:
        with self._base(self.http_port) as base:
            return http_get(base + "/metrics", timeout=5) if base else None


class PortForward:
    """`kubectl port-forward` to a random local port on 127.0.0.1 (for clusters whose pod IPs are not
    loopback); `port` is None when it did not start within `timeout`."""

    def __init__(self, kubectl: Callable[..., Any], namespace: str, target: str, port: int, timeout: float = 20):
        cmd = [kubectl.binary, f"--kubeconfig={kubectl.kubeconfig}", "port-forward", "-n", namespace,
               "--address", "127.0.0.1", target, f":{port}"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.port: int | None = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", self.proc.stdout.readline() or "")
            if m:
                self.port = int(m.group(1))
                break

    def alive(self) -> bool:
        return self.port is not None and self.proc.poll() is None

    def close(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


@contextlib.contextmanager
def port_forward(kubectl: Callable[..., Any], namespace: str, target: str, port: int,
                 timeout: float = 20) -> Iterator[int | None]:
    forward = PortForward(kubectl, namespace, target, port, timeout)
    try:
        yield forward.port
    finally:
        forward.close()


# ----- readers -------------------------------------------------------------------------------------

def stage0(listing: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list(((listing or {}).get("stages") or {}).get("0") or [])


def serving_at_head(listing: dict[str, Any] | None) -> int | None:
    """The stage-0 engines serving behind a head, from its listing: its own while it lists it live
    (contract.is_live: attached, heartbeats on time; read, never assumed, so a floor of 1 can fail) and
    the replica pods joined at it. None when the head did not answer."""
    if listing is None:
        return None
    own = any(m.get("local") and contract.is_live(m) for m in stage0(listing))
    return int(own) + len([m for m in remote_members(listing) if m.get("pod")])


def remote_members(listing: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Headless replicas the head holds (its own local replica excluded): not left, and not detached
    (the head lists a replica it dropped on its own as detached until the operator's leave)."""
    return [m for m in stage0(listing)
            if not m.get("local") and str(m.get("state", "")).lower() not in ("left", "detached")]


def left_at_head(listing: dict[str, Any] | None, replica_id: int) -> dict[str, Any] | None:
    """The head's record of a `leave` for this replica (from a listing with include_all), if any."""
    return next((m for m in stage0(listing) if m.get("replicaId") == replica_id
                 and str(m.get("state", "")).lower() == "left"), None)


def replica_series(metrics_text: str | None, stage: str = "0") -> set[str]:
    """Replica ids that have a `vllm:*` series labelled with this stage on the head's /metrics."""
    out: set[str] = set()
    for line in (metrics_text or "").splitlines():
        if line.startswith("#") or "replica=" not in line:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("{", 1)[1].split("}", 1)[0])) if "{" in line else {}
        if labels.get("stage", stage) == stage and "replica" in labels:
            out.add(labels["replica"])
    return out


def engine_pods(kubectl: Callable[..., Any], namespace: str, name: str, role: str | None = None,
                include_terminating: bool = False) -> list[dict[str, Any]]:
    sel = f"{L_OMNISTAGE}={name},{L_COMPONENT}=engine" + (f",{L_ROLE}={role}" if role else "")
    items = kubectl.json("get", "pods", "-n", namespace, "-l", sel)["items"]
    return [p for p in items if include_terminating or not p["metadata"].get("deletionTimestamp")]


def service_addresses(kubectl: Callable[..., Any], namespace: str, service: str) -> list[str]:
    """The addresses a Service routes new connections to: its selector's pods that are Ready and not
    terminating (the EndpointSlice controller's rule, applied here because the local cluster's pod
    IPs are loopback addresses, which an EndpointSlice refuses)."""
    selector = kubectl.json("get", "service", service, "-n", namespace)["spec"].get("selector") or {}
    proc = kubectl("get", "pods", "-n", namespace, "-o", "json", "-l",
                   ",".join(f"{k}={v}" for k, v in sorted(selector.items())), check=False)
    if proc.returncode != 0 or not selector:
        return []
    return [p["status"]["podIP"] for p in json.loads(proc.stdout)["items"]
            if not p["metadata"].get("deletionTimestamp") and pod_ready(p) and (p.get("status") or {}).get("podIP")]


def converged(kubectl: Callable[..., Any], namespace: str, name: str, replicas: int, *,
              head: HeadEndpoint | None = None, also: tuple[str, ...] = (),
              say: str | None = None) -> dict[str, Any] | None:
    """The OmniStage if it is Ready (and every condition in `also` True) for its current generation with
    `replicas` engine pods ready and registered, AND its status and the engine agree with the pods that
    exist now: every replica pod Joined at its IP, and the head's own listing (through `head`, by default
    the stage's HeadEndpoint) naming exactly those. A status can still describe pods that were just
    replaced under the same names; "Ready" alone is not enough. `say`: a progress line tagged so
    while the status is not there yet (the GPU tier's waits are minutes long)."""
    proc = kubectl("get", "omnistage", name, "-n", namespace, "-o", "json", check=False)
    if proc.returncode != 0:
        return None
    obj = json.loads(proc.stdout)
    st = obj.get("status") or {}
    # What spec.replicas counts: not a spare head (spec.head.standby), which serves nothing.
    pods = [p for p in engine_pods(kubectl, namespace, name) if p["metadata"]["labels"].get(L_ROLE) != "spare-head"]
    if not (all(is_true(obj, ctype) for ctype in ("Ready", *also))
            and st.get("observedGeneration") == obj["metadata"]["generation"]
            and st.get("registeredReplicas") == replicas and st.get("replicas") == replicas
            and len(pods) == replicas and all(pod_ready(p) for p in pods)):
        if say:
            print(f"[{say}]   {name}: " + " ".join(f"{c}={condition(obj, c).get('reason')}" for c in ("Ready", *also))
                  + f" ready {st.get('readyReplicas')}/{replicas} registered {st.get('registeredReplicas')}",
                  flush=True)
        return None
    now = {p["metadata"]["name"]: (p.get("status") or {}).get("podIP") for p in pods
           if p["metadata"]["labels"].get(L_ROLE) == "replica"}
    members = {m.get("pod"): (m.get("replicaId"), m.get("ip")) for m in st.get("members") or []}
    if set(members) != set(now) or any(members[pod][1] != ip for pod, ip in now.items()) or \
            any(m.get("state") != "Joined" for m in st.get("members") or []):
        return None
    listing = (head or HeadEndpoint(kubectl, namespace, name)).listing()
    at_head = {m.get("pod"): (m.get("replicaId"), m.get("host")) for m in remote_members(listing)}
    return obj if listing is not None and at_head == members else None
