"""Waiting on a log that already holds finished runs (``--log-file`` appends) with ``new_only``
(``otel-swa check --wait N --new``): the run being written is judged, never a finished earlier one."""

from __future__ import annotations

import threading
import time

from otel_swa.record import SwaDivergenceRecord
from otel_swa.testing.assertions import wait_for_observation


def _run_lines(pid: int, good: bool) -> str:
    out = [f'[2026-01-01 00:00:00 TP0] otel_swa[verify=attention] otel_swa_run_start={{"pid":{pid}}}']
    for ct in (20, 40, 60):
        record = SwaDivergenceRecord(ct, 100 * ct, (50 if good else 100) * ct, 7 if good else 0, 30 if good else 0,
                                     verify_source="attention")
        out.append(f"[2026-01-01 00:00:00 TP0] {record.line()}")
    return "\n".join(out) + "\n"


def test_a_finished_good_run_does_not_pass_for_the_failing_one_being_written(tmp_path):
    log = tmp_path / "app.log"
    log.write_text(_run_lines(1, True) + _run_lines(2, True))  # two finished, good runs

    def write_a_bad_run():
        time.sleep(0.5)
        with open(log, "a") as f:
            f.write(_run_lines(3, False))

    writer = threading.Thread(target=write_a_bad_run)
    writer.start()
    observation = wait_for_observation(log, timeout_s=3.0, poll_s=0.1, new_only=True)
    writer.join()
    assert not observation.ok  # the third run, written during the wait, fails
    assert observation.last.forward_ct == 60 and observation.last.swa_full_idx_divergence == 0
    assert observation.waited_s >= 0.5


def test_a_good_run_written_during_the_wait_passes_as_soon_as_it_shows(tmp_path):
    log = tmp_path / "app.log"
    log.write_text(_run_lines(1, False))  # a finished run that failed

    def write_a_good_run():
        time.sleep(0.3)
        with open(log, "a") as f:
            f.write(_run_lines(2, True))

    writer = threading.Thread(target=write_a_good_run)
    writer.start()
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
    assert any("3 record(s) of finished runs already in the source when the wait began were not judged" in n
               for n in observation.notes)
    assert main(["check", str(log), "--wait", "0.3", "--new"]) == 1
    assert "not judged" in capsys.readouterr().out


def test_a_fault_the_run_being_written_logged_before_the_wait_still_fails_it(tmp_path):
    log = tmp_path / "app.log"
    audit = dict(swa_leaked_slots=0, swa_stale_tokens=0, swa_shared_slots=0)
    early = SwaDivergenceRecord(20, 2000, 1000, 7, 30, verify_source="attention", swa_premature_evictions=9, **audit)
    log.write_text(_run_lines(1, True) + '[2026-01-01 00:00:00 TP0] otel_swa[verify=attention] otel_swa_run_start={"pid":2}\n'
                   + "".join(f"[2026-01-01 00:00:00 TP0] {line}\n" for line in early.lines()))

    def write_the_rest_of_the_run():
        time.sleep(0.3)
        with open(log, "a") as f:
            for ct in (40, 60):
                record = SwaDivergenceRecord(ct, 100 * ct, 50 * ct, 7, 30, verify_source="attention",
                                             swa_premature_evictions=0, **audit)
                f.write("".join(f"[2026-01-01 00:00:00 TP0] {line}\n" for line in record.lines()))

    writer = threading.Thread(target=write_the_rest_of_the_run)
    writer.start()
    observation = wait_for_observation(log, timeout_s=2.0, poll_s=0.1, new_only=True)
    writer.join()
    assert not observation.ok and observation.groups[0].failed == ("audit",)
    assert observation.groups[0].records == 3  # run 2 whole: its record from before the wait and the two after
    assert any("3 record(s) of finished runs already in the source when the wait began were not judged; "
               "1 earlier record(s) of the run being written were" in n for n in observation.notes)
