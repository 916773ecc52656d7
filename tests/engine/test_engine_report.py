"""The engine report and the cache the engine really builds, for every cache mode x membership.

What runs: the operator's real rendering (spec -> effective cache mode, the deploy config's
stage-0 cache keys, the head's OMNISTAGE_FRONTEND_CACHE), then vllm-omni's real
`OmniEngineBase._initialize_stages` -> `build_stage0_input_processor` -> vLLM renderer and cache on
a tiny weightless Qwen2-VL / Qwen2 checkpoint (stand-ins: the stage runtime and the replicas'
head-side clients, see tests/support/engine_stack.py), then the plugin's real report read from
that live renderer, then the operator's real CacheConsistent rule on that report.

Tests marked "regression" fail with the frontend patch off:
    OMNISTAGE_DISABLE_PATCHES=frontend_cache pytest tests/engine/test_engine_report.py
(the report then names vLLM's sender cache where the OmniStage promises processor-only); the
`replica-aware` rows also fail with OMNISTAGE_DISABLE_PATCHES=replica_aware_cache (the report then
says processor-only, and CacheConsistent is False).
"""

from __future__ import annotations

from importlib import metadata

import pytest

pytest.importorskip(
    "vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)", exc_type=ImportError
)

import yaml
from omnistage.control import engine_truth
from omnistage.render import target_from
from omnistage.render.config import CONFIG_KEY, render_configmap
from omnistage.render.pods import render_head_pod
from omnistage_engine_patches import _patching, contract, report
from vllm.multimodal.registry import MultiModalRegistry


def rendered(spec: dict) -> tuple[object, dict, dict[str, str]]:
    """The operator's view: (target, stage-0 deploy-config keys, head pod env)."""
    obj = {"metadata": {"name": "t", "namespace": "ns", "uid": "u"},
           "spec": {"model": "tiny", "gpu": {"count": 1}, **spec}}
    t = target_from(obj)
    stage0 = yaml.safe_load(render_configmap(t)["data"][CONFIG_KEY])["stages"][0]
    env = {e["name"]: e.get("value") for e in render_head_pod(t)["spec"]["containers"][0]["env"]}
    return t, stage0, env


def build_head(build_stage0_engine, make_vllm_config, monkeypatch, spec: dict):
    """The head the operator would start for `spec`, built by vllm-omni's real stage initialisation."""
    t, stage0, env = rendered(spec)
    kind = "text" if spec.get("modelKind") == "text-only" else "multimodal"
    cache_keys = {k: stage0[k] for k in ("mm_processor_cache_gb", "mm_processor_cache_type") if k in stage0}
    monkeypatch.setenv(contract.FRONTEND_CACHE_ENV, env[contract.FRONTEND_CACHE_ENV])
    # The deploy config gives stage 0 one replica (the head's own); headless replicas join later.
    engine = build_stage0_engine(make_vllm_config(kind, **cache_keys), replicas=stage0["num_replicas"],
                                 distributed=t.distributed)
    return t, engine


PO, SENDER, SHM, NONE = ("MultiModalProcessorOnlyCache", "MultiModalProcessorSenderCache",
                         "ShmObjectStoreSenderCache", None)

# spec -> (effective cache mode, distributed, the class the engine must build)
TABLE = [
    pytest.param({"membership": "static", "replicas": 1}, "lru", False, SENDER, id="unchanged-auto-static-1"),
    pytest.param({"membership": "static", "replicas": 1, "cache": {"mode": "lru"}}, "lru", False, SENDER,
                 id="unchanged-lru-static-1"),
    pytest.param({"membership": "static", "replicas": 1, "cache": {"mode": "shm"}}, "shm", False, SHM,
                 id="unchanged-shm-static-1"),
    pytest.param({"membership": "static", "replicas": 1, "cache": {"mode": "processor-only"}}, "processor-only",
                 False, PO, id="regression-processor-only-static-1"),
    pytest.param({"membership": "static", "replicas": 1, "cache": {"mode": "disabled"}}, "disabled", False, NONE,
                 id="unchanged-disabled-static-1"),
    pytest.param({"membership": "static", "replicas": 2}, "processor-only", True, PO, id="regression-auto-static-2"),
    pytest.param({"membership": "dynamic", "replicas": 1}, "processor-only", True, PO,
                 id="regression-auto-dynamic-1"),
    pytest.param({"membership": "dynamic", "replicas": 3, "cache": {"mode": "processor-only"}}, "processor-only",
                 True, PO, id="regression-processor-only-dynamic-3"),
    pytest.param({"membership": "dynamic", "replicas": 2, "cache": {"mode": "disabled"}}, "disabled", True, NONE,
                 id="unchanged-disabled-dynamic-2"),
    pytest.param({"membership": "dynamic", "replicas": 2, "cache": {"mode": "auto", "sizeGiB": 0}}, "disabled",
                 True, NONE, id="unchanged-size-0-dynamic-2"),
    pytest.param({"membership": "dynamic", "replicas": 2, "modelKind": "text-only"}, "not-applicable", True, NONE,
                 id="unchanged-text-only-dynamic-2"),
    pytest.param({"membership": "static", "replicas": 1, "modelKind": "text-only"}, "not-applicable", False, NONE,
                 id="unchanged-text-only-static-1"),
    # replica-aware: the processor-only frontend plus the per-replica dispatch; the report says
    # replica-aware only while the dispatch is live (with the patch off: processor-only, a mismatch).
    pytest.param({"membership": "dynamic", "replicas": 2, "cache": {"mode": "replica-aware"}}, "replica-aware", True,
                 PO, id="regression-replica-aware-dynamic-2"),
    pytest.param({"membership": "dynamic", "replicas": 1, "cache": {"mode": "replica-aware"}}, "replica-aware", True,
                 PO, id="regression-replica-aware-dynamic-1"),
    pytest.param({"membership": "static", "replicas": 1, "cache": {"mode": "replica-aware"}}, "replica-aware", False,
                 PO, id="regression-replica-aware-static-1"),
    pytest.param({"membership": "dynamic", "replicas": 2, "cache": {"mode": "replica-aware", "sizeGiB": 0}},
                 "disabled", True, NONE, id="unchanged-replica-aware-size-0-dynamic-2"),
    pytest.param({"membership": "dynamic", "replicas": 2, "modelKind": "text-only", "cache": {"mode": "replica-aware"}},
                 "not-applicable", True, NONE, id="unchanged-replica-aware-text-only-dynamic-2"),
]


