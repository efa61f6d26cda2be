"""``configure(...)``: OpenTelemetry set up for an engine or for ``otel-swa replay``.

What it does, per signal (traces, metrics, logs):

1. a provider given as an argument is used as is;
2. otherwise, if the application already installed a global provider (any provider that is not the
   API's default proxy), that one is used: ``configure`` never replaces it;
3. otherwise it builds an SDK provider with the resource below and the exporters selected, and
   (``set_global=True``, the default) installs it as the global provider.

It only shuts down what it built (:meth:`SwaTelemetry.shutdown`).

Exporters. ``exporters`` (argument, a list or a comma-separated string) names exporters for all
signals at once: ``otlp``, ``console``, ``logline`` (the SGLang line, logs only: ``swa_logline``),
``prometheus`` (metrics only), ``none``. When it is not given, the standard variables ``OTEL_TRACES_EXPORTER``,
``OTEL_METRICS_EXPORTER``, ``OTEL_LOGS_EXPORTER`` choose, per signal, among the entry points installed
in the groups ``opentelemetry_{traces,metrics,logs}_exporter`` (as ``opentelemetry-instrument`` does;
unset means none). ``otlp`` resolves to gRPC or HTTP by ``OTEL_EXPORTER_OTLP_{SIGNAL}_PROTOCOL`` /
``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc``, the Python SDK's default, or ``http/protobuf``). Every
other setting is read by the SDK's own classes from the standard variables: endpoint
(``OTEL_EXPORTER_OTLP_ENDPOINT``...), headers, compression, timeout, metric temporality
(``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``), export interval
(``OTEL_METRIC_EXPORT_INTERVAL``), exemplar filter (``OTEL_METRICS_EXEMPLAR_FILTER``), span limits,
batch processor settings.

``prometheus`` (``OTEL_METRICS_EXPORTER=prometheus``) is the OpenTelemetry Prometheus exporter (the
``prometheus`` extra), built here rather than from its entry point: an HTTP endpoint in this
process on ``OTEL_EXPORTER_PROMETHEUS_HOST`` (default ``localhost``) and
``OTEL_EXPORTER_PROMETHEUS_PORT`` (default 9464) plus the process's local rank, with the service,
host and rank resource attributes as labels (:mod:`otel_swa.telemetry.prometheus`).

Resource. ``Resource.create`` (so ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` apply),
plus ``resource_attributes``, ``process.pid``, and the process's ranks (:mod:`otel_swa.ranks`):
``otel_swa.rank`` / ``otel_swa.world_size`` / ``otel_swa.local_rank`` from ``torch.distributed``
(when initialised) or the launcher's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, and
``otel_swa.tp_rank`` / ``dp_rank`` / ``pp_rank`` from the arguments or
``OTEL_SWA_TP_RANK`` / ``OTEL_SWA_DP_RANK`` / ``OTEL_SWA_PP_RANK``.
``default_service_name`` is used only when neither variable names the service.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from opentelemetry import metrics as metrics_api
from opentelemetry import trace
from opentelemetry._logs import get_logger_provider, set_logger_provider
from opentelemetry.environment_variables import OTEL_LOGS_EXPORTER, OTEL_METRICS_EXPORTER, OTEL_TRACES_EXPORTER
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, SimpleLogRecordProcessor
from opentelemetry.sdk.environment_variables import OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_SDK_DISABLED, OTEL_SERVICE_NAME
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import OTEL_RESOURCE_ATTRIBUTES, PROCESS_PID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.util._importlib_metadata import entry_points

from otel_swa import config
from otel_swa.config import ConfigError
from otel_swa.ranks import RANK_ATTRIBUTES, process_ranks
from otel_swa.telemetry import semconv as sc
from otel_swa.telemetry.exporters import AccountedExporter, ExportCounts, RepeatedWarningFilter
from otel_swa.telemetry.logline import SwaLogLineExporter
from otel_swa.telemetry.otlp_env import check_otlp_environment
from otel_swa.telemetry.prometheus import PROMETHEUS_EXPORTER, start_endpoint
from otel_swa.telemetry.sink import SwaTelemetrySink
from otel_swa.telemetry.spans import ForwardSpans, RequestSpans
from otel_swa.version import __version__

__all__ = ["configure", "configure_like_the_distro", "distro_exporters", "SwaTelemetry", "resolve_exporters",
           "LOGLINE_EXPORTER", "SIGNALS"]

_log = logging.getLogger(__name__)

SIGNALS = ("traces", "metrics", "logs")
#: Entry-point name of the SGLang log-line exporter (group ``opentelemetry_logs_exporter``).
LOGLINE_EXPORTER = "swa_logline"
_SIGNAL_VARIABLE = {"traces": OTEL_TRACES_EXPORTER, "metrics": OTEL_METRICS_EXPORTER, "logs": OTEL_LOGS_EXPORTER}
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
#: Short names accepted by ``exporters=`` / ``--exporter``.
EXPORTER_CHOICES = ("otlp", "console", "logline", "prometheus", "none")


def _split(names: "str | Iterable[str]") -> list[str]:
    items = names.split(",") if isinstance(names, str) else [n for name in names for n in str(name).split(",")]
    return [item.strip().lower() for item in items if item.strip()]


def _otlp_entry_point(signal: str, environ: Mapping[str, str]) -> str:
    variable = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
    protocol = (environ.get(variable) or environ.get(OTEL_EXPORTER_OTLP_PROTOCOL) or "grpc").strip()
    if protocol not in _OTLP_BY_PROTOCOL:
        name = variable if environ.get(variable) else OTEL_EXPORTER_OTLP_PROTOCOL
        raise ConfigError(f"{name}={protocol!r}; expected one of {', '.join(_OTLP_BY_PROTOCOL)}")
    return _OTLP_BY_PROTOCOL[protocol]


def resolve_exporters(exporters: "str | Iterable[str] | None" = None, environ: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """The exporter entry-point names per signal, e.g. ``{"traces": ["otlp_proto_grpc"], ...}``.

    Args:
        exporters: names from :data:`EXPORTER_CHOICES` applying to every signal (``logline`` to
            logs only); ``None``: the ``OTEL_*_EXPORTER`` variables, per signal.
        environ: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: an unknown exporter name, or an unknown OTLP protocol.
    """
    env = os.environ if environ is None else environ
    chosen: dict[str, list[str]] = {signal: [] for signal in SIGNALS}
    for signal in ("traces", "logs"):
        if PROMETHEUS_EXPORTER in _split(env.get(_SIGNAL_VARIABLE[signal], "") or "") and exporters is None:
            raise ConfigError(f"{_SIGNAL_VARIABLE[signal]}=prometheus; the Prometheus exporter is for metrics only "
                              "(OTEL_METRICS_EXPORTER=prometheus)")
    if exporters is not None:
        if not _split(exporters):
            raise ConfigError(f"exporters={exporters!r} names no exporter; expected one or more of "
                              f"{', '.join(EXPORTER_CHOICES)} (none: export nothing)")
        for name in _split(exporters):
            if name not in EXPORTER_CHOICES:
                raise ConfigError(f"exporter {name!r} is unknown; expected one or more of {', '.join(EXPORTER_CHOICES)}")
            for signal in SIGNALS:
                if name == "otlp":
                    chosen[signal].append(_otlp_entry_point(signal, env))
                elif name == "console":
                    chosen[signal].append("console")
                elif name == "logline" and signal == "logs":
                    chosen[signal].append(LOGLINE_EXPORTER)
                elif name == PROMETHEUS_EXPORTER and signal == "metrics":
                    chosen[signal].append(PROMETHEUS_EXPORTER)
    else:
        for signal in SIGNALS:
            for name in _split(env.get(_SIGNAL_VARIABLE[signal], "") or ""):
                if name == "none":
                    continue
                chosen[signal].append(_otlp_entry_point(signal, env) if name == "otlp" else name)
    return {signal: list(dict.fromkeys(names)) for signal, names in chosen.items()}


def _load_exporter(signal: str, name: str) -> Any:
    if signal == "metrics" and name == PROMETHEUS_EXPORTER:
        return start_endpoint  # not the entry point's reader: ports per rank, resource labels
    group = f"opentelemetry_{signal}_exporter"
    found = list(entry_points(group=group, name=name))
    if not found:
        raise ConfigError(f"exporter {name!r} is not installed for {signal} (no entry point {name!r} in group {group!r})")
    return found[0].load()


def _resource(
    resource_attributes: Mapping[str, Any] | None,
    ranks: Mapping[str, int],
    default_service_name: str | None,
    environ: Mapping[str, str],
) -> Resource:
    attributes: dict[str, Any] = {}
    env_names_service = bool(environ.get(OTEL_SERVICE_NAME, "").strip()) or any(
        item.split("=", 1)[0].strip() == SERVICE_NAME for item in environ.get(OTEL_RESOURCE_ATTRIBUTES, "").split(",")
    )
    if default_service_name and not env_names_service:
        attributes[SERVICE_NAME] = default_service_name
    attributes.update(resource_attributes or {})
    for dim, rank in ranks.items():
        attributes[RANK_ATTRIBUTES[dim]] = rank
    # the process's identity: several engine processes (ranks, forked or spawned workers) of one
    # service export apart, and a child never passes for its parent
    attributes.setdefault(PROCESS_PID, os.getpid())
    return Resource.create(attributes)


def _is_proxy_tracer_provider(provider: Any) -> bool:
    return isinstance(provider, trace.ProxyTracerProvider)


def _is_proxy_meter_provider(provider: Any) -> bool:
    # The API's placeholder until a provider is set (opentelemetry.metrics._internal._ProxyMeterProvider).
    return type(provider).__name__ == "_ProxyMeterProvider"


def _is_proxy_logger_provider(provider: Any) -> bool:
    # The API's placeholder until a provider is set (opentelemetry._logs._internal.ProxyLoggerProvider).
    return type(provider).__name__ == "ProxyLoggerProvider"


def _remove(items: list[Any], item: Any) -> None:
    """Remove ``item`` from ``items`` by identity (exporters need not be hashable or comparable)."""
    for index, other in enumerate(items):
        if other is item:
            del items[index]
            return


def _shutdown_quietly(parts: Iterable[Any]) -> None:
    """Shut down providers, readers or exporters built by a :func:`configure` that failed; errors
    are logged (the original error is the one to report)."""
    for part in parts:
        try:
            part.shutdown()
        except Exception:
            _log.exception("shutdown of %s after a failed configure() failed", type(part).__name__)


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
    _closed: bool = False

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
        finish in the background (a daemon thread). Then one warning says what failed, if
        anything did, and how many repeated exporter warnings were not logged, if any were."""
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
        threads = []
        for signal in ("logs", "traces", "metrics"):
            if signal in self.owned:
                thread = threading.Thread(target=_shutdown_provider, args=(signal, providers[signal]),
                                          name=f"otel-swa-shutdown-{signal}", daemon=True)
                thread.start()
                threads.append(thread)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        late = [t.name.rsplit("-", 1)[-1] for t in threads if t.is_alive()]
        if late:
            _log.warning("otel-swa: the %s provider(s) did not finish exporting in time; leaving them", ", ".join(late))
        self._report_export_failures()

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


