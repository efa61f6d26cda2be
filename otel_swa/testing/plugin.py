"""pytest plugin of otel-swa (entry point ``pytest11: otel_swa``): the ``swa_records`` fixture.

Installed with the package; no ``conftest.py`` needed. See :mod:`otel_swa.testing`.

A test that used the fixture (records reached it, or it was told to read ``logging``, a file or
output) and never judged nor read what it collected fails at teardown: collecting records is not
asserting on them (``swa_records.assert_observed()``). A test that failed already is left as it is.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from otel_swa.testing.capture import SwaRecordCapture

_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        item.stash[_CALL_FAILED] = True


@pytest.fixture
def swa_records(request: pytest.FixtureRequest) -> Iterator[SwaRecordCapture]:
    """A fresh :class:`~otel_swa.testing.SwaRecordCapture` per test.

    Hand it to the reporter as a sink, and/or call ``.capture_logging()``, ``.follow(path)`` or
    ``.follow_output(get_text)``; then ``swa_records.assert_observed(...)``. Logging handlers it
    added are removed after the test. A test that fed it and never judged or read it fails.
    """
    capture = SwaRecordCapture()
    try:
        yield capture
    finally:
        capture.close()
    if capture.unjudged and not request.node.stash.get(_CALL_FAILED, False):
        pytest.fail(
            "swa_records collected records (or was set to read logging, a file or output) and the test made no "
            "assertion on them: call swa_records.assert_observed(), or read swa_records.records and assert on them",
            pytrace=False,
        )
