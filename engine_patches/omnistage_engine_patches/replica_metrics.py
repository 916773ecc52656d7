"""Defect 3: metric series that follow stage membership (vllm-omni 0.30.0).

vllm-omni's ``OmniPrometheusStatLogger`` relabels vLLM's ``vllm:*`` families from ``engine`` to
``stage`` + ``replica``. In 0.30.0 a replica gets its series lazily, on its first stats tick
(``OrchestratorBase._process_llm_stage_outputs``), and nothing ever removes them: a departed
replica's gauges freeze at their last value and, because replica ids are never reused, the label
set grows for the life of the head. The stage-0 frontend renderer's multimodal cache statistics
(``BaseRenderer.stat_mm_cache``) are never recorded at all.

Two patches, each switchable through ``OMNISTAGE_DISABLE_PATCHES``:

``replica_metrics``
    * Attach (``MembershipController._do_register`` succeeded) registers the replica's series at
      once, zero-valued, before it has served anything.
    * Detach (``OrchestratorBase._remove_stage_replica_waiting``, the callback every removal path
      calls: membership unregister, DOWN/heartbeat timeout, dead engine) removes every child of
      every relabelled family for that (stage, replica) with prometheus_client's ``remove`` and
      drops the engine-idx bookkeeping (the orchestrator's ``_stage_replica_to_engine_idx``, the
      stat logger's maps and per-engine tables, and the process-global ``_ENGINE_INDEX_MAP``).
    * Engine indices come from a monotonic allocator. Upstream allocates ``len(mapping)``, which
      collides with a live index once an entry has been removed (``register_replica`` would raise
      ``ValueError`` inside output processing), so the stats path registers unknown-but-attached
      replicas itself before upstream's branch can run, and routes a late stats batch from an
      already-detached replica to a sink instead of resurrecting its series.

``mm_cache_metrics``
    Drains the stage-0 frontend renderer's cache statistics on every stage-0 stats tick and adds
    them to ``vllm:mm_cache_queries`` / ``vllm:mm_cache_hits`` under
    ``{stage="0", replica="frontend"}`` (the frontend cache is shared by all replicas, so it gets
    its own, membership-independent series; it exists, zero-valued, from startup).

Every function here that touches the stat logger runs on the orchestrator's event loop (the
stats path, the membership controller and the membership endpoint all execute there), so the
per-engine tables are never mutated concurrently with ``record``.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import weakref
from typing import Any

from . import contract
from ._patching import Outcome, UpstreamFixed, apply_patch, is_ours, mark, outcomes

logger = logging.getLogger("omnistage_engine_patches.replica_metrics")

REPLICA_METRICS = contract.REPLICA_METRICS
MM_CACHE_METRICS = contract.MM_CACHE_METRICS

# Engine index that swallows a stats batch (see ``_process_llm_stage_outputs`` below). Real
# indices are >= 0.
SINK_ENGINE_IDX = -1
FRONTEND_REPLICA_LABEL = "frontend"

# Set while an engine's orchestrator thread runs (``OmniEngineBase._bootstrap_orchestrator``), so
# the orchestrator built inside it can find the engine's stage-0 frontend renderer.
_CURRENT_ENGINE: contextvars.ContextVar[Any] = contextvars.ContextVar("omnistage_current_engine", default=None)


# --------------------------------------------------------------------------------------------
# Helpers usable by the membership logic (they are no-ops when stats are disabled).
# --------------------------------------------------------------------------------------------


def enabled() -> bool:
    """True when the ``replica_metrics`` patch is applied in this process."""
    outcome = outcomes().get(REPLICA_METRICS)
    return bool(outcome and outcome.applied)


def attached(pool: Any, replica_id: int) -> bool:
    clients = getattr(pool, "clients", None) or []
    return 0 <= replica_id < len(clients) and clients[replica_id] is not None


def _next_engine_idx(orch: Any) -> int:
    stat_logger = orch._stat_logger
    used = set(orch._stage_replica_to_engine_idx.values()) | set(stat_logger.stage_replica_map)
    nxt = getattr(orch, "_omnistage_next_engine_idx", None)
    if nxt is None:
        nxt = max((i for i in used if i >= 0), default=-1) + 1
    while nxt in used:
        nxt += 1
    orch._omnistage_next_engine_idx = nxt + 1
    return nxt


def series_registered(orch: Any, stage_id: int, replica_id: int) -> bool:
    stat_logger = getattr(orch, "_stat_logger", None)
    if stat_logger is None:
        return False
    idx = orch._stage_replica_to_engine_idx.get((stage_id, replica_id))
    return idx is not None and idx >= 0 and idx in stat_logger.stage_replica_map


def register_replica_series(orch: Any, stage_id: int, replica_id: int) -> bool:
    """Create (stage, replica)'s series now, zero-valued. Idempotent. False when stats are off."""
    stat_logger = getattr(orch, "_stat_logger", None)
    if stat_logger is None:
        return False
    key = (stage_id, replica_id)
    mapping = orch._stage_replica_to_engine_idx
    idx = mapping.get(key)
    if idx is not None and idx >= 0 and idx in stat_logger.stage_replica_map:
        return True
    idx = _next_engine_idx(orch)
    # Upstream's own registration: extends every per-engine table by binding new children on
    # the existing families (no reset of the other replicas' series) and sets sleep_state awake.
    stat_logger.register_replica(idx, str(stage_id), str(replica_id))
    mapping[key] = idx
    logger.info("metric series registered for stage %d replica %d (engine idx %d)", stage_id, replica_id, idx)
    return True


