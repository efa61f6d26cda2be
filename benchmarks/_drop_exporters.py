"""OpenTelemetry SDK exporters that accept every batch and send nothing: the benchmarks' stand-ins
for a collector, so that what is timed or measured is the SDK pipeline and otel-swa, not a network."""

from __future__ import annotations

from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class DropSpans(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


class DropLogs(LogRecordExporter):
    def export(self, batch):
        return LogRecordExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class DropMetrics(MetricExporter):
    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass
