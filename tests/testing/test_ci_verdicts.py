"""Verdicts a CI can trust (issue 9): each broken log fails, with its reason, through the judge and
its three fronts alike: the pytest assertion, the ``swa_records`` fixture, and ``otel-swa check``.

The logs are written by hand from records whose verdict is known by reading them: which run is
last, which rank shows no divergence, which sample leaked a slot.
"""

from __future__ import annotations

import pytest

from otel_swa.cli import main
from otel_swa.record import SwaDivergenceRecord, run_start_line
from otel_swa.testing import SwaDivergenceNotObserved, SwaRecordCapture, assert_swa_divergence_observed, judge
from otel_swa.testing.runs import split_runs
from otel_swa.logsource import logged_entries

R = SwaDivergenceRecord
OPTIONS = {"runs": "--run", "ranks": "--ranks", "lines": "--lines"}


def good(ct, source="attention", **audit):
    """A healthy sample: remapped and evicted tokens, the SWA pool read less than the FULL pool."""
    return R(ct, 100 * ct, 30 * ct, 5, 40, verify_source=source, **audit)


def idle(ct, source="attention", **audit):
    """A sample of a broken SWA path: nothing remapped, nothing evicted, both pools read alike."""
    return R(ct, 100 * ct, 100 * ct, 0, 0, verify_source=source, **audit)


def log_of(*runs, rank="TP0", marker=True):
    """Lines as otel-swa's line sink writes them, a run start marker before each run."""
    lines = []
    for run in runs:
        if marker:
            lines.append(f"[2026-01-01 00:00:00 {rank}] {run_start_line('attention', pid=100)}")
        for record in run:
            lines += [f"[2026-01-01 00:00:01 {rank}] {line}" for line in record.lines()]
    return "\n".join(lines) + "\n"


def fronts(tmp_path, text, **rules):
    """The verdict of each front on ``text``: ``(assertion, fixture, check)``, each ``(ok, message)``."""
    path = tmp_path / "server.log"
    path.write_text(text)
    out = []
    for front in ("assertion", "fixture"):
        try:
            if front == "assertion":
                obs = assert_swa_divergence_observed(text, **rules)
            else:
                capture = SwaRecordCapture()
                capture.follow(path)
                obs = capture.assert_observed(timeout_s=0, **rules)
            out.append((True, obs.explain()))
        except SwaDivergenceNotObserved as exc:
            out.append((False, str(exc)))
    argv = ["check", str(path)]
    for name, value in rules.items():
        if name == "require_clean_audit":
            argv += [] if value else ["--no-audit"]
        else:
            argv += [OPTIONS[name], value]
    return out, argv


def check(capsys, argv):
    code = main(argv)
    return code, capsys.readouterr().out


def assert_all_fail(tmp_path, capsys, text, *reasons, **rules):
    """Every front fails, and each message holds every one of ``reasons``."""
    (assertion, fixture), argv = fronts(tmp_path, text, **rules)
    code, out = check(capsys, argv)
    for ok, message in (assertion, fixture, (code == 0, out)):
        assert not ok, message
        for reason in reasons:
            assert reason in message, message
    assert code == 1
    return out


def assert_all_pass(tmp_path, capsys, text, **rules):
    (assertion, fixture), argv = fronts(tmp_path, text, **rules)
    code, out = check(capsys, argv)
    for ok, message in (assertion, fixture, (code == 0, out)):
        assert ok, message
    return out


# ------------------------------------------------------------------ case 1: several runs in one log
GOOD_RUN = [good(20), good(40), good(60)]
FAILING_RUN = [idle(20), idle(40)]


def test_a_failing_run_appended_after_a_good_one_fails(tmp_path, capsys):
    text = log_of(GOOD_RUN, FAILING_RUN)
    # lines: 1 marker, 2-4 run 1, 5 marker, 6-7 run 2
    out = assert_all_fail(tmp_path, capsys, text, "runs: 2 runs in this log (run 2 at line 6); judged the last, run 2",
                          "run 2, TP0: FAILED, 2 record(s), lines 6-7",
                          "FAILED divergence: peak swa_full_idx_divergence=0 at forward_ct=20 (need >= 1)")
    assert out.splitlines()[0] == "SWA path NOT observed in " + str(tmp_path / "server.log") + ": 5 record(s) seen"
    obs = judge(split_runs(logged_entries(text)))
    assert [(g.run, g.rank, g.records, g.failed) for g in obs.groups] == [
        (2, "TP0", 2, ("divergence", "out-of-window", "verify lag"))]