def _drop_engine_entries(value: Any, engine_idx: int, families: dict[int, Any], seen: set[int]) -> None:
    """Pop ``engine_idx`` from every per-engine table below ``value``; collect the families.

    Mirrors the table shapes ``vllm_omni.metrics.stat_logger._extend_metric_maps`` extends:
    ``{idx: child}``, ``{idx: [child, ...]}``, dicts of those (per reason/source/sleep state),
    and the perf / spec-decode / KV-connector helper objects.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm, KVConnectorPromMetrics
    from vllm.v1.metrics.perf import PerfMetricsProm
    from vllm.v1.spec_decode.metrics import SpecDecodingProm
    from vllm_omni.metrics.stat_logger import _RelabelMixin

    if id(value) in seen:
        return
    seen.add(id(value))

    def collect(child: Any) -> None:
        parent = getattr(child, "_omni_parent", None)
        if isinstance(child, _RelabelMixin) and parent is not None:
            families[id(parent)] = parent

    if isinstance(value, dict):
        per_engine = any(isinstance(k, int) and not isinstance(k, bool) for k in value) and all(
            isinstance(v, _RelabelMixin) or (isinstance(v, list) and all(isinstance(i, _RelabelMixin) for i in v))
            for v in value.values()
        )
        if per_engine and value:
            for children in value.values():
                for child in children if isinstance(children, list) else [children]:
                    collect(child)
            value.pop(engine_idx, None)
            return
        for child in list(value.values()):
            _drop_engine_entries(child, engine_idx, families, seen)
    elif isinstance(value, (list, tuple)):
        for child in value:
            _drop_engine_entries(child, engine_idx, families, seen)
    elif isinstance(value, (PerfMetricsProm, SpecDecodingProm, KVConnectorProm, KVConnectorPromMetrics)):
        _drop_engine_entries(vars(value), engine_idx, families, seen)


def _remove_children(family: Any, labels: dict[str, str]) -> int:
    """Remove every child of ``family`` whose labels include ``labels``; return how many."""
    names = tuple(getattr(family, "_labelnames", ()) or ())
    if not all(name in names for name in labels):
        return 0
    positions = {names.index(name): str(value) for name, value in labels.items()}
    # ``_metrics`` maps label-value tuples to children (prometheus_client's own table, read under
    # its lock); removal goes through the public ``remove``.
    with family._lock:
        victims = [lv for lv in family._metrics if all(lv[i] == v for i, v in positions.items())]
    for labelvalues in victims:
        family.remove(*labelvalues)
    return len(victims)


def _omni_per_replica_families() -> list[Any]:
    """vllm-omni's module-level per-replica families (audio, diffusion, transfer), if imported."""
    import sys

    from prometheus_client.metrics import MetricWrapperBase

    found = []
    for name in ("vllm_omni.metrics.modality", "vllm_omni.metrics.transfer"):
        module = sys.modules.get(name)
        if module is None:
            continue
        found.extend(v for v in vars(module).values() if isinstance(v, MetricWrapperBase))
    return found


