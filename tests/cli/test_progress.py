"""Progress lines of a long replay when stderr is not a terminal (a CI log)."""

import io
from types import SimpleNamespace

from otel_swa.cli import main
from otel_swa.commands import _progress
from otel_swa.commands._progress import ProgressLines


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def step(forward_ct, finished=()):
    return SimpleNamespace(forward_ct=forward_ct, finished=list(finished))


def test_a_line_every_interval_of_wall_time_with_counts_and_estimate():
    clock, out = FakeClock(), io.StringIO()
    progress = ProgressLines(10, every_s=30.0, stream=out, clock=clock)
    clock.now = 110.0
    progress(step(1, [7]))             # 10 s: not yet
    clock.now = 129.9
    progress(step(2, [8]))             # 29.9 s: not yet
    assert out.getvalue() == ""
    clock.now = 130.0
    progress(step(3, [9, 10]))         # 30 s: 4 of 10 finished -> 30 * 6 / 4 = 45 s left
    clock.now = 140.0
    progress(step(4))                  # next line due at 160 s
    clock.now = 1260.0
    progress(step(12345, [1, 2, 3, 4, 5, 6]))
    assert out.getvalue().splitlines() == [
        "otel-swa replay: 4 / 10 requests finished, 3 forward steps, 30 s elapsed, about 45 s left",
        "otel-swa replay: 10 / 10 requests finished, 12,345 forward steps, 1,160 s elapsed",
    ]
    assert progress.lines == 2


def test_a_failing_stream_stops_the_lines_without_raising():
    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    clock = FakeClock()
    progress = ProgressLines(3, every_s=0.0, stream=Closed(), clock=clock)
    progress(step(1, [1]))
    progress(step(2, [2]))
    assert progress.lines == 0 and progress.finished == 2


def test_replay_writes_progress_lines_to_a_stderr_that_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(_progress, "PROGRESS_EVERY_S", 0.0)
    run = ["replay", "--requests", "4", "--no-model", "--interval", "20"]
    assert main(run) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    steps = int(next(l for l in captured.out.splitlines() if l.startswith("  forward steps")).split()[-1])
    assert len(lines) == steps  # every_s 0: one line per forward step
    assert lines[-1].startswith(f"otel-swa replay: 4 / 4 requests finished, {steps} forward steps, ")
    assert main(run + ["--no-progress"]) == 0
    assert capsys.readouterr().err == ""
