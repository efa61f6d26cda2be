"""Shutting the providers down within a bound, and cutting the wait short (Ctrl-C).

:func:`shutdown_providers` shuts the providers :func:`otel_swa.telemetry.configure` built down in
parallel, one daemon thread each, and waits for them until a deadline: a collector that accepts
connections and never answers cannot hold the process longer. A provider still exporting then is
left to finish in the background.

A :class:`threading.Event` ``cut`` (set by :meth:`otel_swa.telemetry.SwaTelemetry.cut_short`,
which is safe inside a signal handler) shortens the wait: once it is set, the providers get at most
:data:`CUT_GRACE_S` more (a collector that answers needs milliseconds), then the exporters still
busy are shut down themselves, which ends their retries and backoff waits at once (the OTLP
exporters of opentelemetry-exporter-otlp 1.45 wait for their retries on an event that ``shutdown``
sets), and the wait ends. What they still held is lost; the signals are returned so that the
caller can name them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable, Mapping

from otel_swa.telemetry.exporters import EXPORTER_LOGGERS

__all__ = ["CUT_GRACE_S", "POLL_S", "shutdown_providers"]

_log = logging.getLogger("otel_swa.telemetry.setup")

#: Seconds the providers still get once the wait is cut short.
CUT_GRACE_S = 0.5
#: How often the wait looks at the cut event (seconds).
POLL_S = 0.05
#: Seconds an exporter still gets, after its own shutdown, to leave its retry loop.
_ABORT_JOIN_S = 0.5


def _shutdown_provider(signal: str, provider: Any) -> None:
    try:
        provider.shutdown()
    except Exception:
        _log.exception("shutdown of the %s provider failed", signal)


#: What the OTLP exporters log when their shutdown ends a retry (opentelemetry-exporter-otlp 1.45):
#: the abort is this module's doing, and the warning that follows says what it cost.
_ABORT_MESSAGES = ("Shutdown in progress, aborting retry.", "Exporter already shutdown, ignoring call",
                   "Exporter already shutdown, ignoring batch")


class _AbortNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _ABORT_MESSAGES


def _abort(exporters: Iterable[Any], signals: set[str]) -> None:
    """Shut the exporters of ``signals`` down: an export retrying against a dead collector stops."""
    noise = _AbortNoise()
    for name in EXPORTER_LOGGERS:  # left in place: the process is stopping
        logging.getLogger(name).addFilter(noise)
    for exporter in exporters:
        if getattr(exporter, "signal", None) in signals:
            try:
                exporter.shutdown()
            except Exception:  # already shut down, or failing: either way it sends nothing more
                pass


def shutdown_providers(
    providers: Mapping[str, Any],
    deadline: float,
    cut: threading.Event,
    exporters: Iterable[Any] = (),
) -> tuple[list[str], list[str]]:
    """Shut ``providers`` (signal -> provider, in the order given) down in parallel until
    ``deadline`` (``time.monotonic()``), or :data:`CUT_GRACE_S` after ``cut`` is set.

    Args:
        providers: the providers to shut down, by signal (``traces``, ``metrics``, ``logs``).
        deadline: when to stop waiting, on the ``time.monotonic()`` clock.
        cut: when set, the wait ends :data:`CUT_GRACE_S` later at the latest, and the exporters
            (of ``exporters``, with a ``signal`` attribute) of the providers still busy are shut
            down.
        exporters: the exporters the providers export through.

    Returns:
        ``(late, cut_short)``: the signals whose provider had not finished when the wait ended,
        and among them those whose exports were cut short.
    """
    threads = []
    for signal, provider in providers.items():
        thread = threading.Thread(target=_shutdown_provider, args=(signal, provider),
                                  name=f"otel-swa-shutdown-{signal}", daemon=True)
        thread.start()
        threads.append(thread)
    cut_at = None
    while True:
        alive = [t for t in threads if t.is_alive()]
        now = time.monotonic()
        if cut_at is None and cut.is_set():
            cut_at = min(deadline, now + CUT_GRACE_S)
        if not alive or now >= (deadline if cut_at is None else cut_at):
            break
        alive[0].join(min(POLL_S, max(0.0, deadline - now)))
    late = [t.name.rsplit("-", 1)[-1] for t in threads if t.is_alive()]
    cut_short: list[str] = []
    if late and cut.is_set():
        _abort(exporters, set(late))
        for thread in threads:
            thread.join(_ABORT_JOIN_S / max(1, len(threads)))
        cut_short = list(late)
    return late, cut_short