def remove_replica_series(orch: Any, stage_id: int, replica_id: int) -> int:
    """Remove (stage, replica)'s series and bookkeeping. Idempotent; returns children removed."""
    from vllm_omni.metrics import stat_logger as omni_stat_logger

    stage, replica = str(stage_id), str(replica_id)
    removed = 0
    stat_logger = getattr(orch, "_stat_logger", None)
    idx = orch._stage_replica_to_engine_idx.pop((stage_id, replica_id), None)
    if stat_logger is not None:
        indices = {i for i, pair in stat_logger.stage_replica_map.items() if pair == (stage, replica)}
        if idx is not None and idx >= 0:
            indices.add(idx)
        families: dict[int, Any] = {}
        for engine_idx in indices:
            _drop_engine_entries(vars(stat_logger), engine_idx, families, set())
            stat_logger.stage_replica_map.pop(engine_idx, None)
            omni_stat_logger._ENGINE_INDEX_MAP.pop(engine_idx, None)
            stat_logger.per_engine_labelvalues.pop(engine_idx, None)
            if engine_idx in stat_logger.engine_indexes:
                stat_logger.engine_indexes.remove(engine_idx)
        # Every relabelled family seen in the tables: remove all children of this replica, also
        # those bound outside the tables (extra label values such as finish reasons).
        for family in families.values():
            removed += _remove_children(family, {"stage": stage, "replica": replica})
    for family in _omni_per_replica_families():
        removed += _remove_children(family, {"stage": stage, "replica": replica})
        removed += _remove_children(family, {"from_stage": stage, "from_replica": replica})
        removed += _remove_children(family, {"to_stage": stage, "to_replica": replica})
    if idx is not None or removed:
        logger.info("metric series removed for stage %d replica %d (%d children)", stage_id, replica_id, removed)
    return removed


def _orchestrator_of_pool(pool: Any) -> Any | None:
    ref = getattr(pool, "_omnistage_orchestrator", None)
    return ref() if ref is not None else None


# --------------------------------------------------------------------------------------------
# replica_metrics
# --------------------------------------------------------------------------------------------


