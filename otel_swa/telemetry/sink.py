"""The reporter sink that turns each delivered record into metrics and events, off the engine's thread.

A sink is any callable ``sink(record, context)``; the reporter calls it once per delivered
:class:`~otel_swa.record.SwaDivergenceRecord`, in ``forward_ct`` order, with the
``opentelemetry.context.Context`` of the forward step where the sample was taken.
:class:`SwaTelemetrySink` stores the record's values for the metrics of
:mod:`otel_swa.telemetry.metrics` (read when the SDK collects) and emits the events of
:mod:`otel_swa.telemetry.events` (the Logs API event, which the ``swa_logline`` exporter turns into
otel-swa's line, and the span event). Telemetry never breaks the engine: an exception in any part is
caught, logged and counted in :attr:`SwaTelemetrySink.errors`, and the other parts still run.

The delivery thread. Calling the sink delivers at once, on the calling thread. A sink attached to a
reporter (:meth:`SwaTelemetrySink.attach`) gives the reporter a hand-off instead: at the sampled
step the engine's thread only appends the record (with its context and the reporter's forward
count) to a bounded FIFO queue, a ``deque.append`` (atomic under the GIL: no lock taken, no thread
woken), and one daemon thread per process, ``otel-swa-telemetry``, wakes every
:data:`DELIVERY_PERIOD_S` (or as soon as :data:`WAKE_AT` records wait) and delivers the queued
records to their sinks in order, yielding the GIL after every :data:`YIELD_PERIOD_S` of delivery.
Waking the thread for every record (a ``Condition.notify`` under its lock) cost the engine's thread
more than the append itself: the lock, the notify, and the GIL taken back from a thread woken while
the engine runs (``benchmarks/bench_telemetry.py``, table 3: the engine thread's CPU time per
record). Yielding after every record did too: each ``time.sleep(0)`` of the delivery thread cost
the engine's thread about one involuntary context switch per record on 2 CPU cores
(``benchmarks/bench_engine_thread.py`` counts them), where yielding once a millisecond costs about
one in ten records; the interpreter's own switch interval (``sys.getswitchinterval()``, 5 ms) still
bounds how long the engine's thread waits for the GIL, and the yield makes that wait at most about
a millisecond. The reporter's health counts (``reporter.stats``, read for the counters of
:mod:`otel_swa.telemetry.metrics`) are noted once per run of a sink's records in a round, after its
last one, instead of after each record. Guarantees:

* **in order**: one queue, one deliverer at a time (the thread or a flush), so every sink sees its
  records in ``forward_ct`` order, and the line is written in order;
* **nothing lost at flush, close or exit**: ``reporter.flush()`` / ``close()`` call the hand-off's
  ``flush()``, which delivers every queued record on the calling thread (waiting for the one the
  thread may be delivering) before it returns; :mod:`otel_swa.lifecycle` flushes the reporters at
  exit before the SDK's providers shut down, so those records are exported;
* **never blocking the forward**: when the queue holds :data:`QUEUE_CAPACITY` records (the thread
  is stalled, e.g. in an exporter that blocks) a new record is not queued: it is counted in
  :attr:`SwaTelemetrySink.dropped` (exported as ``kv_cache.swa.telemetry.records.dropped``) and a
  warning is logged once;
* **fork**: a thread does not survive ``fork()``. :func:`reset_after_fork` (called by
  ``SwaDivergenceReporter.reset_after_fork``, which :mod:`otel_swa.lifecycle` calls in a forked
  child) empties the queue (its records are the parent's) and lets the next record start a new
  thread; a record put in a child without that call is noticed by the process id and handled the
  same way.

What a SIGKILL can lose: the records still queued: those of the last :data:`DELIVERY_PERIOD_S`
(0.05 s), more when the thread was stalled.

Memory: the delivery thread's allocations come from a glibc malloc arena of its own, which returns
freed memory to the system only from its top; over a long run its free pages in between add up
(measured: several MiB over a million steps, ``benchmarks/bench_memory.py``). On glibc the thread
gives them back with ``malloc_trim(0)`` every :data:`TRIM_PERIOD_S` of delivery, off the engine's
thread (``ctypes`` releases the GIL for the call). The plain line sink (:class:`otel_swa.logline.LogLineSink`) does not use the
thread: it writes the line on the engine's thread at the step the sample describes (on CPU), so a
SIGKILLed process has lost no line it sampled.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Mapping

from opentelemetry import metrics as metrics_api
from opentelemetry import trace
from opentelemetry._logs import get_logger_provider
from opentelemetry.context import Context

from otel_swa.record import LivenessWarning, SwaDivergenceRecord
from otel_swa.telemetry import semconv as sc
from otel_swa.telemetry.events import SampleEvents
from otel_swa.telemetry.metrics import SwaMetrics
from otel_swa.version import __version__

__all__ = ["SwaTelemetrySink", "QUEUE_CAPACITY", "DELIVERY_PERIOD_S", "WAKE_AT", "TRIM_PERIOD_S", "YIELD_PERIOD_S",
           "reset_after_fork", "flush_queued"]

_log = logging.getLogger(__name__)

#: Records the delivery queue holds at most (all sinks of the process together). Records arrive
#: once per sampling interval; the queue fills only when the delivery thread is stalled.
QUEUE_CAPACITY = 4096
#: Seconds between the delivery thread's rounds (each delivers every record queued).
DELIVERY_PERIOD_S = 0.05
#: Records queued at which the engine's thread wakes the delivery thread before its round.
WAKE_AT = 256
#: Seconds of delivery between two ``malloc_trim(0)`` calls of the delivery thread (glibc only).
TRIM_PERIOD_S = 30.0
#: Seconds of delivery after which the delivery thread lets the engine's thread have the GIL
#: (``time.sleep(0)``), between two records.
YIELD_PERIOD_S = 0.001


def _malloc_trim() -> "Any":
    """glibc's ``malloc_trim`` (returns free heap pages of every arena to the system), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has none)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class _DeliveryQueue:
    """The process's queue of records waiting for their sink, and the thread that delivers them.

    Start and stop live here only: the thread is started by the first :meth:`put` (and again by
    the first one after a fork), and it never stops (a daemon thread: it does not hold up
    interpreter exit, where :mod:`otel_swa.lifecycle` flushes first).
    """

    def __init__(self, capacity: int = QUEUE_CAPACITY) -> None:
        self.capacity = capacity
        self._init()

    def _init(self) -> None:
        self._items: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._starting = threading.Lock()
        # Held while records are taken off the queue and delivered (the thread or a flush): order.
        self._delivering = threading.RLock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def put(self, sink: "SwaTelemetrySink", record: SwaDivergenceRecord, context: Any, delivered_at: "int | None") -> bool:
        """Queue a record for ``sink``; ``False`` (not queued) when the queue is full. Never blocks:
        a ``deque.append``, the thread started at the first record, woken only at :data:`WAKE_AT`."""
        if self._pid != os.getpid():
            self.reset_after_fork()
        items = self._items
        if len(items) >= self.capacity:
            return False
        items.append((sink, record, context, delivered_at))
        if self._thread is None:
            self._start()
        elif len(items) >= WAKE_AT:
            self._wake.set()
        return True

    def _start(self) -> None:
        with self._starting:
            if self._thread is not None:
                return
            thread = threading.Thread(target=self._run, name="otel-swa-telemetry", daemon=True)
            self._thread = thread
            thread.start()

    def _run(self) -> None:
        items, wake, delivering = self._items, self._wake, self._delivering
        trim, trimmed = _malloc_trim(), time.monotonic()
        while True:
            wake.wait(DELIVERY_PERIOD_S)
            wake.clear()
            if not items:
                continue
            with delivering:
                self._deliver_queued(items, yield_between=True)
            if trim is not None and time.monotonic() - trimmed >= TRIM_PERIOD_S:
                trimmed = time.monotonic()
                trim(0)

    @staticmethod
    def _deliver_queued(items: collections.deque, yield_between: bool = False) -> None:
        clock = time.perf_counter
        yield_at = clock() + YIELD_PERIOD_S
        while items:
            try:
                sink, record, context, delivered_at = items.popleft()
            except IndexError:  # taken by another deliverer
                return
            # the reporter's health is noted after the last record of a run of this sink's records
            sink._deliver(record, context, delivered_at, note_stats=not items or items[0][0] is not sink)
            if yield_between and items and clock() >= yield_at:
                time.sleep(0)  # the GIL to the engine's thread, if it waits for it, between records
                yield_at = clock() + YIELD_PERIOD_S

    def flush(self, timeout_s: "float | None" = None) -> bool:
        """Deliver every record queued now, on the calling thread, after the one being delivered.
        ``False`` when the thread held the queue longer than ``timeout_s`` (an exporter that
        blocks): the records stay queued."""
        if self._pid != os.getpid():
            self.reset_after_fork()
        if not self._delivering.acquire(timeout=-1 if timeout_s is None else timeout_s):
            _log.warning("otel-swa telemetry flush gave up after %.1f s: the delivery thread is stalled", timeout_s)
            return False
        try:
            self._deliver_queued(self._items)
        finally:
            self._delivering.release()
        return True

    def reset_after_fork(self) -> None:
        """In a forked child: drop the queued records (the parent delivers them) and the parent's
        thread and locks; the next record starts a new thread."""
        self._init()

    def __len__(self) -> int:
        return len(self._items)


