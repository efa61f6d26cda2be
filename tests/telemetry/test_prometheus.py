"""The Grafana dashboard's queries answered by a real Prometheus scraping otel-swa's endpoints.

One Prometheus 2 server (Debian's ``prometheus``; in CI its absence fails) on loopback, scraping
every 200 ms, with its own configuration and data directory, stopped by its PID. Four engine
processes (``prometheus_run.py``) export with ``OTEL_METRICS_EXPORTER=prometheus``-style set-up
(``configure(exporters="prometheus,logline")``) and pace themselves so that each record is scraped:

* ``healthy``: a replay of the packaged trace;
* ``leaky``: the same replay with the SWA pool leaking one page in 40 it frees
  (``tests/cli/leaky_swa_pool.py``, SGLang #27789 / #36081);
* ``ranks``: two processes started as torchrun starts them (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``; one ``OTEL_EXPORTER_PROMETHEUS_PORT``), each on its share of the trace.

Every query of ``examples/grafana/otel-swa-dashboard.json`` goes to ``/api/v1/query`` with
``$service`` set to the run's service and ``$host`` to "All", at every pause of the one-process
runs and at the final pause of all processes of every run; its series must equal what
``tests/prometheus_support.py`` computes from the run's own log lines and recounts. An empty
result fails, naming the panel and the query.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_support import Process, counter_values, expected, result_key

from otel_swa.record import find_all
from otel_swa.testing.prometheus import (
    PrometheusServer,
    dashboard_targets,
    free_port,
    grafana_expr,
    label_values_query,
    value,
)

pytestmark = pytest.mark.prometheus

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "otel-swa-dashboard.json"
PROGRAM = Path(__file__).with_name("prometheus_run.py")
SCRAPE_INTERVAL = "200ms"
REQUESTS = 10
LEAK_EVERY = 40


@dataclass
class Run:
    name: str
    service: str
    processes: list  # Process, after the run
    evaluations: list  # times (Unix s) at which every process holds a known state

    def labels(self) -> dict:
        return {"service": self.service, "host": ".*"}


def _two_free_ports() -> int:
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port + 1)) != 0:
                return port
    raise RuntimeError("no two adjacent free ports")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    env.update(OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel,host", OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1", **extra)
    return env


@pytest.fixture(scope="module")
def runs(prometheus_binary, tmp_path_factory):
    base = tmp_path_factory.mktemp("prometheus")
    healthy, leaky, ranks = free_port(), free_port(), _two_free_ports()
    plan = {  # run -> [(rank, port, env, extra argv)]
        "healthy": [(0, healthy, _env(OTEL_EXPORTER_PROMETHEUS_PORT=str(healthy)), [])],
        "leaky": [(0, leaky, _env(OTEL_EXPORTER_PROMETHEUS_PORT=str(leaky)), [str(LEAK_EVERY)])],
        "ranks": [(r, ranks + r, _env(OTEL_EXPORTER_PROMETHEUS_PORT=str(ranks), RANK=str(r), LOCAL_RANK=str(r),
                                      WORLD_SIZE="2"), []) for r in range(2)],
    }
    jobs = [{"job_name": name, "targets": [f"127.0.0.1:{port}" for _, port, _, _ in procs]} for name, procs in plan.items()]
    with PrometheusServer(base / "server", jobs, scrape_interval=SCRAPE_INTERVAL, binary=prometheus_binary) as prom:
        started = []
        for name, procs in plan.items():
            out = base / name
            out.mkdir()
            for rank, port, env, extra in procs:
                argv = [sys.executable, str(PROGRAM), str(out), f"otel-swa-{name}", str(REQUESTS), prom.url,
                        f"127.0.0.1:{port}", *extra]
                started.append((name, rank, port, out, subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)))
        try:
            deadline = time.monotonic() + 240
            for name, rank, port, out, proc in started:
                while not (out / f"rank{rank}.json").exists():
                    assert proc.poll() is None, f"{name} rank {rank} exited: {proc.stderr.read()[-3000:]}"
                    assert time.monotonic() < deadline, f"{name} rank {rank} did not finish"
                    time.sleep(0.05)
            result = {}
            for name, procs in plan.items():
                out = base / name
                processes = []
                for rank, port, _, _ in procs:
                    labels = {"service_name": f"otel-swa-{name}", "host_name": socket.gethostname()}
                    if name == "ranks":
                        labels.update(otel_swa_rank=str(rank), otel_swa_local_rank=str(rank), otel_swa_world_size="2")
                    processes.append(Process.load(out, rank, f"127.0.0.1:{port}", name, labels))
                final = max(p.info["pauses"][-1]["scraped_at"] for p in processes)
                evaluations = [p["scraped_at"] for p in processes[0].info["pauses"]] if len(processes) == 1 else [final]
                result[name] = Run(name, f"otel-swa-{name}", processes, evaluations)
            yield prom, result
        finally:
            for name, rank, port, out, proc in started:
                (out / "done").write_text("")
            for name, rank, port, out, proc in started:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                assert proc.returncode == 0, f"{name} rank {rank}: {proc.stderr.read()[-3000:]}"


def _rate_window_ms(run: Run, at: float) -> int | None:
    """A range from the run's first pause to ``at`` (``None`` at the first pause: one sample)."""
    first = min(p.info["pauses"][0]["scraped_at"] for p in run.processes)
    return int((at - first) * 1000) + 50 if at > first else None


