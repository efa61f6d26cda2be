"""The examples stay in step with the instrument table."""

from __future__ import annotations

import json
import re
from pathlib import Path

from otel_swa.telemetry import INSTRUMENTS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def prometheus_names() -> set[str]:
    """Names the Collector's Prometheus exporter gives our instruments: dots to underscores,
    ``_total`` on counters, ``_bucket``/``_sum``/``_count`` on histograms; ``{...}`` units add nothing."""
    names = set()
    for spec in INSTRUMENTS:
        base = spec.name.replace(".", "_")
        if spec.kind in ("counter", "event_counter", "observable_counter"):
            names.add(base + "_total")
        elif spec.kind == "histogram":
            names |= {base + "_bucket", base + "_sum", base + "_count"}
        else:
            names.add(base)
    return names


def test_dashboard_queries_only_metrics_that_exist():
    dashboard = json.loads((EXAMPLES / "grafana" / "otel-swa-dashboard.json").read_text())
    known = prometheus_names()
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"kv_cache_swa_[a-z_]+", target["expr"]))
    assert used, "the dashboard queries no otel-swa metric"
    assert used <= known, used - known
    # the four record metrics are all shown
    assert {"kv_cache_swa_tokens_out_of_window", "kv_cache_swa_tokens_divergent",
            "kv_cache_swa_entries_verified_total", "kv_cache_swa_forward_steps_total"} <= used


def test_collector_config_has_otlp_in_and_prometheus_and_debug_out():
    text = (EXAMPLES / "collector" / "otelcol-config.yaml").read_text()
    lines = [line.split("#", 1)[0].rstrip() for line in text.splitlines()]
    lines = [line for line in lines if line.strip()]
    assert "      exporters: [prometheus, debug]" in lines  # the metrics pipeline
    assert lines.count("      receivers: [otlp]") == 3  # metrics, traces, logs
    assert "    enable_open_metrics: true" in lines  # exemplars need OpenMetrics
    assert {"      grpc:", "      http:"} <= set(lines)
