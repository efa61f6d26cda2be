"""What happens to the exporters :func:`otel_swa.telemetry.configure` builds: accounting, fork
safety, and how often their failures are logged.

* :class:`AccountedExporter` wraps each span, metric and log exporter ``configure()`` builds. It
  counts what was sent and what failed (spans, metric data points, log records), so that
  "samples delivered 10 / 10" is never the only word when the collector got nothing
  (:meth:`otel_swa.telemetry.SwaTelemetry.export_stats`). In a process forked after it was built
  it exports nothing and reports success: a forked child inherits the parent's SDK buffers and
  cumulative metric state (the parent's numbers) and, for OTLP over gRPC, the parent's channel,
  which a child that closes its inherited file descriptors turns into hundreds of thousands of
  gRPC error lines a second. For OTLP over HTTP, the child also lets go of the parent's open
  connections (their sockets are the parent's): urllib3 closes a connection pool's sockets when
  the pool is finalized, at the child's exit too, which after ``os.closerange`` (as daemons do)
  prints ``OSError: [Errno 9] Bad file descriptor`` tracebacks, or closes a descriptor the child
  has opened since under the same number.
* :class:`RepeatedWarningFilter` lets the first exporter warning or error of each kind through
  (per logger, message and arguments, retry delays aside) and counts the repeats, so that a dead
  collector gives one line per failure kind, not one per retry of every batch of every signal.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

from otel_swa import lifecycle

__all__ = ["AccountedExporter", "ExportCounts", "RepeatedWarningFilter", "EXPORTER_LOGGERS", "export_success",
           "release_connections"]

#: The loggers of the OTLP exporters and of the SDK's batching processors, where export failures
#: are logged (opentelemetry-exporter-otlp-proto-grpc / -http 1.45, opentelemetry-sdk 1.45).
EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._log_exporter",
    "opentelemetry.sdk._shared_internal",
)


def export_success(signal: str) -> Any:
    """The SDK's success value for an exporter of ``signal`` (traces, metrics, logs)."""
    if signal == "traces":
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS
    if signal == "metrics":
        from opentelemetry.sdk.metrics.export import MetricExportResult

        return MetricExportResult.SUCCESS
    from opentelemetry.sdk._logs.export import LogRecordExportResult

    return LogRecordExportResult.SUCCESS


def _items(signal: str, payload: Any) -> int:
    """Spans or log records in a batch; data points in a ``MetricsData``."""
    if signal != "metrics":
        try:
            return len(payload)
        except TypeError:
            return 0
    try:
        return sum(
            len(metric.data.data_points)
            for resource_metrics in payload.resource_metrics
            for scope_metrics in resource_metrics.scope_metrics
            for metric in scope_metrics.metrics
        )
    except AttributeError:
        return 0


@dataclass(frozen=True)
class ExportCounts:
    """One exporter's counts (spans, metric data points or log records).

    Attributes:
        exported: items in exports the exporter reported successful.
        failed: items in exports that failed (or raised).
        failed_exports: exports that failed.
        dropped_in_child: exports skipped in a forked child.
    """

    exported: int
    failed: int
    failed_exports: int
    dropped_in_child: int


class AccountedExporter:
    """An exporter that counts, and exports only in the process that built it (module docstring).

    Args:
        exporter: the SDK exporter (span, metric or log record exporter).
        signal: ``traces``, ``metrics`` or ``logs``.
        name: the exporter's entry-point name (``otlp_proto_grpc``...), for reports.

    Everything but ``export`` / ``force_flush`` / ``shutdown`` is the wrapped exporter's (the SDK
    reads attributes such as a metric exporter's preferred temporality).
    """

    def __init__(self, exporter: Any, signal: str, name: str = "") -> None:
        self._exporter = exporter
        self._signal = signal
        self._success = export_success(signal)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.name = name
        self.exported = self.failed = self.failed_exports = self.dropped_in_child = 0
        lifecycle.reset_in_child(self)

    def reset_after_fork(self) -> None:
        """In a forked child (called by :mod:`otel_swa.lifecycle`): let go of the parent's open
        HTTP connections without closing them (module docstring); a new lock."""
        self._lock = threading.Lock()
        release_connections(self._exporter)

    @property
    def signal(self) -> str:
        return self._signal

    @property
    def in_parent(self) -> bool:
        """Whether this is the process that built the exporter (not a forked child)."""
        return os.getpid() == self._pid

    def export(self, payload: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.in_parent:
            self.dropped_in_child += 1
            return self._success
        items = _items(self._signal, payload)
        try:
            result = self._exporter.export(payload, *args, **kwargs)
        except Exception:
            with self._lock:
                self.failed += items
                self.failed_exports += 1
            raise
        with self._lock:
            if result == self._success:
                self.exported += items
            else:
                self.failed += items
                self.failed_exports += 1
        return result

    def force_flush(self, *args: Any, **kwargs: Any) -> Any:
        return self._exporter.force_flush(*args, **kwargs) if self.in_parent else True

    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        return self._exporter.shutdown(*args, **kwargs) if self.in_parent else None

    def counts(self) -> ExportCounts:
        with self._lock:
            return ExportCounts(self.exported, self.failed, self.failed_exports, self.dropped_in_child)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._exporter, name)