_queue = _DeliveryQueue()


def reset_after_fork() -> None:
    """Reset the process's delivery queue and thread in a forked child (see the module docstring).
    Idempotent; what :mod:`otel_swa.lifecycle` needs after a fork (through the reporters)."""
    _queue.reset_after_fork()


def flush_queued(timeout_s: "float | None" = None) -> bool:
    """Deliver every record queued for any sink of this process, on the calling thread (see the
    module docstring); ``False`` when the delivery thread held the queue longer than ``timeout_s``."""
    return _queue.flush(timeout_s)


class _HandOff:
    """What an attached sink gives its reporter: ``handoff(record, context)`` queues the record for
    the delivery thread; ``flush()`` delivers what is queued; ``reset_after_fork()``."""

    __slots__ = ("sink",)

    def __init__(self, sink: "SwaTelemetrySink") -> None:
        self.sink = sink

    def __call__(self, record: SwaDivergenceRecord, context: Any = None) -> None:
        sink = self.sink
        reporter = sink._reporter() if sink._reporter is not None else None
        delivered_at = reporter.forward_ct if reporter is not None else None
        if not _queue.put(sink, record, context, delivered_at):
            sink.dropped += 1
            if sink.dropped == 1:
                _log.warning(
                    "otel-swa telemetry queue full (%d records): records are dropped from the metrics, events "
                    "and line, never waited for (kv_cache.swa.telemetry.records.dropped)", _queue.capacity,
                )

    def liveness(self, warning: LivenessWarning, context: Any = None) -> None:
        """Queue the reporter's liveness warning behind its records (its event is emitted in order)."""
        if not _queue.put(self.sink, warning, context, None):
            self.sink.dropped += 1

    def flush(self) -> None:
        _queue.flush()

    def reset_after_fork(self) -> None:
        _queue.reset_after_fork()
        self.sink.reset_after_fork()

    def __repr__(self) -> str:
        return f"<hand-off to {self.sink!r}>"


