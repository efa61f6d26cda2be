"""Resident memory over a long run with the full OpenTelemetry sink: does it stay flat?

Runs ``--steps`` forward steps (default 1,000,000) of a reporter at interval 20 on the CPU, attached
to a telemetry sink on SDK providers as ``configure()`` builds them (batching span and log
processors with exporters that drop, the ``swa_logline`` exporter on a simple processor writing to a
discarded stream, a periodic metric reader collecting every second into an exporter that drops),
each step observing two counts and stepping over a batch of 16 requests whose lengths change from
step to step, up to ``--width`` tokens each (so that every sample's work has another size), inside
the forward-step span of the sampled steps. Prints the resident set size (``VmRSS`` of
``/proc/self/status``) after a warm-up of ``--warmup`` steps and every 100,000 steps, the growth
after the warm-up, and the growth per 100,000 steps from a least-squares line through the points.

Run: ``python benchmarks/bench_memory.py [--steps 1000000] [--warmup 100000]``
"""

from __future__ import annotations

import argparse
import gc
import io
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, one_thread  # noqa: E402
from _drop_exporters import DropSpans, DropLogs, DropMetrics  # noqa: E402

import torch  # noqa: E402
from opentelemetry.sdk._logs import LoggerProvider  # noqa: E402
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, SimpleLogRecordProcessor  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402

from otel_swa.reporter import SwaDivergenceReporter  # noqa: E402
from otel_swa.telemetry import ForwardSpans, SwaTelemetrySink  # noqa: E402
from otel_swa.telemetry.logline import SwaLogLineExporter  # noqa: E402
from otel_swa.views import SwaBatch  # noqa: E402


class DiscardedText(io.TextIOBase):
    def write(self, text):
        return len(text)


def rss_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--warmup", type=int, default=100_000)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--width", type=int, default=4096,
                        help="max_context_len of the batch of 16 requests; their lengths vary up to it (default 4096)")
    args = parser.parse_args()
    one_thread()
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    print(machine_line())
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(DropSpans()))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(DropLogs()))
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(SwaLogLineExporter(DiscardedText())))
    meter_provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(DropMetrics(), export_interval_millis=1000)])
    sink = SwaTelemetrySink(meter_provider=meter_provider, tracer_provider=tracer_provider, logger_provider=logger_provider)
    reporter = sink.attach(SwaDivergenceReporter(args.interval))
    spans = ForwardSpans(tracer_provider.get_tracer("bench"), mode="sampled", interval=args.interval)
    width = args.width
    req_to_token = torch.arange(1, 17 * width + 1, dtype=torch.int32).reshape(17, width)
    mapping = torch.arange(17 * width + 2) % 3000
    rows = torch.arange(1, 17)
    points = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        lens = [(step * 7 + i * 13) % width for i in range(16)]
        view = SwaBatch(req_to_token, mapping, rows, torch.tensor(lens), lens) if step % args.interval == 0 else None
        with spans.forward_span(forward_ct=step, batch_size=16):
            reporter.observe("full", 100)
            reporter.observe("swa", 30)
            reporter.step(view)
        if step >= args.warmup and (step - args.warmup) % 100_000 == 0:
            reporter.flush()
            gc.collect()
            points.append((step, rss_kib()))
            print(f"  step {step:>9,}  RSS {points[-1][1] / 1024:8.1f} MiB  ({time.perf_counter() - start:5.1f} s)", flush=True)
    reporter.close()
    meter_provider.shutdown()
    tracer_provider.shutdown()
    logger_provider.shutdown()
    (first_step, first), (last_step, last) = points[0], points[-1]
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / max(sum((x - mean_x) ** 2 for x, _ in points), 1)
    print(f"samples delivered {reporter.stats.samples_delivered:,}, records dropped {sink.dropped}")
    print(f"RSS after warm-up ({first_step:,} steps): {first / 1024:.1f} MiB; at {last_step:,}: {last / 1024:.1f} MiB; "
          f"growth {(last - first) / 1024:+.2f} MiB; {slope * 100_000 / 1024:+.3f} MiB per 100K steps (least squares)")


if __name__ == "__main__":
    main()
