"""The plugin as a user's test suite sees it: inner pytest runs through pytester."""

import textwrap

pytest_plugins = ["pytester"]

HEADER = textwrap.dedent(
    """
    import threading, time
    from otel_swa.record import SwaDivergenceRecord
    from otel_swa.testing import assert_swa_divergence_observed

    def line(ct, full, swa, div, oow, rank="TP0"):
        return f"[2025-06-01 12:00:{ct % 60:02d} {rank}] " + SwaDivergenceRecord(ct, full, swa, div, oow).format() + "\\n"
    """
)


def run(pytester, body):
    pytester.makepyfile(HEADER + textwrap.dedent(body))
    return pytester.runpytest("-p", "no:cacheprovider")


def test_pass_from_file_and_from_fixture_sink(pytester):
    result = run(pytester, """
        def test_file(tmp_path):
            log = tmp_path / "server.log"
            log.write_text(line(20, 100, 100, 0, 0) + line(40, 300, 200, 4, 0) + line(60, 500, 260, 0, 2))
            obs = assert_swa_divergence_observed(log, timeout_s=0)
            assert (obs.records, obs.peak_divergence, obs.peak_out_of_window) == (3, 4, 2)

        def test_sink(swa_records):
            sink = swa_records           # what a reporter calls: sink(record, context)
            sink(SwaDivergenceRecord(20, 100, 40, 1, 1), None)
            swa_records.assert_observed()
    """)
    result.assert_outcomes(passed=2)


def test_each_threshold_fails_with_explanation(pytester):
    result = run(pytester, """
        import pytest

        LOG = line(20, 100, 40, 2, 3) + line(40, 200, 200, 1, 1)

        def test_divergence():
            assert_swa_divergence_observed(LOG, min_divergence=3, require_verify_lag=False)

        def test_out_of_window():
            assert_swa_divergence_observed(LOG, min_out_of_window=4, require_verify_lag=False)

        def test_verify_lag():
            assert_swa_divergence_observed(LOG)
    """)
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    assert "FAILED divergence: peak swa_full_idx_divergence=2 at forward_ct=20 (need >= 3)" in out
    assert "FAILED out-of-window: peak swa_out_of_window_tokens=3 at forward_ct=20 (need >= 4)" in out
    assert "FAILED verify lag: last record verify_swa=200 is not < verify_full=200" in out
    # each failure's own report (the short summary repeats it in full when CI is set, so count
    # the report lines, which start with "E ")
    assert sum(1 for l in out.splitlines() if l.startswith("E ") and "SWA path NOT observed in log text: 2 record(s) seen" in l) == 3


def test_waits_for_a_late_record(pytester):
    result = run(pytester, """
        def test_late(tmp_path):
            log = tmp_path / "server.log"
            log.write_text(line(20, 100, 100, 0, 0))          # no divergence yet, no lag
            def writer():
                time.sleep(0.3)
                with open(log, "a") as f:
                    f.write(line(40, 300, 200, 5, 0)[:30])  # half a line, then the rest
                    f.flush()
                    time.sleep(0.1)
                    f.write(line(40, 300, 200, 5, 0)[30:] + line(60, 500, 260, 0, 6))
            t = threading.Thread(target=writer)
            t.start()
            try:
                obs = assert_swa_divergence_observed(log, timeout_s=30, poll_s=0.05)
            finally:
                t.join()
            assert (obs.records, obs.malformed, obs.last.forward_ct) == (3, 0, 60)

        def test_file_appears_late(tmp_path, swa_records):
            log = tmp_path / "later.log"
            swa_records.follow(log)
            t = threading.Timer(0.2, lambda: log.write_text(line(20, 100, 40, 1, 1)))
            t.start()
            try:
                obs = swa_records.assert_observed(timeout_s=30, poll_s=0.05)
            finally:
                t.join()
            assert obs.records == 1
    """)
    result.assert_outcomes(passed=2)


def test_no_records(pytester):
    result = run(pytester, """
        def test_none(tmp_path):
            log = tmp_path / "server.log"
            log.write_text("[2025-06-01 12:00:01 TP0] Load weight end.\\n")
            assert_swa_divergence_observed(log, timeout_s=0.2, poll_s=0.05)
    """)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*SWA path NOT observed in */server.log: 0 record(s) seen, waited 0.2 s",
        "*no 'kv_canary_swa_divergence=' record found*",
        "*FAILED divergence: peak swa_full_idx_divergence=0 (need >= 1)",
        "*FAILED verify lag: no last record*",
    ])


