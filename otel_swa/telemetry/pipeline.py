"""The configured OpenTelemetry pipeline, :class:`SwaTelemetry` (what
:func:`otel_swa.telemetry.setup.configure` returns): its providers, the reporters' sinks, the
spans, the export counts, and its bounded shutdown (:data:`SHUTDOWN_MARGIN_S`, :data:`SHUTDOWN_MAX_S`)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.resources import Resource

from otel_swa import config
from otel_swa.telemetry.exporters import ExportCounts
from otel_swa.telemetry.sink import SwaTelemetrySink
from otel_swa.telemetry.spans import ForwardSpans, RequestSpans
from otel_swa.telemetry.stopping import shutdown_providers

_log = logging.getLogger("otel_swa.telemetry.setup")  # the set-up's logger, for every part of it


@dataclass
class SwaTelemetry:
    """The configured pipeline (returned by :func:`configure`).

    Attributes:
        tracer_provider, meter_provider, logger_provider: the providers in use.
        owned: the signals whose provider ``configure`` built (and :meth:`shutdown` shuts down).
        sink: the :class:`~otel_swa.telemetry.sink.SwaTelemetrySink` of the first reporter
            attached with :meth:`attach` (or hand it to one reporter yourself); each further
            reporter gets its own sink from ``sink.for_another_reporter()``.
        sinks: the sink of every reporter attached with :meth:`attach`, in attach order.
        request_spans: :class:`~otel_swa.telemetry.spans.RequestSpans`, one span per request.
        forward_spans: :class:`~otel_swa.telemetry.spans.ForwardSpans`, whose traceparent lookup is
            the given one or, by default, ``request_spans``.
        resource: the resource of the providers built here (``None`` when none was built).
        exporters: the exporter entry-point names per signal that were set up.
        prometheus_endpoint: the Prometheus endpoint's reader built here
            (:func:`otel_swa.telemetry.prometheus.start_endpoint`: its ``url`` and ``linger_s``), or
            ``None`` without one.
        cut_signals: the signals whose last exports :meth:`cut_short` cut off in :meth:`shutdown`
            (what their providers held was not exported).
    """

    tracer_provider: Any
    meter_provider: Any
    logger_provider: Any
    owned: tuple[str, ...]
    sink: SwaTelemetrySink
    request_spans: RequestSpans
    forward_spans: ForwardSpans
    resource: Resource | None
    exporters: dict[str, list[str]] = field(default_factory=dict)
    sinks: list = field(default_factory=list)
    accounted: list = field(default_factory=list)
    warning_filter: Any = None
    linger_s: float = 0.0
    prometheus_endpoint: Any = None
    cut_signals: list = field(default_factory=list)
    _closed: bool = False
    _cut: threading.Event = field(default_factory=threading.Event)

    def attach(self, reporter: Any) -> Any:
        """Give ``reporter`` a sink of this pipeline and observe its health; returns ``reporter``.

        The first reporter gets :attr:`sink`; every other one a sink of its own
        (``sink.for_another_reporter()``) that shares the instruments and event emitters but keeps
        that reporter's cumulative totals, so the counters add up the work of all reporters.
        Attaching a reporter twice does nothing.

        The reporter is then looked after by :mod:`otel_swa.lifecycle` like an instrumentor's: its
        pending samples are delivered and exported at interpreter exit (before the SDK's providers
        shut down) and on SIGTERM (when SIGTERM has its default action), and it is reset in a
        forked child.
        """
        from otel_swa import lifecycle

        for sink in self.sinks:
            if sink.reporter is reporter:
                return reporter
        sink = self.sink if not self.sink.attached else self.sink.for_another_reporter()
        sink.attach(reporter)
        self.sinks.append(sink)
        if self.forward_spans.interval is None:  # "sampled" spans follow this reporter's samples
            self.forward_spans.interval = reporter.interval
        lifecycle.track(reporter, (self.tracer_provider, self.meter_provider, self.logger_provider))
        return reporter

    def forward_span(self, batch_info: Any = None, **values: Any):
        """The forward-step span context manager (see :meth:`ForwardSpans.forward_span`)."""
        return self.forward_spans.forward_span(batch_info, **values)

    def start_request_span(self, request_id: Any, **kwargs: Any) -> str:
        """Start the span of a request; returns its W3C traceparent (see :class:`RequestSpans`)."""
        return self.request_spans.start(request_id, **kwargs)

    def end_request_span(self, request_id: Any, **kwargs: Any) -> None:
        """End the span of a request."""
        self.request_spans.end(request_id, **kwargs)

    def force_flush(self, timeout_millis: int = 30000) -> None:
        """Export what is buffered, in every provider in use (built here or not)."""
        for provider in (self.tracer_provider, self.meter_provider, self.logger_provider):
            flush = getattr(provider, "force_flush", None)
            if flush is not None:
                try:
                    flush(timeout_millis)
                except Exception:
                    _log.exception("force_flush of %s failed", type(provider).__name__)

    def export_stats(self) -> dict[str, ExportCounts]:
        """What the exporters :func:`configure` built sent, per signal (``traces``: spans,
        ``metrics``: data points, ``logs``: log records; the SGLang line exporter is not counted:
        it writes, it does not send). Signals without such an exporter are absent."""
        stats: dict[str, ExportCounts] = {}
        for exporter in self.accounted:
            counts = exporter.counts()
            before = stats.get(exporter.signal, ExportCounts(0, 0, 0, 0))
            stats[exporter.signal] = ExportCounts(*(a + b for a, b in zip(
                (before.exported, before.failed, before.failed_exports, before.dropped_in_child),
                (counts.exported, counts.failed, counts.failed_exports, counts.dropped_in_child))))
        return stats

    @property
    def pools(self) -> Any:
        """The KV cache pool gauges on this pipeline's meter provider
        (:func:`otel_swa.telemetry.pools.pool_metrics`): ``telemetry.pools.register(source,
        owner=engine)`` exports an engine's pool usage, read at each collection."""
        from otel_swa.telemetry.pools import pool_metrics

        return pool_metrics(self.meter_provider)

    @property
    def suppressed_warnings(self) -> int:
        """Repeated exporter warnings not logged (the first of each kind was)."""
        return self.warning_filter.suppressed if self.warning_filter is not None else 0

    def shutdown(self, timeout_s: float | None = None) -> None:
        """End open request spans, then shut down the providers built by :func:`configure` (only
        those; the SDK's shutdown exports what is buffered, and the metric reader collects a last
        time). Idempotent.

        The providers shut down in parallel and this returns after at most ``timeout_s`` seconds
        (default: the largest OTLP timeout set, ``OTEL_EXPORTER_OTLP[_<SIGNAL>]_TIMEOUT``, else the
        exporters' 10 s, plus :data:`SHUTDOWN_MARGIN_S`): a collector that accepts connections and
        never answers cannot hold the process longer. A provider still exporting then is left to
        finish in the background (a daemon thread); after :meth:`cut_short` the wait is shorter
        (see there). Then one warning says what failed, if anything did, and how many repeated
        exporter warnings were not logged, if any were."""
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:  # what the attached reporters still hold reaches the providers first
            reporter = sink.reporter
            if reporter is not None:
                try:
                    reporter.flush()
                except Exception:
                    _log.exception("flushing an SWA divergence reporter before shutdown failed")
        self.request_spans.end_all()
        providers = {"traces": self.tracer_provider, "metrics": self.meter_provider, "logs": self.logger_provider}
        budget = timeout_s if timeout_s is not None else _shutdown_budget_s()
        if timeout_s is None:
            budget += self.linger_s  # a Prometheus endpoint waits that long for a last scrape
        deadline = time.monotonic() + min(max(budget, 0.0), SHUTDOWN_MAX_S)
        owned = {signal: providers[signal] for signal in ("logs", "traces", "metrics") if signal in self.owned}
        late, self.cut_signals = shutdown_providers(owned, deadline, self._cut, self.accounted)
        if self.cut_signals:
            _log.warning("otel-swa: interrupted: the %s provider(s) were still exporting; their exports were cut short "
                         "and what they held is lost", ", ".join(self.cut_signals))
        elif late:
            _log.warning("otel-swa: the %s provider(s) did not finish exporting in time; leaving them", ", ".join(late))
        self._report_export_failures()

    def cut_short(self) -> None:
        """End the exporters' waits: :meth:`shutdown`, under way or later, gives the providers at
        most :data:`~otel_swa.telemetry.stopping.CUT_GRACE_S` more, then shuts the exporters still
        busy down (their retries end) and names their signals in :attr:`cut_signals`. Only sets an
        event: safe inside a signal handler (Ctrl-C)."""
        self._cut.set()

    def _report_export_failures(self) -> None:
        units = {"traces": "spans", "metrics": "data points", "logs": "log records"}
        failed = [f"{signal}: {c.failed} {units[signal]} in {c.failed_exports} export(s)"
                  for signal, c in self.export_stats().items() if c.failed_exports]
        suppressed = self.suppressed_warnings
        if self.warning_filter is not None:
            self.warning_filter.uninstall()
        repeats = f"{suppressed} repeated exporter warning(s) not logged" if suppressed else ""
        if failed:
            _log.warning("otel-swa: exports failed (%s)%s", "; ".join(failed), f"; {repeats}" if repeats else "")
        elif repeats:
            _log.warning("otel-swa: %s (no export failed)", repeats)

    def __enter__(self) -> "SwaTelemetry":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


#: Added to the exporters' timeout in :meth:`SwaTelemetry.shutdown`'s bound (seconds).
SHUTDOWN_MARGIN_S = 2.0
#: The longest :meth:`SwaTelemetry.shutdown` waits, whatever the timeouts say (seconds).
SHUTDOWN_MAX_S = 600.0


def _shutdown_budget_s() -> float:
    return config.otlp_timeout_s() + SHUTDOWN_MARGIN_S
