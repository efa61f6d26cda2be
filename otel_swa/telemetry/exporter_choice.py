"""Which exporters :func:`otel_swa.telemetry.setup.configure` sets up, per signal: the names given
(``otlp``, ``console``, ``logline``, ``prometheus``, ``none``) or the standard ``OTEL_*_EXPORTER``
variables, OTLP's protocol (``OTEL_EXPORTER_OTLP[_<SIGNAL>]_PROTOCOL``), the choice an engine
plugin makes when nobody configured OpenTelemetry (:func:`distro_exporters`), and the entry point
that builds each exporter."""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from opentelemetry.environment_variables import OTEL_LOGS_EXPORTER, OTEL_METRICS_EXPORTER, OTEL_TRACES_EXPORTER
from opentelemetry.sdk.environment_variables import OTEL_EXPORTER_OTLP_PROTOCOL
from opentelemetry.util._importlib_metadata import entry_points

from otel_swa.config import ConfigError
from otel_swa.telemetry.prometheus import PROMETHEUS_EXPORTER, start_endpoint

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
