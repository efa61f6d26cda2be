"""Assert, in an engine's CI, that the SWA KV cache path really runs.

One line of pytest::

    from otel_swa.testing import assert_swa_divergence_observed

    def test_swa_path(server_log_path):
        assert_swa_divergence_observed(server_log_path, until="end", timeout_s=120)  # the run, whole

or, in process, with the ``swa_records`` fixture (registered by the ``pytest11`` entry point of
this package)::

    def test_swa_path_in_process(swa_records):
        reporter = SwaDivergenceReporter(interval=20, device="cpu", sinks=[swa_records])
        ...  # run the engine
        reporter.flush()
        swa_records.assert_observed()

One verdict, :func:`judge` (:mod:`otel_swa.testing.judge`: peaks of divergence and out-of-window,
the verify lag on the last record, a clean SWA slot audit, judged on the last run of a log, rank
by rank), behind three fronts: :func:`assert_swa_divergence_observed`, the fixture, and
``otel-swa check``. Runs, ranks and writers of a log: :mod:`otel_swa.testing.runs`; the sources
read: :mod:`otel_swa.testing.sources`. A real Prometheus for tests and the queries of a Grafana dashboard:
:mod:`otel_swa.testing.prometheus`. Nothing here imports pytest except
:mod:`otel_swa.testing.plugin`.
"""

from otel_swa.testing.assertions import (
    DEFAULT_POLL_S,
    DEFAULT_TIMEOUT_S,
    SwaDivergenceNotObserved,
    assert_swa_divergence_observed,
    wait_for_observation,
)
from otel_swa.testing.capture import SwaRecordCapture
from otel_swa.testing.judge import AUDIT_RULES, Failure, GroupVerdict, SwaObservation, judge
from otel_swa.testing.runs import RunRecord, split_runs

__all__ = [
    "AUDIT_RULES",
    "DEFAULT_POLL_S",
    "DEFAULT_TIMEOUT_S",
    "Failure",
    "GroupVerdict",
    "RunRecord",
    "SwaDivergenceNotObserved",
    "SwaObservation",
    "SwaRecordCapture",
    "assert_swa_divergence_observed",
    "judge",
    "split_runs",
    "wait_for_observation",
]
