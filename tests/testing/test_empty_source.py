"""An empty source (the empty ``proc.stdout`` of an engine that crashed) is text with no record."""

import pytest

from otel_swa.testing import SwaDivergenceNotObserved, assert_swa_divergence_observed, assertions


def _no_sleep(seconds):
    raise AssertionError(f"an empty text source must be judged at once, not waited for ({seconds} s)")


@pytest.mark.parametrize("source", ["", "   ", b""])
def test_empty_text_fails_at_once_with_zero_records_and_says_it_was_empty(monkeypatch, source):
    monkeypatch.setattr(assertions.time, "sleep", _no_sleep)
    with pytest.raises(SwaDivergenceNotObserved) as info:
        assert_swa_divergence_observed(source)
    obs = info.value.observation
    assert (obs.records, obs.problem, obs.empty, obs.waited_s) == (0, None, True, 0.0)
    lines = str(info.value).splitlines()
    assert lines[0].endswith(": 0 record(s) seen")
    assert lines[1] == "  the source was empty (no text at all): did the engine crash, or log to another stream?"
    assert "cannot be read" not in str(info.value)


def test_text_without_records_is_not_called_empty():
    with pytest.raises(SwaDivergenceNotObserved) as info:
        assert_swa_divergence_observed("engine started\nengine stopped\n")
    assert info.value.observation.empty is False
    assert "the source was empty" not in str(info.value)
    assert "no 'kv_canary_swa_divergence=' record found" in str(info.value)


@pytest.mark.parametrize("source", ["", b"", [], "no record here\n"])
def test_fixed_source_is_read_once_even_with_a_timeout(monkeypatch, source):
    monkeypatch.setattr(assertions.time, "sleep", _no_sleep)  # any wait fails the test
    observation = assertions.wait_for_observation(source, timeout_s=5)
    assert not observation.ok
