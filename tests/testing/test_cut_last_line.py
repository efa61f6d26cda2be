"""A log whose last line is cut in the middle (a log still being written, or copied while it was)
is judged without that line, whatever its kind, in every command and source, and one info line
says so.

The log is a real replay's (records, audit lines, provenance lines, run start marker), plus the
line kinds a clean replay does not write (a fault line, a liveness warning, the next run's start
marker) in the shape the record module writes them. For every kind, the last line is cut in the
middle of its JSON; the verdict must be exactly the verdict of the same log without that line
(the log up to the end of the line before), plus the info line.
"""

import io
import os
import subprocess
import sys

import pytest

from otel_swa.cli import main
from otel_swa.testing import assert_swa_divergence_observed
from otel_swa.testing.assertions import wait_for_observation

PREFIX = "[2026-12-04 18:19:40 TP0] otel_swa[verify=attention] "
EXTRA = {
    "fault": PREFIX + 'otel_swa_fault={"forward_ct":40,"fault":"swa_read_mismatches","request":"11","row":12,'
                      '"position":427,"full_slot":6583,"swa_slot":702,"swa_page":702,"layer":1}',
    "liveness": PREFIX + 'otel_swa_liveness={"pid":4242,"forward_ct":0,"steps":0,"samples_delivered":0,'
                         '"samples_taken":0,"invalid_samples":0,"skipped_captures":0,"cause":"no_forward_step"}',
    "run start": PREFIX + 'otel_swa_run_start={"pid":4242}',
}


@pytest.fixture(scope="module")
def replay_lines(tmp_path_factory):
    log = tmp_path_factory.mktemp("cut") / "run.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-m", "otel_swa.cli", "replay", "--requests", "8", "--swa-pool", "2048", "--interval", "10",
                    "--no-progress", "--log-file", str(log)],
                   check=True, capture_output=True, env=env, timeout=300)
    return log.read_text().splitlines(keepends=True)


def _last_of(lines, prefix):
    return max(i for i, line in enumerate(lines) if prefix in line)


