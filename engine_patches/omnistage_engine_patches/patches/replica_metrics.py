"""Patch ``replica_metrics``: metric series that follow stage membership (vllm-omni 0.30.0).

Defect: in 0.30.0 a replica gets its ``vllm:*`` series (relabelled to ``stage`` + ``replica`` by
``OmniPrometheusStatLogger``) lazily, on its first stats tick (``OrchestratorBase.
_process_llm_stage_outputs``), and nothing ever removes them: a departed replica's gauges freeze at
their last value and, because replica ids are never reused, the label set grows for the life of
the head.

What the wrappers do (the bookkeeping is metric_series.py's):
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

mm_cache_metrics wraps ``_init_metrics_state`` and ``_process_llm_stage_outputs`` too; neither
depends on the order of the two wrappers (patches/__init__.py).

Switch off: ``OMNISTAGE_DISABLE_PATCHES=replica_metrics``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Any

from .. import contract
from .._patching import UpstreamFixed, argument, is_ours, mark
from ..metric_series import SINK_ENGINE_IDX, attached, register_replica_series, remove_replica_series

logger = logging.getLogger("omnistage_engine_patches.replica_metrics")

NAME = contract.REPLICA_METRICS


def _orchestrator_of_pool(pool: Any) -> Any | None:
    ref = getattr(pool, "_omnistage_orchestrator", None)
    return ref() if ref is not None else None


def _params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def install() -> str | None:
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
    engine_idx_of = argument(OmniPrometheusStatLogger.record, "engine_idx")
    if engine_idx_of is None:  # the wrapper reads it where record declares it, with its default
        return "target changed shape: OmniPrometheusStatLogger.record has no engine_idx=... parameter"
    if _params(OmniPrometheusStatLogger.register_replica) != ["self", "engine_idx", "stage", "replica"]:
        return "target changed shape: OmniPrometheusStatLogger.register_replica(self, engine_idx, stage, replica)"
    if not isinstance(getattr(OmniPrometheusStatLogger, "stage_replica_map", None), property):
        return "target changed shape: OmniPrometheusStatLogger.stage_replica_map"
    if any(is_ours(fn, NAME) for fn in targets.values()):
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
        if engine_idx_of(args, kwargs) == SINK_ENGINE_IDX:
            return None
        return orig_record(self, *args, **kwargs)

    OrchestratorBase._init_metrics_state = mark(_init_metrics_state, NAME)
    OrchestratorBase._process_llm_stage_outputs = mark(_process_llm_stage_outputs, NAME)
    OrchestratorBase._remove_stage_replica_waiting = mark(_remove_stage_replica_waiting, NAME)
    MembershipController._do_register = mark(_do_register, NAME)
    OmniPrometheusStatLogger.record = mark(record, NAME)
    return None
