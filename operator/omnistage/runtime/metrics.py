"""Operator metrics: counters and histograms updated inline, and a Collector that reports the
latest observed state of every OmniStage at scrape time (crate-operator's pattern)."""

from __future__ import annotations

import threading
from typing import Any

from omnistage_engine_patches import contract
from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from . import memory

RECONCILE_SECONDS = Histogram(
    "omnistage_reconcile_duration_seconds", "Time one reconcile of an OmniStage took.", ["namespace", "name"])
RECONCILE_ERRORS = Counter(
    "omnistage_reconcile_errors_total",
    "Reconciles that raised, by error type.",
    ["namespace", "name", "error"],
)
MEMBERSHIP_CALLS = Counter(
    "omnistage_membership_calls_total", "Calls to the engine head's membership endpoint.", ["op", "result"])
MEMBERSHIP_SECONDS = Histogram(
    "omnistage_membership_call_duration_seconds", "Latency of membership calls.", ["op"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
API_REQUESTS = Counter(
    "omnistage_operator_api_requests_total",
    "Requests this operator replica sent the Kubernetes API server through its client (kube.py: the "
    "watch-fed stores, writes, the leader-election Lease; kopf watches nothing), by verb "
    "(get, list, watch, create, update, patch, delete) and resource.", ["verb", "resource"])


_series_lock = threading.Lock()
_error_types: dict[tuple[str, str], set[str]] = {}  # the RECONCILE_ERRORS label values made per OmniStage


def reconcile_failed(namespace: str, name: str, error: str) -> None:
    with _series_lock:
        _error_types.setdefault((namespace, name), set()).add(error)
    RECONCILE_ERRORS.labels(namespace, name, error).inc()


def forget(namespace: str, name: str) -> None:
    """Remove every series of a deleted OmniStage: at fleet scale, series of OmniStages long gone
    would otherwise grow the scrape (and Prometheus' memory) without end."""
    with _series_lock:
        errors = _error_types.pop((namespace, name), set())
    for error in errors:
        try:
            RECONCILE_ERRORS.remove(namespace, name, error)
        except KeyError:
            pass
    try:
        RECONCILE_SECONDS.remove(namespace, name)
    except KeyError:
        pass
    STATUS.observe(namespace, name, None)


memory.register(forget)


class StatusCollector(Collector):
    """Reads the status each reconcile last wrote; nothing here is state the operator acts on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[tuple[str, str], dict[str, Any]] = {}

    def count(self) -> int:
        with self._lock:
            return len(self._status)

    def observe(self, namespace: str, name: str, status: dict[str, Any] | None) -> None:
        with self._lock:
            if status is None:
                self._status.pop((namespace, name), None)
            else:
                self._status[(namespace, name)] = status

    def collect(self):
        replicas = GaugeMetricFamily("omnistage_replicas", "Stage-0 engine replicas by state.",
                                     labels=["namespace", "name", "state"])
        conditions = GaugeMetricFamily(
            "omnistage_condition",
            "OmniStage conditions (1 when the status matches).",
            labels=["namespace", "name", "type", "status"],
        )
        patches = GaugeMetricFamily(
            "omnistage_engine_patch",
            "Engine patch outcomes the head reported (1 for the outcome in effect).",
            labels=["namespace", "name", "patch", "outcome"],
        )
        with self._lock:
            items = list(self._status.items())
        for (ns, name), st in items:
            for state, key in (
                ("desired", "desiredReplicas"),
                ("existing", "replicas"),
                ("ready", "readyReplicas"),
                ("registered", "registeredReplicas"),
                ("updated", "updatedReplicas"),
                ("standby", "standbyReplicas"),  # standbys (spec.standby): in none of the counts above
                ("standby_ready", "readyStandbyReplicas"),
            ):
                if key in st:
                    replicas.add_metric([ns, name, state], st[key])
            for c in st.get("conditions", []):
                for status in ("True", "False"):
                    conditions.add_metric(
                        [ns, name, c["type"], status], 1.0 if c["status"] == status else 0.0
                    )
            for patch, outcome in ((st.get("engine") or {}).get("patches") or {}).items():
                for value in contract.OUTCOMES:
                    patches.add_metric([ns, name, patch, value], 1.0 if outcome == value else 0.0)
        yield replicas
        yield conditions
        yield patches


STATUS = StatusCollector()
REGISTRY.register(STATUS)


def serve(port: int, bind: str) -> None:
    if port:
        start_http_server(port, addr=bind)
