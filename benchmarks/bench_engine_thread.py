"""Engine-thread CPU per delivered record, as users pay it, side by side for several revisions.

A reporter samples every forward step (interval 1) of a small batch (16 requests, up to 64 live
tokens each) with the full OpenTelemetry sink attached (``SwaTelemetrySink.attach``: metrics, the
Logs API event, the span event, the ``swa_logline`` line; providers as ``configure()`` builds them:
batching span and log processors whose exporters drop, the line exporter on a simple processor
writing to a discarded stream, a periodic metric reader collecting every second into an exporter
that drops). The figure is ``time.thread_time()`` of the engine's thread over the whole run, the
final ``close()`` (which delivers what is still queued) included, less the same run with no sink,
divided by the records delivered: what the telemetry costs the engine's thread per record,
whatever thread does the work. Two loops: steps back to back (a tight loop), and 0.5 ms of work
per step (``time.sleep(0.0005)``: the GIL released, as a forward step's device work releases it).
Each loop is also given before ``close()``: the steps alone, without the records still queued at
the end, which ``close()`` delivers on the calling thread. Beside them, the delivery thread's own
CPU per record it delivered (``time.pthread_getcpuclockid`` of the ``otel-swa-telemetry`` thread,
over the records it took off the queue before ``close()``), and the engine thread's context switches
per record before ``close()``, with the sink less without (``/proc/thread-self/status``: voluntary,
waiting for the GIL or a lock; involuntary, taken off its CPU): on a machine shared with other work
they say, less noisily than CPU time, how often the delivery thread got in the engine thread's way.

Each revision (``--revisions``, default 0399fbd and the working tree) runs in a child process of its
own (``_revisions.py``), round after round in turn; a child measures each loop ``--pairs`` times
with and without the sink, interleaved, and prints the median of its pairs' differences as JSON.

Run: ``python benchmarks/bench_engine_thread.py [--rounds 5] [--pairs 5] [--steps 1000] [--revisions REV ...]``
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report_child  # noqa: E402

LOOPS = {"tight loop": 0.0, "0.5 ms work per step": 0.0005}


def child(steps: int, pairs: int) -> None:
    """One revision (``otel_swa`` from ``PYTHONPATH``): print ``{figure: us per record}`` as JSON."""
    import statistics
    import threading

    import torch
    from _drop_exporters import DropLogs, DropMetrics, DropSpans
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, SimpleLogRecordProcessor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.telemetry import SwaTelemetrySink
    from otel_swa.telemetry import sink as sink_module
    from otel_swa.telemetry.logline import SwaLogLineExporter
    from otel_swa.views import SwaBatch

    torch.set_num_threads(1)
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(DropSpans()))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(DropLogs()))
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(SwaLogLineExporter(io.StringIO())))
    meter_provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(DropMetrics(), export_interval_millis=1000)])
    tracer = tracer_provider.get_tracer("bench")
    width = 64
    req_to_token = torch.arange(1, 17 * width + 1, dtype=torch.int32).reshape(17, width)
    mapping = torch.arange(17 * width + 2) % 700
    rows = torch.arange(1, 17)
    views = []
    for step in range(64):
        lens = [(step * 7 + i * 13) % width for i in range(16)]
        views.append(SwaBatch(req_to_token, mapping, rows, torch.tensor(lens), lens))
    base_sink = SwaTelemetrySink(meter_provider=meter_provider, tracer_provider=tracer_provider, logger_provider=logger_provider)

    def switches() -> "tuple[int, int]":
        """This thread's voluntary and involuntary context switches so far (Linux; zeros elsewhere)."""
        try:
            with open("/proc/thread-self/status", encoding="ascii") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])
        except (OSError, KeyError, ValueError):
            return 0, 0

    def delivery_clock() -> "int | None":
        for thread in threading.enumerate():
            if thread.name == "otel-swa-telemetry" and thread.ident is not None:
                return time.pthread_getcpuclockid(thread.ident)
        return None

    def run(pause_s: float, with_sink: bool) -> "tuple[float, float, float, int, int]":
        """Engine-thread CPU s over the run and over its steps alone (before ``close()``), the
        delivery thread's CPU s per record it delivered (0 without the sink), and the engine
        thread's voluntary and involuntary context switches over its steps."""
        reporter = SwaDivergenceReporter(1)
        if with_sink:
            base_sink.for_another_reporter().attach(reporter)
        clock = delivery_clock()
        delivery_start = time.clock_gettime(clock) if clock is not None else 0.0
        switched = switches()
        start = time.thread_time()
        for step in range(steps):
            with tracer.start_as_current_span("forward step"):
                reporter.observe("full", 100)
                reporter.observe("swa", 30)
                reporter.step(views[step % 64])
            if pause_s:
                time.sleep(pause_s)
        stepped = time.thread_time() - start
        voluntary, involuntary = (now - then for now, then in zip(switches(), switched))
        by_thread = steps - len(sink_module._queue)  # the records the thread took before close()
        delivery = time.clock_gettime(clock) - delivery_start if clock is not None and with_sink else 0.0
        reporter.close()
        spent = time.thread_time() - start
        assert reporter.stats.samples_delivered == steps
        return spent, stepped, delivery / max(by_thread, 1), voluntary, involuntary

    for pause_s in LOOPS.values():  # warm-up: imports, buffers, the delivery thread
        run(pause_s, True), run(pause_s, False)
    got = {}
    for name, pause_s in LOOPS.items():
        whole, stepped, delivery, voluntary, involuntary = [], [], [], [], []
        for _ in range(pairs):
            with_sink, without = run(pause_s, True), run(pause_s, False)
            whole.append((with_sink[0] - without[0]) / steps * 1e6)
            stepped.append((with_sink[1] - without[1]) / steps * 1e6)
            delivery.append(with_sink[2] * 1e6)
            voluntary.append((with_sink[3] - without[3]) / steps)
            involuntary.append((with_sink[4] - without[4]) / steps)
        got[name] = statistics.median(whole)
        got[name + ", steps only"] = statistics.median(stepped)
        got[name + ", delivery thread"] = statistics.median(delivery)
        got[name + ", voluntary switches"] = statistics.median(voluntary)
        got[name + ", involuntary switches"] = statistics.median(involuntary)
    report_child(got, meter_provider, tracer_provider, logger_provider)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=5, help="with / without pairs per loop in each child")
    parser.add_argument("--steps", type=int, default=1000)
    from _revisions import WORKTREE, label, run_child, unpacked

    parser.add_argument("--revisions", nargs="+", default=["0399fbd", WORKTREE])
    args = parser.parse_args()
    from _common import fmt, load_line, machine_line, one_thread, print_table

    one_thread()
    print(machine_line())
    print(f"{args.rounds} rounds, one child process per revision in turn; {args.steps} steps at interval 1 per run, "
          f"{args.pairs} pairs a loop in each child (their median); per record: engine-thread CPU with the sink less "
          "without, median (min - max) over the rounds, us\n")
    with unpacked(args.revisions) as roots:
        got = {rev: [] for rev in roots}
        for _ in range(args.rounds):
            for rev, root in roots.items():
                got[rev].append(run_child(root, [os.path.abspath(__file__), "--child", str(args.steps), str(args.pairs)]))
    figures = [(key, shown, digits) for name in LOOPS for key, shown, digits in (
        (name, f"{name}, whole run", 1), (name + ", steps only", f"{name}, before close()", 1),
        (name + ", delivery thread", f"{name}: delivery thread's own CPU per record it delivered", 1),
        (name + ", voluntary switches", f"{name}: engine-thread voluntary context switches per record", 2),
        (name + ", involuntary switches", f"{name}: engine-thread involuntary context switches per record", 2))]
    rows = [(shown, *(fmt([r[key] for r in got[rev] if key in r] or [float("nan")], 1, digits) for rev in roots))
            for key, shown, digits in figures]
    print_table("engine-thread CPU per delivered record, full OpenTelemetry sink, interval 1 (us)",
                ("loop", *(label(rev) for rev in roots)), rows)
    print(f"load average after: {load_line()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    else:
        main()
