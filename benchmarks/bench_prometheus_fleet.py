"""A fleet on one machine: N engine processes (ranks) into one Prometheus and one collector.

Each rank (started as torchrun starts them: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, one
``OTEL_EXPORTER_PROMETHEUS_PORT``) replays a slice of the packaged trace through the reference
engine with the reporter on, then holds its last state (engine, pools and reporter alive) while
exporting both ways users deploy:

* its own Prometheus endpoint (``configure(exporters="prometheus,otlp")``, port base + local
  rank), scraped by one real Prometheus 2 (Debian's, started here on loopback with
  ``--enable-feature=extra-scrape-metrics``);
* OTLP/gRPC every ``--export-interval`` seconds to one real collector, ``rotel-agent``
  (blackhole exporter: what receiving costs; rotel has no Prometheus exporter).

Measured over a steady window after every rank finished its replay, from the servers' own figures:
series per rank (Prometheus ``scrape_series_added`` and a ``count by (instance)``), samples per
scrape (``scrape_samples_scraped``), bytes per scrape (``scrape_body_size_bytes``), bytes per OTLP
export (each rank encodes one collection with the OTLP exporter's own encoder: the protobuf
request body, uncompressed), and the CPU time of the Prometheus and rotel-agent processes
(``/proc/<pid>/stat`` utime + stime over the window). From them, the cost per 1,000 ranks at a
15 s scrape and export interval (every figure linear in ranks, and CPU linear in samples).

    python benchmarks/bench_prometheus_fleet.py                      # 16 ranks, 30 s window
    python benchmarks/bench_prometheus_fleet.py --ranks 4 --window 10
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line  # noqa: E402

from otel_swa.testing.prometheus import PrometheusServer, free_port  # noqa: E402

RANK_PROGRAM = textwrap.dedent(
    """
    import json, os, sys, time, dataclasses
    import torch
    torch.set_num_threads(1)
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from otel_swa.reference.config import EngineConfig
    from otel_swa.reference.replay import replay
    from otel_swa.reference.trace import load_trace
    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.telemetry import configure

    out, requests, hold_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    probe = InMemoryMetricReader()
    telemetry = configure(exporters="prometheus,otlp", default_service_name="otel-swa-fleet", metric_readers=[probe])
    reporter = telemetry.attach(SwaDivergenceReporter(20, device="cpu"))
    pools, engines = telemetry.pools, []
    def on_engine(engine):
        engines.append(engine)
        pools.register(lambda e: e.pools.usage(), owner=engine)
        reporter.add_sink(pools.savings_sink(engine.kv.swa_bytes_per_token))
    config = dataclasses.replace(EngineConfig(), window=64, full_pool_size=16384, swa_pool_size=2048, max_running=8,
                                 token_budget=256, max_context_len=4096)
    trace = [dataclasses.replace(r, context_tokens=min(r.context_tokens, 1000), generated_tokens=min(r.generated_tokens, 40))
             for r in load_trace("conv", limit=requests * world)[rank::world]]
    replay(trace, config, reporter, on_engine=on_engine)
    reporter.flush()
    data = probe.get_metrics_data()
    body = encode_metrics(data).SerializeToString()
    points = sum(len(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"otlp_bytes": len(body), "otlp_points": points}, f)
    while not os.path.exists(hold_file):
        time.sleep(0.2)
    reporter.close()
    telemetry.shutdown()
    stats = telemetry.export_stats()["metrics"]
    with open(os.path.join(out, f"rank{rank}.exported.json"), "w") as f:
        json.dump({"exported": stats.exported, "failed": stats.failed}, f)
    """
)


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (proc(5): fields 14 and 15, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rotel_agent() -> str:
    import rotel

    return str(Path(rotel.__file__).with_name("rotel-agent"))


def adjacent_ports(count: int) -> int:
    for _ in range(100):
        base = free_port()
        ok = True
        for port in range(base + 1, base + count):
            with socket.socket() as s:
                ok = ok and s.connect_ex(("127.0.0.1", port)) != 0
        if ok and base + count < 65536:
            return base
    raise RuntimeError(f"no {count} adjacent free ports")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--requests", type=int, default=6, help="requests per rank (default 6)")
    parser.add_argument("--window", type=float, default=30.0, help="steady seconds measured (default 30)")
    parser.add_argument("--interval", type=float, default=1.0, help="scrape and OTLP export interval, s (default 1)")
    args = parser.parse_args(argv)
    print(machine_line())
    base = adjacent_ports(args.ranks)
    grpc, http = free_port(), free_port()
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        collector = subprocess.Popen(
            [rotel_agent(), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{grpc}", "--otlp-http-endpoint",
             f"127.0.0.1:{http}", "--exporter", "blackhole", "--pid-file", str(work / "rotel.pid"),
             "--log-file", str(work / "rotel.log")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        jobs = [{"job_name": "fleet", "targets": [f"127.0.0.1:{base + r}" for r in range(args.ranks)]}]
        interval_ms = f"{int(args.interval * 1000)}ms"
        ranks = []
        try:
            with PrometheusServer(work / "prometheus", jobs, scrape_interval=interval_ms,
                                  extra_args=["--enable-feature=extra-scrape-metrics"]) as prom:
                hold = work / "hold"
                for r in range(args.ranks):
                    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
                    env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.ranks),
                               OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1", OTEL_EXPORTER_PROMETHEUS_PORT=str(base),
                               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{grpc}", OTEL_EXPORTER_OTLP_INSECURE="true",
                               OTEL_METRIC_EXPORT_INTERVAL=str(int(args.interval * 1000)),
                               OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel,host")
                    ranks.append(subprocess.Popen([sys.executable, "-c", RANK_PROGRAM, str(work), str(args.requests), str(hold)],
                                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
                started = time.monotonic()
                while not all((work / f"rank{r}.json").exists() for r in range(args.ranks)):
                    for proc in ranks:
                        if proc.poll() is not None:
                            raise RuntimeError(f"a rank exited: {proc.stderr.read()[-2000:]}")
                    time.sleep(0.2)
                print(f"{args.ranks} ranks replayed in {time.monotonic() - started:.0f} s; measuring {args.window:g} s")
                time.sleep(3 * args.interval)  # every target scraped with its final series
                cpu0 = {"prometheus": cpu_seconds(prom.pid), "collector": cpu_seconds(collector.pid)}
                t0 = time.monotonic()
                time.sleep(args.window)
                elapsed = time.monotonic() - t0
                cpu = {name: (cpu_seconds(pid) - cpu0[name]) / elapsed
                       for name, pid in (("prometheus", prom.pid), ("collector", collector.pid))}

                def per_target(expr: str) -> list[float]:
                    return sorted(float(s["value"][1]) for s in prom.query(expr))

                series = per_target('count by (instance) ({job="fleet",__name__=~"kv_cache_.*|target_info"})')
                added = per_target('max_over_time(scrape_series_added{job="fleet"}[1h])')
                samples = per_target('scrape_samples_scraped{job="fleet"}')
                body = per_target('scrape_body_size_bytes{job="fleet"}')
                up = per_target('up{job="fleet"}')
                hold.write_text("")
                for proc in ranks:
                    proc.wait(timeout=60)
        finally:
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
            collector.terminate()
            collector.wait(timeout=10)
        otlp = [json.loads((work / f"rank{r}.json").read_text()) for r in range(args.ranks)]
        exported = [json.loads((work / f"rank{r}.exported.json").read_text()) for r in range(args.ranks)]
    otlp_bytes = sorted(o["otlp_bytes"] for o in otlp)
    otlp_points = sorted(o["otlp_points"] for o in otlp)
    n = args.ranks

    def spread(values: list[float], fmt: str = "{:.0f}") -> str:
        return f"{fmt.format(values[len(values) // 2])} ({fmt.format(values[0])} - {fmt.format(values[-1])})"

    print(f"targets up                      {int(sum(up))} / {n}")
    print(f"series per rank (Prometheus)    {spread(series)}  [scrape_series_added, first scrape: {spread(added)}]")
    print(f"samples per scrape              {spread(samples)}")
    print(f"bytes per scrape (text format)  {spread(body)}")
    print(f"bytes per OTLP export           {spread(otlp_bytes)}  ({spread(otlp_points)} data points)")
    print(f"OTLP data points exported       {sum(e['exported'] for e in exported):,} by all ranks, "
          f"{sum(e['failed'] for e in exported)} failed")
    print(f"Prometheus CPU                  {cpu['prometheus'] * 1000:.1f} ms/s for {n} targets at {args.interval:g} s "
          f"= {cpu['prometheus'] * 1000 / n / (1 / args.interval):.2f} ms per scrape of one rank")
    print(f"collector CPU (rotel-agent)     {cpu['collector'] * 1000:.1f} ms/s for {n} ranks at {args.interval:g} s "
          f"= {cpu['collector'] * 1000 / n / (1 / args.interval):.2f} ms per export of one rank")
    per_scrape_ms = cpu["prometheus"] * 1000 / n * args.interval
    per_export_ms = cpu["collector"] * 1000 / n * args.interval
    median_series, median_samples = series[len(series) // 2], samples[len(samples) // 2]
    print("per 1,000 ranks at a 15 s scrape / export interval:")
    print(f"  series                        {median_series * 1000:,.0f}")
    print(f"  samples ingested              {median_samples * 1000 / 15:,.0f} /s")
    print(f"  scrape traffic                {body[len(body) // 2] * 1000 / 15 / 1e6:.2f} MB/s")
    print(f"  OTLP traffic                  {otlp_bytes[len(otlp_bytes) // 2] * 1000 / 15 / 1e6:.2f} MB/s (uncompressed)")
    print(f"  Prometheus CPU                {per_scrape_ms * 1000 / 15 / 1000:.2f} cores (scraping and ingesting)")
    print(f"  collector CPU                 {per_export_ms * 1000 / 15 / 1000:.2f} cores (receiving)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
