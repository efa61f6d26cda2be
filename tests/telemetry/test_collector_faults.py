"""A collector that is down, never answers, or dies and comes back: the program still ends in time,
says what was not exported, logs each kind of failure once, and the totals are right once the
collector is back (cumulative temporality)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from collector_support import RotelCollector, free_port

from otel_swa.record import find_all

pytestmark = pytest.mark.collector

REPLAY = [sys.executable, "-m", "otel_swa.cli", "replay", "--requests", "8", "--no-model", "--interval", "10",
          "--window", "64", "--swa-pool", "1024", "--no-progress", "--exporter", "otlp,logline"]


def _env(endpoint: str, **more: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_INSECURE": "true", **more})
    return env


def _export_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "Failed to export" in line or "Transient error" in line]


def test_a_closed_port_is_reported_once_per_kind_in_a_summary_and_in_the_exit_status():
    port = free_port()  # nothing listens there
    started = time.monotonic()
    run = subprocess.run(REPLAY, env=_env(f"http://127.0.0.1:{port}", OTEL_EXPORTER_OTLP_TIMEOUT="1"),
                         capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert run.returncode == 3, run.stderr[-2000:]  # every export of every signal failed
    assert find_all(run.stdout)  # the lines are written whatever the collector does
    warnings = _export_warnings(run.stderr)
    # one line per kind (transient retry, final failure) and signal at most, not one per retry
    assert 1 <= len(warnings) <= 6, "\n".join(warnings)
    summary = [line for line in run.stderr.splitlines() if "otel-swa: exports failed" in line]
    assert len(summary) == 1 and "metrics:" in summary[0]
    repeats = re.search(r"; (\d+) repeated exporter warning\(s\) not logged$", summary[0])
    assert repeats is None or int(repeats.group(1)) > 0, summary[0]  # never "0 ... not logged"
    assert run.stderr.splitlines()[-1] == ("otel-swa replay: every export of traces, metrics, logs failed: nothing of "
                                           "it reached its destination; exit status 3")
    # "samples delivered 14 / 14" is never the only word: the summary says nothing was sent
    exported = next(line for line in run.stdout.splitlines() if line.strip().startswith("exported"))
    assert "traces 0 spans" in exported and "metrics 0 data points" in exported and "EXPORTS FAILED" in exported
    # the wall time is the command's, the stop's waits on the exporters included
    row = re.search(r"^  wall time\s+(\d+\.\d) s \(replay (\d+\.\d) s, stop (\d+\.\d) s\)$", run.stdout, re.MULTILINE)
    total, replayed, stop = (float(value) for value in row.groups())
    # each rounded to 0.1 s
    assert replayed + stop <= total + 0.1 and total <= elapsed + 0.1


def test_a_run_whose_exports_partly_failed_keeps_its_exit_status():
    from otel_swa.commands._replay_summary import verdict_of
    from otel_swa.telemetry.exporters import ExportCounts

    partly = {"traces": ExportCounts(10, 5, 1, 0), "metrics": ExportCounts(40, 0, 0, 0)}
    assert verdict_of([], None, False, partly).exit_status == 0
    nothing = {"traces": ExportCounts(10, 5, 1, 0), "metrics": ExportCounts(0, 40, 2, 0)}
    verdict = verdict_of([], None, False, nothing)
    assert (verdict.exports_failed, verdict.exit_status) == (("metrics",), 3)
    assert verdict_of([], None, True, nothing).exit_status == 130


class Blackhole:
    """A TCP server that accepts connections and never answers (a collector stuck or behind a
    misconfigured proxy)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def test_shutdown_against_a_collector_that_never_answers_is_bounded():
    blackhole = Blackhole()
    try:
        timeout = 3
        run = subprocess.run(REPLAY, env=_env(f"http://127.0.0.1:{blackhole.port}", OTEL_EXPORTER_OTLP_TIMEOUT=str(timeout)),
                             capture_output=True, text=True, timeout=120)
    finally:
        blackhole.close()
    assert run.returncode == 3, run.stderr[-2000:]  # nothing was exported
    assert blackhole.accepted  # the exporters did connect
    # three providers, each waiting its export timeout one after the other, took 3 x 3 s and more;
    # in parallel under one bound: the timeout plus the 2 s margin. The stop alone (the summary's
    # wall time row), so that the interpreter's start and the replay, slow on a loaded machine, do not count
    stop = float(re.search(r"^  wall time .*, stop (\d+\.\d) s\)$", run.stdout, re.MULTILINE).group(1))
    assert stop < 3 * timeout, (stop, run.stderr[-2000:])
    assert any("otel-swa: exports failed" in line for line in run.stderr.splitlines())


PROGRAM = textwrap.dedent(
    """
    import sys, time
    import torch
    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.telemetry import configure
    from otel_swa.views import SwaBatch

    empty = torch.zeros(0, dtype=torch.int64)
    view = SwaBatch(torch.zeros((1, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.int64), empty, empty, ())
    telemetry = configure(exporters="otlp,logline")
    reporter = telemetry.attach(SwaDivergenceReporter(5))
    for step in range(1, 121):
        reporter.observe("full", step)
        reporter.step(view)
        if step % 5 == 0:
            print("step", step, flush=True)
        if step in (40, 80):  # the test stops the collector after step 40, starts it again after step 80
            sys.stdin.readline()
        time.sleep(0.02)  # 40 steps: about five of the 150 ms export intervals per phase
    reporter.close()
    telemetry.shutdown()
    """
)


def _read_until(proc: subprocess.Popen, start: str) -> None:
    for line in proc.stdout:
        if line.startswith(start):
            return
    raise AssertionError(f"the program ended before printing {start!r}: {proc.stderr.read()[-2000:]}")


def test_totals_are_right_after_the_collector_dies_and_comes_back(agent_binary, tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    first = RotelCollector(agent_binary, tmp_path, name="before")
    with first:
        env = _env(first.endpoint("grpc"), OTEL_METRIC_EXPORT_INTERVAL="150", OTEL_EXPORTER_OTLP_TIMEOUT="2",
                   OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE="cumulative")
        proc = subprocess.Popen([sys.executable, str(script)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        _read_until(proc, "step 40")
    # the collector is gone: steps 41 to 80 run (their exports fail); then it comes back on the
    # same ports and the program runs on (steps 81 to 120), whatever the machine's load
    proc.stdin.write("down\n")
    proc.stdin.flush()
    _read_until(proc, "step 80")
    second = RotelCollector(agent_binary, tmp_path, name="after")
    second.grpc_port, second.http_port = first.grpc_port, first.http_port
    with second:
        proc.stdin.write("up\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    lines = find_all(err + out)
    last = lines[-1]
    assert last.forward_ct == 120
    after = second.seen()
    points = [p["value"] for m in after["metrics"] if m.get("name") == "kv_cache.swa.forward_steps" for p in m["points"]]
    verified = [p["value"] for m in after["metrics"] if m.get("name") == "kv_cache.swa.entries.verified"
                for p in m["points"] if p["attributes"].get("pool") == "Str(full)"]
    assert points and points[-1] == last.forward_ct
    assert verified and verified[-1] == last.verify_full == sum(range(1, 121))
