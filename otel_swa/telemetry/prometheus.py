"""The Prometheus endpoint of ``OTEL_METRICS_EXPORTER=prometheus`` (or ``configure(exporters="prometheus")``).

The OpenTelemetry Prometheus exporter (``opentelemetry-exporter-prometheus``, the ``prometheus``
extra: ``pip install 'otel-swa[prometheus]'``) is a pull reader: every scrape of its HTTP endpoint
(``http://HOST:PORT/metrics``, the Prometheus text format) collects the SDK's instruments at that
moment. :func:`start_endpoint` builds one on a registry of its own, so the endpoint serves
otel-swa's meter provider only, never whatever else the process registered in
``prometheus_client``'s global registry (an engine's own metrics keep their own endpoint).

Where it listens: :func:`otel_swa.config.prometheus_address`: ``OTEL_EXPORTER_PROMETHEUS_HOST``
(default ``localhost``) and ``OTEL_EXPORTER_PROMETHEUS_PORT`` (default 9464) plus this process's
local rank (``OTEL_SWA_PROMETHEUS_PORT_OFFSET``), so the ranks of one host, which inherit one
environment, do not fight over one port.

Labels: the exporter's own (each data point's attributes, ``otel_scope_name`` /
``otel_scope_version`` / ``otel_scope_schema_url``, a ``target_info`` series holding the whole
resource), plus the resource attributes of :data:`RESOURCE_LABELS` on every series, the ones the
Collector's Prometheus exporter gives with ``resource_to_telemetry_conversion`` and the dashboard
groups by: ``service_name``, ``host_name``, the ranks (``otel_swa_rank``, ``otel_swa_tp_rank``...).
``process.pid``, ``service.instance.id`` (new at every start) and the SDK's attributes stay on
``target_info`` only (Prometheus's own
``instance`` label already tells processes apart).

Names differ from the Collector's in one place: the exporter maps unit ``1`` to no suffix
(``kv_cache_pool_utilization``) where the Collector adds ``_ratio``; docs/telemetry.md has the
table of names as scraped.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Any, Mapping

from otel_swa import config
from otel_swa.config import ConfigError

__all__ = ["PROMETHEUS_EXPORTER", "RESOURCE_LABELS", "resource_label", "start_endpoint"]

_log = logging.getLogger(__name__)

#: The exporter name (``OTEL_METRICS_EXPORTER``, ``exporters=``); metrics only.
PROMETHEUS_EXPORTER = "prometheus"
#: Resource attributes put on every series as labels (the ``otel_swa.`` ones by prefix).
RESOURCE_LABELS = ("service.name", "service.namespace", "host.name")


def resource_label(key: str) -> bool:
    """Whether resource attribute ``key`` becomes a label of every series (:data:`RESOURCE_LABELS`
    and every ``otel_swa.`` attribute: the ranks)."""
    return key in RESOURCE_LABELS or key.startswith("otel_swa.")


class _Scrapes:
    """The endpoint's WSGI application, counting the scrapes whose reply was written (for the linger)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.count = 0
        self.changed = threading.Condition()

    def __call__(self, environ: dict, start_response: Any) -> Any:
        body = self.app(environ, start_response)
        try:
            yield from body  # the server writes each chunk before asking for the next
        finally:
            with self.changed:
                self.count += 1
                self.changed.notify_all()

    def wait_for_next(self, after: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while self.count <= after:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
        return True


def _serve(host: str, port: int, app: Any) -> Any:
    """A threading WSGI server on ``host:port`` (IPv6 when ``host`` resolves only to it), serving
    ``app`` from a daemon thread, as ``prometheus_client.start_http_server`` does."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    class Server(ThreadingWSGIServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # no line per scrape on stderr
            pass

    server = make_server(host, port, app, Server, handler_class=QuietHandler)
    threading.Thread(target=server.serve_forever, name="otel-swa-prometheus", daemon=True).start()
    return server


def start_endpoint(ranks: Mapping[str, int], environ: Mapping[str, str] | None = None) -> Any:
    """A started Prometheus endpoint: a ``PrometheusMetricReader`` (hand it to the ``MeterProvider``)
    whose ``shutdown()`` also closes its HTTP server, after waiting for one more scrape when
    ``OTEL_SWA_PROMETHEUS_LINGER`` > 0. ``reader.url`` is its ``/metrics`` URL, ``reader.linger_s``
    that wait, ``reader.begin_linger()`` makes the scrapes from then on count towards it.

    Args:
        ranks: this process's ranks (:func:`otel_swa.ranks.process_ranks`), for the port offset.
        environ: the environment (default ``os.environ``).

    Raises:
        ConfigError: the exporter is not installed (the ``prometheus`` extra), a variable is
            unusable (:func:`otel_swa.config.prometheus_address`), or the port cannot be listened on
            (taken by another process: the message names the address and how the port was made).
    """
    host, port, why = config.prometheus_address(ranks, environ)
    linger_s = config.prometheus_linger(environ)
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, make_wsgi_app
    except ImportError as exc:
        raise ConfigError(f"OTEL_METRICS_EXPORTER=prometheus needs the OpenTelemetry Prometheus exporter "
                          f"(pip install 'otel-swa[prometheus]'): {exc}") from exc

    class EndpointReader(PrometheusMetricReader):
        #: the scrape count when :meth:`begin_linger` was called (``None``: not called)
        linger_after: int | None = None

        def begin_linger(self) -> None:
            """Count the scrapes from now on towards the linger of :meth:`shutdown` (a caller that
            says it waits for one more scrape before it shuts down: a scrape in between counts)."""
            self.linger_after = scrapes.count

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            after = scrapes.count if self.linger_after is None else self.linger_after
            try:
                # the linger is the user's own bound (0 - 600 s), not the SDK's shutdown timeout (the
                # MeterProvider hands its readers 30 s): OTEL_SWA_PROMETHEUS_LINGER=120 waits 120 s
                if linger_s > 0 and not scrapes.wait_for_next(after, linger_s):
                    _log.warning("otel-swa: %s was not scraped within OTEL_SWA_PROMETHEUS_LINGER=%gs; the last "
                                 "values may not have reached Prometheus", self.url, linger_s)
            finally:
                try:
                    super().shutdown(timeout_millis=timeout_millis, **kwargs)
                finally:
                    server.shutdown()
                    server.server_close()

    registry = CollectorRegistry(auto_describe=False)
    scrapes = _Scrapes(make_wsgi_app(registry))
    try:
        server = _serve(host, port, scrapes)
    except OSError as exc:
        # the host, not the port: a name that does not resolve, an address of another machine
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            what = "does not resolve" if isinstance(exc, socket.gaierror) else "is not an address of this host"
            raise ConfigError(f"the Prometheus endpoint cannot listen on {host}:{port}: OTEL_EXPORTER_PROMETHEUS_HOST="
                              f"{host!r} {what} ({exc.strerror or exc}); expected an address or a name of this host "
                              "(localhost, 0.0.0.0 for every interface)") from exc
        raise ConfigError(f"the Prometheus endpoint cannot listen on {host}:{port} (OTEL_EXPORTER_PROMETHEUS_PORT "
                          f"{why}): {exc}; give each process of a host its own port "
                          f"(OTEL_EXPORTER_PROMETHEUS_PORT, OTEL_SWA_PROMETHEUS_PORT_OFFSET)") from exc
    try:
        reader = EndpointReader(registry=registry, resource_attribute_filter=resource_label)
    except BaseException:
        server.shutdown()
        server.server_close()
        raise
    shown = f"[{host}]" if ":" in host else host
    reader.url = f"http://{shown}:{server.server_address[1]}/metrics"
    reader.linger_s = linger_s
    return reader
