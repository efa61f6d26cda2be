"""Under ``opentelemetry-instrument``, a program that never closes its reporter: every sample taken
reaches the log line and the collector at interpreter exit, and on SIGTERM.

The reference engine runs with the ``swa_reference`` instrumentor loaded by
``opentelemetry-instrument`` (the distro's providers, batching processors, the ``swa_logline``
logs exporter); the program has no ``close()``, no ``shutdown()``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
from collector_support import RotelCollector, int_value

from otel_swa.record import find_all

pytestmark = pytest.mark.collector

APP = textwrap.dedent(
    """
    import sys, time
    from types import SimpleNamespace
    from otel_swa.reference.engine import EngineConfig, ReferenceEngine

    engine = ReferenceEngine(EngineConfig(window=16, full_pool_size=4096, swa_pool_size=512, max_running=4,
                                          token_budget=64, max_context_len=512, step_time_s=0.0))
    for c, g in ((40, 200), (25, 220), (70, 200), (33, 215)):
        engine.submit(SimpleNamespace(context_tokens=c, generated_tokens=g), arrival_s=0.0)
    steps = int(sys.argv[1])
    for step in range(1, steps + 1):
        engine.step()
        print("step", step, flush=True)
        time.sleep(float(sys.argv[2]))
    # no close(), no shutdown(): the interpreter exits here
    """
)


def _launcher() -> str:
    launcher = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    if launcher is None or not list(entry_points(group="opentelemetry_configurator")):
        pytest.skip("opentelemetry-instrument or a distro (pip install opentelemetry-distro) is missing")
    return launcher


def _start(tmp_path, collector, interval: int, steps: int, pause_s: float) -> subprocess.Popen:
    app = tmp_path / "app.py"
    app.write_text(APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env.update({
        "OTEL_SWA_DIVERGENCE_INTERVAL": str(interval),
        "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp", "OTEL_LOGS_EXPORTER": "otlp,swa_logline",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint("grpc"), "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_METRIC_EXPORT_INTERVAL": "600000", "OTEL_BLRP_SCHEDULE_DELAY": "5000",  # nothing leaves before the end
    })
    return subprocess.Popen([_launcher(), sys.executable, str(app), str(steps), str(pause_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)


def _events(seen) -> list[int]:
    return [int_value(l["attributes"]["kv_cache.swa.forward_ct"]) for l in seen["logs"]
            if l.get("event_name") == "kv_cache.swa.divergence_sample"]


@pytest.mark.parametrize("interval", [9, 27])
def test_every_sample_is_written_and_exported_at_exit(agent_binary, tmp_path, interval):
    with RotelCollector(agent_binary, tmp_path) as collector:
        proc = _start(tmp_path, collector, interval, steps=27, pause_s=0.0)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    expected = list(range(interval, 28, interval))
    assert [r.forward_ct for r in find_all(err)] == expected
    assert _events(collector.seen()) == expected


def test_on_sigterm_every_sample_taken_is_written_and_exported(agent_binary, tmp_path):
    with RotelCollector(agent_binary, tmp_path) as collector:
        proc = _start(tmp_path, collector, 3, steps=400, pause_s=0.02)
        for line in proc.stdout:
            if line.strip() == "step 40":
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM  # still ended by SIGTERM, as without otel-swa
    lines = [r.forward_ct for r in find_all(err)]
    assert lines and lines[0] == 3 and len(lines) >= 13
    assert lines == list(range(3, 3 * len(lines) + 1, 3))
    assert _events(collector.seen()) == lines
    metrics = {m.get("name"): m for m in collector.seen()["metrics"]}
    assert metrics["kv_cache.swa.forward_steps"]["points"][-1]["value"] == lines[-1]


BY_HAND = textwrap.dedent(
    """
    import sys, time
    import torch
    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.telemetry import configure
    from otel_swa.views import SwaBatch

    empty = torch.zeros(0, dtype=torch.int64)
    view = SwaBatch(torch.zeros((1, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.int64), empty, empty, ())
    telemetry = configure(exporters="otlp,logline")          # wired by hand, no instrumentor
    reporter = telemetry.attach(SwaDivergenceReporter(1))
    for step in range(1, int(sys.argv[1]) + 1):
        reporter.observe("full", 2)
        reporter.step(view)
    print("sampled", flush=True)
    # short sleeps: a SIGTERM the OS hands to another thread (the exporters') does not cut a long
    # sleep of the main thread short, and Python runs the handler only on the main thread
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        time.sleep(0.05)
    # no close(), no shutdown()
    """
)


def _start_by_hand(tmp_path, collector, steps: int, pause_s: float) -> subprocess.Popen:
    app = tmp_path / "by_hand.py"
    app.write_text(BY_HAND)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint("grpc"), "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_METRIC_EXPORT_INTERVAL": "600000",
                "OTEL_BLRP_SCHEDULE_DELAY": "5000"})
    return subprocess.Popen([sys.executable, str(app), str(steps), str(pause_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)


@pytest.mark.parametrize("ending", ["exit", "sigterm"])
def test_a_reporter_wired_by_hand_is_delivered_and_exported_at_exit_and_on_sigterm(agent_binary, tmp_path, ending):
    with RotelCollector(agent_binary, tmp_path) as collector:
        proc = _start_by_hand(tmp_path, collector, steps=5, pause_s=30.0 if ending == "sigterm" else 0.0)
        if ending == "sigterm":
            for line in proc.stdout:
                if line.strip() == "sampled":
                    break
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == (-signal.SIGTERM if ending == "sigterm" else 0), err[-2000:]
    assert [r.forward_ct for r in find_all(err)] == [1, 2, 3, 4, 5]
    seen = collector.seen()
    assert _events(seen) == [1, 2, 3, 4, 5]
    metrics = {m.get("name"): m for m in seen["metrics"]}
    assert metrics["kv_cache.swa.forward_steps"]["points"][-1]["value"] == 5
