"""In-process OpenTelemetry pipelines for the telemetry tests (the SDK's in-memory exporters)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, ObservableCounter
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pipeline_support import Pipeline

DELTA = {Counter: AggregationTemporality.DELTA, Histogram: AggregationTemporality.DELTA,
         ObservableCounter: AggregationTemporality.DELTA}


def _make_pipeline(temporality: str = "cumulative", max_links: int | None = None, exemplar_filter=None) -> Pipeline:
    resource = Resource.create({"service.name": "otel-swa-test"})
    spans = InMemorySpanExporter()
    limits = SpanLimits(max_links=max_links) if max_links is not None else SpanLimits()
    tracer_provider = TracerProvider(resource=resource, span_limits=limits)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader(preferred_temporality=DELTA if temporality == "delta" else None)
    kwargs = {"exemplar_filter": exemplar_filter} if exemplar_filter is not None else {}
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader], **kwargs)
    logs = InMemoryLogRecordExporter()
    logger_provider = LoggerProvider(resource=resource)
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(logs))
    return Pipeline(tracer_provider, meter_provider, logger_provider, spans, reader, logs)


@pytest.fixture
def make_pipeline():
    """Factory: ``make_pipeline(temporality="cumulative"|"delta", max_links=None, exemplar_filter=None)``."""
    made = []

    def make(*args, **kwargs) -> Pipeline:
        made.append(_make_pipeline(*args, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.shutdown()


@pytest.fixture
def pipeline(make_pipeline):
    return make_pipeline()
