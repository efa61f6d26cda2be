"""The examples stay in step with what the package exports.

The dashboard's queries are checked against a real export, not against a list: an instrumented
reference engine with ranks on its resource (the launcher's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
and ``OTEL_SWA_*_RANK``) and the SDK's host detector runs a trace slice into an in-memory reader; its
metric names and attribute keys, turned into the names the Collector's Prometheus exporter gives
them, are the only ones a query may use.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DASHBOARD = EXAMPLES / "grafana" / "otel-swa-dashboard.json"
COLLECTOR = EXAMPLES / "collector" / "otelcol-config.yaml"

#: PromQL words that look like names in an expression but are not metrics or labels.
PROMQL = {"sum", "max", "min", "avg", "by", "without", "rate", "increase", "histogram_quantile", "le",
          "rate_interval", "__rate_interval", "service", "host"}
#: Labels Prometheus itself adds to every scraped series (job and instance) or the histogram's bucket bound.
PROMETHEUS_LABELS = {"job", "instance", "le"}


def prometheus_name(name: str, unit: str, kind: str) -> set[str]:
    """The names Prometheus gets for a metric from the Collector's Prometheus exporter (its default
    naming, with suffixes: dots to underscores, unit ``By`` -> ``_bytes``, unit ``1`` on a gauge ->
    ``_ratio``, ``{...}`` units nothing; ``_total`` on a monotonic sum; ``_bucket``/``_sum``/``_count``
    on a histogram) and from the SDK's Prometheus exporter (``OTEL_METRICS_EXPORTER=prometheus``),
    which gives unit ``1`` no suffix (the names it really gives are scraped in test_prometheus.py)."""
    base = name.replace(".", "_")
    bases = {base}
    if unit == "By":
        bases = {base + "_bytes"}
    elif unit == "1" and kind == "gauge":
        bases = {base + "_ratio", base}
    if kind == "counter":
        return {b + "_total" for b in bases}
    if kind == "histogram":
        return {b + suffix for b in bases for suffix in ("_bucket", "_sum", "_count")}
    return bases


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(Prometheus metric names, label names) of a real export."""
    import torch
    from opentelemetry.sdk.metrics._internal.point import Histogram, Sum

    from opentelemetry.instrumentation.swa_reference import SwaReferenceInstrumentor
    from otel_swa.reference.engine import EngineConfig, ReferenceEngine
    from otel_swa.reference.trace import TraceRequest, load_trace
    from otel_swa.telemetry import configure

    patch = pytest.MonkeyPatch()
    patch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "5")
    patch.setenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", "otel,host")
    reader = InMemoryMetricReader()
    environ = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "OTEL_SWA_TP_RANK": "1", "OTEL_SWA_PP_RANK": "1",
               "OTEL_SWA_DP_RANK": "0"}
    telemetry = configure(exporters="none", metric_readers=[reader], use_global=False, set_global=False,
                          environ=environ, default_service_name="dashboard-test")
    instrumentor = SwaReferenceInstrumentor()
    instrumentor.instrument(meter_provider=telemetry.meter_provider, tracer_provider=telemetry.tracer_provider,
                            logger_provider=telemetry.logger_provider)
    try:
        engine = ReferenceEngine(EngineConfig(window=16, full_pool_size=4096, swa_pool_size=512, max_running=8,
                                              token_budget=128, max_context_len=2048, step_time_s=0.0))
        for request in load_trace("conv", limit=10):  # scaled down: the model runs, briefly
            engine.submit(TraceRequest(0.0, request.context_tokens // 16 + 1, request.generated_tokens // 8 + 1))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            engine.run_until_done()
        finally:
            torch.set_num_threads(threads)
        data = reader.get_metrics_data()
    finally:
        instrumentor.uninstrument()
        telemetry.shutdown()
        patch.undo()
    names, labels = set(), set()
    for resource in data.resource_metrics:
        labels |= {key.replace(".", "_") for key in resource.resource.attributes}
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                kind = ("counter" if isinstance(metric.data, Sum) and metric.data.is_monotonic
                        else "histogram" if isinstance(metric.data, Histogram) else "gauge")
                names |= prometheus_name(metric.name, metric.unit, kind)
                for point in metric.data.data_points:
                    labels |= {key.replace(".", "_") for key in point.attributes}
    return names, labels | PROMETHEUS_LABELS


def queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [(target["expr"], target.get("legendFormat", "")) for panel in dashboard["panels"]
             for target in panel.get("targets", ())]
    found += [(variable["query"]["query"], "") for variable in dashboard["templating"]["list"]
              if isinstance(variable.get("query"), dict)]
    return found


def test_every_query_names_a_metric_and_labels_the_package_exports(exported):
    names, labels = exported
    used_metrics, used_labels = set(), set()
    for expr, legend in queries():
        metrics = set(re.findall(r"\b(kv_cache_[a-z_]+)", re.sub(r"\bby \([^)]*\)", "", expr)))  # labels aside
        assert metrics, f"a query names no otel-swa metric: {expr}"
        used_metrics |= metrics
        without_strings = re.sub(r'"[^"]*"', '""', expr)
        groupings = re.findall(r"\bby \(([^)]*)\)", without_strings)
        matchers = re.findall(r"([a-z_]+)\s*=~?", without_strings)
        values = re.findall(r"label_values\([a-z_]+, ([a-z_]+)\)", without_strings)
        for label in [l.strip() for g in groupings for l in g.split(",")] + matchers + values:
            used_labels.add(label)
        used_labels |= set(re.findall(r"\{\{([a-z_]+)\}\}", legend))
    assert used_metrics - names == set(), "metrics the package does not export"
    assert used_labels - labels == set(), "labels the package does not export"


def test_the_dashboard_shows_fleet_and_per_rank_panels_for_every_pool_figure():
    exprs = [expr for expr, _ in queries()]
    # the record metrics, the pools and the savings are all shown
    for metric in ("kv_cache_swa_tokens_out_of_window", "kv_cache_swa_tokens_divergent",
                   "kv_cache_swa_entries_verified_total", "kv_cache_swa_forward_steps_total",
                   "kv_cache_pool_tokens_used", "kv_cache_pool_tokens_available", "kv_cache_pool_tokens_evictable",
                   "kv_cache_pool_tokens_limit", "kv_cache_pool_utilization_ratio", "kv_cache_swa_memory_saved_bytes"):
        assert any(metric in expr for expr in exprs), metric
    # fleet: max over ranks for gauges (per pool for the pools), sum for counters
    assert 'max by (pool) (kv_cache_pool_utilization_ratio{' in " ".join(exprs)
    assert any(expr.startswith("sum(rate(kv_cache_swa_forward_steps_total{") for expr in exprs)
    # per rank: grouped by the three parallel ranks
    assert any("by (pool, otel_swa_tp_rank, otel_swa_pp_rank, otel_swa_dp_rank" in expr for expr in exprs)
    titles = [panel["title"] for panel in json.loads(DASHBOARD.read_text())["panels"] if panel["type"] == "row"]
    assert [t.split(":")[0].split(" (")[0] for t in titles] == ["Fleet", "Per host", "Per rank"]


def test_collector_config_has_otlp_in_host_identity_and_prometheus_and_debug_out():
    text = COLLECTOR.read_text()
    lines = [line.split("#", 1)[0].rstrip() for line in text.splitlines()]
    lines = [line for line in lines if line.strip()]
    assert "      exporters: [prometheus, debug]" in lines  # the metrics pipeline
    assert lines.count("      receivers: [otlp]") == 3  # metrics, traces, logs
    assert lines.count("      processors: [resourcedetection, batch]") == 3  # host.name on every signal
    assert "    detectors: [env, system]" in lines and "    override: false" in lines
    assert "    enable_open_metrics: true" in lines  # exemplars need OpenMetrics
    assert "      enabled: true" in lines  # resource attributes (ranks, host) become labels
    assert {"      grpc:", "      http:"} <= set(lines)
