"""manifests/monitoring's alert rules and Grafana dashboard name only metrics that something exports
(issue 21, item 3).

What is exported is read from the code, not listed here: every Counter, Gauge, Histogram, Summary
and *MetricFamily built with a literal name in operator/omnistage/ and in the engine plugin, and the
`vllm:*` families the installed vLLM and vllm-omni build (their metric modules, parsed without
importing them). Series names follow prometheus_client's exposition: a counter `x` is `x_total`, a
histogram `x` is `x_bucket`, `x_sum` and `x_count`. The objects themselves are validated against
the real Prometheus Operator CRDs by tests/cluster/test_install.py.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "manifests" / "monitoring"
RULES = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
DASHBOARD = json.loads((MONITORING / "dashboards" / "omnistage.json").read_text())
# A metric name in PromQL: the project's own and vLLM's (nothing else is queried).
METRIC = re.compile(r"(?<![\w:])(omnistage_[A-Za-z0-9_]+|vllm:[A-Za-z0-9_:]+)")

SUFFIXES = {
    "Counter": ["_total"],
    "CounterMetricFamily": ["_total"],
    "Gauge": [""],
    "GaugeMetricFamily": [""],
    "Histogram": ["_bucket", "_sum", "_count"],
    "HistogramMetricFamily": ["_bucket", "_sum", "_count"],
    "Summary": ["_sum", "_count"],
    "SummaryMetricFamily": ["_sum", "_count"],
}
# vLLM builds its metrics through class attributes (self._counter_cls(name=...)).
ALIASES = {"_counter_cls": "Counter", "_gauge_cls": "Gauge", "_histogram_cls": "Histogram"}


def _metric_calls(path: Path) -> set[str]:
    """The series names of the metrics the file builds with a literal name."""
    text, out = path.read_text(), set()
    if "omnistage_" not in text and "vllm:" not in text:
        return out  # parsing all of vllm-omni would take a minute on 2 cores
    for node in ast.walk(ast.parse(text, str(path))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        kind = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        kind = ALIASES.get(kind, kind)
        if kind not in SUFFIXES:
            continue
        names = [kw.value for kw in node.keywords if kw.arg == "name"] or node.args[:1]
        if names and isinstance(names[0], ast.Constant) and isinstance(names[0].value, str):
            name = names[0].value
            base = name.removesuffix("_total") if kind.startswith("Counter") else name
            out |= {base + s for s in SUFFIXES[kind]}
    return out


def _exported(*dirs: Path) -> set[str]:
    return set().union(*(_metric_calls(p) for d in dirs for p in d.rglob("*.py")))


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)  # locates, does not import
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


@pytest.fixture(scope="module")
def exported() -> set[str]:
    names = _exported(ROOT / "operator" / "omnistage", ROOT / "engine_patches" / "omnistage_engine_patches")
    vllm, omni = _package_dir("vllm"), _package_dir("vllm_omni")
    if vllm is None:
        pytest.skip("vLLM is not installed here (the engine extra): its metric names cannot be read")
    names |= _exported(vllm / "v1" / "metrics", *([omni] if omni else []))
    return names


def _queries() -> list[tuple[str, str]]:
    out = [(f"alert {r['alert']}", r["expr"]) for g in RULES["spec"]["groups"] for r in g["rules"]]
    for panel in DASHBOARD["panels"]:
        out += [(f"panel {panel['title']!r}", t["expr"]) for t in panel.get("targets", [])]
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["query"]["query"]))
    return out


def test_the_code_exports_what_the_operator_documents(exported):
    # The reader's sanity check on the parser: the families docs/membership-and-metrics.md lists.
    assert {
        "omnistage_replicas",
        "omnistage_condition",
        "omnistage_engine_patch",
        "omnistage_operator_leader",
        "omnistage_reconcile_errors_total",
        "omnistage_membership_calls_total",
        "omnistage_reconcile_duration_seconds_bucket",
        "vllm:num_requests_waiting",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:mm_cache_hits_total",
    } <= exported


@pytest.mark.parametrize("where,query", _queries(), ids=[w for w, _ in _queries()])
def test_every_query_names_exported_metrics(exported, where, query):
    named = set(METRIC.findall(query))
    assert named, f"{where}: names no omnistage_* or vllm:* metric: {query}"
    assert named <= exported, f"{where}: nothing exports {sorted(named - exported)}"


def test_the_dashboard_is_well_formed():
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for p in DASHBOARD["panels"]:
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        # One data source variable, so the dashboard imports into any Grafana.
        for t in p.get("targets", []):
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]


def test_the_docs_list_every_alert_as_shipped():
    docs = (ROOT / "docs" / "membership-and-metrics.md").read_text()
    rules = [r for g in RULES["spec"]["groups"] for r in g["rules"]]
    rows = [f"| `{r['alert']}` | `{r['expr']}` | {r['for']} |" for r in rules]
    assert [row for row in rows if row not in docs] == []