def test_malformed_records_are_skipped_and_counted(pytester):
    result = run(pytester, """
        BAD = ('[2025-06-01 12:00:20 TP0] kv_canary_swa_divergence={"forward_ct":20}\\n'
               '[2025-06-01 12:00:40 TP0] kv_canary_swa_divergence={not json\\n')

        def test_malformed_only():
            assert_swa_divergence_observed(BAD)

        def test_malformed_and_good():
            obs = assert_swa_divergence_observed(BAD + line(60, 50, 20, 1, 1))
            assert (obs.records, obs.malformed) == (1, 2)
    """)
    result.assert_outcomes(passed=1, failed=1)
    assert "0 record(s) seen (2 malformed skipped)" in result.stdout.str()


def test_fixture_judges_the_last_run_and_every_rank_of_a_followed_log(pytester):
    result = run(pytester, """
        from otel_swa.record import run_start_line

        def tagged(*fields):  # otel-swa's line: the record after its tag
            return "[2025-06-01 12:00:01 TP0] " + SwaDivergenceRecord(*fields, verify_source="attention").line() + "\\n"

        def appended(path):
            marker = "[2025-06-01 12:00:00 TP0] " + run_start_line("attention", pid=1) + "\\n"
            path.write_text(marker + tagged(20, 100, 40, 3, 5) + tagged(40, 200, 80, 4, 6)      # a good run
                            + marker + tagged(20, 100, 100, 0, 0) + tagged(40, 200, 200, 0, 0))  # then a broken one

        def test_appended_log(tmp_path, swa_records):
            log = tmp_path / "server.log"
            appended(log)
            swa_records.follow(log)
            swa_records.assert_observed(timeout_s=0)

        def test_dead_rank(tmp_path, swa_records):
            log = tmp_path / "server.log"
            log.write_text(line(20, 100, 40, 3, 5) + line(20, 100, 100, 0, 0, rank="TP1")
                           + line(40, 200, 80, 4, 6) + line(40, 200, 200, 0, 0, rank="TP1"))
            swa_records.follow(log)
            swa_records.assert_observed(timeout_s=0)

        def test_whole_log_on_request(tmp_path, swa_records):
            log = tmp_path / "server.log"
            appended(log)
            swa_records.follow(log)
            swa_records.assert_observed(timeout_s=0, runs="all", require_verify_lag=False)
    """)
    result.assert_outcomes(failed=2, passed=1)
    out = result.stdout.str()
    assert "run 2, TP0: FAILED, 2 record(s), lines 5-6" in out
    assert "TP1: FAILED, 2 record(s), lines 2-4" in out


def test_a_test_that_collects_records_and_never_asserts_fails(pytester):
    result = run(pytester, """
        from otel_swa.record import LivenessWarning

        def test_collects_and_forgets(swa_records):
            swa_records(SwaDivergenceRecord(20, 100, 40, 3, 5), None)   # a record reached it: no assertion follows

        def test_follows_and_forgets(tmp_path, swa_records):
            swa_records.follow(tmp_path / "server.log")

        def test_reads_the_records(swa_records):
            swa_records(SwaDivergenceRecord(20, 100, 40, 3, 5), None)
            assert swa_records.records[0].forward_ct == 20               # its own assertion: fine

        def test_asserts(swa_records):
            swa_records(SwaDivergenceRecord(20, 100, 40, 3, 5), None)
            swa_records.assert_observed()

        def test_never_used(swa_records):
            pass                                                         # nothing reached it: nothing to judge

        def test_already_failing(swa_records):
            swa_records(SwaDivergenceRecord(20, 100, 40, 3, 5), None)
            assert False, "its own failure"                              # reported once, not twice

        def test_silent_reporter(swa_records):
            swa_records.liveness(LivenessWarning("no_forward_step", verify_source="attention"), None)
            swa_records.assert_observed()
    """)
    result.assert_outcomes(passed=5, failed=2, errors=2)
    out = result.stdout.str()
    errors = out.split("short test summary info")[0]  # the summary repeats the message when the terminal is wide
    assert errors.count("swa_records collected records (or was set to read logging, a file or output) and the test "
                        "made no assertion on them") == 2
    assert "ERROR at teardown of test_collects_and_forgets" in out and "ERROR at teardown of test_follows_and_forgets" in out
    assert "instrumented, 0 samples in 0 steps: no forward step reached the reporter" in out