def test_each_run_or_the_whole_log_on_request(tmp_path, capsys):
    text = log_of(GOOD_RUN, FAILING_RUN)
    out = assert_all_fail(tmp_path, capsys, text, "run 1, TP0: ok, 3 record(s)", "run 2, TP0: FAILED", runs="each")
    assert "judged each" in out
    # the whole log as one run: the peaks come from run 1, the last record is run 2's (no lag)
    assert_all_fail(tmp_path, capsys, text, "judged together as one (--run all)",
                    "FAILED verify lag: last record verify_swa=4000 is not < verify_full=4000", runs="all")
    # a good run appended after a failing one passes by default, and says what it left out
    out = assert_all_pass(tmp_path, capsys, log_of(FAILING_RUN, GOOD_RUN))
    assert "2 runs in this log" in out and "judged the last, run 2" in out


def test_a_new_run_with_a_larger_interval_is_told_apart_by_its_start_marker(tmp_path, capsys):
    # run 1 at interval 10 ends at 30; run 2 at interval 100 begins at 100, above 30
    run1 = [good(10), good(20), good(30)]
    run2 = [idle(100), idle(200)]
    assert_all_fail(tmp_path, capsys, log_of(run1, run2), "run 2, TP0: FAILED")


def test_two_runs_writing_one_log_at_once_fail(tmp_path, capsys):
    a = [good(ct) for ct in range(20, 201, 20)]
    # two real runs never write the very same lines (byte-identical adjacent lines are one line
    # logged twice, read once): run b's engine read a little more
    b = [R(ct, 101 * ct, 31 * ct, 5, 40, verify_source="attention") for ct in range(20, 201, 20)]
    lines = [f"[2026-01-01 00:00:00 TP0] {run_start_line('attention', pid=1)}",
             f"[2026-01-01 00:00:00 TP0] {run_start_line('attention', pid=2)}"]
    for x, y in zip(a, b):  # both healthy: each run alone would pass
        lines += [f"[2026-01-01 00:00:01 TP0] {line}" for line in x.lines() + y.lines()]
    text = "\n".join(lines) + "\n"
    out = assert_all_fail(tmp_path, capsys, text, "FAILED runs: forward_ct of TP0 went back and came forward again",
                          "several runs wrote this log at the same time")
    obs = judge(split_runs(logged_entries(text)))
    assert obs.failed == ("runs",)
    assert "came forward again 9 times" in out  # 40 after 20 after 20, then each step up to 200


# ------------------------------------------------------------------ case 2: ranks
def two_ranks(tp1, tp0=None):
    lines = []
    for a, b in zip(tp0 or [good(20), good(40)], tp1):
        lines += [f"[2026-01-01 00:00:00 TP0] {a.line()}", f"[2026-01-01 00:00:00 TP1] {b.line()}"]
    return "\n".join(lines) + "\n"


def test_a_rank_without_the_swa_path_fails_beside_a_healthy_one(tmp_path, capsys):
    text = two_ranks([idle(20), idle(40)])
    out = assert_all_fail(tmp_path, capsys, text, "TP1: FAILED, 2 record(s), lines 2-4",
                          "FAILED verify lag: last record verify_swa=4000 is not < verify_full=4000")
    assert "TP0: ok, 2 record(s), lines 1-3" in out
    assert "judged each rank on its own (TP0, TP1); --ranks all judges them together (pipeline parallelism" in out
    obs = judge(split_runs(logged_entries(text)))
    assert [(g.rank, g.ok) for g in obs.groups] == [("TP0", True), ("TP1", False)]


