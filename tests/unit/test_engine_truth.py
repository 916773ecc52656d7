"""The CacheConsistent rule (engine_truth.check): the operator's decision against the head's report."""

from __future__ import annotations

import copy

import pytest
from omnistage.api.conditions import Reason
from omnistage.control import engine_truth
from omnistage_engine_patches import contract

ALL_APPLIED = {name: {"outcome": contract.APPLIED, "reason": "applied"} for name in contract.PATCHES}


def report(
    cache_class: str | None, patches: dict | None = None, replica_aware: bool = False, **extra
) -> dict:
    return {
        "bootId": "b1",
        "pluginVersion": "0.2.0",
        "vllmVersion": "0.30.0",
        "vllmOmniVersion": "0.30.0",
        "distributed": True,
        "frontendCache": {
            "cacheClass": cache_class,
            "mode": contract.frontend_mode(cache_class, replica_aware),
            "requested": None,
        },
        "patches": copy.deepcopy(patches if patches is not None else ALL_APPLIED),
        **extra,
    }


def with_outcome(patch: str, outcome: str, reason: str = "target changed shape") -> dict:
    patches = copy.deepcopy(ALL_APPLIED)
    patches[patch] = {"outcome": outcome, "reason": reason}
    return patches


@pytest.mark.parametrize(
    ("mode", "distributed", "cache_class", "patches", "reason"),
    [
        ("processor-only", True, "MultiModalProcessorOnlyCache", ALL_APPLIED, Reason.CONSISTENT),
        ("processor-only", True, "MultiModalProcessorSenderCache", ALL_APPLIED, Reason.CACHE_MISMATCH),
        ("processor-only", True, "ShmObjectStoreSenderCache", ALL_APPLIED, Reason.CACHE_MISMATCH),
        ("processor-only", True, None, ALL_APPLIED, Reason.CACHE_MISMATCH),
        (
            "processor-only",
            True,
            "MultiModalProcessorOnlyCache",
            with_outcome("frontend_cache", contract.UPSTREAM_FIXED, "upstream has it"),
            Reason.CONSISTENT,
        ),
        (
            "processor-only",
            True,
            "MultiModalProcessorOnlyCache",
            with_outcome("frontend_cache", contract.SKIPPED),
            Reason.PATCH_NOT_APPLIED,
        ),
        (
            "processor-only",
            True,
            "MultiModalProcessorOnlyCache",
            with_outcome("frontend_cache", contract.DISABLED, "disabled by switch"),
            Reason.PATCH_NOT_APPLIED,
        ),
        (
            "processor-only",
            True,
            "MultiModalProcessorOnlyCache",
            with_outcome("uuid_scope", contract.SKIPPED),
            Reason.PATCH_NOT_APPLIED,
        ),
        (
            "processor-only",
            True,
            "MultiModalProcessorOnlyCache",
            with_outcome("membership", contract.SKIPPED),
            Reason.PATCH_NOT_APPLIED,
        ),
        # Metrics patches are not part of the cache guarantee.
        (
            "processor-only",
            True,
            "MultiModalProcessorOnlyCache",
            with_outcome("replica_metrics", contract.SKIPPED),
            Reason.CONSISTENT,
        ),
        (
            "processor-only",
            False,
            "MultiModalProcessorOnlyCache",
            with_outcome("uuid_scope", contract.SKIPPED),
            Reason.CONSISTENT,
        ),
        (
            "processor-only",
            True,
            "MultiModalProcessorOnlyCache",
            {k: v for k, v in ALL_APPLIED.items() if k != "frontend_cache"},
            Reason.PATCH_NOT_APPLIED,
        ),
        (
            "lru",
            False,
            "MultiModalProcessorSenderCache",
            with_outcome("frontend_cache", contract.SKIPPED),
            Reason.CONSISTENT,
        ),
        ("lru", False, "MultiModalProcessorOnlyCache", ALL_APPLIED, Reason.CACHE_MISMATCH),
        ("shm", False, "ShmObjectStoreSenderCache", ALL_APPLIED, Reason.CONSISTENT),
        ("disabled", True, None, ALL_APPLIED, Reason.CONSISTENT),
        ("disabled", True, "MultiModalProcessorOnlyCache", ALL_APPLIED, Reason.CACHE_MISMATCH),
        ("not-applicable", True, None, ALL_APPLIED, Reason.CONSISTENT),
        ("processor-only", True, "SomeFutureCache", ALL_APPLIED, Reason.CACHE_MISMATCH),
    ],
)
def test_verdict_table(mode, distributed, cache_class, patches, reason):
    verdict = engine_truth.check(mode, distributed, report(cache_class, patches))
    assert verdict.reason == reason, verdict.message
    assert verdict.consistent is (reason == Reason.CONSISTENT)


PO = "MultiModalProcessorOnlyCache"