#: Standard variables the SDK validates when the providers are built: a word in the SDK's error ->
#: the variable and the values it accepts (OpenTelemetry SDK environment variables).
_SDK_HINTS = {
    "exemplar filter": "OTEL_METRICS_EXEMPLAR_FILTER expects always_on, always_off or trace_based",
    "interval value": "OTEL_METRIC_EXPORT_INTERVAL expects milliseconds > 0",
    "schedule_delay_millis": "OTEL_BSP_SCHEDULE_DELAY / OTEL_BLRP_SCHEDULE_DELAY expect milliseconds > 0",
}


def _sdk_hint(exc: Exception) -> str:
    text = str(exc).lower()
    for word, hint in _SDK_HINTS.items():
        if word in text:
            return f" ({hint})"
    return " (check the OTEL_* environment variables)"


def _shutdown_provider(signal: str, provider: Any) -> None:
    try:
        provider.shutdown()
    except Exception:
        _log.exception("shutdown of the %s provider failed", signal)


#: The OTLP endpoint variables: one set names a collector, so the exporters default to OTLP.
_OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT")


def distro_exporters(environ: Mapping[str, str] | None = None) -> "tuple[str | None, Mapping[str, str]]":
    """The exporters an engine plugin sets up when nobody configured OpenTelemetry: the
    ``(exporters, environ)`` to pass to :func:`configure`.

    * one of ``OTEL_TRACES_EXPORTER``, ``OTEL_METRICS_EXPORTER``, ``OTEL_LOGS_EXPORTER`` set: each
      signal as its variable says, ``otlp`` for those left unset (opentelemetry-distro's
      defaults, which it sets with ``os.environ.setdefault``; here only in the returned mapping,
      never in the process's environment, which the engine's child processes inherit);
    * none of them, but an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` or a signal's own): OTLP
      for every signal, and SGLang's line (``logline``) in the log beside it;
    * nothing: SGLang's line only, in the engine's own log (traces and metrics are not exported:
      there is nowhere to send them).
    """
    env = os.environ if environ is None else environ
    chosen = [signal for signal in SIGNALS if (env.get(_SIGNAL_VARIABLE[signal]) or "").strip()]
    if chosen:
        filled = dict(env)
        for signal in SIGNALS:
            if signal not in chosen:
                filled[_SIGNAL_VARIABLE[signal]] = "otlp"
        return None, filled
    if any((env.get(name) or "").strip() for name in _OTLP_ENDPOINT_VARIABLES):
        return "otlp,logline", env
    return "logline", env


