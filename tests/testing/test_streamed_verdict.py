"""A complete log file judged while it is read (``otel-swa check FILE``, ``records FILE``): the same
verdict and rows as the whole log's, the records let go as they are read, and the logs whose runs
only the whole log can split read whole."""

import dataclasses
import errno
import io
import itertools
import json
import sys

import pytest

import otel_swa.commands.check as check_command
import otel_swa.commands.records as records_command
import otel_swa.logstream as logstream
from otel_swa.cli import main
from otel_swa.logstream import EntryWindow, ReleasedEntryError, stream_log
from otel_swa.testing import wait_for_observation
from otel_swa.testing.sources import text_source
from otel_swa.testing.streaming import judge_log_file

TAG = "otel_swa[verify=attention] "
AUDIT_FAULTS = ("swa_leaked_slots", "swa_stale_tokens", "swa_shared_slots", "swa_premature_evictions")


def record_line(ct, full, swa, div, oow):
    fields = {"forward_ct": ct, "verify_full": full, "verify_swa": swa, "swa_full_idx_divergence": div,
              "swa_out_of_window_tokens": oow}
    return "kv_canary_swa_divergence=" + json.dumps(fields, separators=(",", ":"))


def audit_line(ct, leaked=0):
    fields = {"forward_ct": ct, **{name: 0 for name in AUDIT_FAULTS}, "swa_leaked_slots": leaked}
    return "otel_swa_audit=" + json.dumps(fields, separators=(",", ":"))


def two_ranks_two_runs(path, records=40, leaked_at=None, drop_audit_at=None):
    """Two tensor-parallel ranks, two runs (run start markers), each record with its audit line; TP1
    leaks a slot in run 2 at ``leaked_at``; the audit line of TP0's record ``drop_audit_at`` of run 1
    is lost. Returns what each (run, rank) wrote: a list of (forward_ct, divergence, out-of-window)."""
    lines, wrote = [], {}
    for run in (1, 2):
        for rank in ("TP0", "TP1"):
            lines.append(f"[2026-12-07 10:00:00 {rank}] {TAG}otel_swa_run_start={{\"pid\":{run}{rank[-1]}}}")
        for i in range(records):
            ct = 20 * (i + 1)
            for rank in ("TP0", "TP1"):
                div, oow = (i * 7 + run) % 13, (i * 11 + len(rank) * run) % 17
                prefix = f"[2026-12-07 10:00:{i % 60:02d} {rank}] {TAG}"
                lines.append(prefix + record_line(ct, 1000 * (i + 1), 400 * (i + 1), div, oow))
                if not (run == 1 and rank == "TP0" and i == drop_audit_at):
                    leaked = 3 if (run == 2 and rank == "TP1" and i == leaked_at) else 0
                    lines.append(prefix + audit_line(ct, leaked))
                wrote.setdefault((run, rank), []).append((ct, div, oow))
    path.write_text("\n".join(lines) + "\n")
    return wrote


MODES = [dict(runs=runs, ranks=ranks, lines=lines, require_clean_audit=audit)
         for runs, ranks, lines, audit in itertools.product(("last", "each", "all"), ("each", "all"),
                                                            ("auto", "sglang", "both"), (True, False))]


def same_verdict(streamed, whole):
    def key(observation):
        return (dataclasses.replace(observation, errors=()),
                [(e.line_no, e.reason, e.prefix) for e in observation.errors])

    return key(streamed) == key(whole) and streamed.explain(verbose=True) == whole.explain(verbose=True)


