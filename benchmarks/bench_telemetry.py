"""Host cost of the OpenTelemetry side on the engine's thread, with the real SDK.

Prints (median over interleaved rounds, spread min - max, microseconds):

1. **per delivered record, engine thread**: the full telemetry sink (metrics, Logs API event, span
   event; batching processors whose exporters drop, and the ``swa_logline`` exporter on its simple
   processor writing to a discarded stream), called on the engine's thread as before (``sink(record,
   context)``) and handed off to the delivery thread as an attached sink does; ``+ OTLP`` adds OTLP
   exporters (gRPC, to a closed local port: their export work runs on the SDK's threads). The
   hand-off is timed per call, with the engine thread then sleeping 0.5 ms (a forward step releases
   the GIL) so that the delivery thread does its work between records, as in an engine;
2. **the plain line sink** (``LogLineSink``, what ``otel-swa replay`` uses without an
   OpenTelemetry pipeline: it writes the line on the engine's thread);
3. **forward-step span per forward step** with 48 request links: ``OTEL_SWA_FORWARD_SPANS=all``,
   ``sampled`` at interval 20 (the default), ``off``.

Run: ``python benchmarks/bench_telemetry.py [--rounds 7] [--records 300]``
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, interleaved, machine_line, one_thread, print_table  # noqa: E402
from _drop_exporters import DropSpans, DropLogs  # noqa: E402

from opentelemetry import context as otel_context  # noqa: E402
from opentelemetry.sdk._logs import LoggerProvider  # noqa: E402
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, SimpleLogRecordProcessor  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402

from otel_swa.logline import LogLineSink  # noqa: E402
from otel_swa.record import SwaDivergenceRecord  # noqa: E402
from otel_swa.telemetry import ForwardSpans, SwaTelemetrySink, format_traceparent  # noqa: E402
from otel_swa.telemetry.logline import SwaLogLineExporter  # noqa: E402


def pipeline(otlp: bool):
    """Providers as ``configure()`` builds them: batching processors, the line exporter on a simple
    one, optionally OTLP over gRPC to a port nobody listens on."""
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(DropSpans()))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(DropLogs()))
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(SwaLogLineExporter(io.StringIO())))
    readers = [InMemoryMetricReader()]
    if otlp:
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = "http://127.0.0.1:9"  # discard port: nothing answers
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=1)))
        logger_provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter(endpoint=endpoint, insecure=True, timeout=1)))
    meter_provider = MeterProvider(metric_readers=readers)
    return tracer_provider, meter_provider, logger_provider


class Reporter:
    """What an attached sink reads from its reporter (a stand-in for ``SwaDivergenceReporter``'s
    ``add_sink``, ``forward_ct`` and ``stats``), so only the sink's own cost is timed."""

    def __init__(self):
        self.forward_ct = 0
        self.sinks = []
        self.stats = SimpleNamespace(samples_taken=0, samples_delivered=0, ring_full_waits=0, sink_errors=0, pending=0,
                                     invalid_samples=0, skipped_captures=0, view_faults={})

    def add_sink(self, sink):
        self.sinks.append(sink)


def record_timer(deliver, records: int, step_context, pause_s: float):
    """Seconds per ``deliver(record, context)`` call on this thread, the thread sleeping
    ``pause_s`` after each (time not counted)."""
    state = {"n": 0}

    def measure() -> float:
        spent = 0.0
        for _ in range(records):
            state["n"] += 20
            n = state["n"]
            record = SwaDivergenceRecord(n, 100 * n, 30 * n, n % 97, n % 89, verify_source="attention")
            start = time.perf_counter()
            deliver(record, step_context)
            spent += time.perf_counter() - start
            if pause_s:
                time.sleep(pause_s)
        return spent / records

    return measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--records", type=int, default=300)
    args = parser.parse_args()
    one_thread()
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)  # the OTLP exporters' connection errors
    print(machine_line())
    print(f"{args.rounds} rounds, interleaved; {args.records} records a round; median (min - max), microseconds\n")

    variants = {}
    flushes = []
    for otlp in (False, True):
        tracer_provider, meter_provider, logger_provider = pipeline(otlp)
        tracer = tracer_provider.get_tracer("bench")
        with tracer.start_as_current_span("forward step"):
            step_context = otel_context.get_current()
        label = " + OTLP" if otlp else ""
        called = SwaTelemetrySink(meter_provider=meter_provider, tracer_provider=tracer_provider, logger_provider=logger_provider)
        variants[f"sink called on the engine thread{label}"] = record_timer(called, args.records, step_context, 0.0)
        attached = called.for_another_reporter()
        reporter = Reporter()
        attached.attach(reporter)
        variants[f"sink handed off (attached){label}"] = record_timer(reporter.sinks[0], args.records, step_context, 0.0005)
        flushes.append(attached.flush)
    devnull = logging.getLogger("bench.line")
    devnull.propagate = False
    devnull.addHandler(logging.StreamHandler(open(os.devnull, "w")))
    devnull.setLevel(logging.INFO)
    variants["plain line sink (LogLineSink)"] = record_timer(LogLineSink(devnull), args.records, None, 0.0)
    got = interleaved(variants, args.rounds)
    for flush in flushes:
        flush()
    print_table("1. per delivered record, on the engine's thread (us)", ("sink", "us / record"),
                [(name, fmt(values, 1e6, 1)) for name, values in got.items()])

    # forward-step spans, 48 links
    tracer_provider, _, _ = pipeline(False)
    tracer = tracer_provider.get_tracer("bench")
    request_spans = [tracer.start_span(f"request {i}") for i in range(48)]
    traceparents = {i: format_traceparent(s.get_span_context()) for i, s in enumerate(request_spans)}
    spans = {mode: ForwardSpans(tracer, traceparents, mode=mode, interval=20) for mode in ("all", "sampled", "off")}
    counter = {"ct": 0}

    def steps(forward_spans, number=400):
        def measure() -> float:
            start = time.perf_counter()
            for _ in range(number):
                counter["ct"] += 1
                with forward_spans.forward_span(forward_ct=counter["ct"], batch_size=48, num_prefill=0, num_decode=48,
                                                request_ids=range(48)):
                    pass
            return (time.perf_counter() - start) / number

        return measure

    got = interleaved({mode: steps(fs) for mode, fs in spans.items()}, args.rounds)
    print_table("2. forward-step span with 48 request links, per forward step (us)", ("OTEL_SWA_FORWARD_SPANS", "us / step"),
                [(f"{mode}{' (interval 20, default)' if mode == 'sampled' else ''}", fmt(values, 1e6, 1)) for mode, values in got.items()])
    for s in request_spans:
        s.end()


if __name__ == "__main__":
    main()
