"""Does the engine really run the cache the OmniStage promises? One pure function.

The OmniStage's `status.effectiveCacheMode` is the operator's decision; the head's engine report
(`contract.ENGINE_PATH`) is what the engine built. They must agree, and every patch the decision
depends on must be in effect, before a replica may receive traffic from that head: a replica
routed by a sender-cache frontend fails silently (HTTP 200, no content).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnistage_engine_patches import contract

from ..api.conditions import Reason

# What to run when the report disagrees (said in the Warning Event and the condition): the rows of
# the plugin's version table (contract.ENGINE_VERSIONS).
SUPPORTED_VERSIONS = " or ".join(str(v) for v in contract.ENGINE_VERSIONS)
SUPPORTED_ENGINE = f"{SUPPORTED_VERSIONS} with this operator's omnistage-engine-patches plugin"
PLUGIN_ADVICE = (
    f"use an engine image with {SUPPORTED_ENGINE} installed, and keep {contract.GENERAL_PLUGIN} and "
    f"{contract.ENDPOINT_PLUGIN} in {contract.VLLM_PLUGINS_ENV}"
)

@dataclass(frozen=True)
class Verdict:
    consistent: bool
    reason: str
    message: str


def required_patches(effective_mode: str, distributed: bool) -> list[str]:
    """The patches the effective mode and the topology depend on.

    processor-only: the plugin builds it (vLLM 0.30.0 has no knob for it). replica-aware: that, plus
    the dispatch that omits tensors per replica (`replica_aware_cache`). Distributed: UUID
    scoping must not write replica keys into callers' prompts (defect 2), and the membership
    hooks hold unjoined replicas unroutable and serve join/leave.
    """
    record = contract.CACHE_MODES.get(effective_mode)
    needed = list(record.patches) if record is not None else []
    if distributed:
        needed += [contract.UUID_SCOPE, contract.MEMBERSHIP]
    return needed


def _engine(report: dict[str, Any]) -> str:
    """The head's engine, and whether it is a supported version: the verdict rests on the patches'
    outcomes, which the plugin finds by itself on any version, but an untested one is named."""
    said = (f"plugin {report.get('pluginVersion') or '?'}, vllm {report.get('vllmVersion') or '?'}, "
            f"vllm-omni {report.get('vllmOmniVersion') or '?'}")
    if contract.engine_version(report.get("vllmVersion"), report.get("vllmOmniVersion")) is None:
        said += f" (not a version this operator supports: {SUPPORTED_VERSIONS})"
    return said


def check(effective_mode: str, distributed: bool, report: dict[str, Any] | None,
          unreported_because: str | None = None, refused: str | None = None) -> Verdict:
    """Compare the operator's decision with the head's report.

    `report` None: the head did not answer (`unreported_because` says why), or its answer was
    refused (`refused` says which and why).
    """
    if report is None and refused:
        return Verdict(False, Reason.HEAD_ANSWER_REFUSED,
                       f"{refused}; replicas are not joined until the head answers within the operator's "
                       "bounds (docs/security.md)")
    if report is None:
        return Verdict(False, Reason.ENGINE_UNREPORTED,
                       f"the head has not reported its engine ({unreported_because or 'no answer'}); "
                       f"replicas are not joined until it does. If it never does: {PLUGIN_ADVICE}")
    frontend = report.get("frontendCache")
    if not isinstance(frontend, dict):
        return Verdict(False, Reason.ENGINE_UNREPORTED,
                       f"the head's stage-0 frontend is not built yet ({_engine(report)})")
    patches = report.get("patches") or {}
    broken = []
    for name in required_patches(effective_mode, distributed):
        outcome = patches.get(name) or {}
        if outcome.get("outcome") not in contract.EFFECTIVE_OUTCOMES:
            broken.append(f"{name} {outcome.get('outcome') or 'missing'}"
                          + (f" ({outcome['reason']})" if outcome.get("reason") else ""))
    if broken:
        return Verdict(False, Reason.PATCH_NOT_APPLIED,
                       f"engine patches not in effect: {'; '.join(broken)}. The head runs {_engine(report)}; "
                       f"{PLUGIN_ADVICE}")
    record = contract.CACHE_MODES.get(effective_mode)
    expected = record.reports if record is not None else None
    actual = frontend.get("mode")
    if actual != expected:
        return Verdict(
            False,
            Reason.CACHE_MISMATCH,
            f"status.effectiveCacheMode is {effective_mode} but the head's stage-0 frontend built "
            f"{frontend.get('cacheClass') or 'no cache'} ({actual}); the head runs {_engine(report)}. "
            f"{PLUGIN_ADVICE}",
        )
    built = frontend.get("cacheClass") or "no multimodal cache"
    return Verdict(True, Reason.CONSISTENT, f"the head's stage-0 frontend runs {built} ({effective_mode}); "
                                       f"{_engine(report)}")


def summary(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """The part of the report that goes into status.engine."""
    if report is None:
        return None
    frontend = report.get("frontendCache") if isinstance(report.get("frontendCache"), dict) else {}
    out = {
        "bootId": report.get("bootId"),
        "pluginVersion": report.get("pluginVersion"),
        "vllmVersion": report.get("vllmVersion"),
        "vllmOmniVersion": report.get("vllmOmniVersion"),
        "distributed": report.get("distributed"),
        "frontendCacheClass": frontend.get("cacheClass"),
        "frontendCacheMode": frontend.get("mode"),
        "patches": {
            name: str((p or {}).get("outcome")) for name, p in sorted((report.get("patches") or {}).items())
        },
    }
    return {k: v for k, v in out.items() if v is not None}
