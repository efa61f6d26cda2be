"""Runs, ranks and writers of a log (otel_swa.testing.runs), against runs counted by hand."""

import pytest

from otel_swa.logsource import LoggedRecord, LoggedRunStart
from otel_swa.record import SwaDivergenceRecord
from otel_swa.testing.judge import judge
from otel_swa.testing.runs import split_runs


def rec(ct, source="attention"):
    return SwaDivergenceRecord(ct, 10 * ct, 4 * ct, 1, 1, verify_source=source)


def logged(items):
    """(rank, forward_ct) -> log entries, one per line; ("start", rank) is a run start marker."""
    out = []
    for line_no, (rank, ct) in enumerate(items, 1):
        if ct == "start":
            out.append(LoggedRunStart(line_no, None, rank, "attention", 1))
        else:
            out.append(LoggedRecord(rec(ct), line_no, None, rank))
    return out


def runs_of(items):
    return [(r.rank, r.record.forward_ct, r.run) for r in split_runs(logged(items))]


def test_forward_ct_going_back_starts_a_new_run_per_rank():
    items = [("TP0", 20), ("TP1", 20), ("TP0", 40), ("TP1", 40),   # run 1, both ranks
             ("TP0", 20), ("TP1", 20), ("TP1", 40), ("TP0", 40)]   # run 2, both restarted
    assert runs_of(items) == [("TP0", 20, 1), ("TP1", 20, 1), ("TP0", 40, 1), ("TP1", 40, 1),
                              ("TP0", 20, 2), ("TP1", 20, 2), ("TP1", 40, 2), ("TP0", 40, 2)]


def test_a_rank_that_starts_late_joins_the_run_of_the_log_and_a_late_line_stays_in_its_run():
    # TP1 logs nothing in run 1 but appears in run 2; TP0's 60 is logged after run 2 began (buffered)
    items = [("TP0", 20), ("TP0", 40), ("TP0", 20), ("TP1", 20), ("TP1", 40)]
    assert runs_of(items) == [("TP0", 20, 1), ("TP0", 40, 1), ("TP0", 20, 2), ("TP1", 20, 2), ("TP1", 40, 2)]
    buffered = [("TP0", 20), ("TP1", 20), ("TP0", 20), ("TP1", 40)]
    assert runs_of(buffered) == [("TP0", 20, 1), ("TP1", 20, 1), ("TP0", 20, 2), ("TP1", 40, 1)]


def test_a_run_start_marker_starts_a_run_even_when_forward_ct_goes_up():
    # run 1 at interval 10 ends at 30; run 2 at interval 100 starts at 100 > 30
    items = [(None, "start"), (None, 10), (None, 20), (None, 30), (None, "start"), (None, 100), (None, 200)]
    assert runs_of(items) == [(None, 10, 1), (None, 20, 1), (None, 30, 1), (None, 100, 2), (None, 200, 2)]
    # without the marker the two runs cannot be told apart
    plain = [(None, 10), (None, 20), (None, 30), (None, 100), (None, 200)]
    assert [run for _, _, run in runs_of(plain)] == [1, 1, 1, 1, 1]


def test_writers_are_separate_streams():
    entries = [LoggedRecord(rec(20), 1), LoggedRecord(rec(20, None), 2),   # otel-swa's line, SGLang's line
               LoggedRecord(rec(40), 3), LoggedRecord(rec(40, None), 4)]
    out = split_runs(entries)
    assert [(r.writer, r.record.forward_ct, r.run) for r in out] == [
        ("otel-swa", 20, 1), ("sglang", 20, 1), ("otel-swa", 40, 1), ("sglang", 40, 1)]
    assert not any(r.back_and_forth for r in out)


def test_two_runs_writing_at_once_are_marked_back_and_forth():
    # A: 20 40 60 80, B: 20 40 60 80, lines alternating, each with its start marker first
    items = [(None, "start"), (None, 20), (None, "start"), (None, 20),
             (None, 40), (None, 40), (None, 60), (None, 60), (None, 80), (None, 80)]
    out = split_runs(logged(items))
    assert [(r.record.forward_ct, r.back_and_forth) for r in out] == [
        (20, False), (20, False), (40, False), (40, False), (60, True), (60, False), (80, True), (80, False)]


def test_sequential_runs_are_not_taken_for_interleaved_ones():
    # a short run at interval 10 (10, 20, 30), then one at interval 20 (20, 40, 60) without start
    # markers (SGLang's own lines): 40 > 30 looks like one step back and forth, once; the judge
    # needs two before it calls the runs interleaved
    items = [(None, 10), (None, 20), (None, 30), (None, 20), (None, 40), (None, 60)]
    out = split_runs(logged(items))
    assert [r.run for r in out] == [1, 1, 1, 2, 2, 2]
    assert [r.back_and_forth for r in out] == [False, False, False, False, True, False]
    assert "runs" not in judge(out, runs="each").failed
    # the same with otel-swa's start markers: no mark at all
    marked = [(None, "start")] + items[:3] + [(None, "start")] + items[3:]
    assert not any(r.back_and_forth for r in split_runs(logged(marked)))


def test_plain_records_and_bad_items():
    out = split_runs([rec(20, None), rec(40, None), rec(20, None)])
    assert [(r.rank, r.run, r.line_no, r.writer) for r in out] == [
        (None, 1, None, "sglang"), (None, 1, None, "sglang"), (None, 2, None, "sglang")]
    with pytest.raises(TypeError, match="expected log entries or SwaDivergenceRecord items, got int"):
        split_runs([3])
