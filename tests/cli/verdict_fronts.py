"""What the replay CLI tests read back: the replay summary's rows, and one run's verdict on the three
fronts of the CI judge (``otel-swa check``, the pytest assertion, the capture fixture)."""

from __future__ import annotations

import re

import pytest

from otel_swa.cli import main
from otel_swa.testing import SwaDivergenceNotObserved, SwaRecordCapture, assert_swa_divergence_observed


def summary_of(out: str) -> dict[str, str]:
    """The rows of the replay summary printed in ``out``: label -> value."""
    return dict((m.group(1), m.group(2)) for m in re.finditer(r"^  ([a-zA-Z_ -]+?)\s{2,}(.+)$", out, re.MULTILINE))


def assert_fails_on_every_front(log, capsys, failure: str, match: str) -> None:
    """``otel-swa check`` exits 1 on ``log`` with ``failure`` in its output; the assertion and the
    fixture raise with ``match`` (a regular expression); ``--no-audit`` passes the same log."""
    assert main(["check", str(log)]) == 1
    assert failure in capsys.readouterr().out
    with pytest.raises(SwaDivergenceNotObserved, match=match):
        assert_swa_divergence_observed(log, timeout_s=0)
    capture = SwaRecordCapture()
    capture.follow(log)
    with pytest.raises(SwaDivergenceNotObserved, match=match):
        capture.assert_observed(timeout_s=0)
    assert main(["check", str(log), "--no-audit"]) == 0
