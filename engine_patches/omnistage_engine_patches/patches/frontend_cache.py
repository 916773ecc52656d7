"""Defect 1: the shared stage-0 frontend gets vLLM's processor-only multimodal cache.

vllm-omni 0.30.0 builds one stage-0 renderer on the head (`OmniEngineBase._initialize_stages`
-> `build_stage0_input_processor`) and vLLM gives it the IPC *sender* cache
(`MultiModalProcessorSenderCache` for `lru`, `ShmObjectStoreSenderCache` for `shm`). A sender
cache omits a tensor it has sent before, trusting that "the" engine still holds it. With two or
more stage-0 replicas the request may go to a replica that never received it
(`MultiModalCacheMissError`, finish_reason="error" under HTTP 200). On /v1/chat/completions the
renderer runs before a replica is chosen, so per-replica key scoping cannot help: the frontend
must always send the tensor. `MultiModalProcessorOnlyCache` does exactly that while still caching
the processed result on the frontend.

When: stage 0 replicated in a single runtime (more than one replica), or the runtime distributed
(`single_stage_mode`: head started with --stage-id and a master address) whatever the initial
replica count, because headless replicas may join later. Unchanged: local single-replica
deployments, a disabled cache (size 0: vLLM returns None), a configuration that already selects
processor-only (e.g. --api-server-count > 1), text-only models (vLLM builds no cache), and every
receiver cache: `_get_cache_type` is left alone because the engine cores derive their receiver
caches from it.

How: `OmniEngineBase._initialize_stages` is wrapped to publish the engine in a ContextVar for the
duration of the call (the body, including `build_stage0_input_processor`, runs synchronously on
the orchestrator thread). `processor_cache_from_config`, the only constructor `BaseRenderer.__init__`
uses for its main processor (vLLM 0.30: a `MultiModalRegistry` method; vLLM 0.32: a function of
`vllm/multimodal/cache/factories.py`, wrapped under the name `vllm/renderers/base.py` imported), is
wrapped to return
`processor_only_cache_from_config(...)` when, and only when, it is called for that engine's
stage-0 config object (identity with `engine.stage_vllm_configs[0]`): any other renderer built in
that window (none in 0.30.0) and every renderer built outside it keep vLLM's choice.

The operator's decision is the authority: when `contract.FRONTEND_CACHE_ENV` names the mode the
operator resolved (`status.effectiveCacheMode`), that mode is built, so the OmniStage can never
promise one cache while the engine runs another. `processor-only` is built even for a static
single replica; `replica-aware` builds processor-only too and switches on the per-replica dispatch
of `replica_aware_cache` (which omits tensors per replica after the replica is chosen); `disabled`
and `not-applicable` build no cache (as vLLM does for size 0); a
sender mode (`lru`, `shm`) keeps vLLM's choice only while this process's own detection agrees
that membership cannot change, and otherwise falls back to processor-only (fail closed). Without
the variable (no operator) the detection above decides.

If the wrapper never saw stage 0's config while a multimodal stage-0 renderer was built (an
upstream that copies the config would do that), the patch records itself `skipped`: the head's
report must never say "applied" for a frontend it did not touch.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import os
from typing import Any

from .. import contract
from .._patching import STAGE0_CACHE_DECIDED, Target, UpstreamFixed, demote, is_ours, shape_problem, wrap
from . import replica_aware_cache

NAME = contract.FRONTEND_CACHE
logger = logging.getLogger("omnistage_engine_patches")

# The engine whose `_initialize_stages` is running in this context (orchestrator thread), if any.
_INITIALIZING_ENGINE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "omnistage_initializing_engine", default=None
)

# A source-level sign that upstream already makes this decision itself: then we stay out.
_UPSTREAM_FIX_MARKERS = ("ProcessorOnly", "processor_only")


def _configured_replicas(stage_config: Any) -> int:
    """Stage-0 replica count from its runtime config (typed object or OmegaConf/dict, as
    `compute_replica_layout` reads it)."""
    runtime = getattr(stage_config, "runtime_config", None)
    if runtime is None:
        runtime = getattr(stage_config, "runtime", None)
    if runtime is None:
        return 1
    try:
        value = (
            runtime.get("num_replicas", 1) if hasattr(runtime, "get") else getattr(runtime, "num_replicas", 1)
        )
        return int(value if value is not None else 1)
    except (TypeError, ValueError):
        return 1


def stage0_needs_processor_only(engine: Any) -> bool:
    """The decision, from the engine's own state at the moment stage 0's renderer is built.

    Distributed (`single_stage_mode`) always: replicas join at any time. Otherwise the larger of
    the configured stage-0 replica count and the slots of the stage-0 pool the runtime built.
    """
    if bool(getattr(engine, "single_stage_mode", False)):
        return True
    counts = [1]
    stage_configs = getattr(engine, "stage_configs", None) or []
    if stage_configs:
        counts.append(_configured_replicas(stage_configs[0]))
    stage_pools = getattr(engine, "stage_pools", None) or []
    if stage_pools:
        try:
            counts.append(int(stage_pools[0].num_replicas))
        except (AttributeError, TypeError, ValueError):
            pass
    return max(counts) > 1


# vLLM's cache type name (`MultiModalRegistry._get_cache_type`) of the frontend that always sends full
# tensors; contract.CACHE_MODES says which modes build it (replica-aware too: `replica_aware_cache`
# omits tensors per replica at dispatch) and which build none.
_PROCESSOR_ONLY = contract.VLLM_PROCESSOR_ONLY


def choose_cache_type(
    vllm_choice: str | None, requested: str | None, needs_processor_only: bool
) -> str | None:
    """The stage-0 frontend cache type to build: vLLM's type name, or None for no cache.

    `vllm_choice` is `_get_cache_type` (None: text-only model or size 0), `requested` the
    operator's resolved mode (None: no operator), `needs_processor_only` this process's detection.
    """
    record = contract.CACHE_MODES.get(requested) if requested is not None else None
    if vllm_choice is None or (record is not None and record.vllm_cache_type is None):
        return None
    if (record is not None and record.vllm_cache_type == _PROCESSOR_ONLY) or needs_processor_only:
        return _PROCESSOR_ONLY
    return vllm_choice  # a sender cache on one fixed replica (the operator asked, detection agrees)


def requested_mode() -> str | None:
    """The operator's resolved mode from the head's environment; an unknown value counts as none."""
    value = os.environ.get(contract.FRONTEND_CACHE_ENV, "").strip() or None
    if value is not None and value not in contract.CACHE_MODES:
        logger.warning("%s=%r is not a cache mode this plugin knows; deciding by detection",
                       contract.FRONTEND_CACHE_ENV, value)
        return None
    return value


def _is_stage0_frontend_config(engine: Any, vllm_config: Any) -> bool:
    configs = getattr(engine, "stage_vllm_configs", None) or []
    return bool(configs) and configs[0] is vllm_config


def _stage0_cache(build: Any, vllm_config: Any, cache_type: Any, processor_only: Any) -> Any:
    """The frontend cache for `vllm_config`: vLLM's own (`build()`) unless it is the stage-0 config
    of the engine whose stages are being built, where the decision above picks it. `cache_type` and
    `processor_only` are vLLM's `_get_cache_type` and `processor_only_cache_from_config` (a method of
    the registry in vLLM 0.30, module functions from 0.32)."""
    engine = _INITIALIZING_ENGINE.get()
    if engine is None or not _is_stage0_frontend_config(engine, vllm_config):
        return build()
    setattr(engine, STAGE0_CACHE_DECIDED, True)
    vllm_choice = cache_type(vllm_config)
    chosen = choose_cache_type(vllm_choice, requested_mode(), stage0_needs_processor_only(engine))
    replica_aware = chosen == _PROCESSOR_ONLY and requested_mode() == contract.CACHE_REPLICA_AWARE
    replica_aware_cache.activate(
        vllm_config.model_config.get_multimodal_config().mm_processor_cache_gb if replica_aware else None)
    if chosen == vllm_choice:
        return build()
    logger.info("stage-0 frontend: %s cache replaced by %s (%s=%s, distributed=%s)", vllm_choice,
                chosen or "no cache", contract.FRONTEND_CACHE_ENV, requested_mode(),
                bool(getattr(engine, "single_stage_mode", False)))
    if chosen is None:
        return None  # what vLLM itself returns for a disabled cache
    return processor_only(vllm_config)


def _cache_constructor() -> tuple[Any, tuple[Target, ...]] | str:
    """Where BaseRenderer gets its main processor's cache, and the targets to check there: vLLM 0.30's
    `MultiModalRegistry.processor_cache_from_config` (a method), or vLLM 0.32's module function
    `vllm.multimodal.cache.factories.processor_cache_from_config`, which `vllm/renderers/base.py`
    imports by name (so the renderer module's name is the one to wrap)."""
    from vllm.multimodal.registry import MultiModalRegistry
    from vllm.renderers import base as renderer_base

    if hasattr(MultiModalRegistry, "processor_cache_from_config"):
        return MultiModalRegistry, (
            Target(MultiModalRegistry, "processor_cache_from_config", ("self", "vllm_config")),
            Target(MultiModalRegistry, "processor_only_cache_from_config"),
            Target(MultiModalRegistry, "_get_cache_type"))
    try:
        from vllm.multimodal.cache import factories
    except ImportError as e:
        return f"target not importable ({e})"
    named = getattr(renderer_base, "processor_cache_from_config", None)
    if named is not factories.processor_cache_from_config:
        return "vllm.renderers.base does not take its cache from factories.processor_cache_from_config"
    return renderer_base, (
        Target(renderer_base, "processor_cache_from_config", ("vllm_config",)),
        Target(factories, "processor_only_cache_from_config"), Target(factories, "_get_cache_type"))


def install() -> str | None:
    # Every check runs before anything is changed, so a None-or-reason answer never half-applies.
    try:
        from vllm.multimodal.cache import MultiModalProcessorOnlyCache  # noqa: F401
        from vllm.renderers import base as renderer_base
        from vllm_omni.engine import omni_engine_base, stage_init_utils
        from vllm_omni.engine.omni_engine_base import OmniEngineBase
    except ImportError as e:  # not an engine image (or a layout we do not know): nothing to fix
        return f"target not importable ({e})"
    found = _cache_constructor()
    if isinstance(found, str):
        return found
    owner, (ctor, processor_only_ctor, cache_type_fn) = found

    targets = (Target(OmniEngineBase, "_initialize_stages", ("self", "stage_init_timeout")), ctor)
    wrapped = [is_ours(t.get(), NAME) for t in targets]
    if all(wrapped):
        return None  # already in place (e.g. this module was reloaded)
    if any(wrapped):
        return "only one of the two wrappers is in place: refusing to stack a second copy"
    problem = shape_problem(*targets, processor_only_ctor, cache_type_fn)
    if problem:
        return problem
    init_stages = targets[0].get()
    try:
        init_src = inspect.getsource(init_stages)
        builder_src = inspect.getsource(stage_init_utils.build_stage0_input_processor)
        renderer_src = inspect.getsource(renderer_base.BaseRenderer.__init__)
        engine_module_src = inspect.getsource(omni_engine_base)
    except (OSError, TypeError, AttributeError) as e:
        return f"cannot read the target source to check its shape ({e})"
    if "build_stage0_input_processor" not in init_src or "stage_vllm_configs" not in init_src:
        return "OmniEngineBase._initialize_stages no longer builds the stage-0 input processor"
    if "processor_cache_from_config" not in renderer_src:
        return "BaseRenderer no longer takes its cache from processor_cache_from_config"
    for marker in _UPSTREAM_FIX_MARKERS:
        if marker in init_src or marker in builder_src or marker in engine_module_src:
            return UpstreamFixed(
                f"upstream already chooses the stage-0 frontend cache ({marker!r} found in vllm_omni)"
            )

    @wrap(OmniEngineBase, "_initialize_stages", NAME)
    def _initialize_stages(original_init_stages: Any, self: Any, stage_init_timeout: int) -> None:
        token = _INITIALIZING_ENGINE.set(self)
        setattr(self, STAGE0_CACHE_DECIDED, False)
        replica_aware_cache.activate(None)  # until this engine's stage-0 frontend asks for it
        try:
            result = original_init_stages(self, stage_init_timeout)
        finally:
            _INITIALIZING_ENGINE.reset(token)
        renderer = getattr(getattr(self, "input_processor", None), "renderer", None)
        if getattr(renderer, "mm_processor", None) is not None and not getattr(self, STAGE0_CACHE_DECIDED):
            demote(NAME, "the stage-0 frontend renderer was built without passing stage 0's config through "
                         "processor_cache_from_config (upstream changed how it builds the frontend)")
        return result

    if isinstance(owner, type):  # vLLM 0.30: the registry's methods
        @wrap(owner, "processor_cache_from_config", NAME)
        def processor_cache_from_config(original: Any, self: Any, vllm_config: Any) -> Any:
            return _stage0_cache(lambda: original(self, vllm_config), vllm_config,
                                 self._get_cache_type, self.processor_only_cache_from_config)
    else:  # vLLM 0.32: the renderer module's name for the factory function
        @wrap(owner, "processor_cache_from_config", NAME)
        def processor_cache_from_config(original: Any, vllm_config: Any) -> Any:
            return _stage0_cache(lambda: original(vllm_config), vllm_config,
                                 cache_type_fn.get(), processor_only_ctor.get())

    return None