def test_the_streamed_verdict_is_the_whole_logs_in_every_mode(tmp_path):
    path = tmp_path / "run.log"
    wrote = two_ranks_two_runs(path, leaked_at=7, drop_audit_at=3)
    for modes in MODES:
        streamed = judge_log_file(path, **modes)
        assert streamed is not None, modes
        assert same_verdict(streamed, wait_for_observation(path, timeout_s=0, **modes)), modes
    # and the figures are the log's own, computed here from what was written
    observation = judge_log_file(path, runs="each")
    assert observation.records == 4 * 40
    groups = {(g.run, g.rank): g for g in observation.groups}
    assert sorted(groups) == [(1, "TP0"), (1, "TP1"), (2, "TP0"), (2, "TP1")]
    for (run, rank), items in wrote.items():
        group = groups[(run, rank)]
        peak_div = max(div for _, div, _ in items)
        peak_oow = max(oow for _, _, oow in items)
        assert (group.records, group.peak_divergence, group.peak_out_of_window) == (40, peak_div, peak_oow)
        assert group.peak_divergence_at == next(ct for ct, div, _ in items if div == peak_div)
        assert group.peak_out_of_window_at == next(ct for ct, _, oow in items if oow == peak_oow)
    assert groups[(2, "TP1")].failed == ("audit",)
    leaked = next(p for p in groups[(2, "TP1")].audit_peaks if p.rule.field == "swa_leaked_slots")
    assert (leaked.peak, leaked.peak_at) == (3, 20 * 8)
    # run 1's lost audit line (TP0's 4th record, forward_ct=80) fails its audit, not run 2's
    assert groups[(1, "TP0")].failed == ("audit",) and groups[(2, "TP0")].ok
    assert "audit line missing for the record at line" in groups[(1, "TP0")].failures[0].reason


def test_lines_of_several_processes_are_judged_from_the_whole_log(tmp_path, capsys):
    # a record whose log prefix another process's write took (it stands at the start of a line)
    # while the other lines name ranks: only the whole log can say whose it is
    path = tmp_path / "run.log"
    two_ranks_two_runs(path, records=6)
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "forward_ct\":60" in line and "TP1]" in line)
    lines[at] = lines[at].split("] ", 1)[1]  # the prefix gone: the tag and the record at the line's start
    path.write_text("\n".join(lines) + "\n")
    assert judge_log_file(path) is None
    whole = wait_for_observation(path, timeout_s=0)
    assert main(["check", str(path)]) == (0 if whole.ok else 1)
    assert capsys.readouterr().out == whole.explain() + "\n"


def test_records_are_let_go_as_the_log_is_read(tmp_path, monkeypatch):
    path = tmp_path / "run.log"
    two_ranks_two_runs(path, records=3000)  # 12,000 records, 24,004 lines, 2.9 MB
    held = []
    release = EntryWindow.release

    def watched(window, upto):
        held.append(len(window._held))
        return release(window, upto)

    monkeypatch.setattr(EntryWindow, "release", watched)
    count = []
    follower = stream_log(path, count.append)
    assert len(count) == 12_000 + 4 and follower.entries._held == []  # every entry once, none kept
    chunk_lines = logstream.STREAM_CHUNK_BYTES // min(len(line) + 1 for line in path.read_text().splitlines())
    assert len(held) > 2 and max(held) <= chunk_lines // 2 + 2  # one chunk's records at most (two lines each)


def test_a_line_written_far_from_its_record_is_paired_from_the_whole_log(tmp_path, capsys):
    # TP0's audit line of forward_ct=40 (run 1) written 30 records later, after a chunk: it still
    # belongs to that record (AuditPairing), which the streamed read has handed on already
    path = tmp_path / "run.log"
    two_ranks_two_runs(path, records=8000)
    lines = path.read_text().splitlines()
    late = next(i for i, line in enumerate(lines) if "TP0]" in line and 'otel_swa_audit={"forward_ct":40,' in line)
    moved = lines.pop(late).replace('"swa_leaked_slots":0', '"swa_leaked_slots":5')
    lines.insert(late + 8000, moved)  # 1.1 MB later: past the first 1 MiB chunk
    path.write_text("\n".join(lines) + "\n")
    assert judge_log_file(path, runs="each") is None
    whole = wait_for_observation(path, timeout_s=0, runs="each")
    run1_tp0 = next(g for g in whole.groups if (g.run, g.rank) == (1, "TP0"))
    leaked = next(p for p in run1_tp0.audit_peaks if p.rule.field == "swa_leaked_slots")
    assert (leaked.peak, leaked.peak_at) == (5, 40) and whole.failed == ("audit",)
    assert main(["check", str(path), "--run", "each"]) == 1
    assert capsys.readouterr().out == whole.explain() + "\n"