def _compare(prom, run: Run, target, at: float) -> None:
    uses_range = "$__rate_interval" in target.expr
    window = _rate_window_ms(run, at) if uses_range else 0
    if window is None:
        return
    expr = grafana_expr(target.expr, run.labels(), rate_interval=f"{window}ms")
    where = f"panel {target.panel!r} ({target.ref_id}), query {expr} at {at:.3f} in the {run.name} run"
    result = prom.query(expr, at=at)
    assert result, f"empty result: {where}"
    want = expected(expr, run.processes, at, lambda selector, t: prom.query(selector, at=t))
    got = {result_key(series["metric"], want.by): value(series) for series in result}
    assert set(got) == set(want.values), f"{where}: series {sorted(got)} != {sorted(want.values)}"
    for key, number in want.values.items():
        if math.isnan(number):
            assert math.isnan(got[key]), f"{where}: {key} = {got[key]}, expected NaN"
        else:
            assert math.isclose(got[key], number, rel_tol=want.rel, abs_tol=1e-12), \
                f"{where}: {key} = {got[key]}, expected {number}"


@pytest.mark.parametrize("name", ["healthy", "leaky", "ranks"])
def test_every_dashboard_query_returns_the_runs_values(runs, name):
    prom, by_name = runs
    run = by_name[name]
    targets = [t for t in dashboard_targets(DASHBOARD) if not t.is_variable]
    assert len(targets) >= 40
    for at in run.evaluations:
        for target in targets:
            _compare(prom, run, target, at)


@pytest.mark.parametrize("name", ["healthy", "leaky", "ranks"])
def test_scraped_counters_equal_the_records_at_every_pause(runs, name):
    """The raw samples the rate panels are computed from: at every pause, each counter and
    histogram bucket of each process as Prometheus stored it equals the run's records."""
    prom, by_name = runs
    run = by_name[name]
    for at in run.evaluations:
        want = counter_values(run.processes, at)
        result = prom.query(f'{{__name__=~"kv_cache_swa_(forward_steps|entries_verified|reporter_samples_(taken|delivered|invalid)'
                            f'|read_check_queries)_total|kv_cache_swa_reporter_delivery_delay_bucket",'
                            f'service_name="{run.service}"}}', at=at)
        got = {(s["metric"]["__name__"], s["metric"]["instance"], s["metric"].get("pool", ""), s["metric"].get("le", ""),
                s["metric"].get("kv_cache_swa_read_check_outcome", "")): value(s) for s in result}
        assert got == want, at


def test_the_dashboard_variables_list_the_services_and_the_host(runs):
    prom, by_name = runs
    variables = {t.panel: label_values_query(t.expr) for t in dashboard_targets(DASHBOARD) if t.is_variable}
    metric, label = variables["service"]
    assert set(prom.label_values(label, metric)) >= {run.service for run in by_name.values()}
    metric, label = variables["host"]
    assert prom.label_values(label, metric) == [socket.gethostname()]  # the SDK's host detector


def test_headline_values(runs):
    """The figures an operator reads first, each from its dashboard panel, against the records."""
    prom, by_name = runs
    for run in by_name.values():
        records = {p.instance: [p.records[ct] for ct in sorted(p.records)] for p in run.processes}
        at = run.evaluations[-1]
        labels = f'service_name=~"{run.service}",host_name=~".*"'
        # the last divergence: the fleet panel at the final pause is the largest rank's last record
        last = prom.query(f"max(kv_cache_swa_tokens_divergent{{{labels}}})", at=at)
        assert value(last[0]) == max(r[-1].swa_full_idx_divergence for r in records.values())
        # the out-of-window peak over the whole run: every record was scraped
        first = min(p.info["pauses"][0]["scraped_at"] for p in run.processes)
        series = prom.query_range(f"max(kv_cache_swa_tokens_out_of_window{{{labels}}})", first, at, 0.05)
        assert max(float(v) for _, v in series[0]["values"]) == max(
            rec.swa_out_of_window_tokens for r in records.values() for rec in r)
        # pool usage by pool at the final pause: every request finished
        usage = prom.query(f"max by (pool) (kv_cache_pool_tokens_used{{{labels}}})", at=at)
        assert {s["metric"]["pool"]: value(s) for s in usage} == {"full": 0.0, "swa": 0.0 if run.name != "leaky" else
                                                                   float(run.processes[0].info["leaked_pages"])}
        # leaked slots: 0 all along in a healthy run, > 0 in the leaking one (the audit's figure)
        leaked = prom.query_range(f"max(kv_cache_swa_slots_leaked{{{labels}}})", first, at, 0.05)
        peak = max(float(v) for _, v in leaked[0]["values"])
        assert peak == max(rec.swa_leaked_slots for r in records.values() for rec in r)
        assert (peak > 0) == (run.name == "leaky")
        print(f"{run.name}: last divergence {value(last[0]):g}, out-of-window peak "
              f"{max(float(v) for _, v in series[0]['values']):g}, used {usage}, leaked peak {peak:g}")
    # one series per rank in the 2-rank run
    per_rank = prom.query('kv_cache_swa_tokens_out_of_window{service_name=~"otel-swa-ranks",host_name=~".*"}',
                          at=by_name["ranks"].evaluations[-1])
    assert sorted(s["metric"]["otel_swa_rank"] for s in per_rank) == ["0", "1"]