def test_ranks_all_judges_the_ranks_together(tmp_path, capsys):
    # pipeline parallelism: TP1 never shows divergence on its own, TP0's line is the last one
    text = two_ranks([R(20, 2000, 600, 0, 40, verify_source="attention"),
                      R(40, 4000, 1200, 0, 40, verify_source="attention")])
    text += f"[2026-01-01 00:00:02 TP0] {good(60).line()}\n"
    assert_all_fail(tmp_path, capsys, text, "TP1: FAILED", "FAILED divergence")
    out = assert_all_pass(tmp_path, capsys, text, ranks="all")
    assert "all ranks: ok, 5 record(s), lines 1-5" in out


def test_a_rank_silent_in_the_last_run_fails_as_a_dead_rank(tmp_path, capsys):
    run1 = two_ranks([good(20), good(40)])
    run2 = "".join(f"[2026-01-01 00:01:00 TP0] {r.line()}\n" for r in (good(20), good(40)))
    assert_all_fail(tmp_path, capsys, run1 + run2, "TP1: FAILED, 0 record(s)",
                    "no record from TP1 in this run (it wrote records in run 1): a dead rank?")


# ------------------------------------------------------------------ case 3: the SWA slot audit
CLEAN = dict(swa_leaked_slots=0, swa_stale_tokens=0, swa_shared_slots=0, swa_pages_in_use=50, swa_pages_referenced=50)


def test_a_leaked_slot_on_the_audit_line_fails(tmp_path, capsys):
    leaking = [good(20, **CLEAN), good(40, **{**CLEAN, "swa_leaked_slots": 1, "swa_pages_referenced": 49}),
               good(60, **{**CLEAN, "swa_leaked_slots": 2, "swa_pages_referenced": 48})]
    text = log_of(leaking)  # line 1 marker, then each record's line and its audit line: 2-3, 4-5, 6-7
    assert_all_fail(tmp_path, capsys, text,
                    "FAILED SWA slot audit: leaked SWA slots: peak swa_leaked_slots=2 at forward_ct=60 (line 6), "
                    "first non-zero at forward_ct=40 (line 4)")
    out = assert_all_pass(tmp_path, capsys, text, require_clean_audit=False)
    assert "skip   SWA slot audit: not required" in out
    assert "SWA slot audit" in assert_all_pass(tmp_path, capsys, log_of([good(20, **CLEAN), good(40, **CLEAN)]))


@pytest.mark.parametrize("field, label", [("swa_stale_tokens", "stale tokens"), ("swa_shared_slots", "shared SWA slots")])
def test_stale_tokens_and_shared_slots_fail_too(tmp_path, capsys, field, label):
    text = log_of([good(20, **CLEAN), good(40, **{**CLEAN, field: 3})])
    assert_all_fail(tmp_path, capsys, text, f"FAILED SWA slot audit: {label}: peak {field}=3 at forward_ct=40")


def test_the_fixture_sink_judges_the_audit_of_records_it_is_handed():
    capture = SwaRecordCapture()
    capture(good(20, **CLEAN), None)
    capture(good(40, **{**CLEAN, "swa_leaked_slots": 4}), None)
    with pytest.raises(SwaDivergenceNotObserved, match="leaked SWA slots: peak swa_leaked_slots=4 at forward_ct=40"):
        capture.assert_observed()
    assert capture.assert_observed(require_clean_audit=False).ok


# ------------------------------------------------------------------ the sliding-window check
WINDOW_OK = {"swa_premature_evictions": 0, "swa_late_held_slots": 0}


def test_a_premature_eviction_fails_with_the_reason_in_words(tmp_path, capsys):
    # window check only (no slot audit on these lines): line 1 marker, then record and audit line
    records = [good(20, **WINDOW_OK), good(40, swa_premature_evictions=7, swa_late_held_slots=0),
               good(60, **WINDOW_OK)]
    text = log_of(records)
    assert text.count("otel_swa_audit=") == 3  # a window-checked record writes its audit line
    out = assert_all_fail(tmp_path, capsys, text,
                          "7 live token(s) inside the sliding window had no SWA slot (premature eviction: attention "
                          "read freed KV): peak swa_premature_evictions=7 at forward_ct=40 (line 4)")
    assert "FAILED SWA slot audit:" in out
    assert assert_all_pass(tmp_path, capsys, text, require_clean_audit=False)


