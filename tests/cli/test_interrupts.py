"""Ctrl-C anywhere in every command: the summary (or verdict) so far, an "interrupted" row, exit
status 130, never a traceback; a second Ctrl-C ends the process at once, without a traceback.

Each test sends SIGINT to a child process after a line the child printed (or, for a read, once the
child opened the FIFO it reads), never after a guessed time.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from verdict_fronts import summary_of

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")

HERE = Path(__file__).parent
CLI = [sys.executable, "-m", "otel_swa.cli"]
SHIMS = [sys.executable, str(HERE / "interrupt_shims.py")]
NOT_OBSERVED = (
    '[2025-06-01 12:34:56 TP0] kv_canary_swa_divergence={"forward_ct":20,"verify_full":90,"verify_swa":90,'
    '"swa_full_idx_divergence":0,"swa_out_of_window_tokens":0}\n'
)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SHIM_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _closed_port() -> int:
    with socket.socket() as sock:  # bound, then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Child:
    """A command in a child process whose stderr is read line by line on a thread."""

    def __init__(self, args, env, stdin=None):
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, text=True,
                                     env=env)
        self.err_lines: list[str] = []
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read_err, daemon=True)
        self._reader.start()

    def _read_err(self):
        for line in self.proc.stderr:
            with self._seen:
                self.err_lines.append(line)
                self._seen.notify_all()
        with self._seen:
            self.err_lines.append(None)  # end of stderr
            self._seen.notify_all()

    def wait_for_err(self, text: str, timeout: float = 300) -> str:
        with self._seen:
            found = self._seen.wait_for(lambda: any(line is None or text in line for line in self.err_lines), timeout)
            assert found, f"no {text!r} on stderr: {self.err_lines}"
            line = next(line for line in self.err_lines if line is None or text in line)
            assert line is not None, f"stderr ended without {text!r}: {''.join(self.err_lines[:-1])}"
            return line

    def finish(self, timeout: float = 120):
        out = self.proc.stdout.read()
        self.proc.wait(timeout)
        self._reader.join(timeout)
        return self.proc.returncode, out, "".join(line for line in self.err_lines if line is not None)


def test_replay_ctrl_c_while_the_otlp_exporter_retries_a_closed_port():
    # the collector is down and the OTLP timeout is 600 s: uncut, the stop would wait for the
    # exporters' retries (about a minute of backoff); Ctrl-C cuts them short and names them
    env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", OTEL_EXPORTER_OTLP_TIMEOUT="600")
    child = Child(CLI + ["replay", "--requests", "20", "--no-model", "--no-progress", "--exporter", "otlp,logline"], env)
    child.wait_for_err("Transient error")  # an export is retrying against the closed port
    child.proc.send_signal(signal.SIGINT)
    code, out, err = child.finish(timeout=60)
    assert code == 130, err
    assert "Traceback" not in err
    summary = summary_of(out)
    assert summary["interrupted"].endswith("the exporters' waits were cut short: the last exports of "
                                           "logs, traces, metrics were not sent")
    assert "EXPORTS FAILED" in summary["exported"]
    assert "provider(s) were still exporting; their exports were cut short and what they held is lost" in err
    assert err.rstrip().endswith("every sample taken was delivered; exit status 130")


def test_replay_second_ctrl_c_while_it_stops_exits_at_once():
    # the stand-in keeps the exporters busy after the cut (SHIM_CUT_GRACE_S): the second Ctrl-C
    # must end the process there, with one line and no traceback
    env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", OTEL_EXPORTER_OTLP_TIMEOUT="600",
               SHIM_CUT_GRACE_S="600")
    child = Child(SHIMS + ["replay", "--requests", "20", "--no-model", "--no-progress", "--exporter", "otlp,logline"],
                  env)
    child.wait_for_err("Transient error")
    child.proc.send_signal(signal.SIGINT)
    child.wait_for_err("Ctrl-C again stops at once")
    child.proc.send_signal(signal.SIGINT)
    code, out, err = child.finish(timeout=60)
    assert code == 130
    assert "Traceback" not in err
    assert err.splitlines()[-1] == ("otel-swa replay: interrupted again (Ctrl-C): stopped at once; what was not yet "
                                    "written or exported is lost; exit status 130")
    assert "otel_swa_run_start=" in out  # the lines written before it stay written


@pytest.mark.parametrize("shim", ["SHIM_SLOW_IMPORT", "SHIM_SWALLOWING_IMPORT"])
def test_replay_ctrl_c_while_torch_imports(shim):
    env = _env(**{shim: "torch"})
    child = Child(SHIMS + ["replay", "--requests", "20", "--no-model", "--no-progress"], env)
    child.wait_for_err("shim: importing torch")
    child.proc.send_signal(signal.SIGINT)
    code, out, err = child.finish()
    assert code == 130, err
    assert "Traceback" not in err
    summary = summary_of(out)
    assert summary["interrupted"] == ("before the run began (Ctrl-C while starting up: imports, the trace); "
                                      "nothing was replayed")
    assert summary["trace"] == "conv"
    assert err.splitlines()[-1] == "otel-swa replay: interrupted before the run began; exit status 130"


@pytest.mark.parametrize("until", ["pass", "end"])
def test_check_ctrl_c_during_wait_judges_what_was_read(tmp_path, until):
    log = tmp_path / "run.log"
    log.write_text(NOT_OBSERVED)
    child = Child(CLI + ["check", str(log), "--wait", "600", "--until", until], _env())
    line = child.wait_for_err("otel-swa check: waiting up to 600 s")
    assert line.rstrip() == f"otel-swa check: waiting up to 600 s for log file {str(log)!r} (Ctrl-C judges what was read by then)"
    child.proc.send_signal(signal.SIGINT)
    code, out, err = child.finish()
    assert code == 130, err
    assert "Traceback" not in err
    lines = out.splitlines()
    assert lines[0].startswith(f"SWA path NOT observed in {log}: 1 record(s) seen")
    assert lines[1].startswith("  interrupted (Ctrl-C) after ") and lines[1].endswith(
        " s of waiting: judged what was read by then")
    assert "    FAILED divergence: peak swa_full_idx_divergence=0 at forward_ct=20 (need >= 1)" in lines
    assert err.splitlines()[-1] == "otel-swa check: interrupted (Ctrl-C) while waiting; exit status 130"


@pytest.mark.parametrize("exists", [False, True], ids=["not yet written", "empty"])
def test_check_ctrl_c_while_waiting_for_a_log_not_yet_written(tmp_path, exists):
    log = tmp_path / "run.log"
    if exists:
        log.write_text("")
    child = Child(CLI + ["check", str(log), "--wait", "600"], _env())
    child.wait_for_err("otel-swa check: waiting up to 600 s")
    child.proc.send_signal(signal.SIGINT)
    code, out, err = child.finish()
    assert code == 130, err  # the Ctrl-C's status, not the unusable input's (2)
    assert "Traceback" not in err and out == ""
    why = "is empty: no log text at all" if exists else "does not exist"
    assert err.splitlines()[-2].startswith(f"otel-swa check: log file {str(log)!r} {why}")
    assert err.splitlines()[-2].endswith(": nothing was read to judge")
    assert err.splitlines()[-1] == "otel-swa check: interrupted (Ctrl-C) while waiting; exit status 130"


@pytest.mark.parametrize("command", [["records"], ["check"], ["plot", "-o", "never.png"]])
def test_ctrl_c_while_a_command_reads_its_log(tmp_path, command):
    # the log is a FIFO: the child's open returns once this test opens it for writing, then the
    # child's read waits for text that never comes; Ctrl-C there: one line, 130
    fifo = tmp_path / "run.log"
    os.mkfifo(fifo)
    args = CLI + command[:1] + [str(fifo)] + command[1:]
    child = Child(args, _env())
    with open(fifo, "w") as writer:  # returns when the child has opened the FIFO for reading
        writer.write(NOT_OBSERVED)
        writer.flush()
        child.proc.send_signal(signal.SIGINT)
        code, out, err = child.finish()
    assert code == 130, err
    assert err == f"otel-swa {command[0]}: interrupted (Ctrl-C); exit status 130\n"
    assert out == ""


def test_the_process_interrupted_ends_at_once_without_the_interpreters_clean_up(monkeypatch, capsys):
    # A second Ctrl-C during the interpreter's clean-up after the first (torch's teardown, a few
    # tenths of a second; Python has given SIGINT back to the default by then) killed the process by
    # the signal: status -2 to a Python parent, no line said. The process's own command, once
    # interrupted, flushes its output and ends with 130 at once.
    import otel_swa.cli as cli
    import otel_swa.commands.check as check_command

    def interrupted(args):
        print("the verdict so far")
        raise KeyboardInterrupt

    exits = []

    def exit_now(status):
        exits.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(check_command, "run", interrupted)
    monkeypatch.setattr(cli.os, "_exit", exit_now)
    monkeypatch.setattr(sys, "argv", ["otel-swa", "check", "run.log"])
    handler = signal.getsignal(signal.SIGINT)  # the process's own command keeps its handler: given back here
    try:
        with pytest.raises(SystemExit):
            cli.main()
    finally:
        signal.signal(signal.SIGINT, handler)
    assert exits == [130]
    captured = capsys.readouterr()
    assert captured.out == "the verdict so far\n"
    assert captured.err == "otel-swa check: interrupted (Ctrl-C); exit status 130\n"
    assert cli.main(["check", "run.log"]) == 130 and exits == [130]  # called with arguments: returns
