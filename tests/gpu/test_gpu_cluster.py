"""Tier 4: the operator, installed in a real GPU cluster from manifests/, drives OmniStages on real GPUs.

`make test-gpu` (docs/gpu-tests.md); skipped unless a GPU cluster is configured. What a user would
check by hand, in order: the operator runs in the cluster under its own ServiceAccount; an OmniStage
becomes Ready only with the cache guarantee proven on the live engine; the operator's metrics say so;
kubectl scale joins a replica (its vllm:* series appear before it served anything) and a scale-down
drains it and removes its series; and the serving reproduction (hack/gpu-repro.py) passes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from omnistage.control.engine_truth import required_patches
from omnistage_engine_patches import contract

from tests.standin.harness import left_at_head
from tests.support.status import condition, pod_ready

from .checks import head, operator_leader, stage_converged, wait_gpu
from .support import ENGINE_IMAGE_ENV, OPERATOR_CONTAINER, OPERATOR_NAME, ROOT, allocatable_gpus, gpus_needed

# No pytest-timeout limit (the project's default is 600 s, less than one model load): every wait in
# this tier is bounded by OMNISTAGE_GPU_READY_TIMEOUT instead.
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(0)]

# status.effectiveCacheMode -> the mode the engine report must name for the stage-0 frontend.
FRONTEND_MODE = {"processor-only": "processor-only", "lru": "lru", "shm": "shm", "disabled": "none",
                 "not-applicable": "none"}


def _series(metrics: str | None) -> set[str]:
    """Stage-0 replica ids with a vllm:* series on the head's /metrics (the frontend cache's excluded)."""
    out = set()
    for line in (metrics or "").splitlines():
        if line.startswith("vllm:") and "{" in line:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("{", 1)[1].split("}", 1)[0]))
            if labels.get("stage") == "0" and labels.get("replica") not in (None, "frontend"):
                out.add(labels["replica"])
    return out


def _value(lines: list[str], metric: str, **labels: str) -> float | None:
    """The sample of `metric` with these labels in Prometheus text lines, or None."""
    for line in lines:
        if line.startswith(metric + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_operator_runs_in_the_cluster_from_the_install_manifests(kubectl, operator_in_cluster, settings):
    op = operator_in_cluster
    want = kubectl.json("get", "deployment", op.name, "-n", op.namespace)["spec"]["replicas"]
    pods = kubectl.json("get", "pods", "-n", op.namespace, "-l", f"app.kubernetes.io/name={OPERATOR_NAME}")["items"]
    running = [p for p in pods if pod_ready(p) and not p["metadata"].get("deletionTimestamp")]
    # Every replica Ready (the follower answers its probes too, by design), exactly one of them leading.
    assert len(running) == want, f"expected {want} Ready operator pods, found {[p['metadata']['name'] for p in pods]}"
    names = {p["metadata"]["name"] for p in running}

    def leader_among_them() -> str | None:
        holder = operator_leader(kubectl, op.namespace)
        return holder if holder in names else None

    leading = wait_gpu("an operator pod holding the Lease", leader_among_them, timeout=120, interval=5)
    print(f"[gpu] operator pods {sorted(names)}, leader {leading}")
    for pod in running:
        assert pod["spec"]["serviceAccountName"] == OPERATOR_NAME
        container = next(c for c in pod["spec"]["containers"] if c["name"] == OPERATOR_CONTAINER)
        if op.installed:
            assert container["image"] == op.image
            if settings.engine_image:
                env = {e["name"]: e.get("value") for e in container.get("env") or []}
                assert env.get(ENGINE_IMAGE_ENV) == settings.engine_image


def test_ready_with_the_cache_guarantee_proven_on_the_live_engine(kubectl, gpu_omnistage, settings):
    stage = gpu_omnistage
    obj = stage_converged(kubectl, stage, stage.replicas)
    assert obj is not None, "the OmniStage is not converged"
    st = obj["status"]
    cache = condition(obj, "CacheConsistent")
    assert cache["status"] == "True" and cache["reason"] == "Consistent", cache
    mode, engine = st["effectiveCacheMode"], st["engine"]
    assert engine["frontendCacheMode"] == FRONTEND_MODE[mode], engine
    distributed = stage.replicas > 1 or obj["spec"].get("membership", "dynamic") == "dynamic"
    for patch in required_patches(mode, distributed):
        assert engine["patches"].get(patch) in contract.EFFECTIVE_OUTCOMES, (patch, engine["patches"])
    report = head(kubectl, stage).report()
    assert report is not None, "the head's engine report did not answer through the port-forward"
    assert report["bootId"] == engine["bootId"] == st["head"]["bootId"]
    assert (report["frontendCache"] or {}).get("mode") == FRONTEND_MODE[mode]
    head_pod = kubectl.json("get", "pod", st["head"]["pod"], "-n", stage.namespace)
    image = next(c["image"] for c in head_pod["spec"]["containers"] if c["name"] == "engine")
    if settings.engine_image and stage.created:
        # install: the operator's default (OMNISTAGE_ENGINE_IMAGE); existing: written into the spec.
        assert image == settings.engine_image
    print(f"[gpu] head {st['head']['pod']} runs {image}: vllm {engine.get('vllmVersion')}, vllm-omni "
          f"{engine.get('vllmOmniVersion')}, plugin {engine.get('pluginVersion')}, frontend "
          f"{engine.get('frontendCacheClass')}, patches {engine['patches']}")


def test_operator_metrics_report_the_engine(kubectl, operator_in_cluster, gpu_omnistage):
    op, stage = operator_in_cluster, gpu_omnistage
    dep = kubectl.json("get", "deployment", op.name, "-n", op.namespace)
    ports = {p.get("name"): p["containerPort"] for c in dep["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports") or []}
    # The leader's: the follower reconciles nothing, so it exports no OmniStage series.
    leading = operator_leader(kubectl, op.namespace)
    assert leading, "no operator pod holds the Lease"
    # Through the API server's pod proxy: the operator binds its pod's IP, which a port-forward (the pod's
    # loopback) does not reach (docs/security.md).
    proxy = f"/api/v1/namespaces/{op.namespace}/pods/{leading}:{ports['metrics']}/proxy/metrics"
    text = kubectl("get", "--raw", proxy, check=False).stdout
    assert text, "the operator's /metrics did not answer"
    mine = [line for line in text.splitlines() if f'name="{stage.name}"' in line
            and f'namespace="{stage.namespace}"' in line]
    assert _value(mine, "omnistage_condition", type="CacheConsistent", status="True") == 1.0, mine
    assert _value(mine, "omnistage_condition", type="Ready", status="True") == 1.0, mine
    assert _value(mine, "omnistage_replicas", state="registered") == stage.replicas, mine
    outcomes = {o for o in contract.OUTCOMES
                if _value(mine, "omnistage_engine_patch", patch=contract.FRONTEND_CACHE, outcome=o) == 1.0}
    assert len(outcomes) == 1, mine


def test_scale_up_joins_a_replica_and_scale_down_drains_it(kubectl, gpu_omnistage, settings):
    stage = gpu_omnistage
    obj = kubectl.json("get", "omnistage", stage.name, "-n", stage.namespace)
    nodes = kubectl.json("get", "nodes", "-l", f"{settings.product_label}={settings.product}")["items"]
    if allocatable_gpus(nodes, settings.resource) < gpus_needed(obj, stage.replicas + 1):
        pytest.skip(f"{stage.replicas + 1} engine pods need {gpus_needed(obj, stage.replicas + 1)} "
                    f"{settings.resource}; the cluster has fewer")
    hd = head(kubectl, stage)
    before = {m["pod"] for m in obj["status"].get("members") or []}
    series_before = _series(hd.metrics())
    up = stage.replicas + 1
    kubectl("scale", "omnistage", stage.name, "-n", stage.namespace, f"--replicas={up}")
    try:
        grown = wait_gpu(f"{stage.name} at {up} replicas", lambda: stage_converged(kubectl, stage, up),
                         settings.ready_timeout)
        new = [m for m in grown["status"]["members"] if m["pod"] not in before]
        assert len(new) == 1 and new[0]["state"] == "Joined", grown["status"]["members"]
        rid = str(new[0]["replicaId"])
        joined_series = _series(hd.metrics())
        assert rid in joined_series and rid not in series_before, (rid, series_before, joined_series)
    finally:
        kubectl("scale", "omnistage", stage.name, "-n", stage.namespace, f"--replicas={stage.replicas}")
    wait_gpu(f"{stage.name} back at {stage.replicas} replicas", lambda: stage_converged(kubectl, stage, stage.replicas),
             settings.ready_timeout)
    # The victim is the newest replica, the one that joined: told to leave and drained before deletion.
    assert left_at_head(hd.listing(include_all=True), int(rid)) is not None
    assert rid not in _series(hd.metrics())
    events = kubectl.json("get", "events", "-n", stage.namespace, "--field-selector",
                          f"involvedObject.name={stage.name}")["items"]
    reasons = {e.get("reason") for e in events}
    assert {"ScaledUp", "Joined", "ScaledDown"} <= reasons and reasons & {"Left", "DrainTimeout"}, reasons


def test_serving_reproduction(kubectl, gpu_omnistage, settings):
    stage = gpu_omnistage
    env = {**os.environ, "KUBECONFIG": str(kubectl.kubeconfig), "OMNISTAGE_KUBECTL": kubectl.binary}
    proc = subprocess.run([sys.executable, str(ROOT / "hack" / "gpu-repro.py"), "--namespace", stage.namespace,
                           "--name", stage.name, "--ready-timeout", str(settings.ready_timeout)],
                          capture_output=True, text=True, timeout=6 * settings.ready_timeout + 3600, env=env,
                          check=False)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # The script puts spec.replicas back to what it found.
    assert kubectl.json("get", "omnistage", stage.name, "-n", stage.namespace)["spec"]["replicas"] == stage.replicas
