"""What bounds a stop: a flush never waits longer than its time, whatever a provider does; SIGTERM
leaves the process its OTLP timeout; metrics leave on a bounded schedule while an engine runs, so
that a kill from outside loses at most that much.
"""

from __future__ import annotations

import threading
import time

import pytest
from collector_support import RotelCollector

from otel_swa import config, lifecycle
from otel_swa.config import ConfigError


class _Provider:
    """A provider whose ``force_flush`` takes ``seconds`` (an exporter stuck on a collector that is down)."""

    def __init__(self, seconds: float, result: bool = True) -> None:
        self.seconds, self.result = seconds, result
        self.finished = threading.Event()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        time.sleep(self.seconds)
        self.finished.set()
        return self.result


def test_a_stuck_provider_does_not_hold_the_flush_or_the_others(monkeypatch):
    monkeypatch.setattr(lifecycle, "_providers", [])
    stuck, quick, failing = _Provider(30.0), _Provider(0.0), _Provider(0.0, result=False)
    lifecycle.track(providers=[stuck, quick, failing])
    result = lifecycle.flush_all(0.5)
    # flushed side by side: the quick one made it, the stuck one was left exporting, not waited for
    assert quick.finished.is_set() and failing.finished.is_set() and not stuck.finished.is_set()
    assert (result.providers, result.failed) == (1, 2)


def test_the_default_flush_bound_is_the_otlp_timeout(monkeypatch):
    monkeypatch.setattr(lifecycle, "_providers", [])
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.4")
    stuck = _Provider(30.0)
    lifecycle.track(providers=[stuck])
    result = lifecycle.flush_all()
    assert (result.providers, result.failed) == (0, 1) and not stuck.finished.is_set()


@pytest.mark.parametrize("environ, expected", [
    ({}, 10.0),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "2"}, 2.0),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "2", "OTEL_EXPORTER_OTLP_LOGS_TIMEOUT": "7.5"}, 7.5),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "abc"}, 10.0),  # reported by the OTLP checks, not here
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "-1"}, 10.0),
])
def test_otlp_timeout_is_the_longest_one_set_in_seconds(environ, expected):
    assert config.otlp_timeout_s(environ) == expected


def test_sigterm_leaves_the_process_time_to_end_within_the_otlp_timeout(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "10")
    assert lifecycle.sigterm_flush_timeout_s() == 10 - lifecycle.SIGTERM_EXIT_MARGIN_S
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.2")  # a tenth of a tiny timeout, never negative
    assert 0 < lifecycle.sigterm_flush_timeout_s() <= 0.2


@pytest.mark.parametrize("value, expected", [(None, 5000), ("0", 0), ("250", 250)])
def test_metric_export_interval_variable(value, expected):
    environ = {} if value is None else {"OTEL_SWA_METRIC_EXPORT_INTERVAL": value}
    assert config.metric_export_interval_ms(environ) == expected


@pytest.mark.parametrize("value", ["-1", "1.5", "soon"])
def test_an_unusable_metric_export_interval_names_the_variable(value):
    with pytest.raises(ConfigError, match=rf"OTEL_SWA_METRIC_EXPORT_INTERVAL='{value}'"):
        config.metric_export_interval_ms({"OTEL_SWA_METRIC_EXPORT_INTERVAL": value})


# ------------------------------------------------------------------ the metric export schedule
def _otlp_meter_provider(collector, interval_ms: int):
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    exporter = OTLPMetricExporter(endpoint=collector.endpoint("grpc"), insecure=True)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms)
    return MeterProvider(metric_readers=[reader]), reader


def _counter_points(collector) -> list[float]:
    return [p["value"] for m in collector.seen()["metrics"] if m.get("name") == "test.forward_steps" for p in m["points"]]


@pytest.mark.collector
def test_metrics_reach_a_real_collector_on_the_schedule_long_before_the_sdks_interval(agent_binary, tmp_path):
    from otel_swa.telemetry.export_schedule import ExportSchedule

    with RotelCollector(agent_binary, tmp_path) as collector:
        provider, _reader = _otlp_meter_provider(collector, interval_ms=600_000)  # the SDK: once in 10 min
        schedule = ExportSchedule(200)
        try:
            assert schedule.add(provider) == 1
            counter = provider.get_meter("test").create_counter("test.forward_steps")
            counter.add(7)
            deadline = time.monotonic() + 60  # reached only when the schedule fails
            while schedule.collections < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            counter.add(5)
            seen = schedule.collections
            while schedule.collections < seen + 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            schedule.stop()
            provider.shutdown()  # the SDK's last export: the total again
    points = _counter_points(collector)
    # cumulative totals before the change, then the new total, before any SDK export but the last
    assert points[0] == 7 and 12 in points[:-1] and points[-1] == 12


def test_the_schedule_leaves_readers_with_a_shorter_interval_and_pull_readers_alone():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (ConsoleMetricExporter, InMemoryMetricReader,
                                                  PeriodicExportingMetricReader)

    from otel_swa.telemetry.export_schedule import ExportSchedule, keep_exporting

    in_memory = InMemoryMetricReader()
    fast = PeriodicExportingMetricReader(ConsoleMetricExporter(out=open("/dev/null", "w")), export_interval_millis=1000)
    provider = MeterProvider(metric_readers=[in_memory, fast])
    try:
        assert ExportSchedule(5000).add(provider) == 0
        assert keep_exporting(provider, 0) is None  # 0: off
    finally:
        provider.shutdown()


def test_an_engine_instrumentors_reporter_starts_the_schedule(monkeypatch):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    from otel_swa.engine_wrapping import EngineInstrumentor
    from otel_swa.telemetry import export_schedule

    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "5")
    monkeypatch.setenv("OTEL_SWA_METRIC_EXPORT_INTERVAL", "321")
    monkeypatch.setattr(export_schedule, "_schedules", {})
    reader = PeriodicExportingMetricReader(ConsoleMetricExporter(out=open("/dev/null", "w")), export_interval_millis=60_000)
    provider = MeterProvider(metric_readers=[reader])

    class Instrumentor(EngineInstrumentor):
        name, engine, distribution = "swa_test", "Test", "otel-swa"
        instruments = ("otel-swa >= 0",)

        def _wrappers(self):
            return ()

    instrumentor = Instrumentor()
    try:
        instrumentor._set_up_telemetry({"meter_provider": provider})
        reporter = instrumentor._new_reporter("cpu")
        assert reporter is not None
        schedule = export_schedule._schedules[321]
        assert schedule.interval_ms == 321 and reader in schedule._readers
        schedule.stop()
        reporter.close()
    finally:
        provider.shutdown()