def test_late_held_slots_are_reported_and_never_fail(tmp_path, capsys):
    records = [good(20, **CLEAN, **WINDOW_OK), good(40, **CLEAN, swa_premature_evictions=0, swa_late_held_slots=90),
               good(60, **CLEAN, swa_premature_evictions=0, swa_late_held_slots=12)]
    out = assert_all_pass(tmp_path, capsys, log_of(records))
    assert ("info   late-held SWA slots: peak swa_late_held_slots=90 at forward_ct=40 (SWA slots still held by "
            "tokens older than the step's sliding windows plus the engine's eviction allowance; reported, not judged)") in out
    assert "swa_premature_evictions=0 throughout" in out
    observation = judge(records)
    (group,) = observation.groups
    assert [(p.rule.field, p.peak, p.peak_at) for p in group.reported_peaks] == [("swa_late_held_slots", 90, 40)]
    assert group.audited == 3


def test_audit_lines_without_the_window_fields_still_judge_as_before(tmp_path, capsys):
    old = "\n".join([
        "[2026-01-01 00:00:01 TP0] " + good(20).line(),
        '[2026-01-01 00:00:01 TP0] otel_swa[verify=attention] otel_swa_audit={"forward_ct":20,"swa_leaked_slots":0,'
        '"swa_stale_tokens":0,"swa_shared_slots":0}',
        "[2026-01-01 00:00:02 TP0] " + good(40).line(),
        '[2026-01-01 00:00:02 TP0] otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,"swa_leaked_slots":0,'
        '"swa_stale_tokens":0,"swa_shared_slots":0}',
    ]) + "\n"
    out = assert_all_pass(tmp_path, capsys, old)
    assert ("ok     SWA slot audit: clean in 2 audited record(s) (swa_leaked_slots=0, swa_stale_tokens=0, "
            "swa_shared_slots=0 throughout)") in out
    assert "late-held" not in out


# ------------------------------------------------------------------ otel-swa's lines beside SGLang's own
def test_otel_swa_lines_are_judged_when_sglangs_own_are_there_too(tmp_path, capsys):
    # SGLang's own reporter sees nothing (its lines show no divergence); otel-swa's lines do
    lines = []
    for ct in (20, 40):
        lines += [f"[2026-01-01 00:00:00 TP0] {idle(ct, source=None).line()}",
                  f"[2026-01-01 00:00:00 TP0] {good(ct, source='kv_canary').line()}"]
    text = "\n".join(lines) + "\n"
    out = assert_all_pass(tmp_path, capsys, text)
    assert ("otel-swa's tagged lines (2 records) and SGLang's own untagged lines (2) are both here; "
            "judged otel-swa's") in out
    assert "runs:" not in out  # the two streams never start a run of one another
    assert_all_fail(tmp_path, capsys, text, "FAILED divergence", lines="sglang")
    assert_all_fail(tmp_path, capsys, text, "sglang lines, TP0: FAILED", "otel-swa lines, TP0: ok", lines="both")


# ------------------------------------------------------------------ case 5: records glued on one line
def test_records_glued_on_one_line_are_judged_each_with_its_own_rank(tmp_path, capsys):
    # TP1's line landed right after TP0's, without a line end
    text = (f"[2026-01-01 00:00:00 TP0] {good(20).line()}[2026-01-01 00:00:00 TP1] {idle(20).line()}\n"
            f"[2026-01-01 00:00:01 TP0] {good(40).line()}\n[2026-01-01 00:00:01 TP1] {idle(40).line()}\n")
    out = assert_all_fail(tmp_path, capsys, text, "TP1: FAILED, 2 record(s), lines 1-3")
    assert "4 record(s) seen" in out and "malformed" not in out


# ------------------------------------------------------------------ case 6: malformed lines say why
def test_malformed_lines_give_their_line_and_reason(tmp_path, capsys):
    spaced = 'kv_canary_swa_divergence={"forward_ct": 40, "verify_full": 9, "verify_swa": 3, ' \
             '"swa_full_idx_divergence": 1, "swa_out_of_window_tokens": 2}'
    text = f"[2026-01-01 00:00:00 TP0] {spaced}\n[2026-01-01 00:00:01 TP0] kv_canary_swa_divergence={{broken\n"
    out = assert_all_fail(tmp_path, capsys, text, "0 record(s) seen (2 malformed skipped)",
                          "malformed, skipped: line 1: the JSON holds spaces: SGLang's parser (and this one) reads "
                          "only up to the first space")
    assert "... and 1 more malformed line(s) (--verbose lists them)" in out
    code, verbose = check(capsys, ["check", str(tmp_path / "server.log"), "--verbose"])
    assert code == 1 and "malformed, skipped: line 2: the text after the prefix is not JSON" in verbose