def configure_like_the_distro(environ: Mapping[str, str] | None = None) -> "SwaTelemetry":
    """OpenTelemetry for an engine process that an engine plugin switched on without
    ``opentelemetry-instrument``: :func:`configure` with the exporters of :func:`distro_exporters`,
    every other setting (endpoint, headers, protocol, compression, timeout, temporality, resource
    from ``OTEL_RESOURCE_ATTRIBUTES`` / ``OTEL_SERVICE_NAME``, batch and export intervals) read by
    the SDK's classes from the standard variables, as under the distro. Providers already installed
    as the global ones (the application's own, or the distro's) are used as they are; the ones built
    here are installed as the global ones and shut down by the SDK at interpreter exit.

    Raises:
        ConfigError: as :func:`configure` (an exporter that is not installed, a bad value).
    """
    exporters, env = distro_exporters(environ)
    return configure(exporters=exporters, environ=env)


def configure(
    *,
    exporters: "str | Iterable[str] | None" = None,
    tracer_provider: Any = None,
    meter_provider: Any = None,
    logger_provider: Any = None,
    resource_attributes: Mapping[str, Any] | None = None,
    default_service_name: str | None = None,
    tp_rank: int | None = None,
    dp_rank: int | None = None,
    pp_rank: int | None = None,
    metric_readers: Sequence[MetricReader] = (),
    span_processors: Sequence[Any] = (),
    log_record_processors: Sequence[Any] = (),
    traceparents: Any = None,
    max_links: int | None = None,
    span_events: bool = True,
    logline_logger: str | None = None,
    use_global: bool = True,
    set_global: bool = True,
    environ: Mapping[str, str] | None = None,
) -> SwaTelemetry:
    """Set up (or reuse) the three providers and return the pipeline with its reporter sink.

    Args:
        exporters: see the module docstring; ``None``: the ``OTEL_*_EXPORTER`` variables.
        tracer_provider, meter_provider, logger_provider: providers to use instead of building.
        resource_attributes: extra resource attributes (override the variables).
        default_service_name: ``service.name`` when neither ``OTEL_SERVICE_NAME`` nor
            ``OTEL_RESOURCE_ATTRIBUTES`` gives one.
        tp_rank, dp_rank, pp_rank: ranks for the resource (default ``OTEL_SWA_*_RANK``).
        metric_readers, span_processors, log_record_processors: extra readers/processors for the
            providers built here (e.g. the SDK's in-memory ones in tests).
        traceparents: request id -> traceparent lookup for the forward-step links (mapping or
            callable); default: the returned object's ``request_spans``.
        max_links: link limit of the forward-step span (default ``SpanLimits().max_links``).
        span_events: emit span events besides the Logs API events.
        logline_logger: name of the Python logger the ``swa_logline`` exporter writes to (default
            ``otel_swa``), so that the lines get the application's log format and handlers.
        use_global: reuse global providers already installed (step 2 above).
        set_global: install the providers built here as the global ones.
        environ: environment for our own variables and the exporter choice (default ``os.environ``;
            the SDK classes always read ``os.environ``).

    Raises:
        ConfigError: an unknown exporter or protocol, an exporter that is not installed, a rank that
            is not an integer >= 0, an unusable ``OTEL_SWA_SIGTERM_FLUSH`` or
            ``OTEL_SWA_FORWARD_SPANS``, an exporter whose constructor refused its ``OTEL_EXPORTER_*``
            settings (e.g. ``OTEL_EXPORTER_OTLP_LOGS_COMPRESSION=bogus`` for gRPC). Every exporter is
            created before any provider is built, so nothing is then built or installed as global;
            a failure while building the providers shuts down what was built and installs nothing.
    """
    env = os.environ if environ is None else environ
    config.sigterm_flush(env)  # an unusable OTEL_SWA_SIGTERM_FLUSH is an error here, not later
    span_mode = config.forward_spans(env)  # and OTEL_SWA_FORWARD_SPANS before anything is built
    names = resolve_exporters(exporters, env)
    if env.get(OTEL_SDK_DISABLED, "").strip().lower() == "true":
        # the specification's switch: the SDK's providers are no-ops then; build no exporter either
        names = {signal: [] for signal in SIGNALS}
    ranks = process_ranks(env)
    for dim, value in (("tp", tp_rank), ("dp", dp_rank), ("pp", pp_rank)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{dim}_rank={value!r}; expected an integer >= 0")
            ranks[dim] = value
    classes = {signal: [(name, _load_exporter(signal, name)) for name in names[signal]] for signal in SIGNALS}
    protocols = {signal: protocol for signal in SIGNALS for protocol, entry in _OTLP_BY_PROTOCOL.items()
                 if entry in names[signal]}
    for warning in check_otlp_environment(protocols, env):  # raises ConfigError before anything is built
        _log.warning("%s", warning)

    resource: Resource | None = None

    def need_resource() -> Resource:
        nonlocal resource
        if resource is None:
            resource = _resource(resource_attributes, ranks, default_service_name, env)
        return resource

    # Which providers are reused (given, or already installed globally) and which are built here.
    if tracer_provider is None and use_global and not _is_proxy_tracer_provider(trace.get_tracer_provider()):
        tracer_provider = trace.get_tracer_provider()
    if meter_provider is None and use_global and not _is_proxy_meter_provider(metrics_api.get_meter_provider()):
        meter_provider = metrics_api.get_meter_provider()
    if logger_provider is None and use_global and not _is_proxy_logger_provider(get_logger_provider()):
        logger_provider = get_logger_provider()
    to_build = [
        signal
        for signal, provider in (("traces", tracer_provider), ("metrics", meter_provider), ("logs", logger_provider))
        if provider is None
    ]

    # 1. Every exporter of the providers to build, before any provider exists: a constructor that
    # fails on a bad OTEL_EXPORTER_OTLP_* value then leaves nothing built or installed.
    made: list[Any] = []
    accounted: list[AccountedExporter] = []
    exporters_of: dict[str, list[tuple[type, Any]]] = {signal: [] for signal in SIGNALS}
    for signal in to_build:
        for name, cls in classes[signal]:
            try:
                if cls is start_endpoint:
                    exporter = start_endpoint(ranks, env)
                elif signal == "logs" and issubclass(cls, SwaLogLineExporter) and logline_logger:
                    exporter = cls(logger_name=logline_logger)
                else:
                    exporter = cls()
            except ConfigError:
                _shutdown_quietly(made)
                raise
            except Exception as exc:
                _shutdown_quietly(made)
                raise ConfigError(
                    f"the {signal} exporter {name!r} could not be created from its OTEL_EXPORTER_* "
                    f"settings: {type(exc).__name__}: {exc}"
                ) from exc
            # A reader is no exporter (the SDK drives it); the line exporter writes each record
            # as it is emitted (no buffered parent data), so a child's own lines still appear.
            if not isinstance(exporter, (MetricReader, SwaLogLineExporter)):
                exporter = AccountedExporter(exporter, signal, name)
                accounted.append(exporter)
            made.append(exporter)
            exporters_of[signal].append((cls, exporter))

    # 2. The providers; 3. installed as the global ones only once all of them exist.
    owned: list[str] = []
    built: list[Any] = []  # providers built here: their shutdown shuts down what was handed to them
    loose: list[Any] = list(made)  # exporters and readers made here and not handed to a provider yet
    try:
        if tracer_provider is None:
            tracer_provider = TracerProvider(resource=need_resource())
            built.append(tracer_provider)
            for processor in span_processors:
                tracer_provider.add_span_processor(processor)
            for _, exporter in exporters_of["traces"]:
                tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
                _remove(loose, exporter)
            owned.append("traces")
        if meter_provider is None:
            readers = list(metric_readers)
            for _, exporter in exporters_of["metrics"]:
                if not isinstance(exporter, MetricReader):
                    reader = PeriodicExportingMetricReader(exporter)  # starts its export thread
                    _remove(loose, exporter)
                    loose.append(reader)
                    exporter = reader
                readers.append(exporter)
            meter_provider = MeterProvider(resource=need_resource(), metric_readers=readers)
            built.append(meter_provider)
            for reader in readers:
                _remove(loose, reader)
            owned.append("metrics")
        if logger_provider is None:
            logger_provider = LoggerProvider(resource=need_resource())
            built.append(logger_provider)
            for processor in log_record_processors:
                logger_provider.add_log_record_processor(processor)
            for cls, exporter in exporters_of["logs"]:
                # The SGLang line is written at once, in order, as SGLang's logger does; the others batch.
                if issubclass(cls, SwaLogLineExporter):
                    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
                else:
                    logger_provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
                _remove(loose, exporter)
            owned.append("logs")
    except ValueError as exc:  # the SDK refused one of its own variables (an export interval of -1...)
        _shutdown_quietly(built + loose)
        raise ConfigError(f"OpenTelemetry cannot be set up from the environment: {exc}{_sdk_hint(exc)}") from exc
    except BaseException:
        _shutdown_quietly(built + loose)
        raise
    if set_global:
        if "traces" in owned:
            trace.set_tracer_provider(tracer_provider)
        if "metrics" in owned:
            metrics_api.set_meter_provider(meter_provider)
        if "logs" in owned:
            set_logger_provider(logger_provider)

    sink = SwaTelemetrySink(
        meter_provider=meter_provider, tracer_provider=tracer_provider, logger_provider=logger_provider,
        span_events=span_events,
    )
    tracer = tracer_provider.get_tracer(sc.SCOPE_NAME, __version__, schema_url=sc.SCHEMA_URL)
    request_spans = RequestSpans(tracer)
    forward_spans = ForwardSpans(tracer, traceparents if traceparents is not None else request_spans, max_links=max_links,
                                 mode=span_mode, environ=env)
    return SwaTelemetry(
        tracer_provider=tracer_provider, meter_provider=meter_provider, logger_provider=logger_provider,
        owned=tuple(owned), sink=sink, request_spans=request_spans, forward_spans=forward_spans,
        resource=resource, exporters=names, accounted=accounted,
        warning_filter=RepeatedWarningFilter().install() if accounted else None,
        linger_s=max((getattr(reader, "linger_s", 0.0) for reader in made), default=0.0) if "metrics" in owned else 0.0,
        prometheus_endpoint=next((reader for reader in made if hasattr(reader, "linger_s")), None)
        if "metrics" in owned else None,
    )
