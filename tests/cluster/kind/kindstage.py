"""The kind tier's OmniStage: the real-engine tier's RealOmniStage, read through the API server and
`kubectl port-forward` only (no runtime of ours: the kubelets run the pods), and the manifest that
runs the tiny model on the kind workers' CPU engine image (hack/kind/images.py); the chart and the
values the tier installs it with."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistage_engine_patches import contract

from tests.cluster.real.realstage import CPU_VENV, RealOmniStage, tiny_omnistage
from tests.cpu_engine import client
from tests.standin.harness import PortForward
from tests.support import stream as support_stream
from tests.support.stream import Stream

ENGINE_IMAGE = "omnistage-local/omnistage-engine-cpu:dev"     # hack/kind/images.py
OPERATOR_IMAGE = "omnistage-local/omnistage-operator:dev"
ENGINE_VENV = "/opt/omnistage-engine"                         # hack/kind/up.sh mounts it into the workers
# The models on the workers (hack/kind/up.sh mounts them there from the host's cache).
MODEL_DIR = "/opt/omnistage-models/tiny-omni"
SPEECH_MODEL_DIR = "/opt/omnistage-models/tiny-qwen3-omni"
DOCKER = "/usr/bin/docker"                                   # the kind nodes are its containers
ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "omnistage-operator"
RELEASE, OPERATOR_NS = "omnistage-operator", "omnistage-system"
HEAD_READY_TIMEOUT = 25 * 60


def python_prefix() -> str:
    """The interpreter prefix of the host's CPU venv: up.sh mounts it into the workers at the same path
    (the venv's bin/python links to it)."""
    cfg = (CPU_VENV / "pyvenv.cfg").read_text().splitlines()
    home = next(line.split("=", 1)[1].strip() for line in cfg if line.startswith("home"))
    return str(Path(home).parent)


def helm_values() -> list[str]:
    """The chart's values for this tier. allowedHostPaths: the node directories kind_omnistage mounts
    (the engine venv and its interpreter, the models), which the operator refuses unless its
    administrator allows them (docs/security.md)."""
    repo, tag = OPERATOR_IMAGE.rsplit(":", 1)
    allowed = f"{ENGINE_VENV},{python_prefix()},{MODEL_DIR},{SPEECH_MODEL_DIR}"
    return ["--set", f"image.repository={repo}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
            "--set", f"engineImage={ENGINE_IMAGE}", "--set", "replicaCount=2",
            "--set", f"allowedHostPaths={{{allowed}}}"]


def kind_omnistage(name: str, replicas: int) -> dict[str, Any]:
    """tests/cpu_engine/omnistage.yaml for the kind workers (on_kind)."""
    return on_kind(tiny_omnistage(name, replicas), MODEL_DIR)


def on_kind(m: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """An OmniStage for the kind workers: the CPU engine image (pulled never: it was `kind load`ed),
    the model from the node's `model_dir` (spec.modelVolume), the venv and its interpreter mounted
    from the node, and requests a 2-core node can grant (the operator's defaults are per H200).
    Its OmniStagePools' pods take all of these from it (a pool has no image, volume or template)."""
    spec = m["spec"]
    spec["model"] = "/models"
    spec["modelVolume"] = {"mountPath": "/models", "hostPath": {"path": model_dir}}
    spec["engine"].update(image=ENGINE_IMAGE, imagePullPolicy="Never")
    spec["template"] = {"spec": {
        "containers": [{"name": "engine",
                        "resources": {"requests": {"cpu": "100m", "memory": "1Gi"}},
                        "volumeMounts": [{"name": "engine-venv", "mountPath": ENGINE_VENV, "readOnly": True},
                                         {"name": "engine-python", "mountPath": python_prefix(), "readOnly": True}]}],
        "volumes": [{"name": "engine-venv", "hostPath": {"path": ENGINE_VENV, "type": "Directory"}},
                    {"name": "engine-python", "hostPath": {"path": python_prefix(), "type": "Directory"}}]}}
    return m


SELECT_SECONDS = 2.0


@dataclass
class KindOmniStage(RealOmniStage):
    """RealOmniStage with the kubelet as the runtime: requests go to the head the Service NAME selects
    (a Ready pod of its selector, as a proxy picks one per new connection) through a port-forward per
    head pod, engine logs from `kubectl logs`."""

    # Head pod uid -> its forward. A forward to a head that stopped being selected stays open while it
    # lives, so the requests in flight through it (a head change's old head) are not cut off by the test.
    _forwards: dict[str, PortForward] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _chosen: tuple[float, str] | None = field(default=None, repr=False)  # (when, head pod uid) of the last choice
    # Head pod uid -> (its name, the forward to its membership port): the head's own listing.
    _membership: dict[str, tuple[str, PortForward | None]] = field(default_factory=dict, repr=False)

    def head_name(self) -> str:
        """The head the Services select (NAME-head, or NAME-head-<hash> after a head change)."""
        pod = self.head.pod()
        assert pod is not None, f"no head pod of {self.name}"
        return pod["metadata"]["name"]

    def get(self) -> dict[str, Any]:
        # A head container that exits before it ever was Ready rejected what was rendered: fail now.
        head = self.head.pod()
        for cs in (head or {}).get("status", {}).get("containerStatuses") or []:
            term = (cs.get("lastState") or {}).get("terminated") or {}
            if term.get("exitCode") and not cs.get("ready") and cs.get("restartCount", 0) >= 2:
                name = head["metadata"]["name"]
                raise AssertionError(f"{name} keeps exiting ({term.get('exitCode')}, "
                                     f"{term.get('reason')}):\n{self.logs(name, previous=True)}")
        return self.kubectl.json("get", "omnistage", self.name, "-n", self.namespace)

    def base(self) -> str:
        """http://127.0.0.1:PORT forwarded to a head pod the Service selects (Ready, not terminating;
        the current head pod when none is Ready): a new forward for a new pod or a dead forward.
        The choice is read again after SELECT_SECONDS (about as long as a Service's endpoints take to
        reach the proxies), not per request: a kubectl per request loads a 2-core machine."""
        with self._lock:
            chosen = self._chosen
            if chosen and time.monotonic() - chosen[0] < SELECT_SECONDS and chosen[1] in self._forwards \
                    and self._forwards[chosen[1]].alive():
                return f"http://127.0.0.1:{self._forwards[chosen[1]].port}"
        selected = [p for p in self.kubectl.json("get", "pods", "-n", self.namespace, "-l",
                                                 f"serving.omnistage.io/omnistage={self.name},"
                                                 "serving.omnistage.io/role=head")["items"]
                    if not p["metadata"].get("deletionTimestamp")]
        selected.sort(key=lambda p: not any(c["type"] == "Ready" and c["status"] == "True"
                                            for c in p.get("status", {}).get("conditions") or []))
        assert selected, f"no head pod of {self.name}"
        uid, name = selected[0]["metadata"]["uid"], selected[0]["metadata"]["name"]
        with self._lock:
            for old in [u for u, f in self._forwards.items() if not f.alive()]:
                self._forwards.pop(old).close()
            self._membership.setdefault(uid, (name, None))
            if uid not in self._forwards:
                forward = PortForward(self.kubectl, self.namespace, f"pod/{name}", 8000)
                assert forward.port, f"kubectl port-forward to {name} did not start"
                self._forwards[uid] = forward
            self._chosen = (time.monotonic(), uid)
            return f"http://127.0.0.1:{self._forwards[uid].port}"

    def service_base(self) -> str:
        return self.base()

    def membership_base(self) -> str:
        """http://127.0.0.1:PORT forwarded to the membership port of the head base() chose (the
        listing is not on the OpenAI port: contract.MEMBERSHIP_PORT_NAME)."""
        self.base()
        with self._lock:
            uid = self._chosen[1]
            name, forward = self._membership[uid]
            if forward is None or not forward.alive():
                forward = PortForward(self.kubectl, self.namespace, f"pod/{name}", contract.DEFAULT_MEMBERSHIP_PORT)
                assert forward.port, f"kubectl port-forward to {name}'s membership port did not start"
                self._membership[uid] = (name, forward)
            return f"http://127.0.0.1:{forward.port}"

    def close_forward(self) -> None:
        with self._lock:
            for f in [*self._forwards.values(), *(f for _, f in self._membership.values() if f is not None)]:
                f.close()
            self._forwards.clear()
            self._membership.clear()

    def logs(self, pod: str, previous: bool = False) -> str:
        args = ["logs", pod, "-n", self.namespace, "-c", "engine", "--tail=60"] + (["--previous"] if previous else [])
        return self.kubectl(*args, check=False).stdout

    def engine_logs(self, role: str | None = None) -> dict[str, str]:
        sel = f"serving.omnistage.io/omnistage={self.name}" + (f",serving.omnistage.io/role={role}" if role else "")
        pods = self.kubectl.json("get", "pods", "-n", self.namespace, "-l", sel)["items"]
        return {p["metadata"]["name"]: self.logs(p["metadata"]["name"]) for p in pods}

    def pod(self, name: str) -> dict[str, Any]:
        return self.kubectl.json("get", "pod", name, "-n", self.namespace)

    def exec(self, pod: str, *cmd: str) -> str:
        return self.kubectl("exec", pod, "-n", self.namespace, "-c", "engine", "--", *cmd).stdout


@contextlib.contextmanager
def stream(stage: KindOmniStage, requests: int, concurrency: int = 2, seconds: float = 600,
           max_tokens: int = 32) -> Iterator[Stream]:
    """A bounded stream of requests (tests/support/stream.py) through the head the Service selects while
    the body runs; on exit, a moment more of it, then no new request and a wait for those in flight (each
    bounded by its client timeout). The stream's results and lost requests: the yielded Stream's."""
    model = client.served_model(stage.base())
    # stage.base, asked per request: the head the Service selects now (a head change moves it).
    s = Stream(stage.base, support_stream.requests(model, seed0=70, max_tokens=max_tokens, limit=requests),
               concurrency, seconds=seconds).start()
    try:
        yield s
    finally:
        time.sleep(3)  # requests keep coming a moment after the body: they meet what it left
        s.stop()


def sh(*cmd: str) -> str:
    return subprocess.run(list(cmd), check=True, capture_output=True, text=True).stdout