def test_endpoint_labels_ranks_and_keeps_process_identity_off_the_series(runs):
    prom, by_name = runs
    run = by_name["ranks"]
    at = run.evaluations[-1]
    series = prom.query('kv_cache_swa_forward_steps_total{service_name="otel-swa-ranks"}', at=at)
    assert sorted((s["metric"]["instance"], s["metric"]["otel_swa_rank"]) for s in series) == sorted(
        (p.instance, p.labels["otel_swa_rank"]) for p in run.processes)  # ports 9464-style base + LOCAL_RANK
    assert all("process_pid" not in s["metric"] and "service_instance_id" not in s["metric"] for s in series)
    info = prom.query('target_info{job="ranks"}', at=at)  # the whole resource stays joinable
    assert len(info) == 2 and all("process_pid" in s["metric"] for s in info)


def test_replay_command_with_the_endpoint_lingers_for_the_last_scrape(prometheus_binary, tmp_path):
    """``otel-swa replay --exporter prometheus,logline`` with ``OTEL_SWA_PROMETHEUS_LINGER``: the
    last values reach Prometheus before the process exits."""
    port = free_port()
    jobs = [{"job_name": "replay", "targets": [f"127.0.0.1:{port}"]}]
    with PrometheusServer(tmp_path, jobs, scrape_interval=SCRAPE_INTERVAL, binary=prometheus_binary) as prom:
        run = subprocess.run(
            [sys.executable, "-m", "otel_swa.cli", "replay", "--requests", "4", "--no-model", "--interval", "10",
             "--window", "64", "--no-progress", "--exporter", "prometheus,logline"],
            env=_env(OTEL_EXPORTER_PROMETHEUS_PORT=str(port), OTEL_SWA_PROMETHEUS_LINGER="20"),
            capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        records = list(find_all(run.stdout))
        raw = prom.query('kv_cache_swa_forward_steps_total{job="replay"}[5m]')
        last_t, last_v = raw[0]["values"][-1]
        assert float(last_v) == records[-1].forward_ct
        out_of_window = prom.query('kv_cache_swa_tokens_out_of_window{job="replay"}', at=float(last_t))
        assert value(out_of_window[0]) == records[-1].swa_out_of_window_tokens
    assert "was not scraped within" not in run.stderr


DOCS = ROOT / "docs" / "telemetry.md"


def test_the_docs_name_table_is_what_prometheus_scraped(runs):
    prom, _ = runs
    text = DOCS.read_text().split("### Names as scraped", 1)[1].split("###", 1)[0]
    documented = set()
    for row in text.splitlines():
        cells = row.split(" | ")
        # rows of instruments a replay does not export: vLLM's, and the provenance checks'
        if (row.startswith("| `kv_cache.") and len(cells) > 2 and "(vLLM only)" not in cells[1]
                and "(with provenance checks)" not in cells[1]):
            documented |= set(re.findall(r"`(kv_cache_[a-z_]+)`", cells[1].split("(Collector")[0]))
    documented |= {n.replace("_bucket", suffix) for n in documented if n.endswith("_bucket") for suffix in ("_sum", "_count")}
    scraped = {n for n in prom.label_values("__name__", '{service_name="otel-swa-healthy"}') if n.startswith("kv_cache")}
    # a counter of resets exists once a reset happened (none in these runs)
    assert documented - {"kv_cache_swa_reporter_resets_total"} == scraped


def test_the_docs_promql_parses_and_runs(runs):
    prom, _ = runs
    blocks = re.findall(r"```promql\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert len(blocks) >= 4
    for block in blocks:
        expr = "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("#"))
        prom.query(expr)  # a PromQL error is an HTTP 400, raised with Prometheus's message


def test_the_example_scrape_configuration_is_valid(prometheus_binary):
    promtool = Path(prometheus_binary).with_name("promtool")
    check = subprocess.run([str(promtool), "check", "config", str(ROOT / "examples" / "prometheus" / "prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_render_panels_draws_every_panel_of_every_row(runs, tmp_path):
    pytest.importorskip("matplotlib")
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_panels", ROOT / "examples" / "prometheus" / "render_panels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prom, by_name = runs
    run = by_name["healthy"]
    written = module.render(prom, run.evaluations[0] - 1, run.evaluations[-1], tmp_path, run.labels(), "1s", step=0.2)
    assert [path.name for path, _ in written] == ["dashboard-fleet.png", "dashboard-per-host.png", "dashboard-per-rank.png"]
    for path, empty in written:
        assert path.stat().st_size > 10_000 and empty == [], (path, empty)