# ------------------------------------------------------------------ case 7: values outside int64
def test_a_value_above_int64_is_refused_with_its_field(tmp_path, capsys):
    big = ('kv_canary_swa_divergence={"forward_ct":20,"verify_full":9223372036854775808,"verify_swa":1,'
           '"swa_full_idx_divergence":1,"swa_out_of_window_tokens":1}')
    text = f"[2026-01-01 00:00:00 TP0] {big}\n"
    assert_all_fail(tmp_path, capsys, text, "line 1: verify_full=9223372036854775808 is outside int64")
    with pytest.raises(ValueError, match="verify_full=9223372036854775808 is above the int64 maximum"):
        R(20, 2**63, 1, 1, 1)


def test_a_negative_total_that_sglangs_parser_takes_fails_the_verify_lag_with_why(tmp_path, capsys):
    wrapped = R._as_logged({"forward_ct": 40, "verify_full": -2147483000, "verify_swa": 1500,
                            "swa_full_idx_divergence": 5, "swa_out_of_window_tokens": 40}, None)
    text = f"[2026-01-01 00:00:00 TP0] {good(20, source=None).format()}\n[2026-01-01 00:00:01 TP0] {wrapped.format()}\n"
    assert_all_fail(tmp_path, capsys, text, "a negative total cannot show the lag (a 32-bit verify counter wrapped")


# ------------------------------------------------------------------ case 9: never pass vacuously
def test_no_record_never_passes(tmp_path, capsys):
    assert_all_fail(tmp_path, capsys, "[2026-01-01 00:00:00 TP0] engine started\n",
                    "0 record(s) seen", "no 'kv_canary_swa_divergence=' record found")
    # run start markers alone are no records either
    assert_all_fail(tmp_path, capsys, f"[2026-01-01 00:00:00 TP0] {run_start_line('attention', pid=1)}\n",
                    "0 record(s) seen")


def test_modes_are_checked_with_their_choices():
    with pytest.raises(ValueError, match="runs='first'; expected one of last, each, all"):
        assert_swa_divergence_observed([good(20)], runs="first")
    with pytest.raises(ValueError, match="ranks='some'; expected one of each, all"):
        judge([good(20)], ranks="some")


# ------------------------------------------------------------------ an engine without a FULL-to-SWA mapping
def vllm_sample(ct, out_of_window=40):
    """A healthy vLLM sample: out-of-window tokens, SWA read less than FULL; divergence is a
    placeholder 0 (vLLM keeps no FULL-to-SWA mapping)."""
    return R(ct, 100 * ct, 30 * ct, 0, out_of_window, verify_source="attention", divergence_applicable=False)


def test_a_healthy_vllm_run_passes_its_divergence_not_judged(tmp_path, capsys):
    text = log_of([vllm_sample(20), vllm_sample(40)])
    assert '"divergence_applicable":false' in text  # the flag reaches the log, on the audit line
    out = assert_all_pass(tmp_path, capsys, text)
    assert "n/a    divergence: not judged: the engine has no FULL-to-SWA mapping (vLLM)" in out


def test_a_vllm_run_without_out_of_window_tokens_still_fails(tmp_path, capsys):
    out = assert_all_fail(tmp_path, capsys, log_of([vllm_sample(20, 0), vllm_sample(40, 0)]),
                          "out-of-window")
    assert "FAILED divergence" not in out


def test_a_vllm_run_whose_last_audit_line_was_lost_still_passes(tmp_path, capsys):
    # killed between the last record's two lines: that record carries no flag of its own
    text = log_of([vllm_sample(20), vllm_sample(40)]) + (
        f"[2026-01-01 00:00:01 TP0] {vllm_sample(60).line()}\n")
    out = assert_all_pass(tmp_path, capsys, text)
    assert "n/a    divergence" in out


