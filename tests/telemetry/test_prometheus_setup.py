"""``configure()`` with the Prometheus exporter: where each process listens, what its endpoint
serves, and the errors (no Prometheus server needed: the endpoint is read over HTTP here)."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import REGISTRY, generate_latest

from otel_swa.config import ConfigError, prometheus_address, prometheus_linger
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.telemetry import configure, resolve_exporters
from otel_swa.testing.prometheus import free_port


@pytest.mark.parametrize("ranks, environ, port", [
    ({}, {}, 9464),  # the specification's default
    ({"local_rank": 3, "rank": 11}, {}, 9467),  # torchrun: the local rank
    ({"rank": 2}, {"OTEL_EXPORTER_PROMETHEUS_PORT": "9100"}, 9102),  # no local rank: the global one
    ({"local_rank": 3}, {"OTEL_SWA_PROMETHEUS_PORT_OFFSET": "0"}, 9464),
    ({"local_rank": 3}, {"OTEL_SWA_PROMETHEUS_PORT_OFFSET": "7"}, 9471),
    ({"tp": 1}, {}, 9464),  # a parallel rank alone says nothing about the host's processes
])
def test_each_process_of_a_host_gets_its_own_port(ranks, environ, port):
    host, got, _ = prometheus_address(ranks, environ)
    assert (host, got) == ("localhost", port)


@pytest.mark.parametrize("environ, message", [
    ({"OTEL_EXPORTER_PROMETHEUS_PORT": "http"}, "OTEL_EXPORTER_PROMETHEUS_PORT='http': expected an integer from 1 to 65535"),
    ({"OTEL_EXPORTER_PROMETHEUS_PORT": "70000"}, "OTEL_EXPORTER_PROMETHEUS_PORT='70000': expected an integer from 1 to 65535"),
    ({"OTEL_EXPORTER_PROMETHEUS_PORT": "65535"}, "65535 + LOCAL_RANK 1 = 65536 is above 65535"),
    ({"OTEL_SWA_PROMETHEUS_PORT_OFFSET": "-1"}, "OTEL_SWA_PROMETHEUS_PORT_OFFSET='-1': expected 'rank' or an integer >= 0"),
])
def test_unusable_port_settings_name_the_variable(environ, message):
    with pytest.raises(ConfigError, match=message.replace("+", r"\+").replace("(", r"\(")):
        prometheus_address({"local_rank": 1}, environ)


@pytest.mark.parametrize("text", ["-1", "soon", "601", "nan"])
def test_unusable_linger_names_the_variable(text):
    with pytest.raises(ConfigError, match=f"OTEL_SWA_PROMETHEUS_LINGER='{text}': expected seconds from 0 to 600"):
        prometheus_linger({"OTEL_SWA_PROMETHEUS_LINGER": text})


def test_prometheus_is_a_metrics_exporter_only():
    assert resolve_exporters("prometheus,logline") == {"traces": [], "metrics": ["prometheus"], "logs": ["swa_logline"]}
    assert resolve_exporters(environ={"OTEL_METRICS_EXPORTER": "prometheus"})["metrics"] == ["prometheus"]
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER=prometheus; the Prometheus exporter is for metrics only"):
        resolve_exporters(environ={"OTEL_TRACES_EXPORTER": "prometheus"})


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def test_the_endpoint_serves_the_records_with_the_ranks_and_closes_at_shutdown():
    # the rank listens on the base port + its global rank (3): the port it will bind is the free one
    # (a free base port's +3 may be anybody's on a shared machine)
    served = free_port()
    while served < 1027:
        served = free_port()
    port = served - 3
    environ = {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
               "OTEL_SWA_TP_RANK": "1", "RANK": "3", "WORLD_SIZE": "4"}
    telemetry = configure(exporters="prometheus", use_global=False, set_global=False, environ=environ,
                          default_service_name="endpoint-test")
    records = []
    reporter = telemetry.attach(SwaDivergenceReporter(1, device="cpu", sinks=[lambda r, c: records.append(r)]))
    try:
        import torch

        from otel_swa.views import SwaBatch

        mapping = torch.zeros(14, dtype=torch.int64)
        mapping[5:13] = torch.tensor([3, 4, 1, 2, 7, 8, 9, 10])
        req_to_token = torch.zeros((2, 16), dtype=torch.int32)
        req_to_token[1, :12] = torch.arange(1, 13)
        reporter.observe("full", 12)
        reporter.observe("swa", 8)
        reporter.step(SwaBatch(req_to_token=req_to_token, full_to_swa_index_mapping=mapping,
                               req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([12])))
        reporter.flush()
        text = _get(f"http://127.0.0.1:{port + 3}/metrics")  # 9464-style base + the global rank (no LOCAL_RANK)
    finally:
        reporter.close()
        telemetry.shutdown()
    # mapping 0 for FULL slots 1-4 (out of the window); 5-12 map to 3, 4, 1, 2, 7, 8, 9, 10: all differ
    assert records[0].swa_out_of_window_tokens == 4 and records[0].swa_full_idx_divergence == 8
    lines = {line.split("{")[0]: line for line in text.splitlines() if line.startswith("kv_cache_swa_tokens")}
    assert lines["kv_cache_swa_tokens_out_of_window"].endswith(" 4.0")
    assert lines["kv_cache_swa_tokens_divergent"].endswith(" 8.0")
    for label in ('service_name="endpoint-test"', 'otel_swa_tp_rank="1"', 'otel_swa_rank="3"', 'otel_swa_world_size="4"'):
        assert label in lines["kv_cache_swa_tokens_divergent"]
    assert "process_pid" not in lines["kv_cache_swa_tokens_divergent"]
    assert "process_pid=" in next(line for line in text.splitlines() if line.startswith("target_info"))
    assert "kv_cache" not in generate_latest(REGISTRY).decode()  # prometheus_client's global registry untouched
    with pytest.raises(urllib.error.URLError):
        _get(f"http://127.0.0.1:{port + 3}/metrics")


def test_a_taken_port_is_a_clear_error_and_nothing_is_left_running():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        environ = {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port - 1),
                   "LOCAL_RANK": "1"}
        with pytest.raises(ConfigError, match=rf"cannot listen on 127.0.0.1:{port} \(OTEL_EXPORTER_PROMETHEUS_PORT "
                                              rf"{port - 1} \+ LOCAL_RANK 1\).*its own port"):
            configure(exporters="prometheus,otlp", use_global=False, set_global=False, environ=environ)


def test_linger_waits_for_a_scrape_and_says_so_when_none_comes(caplog):
    port = free_port()
    environ = {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
               "OTEL_SWA_PROMETHEUS_LINGER": "0.5"}
    telemetry = configure(exporters="prometheus", use_global=False, set_global=False, environ=environ)
    start = time.monotonic()
    telemetry.shutdown()
    assert time.monotonic() - start >= 0.5
    assert f"http://127.0.0.1:{port}/metrics was not scraped within OTEL_SWA_PROMETHEUS_LINGER=0.5s" in caplog.text

    telemetry = configure(exporters="prometheus", use_global=False, set_global=False, environ={
        **environ, "OTEL_SWA_PROMETHEUS_LINGER": "30"})
    import threading

    scraped = []
    scrape = threading.Timer(0.3, lambda: scraped.append(_get(f"http://127.0.0.1:{port}/metrics")))
    scrape.start()
    caplog.clear()
    telemetry.shutdown()  # returns once that scrape was answered: no "not scraped" warning
    scrape.join(30)
    assert len(scraped) == 1  # the reply was read in full
    assert "was not scraped" not in caplog.text

    # replay says it waits once it has called begin_linger(): a scrape made between that line and
    # the shutdown is the one waited for (before, shutdown waited for a later one: 30 s for a
    # scraper that had read the line and scraped once)
    telemetry = configure(exporters="prometheus", use_global=False, set_global=False, environ={
        **environ, "OTEL_SWA_PROMETHEUS_LINGER": "30"})
    telemetry.prometheus_endpoint.begin_linger()
    assert _get(f"http://127.0.0.1:{port}/metrics") == ""  # read in full (no instrument has a point yet)
    caplog.clear()
    telemetry.shutdown()
    assert "was not scraped" not in caplog.text


def test_the_linger_is_its_own_bound_not_the_sdks_shutdown_timeout(caplog):
    # OTEL_SWA_PROMETHEUS_LINGER up to 600 s: the wait is not cut at the timeout the SDK hands a
    # reader's shutdown (the MeterProvider's 30 s; here 1 ms, with a scrape 0.3 s later)
    import threading

    from otel_swa.telemetry.prometheus import start_endpoint

    port = free_port()
    reader = start_endpoint({}, {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
                                 "OTEL_SWA_PROMETHEUS_LINGER": "60"})
    scraped = []
    scrape = threading.Timer(0.3, lambda: scraped.append(_get(f"http://127.0.0.1:{port}/metrics")))
    scrape.start()
    reader.shutdown(timeout_millis=1)  # returns once that scrape was answered
    scrape.join(60)
    assert len(scraped) == 1
    assert "was not scraped" not in caplog.text


def test_replay_says_where_its_endpoint_serves_and_how_long_it_waits_at_the_end():
    import os
    import subprocess
    import sys

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1", OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
               OTEL_SWA_PROMETHEUS_LINGER="0.5")
    run = subprocess.run([sys.executable, "-m", "otel_swa.cli", "replay", "--requests", "3", "--no-model", "--interval",
                          "10", "--no-progress", "--exporter", "prometheus"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    url = f"http://127.0.0.1:{port}/metrics"
    lines = run.stderr.splitlines()
    assert lines[0] == f"otel-swa replay: metrics for Prometheus at {url}"
    assert f"otel-swa replay: waiting up to 0.5 s for one more scrape of {url} (OTEL_SWA_PROMETHEUS_LINGER)" in lines
    assert any(f"{url} was not scraped within OTEL_SWA_PROMETHEUS_LINGER=0.5s" in line for line in lines)