@pytest.mark.parametrize(
    ("mode", "distributed", "cache_class", "replica_aware", "patches", "reason"),
    [
        ("replica-aware", True, PO, True, ALL_APPLIED, Reason.CONSISTENT),
        ("replica-aware", False, PO, True, with_outcome("uuid_scope", contract.SKIPPED), Reason.CONSISTENT),
        # The frontend is processor-only but the per-replica dispatch is not live: a mismatch
        # (safe, every tensor is sent, but not what the OmniStage promises).
        ("replica-aware", True, PO, False, ALL_APPLIED, Reason.CACHE_MISMATCH),
        (
            "replica-aware",
            True,
            PO,
            False,
            with_outcome("replica_aware_cache", contract.SKIPPED),
            Reason.PATCH_NOT_APPLIED,
        ),
        (
            "replica-aware",
            True,
            PO,
            False,
            with_outcome("replica_aware_cache", contract.DISABLED),
            Reason.PATCH_NOT_APPLIED,
        ),
        (
            "replica-aware",
            True,
            PO,
            True,
            with_outcome("frontend_cache", contract.SKIPPED),
            Reason.PATCH_NOT_APPLIED,
        ),
        ("replica-aware", True, "MultiModalProcessorSenderCache", False, ALL_APPLIED, Reason.CACHE_MISMATCH),
        # A head that strips per replica while the OmniStage promises processor-only.
        ("processor-only", True, PO, True, ALL_APPLIED, Reason.CACHE_MISMATCH),
        # processor-only never needs the replica-aware patch.
        (
            "processor-only",
            True,
            PO,
            False,
            with_outcome("replica_aware_cache", contract.SKIPPED),
            Reason.CONSISTENT,
        ),
    ],
)
def test_verdict_table_replica_aware(mode, distributed, cache_class, replica_aware, patches, reason):
    verdict = engine_truth.check(mode, distributed, report(cache_class, patches, replica_aware))
    assert verdict.reason == reason, verdict.message
    assert verdict.consistent is (reason == Reason.CONSISTENT)


def test_no_report_is_unreported_and_says_why():
    verdict = engine_truth.check("processor-only", True, None, "head unreachable: connection refused")
    assert (verdict.consistent, verdict.reason) == (False, Reason.ENGINE_UNREPORTED)
    assert "connection refused" in verdict.message and contract.GENERAL_PLUGIN in verdict.message


def test_frontend_not_built_yet_is_unreported():
    r = report("MultiModalProcessorOnlyCache")
    r["frontendCache"] = None
    assert engine_truth.check("processor-only", True, r).reason == Reason.ENGINE_UNREPORTED


def test_messages_name_what_to_do():
    mismatch = engine_truth.check("processor-only", True, report("MultiModalProcessorSenderCache"))
    assert "MultiModalProcessorSenderCache" in mismatch.message and "vllm-omni 0.30.0" in mismatch.message
    skipped = engine_truth.check("processor-only", True, report(
        "MultiModalProcessorOnlyCache", with_outcome("frontend_cache", contract.SKIPPED, "X is missing")))
    assert "frontend_cache skipped (X is missing)" in skipped.message


def test_summary_for_status():
    s = engine_truth.summary(
        report("MultiModalProcessorOnlyCache", with_outcome("uuid_scope", contract.DISABLED))
    )
    assert s["frontendCacheClass"] == "MultiModalProcessorOnlyCache"
    assert s["frontendCacheMode"] == "processor-only"
    assert s["patches"]["uuid_scope"] == "disabled" and s["patches"]["frontend_cache"] == "applied"
    assert engine_truth.summary(None) is None


def test_summary_shows_replica_aware():
    """status.engine names the mode the head really runs: replica-aware only while its dispatch is live."""
    s = engine_truth.summary(report("MultiModalProcessorOnlyCache", replica_aware=True))
    assert (s["frontendCacheClass"], s["frontendCacheMode"]) == (
        "MultiModalProcessorOnlyCache",
        "replica-aware",
    )
    assert s["patches"]["replica_aware_cache"] == "applied"


def _on(version: contract.EngineVersion) -> dict:
    """The report a head of that supported version gives with the plugin (its outcomes from the table)."""
    patches = {name: {"outcome": version.outcome(name), "reason": "table"} for name in contract.PATCHES}
    return report("MultiModalProcessorOnlyCache", patches, vllmVersion=version.vllm,
                  vllmOmniVersion=version.vllm_omni)


@pytest.mark.parametrize("version", contract.ENGINE_VERSIONS, ids=str)
def test_every_supported_version_serves_processor_only_replicated(version):
    """A head of each row of contract.ENGINE_VERSIONS, with the outcomes the row says, is consistent
    for processor-only with dynamic membership (the mode every elastic OmniStage runs), and named
    supported; replica-aware is offered only where its patches apply."""
    verdict = engine_truth.check("processor-only", True, _on(version))
    assert verdict.reason == Reason.CONSISTENT, verdict.message
    assert "not a version this operator supports" not in verdict.message
    aware = engine_truth.check("replica-aware", True, {**_on(version), "frontendCache": {
        "cacheClass": "MultiModalProcessorOnlyCache", "mode": contract.CACHE_REPLICA_AWARE}})
    applies = version.outcome(contract.REPLICA_AWARE_CACHE) in contract.EFFECTIVE_OUTCOMES
    assert (aware.reason == Reason.CONSISTENT) is applies, aware.message


def test_an_untested_version_is_named_in_the_verdict():
    untested = report("MultiModalProcessorOnlyCache", vllmVersion="0.34.0", vllmOmniVersion="0.34.0")
    verdict = engine_truth.check("processor-only", True, untested)
    assert verdict.reason == Reason.CONSISTENT  # the outcomes decide; the version is said
    assert "vllm 0.34.0" in verdict.message and "not a version this operator supports" in verdict.message
    assert "vllm 0.32.0 and vllm-omni 0.32.0rc1" in verdict.message
    broken = engine_truth.check("processor-only", True, report("MultiModalProcessorSenderCache"))
    assert engine_truth.SUPPORTED_VERSIONS in broken.message


def test_the_version_table_names_real_patches_and_outcomes():
    for version in contract.ENGINE_VERSIONS:
        assert {p for p, _ in version.not_applied} <= set(contract.PATCHES), version
        assert {o for _, o in version.not_applied} <= set(contract.OUTCOMES) - {contract.APPLIED}, version
        assert contract.CACHE_CLASS_MODES[version.sender_cache_class] == contract.CACHE_LRU, version
    assert len({(v.vllm, v.vllm_omni) for v in contract.ENGINE_VERSIONS}) == len(contract.ENGINE_VERSIONS)
