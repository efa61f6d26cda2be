"""The delivery thread's work per record: what the telemetry sink does with each record, side by side
for several revisions.

The work the ``otel-swa-telemetry`` thread does for each record it delivers, done here on the
calling thread (``sink(record, context)`` delivers at once on the thread that calls it) and timed
by ``time.thread_time()``: the metrics (the record's values into its reporter's store, the
delivery-delay histogram, the reporter's health counts noted), the Logs API event, the span event on
a child of the record's forward-step span (ended, as it is when a copy lands a step later), and the
line (``swa_logline`` on its simple processor, through Python ``logging`` with SGLang's log format
to a discarded stream). Providers as ``configure()`` builds them: batching span and log processors
whose exporters drop (their export runs on the SDK's own threads), a periodic metric reader
collecting every second into an exporter that drops. The sink is attached to a stand-in reporter
(``add_sink``, ``forward_ct``, ``stats``) with SGLang's three rank attributes, as the SGLang
instrumentor makes it. Each record is one of an SGLang engine's at interval 1: the five fields, the
SWA slot audit's, the window check's and the read check's, ``verify_source`` attention; each has a
forward-step span of its own, made (and ended) in rounds of 64 records before they are delivered.

Printed per revision (median and spread over the rounds, each round one child process per
revision in turn): the whole delivery per record, then its parts measured alone over the same
records (the metrics' ``record``, the events' ``emit`` holding the Logs API event with the line and
the span event, the line exporter's ``export`` alone, timed inside the whole delivery).

Run: ``python benchmarks/bench_delivery.py [--rounds 7] [--records 2000] [--revisions 0399fbd worktree]``
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report_child  # noqa: E402

#: Records made at a time (each with its forward-step span, ended) before they are delivered: about
#: what the delivery queue holds at interval 1 (a round every 50 ms), so that the objects alive while
#: records are delivered, which the garbage collector goes through, are what they are in an engine.
ROUND = 64
#: The figures a child prints, in table order, with their row names.
PARTS = (
    ("deliver", "whole delivery (sink(record, context))"),
    ("metrics", "  metrics: SwaMetrics.record"),
    ("events", "  events: SampleEvents.emit (Logs API event + line + span event)"),
    ("line", "  of which the line: SwaLogLineExporter.export"),
)


class _Discarded:
    def write(self, text):
        return len(text)

    def flush(self):
        pass


def child(records: int) -> None:
    """One revision (``otel_swa`` from ``PYTHONPATH``): print ``{part: us per record}`` as JSON."""
    from types import SimpleNamespace

    import torch  # noqa: F401  (imported as an engine process has it)
    from _drop_exporters import DropLogs, DropMetrics, DropSpans
    from opentelemetry import context as otel_context
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, SimpleLogRecordProcessor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from otel_swa.record import SwaDivergenceRecord
    from otel_swa.telemetry import SwaTelemetrySink
    from otel_swa.telemetry.logline import SwaLogLineExporter

    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    handler = logging.StreamHandler(_Discarded())
    handler.setFormatter(logging.Formatter("[%(asctime)s TP0] %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    line_exporter = SwaLogLineExporter()  # through logging, logger otel_swa
    line_cpu = [0.0]
    export = line_exporter.export

    def timed_export(batch):
        start = time.thread_time()
        try:
            return export(batch)
        finally:
            line_cpu[0] += time.thread_time() - start

    line_exporter.export = timed_export
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(DropSpans()))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(DropLogs()))
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(line_exporter))
    meter_provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(DropMetrics(), export_interval_millis=1000)])
    tracer = tracer_provider.get_tracer("bench")

    class Reporter:
        forward_ct = 0
        sinks: list = []
        stats = SimpleNamespace(samples_taken=0, samples_delivered=0, ring_full_waits=0, sink_errors=0, pending=0,
                                invalid_samples=0, skipped_captures=0, view_faults={}, liveness_warnings=0)

        def add_sink(self, sink):
            self.sinks.append(sink)

    reporter = Reporter()
    ranks = {"otel_swa.tp_rank": 0, "otel_swa.pp_rank": 0, "otel_swa.dp_rank": 0}
    sink = SwaTelemetrySink(meter_provider=meter_provider, tracer_provider=tracer_provider,
                            logger_provider=logger_provider).for_another_reporter(ranks)
    sink.attach(reporter)

    def record(n: int) -> SwaDivergenceRecord:
        return SwaDivergenceRecord(
            n, 3100 * n, 1500 * n, 40 + n % 7, 1400 + n % 11, verify_source="attention",
            swa_leaked_slots=0, swa_stale_tokens=0, swa_shared_slots=0, swa_pages_in_use=1600 + n % 13,
            swa_pages_referenced=1600 + n % 13, swa_premature_evictions=0, swa_late_held_slots=n % 5,
            swa_read_checks=8, swa_read_mismatches=0, swa_read_unchecked=0)

    def contexts(count: int) -> list:
        out = []
        for _ in range(count):
            with tracer.start_as_current_span("forward step"):
                out.append(otel_context.get_current())
        return out

    base = [0]

    def per_record(work, count: int) -> float:
        """CPU us per ``work(record, context)`` over ``count`` records, made (with their forward-step
        spans) in rounds of :data:`ROUND` outside the timed part, as the delivery queue holds them."""
        spent = 0.0
        for first in range(0, count, ROUND):
            items = [(record(base[0] + i + 1), context) for i, context in enumerate(contexts(min(ROUND, count - first)))]
            base[0] += len(items)
            start = time.thread_time()
            for rec, context in items:
                work(rec, context)
            spent += time.thread_time() - start
        return spent / count * 1e6

    def deliver(rec, context):
        reporter.forward_ct = rec.forward_ct + 1
        sink(rec, context)

    got = {}
    for _ in range(2):  # warm-up, then the figures of the last pass
        line_cpu[0] = 0.0
        got["deliver"] = per_record(deliver, records)
        got["line"] = line_cpu[0] / records * 1e6
        got["metrics"] = per_record(lambda r, c: sink.metrics.record(r, c, delivered_at=r.forward_ct + 1, store=sink._store),
                                    records)
        got["events"] = per_record(lambda r, c: sink.events.emit(r, c, sink.attributes), records)
    report_child(got, meter_provider, tracer_provider, logger_provider)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--revisions", nargs="+", default=["0399fbd", "worktree"])
    args = parser.parse_args()
    from _common import fmt, load_line, machine_line, one_thread, print_table
    from _revisions import label, run_child, unpacked

    one_thread()
    print(machine_line())
    print(f"{args.rounds} rounds, one child process per revision in turn; {args.records} records a part; "
          "CPU time of the delivering thread per record (time.thread_time), median (min - max), us\n")
    with unpacked(args.revisions) as roots:
        got = {rev: [] for rev in roots}
        for _ in range(args.rounds):
            for rev, root in roots.items():
                got[rev].append(run_child(root, [os.path.abspath(__file__), "--child", str(args.records)]))
    revs = list(roots)
    rows = [(shown, *(fmt([r[key] for r in got[rev]], 1, 1) for rev in revs)) for key, shown in PARTS]
    if len(revs) >= 2:
        first, last = revs[0], revs[-1]
        rows.append((f"whole delivery, {label(last)} / {label(first)}",
                     *([""] * (len(revs) - 1)),
                     fmt([b["deliver"] / a["deliver"] for a, b in zip(got[first], got[last])], 1, 3)))
    print_table("the delivery thread's work per record: metrics, Logs API event, line, span event (us)",
                ("part", *(label(rev) for rev in revs)), rows)
    print(f"load average after: {load_line()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(int(sys.argv[2]))
    else:
        main()
