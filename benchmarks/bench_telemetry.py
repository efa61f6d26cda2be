"""Host cost of the OpenTelemetry side, per call, with the real SDK and batching processors.

Prints microseconds per call (median of repeats) for:

* the telemetry sink on one record (metrics with context, Logs API event, span event on a child
  span of the forward step), i.e. the host work per delivered sample;
* the forward-step span (start, attributes, end) with 0, 1, 32 and 128 request links.

Exporters drop the data (so export work, which runs on the SDK's background threads, is not
counted); what is measured is what runs on the engine's thread.

Run: ``python benchmarks/bench_telemetry.py``
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

from opentelemetry import context as otel_context
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from otel_swa.record import SwaDivergenceRecord
from otel_swa.telemetry import ForwardSpans, SwaTelemetrySink, format_traceparent


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


def median_us(fn, repeats: int = 7, number: int = 300) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(times)


def main() -> None:
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(DropSpans()))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(DropLogs()))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    tracer = tracer_provider.get_tracer("bench")

    sink = SwaTelemetrySink(meter_provider=meter_provider, tracer_provider=tracer_provider, logger_provider=logger_provider)
    with tracer.start_as_current_span("forward step"):
        step_context = otel_context.get_current()
    state = {"n": 0}

    def deliver():
        state["n"] += 20
        n = state["n"]
        sink(SwaDivergenceRecord(n, 100 * n, 30 * n, n % 97, n % 89), step_context)

    request_spans = [tracer.start_span(f"request {i}") for i in range(128)]
    traceparents = {i: format_traceparent(s.get_span_context()) for i, s in enumerate(request_spans)}
    spans = ForwardSpans(tracer, traceparents)

    rows = [("sink: one record (metrics + event + span event)", deliver)]
    for links in (0, 1, 32, 128):
        info = SimpleNamespace(forward_ct=1, batch_size=links, num_prefill=0, num_decode=links, request_ids=tuple(range(links)))

        def forward(info=info):
            with spans.forward_span(info):
                pass

        rows.append((f"forward-step span, {links} links", forward))
    width = max(len(name) for name, _ in rows)
    print(f"{'operation':<{width}}  us/call (median of 7)")
    for name, fn in rows:
        print(f"{name:<{width}}  {median_us(fn):10.1f}")
    for s in request_spans:
        s.end()
    tracer_provider.shutdown()
    logger_provider.shutdown()
    meter_provider.shutdown()


if __name__ == "__main__":
    main()