@pytest.mark.parametrize(("spec", "effective", "distributed", "built"), TABLE)
def test_cache_mode_x_membership_builds_what_the_status_says(
    build_stage0_engine, make_vllm_config, monkeypatch, spec, effective, distributed, built
):
    t, engine = build_head(build_stage0_engine, make_vllm_config, monkeypatch, spec)
    assert (str(t.cache.mode), t.distributed) == (effective, distributed)  # the operator's decision
    live = engine.input_processor.renderer.mm_processor_cache
    assert (type(live).__name__ if live is not None else None) == built
    r = report.build(engine)
    assert r["frontendCache"]["cacheClass"] == built  # the report reads the live renderer
    assert r["frontendCache"]["requested"] == effective
    assert r["frontendCache"]["mode"] == (effective if built else contract.CACHE_NONE)
    verdict = engine_truth.check(effective, distributed, r)
    assert verdict.consistent, verdict.message


def test_report_names_what_the_process_runs(build_stage0_engine, make_vllm_config):
    import vllm

    engine = build_stage0_engine(make_vllm_config("multimodal"), replicas=1, distributed=True)
    r = report.build(engine)
    assert r["bootId"] == report.BOOT_ID
    assert r["vllmVersion"] == vllm.__version__ == "0.30.0"
    assert r["vllmOmniVersion"] == metadata.version("vllm-omni") == "0.30.0"
    assert r["pluginVersion"] == metadata.version("omnistage-engine-patches")
    assert r["distributed"] is True
    assert set(r["patches"]) == set(contract.PATCHES)
    for name, outcome in r["patches"].items():
        assert outcome["outcome"] == _patching.outcomes()[name].outcome
        assert outcome["outcome"] in contract.OUTCOMES and outcome["reason"]


def test_report_of_a_distributed_head_names_the_processor_only_cache(build_stage0_engine, make_vllm_config):
    """regression: the negative control. With the frontend patch off the live renderer holds
    vLLM's sender cache and the report says so (the operator then holds Ready=False)."""
    engine = build_stage0_engine(make_vllm_config("multimodal"), replicas=2, distributed=True)
    r = report.build(engine)
    # With the patch off this fails with cacheClass MultiModalProcessorSenderCache, mode lru.
    assert r["frontendCache"] == {"cacheClass": PO, "mode": "processor-only", "requested": None}
    assert report.frontend_cache_unsafe(engine) is None


def test_a_wrapper_that_never_ran_for_stage_0_reports_skipped(build_stage0_engine, make_vllm_config, monkeypatch):
    """An upstream that builds the frontend without handing stage 0's config object to
    processor_cache_from_config (e.g. it copies the config) leaves the sender cache in place.
    The patch must then say skipped, not applied, and the report must name the sender cache."""
    import inspect

    if not _patching.applied(contract.FRONTEND_CACHE):
        pytest.skip("the frontend patch is not applied in this process")
    ctor = MultiModalRegistry.__dict__["processor_cache_from_config"]
    monkeypatch.setattr(MultiModalRegistry, "processor_cache_from_config", inspect.unwrap(ctor))
    monkeypatch.setattr(_patching, "_outcomes", dict(_patching._outcomes))  # the demotion stays in this test
    engine = build_stage0_engine(make_vllm_config("multimodal"), replicas=2, distributed=True)
    r = report.build(engine)
    assert r["frontendCache"]["cacheClass"] == SENDER
    assert r["patches"][contract.FRONTEND_CACHE]["outcome"] == contract.SKIPPED
    assert "processor_cache_from_config" in r["patches"][contract.FRONTEND_CACHE]["reason"]
    verdict = engine_truth.check("processor-only", True, r)
    assert verdict.reason == "PatchNotApplied" and not verdict.consistent


def test_text_only_head_is_not_demoted(build_stage0_engine, make_vllm_config, monkeypatch):
    """A text-only renderer builds no multimodal processor, so the wrapper is not expected to run."""
    monkeypatch.setattr(_patching, "_outcomes", dict(_patching._outcomes))
    before = _patching.outcomes()[contract.FRONTEND_CACHE].outcome
    engine = build_stage0_engine(make_vllm_config("text"), replicas=2, distributed=True)
    assert report.build(engine)["frontendCache"]["cacheClass"] is None
    assert _patching.outcomes()[contract.FRONTEND_CACHE].outcome == before


@pytest.mark.parametrize("client", [None, object()], ids=["no-engine", "engine-not-built"])
def test_report_before_the_engine_exists(client):
    r = report.build(client)
    assert r["frontendCache"] is None and r["bootId"] == report.BOOT_ID
    assert engine_truth.check("processor-only", True, r).reason == "EngineUnreported"
