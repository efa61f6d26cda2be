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

The parts: the exporter choice (:mod:`otel_swa.telemetry.exporter_choice`), the providers built
(:mod:`otel_swa.telemetry.providers`) and the pipeline returned (:mod:`otel_swa.telemetry.pipeline`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Mapping, Sequence

from opentelemetry import metrics as metrics_api
from opentelemetry import trace
from opentelemetry._logs import get_logger_provider, set_logger_provider
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, SimpleLogRecordProcessor
from opentelemetry.sdk.environment_variables import OTEL_SDK_DISABLED
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from otel_swa import config
from otel_swa.config import ConfigError
from otel_swa.ranks import process_ranks
from otel_swa.telemetry import semconv as sc
from otel_swa.telemetry.exporter_choice import (  # noqa: F401 (EXPORTER_CHOICES: importable here, as before)
    _OTLP_BY_PROTOCOL, EXPORTER_CHOICES, LOGLINE_EXPORTER, SIGNALS, _load_exporter, distro_exporters, resolve_exporters,
)
from otel_swa.telemetry.exporters import RepeatedWarningFilter
from otel_swa.telemetry.logline import SwaLogLineExporter
from otel_swa.telemetry.otlp_env import check_otlp_environment
from otel_swa.telemetry.pipeline import SHUTDOWN_MARGIN_S, SHUTDOWN_MAX_S, SwaTelemetry  # noqa: F401 (as before)
from otel_swa.telemetry.providers import (
    _add_processors, _is_proxy_logger_provider, _is_proxy_meter_provider, _is_proxy_tracer_provider, _make_exporters,
    _remove, _resource, _sdk_hint, _shutdown_quietly,
)
from otel_swa.telemetry.sink import SwaTelemetrySink
from otel_swa.telemetry.spans import ForwardSpans, RequestSpans
from otel_swa.version import __version__

__all__ = ["configure", "configure_like_the_distro", "distro_exporters", "SwaTelemetry", "resolve_exporters",
           "LOGLINE_EXPORTER", "SIGNALS"]

_log = logging.getLogger(__name__)


def _log_record_processor(cls: type, exporter: Any) -> Any:
    """The SGLang line is written at once, in order, as SGLang's logger does; the others batch."""
    if issubclass(cls, SwaLogLineExporter):
        return SimpleLogRecordProcessor(exporter)
    return BatchLogRecordProcessor(exporter)


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

    # 1. Every exporter of the providers to build, before any provider exists (providers._make_exporters).
    made, accounted, exporters_of = _make_exporters(to_build, classes, ranks, env, logline_logger)

    # 2. The providers; 3. installed as the global ones only once all of them exist.
    owned: list[str] = []
    built: list[Any] = []  # providers built here: their shutdown shuts down what was handed to them
    loose: list[Any] = list(made)  # exporters and readers made here and not handed to a provider yet
    try:
        if tracer_provider is None:
            tracer_provider = TracerProvider(resource=need_resource())
            built.append(tracer_provider)
            _add_processors(tracer_provider.add_span_processor, span_processors, exporters_of["traces"],
                            lambda _cls, exporter: BatchSpanProcessor(exporter), loose)
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
            _add_processors(logger_provider.add_log_record_processor, log_record_processors, exporters_of["logs"],
                            _log_record_processor, loose)
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