class SwaTelemetrySink:
    """Metrics + Logs API event + span event for every record.

    Args:
        meter_provider, tracer_provider, logger_provider: the providers to use (default: the
            global ones). The meter, tracer and logger are named ``otel_swa`` with the package
            version and :data:`~otel_swa.telemetry.semconv.SCHEMA_URL`.
        span_events: also emit the span event (default True).
        log_events: also emit the Logs API event (default True; the log-line exporter needs it).
        metrics, events: share the instruments and event emitters of another sink (one sink per
            reporter, several reporters in a process: the SDK keeps one instrument per name).
            Each sink keeps the totals of its own reporter.
        attributes: added to every metric data point and event of this sink's reporter, e.g. the
            ranks of the engine process when they are known only at run time (under
            ``opentelemetry-instrument`` the resource is fixed before the engine knows its rank).
            Bounded values only.

    One sink serves one reporter: it reports that reporter's cumulative totals (``forward_ct``,
    ``verify_full``, ``verify_swa``), so records of a second reporter would be taken for a restart.
    For another reporter use :meth:`for_another_reporter` (or
    :meth:`otel_swa.telemetry.setup.SwaTelemetry.attach`, which does it).

    Calling the sink delivers on the calling thread; through :meth:`attach` the records go by the
    delivery thread (module docstring).

    Attributes:
        records: records delivered to the metrics and events.
        errors: parts (metrics or events) that raised, caught and logged.
        dropped: records of the attached reporter not queued because the queue was full.
    """

    def __init__(
        self,
        *,
        meter_provider: Any = None,
        tracer_provider: Any = None,
        logger_provider: Any = None,
        span_events: bool = True,
        log_events: bool = True,
        metrics: SwaMetrics | None = None,
        events: SampleEvents | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        scope = dict(schema_url=sc.SCHEMA_URL)
        if metrics is None:
            meter = (meter_provider or metrics_api.get_meter_provider()).get_meter(sc.SCOPE_NAME, __version__, **scope)
            metrics = SwaMetrics.for_meter(meter)
        if events is None:
            tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(sc.SCOPE_NAME, __version__, **scope)
            logger = (logger_provider or get_logger_provider()).get_logger(sc.SCOPE_NAME, __version__, **scope)
            events = SampleEvents(logger if log_events else None, tracer if span_events else None)
        self.metrics = metrics
        self.events = events
        self.attributes = dict(attributes) if attributes else None
        self._store = metrics.store(self.attributes)
        self._reporter: "weakref.ref[Any] | None" = None
        self.handoff = _HandOff(self)
        self.records = 0
        self.errors = 0
        self.dropped = 0

    def for_another_reporter(self, attributes: Mapping[str, Any] | None = None) -> "SwaTelemetrySink":
        """A new sink sharing this one's instruments and event emitters, with its own totals and
        its own ``attributes`` (see the class)."""
        return SwaTelemetrySink(metrics=self.metrics, events=self.events, attributes=attributes)

    @property
    def reporter(self) -> Any:
        """The reporter this sink was attached to (``None``: none yet, or it was garbage-collected)."""
        return self._reporter() if self._reporter is not None else None

    @property
    def attached(self) -> bool:
        """Whether :meth:`attach` was called (the sink's totals then belong to that reporter)."""
        return self._reporter is not None

    def attach(self, reporter: Any) -> Any:
        """Hand this sink's hand-off to ``reporter`` (``reporter.add_sink``: its records then reach
        this sink through the delivery thread) and observe its health (``reporter.stats``;
        delivery delay from ``reporter.forward_ct``). Returns ``reporter``. Attaching the same
        reporter again does nothing.

        Raises:
            ValueError: this sink is already attached to another reporter (use
                :meth:`for_another_reporter`).
        """
        if self._reporter is not None:
            if self._reporter() is reporter:
                return reporter
            raise ValueError(
                "this SwaTelemetrySink already serves another reporter and keeps that reporter's "
                "cumulative totals; attach sink.for_another_reporter() to a second reporter"
            )
        reporter.add_sink(self.handoff)
        self.metrics.attach(reporter, self.attributes, self)
        self._reporter = weakref.ref(reporter)
        return reporter

    def flush(self) -> None:
        """Deliver the records queued for the delivery thread now (every sink's: one queue)."""
        _queue.flush()

    def liveness(self, warning: LivenessWarning, context: Context | None = None) -> None:
        """Emit the event of a reporter's liveness warning now (:meth:`SampleEvents.emit_liveness`).
        Never raises."""
        self._deliver(warning, context, None)

    def reset_after_fork(self) -> None:
        """In a forked child: forget the totals of the parent's records (the child's reporter counts
        from 0; they are not a restart to report: no "went back" warning, no reset counted). The
        child exports nothing of its own unless it calls ``configure()`` (:mod:`otel_swa.lifecycle`)."""
        self._store.totals.clear()
        self._store.offsets.clear()
        self._store.latest.clear()

    def __call__(self, record: SwaDivergenceRecord, context: Context | None = None) -> None:
        """Record ``record`` (sampled in the forward step of ``context``) now. Never raises."""
        reporter = self._reporter() if self._reporter is not None else None
        delivered_at = None
        if reporter is not None:
            try:
                delivered_at = int(reporter.forward_ct)
            except Exception:
                delivered_at = None
        self._deliver(record, context, delivered_at)

    def _deliver(self, record: SwaDivergenceRecord, context: Context | None, delivered_at: "int | None",
                 note_stats: bool = True) -> None:
        if isinstance(record, LivenessWarning):
            try:
                self.events.emit_liveness(record, self.attributes)
                if note_stats:
                    self._note_stats()
            except Exception:
                self.errors += 1
                _log.exception("SWA divergence telemetry (liveness event) failed")
            return
        self.records += 1
        try:
            self.metrics.record(record, context, delivered_at=delivered_at, store=self._store)
            if note_stats:
                self._note_stats()
        except Exception:
            self.errors += 1
            _log.exception("SWA divergence telemetry (metrics) failed for forward_ct=%s", getattr(record, "forward_ct", "?"))
        try:
            self.events.emit(record, context, self.attributes)
        except Exception:
            self.errors += 1
            _log.exception("SWA divergence telemetry (events) failed for forward_ct=%s", getattr(record, "forward_ct", "?"))

    def _note_stats(self) -> None:
        """Take the attached reporter's health counts as its last seen (:meth:`SwaMetrics.note_stats`)."""
        reporter = self._reporter() if self._reporter is not None else None
        if reporter is not None:
            self.metrics.note_stats(reporter)
