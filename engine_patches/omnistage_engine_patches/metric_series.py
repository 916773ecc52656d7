"""The metric series of stage replicas, as replicas join and leave (vllm-omni 0.30.0).

vllm-omni's ``OmniPrometheusStatLogger`` relabels vLLM's ``vllm:*`` families from ``engine`` to
``stage`` + ``replica``. This is the bookkeeping the ``replica_metrics`` patch adds on top: a
replica's series registered at once (zero-valued) when the head attaches it, and removed, with the
engine-idx tables, when it is detached. The membership hooks and the endpoint call it too; every
function here is a no-op when stats are off, and runs on the orchestrator's event loop (the stats
path, the membership controller and the endpoint all execute there), so the per-engine tables are
never mutated concurrently with ``record``.
"""

from __future__ import annotations

import logging
from typing import Any

from . import contract
from ._patching import NEXT_ENGINE_IDX, applied

logger = logging.getLogger("omnistage_engine_patches.metric_series")

# Engine index that swallows a stats batch (patches/replica_metrics.py). Real indices are >= 0.
SINK_ENGINE_IDX = -1


def enabled() -> bool:
    """True when the ``replica_metrics`` patch is applied in this process."""
    return applied(contract.REPLICA_METRICS)


def attached(pool: Any, replica_id: int) -> bool:
    """Whether the pool holds a client for the replica (the head attached it)."""
    clients = getattr(pool, "clients", None) or []
    return 0 <= replica_id < len(clients) and clients[replica_id] is not None


def _next_engine_idx(orch: Any) -> int:
    stat_logger = orch._stat_logger
    used = set(orch._stage_replica_to_engine_idx.values()) | set(stat_logger.stage_replica_map)
    nxt = getattr(orch, NEXT_ENGINE_IDX, None)
    if nxt is None:
        nxt = max((i for i in used if i >= 0), default=-1) + 1
    while nxt in used:
        nxt += 1
    setattr(orch, NEXT_ENGINE_IDX, nxt + 1)
    return nxt


def series_registered(orch: Any, stage_id: int, replica_id: int) -> bool:
    stat_logger = getattr(orch, "_stat_logger", None)
    if stat_logger is None:
        return False
    idx = getattr(orch, "_stage_replica_to_engine_idx", {}).get((stage_id, replica_id))
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
            isinstance(v, _RelabelMixin)
            or (isinstance(v, list) and all(isinstance(i, _RelabelMixin) for i in v))
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
    """Remove (stage, replica)'s series and bookkeeping. Idempotent; returns children removed.
    An orchestrator whose metrics state was never built (no engine-idx map: stats off, or built
    by a test without _init_metrics_state) has nothing to remove."""
    stage, replica = str(stage_id), str(replica_id)
    removed = 0
    stat_logger = getattr(orch, "_stat_logger", None)
    mapping = getattr(orch, "_stage_replica_to_engine_idx", None)
    idx = mapping.pop((stage_id, replica_id), None) if mapping is not None else None
    if stat_logger is not None:
        from vllm_omni.metrics import stat_logger as omni_stat_logger

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
        logger.info(
            "metric series removed for stage %d replica %d (%d children)", stage_id, replica_id, removed
        )
    return removed
