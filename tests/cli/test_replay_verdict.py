"""`otel-swa replay` says when its own run went wrong: a leaking SWA pool (exit 1, and `check` on its
log fails through every front), no sample taken (exit 1), Ctrl-C (summary, exit 130)."""

import os
import re
import signal
import subprocess
import sys

import pytest

import leaky_swa_pool
from verdict_fronts import assert_fails_on_every_front, summary_of
from otel_swa.cli import main

RUN = ["replay", "--no-model", "--no-progress"]


def test_a_replay_that_leaks_swa_pages_exits_1_and_its_log_fails_check(monkeypatch, capsys, tmp_path):
    counts = leaky_swa_pool.install(monkeypatch, every=1000)
    log = tmp_path / "run.log"
    assert main(RUN + ["--requests", "100", "--log-file", str(log)]) == 1
    captured = capsys.readouterr()
    assert counts["leaked"] >= 1  # the stand-in did leak (pages are never given back)
    audit = summary_of(captured.out)["SWA slot audit"]
    assert audit.startswith(f"FAULTS: peak leaked {counts['leaked']} slots, stale 0 tokens, shared 0 slots")
    assert captured.err.splitlines() == [
        f"otel-swa replay: the SWA slot audit found faults (peak swa_leaked_slots={counts['leaked']}); exit status 1"]
    # the audit reached the log: check, the assertion and the fixture fail on it
    assert_fails_on_every_front(
        log, capsys, f"FAILED SWA slot audit: leaked SWA slots: peak swa_leaked_slots={counts['leaked']}", "leaked SWA slots")


def test_a_healthy_replay_exits_0_and_its_log_passes(capsys, tmp_path):
    log = tmp_path / "run.log"
    assert main(RUN + ["--requests", "100", "--log-file", str(log)]) == 0
    assert summary_of(capsys.readouterr().out)["SWA slot audit"].startswith("clean:")
    assert main(["check", str(log), "-q"]) == 0


def test_no_sample_taken_is_said_and_exits_1(capsys):
    assert main(RUN + ["--requests", "2", "--interval", "100000"]) == 1
    captured = capsys.readouterr()
    steps = int(summary_of(captured.out)["forward steps"])
    assert summary_of(captured.out)["samples delivered"] == (
        f"0 / 0 taken (every 100000 forward steps): NONE in {steps} forward step(s), the run ended before the "
        "first sampling step (lower --interval)")
    assert captured.err.splitlines() == [
        f"otel-swa replay: the reporter took no sample in {steps} forward step(s) (interval 100000); exit status 1"]


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_ctrl_c_prints_the_summary_and_exits_130(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    plot = tmp_path / "run.png"
    proc = subprocess.Popen([sys.executable, "-m", "otel_swa.cli", *RUN, "--all", "--interval", "5", "--plot", str(plot)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first = proc.stdout.readline()  # the run start marker: the run is under way
    assert "otel_swa_run_start=" in first
    lines = [proc.stdout.readline() for _ in range(6)]  # three samples and their audit lines
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    summary = summary_of(out)
    delivered, taken = re.match(r"(\d+) / (\d+) taken", summary["samples delivered"]).groups()
    assert delivered == taken and int(taken) >= 3
    records = [line for line in lines + out.splitlines() if "kv_canary_swa_divergence=" in line]
    assert len(records) == int(taken)  # every sample taken was delivered as a line
    assert summary["interrupted"].startswith(f"at forward step {summary['forward steps']} (Ctrl-C)")
    # the engine's figures of the steps run: none skipped, the slots its pools held, its own time
    assert summary["requests skipped"] == "0"
    full, full_pool, swa, swa_pool = map(int, re.fullmatch(r"FULL (\d+) / (\d+), SWA (\d+) / (\d+)",
                                                            summary["peak slots in use"]).groups())
    assert 0 < full <= full_pool and 0 < swa <= swa_pool
    total, replayed, _ = map(float, re.fullmatch(r"([\d.]+) s \(replay ([\d.]+) s, stop ([\d.]+) s\)",
                                                 summary["wall time"]).groups())
    assert replayed <= total
    assert f"otel-swa replay: --plot {plot}: not drawn, the run was interrupted" in err.splitlines()
    assert not plot.exists()
    assert err.strip().endswith("interrupted at forward step " + summary["forward steps"]
                                + "; every sample taken was delivered; exit status 130")
