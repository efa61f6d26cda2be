"""Standard output closed by its reader (``| head -1``, ``| true``) or unwritable (``> /dev/full``).

The commands run in a child process whose standard output is a pipe with no reader left (its read end
is closed before the child starts), so every write fails with EPIPE, deterministically.
"""

import os
import subprocess
import sys

import pytest
from cli_support import SGLANG_LINE as OBSERVED

NOT_OBSERVED = (
    '[2025-06-01 12:34:56 TP0] kv_canary_swa_divergence={"forward_ct":20,"verify_full":90,"verify_swa":90,'
    '"swa_full_idx_divergence":0,"swa_out_of_window_tokens":0}\n'
)
CLI = [sys.executable, "-m", "otel_swa.cli"]


def _run_with_closed_stdout(args, tmp_path):
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(CLI + args, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    return proc.returncode, proc.stderr


def test_replay_into_a_closed_pipe_is_quiet_and_exits_0(tmp_path):
    log_file = tmp_path / "run.log"
    code, err = _run_with_closed_stdout(
        ["replay", "--requests", "10", "--no-model", "--no-progress", "--interval", "20", "--log-file", str(log_file)], tmp_path
    )
    assert err == ""
    assert code == 0
    # the run went on: the log file holds every line (10 requests take more than 20 forward steps)
    lines = log_file.read_text().splitlines()
    records = [line for line in lines if "kv_canary_swa_divergence=" in line]
    assert len(records) >= 1 and len(lines) == 1 + 2 * len(records)  # run start, then each line and its audit


@pytest.mark.parametrize("text, verdict", [(OBSERVED, 0), (NOT_OBSERVED, 1)])
def test_check_into_a_closed_pipe_keeps_its_verdict(tmp_path, text, verdict):
    log = tmp_path / "run.log"
    log.write_text(text)
    code, err = _run_with_closed_stdout(["check", str(log)], tmp_path)
    assert (code, err) == (verdict, "")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("text, verdict", [(OBSERVED, 0), (NOT_OBSERVED, 1)])
def test_check_into_dev_full_keeps_its_verdict_and_says_why_in_one_line(tmp_path, text, verdict):
    log = tmp_path / "run.log"
    log.write_text(text)
    with open("/dev/full", "w") as full:
        proc = subprocess.run(CLI + ["check", str(log)], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert proc.returncode == verdict
    assert proc.stderr.splitlines() == ["otel-swa: cannot write to standard output: No space left on device"]


def test_records_into_a_closed_pipe_is_quiet(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(OBSERVED * 3)
    assert _run_with_closed_stdout(["records", str(log)], tmp_path) == (0, "")


def test_replay_with_the_console_exporters_into_a_closed_pipe_is_quiet(tmp_path):
    # `otel-swa replay --exporter console | head -2`: the console exporters write from their own
    # threads; none may print a traceback when the reader is gone
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(CLI + ["replay", "--requests", "10", "--no-model", "--no-progress", "--interval", "20",
                                     "--exporter", "console"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_replay_into_dev_full_says_so_in_one_line_and_exits_2(tmp_path):
    # the lines, then the summary: one line on stderr for all of them (the console exporters write
    # through the same guard, as the closed-pipe test above shows); the lines are lost, so the
    # run's status is 2, not the 0 of a run whose output was read; the log file still gets them all
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    log_file = tmp_path / "run.log"
    with open("/dev/full", "w") as full:
        proc = subprocess.run(CLI + ["replay", "--requests", "10", "--no-model", "--no-progress", "--interval", "20",
                                     "--log-file", str(log_file)],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["otel-swa: cannot write to standard output: No space left on device"]
    lines = log_file.read_text().splitlines()
    records = [line for line in lines if "kv_canary_swa_divergence=" in line]
    assert len(records) >= 1 and len(lines) == 1 + 2 * len(records)


REPLAY_10 = ["replay", "--requests", "10", "--no-model", "--no-progress", "--interval", "20"]


def _replay_lines(stdout):
    """The log lines of a replay's standard output (the summary left out)."""
    return [line for line in stdout.splitlines() if line.startswith("[")]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_replay_log_file_on_a_full_disk_says_so_in_one_line_and_exits_2():
    # `--log-file /dev/full`: every write to it fails with ENOSPC. One line names the file and the
    # error (no "--- Logging error ---" traceback per line, none at the logger's close), standard
    # output keeps every line and the summary, and the status is 2 (documented: an output that
    # could not be written), not 1 (a fault found)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run(CLI + REPLAY_10 + ["--log-file", "/dev/full"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.stderr.splitlines() == ["otel-swa: cannot write to log file '/dev/full': No space left on device"]
    assert proc.returncode == 2
    lines = _replay_lines(proc.stdout)
    records = [line for line in lines if "kv_canary_swa_divergence=" in line]
    assert len(records) >= 1 and len(lines) == 1 + 2 * len(records)
    assert "otel-swa replay summary" in proc.stdout


def test_replay_log_file_on_a_pipe_without_reader_says_so_and_exits_2():
    # --log-file /dev/fd/N where N is a pipe whose read end is closed: every write fails with EPIPE.
    # For standard output that is `| head` (quiet); for a log file it is a lost log: one line, 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(CLI + REPLAY_10 + ["--log-file", f"/dev/fd/{write_end}"], capture_output=True, text=True,
                              timeout=120, env=env, pass_fds=(write_end,))
    finally:
        os.close(write_end)
    assert proc.stderr.splitlines() == [f"otel-swa: cannot write to log file '/dev/fd/{write_end}': Broken pipe"]
    assert proc.returncode == 2
    assert len(_replay_lines(proc.stdout)) >= 3


def test_replay_with_a_fault_and_an_unwritable_log_file_keeps_exit_1(monkeypatch, capsys):
    # precedence: 130, then 1, then 2: the fault the run found is the verdict; the lost file is said
    import leaky_swa_pool
    from otel_swa.cli import main

    counts = leaky_swa_pool.install(monkeypatch, every=1000)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        status = main(REPLAY_10[:1] + ["--requests", "100", "--no-model", "--no-progress",
                                       "--log-file", f"/dev/fd/{write_end}"])
    finally:
        os.close(write_end)
    err = capsys.readouterr().err.splitlines()
    assert counts["leaked"] >= 1
    assert status == 1
    assert err[0] == f"otel-swa: cannot write to log file '/dev/fd/{write_end}': Broken pipe"
    assert err[1:] == [f"otel-swa replay: the SWA slot audit found faults (peak swa_leaked_slots={counts['leaked']}); "
                       "exit status 1"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_records_into_dev_full_exits_2_in_one_line(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(OBSERVED * 3)
    with open("/dev/full", "w") as full:
        proc = subprocess.run(CLI + ["records", str(log)], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["otel-swa: cannot write to standard output: No space left on device"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_plot_into_dev_full_exits_2_in_one_line(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "run.log"
    log.write_text(OBSERVED * 3)
    with open("/dev/full", "w") as full:
        proc = subprocess.run(CLI + ["plot", str(log), "-o", str(tmp_path / "run.png")], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.stderr.splitlines() == ["otel-swa: cannot write to standard output: No space left on device"]
    assert proc.returncode == 2
    assert (tmp_path / "run.png").stat().st_size > 0


def _run_without_stdout(args):
    # standard output not open at all (a shell's `>&-`): Python starts with sys.stdout None
    return subprocess.run(CLI + args, stdout=None, stderr=subprocess.PIPE, text=True, timeout=120,
                          preexec_fn=lambda: os.close(1))


def test_a_command_started_with_stdout_closed_says_it_in_one_line(tmp_path):
    log_file = tmp_path / "run.log"
    proc = _run_without_stdout(["replay", "--requests", "10", "--no-model", "--no-progress", "--interval", "20",
                                "--log-file", str(log_file)])
    assert (proc.returncode, proc.stderr.splitlines()) == (2, ["otel-swa: cannot write to standard output: it is closed"])
    assert "kv_canary_swa_divergence=" in log_file.read_text()  # the run went on: its log is whole
    proc = _run_without_stdout(["records", str(log_file)])
    assert (proc.returncode, proc.stderr.splitlines()) == (2, ["otel-swa: cannot write to standard output: it is closed"])
    verdict = subprocess.run(CLI + ["check", str(log_file)], capture_output=True, text=True, timeout=60).returncode
    assert verdict in (0, 1)
    proc = _run_without_stdout(["check", str(log_file)])  # the verdict kept, as with > /dev/full
    assert (proc.returncode, proc.stderr.splitlines()) == (verdict, ["otel-swa: cannot write to standard output: it is closed"])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_replay_logs_into_a_named_pipe_its_reader_gets_every_line(tmp_path):
    # --log-file on a named pipe: the check before the run must not open it (an open and close
    # ended the reader's input, and the run's own open then waited for a reader for ever)
    import threading

    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    proc = subprocess.run(CLI + ["replay", "--requests", "10", "--no-model", "--no-progress", "--interval", "20",
                                 "--log-file", str(fifo)], capture_output=True, text=True, timeout=120)
    reader.join(30)
    assert proc.returncode == 0, proc.stderr
    lines = got[0].splitlines()
    records = [line for line in lines if "kv_canary_swa_divergence=" in line]
    assert len(records) >= 1 and len(lines) == 1 + 2 * len(records)
