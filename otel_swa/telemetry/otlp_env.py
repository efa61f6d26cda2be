"""The OTLP exporter variables, checked before any exporter is built.

The OpenTelemetry Protocol Exporter specification (``specification/protocol/exporter.md``) says an
endpoint is a URL whose scheme is ``http`` or ``https`` and a timeout is a non-negative duration;
the Python exporters accept more and fail later, quietly: a gRPC endpoint without a scheme
(``127.0.0.1:4317``) makes a TLS connection unless ``OTEL_EXPORTER_OTLP_INSECURE=true`` (a
plaintext collector then sees only failed handshakes), an HTTP endpoint without a scheme fails
every export (``No connection adapters``), an empty endpoint makes a channel to ``''``, a negative
timeout gives up at once. :func:`check_otlp_environment` turns each of these into a
:class:`~otel_swa.config.ConfigError` naming the variable, or, where the setting can work (a
scheme-less gRPC endpoint of a TLS collector), into one warning saying what will happen.

Variables read, for each signal exported over OTLP: ``OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT`` (else
``OTEL_EXPORTER_OTLP_ENDPOINT``), ``OTEL_EXPORTER_OTLP_<SIGNAL>_TIMEOUT`` (else
``OTEL_EXPORTER_OTLP_TIMEOUT``; the Python exporters read it in seconds, the specification in
milliseconds) and ``OTEL_EXPORTER_OTLP_<SIGNAL>_INSECURE`` (else ``OTEL_EXPORTER_OTLP_INSECURE``).
Unset variables are fine: the exporters' defaults (``http://localhost:4317`` for gRPC,
``http://localhost:4318`` for HTTP, 10 s) apply.
"""

from __future__ import annotations

import math
from typing import Mapping
from urllib.parse import urlsplit

from otel_swa.config import ConfigError

__all__ = ["check_otlp_environment"]

_DEFAULT_PORT = {"grpc": 4317, "http/protobuf": 4318}


def _pick(environ: Mapping[str, str], signal: str, suffix: str) -> tuple[str, str | None]:
    specific = f"OTEL_EXPORTER_OTLP_{signal.upper()}_{suffix}"
    if specific in environ:
        return specific, environ[specific]
    generic = f"OTEL_EXPORTER_OTLP_{suffix}"
    return generic, environ.get(generic)


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def _check_port(name: str, value: str, url: str) -> None:
    """A port in ``url`` (a URL, or ``//host:port``) that is not a number from 1 to 65535 is an error
    (the gRPC exporter otherwise takes a port above 65535 modulo 65536: ``127.0.0.1:99999`` dials
    port 34463)."""
    try:
        port = urlsplit(url).port
    except ValueError:
        raise ConfigError(f"{name}={value!r} has no usable port; expected a port from 1 to 65535") from None
    if port == 0:
        raise ConfigError(f"{name}={value!r} has port 0; expected a port from 1 to 65535")


def check_otlp_environment(protocols: Mapping[str, str], environ: Mapping[str, str]) -> list[str]:
    """Check the OTLP variables of the signals in ``protocols`` (signal -> ``grpc`` or
    ``http/protobuf``).

    Returns:
        Warnings to log once each (a setting that can work but probably does not do what was meant).

    Raises:
        ConfigError: an empty endpoint, an endpoint whose scheme is not ``http`` / ``https`` (or, over
            HTTP, one without a scheme) or whose port is not a number from 1 to 65535, a timeout that is not a number or is negative; the message
            names the variable, its value and what is expected.
    """
    warnings: list[str] = []
    for signal, protocol in protocols.items():
        name, value = _pick(environ, signal, "ENDPOINT")
        if value is not None:
            endpoint = value.strip()
            example = f"http://collector:{_DEFAULT_PORT.get(protocol, 4317)}"
            if not endpoint:
                raise ConfigError(f"{name} is set but empty; expected a URL such as {example} (or unset it for the default)")
            scheme, sep, _rest = endpoint.partition("://")
            if not sep:
                if protocol != "grpc":
                    raise ConfigError(
                        f"{name}={value!r} has no scheme; OTLP over {protocol} needs a URL such as {example}"
                    )
                insecure_name, insecure = _pick(environ, signal, "INSECURE")
                if not _true(insecure):
                    warnings.append(
                        f"{name}={value!r} has no scheme: the gRPC exporter will connect with TLS "
                        f"({insecure_name} is not 'true'); write http://{endpoint} for a plaintext "
                        f"collector, https://{endpoint} for TLS"
                    )
            elif scheme.lower() not in ("http", "https"):
                raise ConfigError(f"{name}={value!r} has the scheme {scheme!r}; expected http:// or https://")
            _check_port(name, value, endpoint if sep else "//" + endpoint)
        name, value = _pick(environ, signal, "TIMEOUT")
        if value is not None and value.strip():
            try:
                timeout = float(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r} is not a number; expected a timeout >= 0") from None
            if not math.isfinite(timeout):
                raise ConfigError(f"{name}={value!r} is not a finite number; expected a timeout >= 0")
            if timeout < 0:
                raise ConfigError(f"{name}={value!r} is negative; expected a timeout >= 0")
    return list(dict.fromkeys(warnings))
