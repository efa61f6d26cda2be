"""The peak/last rules, the explanation, sources, and the capture fixture's object, without pytester."""

import io
import logging

import pytest

from otel_swa.record import SwaDivergenceRecord
from otel_swa.testing import (
    SwaDivergenceNotObserved,
    SwaRecordCapture,
    assert_swa_divergence_observed,
    judge,
    wait_for_observation,
)


def rec(ct, full, swa, div, oow):
    return SwaDivergenceRecord(ct, full, swa, div, oow)


def test_peaks_over_all_records_and_lag_on_last():
    # pipeline parallelism: most samples see an idle micro-batch; the peaks come from one record each
    records = [rec(20, 100, 100, 0, 0), rec(40, 300, 200, 5, 0), rec(60, 500, 260, 0, 9), rec(80, 700, 320, 0, 0)]
    obs = judge(records)
    assert obs.ok and obs.failed == ()
    assert (obs.peak_divergence, obs.peak_divergence_at) == (5, 40)
    assert (obs.peak_out_of_window, obs.peak_out_of_window_at) == (9, 60)
    assert obs.last == records[-1] and obs.records == 4


def test_each_signal_fails_alone():
    base = [rec(20, 100, 40, 2, 3)]
    assert judge(base, min_divergence=3).failed == ("divergence",)
    assert judge(base, min_out_of_window=4).failed == ("out-of-window",)
    # lag present early but not on the last record
    assert judge(base + [rec(40, 200, 200, 0, 0)]).failed == ("verify lag",)
    assert judge(base + [rec(40, 200, 200, 0, 0)], require_verify_lag=False).ok
    assert judge([], require_verify_lag=False).failed == ("divergence", "out-of-window")
    assert judge([]).failed == ("divergence", "out-of-window", "verify lag")
    assert judge(base, min_divergence=0, min_out_of_window=0).ok


def test_explanation_names_counts_peaks_last_and_failures():
    obs = judge([rec(20, 100, 40, 0, 3), rec(40, 200, 200, 0, 1)], malformed=2, source="server.log", last_line_no=17)
    text = obs.explain()
    assert text.splitlines()[0] == "SWA path NOT observed in server.log: 2 record(s) seen (2 malformed skipped)"
    assert "FAILED divergence: peak swa_full_idx_divergence=0 at forward_ct=20 (need >= 1)" in text
    assert "ok     out-of-window: peak swa_out_of_window_tokens=3 at forward_ct=20 (need >= 1)" in text
    assert "FAILED verify lag: last record verify_swa=200 is not < verify_full=200" in text
    assert 'last record (line 17): kv_canary_swa_divergence={"forward_ct":40,' in text


@pytest.mark.parametrize("kwargs, message", [
    ({"min_divergence": -1}, "min_divergence must be an int >= 0, got -1"),
    ({"min_out_of_window": 1.5}, "min_out_of_window must be an int >= 0, got 1.5"),
    ({"timeout_s": -2}, "timeout_s must be a finite number of seconds >= 0, got -2"),
    ({"poll_s": 0}, "poll_s must be a finite number of seconds > 0, got 0"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError) as info:
        wait_for_observation([rec(20, 2, 1, 1, 1)], **kwargs)
    assert str(info.value) == message


def test_source_kinds(tmp_path):
    good = rec(20, 100, 40, 2, 3)
    line = "[2025-06-01 12:00:20 TP0] " + good.format() + "\n"
    path = tmp_path / "a.log"
    path.write_text(line)
    assert assert_swa_divergence_observed(path).records == 1
    assert assert_swa_divergence_observed(str(path)).records == 1
    assert assert_swa_divergence_observed(line).records == 1  # log text
    assert assert_swa_divergence_observed(line.encode()).records == 1
    assert assert_swa_divergence_observed(io.StringIO(line)).records == 1
    assert assert_swa_divergence_observed(lambda: line).records == 1
    assert assert_swa_divergence_observed([good]).records == 1
    with pytest.raises(TypeError, match="source must be a log file path"):
        assert_swa_divergence_observed(42)


def test_missing_file_fails_with_the_reason(tmp_path):
    with pytest.raises(SwaDivergenceNotObserved) as info:
        assert_swa_divergence_observed(tmp_path / "never.log", timeout_s=0)
    assert "unusable source: log file" in str(info.value) and "does not exist" in str(info.value)


def test_capture_sink_logging_and_merge(tmp_path):
    capture = SwaRecordCapture()
    try:
        capture(rec(40, 200, 90, 0, 4), context=None)
        with pytest.raises(TypeError, match="expected a SwaDivergenceRecord"):
            capture({"forward_ct": 1})
        logger = logging.getLogger("otel_swa.test.engine")
        logger.setLevel(logging.WARNING)
        capture.capture_logging(logger)
        logger.info("%s", rec(20, 100, 40, 3, 0).format())
        logger.info("kv_canary_swa_divergence={oops")
        path = tmp_path / "b.log"
        path.write_text(rec(60, 300, 120, 0, 0).format() + "\n")
        capture.follow(path)
        # listed merged in forward_ct order
        assert [r.forward_ct for r in capture.records] == [20, 40, 60]
        assert capture.malformed == 1
        # judged place by place: none of the three shows both signals on its own
        with pytest.raises(SwaDivergenceNotObserved) as info:
            capture.assert_observed(timeout_s=0)
        obs = info.value.observation
        assert [(g.part, g.failed) for g in obs.groups] == [
            ("sink", ("divergence",)), ("logging", ("out-of-window",)),
            (str(path), ("divergence", "out-of-window"))]
        text = str(info.value)
        assert "  sink: FAILED, 1 record(s)" in text and f"  {path}: FAILED, 1 record(s), line 1" in text
    finally:
        capture.close()
    assert logger.level == logging.WARNING and not logger.handlers


def test_capture_of_one_place_is_judged_without_place_labels():
    capture = SwaRecordCapture()
    capture(rec(20, 100, 40, 3, 4), None)
    capture(rec(40, 200, 90, 1, 2), None)
    obs = capture.assert_observed()
    assert [(g.part, g.run, g.records) for g in obs.groups] == [(None, 1, 2)]
    assert "sink:" not in obs.explain()
