"""pytest plugin of otel-swa (entry point ``pytest11: otel_swa``): the ``swa_records`` fixture.

Installed with the package; no ``conftest.py`` needed. See :mod:`otel_swa.testing`.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from otel_swa.testing.capture import SwaRecordCapture


@pytest.fixture
def swa_records() -> Iterator[SwaRecordCapture]:
    """A fresh :class:`~otel_swa.testing.SwaRecordCapture` per test.

    Hand it to the reporter as a sink, and/or call ``.capture_logging()``, ``.follow(path)`` or
    ``.follow_output(get_text)``; then ``swa_records.assert_observed(...)``. Logging handlers it
    added are removed after the test.
    """
    capture = SwaRecordCapture()
    try:
        yield capture
    finally:
        capture.close()
