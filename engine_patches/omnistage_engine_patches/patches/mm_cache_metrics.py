"""Patch ``mm_cache_metrics``: the stage-0 frontend's multimodal cache statistics (vllm-omni 0.30.0).

Defect: the stage-0 frontend renderer's multimodal cache statistics (``BaseRenderer.stat_mm_cache``)
are never recorded.

What the wrappers do: drain them on every stage-0 stats tick and add them to
``vllm:mm_cache_queries`` / ``vllm:mm_cache_hits`` under ``{stage="0", replica="frontend"}`` (the
frontend cache is shared by all replicas, so it gets its own, membership-independent series; it
exists, zero-valued, from startup).

Switch off: ``OMNISTAGE_DISABLE_PATCHES=mm_cache_metrics``.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import weakref
from typing import Any

from .. import contract
from .._patching import ENGINE_REF, Target, UpstreamFixed, ours, referent, shape_problem, wrap

logger = logging.getLogger("omnistage_engine_patches.mm_cache_metrics")

NAME = contract.MM_CACHE_METRICS
FRONTEND_REPLICA_LABEL = "frontend"

# Set while an engine's orchestrator thread runs (``OmniEngineBase._bootstrap_orchestrator``), so
# the orchestrator built inside it can find the engine's stage-0 frontend renderer.
_CURRENT_ENGINE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "omnistage_current_engine", default=None
)


def _frontend_renderer(orch: Any) -> Any | None:
    engine = referent(orch, ENGINE_REF)
    input_processor = getattr(engine, "input_processor", None)
    return getattr(input_processor, "renderer", None)


def _frontend_children(orch: Any) -> tuple[Any, Any] | None:
    """The (queries, hits) children of the frontend series, created on first use."""
    stat_logger = getattr(orch, "_stat_logger", None)
    if stat_logger is None:
        return None
    out = []
    for table in (stat_logger.counter_mm_cache_queries, stat_logger.counter_mm_cache_hits):
        template = next(iter(table.values()), None)
        family = getattr(template, "_omni_parent", None)
        if family is None:
            return None
        model_name = stat_logger.vllm_config.model_config.served_model_name
        # Positional values matching the relabelled names (model_name, stage, replica) pass
        # through the relabel wrapper untouched.
        out.append(family.labels(model_name, "0", FRONTEND_REPLICA_LABEL))
    return out[0], out[1]


def record_frontend_mm_cache(orch: Any) -> bool:
    """Move the stage-0 frontend renderer's pending cache stats into the frontend series."""
    renderer = _frontend_renderer(orch)
    if renderer is None or getattr(renderer, "_mm_cache_stats", None) is None:
        return False  # text-only renderer or disabled cache: vLLM keeps no stats either
    children = _frontend_children(orch)
    if children is None:
        return False
    stats = renderer.stat_mm_cache()
    if stats is not None and (stats.queries or stats.hits):
        children[0].inc(stats.queries)
        children[1].inc(stats.hits)
    return True


def install() -> str | None:
    from vllm_omni.engine import orchestrator as orchestrator_module
    from vllm_omni.engine.omni_engine_base import OmniEngineBase
    from vllm_omni.engine.orchestrator import OrchestratorBase

    try:
        source = inspect.getsource(orchestrator_module)
    except (OSError, TypeError):
        source = ""
    if "stat_mm_cache" in source or "mm_cache_stats=" in source:
        return UpstreamFixed("upstream orchestrator already records the frontend multimodal cache stats")
    targets = (
        Target(OmniEngineBase, "_bootstrap_orchestrator", ("self",), more=True),
        Target(OrchestratorBase, "_init_metrics_state", ("self", "stage_pools"), more=True),
        Target(OrchestratorBase, "_process_llm_stage_outputs", ("self", "stage_id", "replica_id"), more=True),
    )
    problem = shape_problem(*targets)
    if problem:
        return problem
    from vllm.renderers.base import BaseRenderer

    if not callable(getattr(BaseRenderer, "stat_mm_cache", None)):
        return "target changed shape: vllm BaseRenderer.stat_mm_cache is missing"
    if ours(NAME, *targets):
        return None  # our own wrappers are already in place

    @wrap(OmniEngineBase, "_bootstrap_orchestrator", NAME)
    def _bootstrap_orchestrator(orig, self, *args, **kwargs):
        token = _CURRENT_ENGINE.set(weakref.ref(self))
        try:
            return orig(self, *args, **kwargs)
        finally:
            _CURRENT_ENGINE.reset(token)

    @wrap(OrchestratorBase, "_init_metrics_state", NAME)
    def _init_metrics_state(orig, self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        engine_ref = _CURRENT_ENGINE.get()
        if engine_ref is not None:
            setattr(self, ENGINE_REF, engine_ref)
        renderer = _frontend_renderer(self)
        if renderer is not None and getattr(renderer, "_mm_cache_stats", None) is not None:
            # Zero-valued from startup, so a dashboard sees the series before the first request.
            _frontend_children(self)
        return result

    @wrap(OrchestratorBase, "_process_llm_stage_outputs", NAME)
    async def _process_llm_stage_outputs(orig, self, stage_id, replica_id, *args, **kwargs):
        result = await orig(self, stage_id, replica_id, *args, **kwargs)
        if stage_id == 0 and self._stat_logger is not None:
            try:
                record_frontend_mm_cache(self)
            except Exception:  # metrics must never break output processing
                logger.exception("recording frontend multimodal cache stats failed")
        return result

    return None