def test_the_divergence_rule_holds_for_every_run_that_never_says_not_applicable(tmp_path, capsys):
    # a vLLM run, then an SGLang run without divergence restarted onto the same log: the last run
    # (SGLang's) is judged with the rule
    sglang_run = [R(ct, 100 * ct, 30 * ct, 0, 40, verify_source="attention") for ct in (20, 40)]
    out = assert_all_fail(tmp_path, capsys, log_of([vllm_sample(20), vllm_sample(40)], sglang_run), "divergence")
    assert "n/a" not in out


def test_an_otel_swa_sink_that_started_and_wrote_nothing_fails_beside_sglangs_lines(tmp_path, capsys):
    # otel-swa was on (its line sink started) and delivered nothing: a CI failure, even though
    # SGLang's own lines show the SWA path
    text = f"[2026-01-01 00:00:00 TP0] {run_start_line('kv_canary', pid=7)}\n" + "".join(
        f"[2026-01-01 00:00:01 TP0] {R(ct, 100 * ct, 30 * ct, 5, 40).format()}\n" for ct in (20, 40))
    out = assert_all_fail(tmp_path, capsys, text, "otel-swa lines, TP0: FAILED, 0 record(s), line 1",
                          "FAILED liveness: a run start marker (line 1) and no record")
    assert "sglang lines, TP0: ok, 2 record(s), lines 2-3" in out
    assert_all_pass(tmp_path, capsys, text, lines="sglang")  # asked for SGLang's lines only


# ------------------------------------------------------------------ a restart without otel-swa's lines
def bare(ct, good=True, rank="TP0"):
    """SGLang's own line (its canary's reporter), untagged."""
    record = R(ct, 100 * ct, (30 if good else 100) * ct, 5 if good else 0, 40 if good else 0)
    return f"[2026-01-01 00:00:02 {rank}] {record.format()}\n"


def test_sglangs_run_after_otel_swas_last_record_is_judged_too(tmp_path, capsys):
    # a healthy run with both writers, then a restart where only SGLang's canary wrote, broken
    both = "".join(log_of([good(ct)], marker=(ct == 20)) + bare(ct) for ct in (20, 40))
    text = both + "".join(bare(ct, good=False) for ct in (20, 40, 60))
    out = assert_all_fail(tmp_path, capsys, text, "divergence")
    assert "SGLang's own lines hold a run that began after otel-swa's last record" in out
    assert "sglang lines, run 2" in out and "FAILED" in out


def test_a_restart_whose_otel_swa_sink_only_started_is_judged_on_sglangs_lines(tmp_path, capsys):
    text = log_of([good(20), good(40)]) + f"[2026-01-01 00:00:02 TP0] {run_start_line('attention', pid=200)}\n"
    text += "".join(bare(ct, good=False) for ct in (20, 40))
    assert_all_fail(tmp_path, capsys, text, "divergence", "judged both writers")


def test_a_vllm_run_then_a_broken_sglang_restart_fails(tmp_path, capsys):
    text = log_of([vllm_sample(20), vllm_sample(40)]) + "".join(bare(ct, good=False) for ct in (20, 40))
    assert_all_fail(tmp_path, capsys, text, "divergence")


def test_both_writers_on_the_same_steps_judge_otel_swas_lines_only(tmp_path, capsys):
    text = "".join(log_of([good(ct)], marker=(ct == 20)) + bare(ct, good=False) for ct in (20, 40, 60))
    out = assert_all_pass(tmp_path, capsys, text)  # SGLang's bare lines here are a placeholder writer
    assert "judged otel-swa's (--lines sglang or --lines both judges SGLang's)" in out


def test_a_rank_that_started_and_wrote_no_record_fails(tmp_path, capsys):
    text = (f"[2026-01-01 00:00:00 TP1] {run_start_line('attention', pid=2)}\n"
            + log_of([good(20), good(40)], rank="TP0"))
    out = assert_all_fail(tmp_path, capsys, text, "TP1")
    assert "ranks: TP1 wrote a run start marker and no record" in out
    assert "TP0: ok" in out and "TP1: FAILED" in out
