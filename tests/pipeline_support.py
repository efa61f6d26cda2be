"""The tests' in-memory OpenTelemetry pipeline: the SDK's providers with its in-memory span exporter,
metric reader and log record exporter, and what the tests read back from them."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

#: The name of otel-swa's sample event (``otel_swa.telemetry.semconv.EVENT_NAME``, spelled out here
#: so that a rename shows in the tests).
EVENT_NAME = "kv_cache.swa.divergence_sample"


@dataclass
class Pipeline:
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    logger_provider: LoggerProvider
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    logs: InMemoryLogRecordExporter

    @classmethod
    def make(cls) -> "Pipeline":
        """Providers without a resource or limits of their own (the instrumentor tests')."""
        spans, reader, logs = InMemorySpanExporter(), InMemoryMetricReader(), InMemoryLogRecordExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
        logger_provider = LoggerProvider()
        logger_provider.add_log_record_processor(SimpleLogRecordProcessor(logs))
        return cls(tracer_provider, MeterProvider(metric_readers=[reader]), logger_provider, spans, reader, logs)

    def providers(self) -> dict:
        return dict(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider,
                    logger_provider=self.logger_provider)

    def metrics(self) -> dict:
        """name -> {"unit", "description", "points": [data point, ...]} of one collection."""
        out = {}
        data = self.reader.get_metrics_data()
        if data is None:
            return out
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    out[metric.name] = {"unit": metric.unit, "description": metric.description,
                                        "points": list(metric.data.data_points), "data": metric.data}
        return out

    def points(self, name: str) -> list:
        """The data points of metric ``name`` in one collection (empty when it has none)."""
        data = self.reader.get_metrics_data()
        if data is None:
            return []
        return [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                if m.name == name for p in m.data.data_points]

    def events(self) -> list:
        return [l.log_record for l in self.logs.get_finished_logs() if l.log_record.event_name == EVENT_NAME]

    def forward_spans(self) -> list:
        return [s for s in self.spans.get_finished_spans() if s.name == "forward step"]

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
        self.logger_provider.shutdown()
