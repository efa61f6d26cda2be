"""Metric exports on a bounded schedule while an engine runs.

The OpenTelemetry SDK exports metrics every ``OTEL_METRIC_EXPORT_INTERVAL`` (60 s by default) from
its ``PeriodicExportingMetricReader``; spans and log records leave within their batching delays
(``OTEL_BSP_SCHEDULE_DELAY``, 5 s; ``OTEL_BLRP_SCHEDULE_DELAY``, 1 s). A process killed from
outside (SIGKILL, an out-of-memory kill, ``kill_process_tree`` from a supervisor) runs no exit hook
and no flush, so it loses every metric point since the last periodic export: for an engine that
lived less than a minute, all of them.

:func:`keep_exporting` bounds that: every ``OTEL_SWA_METRIC_EXPORT_INTERVAL`` milliseconds (5,000 by
default, the batching delay of spans) a daemon thread collects each periodic reader of the meter
provider whose own interval is longer (``PeriodicExportingMetricReader.collect``: the same
collection and export the SDK's own thread makes, under the reader's lock and export timeout). The
engine instrumentors start it with their first reporter. Cumulative totals stay right under either
temporality (a delta reader exports the change since its previous collection, whichever thread made
it). Readers of other kinds (in-memory, pull-based Prometheus) are left alone: they are read when
their owner asks.

The thread stops at interpreter exit before the SDK's providers shut down (an ``atexit`` hook
registered after theirs) and is not running in a forked child until the child makes a reporter.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Any

from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

__all__ = ["keep_exporting", "periodic_readers", "ExportSchedule"]

_log = logging.getLogger(__name__)


def periodic_readers(meter_provider: Any) -> list:
    """The ``PeriodicExportingMetricReader``s of an SDK ``MeterProvider`` (its private reader list,
    as opentelemetry-sdk 1.45 keeps it; empty for any other provider)."""
    config = getattr(meter_provider, "_sdk_config", None)
    readers = getattr(config, "metric_readers", None)
    if readers is None:
        readers = getattr(meter_provider, "_metric_readers", ())
    return [r for r in readers or () if isinstance(r, PeriodicExportingMetricReader)]


class ExportSchedule:
    """A daemon thread that collects the readers it was given every ``interval_ms`` milliseconds."""

    def __init__(self, interval_ms: int) -> None:
        if interval_ms <= 0:
            raise ValueError(f"interval_ms={interval_ms!r}; expected milliseconds > 0")
        self.interval_ms = interval_ms
        self._readers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._stop = threading.Event()
        self._thread: "threading.Thread | None" = None
        self._lock = threading.Lock()
        self.collections = 0  #: collections made (all readers), for tests and diagnostics

    def add(self, meter_provider: Any) -> int:
        """Collect the periodic readers of ``meter_provider`` whose own interval is longer than this
        schedule's; returns how many were added. Starts the thread on the first one."""
        added = 0
        with self._lock:
            for reader in periodic_readers(meter_provider):
                if getattr(reader, "_export_interval_millis", 0) > self.interval_ms and reader not in self._readers:
                    self._readers.add(reader)
                    added += 1
            if added and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="otel-swa-metric-export", daemon=True)
                self._thread.start()
                atexit.register(self.stop)  # after the providers' own hooks: runs before they shut down
        return added

    def stop(self) -> None:
        """Stop the thread (idempotent); a collection in progress finishes."""
        self._stop.set()

    def _run(self) -> None:
        failed_once = False
        while not self._stop.wait(self.interval_ms / 1000):
            with self._lock:
                readers = list(self._readers)
            for reader in readers:
                if getattr(reader, "_shutdown", False):
                    self._readers.discard(reader)
                    continue
                try:
                    reader.collect(timeout_millis=getattr(reader, "_export_timeout_millis", 10_000))
                    self.collections += 1
                except Exception:  # the SDK's own schedule goes on; one traceback is enough
                    if not failed_once:
                        _log.exception("otel-swa: a scheduled metric export failed")
                        failed_once = True

    def _reset_in_child(self) -> None:
        # the thread did not survive the fork; the parent's readers are not this process's
        self._readers = weakref.WeakSet()
        self._stop = threading.Event()
        self._thread = None
        self._lock = threading.Lock()


_schedules: dict[int, ExportSchedule] = {}


def keep_exporting(meter_provider: Any, interval_ms: "int | None" = None) -> "ExportSchedule | None":
    """Export ``meter_provider``'s metrics at least every ``interval_ms`` milliseconds (default:
    ``OTEL_SWA_METRIC_EXPORT_INTERVAL``, :func:`otel_swa.config.metric_export_interval_ms`) while the
    process lives; see the module docstring. Returns the schedule, or ``None`` when it is off (0),
    the variable is unusable (logged) or the provider has no periodic reader with a longer interval.
    Never raises."""
    from otel_swa import config

    try:
        if interval_ms is None:
            interval_ms = config.metric_export_interval_ms()
        if interval_ms <= 0:
            return None
        schedule = _schedules.get(interval_ms)
        if schedule is None:
            schedule = _schedules[interval_ms] = ExportSchedule(interval_ms)
        schedule.add(meter_provider)
        return schedule if schedule._thread is not None else None
    except config.ConfigError:
        _log.exception("otel-swa: metrics are exported on the SDK's own schedule only")
    except Exception:
        _log.exception("otel-swa: the metric export schedule could not start")
    return None


def _after_fork_in_child() -> None:
    for schedule in _schedules.values():
        schedule._reset_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
