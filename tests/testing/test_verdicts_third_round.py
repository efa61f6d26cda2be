"""Verdicts a CI can trust, third round (issue 18): each case on the three fronts, ``otel-swa
check``, the pytest assertion and the ``swa_records`` fixture (helpers of ``test_ci_verdicts``).

The logs are written from records whose verdict is known by how they were made: which run is the
broken one, which rank wrote which record, which audit line is missing.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_ci_verdicts import CLEAN, R, assert_all_fail, assert_all_pass, good, idle, log_of
from test_wait_on_appended_log import _append_later

from otel_swa import config
from otel_swa.cli import main
from otel_swa.logline import LogLineSink
from otel_swa.logsource import logged_entries
from otel_swa.record import LivenessWarning, SwaDivergenceRecord, run_start_line
from otel_swa.reporter import KVPool, SwaDivergenceReporter
from otel_swa.testing import SwaDivergenceNotObserved, SwaRecordCapture, assert_swa_divergence_observed
from otel_swa.testing.runs import split_runs
from otel_swa.views import SwaBatch

TS = "[2026-01-01 00:00:00 TP0] "


# ------------------------------------------------------------------ 1. runs from the totals
def false_pass_log() -> str:
    """SGLang's own lines: a healthy run (interval 20, totals up to 60,000), then a broken restart
    whose forward_ct goes on upward (interval 50) while verify_full / verify_swa start again low."""
    lines = [TS + R(ct, 6000 * i, 2000 * i, 17, 300).format() for i, ct in enumerate(range(20, 201, 20), 1)]
    lines += [TS + R(ct, 1000 * i, 800 * i, 0, 0).format() for i, ct in enumerate(range(250, 501, 50), 1)]
    return "\n".join(lines) + "\n"


def test_a_restart_whose_forward_ct_goes_on_is_told_by_its_totals(tmp_path, capsys):
    text = false_pass_log()
    assert_all_fail(tmp_path, capsys, text, "runs: 2 runs in this log (run 2 at line 11); judged the last, run 2",
                    "run 2, TP0: FAILED, 6 record(s), lines 11-16",
                    "FAILED divergence: peak swa_full_idx_divergence=0 at forward_ct=250 (need >= 1)",
                    "FAILED out-of-window: peak swa_out_of_window_tokens=0 at forward_ct=250 (need >= 1)")
    assert_all_fail(tmp_path, capsys, text, "run 1, TP0: ok, 10 record(s)", "run 2, TP0: FAILED", runs="each")
    assert [item.run for item in split_runs(logged_entries(text))] == [1] * 10 + [2] * 6


def test_a_wrapped_negative_total_is_no_restart():
    wrapped = R._as_logged({"forward_ct": 40, "verify_full": -2147483000, "verify_swa": 1500,
                            "swa_full_idx_divergence": 5, "swa_out_of_window_tokens": 40}, None)
    assert [item.run for item in split_runs([R(20, 2000, 600, 5, 40), wrapped])] == [1, 1]


# ------------------------------------------------------------------ 2. interleaved writes
def rank_record(rank: int, ct: int, broken: bool = False) -> SwaDivergenceRecord:
    """Rank ``rank``'s sample at ``ct``: its own pace (more requests on higher ranks), idle at 20."""
    full = (100 + 40 * rank) * ct
    if broken:
        return R(ct, full, full, 0, 0, verify_source="attention")
    return R(ct, full, full // 3, 0 if ct == 20 else 5, 0 if ct == 20 else 40, verify_source="attention")


def interleaved_log(broken: bool = False) -> str:
    """Two ranks whose lines were written in parts (prefix, message, line end), interleaved:
    a prefix taken by the other rank's message, two messages glued after two prefixes, a message
    alone at the start of a line (an orphan whose first sample is idle)."""
    a = lambda ct: rank_record(0, ct).line()  # noqa: E731
    b = lambda ct: rank_record(1, ct, broken).line()  # noqa: E731
    p0, p1 = "[2026-01-01 00:00:00 TP0] ", "[2026-01-01 00:00:00 TP1] "
    return "".join([
        f"{p0}{p1}{b(20)}\n",       # TP1 wrote its prefix and message; TP0's prefix stands before them
        f"{a(20)}\n",               # TP0's message, alone on the next line
        f"{p0}{a(40)}\n",
        f"{p1}{p0}{b(40)}{a(60)}\n",  # TP1's message after TP0's prefix, TP0's glued after it
        f"\n{p1}{b(60)}\n",
        f"{p0}{a(80)}\n{p1}{b(80)}\n",
    ])


def test_healthy_ranks_whose_lines_interleaved_pass(tmp_path, capsys):
    text = interleaved_log()
    out = assert_all_pass(tmp_path, capsys, text)
    assert "TP0: ok, 4 record(s)" in out and "TP1: ok, 4 record(s)" in out
    assert "no rank" not in out and "runs:" not in out
    assert "stood after another process's log prefix or none" in out
    # every record went to the rank that wrote it (its totals say which)
    for item in split_runs(logged_entries(text)):
        assert item.rank == ("TP0" if item.record.verify_full == 100 * item.record.forward_ct else "TP1")


def test_a_record_after_two_prefixes_goes_to_the_nearest_when_no_sequence_says_otherwise():
    p0, p1 = "[2026-01-01 00:00:00 TP0] ", "[2026-01-01 00:00:00 TP1] "
    alone = f"{p0}{p1}{rank_record(1, 20).line()}\n"
    assert [item.rank for item in split_runs(logged_entries(alone))] == ["TP1"]
    # TP0's sequence, continued by the record (its pace and forward_ct): TP0's, whatever the prefixes
    text = "".join(f"{p0}{rank_record(0, ct).line()}\n{p1}{rank_record(1, ct).line()}\n" for ct in (20, 40, 60))
    text += f"{p0}{p1}{rank_record(0, 80).line()}\n{p1}{rank_record(1, 80).line()}\n"
    items = split_runs(logged_entries(text))
    assert [(item.rank, item.record.forward_ct) for item in items][-2:] == [("TP0", 80), ("TP1", 80)]
    # and the record that continues TP1's after the same two prefixes: TP1's
    text = text.replace(f"{p0}{p1}{rank_record(0, 80).line()}\n{p1}{rank_record(1, 80).line()}\n",
                        f"{p0}{rank_record(0, 80).line()}\n{p0}{p1}{rank_record(1, 80).line()}\n")
    items = split_runs(logged_entries(text))
    assert [(item.rank, item.record.forward_ct) for item in items][-2:] == [("TP0", 80), ("TP1", 80)]


def test_records_names_the_nearest_prefix_of_a_lone_record_after_two(tmp_path, capsys):
    path = tmp_path / "two.log"
    path.write_text(f"[2026-01-01 00:00:00 TP0] [2026-01-01 00:00:00 TP1] {rank_record(1, 20).line()}\n")
    assert main(["records", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["rank"] == "TP1"


def test_a_broken_rank_whose_lines_interleaved_fails_by_name(tmp_path, capsys):
    out = assert_all_fail(tmp_path, capsys, interleaved_log(broken=True), "TP1: FAILED, 4 record(s)")
    assert "TP0: ok, 4 record(s)" in out


def test_every_line_logged_twice_is_read_once(tmp_path, capsys):
    # two handlers on one logger writing one file: each line twice, one after the other
    lines = log_of([good(20, **CLEAN), good(40, **CLEAN)]).splitlines()
    text = "".join(f"{line}\n{line}\n" for line in lines)
    out = assert_all_pass(tmp_path, capsys, text)
    assert "2 record(s) seen" in out
    assert "lines: 5 exact duplicate line(s) read once (first at line 2)" in out
    assert "malformed" not in out and "runs:" not in out


# ------------------------------------------------------------------ 3. liveness
def test_a_run_of_only_its_start_marker_and_a_liveness_warning_fails(tmp_path, capsys):
    warning = LivenessWarning("no_sample_delivered", forward_ct=200, steps=200, samples_taken=10, invalid_samples=10,
                              verify_source="attention", pid=7)
    text = TS + run_start_line("attention", pid=7) + "\n" + TS + warning.line() + "\n"
    assert_all_fail(tmp_path, capsys, text, "TP0: FAILED, 0 record(s), lines 1-2",
                    "FAILED liveness: instrumented, 0 samples in 200 steps: 10 of 10 sample(s) taken were refused")
    # SGLang's own healthy lines beside it do not hide it
    text += "".join(TS + R(ct, 100 * ct, 30 * ct, 5, 40).format() + "\n" for ct in (20, 40))
    assert_all_fail(tmp_path, capsys, text, "otel-swa lines, TP0: FAILED", "sglang lines, TP0: ok")


def test_a_liveness_warning_in_a_run_with_records_is_shown_not_judged(tmp_path, capsys):
    warning = LivenessWarning("no_sample_delivered", forward_ct=300, steps=200, samples_delivered=2,
                              samples_taken=12, invalid_samples=10, verify_source="attention", pid=7)
    text = log_of([good(20), good(40)]) + TS + warning.line() + "\n"
    out = assert_all_pass(tmp_path, capsys, text)
    assert ("info   liveness: instrumented, 0 samples in the last 200 steps (2 before): 10 of 12 sample(s) taken were "
            "refused") in out


def test_a_never_stepped_reporter_says_so_at_exit_and_fails(tmp_path, capsys):
    # the reference engine under its instrumentor, 453 forward steps that never reach the reporter
    env = {**os.environ, "OTEL_SWA_DIVERGENCE_INTERVAL": "20"}
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("never_stepped.py")), "453"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "engine steps 453, reporter forward_ct 0" in run.stderr
    assert run.stderr.count("otel_swa_liveness=") == 1
    assert_all_fail(tmp_path, capsys, run.stderr, "FAILED liveness: instrumented, 0 samples in 0 steps: no forward "
                    "step reached the reporter (the engine was to step it from ReferenceEngine.step)")


def refusing_view() -> SwaBatch:
    """A batch whose host lengths disagree with its device ``seq_lens`` (a view fault): every
    sample of it is refused."""
    req_to_token = torch.zeros((2, 16), dtype=torch.int32)
    req_to_token[1, :12] = torch.arange(1, 13)
    mapping = torch.zeros(14, dtype=torch.int64)
    return SwaBatch(req_to_token, mapping, torch.tensor([1]), torch.tensor([12]), seq_lens_cpu=[11])


def healthy_view() -> SwaBatch:
    req_to_token = torch.zeros((2, 16), dtype=torch.int32)
    req_to_token[1, :12] = torch.arange(1, 13)
    mapping = torch.zeros(14, dtype=torch.int64)
    mapping[5:13] = torch.tensor([3, 4, 1, 2, 7, 8, 9, 10])
    return SwaBatch(req_to_token, mapping, torch.tensor([1]), torch.tensor([12]), seq_lens_cpu=[12])


def test_a_reporter_whose_every_view_is_refused_warns_once_per_silence(swa_records):
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_swa.telemetry import SwaTelemetrySink

    stream = io.StringIO()
    logger = logging.getLogger("test.liveness.lines")
    logger.propagate = False
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    events, reader = InMemoryLogRecordExporter(), InMemoryMetricReader()
    logs = LoggerProvider()
    logs.add_log_record_processor(SimpleLogRecordProcessor(events))
    sink = SwaTelemetrySink(meter_provider=MeterProvider(metric_readers=[reader]), logger_provider=logs,
                            span_events=False)
    reporter = SwaDivergenceReporter(2, sinks=[LogLineSink(logger), swa_records])  # warns after 20 silent steps
    sink.attach(reporter)
    try:
        for _ in range(59):
            reporter.observe(KVPool.FULL, 12)
            reporter.step(refusing_view())
        reporter.flush()
        assert reporter.stats.invalid_samples == 29 and reporter.stats.liveness_warnings == 1  # once, at step 20
        lines = [line for line in stream.getvalue().splitlines() if "otel_swa_liveness=" in line]
        assert lines == ['otel_swa[verify=attention] otel_swa_liveness={"pid":%d,"forward_ct":20,"steps":20,'
                         '"samples_delivered":0,"samples_taken":10,"invalid_samples":10,"skipped_captures":0,'
                         '"cause":"no_sample_delivered"}' % os.getpid()]
        (event,) = [e for e in events.get_finished_logs() if e.log_record.event_name == "kv_cache.swa.reporter.liveness"]
        assert event.log_record.attributes["kv_cache.swa.liveness.steps"] == 20
        assert event.log_record.severity_text == "WARN"
        with pytest.raises(SwaDivergenceNotObserved,
                           match="instrumented, 0 samples in 20 steps: 10 of 10 sample.s. taken were refused"):
            swa_records.assert_observed()
        # a delivered sample ends the silence; the next one of 20 steps is said again
        reporter.step(healthy_view())
        for _ in range(20):
            reporter.step(refusing_view())
        reporter.flush()
        assert reporter.stats.liveness_warnings == 2 and reporter.stats.samples_delivered == 1
        points = {m.name: m.data.data_points for rm in reader.get_metrics_data().resource_metrics
                  for sm in rm.scope_metrics for m in sm.metrics}
        assert [p.value for p in points["kv_cache.swa.reporter.liveness.warnings"]] == [2]
    finally:
        logger.removeHandler(handler)
        reporter.close()


def test_the_liveness_steps_variable():
    assert config.liveness_steps(20, {}) == 200
    assert config.liveness_steps(20, {"OTEL_SWA_LIVENESS_STEPS": "0"}) == 0
    with pytest.raises(config.ConfigError, match="OTEL_SWA_LIVENESS_STEPS='abc': expected an integer >= 0"):
        config.liveness_steps(20, {"OTEL_SWA_LIVENESS_STEPS": "abc"})
    quiet = SwaDivergenceReporter(1, liveness_steps=0)
    for _ in range(50):
        quiet.step(refusing_view())
    assert quiet.stats.liveness_warnings == 0
    with pytest.raises(ValueError, match="liveness_steps must be None or an int >= 0"):
        SwaDivergenceReporter(1, liveness_steps=-1)


# ------------------------------------------------------------------ 4. missing audit lines
def test_a_record_without_its_audit_line_fails_the_audit(tmp_path, capsys):
    lines = log_of([good(20, **CLEAN), good(40, **CLEAN), good(60, **CLEAN)]).splitlines(keepends=True)
    assert "otel_swa_audit=" in lines[4]  # line 1 marker, then each record and its audit line
    text = "".join(lines[:4] + lines[5:])  # the audit line of forward_ct=40 (line 4's record) is lost
    assert_all_fail(tmp_path, capsys, text, "FAILED SWA slot audit: audit line missing for the record at line 4: "
                    "its faults cannot be ruled out")
    # the log's very last line may still be followed by its audit line: read as now
    assert_all_pass(tmp_path, capsys, "".join(lines[:-1]))


# ------------------------------------------------------------------ 5. the wait
def write_later(path: Path, first: str, then: str, after_s: float) -> threading.Thread:
    """Write ``first`` now, ``then`` ``after_s`` seconds later (an engine still serving)."""
    path.write_text(first)
    return _append_later(path, then, after_s)


LEAK = {**CLEAN, "swa_leaked_slots": 3, "swa_pages_referenced": 47}


@pytest.mark.parametrize("front", ["assertion", "fixture", "check"])
def test_until_end_judges_the_whole_run_and_a_later_fault_fails(tmp_path, capsys, front):
    path = tmp_path / "server.log"
    healthy = log_of([good(20, **CLEAN), good(40, **CLEAN)])
    fault = "".join(f"{TS}{line}\n" for line in good(60, **LEAK).lines())
    thread = write_later(path, healthy, fault, after_s=0.4)  # well inside the 1.5 s quiet period
    try:
        if front == "assertion":
            with pytest.raises(SwaDivergenceNotObserved, match="leaked SWA slots: peak swa_leaked_slots=3") as caught:
                assert_swa_divergence_observed(path, until="end", quiet_s=1.5, timeout_s=30)
            out = str(caught.value)
        elif front == "fixture":
            capture = SwaRecordCapture()
            capture.follow(path)
            with pytest.raises(SwaDivergenceNotObserved) as caught:
                capture.assert_observed(until="end", quiet_s=1.5, timeout_s=30)
            out = str(caught.value)
        else:
            assert main(["check", str(path), "--wait", "30", "--until", "end", "--quiet-period", "1.5"]) == 1
            out = capsys.readouterr().out
    finally:
        thread.join()
    assert "leaked SWA slots: peak swa_leaked_slots=3 at forward_ct=60" in out
    assert "until end: the run ended (nothing new for 1.5 s); judged whole" in out


def test_the_default_wait_returns_at_the_first_pass_and_misses_a_later_fault(tmp_path):
    # what the README says of timeout_s: a pass ends the wait; judge the finished log, or until="end"
    path = tmp_path / "server.log"
    thread = write_later(path, log_of([good(20, **CLEAN), good(40, **CLEAN)]),
                         "".join(f"{TS}{line}\n" for line in good(60, **LEAK).lines()), after_s=1.0)
    try:
        assert assert_swa_divergence_observed(path, timeout_s=30).ok
    finally:
        thread.join()
    with pytest.raises(SwaDivergenceNotObserved):
        assert_swa_divergence_observed(path, timeout_s=0)


def test_until_end_stops_at_the_next_runs_start_and_judges_the_run_before(tmp_path, capsys):
    path = tmp_path / "server.log"
    next_run = log_of([idle(20), idle(40)])  # a restart onto the same log, broken
    thread = write_later(path, log_of([good(20), good(40)]), next_run, after_s=0.4)
    try:
        observation = assert_swa_divergence_observed(path, until="end", quiet_s=60, timeout_s=30)
    finally:
        thread.join()
    assert observation.waited_s < 20  # ended by the next run's start, not the 60 s quiet period
    assert "until end: the run ended (a later run began); judged whole" in observation.explain()
    assert observation.groups[0].records == 2 and observation.groups[0].last.forward_ct == 40


def test_until_is_checked():
    with pytest.raises(ValueError, match="until='never'; expected one of pass, end"):
        assert_swa_divergence_observed([good(20)], until="never")
    with pytest.raises(ValueError, match="quiet_s must be a finite number of seconds > 0"):
        assert_swa_divergence_observed([good(20)], until="end", quiet_s=0)


# ------------------------------------------------------------------ 6. bad values
def test_observe_refuses_a_count_outside_int64_and_nothing_is_poisoned():
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda record, context: records.append(record)])
    with pytest.raises(ValueError, match=r"count of KV entries 1180591620717411303424 .* above the int64 maximum"):
        reporter.observe(KVPool.FULL, 2**70)
    reporter.observe(KVPool.FULL, 2**63 - 13)
    with pytest.raises(ValueError, match="would take its total 9223372036854775795 above the int64 maximum"):
        reporter.observe(KVPool.FULL, 13)
    reporter.observe(KVPool.FULL, 12)
    reporter.observe(KVPool.SWA, 8)
    for _ in range(3):
        reporter.step(healthy_view())
    reporter.close()
    assert [(r.verify_full, r.verify_swa) for r in records] == [(2**63 - 1, 8)] * 3  # every sample delivered
    assert reporter.stats.invalid_samples == 0