def _params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _install_replica_metrics() -> str | None:
    from vllm_omni.engine.membership_controller import MembershipController
    from vllm_omni.engine.orchestrator import OrchestratorBase
    from vllm_omni.metrics.stat_logger import OmniPrometheusStatLogger

    for name in ("unregister_replica", "deregister_replica", "remove_replica"):
        if hasattr(OmniPrometheusStatLogger, name):
            return UpstreamFixed(f"upstream OmniPrometheusStatLogger.{name} exists: series removal is already upstream")

    targets = {
        "OrchestratorBase._init_metrics_state": getattr(OrchestratorBase, "_init_metrics_state", None),
        "OrchestratorBase._process_llm_stage_outputs": getattr(OrchestratorBase, "_process_llm_stage_outputs", None),
        "OrchestratorBase._remove_stage_replica_waiting": getattr(
            OrchestratorBase, "_remove_stage_replica_waiting", None
        ),
        "MembershipController._do_register": getattr(MembershipController, "_do_register", None),
        "OmniPrometheusStatLogger.record": getattr(OmniPrometheusStatLogger, "record", None),
        "OmniPrometheusStatLogger.register_replica": getattr(OmniPrometheusStatLogger, "register_replica", None),
    }
    for label, fn in targets.items():
        if not callable(fn):
            return f"target changed shape: {label} is missing"
    # Shape checks first (inspect.signature sees through wrappers via __wrapped__), so a target
    # replaced by something else is reported even when our wrappers sit on the others.
    if _params(OrchestratorBase._init_metrics_state)[:2] != ["self", "stage_pools"]:
        return "target changed shape: OrchestratorBase._init_metrics_state(self, stage_pools, ...)"
    if _params(OrchestratorBase._process_llm_stage_outputs)[:3] != ["self", "stage_id", "replica_id"] or not (
        inspect.iscoroutinefunction(OrchestratorBase._process_llm_stage_outputs)
    ):
        return "target changed shape: async OrchestratorBase._process_llm_stage_outputs(self, stage_id, replica_id, ...)"
    if _params(OrchestratorBase._remove_stage_replica_waiting) != ["self", "stage_id", "replica_id"]:
        return "target changed shape: OrchestratorBase._remove_stage_replica_waiting(self, stage_id, replica_id)"
    if _params(MembershipController._do_register) != ["self", "stage_id", "replica_id"] or not (
        inspect.iscoroutinefunction(MembershipController._do_register)
    ):
        return "target changed shape: async MembershipController._do_register(self, stage_id, replica_id)"
    if "engine_idx" not in _params(OmniPrometheusStatLogger.record):
        return "target changed shape: OmniPrometheusStatLogger.record has no engine_idx"
    if _params(OmniPrometheusStatLogger.register_replica) != ["self", "engine_idx", "stage", "replica"]:
        return "target changed shape: OmniPrometheusStatLogger.register_replica(self, engine_idx, stage, replica)"
    if not isinstance(getattr(OmniPrometheusStatLogger, "stage_replica_map", None), property):
        return "target changed shape: OmniPrometheusStatLogger.stage_replica_map"
    if any(is_ours(fn, REPLICA_METRICS) for fn in targets.values()):
        return None  # our own wrappers are already in place (applied earlier in this process)

    orig_init = OrchestratorBase._init_metrics_state
    orig_process = OrchestratorBase._process_llm_stage_outputs
    orig_removed = OrchestratorBase._remove_stage_replica_waiting
    orig_do_register = MembershipController._do_register
    orig_record = OmniPrometheusStatLogger.record

    @functools.wraps(orig_init)
    def _init_metrics_state(self, stage_pools, *args, **kwargs):
        result = orig_init(self, stage_pools, *args, **kwargs)
        # Back-references for the attach hook, which only sees the membership controller's pools.
        for pool in stage_pools:
            try:
                pool._omnistage_orchestrator = weakref.ref(self)
            except (AttributeError, TypeError):
                pass
        if self._stat_logger is not None:
            self._omnistage_next_engine_idx = None  # computed from the live indices on first use
        return result

    @functools.wraps(orig_process)
    async def _process_llm_stage_outputs(self, stage_id, replica_id, *args, **kwargs):
        sink_key = None
        if self._stat_logger is not None:
            key = (stage_id, replica_id)
            if key not in self._stage_replica_to_engine_idx:
                if attached(self.stage_pools[stage_id], replica_id):
                    # Register with our allocator so upstream's len()-based one never runs.
                    register_replica_series(self, stage_id, replica_id)
                else:
                    # Late batch from a replica that was detached while it was in flight: record
                    # it nowhere rather than resurrecting the series we removed.
                    self._stage_replica_to_engine_idx[key] = SINK_ENGINE_IDX
                    sink_key = key
        try:
            return await orig_process(self, stage_id, replica_id, *args, **kwargs)
        finally:
            if sink_key is not None and self._stage_replica_to_engine_idx.get(sink_key) == SINK_ENGINE_IDX:
                del self._stage_replica_to_engine_idx[sink_key]

    @functools.wraps(orig_removed)
    def _remove_stage_replica_waiting(self, stage_id, replica_id):
        orig_removed(self, stage_id, replica_id)
        try:
            remove_replica_series(self, stage_id, replica_id)
        except Exception:  # metrics must never break the detach path
            logger.exception("removing metric series for stage %s replica %s failed", stage_id, replica_id)

    @functools.wraps(orig_do_register)
    async def _do_register(self, stage_id, replica_id):
        input_addr = await orig_do_register(self, stage_id, replica_id)
        if input_addr is not None:
            orch = _orchestrator_of_pool(self._pool_for_stage_id(stage_id))
            if orch is not None:
                try:
                    register_replica_series(orch, stage_id, replica_id)
                except Exception:  # never fail an attach because of metrics
                    logger.exception("registering metric series for stage %s replica %s failed", stage_id, replica_id)
        return input_addr

    @functools.wraps(orig_record)
    def record(self, *args, **kwargs):
        engine_idx = kwargs.get("engine_idx", args[3] if len(args) > 3 else 0)
        if engine_idx == SINK_ENGINE_IDX:
            return None
        return orig_record(self, *args, **kwargs)

    OrchestratorBase._init_metrics_state = mark(_init_metrics_state, REPLICA_METRICS)
    OrchestratorBase._process_llm_stage_outputs = mark(_process_llm_stage_outputs, REPLICA_METRICS)
    OrchestratorBase._remove_stage_replica_waiting = mark(_remove_stage_replica_waiting, REPLICA_METRICS)
    MembershipController._do_register = mark(_do_register, REPLICA_METRICS)
    OmniPrometheusStatLogger.record = mark(record, REPLICA_METRICS)
    return None


# --------------------------------------------------------------------------------------------
# mm_cache_metrics
# --------------------------------------------------------------------------------------------