def test_an_entry_window_holds_only_its_tail():
    window = EntryWindow()
    for entry in "abcde":
        window.append(entry)
    assert window.release(3) == ["a", "b", "c"] and len(window) == 5
    assert (window[3], window[4:], window[0:]) == ("d", ["e"], ["d", "e"])
    window[4] = "E"
    window.append("f")
    assert window.release(len(window)) == ["d", "E", "f"] and len(window) == 6
    with pytest.raises(ReleasedEntryError):
        window[2]
    with pytest.raises(IndexError):
        window[6]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_records_streamed_are_the_whole_logs_rows(tmp_path, capsys, monkeypatch, fmt):
    path = tmp_path / "run.log"
    wrote = two_ranks_two_runs(path, records=25, leaked_at=4)
    assert main(["records", str(path), "--format", fmt]) == 0
    streamed = capsys.readouterr()
    monkeypatch.setattr(records_command, "_streamed", lambda args: None)  # the whole log, as before
    assert main(["records", str(path), "--format", fmt]) == 0
    assert capsys.readouterr() == streamed
    if fmt == "jsonl":
        rows = [json.loads(line) for line in io.StringIO(streamed.out)]
        assert [(row["run"], row["rank"], row["forward_ct"], row["swa_full_idx_divergence"]) for row in rows] == [
            (run, rank, ct, div) for run in (1, 2) for i in range(25) for rank in ("TP0", "TP1")
            for ct, div, _ in [wrote[(run, rank)][i]]]


def _stdin(monkeypatch, data):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def test_standard_input_is_judged_as_it_is_read_with_the_whole_inputs_verdict(tmp_path, monkeypatch, capsys):
    # `engine | otel-swa check -`: copied to a temporary file and judged from there, records let go
    # as read (as a file is); the explanation names standard input, as the whole read's does
    path = tmp_path / "run.log"
    two_ranks_two_runs(path, leaked_at=7, drop_audit_at=3)
    judged = []
    real = check_command.judge_log_file
    monkeypatch.setattr(check_command, "judge_log_file",
                        lambda *args, **kwargs: judged.append(kwargs["name"]) or real(*args, **kwargs))
    whole = wait_for_observation(text_source(path.read_bytes(), "standard input"), runs="each")
    _stdin(monkeypatch, path.read_bytes())
    assert main(["check", "-", "--run", "each"]) == 1 == (0 if whole.ok else 1)
    assert judged == ["standard input"]
    assert capsys.readouterr().out == whole.explain() + "\n"
    assert "in standard input: 160 record(s) seen" in whole.explain()


def test_standard_input_that_needs_the_whole_log_or_finds_the_disk_full_is_read_whole(tmp_path, monkeypatch,
                                                                                     capsys):
    path = tmp_path / "run.log"
    two_ranks_two_runs(path, records=6)
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "forward_ct\":60" in line and "TP1]" in line)
    lines[at] = lines[at].split("] ", 1)[1]  # as above: only the whole log says whose this record is
    data = ("\n".join(lines) + "\n").encode()
    whole = wait_for_observation(text_source(data, "standard input"), timeout_s=0)
    _stdin(monkeypatch, data)
    assert main(["check", "-"]) == (0 if whole.ok else 1)
    assert capsys.readouterr().out == whole.explain() + "\n"

    def full_disk(source, target, length):  # stands in for a full /tmp: half copied, then ENOSPC
        target.write(source.read(len(data) // 2))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(check_command.shutil, "copyfileobj", full_disk)
    _stdin(monkeypatch, data)
    assert main(["check", "-"]) == (0 if whole.ok else 1)  # every byte judged, from memory
    assert capsys.readouterr().out == whole.explain() + "\n"
