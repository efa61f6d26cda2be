"""Building the SDK's providers for :func:`otel_swa.telemetry.setup.configure`: the resource, which
global providers are the API's placeholders, the exporters made before any provider exists, the
processors handed to a provider, and the clean-up of what a failed set-up built."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.environment_variables import OTEL_SERVICE_NAME
from opentelemetry.sdk.resources import OTEL_RESOURCE_ATTRIBUTES, PROCESS_PID, SERVICE_NAME, Resource

from otel_swa.config import ConfigError
from otel_swa.ranks import RANK_ATTRIBUTES
from otel_swa.telemetry.exporter_choice import SIGNALS
from otel_swa.telemetry.exporters import AccountedExporter
from otel_swa.telemetry.logline import SwaLogLineExporter
from otel_swa.telemetry.prometheus import start_endpoint

_log = logging.getLogger("otel_swa.telemetry.setup")  # the set-up's logger, for every part of it


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


def _make_exporters(
    to_build: Sequence[str], classes: Mapping[str, list], ranks: Mapping[str, int], env: Mapping[str, str],
    logline_logger: str | None,
) -> "tuple[list[Any], list[AccountedExporter], dict[str, list[tuple[type, Any]]]]":
    """Every exporter of the providers to build (``to_build``: signals), before any provider exists:
    a constructor that fails on a bad ``OTEL_EXPORTER_OTLP_*`` value then leaves nothing built or
    installed. ``classes``: per signal, ``(entry-point name, class or factory)``.

    Returns:
        ``(made, accounted, exporters_of)``: every exporter and reader made, those wrapped to count
        what they send (:class:`~otel_swa.telemetry.exporters.AccountedExporter`), and per signal
        ``(class, exporter)`` in the order made.

    Raises:
        ConfigError: an exporter refused its settings (what was made is shut down first).
    """
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
    return made, accounted, exporters_of


def _add_processors(
    add: Callable[[Any], None], given: Iterable[Any], exporters: Iterable[tuple[type, Any]],
    processor_of: Callable[[type, Any], Any], loose: list[Any],
) -> None:
    """Hand a provider (through its ``add``: ``add_span_processor`` / ``add_log_record_processor``)
    the ``given`` processors, then one processor per exporter (``processor_of(class, exporter)``),
    each exporter then leaving ``loose`` (what a failure must shut down itself)."""
    for processor in given:
        add(processor)
    for cls, exporter in exporters:
        add(processor_of(cls, exporter))
        _remove(loose, exporter)
