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
      already-detached replica, or from a standby (held: its series were removed), to a sink
      instead of resurrecting its series.

mm_cache_metrics wraps ``_init_metrics_state`` and ``_process_llm_stage_outputs`` too; neither
depends on the order of the two wrappers (patches/__init__.py).

Switch off: ``OMNISTAGE_DISABLE_PATCHES=replica_metrics``.
"""

from __future__ import annotations

import logging
import weakref

from .. import contract
from .._patching import (
    NEXT_ENGINE_IDX,
    ORCHESTRATOR,
    Target,
    UpstreamFixed,
    argument,
    ours,
    referent,
    shape_problem,
    wrap,
)
from ..metric_series import SINK_ENGINE_IDX, attached, register_replica_series, remove_replica_series
from .membership import held_of

logger = logging.getLogger("omnistage_engine_patches.replica_metrics")

NAME = contract.REPLICA_METRICS


def install() -> str | None:
    from vllm_omni.engine.membership_controller import MembershipController
    from vllm_omni.engine.orchestrator import OrchestratorBase
    from vllm_omni.metrics.stat_logger import OmniPrometheusStatLogger

    for name in ("unregister_replica", "deregister_replica", "remove_replica"):
        if hasattr(OmniPrometheusStatLogger, name):
            return UpstreamFixed(
                f"upstream OmniPrometheusStatLogger.{name} exists: series removal is already upstream"
            )
    targets = (
        Target(OrchestratorBase, "_init_metrics_state", ("self", "stage_pools"), more=True),
        Target(OrchestratorBase, "_process_llm_stage_outputs", ("self", "stage_id", "replica_id"), more=True,
               coroutine=True),
        Target(OrchestratorBase, "_remove_stage_replica_waiting", ("self", "stage_id", "replica_id")),
        Target(MembershipController, "_do_register", ("self", "stage_id", "replica_id"), coroutine=True),
        Target(OmniPrometheusStatLogger, "record"),
        Target(OmniPrometheusStatLogger, "register_replica", ("self", "engine_idx", "stage", "replica")),
    )
    # Shape checks first (they see through wrappers via __wrapped__), so a target replaced by
    # something else is reported even when our wrappers sit on the others.
    problem = shape_problem(*targets)
    if problem:
        return problem
    engine_idx_of = argument(OmniPrometheusStatLogger.record, "engine_idx")
    if engine_idx_of is None:  # the wrapper reads it where record declares it, with its default
        return "target changed shape: OmniPrometheusStatLogger.record has no engine_idx=... parameter"
    if not isinstance(getattr(OmniPrometheusStatLogger, "stage_replica_map", None), property):
        return "target changed shape: OmniPrometheusStatLogger.stage_replica_map"
    if ours(NAME, *targets):
        return None  # our own wrappers are already in place (applied earlier in this process)

    @wrap(OrchestratorBase, "_init_metrics_state", NAME)
    def _init_metrics_state(orig, self, stage_pools, *args, **kwargs):
        result = orig(self, stage_pools, *args, **kwargs)
        # Back-references for the attach hook, which only sees the membership controller's pools.
        for pool in stage_pools:
            try:
                setattr(pool, ORCHESTRATOR, weakref.ref(self))
            except (AttributeError, TypeError):
                pass
        if self._stat_logger is not None:
            setattr(self, NEXT_ENGINE_IDX, None)  # computed from the live indices on first use
        return result

    @wrap(OrchestratorBase, "_process_llm_stage_outputs", NAME)
    async def _process_llm_stage_outputs(orig, self, stage_id, replica_id, *args, **kwargs):
        sink_key = None
        if self._stat_logger is not None:
            key = (stage_id, replica_id)
            if key not in self._stage_replica_to_engine_idx:
                pool = self.stage_pools[stage_id]
                if attached(pool, replica_id) and replica_id not in held_of(pool):
                    # Register with our allocator so upstream's len()-based one never runs.
                    register_replica_series(self, stage_id, replica_id)
                else:
                    # Late batch from a replica that was detached while it was in flight, or a
                    # standby's idle tick (a hold removed its series; a join makes them again):
                    # record it nowhere rather than resurrecting the series we removed.
                    self._stage_replica_to_engine_idx[key] = SINK_ENGINE_IDX
                    sink_key = key
        try:
            return await orig(self, stage_id, replica_id, *args, **kwargs)
        finally:
            if sink_key is not None and self._stage_replica_to_engine_idx.get(sink_key) == SINK_ENGINE_IDX:
                del self._stage_replica_to_engine_idx[sink_key]

    @wrap(OrchestratorBase, "_remove_stage_replica_waiting", NAME)
    def _remove_stage_replica_waiting(orig, self, stage_id, replica_id):
        orig(self, stage_id, replica_id)
        try:
            remove_replica_series(self, stage_id, replica_id)
        except Exception:  # metrics must never break the detach path
            logger.exception("removing metric series for stage %s replica %s failed", stage_id, replica_id)

    @wrap(MembershipController, "_do_register", NAME)
    async def _do_register(orig, self, stage_id, replica_id):
        input_addr = await orig(self, stage_id, replica_id)
        if input_addr is not None:
            orch = referent(self._pool_for_stage_id(stage_id), ORCHESTRATOR)
            if orch is not None:
                try:
                    register_replica_series(orch, stage_id, replica_id)
                except Exception:  # never fail an attach because of metrics
                    logger.exception(
                        "registering metric series for stage %s replica %s failed", stage_id, replica_id
                    )
        return input_addr

    @wrap(OmniPrometheusStatLogger, "record", NAME)
    def record(orig, self, *args, **kwargs):
        if engine_idx_of(args, kwargs) == SINK_ENGINE_IDX:
            return None
        return orig(self, *args, **kwargs)

    return None