def _pool_managers(exporter: Any) -> list:
    """The urllib3 pool managers behind an OTLP/HTTP exporter: its transport's ``requests``
    session's adapters (``exporter._client._transport._session``, opentelemetry-exporter-otlp-proto-
    http 1.45.2 with opentelemetry-exporter-http-transport 0.66b2; ``exporter._session`` in earlier
    releases) or its transport's own urllib3 ``PoolManager`` (``exporter._client._transport._pool``,
    1.45.0 with 0.66b0). Empty for an exporter with neither (gRPC, console)."""
    transport = getattr(getattr(exporter, "_client", None), "_transport", None)
    pool = getattr(transport, "_pool", None)
    if pool is not None and hasattr(pool, "pools"):
        return [pool]
    session = getattr(exporter, "_session", None)
    if session is None:
        session = getattr(transport, "_session", None)
    adapters = getattr(session, "adapters", None)
    if adapters is None:
        return []
    managers = []
    for adapter in list(adapters.values()):
        managers.append(getattr(adapter, "poolmanager", None))
        managers.extend(list((getattr(adapter, "proxy_manager", None) or {}).values()))
    return [manager for manager in managers if manager is not None]


def release_connections(exporter: Any) -> int:
    """Take every idle connection out of the urllib3 connection pools of an OTLP/HTTP exporter
    (:func:`_pool_managers`: through a ``requests`` session or a bare urllib3 transport) and
    detach its socket without closing it: the descriptor is the parent's. Returns how many were
    let go; an exporter without pools (gRPC, console) has none. Never raises."""
    released = 0
    try:
        managers = _pool_managers(exporter)
    except Exception:
        return 0
    for manager in managers:
        pools = getattr(manager, "pools", None)
        if pools is None:
            continue
        try:
            keys = list(pools.keys())
        except Exception:
            continue
        for key in keys:
            idle = getattr(pools.get(key), "pool", None)  # the pool's queue of idle connections
            while idle is not None:
                try:
                    connection = idle.get(block=False)
                except (queue.Empty, Exception):
                    break
                sock = getattr(connection, "sock", None)
                if sock is not None:
                    try:
                        sock.detach()
                    except Exception:
                        pass
                    connection.sock = None
                    released += 1
    return released


class RepeatedWarningFilter(logging.Filter):
    """Passes the first record of each kind (logger, message template, its non-float arguments) and
    drops the repeats, counting them in :attr:`suppressed`. Records below WARNING pass untouched.

    Install with :meth:`install` on :data:`EXPORTER_LOGGERS` (logger filters apply to records
    logged on that very logger); :meth:`uninstall` removes it."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set = set()
        self._lock = threading.Lock()
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        key = (record.name, str(record.msg), tuple(str(a) for a in args if not isinstance(a, float)))
        with self._lock:
            if key in self._seen:
                self.suppressed += 1
                return False
            self._seen.add(key)
        return True

    def install(self, names=EXPORTER_LOGGERS) -> "RepeatedWarningFilter":
        for name in names:
            logging.getLogger(name).addFilter(self)
        return self

    def uninstall(self, names=EXPORTER_LOGGERS) -> None:
        for name in names:
            logging.getLogger(name).removeFilter(self)