def _cases(lines):
    """(kind, whole lines before the cut line, the cut line)."""
    out = []
    for kind, prefix in (("record", "kv_canary_swa_divergence="), ("audit", "otel_swa_audit="),
                         ("provenance", "otel_swa_provenance=")):
        at = _last_of(lines, prefix)
        line = lines[at].rstrip("\n")
        json_at = line.index(prefix) + len(prefix)
        for keep in (json_at + 1, (json_at + len(line)) // 2, len(line) - 1):  # "{", mid-way, all but "}"
            out.append((kind, lines[:at], line[:keep]))
    for kind, line in EXTRA.items():
        json_at = line.index("={") + 2
        out.append((kind, lines, line[:(json_at + len(line)) // 2]))
    return out


def _check(capsys, path, *options):
    status = main(["check", str(path), *options])
    captured = capsys.readouterr()
    return status, captured.out.splitlines(), captured.err.splitlines()


def _without_note(lines, line_no):
    note = [line for line in lines if line.startswith("  cut line: ")]
    assert len(note) == 1, lines
    assert note[0].startswith(f"  cut line: the last line ({line_no}) has no line end and cannot be read (")
    assert note[0].endswith("): the log is still being written, or was cut there; read without it")
    return [line for line in lines if line not in note]


def test_every_cut_kind_is_judged_without_it_by_check(replay_lines, tmp_path, capsys):
    path = tmp_path / "run.log"
    cases = _cases(replay_lines)
    assert len(cases) == 12
    for kind, before, cut in cases:
        for options in ((), ("--wait", "0.05", "--poll", "0.05"), ("--wait", "30", "--until", "end",
                                                                    "--quiet-period", "0.05", "--poll", "0.05")):
            path.write_text("".join(before))
            whole = _check(capsys, path, *options)
            path.write_text("".join(before) + cut)
            status, out, err = _check(capsys, path, *options)
            assert status == whole[0], (kind, options, out)
            # the same verdict and explanation, the info line aside (waits: the time waited aside)
            strip = lambda lines: [line.split(", waited")[0] for line in lines]  # noqa: E731
            assert strip(_without_note(out, len(before) + 1)) == strip(whole[1]), (kind, options)
            assert [line for line in err if "waiting up to" not in line] == [], (kind, options)


def test_standard_input_text_and_the_fixture_judge_without_the_cut_line(replay_lines, tmp_path, capsys,
                                                                          monkeypatch, swa_records):
    kind, before, cut = _cases(replay_lines)[4]  # the audit line cut mid-way
    assert kind == "audit"
    text = "".join(before) + cut
    # standard input
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert main(["check", "-"]) == 0
    _without_note(capsys.readouterr().out.splitlines(), len(before) + 1)
    # log text, and captured output
    for source in (text, lambda: text):
        observation = assert_swa_divergence_observed(source)
        assert observation.notes[0].startswith(f"cut line: the last line ({len(before) + 1}) has no line end")
    # a file followed by the swa_records fixture
    path = tmp_path / "server.log"
    path.write_text(text)
    swa_records.follow(path)
    observation = swa_records.assert_observed(timeout_s=0.05)
    assert observation.notes[0].startswith(f"cut line: {path}: the last line ({len(before) + 1}) has no line end")


def test_a_cut_provenance_line_used_to_fail_the_run(replay_lines):
    # the case from the field: a log copied while the engine wrote its provenance line
    kind, before, cut = _cases(replay_lines)[7]
    assert kind == "provenance"
    observation = wait_for_observation("".join(before) + cut)
    assert observation.ok and observation.malformed == 0


def test_a_last_line_that_reads_whole_without_its_line_end_is_kept(replay_lines):
    text = "".join(replay_lines).rstrip("\n")
    observation = wait_for_observation(text)
    assert observation.ok and not any(note.startswith("cut line:") for note in observation.notes)
    assert observation.last_line_no == _last_of(replay_lines, "kv_canary_swa_divergence=") + 1


@pytest.mark.parametrize("command", [["records"], ["records", "--format", "csv"], ["plot", "-o", "run.png"]])
def test_records_and_plot_read_without_the_cut_line_and_say_so(replay_lines, tmp_path, capsys, command):
    if command[0] == "plot":
        pytest.importorskip("matplotlib")
    kind, before, cut = _cases(replay_lines)[1]  # the last record line cut mid-way
    assert kind == "record"
    path = tmp_path / "run.log"
    path.write_text("".join(before))
    args = command[:1] + [str(path)] + [tmp_path / a if a.endswith(".png") else a for a in command[1:]]
    args = [str(a) for a in args]
    assert main(args) == 0
    whole = capsys.readouterr()
    path.write_text("".join(before) + cut)
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.out == whole.out
    assert captured.err.splitlines() == [
        f"otel-swa: log file {str(path)!r}: the last line ({len(before) + 1}) has no line end and cannot be read "
        f"({captured.err.split('cannot be read (', 1)[1].rsplit('): the log', 1)[0]}): the log is still being "
        "written, or was cut there; read without it"]


def test_a_line_cut_in_an_earlier_run_does_not_fail_the_last_run(replay_lines, tmp_path):
    # a log that a restarted engine appended to (--log-file appends): the earlier run's provenance
    # line cut in the middle is that run's; --run last judges the last run alone (a line follows its
    # record, so one before the last run's first record cannot be the last run's)
    at = _last_of(replay_lines, "otel_swa_provenance=")
    first_run = replay_lines[:at] + [replay_lines[at][:len(replay_lines[at]) // 2] + "\n"] + replay_lines[at + 1:]
    second_run = [line.replace('otel_swa_run_start={"pid":', 'otel_swa_run_start={"pid":1') for line in replay_lines]
    alone, glued = tmp_path / "alone.log", tmp_path / "glued.log"
    alone.write_text("".join(second_run))
    glued.write_text("".join(first_run + second_run))
    assert main(["check", str(alone)]) == 0  # the last run by itself passes
    assert main(["check", str(glued)]) == 0
    assert main(["check", str(glued), "--run", "each"]) == 1  # judged, the earlier run fails for its line
