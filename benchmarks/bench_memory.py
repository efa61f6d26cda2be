"""Resident memory over a long run with the full OpenTelemetry sink: does it stay flat?

Runs ``--steps`` forward steps (default 1,000,000) of a reporter at interval 20 on the CPU, attached
to a telemetry sink on SDK providers as ``configure()`` builds them (batching span and log
processors with exporters that drop, the ``swa_logline`` exporter on a simple processor writing to a
discarded stream, a periodic metric reader collecting every second into an exporter that drops),
each step observing two counts and stepping over a batch of 16 requests whose lengths change from
step to step, up to ``--width`` tokens each (so that every sample's work has another size), inside
the forward-step span of the sampled steps. Prints the resident set size (``VmRSS`` of
``/proc/self/status``) after the first 1,000 steps (every buffer of a sample made, the delivery
thread started), after a warm-up of ``--warmup`` steps and every 100,000 steps; the growth over
the run (from step 1,000 to the last), the growth after the warm-up, and the growth per 100,000
steps from a least-squares line through the points. Nothing in the environment is tuned (no
``MALLOC_ARENA_MAX`` or other allocator variable; the run refuses to start with one set).

With ``--revisions REV ...`` (e.g. the issue's ``8e6be61 9d98197 worktree``) each revision runs the
same loop in a child process of its own (``_revisions.py``), one after the other, and a table
compares them.

Run: ``python benchmarks/bench_memory.py [--steps 1000000] [--warmup 100000] [--revisions REV ...]``
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_line, machine_line, one_thread, print_table  # noqa: E402
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


def run(steps: int, warmup: int, interval: int, width: int, report) -> dict:
    """The loop of the module docstring; ``report(step, rss_kib, seconds)`` at each point. Returns
    the figures (KiB): ``first`` (step 1,000), ``warm`` (after the warm-up), ``last``, ``slope``
    (per step), and the samples delivered and records dropped."""
    import contextlib

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(DropSpans()))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(DropLogs()))
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(SwaLogLineExporter(DiscardedText())))
    meter_provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(DropMetrics(), export_interval_millis=1000)])
    sink = SwaTelemetrySink(meter_provider=meter_provider, tracer_provider=tracer_provider, logger_provider=logger_provider)
    reporter = sink.attach(SwaDivergenceReporter(interval))
    spans = ForwardSpans(tracer_provider.get_tracer("bench"))  # entered at the sampled steps only
    req_to_token = torch.arange(1, 17 * width + 1, dtype=torch.int32).reshape(17, width)
    mapping = torch.arange(17 * width + 2) % 3000
    rows = torch.arange(1, 17)
    points, first = [], None
    start = time.perf_counter()
    for step in range(1, steps + 1):
        sampled = step % interval == 0
        lens = [(step * 7 + i * 13) % width for i in range(16)]
        view = SwaBatch(req_to_token, mapping, rows, torch.tensor(lens), lens) if sampled else None
        with spans.forward_span(forward_ct=step, batch_size=16) if sampled else contextlib.nullcontext():
            reporter.observe("full", 100)
            reporter.observe("swa", 30)
            reporter.step(view)
        if step == 1000 or (step >= warmup and (step - warmup) % 100_000 == 0):
            reporter.flush()
            gc.collect()
            rss = rss_kib()
            if step == 1000:
                first = rss
            if step >= warmup and (step - warmup) % 100_000 == 0:
                points.append((step, rss))
            report(step, rss, time.perf_counter() - start)
    reporter.close()
    meter_provider.shutdown()
    tracer_provider.shutdown()
    logger_provider.shutdown()
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / max(sum((x - mean_x) ** 2 for x, _ in points), 1)
    return {"first": first, "warm": points[0][1], "last": points[-1][1], "slope": slope, "warm_step": points[0][0],
            "last_step": points[-1][0], "delivered": reporter.stats.samples_delivered, "dropped": getattr(sink, "dropped", 0)}  # (a revision before the counter: 0)


def summary(got: dict) -> str:
    return (f"RSS at step 1,000: {got['first'] / 1024:.1f} MiB; after warm-up ({got['warm_step']:,} steps): "
            f"{got['warm'] / 1024:.1f} MiB; at {got['last_step']:,}: {got['last'] / 1024:.1f} MiB; growth over the run "
            f"{(got['last'] - got['first']) / 1024:+.2f} MiB, after the warm-up {(got['last'] - got['warm']) / 1024:+.2f} MiB; "
            f"{got['slope'] * 100_000 / 1024:+.3f} MiB per 100K steps (least squares)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--warmup", type=int, default=100_000)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--width", type=int, default=4096,
                        help="max_context_len of the batch of 16 requests; their lengths vary up to it (default 4096)")
    parser.add_argument("--revisions", nargs="*", help="compare these revisions, each in a child process")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a child: the figures as JSON
    args = parser.parse_args()
    tuned = sorted(name for name in os.environ if name.startswith(("MALLOC_", "GLIBC_TUNABLES")))
    if tuned:
        raise SystemExit(f"the allocator is tuned in the environment ({', '.join(tuned)}): unset it, the figure is "
                         "meant without tuning")
    one_thread()
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    if args.revisions:
        from _revisions import label, run_child, unpacked

        print(machine_line())
        rows = []
        with unpacked(args.revisions) as roots:
            for rev, root in roots.items():
                got = run_child(root, [os.path.abspath(__file__), "--json", "--steps", str(args.steps), "--warmup",
                                       str(args.warmup), "--interval", str(args.interval), "--width", str(args.width)])
                print(f"{label(rev)}: {summary(got)}", flush=True)
                rows.append((label(rev), f"{(got['last'] - got['first']) / 1024:+.2f}", f"{(got['last'] - got['warm']) / 1024:+.2f}",
                             f"{got['slope'] * 100_000 / 1024:+.3f}", f"{got['last'] / 1024:.1f}"))
        print()
        print_table(f"RSS growth over {args.steps:,} steps, interval {args.interval}, full OpenTelemetry sink (MiB)",
                    ("revision", "from step 1,000", "after warm-up", "per 100K steps", "RSS at the end"), rows)
        print(f"load average after: {load_line()}")
        return
    if args.json:
        print(json.dumps(run(args.steps, args.warmup, args.interval, args.width, lambda *a: None)))
        return
    print(machine_line())

    def report(step, rss, seconds):
        print(f"  step {step:>9,}  RSS {rss / 1024:8.1f} MiB  ({seconds:5.1f} s)", flush=True)

    got = run(args.steps, args.warmup, args.interval, args.width, report)
    print(f"samples delivered {got['delivered']:,}, records dropped {got['dropped']}")
    print(summary(got))


if __name__ == "__main__":
    main()
