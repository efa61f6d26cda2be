"""Forward-step latency and shutdown time of the reference engine with OTLP export to a collector
that is up, down (closed port) or never answers (accepts TCP, says nothing), against exports off.

Each round runs, in a fresh process per case (interleaved: every case once per round), the reference
engine without the model math on a slice of the packaged trace with the reporter sampling every
``--interval`` steps and ``configure(exporters=...)``: ``none`` (no exporter), ``otlp`` to a live
``rotel-agent`` (if installed), to a closed port, and to a blackhole. It prints per case the median
forward-step time, the 99th percentile step, and the shutdown time (``reporter.close()`` and
``telemetry.shutdown()``), median and spread over the rounds, with ``OTEL_EXPORTER_OTLP_TIMEOUT``
as given (default 2 s) and the metric export interval at 1 s so that exports happen during the run.

Run: ``python benchmarks/bench_collector_faults.py [--rounds 5] [--requests 40] [--timeout 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from types import SimpleNamespace
from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.reference.trace import load_trace
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.telemetry import configure

exporters, requests, interval = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
telemetry = configure(exporters=exporters)
engine = ReferenceEngine(EngineConfig(window=128, full_pool_size=65536, swa_pool_size=8192, max_running=64,
                                      token_budget=2048, max_context_len=16384, step_time_s=0.0, run_model=False),
                         reporter=telemetry.attach(SwaDivergenceReporter(interval)))
for request in load_trace("conv", limit=requests):
    engine.submit(request, arrival_s=0.0)
steps = []
while engine.has_work:
    start = time.perf_counter()
    with telemetry.forward_span():
        engine.step()
    steps.append(time.perf_counter() - start)
start = time.perf_counter()
engine.reporter.close()
telemetry.shutdown()
shutdown = time.perf_counter() - start
steps.sort()
print(json.dumps({"median_ms": steps[len(steps) // 2] * 1e3, "p99_ms": steps[int(len(steps) * 0.99)] * 1e3,
                  "shutdown_s": shutdown, "steps": len(steps)}))
"""


class Blackhole:
    """Accepts TCP connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from collector_support import RotelCollector, rotel_agent

    blackhole = Blackhole()
    cases = {"exports off": ("none", None), "closed port": ("otlp", f"http://127.0.0.1:{_free_port()}"),
             "never answers": ("otlp", f"http://127.0.0.1:{blackhole.port}")}
    agent = rotel_agent()
    collector = None
    if agent:
        import tempfile

        collector = RotelCollector(agent, Path(tempfile.mkdtemp()), settle_s=0.0).__enter__()
        cases["collector up"] = ("otlp", collector.endpoint("grpc"))
    results: dict[str, list[dict]] = {name: [] for name in cases}
    try:
        for _ in range(args.rounds):
            for name, (exporters, endpoint) in cases.items():
                env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
                env.update({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "true",
                            "OTEL_EXPORTER_OTLP_TIMEOUT": str(args.timeout), "OTEL_METRIC_EXPORT_INTERVAL": "1000"})
                if endpoint:
                    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
                run = subprocess.run([sys.executable, "-c", CHILD, exporters, str(args.requests), str(args.interval)],
                                     env=env, capture_output=True, text=True, timeout=600)
                if run.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{run.stderr[-2000:]}")
                results[name].append(json.loads(run.stdout.strip().splitlines()[-1]))
    finally:
        if collector is not None:
            collector.__exit__(None, None, None)
    import torch

    print(f"torch={torch.__version__} requests={args.requests} interval={args.interval} "
          f"OTEL_EXPORTER_OTLP_TIMEOUT={args.timeout} rounds={args.rounds}")
    print(f"{'case':<16} {'step median ms':>15} {'step p99 ms':>12} {'shutdown s (min-max)':>24}")
    base = statistics.median(r["median_ms"] for r in results["exports off"])
    for name, runs in results.items():
        step = statistics.median(r["median_ms"] for r in runs)
        p99 = statistics.median(r["p99_ms"] for r in runs)
        shut = [r["shutdown_s"] for r in runs]
        print(f"{name:<16} {step:>9.3f} ({step / base:>4.2f}x) {p99:>12.3f} "
              f"{statistics.median(shut):>10.2f} ({min(shut):.2f}-{max(shut):.2f})")


if __name__ == "__main__":
    main()
