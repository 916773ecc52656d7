"""Patch replica_affinity steers by replica_aware_cache's mirrors. Where that patch is skipped (vLLM 0.32:
`MultiModalProcessorCacheItemMetadata` is no longer exported by vllm.multimodal.cache), affinity must
say skipped with the reason, not applied and never acting (issue 42: never a silent no-op). Its
negative control (replica_aware_cache disabled) is left as it was. No vLLM is imported: the outcome
is decided before the target is."""

from __future__ import annotations

import sys

import pytest
from omnistage_engine_patches import _patching, contract
from omnistage_engine_patches.patches import replica_affinity


@pytest.fixture
def outcomes(monkeypatch):
    recorded: dict[str, _patching.Outcome] = {}
    monkeypatch.setattr(_patching, "_outcomes", recorded)
    return recorded


def test_skipped_mirrors_skip_affinity_with_their_reason(outcomes, monkeypatch):
    outcomes[contract.REPLICA_AWARE_CACHE] = _patching.Outcome(
        contract.REPLICA_AWARE_CACHE, contract.SKIPPED, "target not importable (vLLM 0.32)")
    monkeypatch.setitem(sys.modules, "vllm_omni.engine.stage_pool", None)  # would fail the import if read
    reason = replica_affinity.install()
    assert reason == "replica_aware_cache is skipped (its reason is its own): no mirrors to steer by"
    outcome = _patching.apply_patch(contract.REPLICA_AFFINITY, replica_affinity.install)
    assert (outcome.outcome, outcome.reason) == (contract.SKIPPED, reason)


@pytest.mark.parametrize("mirrors", [None, contract.DISABLED, contract.APPLIED])
def test_otherwise_affinity_checks_its_own_target(outcomes, monkeypatch, mirrors):
    if mirrors is not None:
        outcomes[contract.REPLICA_AWARE_CACHE] = _patching.Outcome(contract.REPLICA_AWARE_CACHE, mirrors, "")
    monkeypatch.setitem(sys.modules, "vllm_omni.engine.stage_pool", None)  # an image without vllm-omni
    assert replica_affinity.install().startswith("target not importable")