def _frontend_renderer(orch: Any) -> Any | None:
    ref = getattr(orch, "_omnistage_engine_ref", None)
    engine = ref() if ref is not None else None
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


def _install_mm_cache_metrics() -> str | None:
    from vllm_omni.engine import orchestrator as orchestrator_module
    from vllm_omni.engine.omni_engine_base import OmniEngineBase
    from vllm_omni.engine.orchestrator import OrchestratorBase

    try:
        source = inspect.getsource(orchestrator_module)
    except (OSError, TypeError):
        source = ""
    if "stat_mm_cache" in source or "mm_cache_stats=" in source:
        return UpstreamFixed("upstream orchestrator already records the frontend multimodal cache stats")
    targets = {
        "OmniEngineBase._bootstrap_orchestrator": getattr(OmniEngineBase, "_bootstrap_orchestrator", None),
        "OrchestratorBase._init_metrics_state": getattr(OrchestratorBase, "_init_metrics_state", None),
        "OrchestratorBase._process_llm_stage_outputs": getattr(OrchestratorBase, "_process_llm_stage_outputs", None),
    }
    for label, fn in targets.items():
        if not callable(fn):
            return f"target changed shape: {label} is missing"
    if _params(OrchestratorBase._process_llm_stage_outputs)[:3] != ["self", "stage_id", "replica_id"]:
        return "target changed shape: OrchestratorBase._process_llm_stage_outputs(self, stage_id, replica_id, ...)"
    if _params(OmniEngineBase._bootstrap_orchestrator)[:1] != ["self"]:
        return "target changed shape: OmniEngineBase._bootstrap_orchestrator"
    if _params(OrchestratorBase._init_metrics_state)[:2] != ["self", "stage_pools"]:
        return "target changed shape: OrchestratorBase._init_metrics_state(self, stage_pools, ...)"
    from vllm.renderers.base import BaseRenderer

    if not callable(getattr(BaseRenderer, "stat_mm_cache", None)):
        return "target changed shape: vllm BaseRenderer.stat_mm_cache is missing"
    if any(is_ours(fn, MM_CACHE_METRICS) for fn in targets.values()):
        return None  # our own wrappers are already in place

    orig_bootstrap = OmniEngineBase._bootstrap_orchestrator
    orig_init = OrchestratorBase._init_metrics_state
    orig_process = OrchestratorBase._process_llm_stage_outputs

    @functools.wraps(orig_bootstrap)
    def _bootstrap_orchestrator(self, *args, **kwargs):
        token = _CURRENT_ENGINE.set(weakref.ref(self))
        try:
            return orig_bootstrap(self, *args, **kwargs)
        finally:
            _CURRENT_ENGINE.reset(token)

    @functools.wraps(orig_init)
    def _init_metrics_state(self, *args, **kwargs):
        result = orig_init(self, *args, **kwargs)
        engine_ref = _CURRENT_ENGINE.get()
        if engine_ref is not None:
            self._omnistage_engine_ref = engine_ref
        renderer = _frontend_renderer(self)
        if renderer is not None and getattr(renderer, "_mm_cache_stats", None) is not None:
            # Zero-valued from startup, so a dashboard sees the series before the first request.
            _frontend_children(self)
        return result

    @functools.wraps(orig_process)
    async def _process_llm_stage_outputs(self, stage_id, replica_id, *args, **kwargs):
        result = await orig_process(self, stage_id, replica_id, *args, **kwargs)
        if stage_id == 0 and self._stat_logger is not None:
            try:
                record_frontend_mm_cache(self)
            except Exception:  # metrics must never break output processing
                logger.exception("recording frontend multimodal cache stats failed")
        return result

    OmniEngineBase._bootstrap_orchestrator = mark(_bootstrap_orchestrator, MM_CACHE_METRICS)
    OrchestratorBase._init_metrics_state = mark(_init_metrics_state, MM_CACHE_METRICS)
    OrchestratorBase._process_llm_stage_outputs = mark(_process_llm_stage_outputs, MM_CACHE_METRICS)
    return None


def apply() -> list[Outcome]:
    return [
        apply_patch(REPLICA_METRICS, _install_replica_metrics),
        apply_patch(MM_CACHE_METRICS, _install_mm_cache_metrics),
    ]


__all__ = [
    "MM_CACHE_METRICS",
    "REPLICA_METRICS",
    "apply",
    "enabled",
    "record_frontend_mm_cache",
    "register_replica_series",
    "remove_replica_series",
    "series_registered",
]
