"""The metric points of one golden run (:data:`SCENARIO` of :mod:`golden_scenarios`), read with the
OpenTelemetry SDK's in-memory reader: every metric's name, kind, unit and description, and each
point's attributes and value, as JSON (:data:`FILE` under ``tests/golden/data/``).

The replay runs with OpenTelemetry on (``OTEL_METRICS_EXPORTER=none``: the SDK pipeline, no
exporter) and the in-memory reader added to the providers ``otel_swa.telemetry.configure`` builds
(no global provider set). Left out as measured, not computed: timestamps, exemplars (trace ids),
and of a histogram whose unit is a time, everything but its count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import golden_scenarios

#: The golden run whose metric points are kept: faults of the slot audit and of provenance, the
#: read and write checks on.
SCENARIO = "foreign_corrupt"
FILE = "foreign_corrupt.metrics.json"
_TIME_UNITS = ("s", "ms", "us", "ns")


def collect(workdir: Path) -> list:
    """Run :data:`SCENARIO` with the in-memory reader; its metrics (``ResourceMetrics`` list)."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    import otel_swa.telemetry as telemetry

    class Reader(InMemoryMetricReader):
        last = None

        def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
            self.last = self.get_metrics_data()

    reader = Reader()
    real = telemetry.configure

    def configure(**kwargs):
        kwargs.update(exporters="none", metric_readers=[reader], use_global=False, set_global=False)
        return real(**kwargs)

    scenario = next(s for s in golden_scenarios.SCENARIOS if s.name == SCENARIO)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(telemetry, "configure", configure)
        golden_scenarios.run(golden_scenarios.Scenario(
            scenario.name, scenario.argv, {**scenario.env, "OTEL_METRICS_EXPORTER": "none"},
            scenario.engine_fault, scenario.patch), workdir)
    data = reader.last or reader.get_metrics_data()
    return list(data.resource_metrics) if data is not None else []


def _value(point, unit: str) -> dict:
    if hasattr(point, "bucket_counts"):  # a histogram
        if unit in _TIME_UNITS:
            return {"count": point.count}
        return {"count": point.count, "sum": point.sum, "min": point.min, "max": point.max,
                "bucket_counts": list(point.bucket_counts), "explicit_bounds": list(point.explicit_bounds)}
    return {"value": point.value}


def dump(resource_metrics: list) -> str:
    """The metrics as sorted JSON text (one metric per entry, points sorted by attributes)."""
    metrics = []
    for rm in resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points = [{"attributes": dict(sorted(point.attributes.items())), **_value(point, metric.unit)}
                          for point in metric.data.data_points]
                points.sort(key=lambda p: json.dumps(p["attributes"], sort_keys=True))
                metrics.append({"name": metric.name, "kind": type(metric.data).__name__, "unit": metric.unit,
                                "description": metric.description, "scope": sm.scope.name, "points": points})
    metrics.sort(key=lambda m: (m["name"], m["scope"]))
    return json.dumps(metrics, indent=1, sort_keys=False) + "\n"
