"""Waiting on a log that already holds finished runs (``--log-file`` appends) with ``new_only``
(``otel-swa check --wait N --new``): the run being written is judged, never a finished earlier one."""

from __future__ import annotations

import threading
import time

from otel_swa.record import SwaDivergenceRecord
from otel_swa.testing.assertions import wait_for_observation


def _rank_lines(rank: str, pid: int, cts, good: bool = True) -> str:
    """A run of one rank as its log lines: the run start marker, then a record per forward_ct in
    ``cts`` (divergence and out-of-window 0 when not ``good``)."""
    out = [f'[2026-01-01 00:00:00 {rank}] otel_swa[verify=attention] otel_swa_run_start={{"pid":{pid}}}']
    for ct in cts:
        record = SwaDivergenceRecord(ct, 100 * ct, (50 if good else 100) * ct, 7 if good else 0, 30 if good else 0,
                                     verify_source="attention")
        out.append(f"[2026-01-01 00:00:00 {rank}] {record.line()}")
    return "\n".join(out) + "\n"


def _run_lines(pid: int, good: bool) -> str:
    return _rank_lines("TP0", pid, (20, 40, 60), good)


def _append_later(path, text: str, delay_s: float) -> threading.Thread:
    """Start a thread that appends ``text`` to ``path`` after ``delay_s`` (an engine still writing
    its log while the check waits) and return it."""
    def write():
        time.sleep(delay_s)
        with open(path, "a") as f:
            f.write(text)

    writer = threading.Thread(target=write)
    writer.start()
    return writer


def test_a_finished_good_run_does_not_pass_for_the_failing_one_being_written(tmp_path):
    log = tmp_path / "app.log"
    log.write_text(_run_lines(1, True) + _run_lines(2, True))  # two finished, good runs

    writer = _append_later(log, _run_lines(3, False), 0.5)
    # a failing observation waits out its whole timeout (a later pass could still come)
    observation = wait_for_observation(log, timeout_s=2.0, poll_s=0.1, new_only=True)
    writer.join()
    assert not observation.ok  # the third run, written during the wait, fails
    assert observation.last.forward_ct == 60 and observation.last.swa_full_idx_divergence == 0
    assert observation.waited_s >= 0.5


def test_a_good_run_written_during_the_wait_passes_as_soon_as_it_shows(tmp_path):
    log = tmp_path / "app.log"
    log.write_text(_run_lines(1, False))  # a finished run that failed

    writer = _append_later(log, _run_lines(2, True), 0.3)
    observation = wait_for_observation(log, timeout_s=10.0, poll_s=0.1, new_only=True)
    writer.join()
    assert observation.ok and observation.waited_s < 10.0


def test_without_new_only_a_finished_good_run_passes_at_once(tmp_path):
    log = tmp_path / "app.log"
    log.write_text(_run_lines(1, True))
    observation = wait_for_observation(log, timeout_s=30.0, poll_s=0.1)
    assert observation.ok and observation.waited_s < 1.0  # a finished log is judged at the first read


def test_new_only_with_nothing_written_fails_saying_what_was_left_out(tmp_path, capsys):
    from otel_swa.cli import main

    log = tmp_path / "app.log"
    log.write_text(_run_lines(1, True))
    observation = wait_for_observation(log, timeout_s=0.3, poll_s=0.1, new_only=True)
    assert not observation.ok
    assert any("no record was written during the wait; the 3 record(s) already in the source when it began "
               "were not judged" in n for n in observation.notes)
    assert main(["check", str(log), "--wait", "0.3", "--new"]) == 1
    assert "not judged" in capsys.readouterr().out


def test_a_fault_the_run_being_written_logged_before_the_wait_still_fails_it(tmp_path):
    log = tmp_path / "app.log"
    audit = dict(swa_leaked_slots=0, swa_stale_tokens=0, swa_shared_slots=0)
    early = SwaDivergenceRecord(20, 2000, 1000, 7, 30, verify_source="attention", swa_premature_evictions=9, **audit)
    log.write_text(_run_lines(1, True) + '[2026-01-01 00:00:00 TP0] otel_swa[verify=attention] otel_swa_run_start={"pid":2}\n'
                   + "".join(f"[2026-01-01 00:00:00 TP0] {line}\n" for line in early.lines()))

    rest = [SwaDivergenceRecord(ct, 100 * ct, 50 * ct, 7, 30, verify_source="attention", swa_premature_evictions=0, **audit)
            for ct in (40, 60)]
    writer = _append_later(log, "".join(f"[2026-01-01 00:00:00 TP0] {line}\n" for r in rest for line in r.lines()), 0.3)
    observation = wait_for_observation(log, timeout_s=1.5, poll_s=0.1, new_only=True)
    writer.join()
    assert not observation.ok and observation.groups[0].failed == ("audit",)
    assert observation.groups[0].records == 3  # run 2 whole: its record from before the wait and the two after
    assert observation.groups[0].run == 2  # the run being written, not the finished run 1


