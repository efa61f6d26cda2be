"""The reporter sink that turns each delivered record into metrics and events.

A sink is any callable ``sink(record, context)``; the reporter calls it once per delivered
:class:`~otel_swa.record.SwaDivergenceRecord`, in ``forward_ct`` order, with the
``opentelemetry.context.Context`` of the forward step where the sample was taken.
:class:`SwaTelemetrySink` records the metrics of :mod:`otel_swa.telemetry.metrics` and emits the
events of :mod:`otel_swa.telemetry.events`. Telemetry never breaks the engine: an exception in any
part is caught, logged and counted in :attr:`SwaTelemetrySink.errors`, and the other parts still run.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Mapping

from opentelemetry import metrics as metrics_api
from opentelemetry import trace
from opentelemetry._logs import get_logger_provider
from opentelemetry.context import Context

from otel_swa.record import SwaDivergenceRecord
from otel_swa.telemetry import semconv as sc
from otel_swa.telemetry.events import SampleEvents
from otel_swa.telemetry.metrics import SwaMetrics
from otel_swa.version import __version__

__all__ = ["SwaTelemetrySink"]

_log = logging.getLogger(__name__)


class SwaTelemetrySink:
    """Metrics + Logs API event + span event for every record.

    Args:
        meter_provider, tracer_provider, logger_provider: the providers to use (default: the
            global ones). The meter, tracer and logger are named ``otel_swa`` with the package
            version and :data:`~otel_swa.telemetry.semconv.SCHEMA_URL`.
        span_events: also emit the span event (default True).
        log_events: also emit the Logs API event (default True; the log-line exporter needs it).
        metrics, events: share the instruments and event emitters of another sink (one sink per
            reporter, several reporters in a process: the SDK keeps one instrument per name).
            Each sink keeps the last cumulative totals of its own reporter.
        attributes: added to every metric data point and event of this sink's reporter, e.g. the
            ranks of the engine process when they are known only at run time (under
            ``opentelemetry-instrument`` the resource is fixed before the engine knows its rank).
            Bounded values only.

    One sink serves one reporter: it turns that reporter's cumulative totals (``forward_ct``,
    ``verify_full``, ``verify_swa``) into counter increments, so records of a second reporter
    would be taken for a restart. For another reporter use :meth:`for_another_reporter` (or
    :meth:`otel_swa.telemetry.setup.SwaTelemetry.attach`, which does it).

    Attributes:
        records: records received.
        errors: parts (metrics or events) that raised, caught and logged.
    """

    def __init__(
        self,
        *,
        meter_provider: Any = None,
        tracer_provider: Any = None,
        logger_provider: Any = None,
        span_events: bool = True,
        log_events: bool = True,
        metrics: SwaMetrics | None = None,
        events: SampleEvents | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        scope = dict(schema_url=sc.SCHEMA_URL)
        if metrics is None:
            meter = (meter_provider or metrics_api.get_meter_provider()).get_meter(sc.SCOPE_NAME, __version__, **scope)
            metrics = SwaMetrics.for_meter(meter)
        if events is None:
            tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(sc.SCOPE_NAME, __version__, **scope)
            logger = (logger_provider or get_logger_provider()).get_logger(sc.SCOPE_NAME, __version__, **scope)
            events = SampleEvents(logger if log_events else None, tracer if span_events else None)
        self.metrics = metrics
        self.events = events
        self.attributes = dict(attributes) if attributes else None
        self._totals: dict = {}
        self._reporter: "weakref.ref[Any] | None" = None
        self.records = 0
        self.errors = 0

    def for_another_reporter(self, attributes: Mapping[str, Any] | None = None) -> "SwaTelemetrySink":
        """A new sink sharing this one's instruments and event emitters, with its own totals and
        its own ``attributes`` (see the class)."""
        return SwaTelemetrySink(metrics=self.metrics, events=self.events, attributes=attributes)

    @property
    def reporter(self) -> Any:
        """The reporter this sink was attached to (``None``: none yet, or it was garbage-collected)."""
        return self._reporter() if self._reporter is not None else None

    @property
    def attached(self) -> bool:
        """Whether :meth:`attach` was called (the sink's totals then belong to that reporter)."""
        return self._reporter is not None

    def attach(self, reporter: Any) -> Any:
        """Hand this sink to ``reporter`` (``reporter.add_sink``) and observe its health
        (``reporter.stats``; delivery delay from ``reporter.forward_ct``). Returns ``reporter``.
        Attaching the same reporter again does nothing.

        Raises:
            ValueError: this sink is already attached to another reporter (use
                :meth:`for_another_reporter`).
        """
        if self._reporter is not None:
            if self._reporter() is reporter:
                return reporter
            raise ValueError(
                "this SwaTelemetrySink already serves another reporter and keeps that reporter's "
                "cumulative totals; attach sink.for_another_reporter() to a second reporter"
            )
        reporter.add_sink(self)
        self.metrics.attach(reporter, self.attributes)
        self._reporter = weakref.ref(reporter)
        return reporter

    def __call__(self, record: SwaDivergenceRecord, context: Context | None = None) -> None:
        """Record ``record`` (sampled in the forward step of ``context``). Never raises."""
        self.records += 1
        reporter = self._reporter() if self._reporter is not None else None
        delivered_at = None
        if reporter is not None:
            try:
                delivered_at = int(reporter.forward_ct)
            except Exception:
                delivered_at = None
        for part, call in (
            ("metrics", lambda: self._record_metrics(record, context, delivered_at, reporter)),
            ("events", lambda: self.events.emit(record, context, self.attributes)),
        ):
            try:
                call()
            except Exception:
                self.errors += 1
                _log.exception("SWA divergence telemetry (%s) failed for forward_ct=%s", part, getattr(record, "forward_ct", "?"))

    def _record_metrics(self, record: SwaDivergenceRecord, context: Context | None, delivered_at: int | None, reporter: Any) -> None:
        self.metrics.record(record, context, delivered_at=delivered_at, totals=self._totals, extra=self.attributes)
        if reporter is not None:
            self.metrics.note_stats(reporter)
