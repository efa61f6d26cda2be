"""Assert, in an engine's CI, that the SWA KV cache path really runs.

One line of pytest::

    from otel_swa.testing import assert_swa_divergence_observed

    def test_swa_path(server_log_path):
        assert_swa_divergence_observed(server_log_path, timeout_s=60)

or, in process, with the ``swa_records`` fixture (registered by the ``pytest11`` entry point of
this package)::

    def test_swa_path_in_process(swa_records):
        reporter = SwaDivergenceReporter(interval=20, device="cpu", sinks=[swa_records])
        ...  # run the engine
        reporter.flush()
        swa_records.assert_observed()

The rules (peak divergence and out-of-window over all records, ``verify_swa < verify_full`` on the
last record) and the accepted sources are described in :mod:`otel_swa.testing.assertions`. Nothing
here imports pytest except :mod:`otel_swa.testing.plugin`.
"""

from otel_swa.testing.assertions import (
    DEFAULT_POLL_S,
    DEFAULT_TIMEOUT_S,
    SwaDivergenceNotObserved,
    SwaObservation,
    assert_swa_divergence_observed,
    judge,
    wait_for_observation,
)
from otel_swa.testing.capture import SwaRecordCapture

__all__ = [
    "DEFAULT_POLL_S",
    "DEFAULT_TIMEOUT_S",
    "SwaDivergenceNotObserved",
    "SwaObservation",
    "SwaRecordCapture",
    "assert_swa_divergence_observed",
    "judge",
    "wait_for_observation",
]