def test_a_rank_of_the_run_being_written_that_wrote_nothing_is_a_dead_rank(tmp_path, capsys):
    from otel_swa.cli import main

    log = tmp_path / "app.log"
    log.write_text(_rank_lines("TP0", 1, (20,)) + _rank_lines("TP1", 2, (20,)))  # run 1: both ranks

    writer = _append_later(log, _rank_lines("TP0", 3, (20, 40)), 0.4)  # run 2: TP1 never writes
    assert main(["check", str(log), "--new", "--wait", "1.5", "--poll", "0.1"]) == 1
    writer.join()
    out = capsys.readouterr().out
    assert "run 2, TP1: FAILED" in out and "a dead rank?" in out


def test_new_only_on_a_capture_judges_the_place_that_got_the_new_run(tmp_path):
    from otel_swa.testing import SwaDivergenceNotObserved, SwaRecordCapture, assert_swa_divergence_observed
    import pytest

    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text(_run_lines(1, True))
    second.write_text(_run_lines(2, True))
    capture = SwaRecordCapture()
    capture.follow(first)
    capture.follow(second)

    writer = _append_later(first, _run_lines(3, False), 0.4)
    with pytest.raises(SwaDivergenceNotObserved) as failed:
        assert_swa_divergence_observed(capture, new_only=True, timeout_s=1.5, poll_s=0.1)
    writer.join()
    message = str(failed.value)
    assert "a.log, run 2" in message and "FAILED divergence" in message
    assert "b.log" not in message.split("new only")[0].split("\n", 1)[1]  # b.log got nothing new: not judged


def test_a_pass_waits_one_poll_for_the_audit_line_of_the_last_record(tmp_path):
    log = tmp_path / "app.log"
    record = SwaDivergenceRecord(20, 200, 60, 3, 4, verify_source="attention", swa_leaked_slots=0, swa_stale_tokens=0,
                                 swa_shared_slots=0, swa_premature_evictions=9)
    line, audit = record.lines()
    log.write_text(f'[2026-01-01 00:00:00 TP0] otel_swa[verify=attention] otel_swa_run_start={{"pid":1}}\n'
                   f"[2026-01-01 00:00:00 TP0] {line}\n")  # the audit line not written yet

    writer = _append_later(log, f"[2026-01-01 00:00:00 TP0] {audit}\n", 0.15)
    observation = wait_for_observation(log, timeout_s=1.0, poll_s=0.3)  # the line must come within the poll
    writer.join()
    assert not observation.ok and observation.groups[0].failed == ("audit",)


def test_a_last_record_without_an_audit_line_passes_after_one_more_poll(tmp_path):
    log = tmp_path / "app.log"
    log.write_text(_run_lines(1, True))  # records without audit lines (no audit, no window)
    observation = wait_for_observation(log, timeout_s=5.0, poll_s=0.2)
    assert observation.ok and 0.2 <= observation.waited_s < 5.0  # one more poll, not the whole wait


def test_a_pass_waits_one_poll_for_the_provenance_line_of_the_last_record(tmp_path):
    log = tmp_path / "app.log"
    audit = dict(swa_leaked_slots=0, swa_stale_tokens=0, swa_shared_slots=0)
    first = SwaDivergenceRecord(20, 200, 60, 3, 4, verify_source="attention", kv_stamp_checks=40, kv_foreign_tokens=0,
                                **audit)
    last = SwaDivergenceRecord(40, 400, 120, 3, 4, verify_source="attention", kv_stamp_checks=80, kv_foreign_tokens=2,
                               **audit)
    *written, provenance = last.lines()  # its audit line is there, its provenance line not yet
    log.write_text("".join(f"[2026-01-01 00:00:00 TP0] {line}\n" for line in first.lines() + written))

    writer = _append_later(log, f"[2026-01-01 00:00:00 TP0] {provenance}\n", 0.15)
    observation = wait_for_observation(log, timeout_s=1.0, poll_s=0.3)  # the line must come within the poll
    writer.join()
    assert not observation.ok and observation.groups[0].failed == ("provenance",)
