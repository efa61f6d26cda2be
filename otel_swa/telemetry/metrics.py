"""The metrics of a delivered sample: one table describing each instrument, one loop creating them.

Every instrument is described once in :data:`INSTRUMENTS` (name, kind, unit, description, and how its
value is read). :class:`SwaMetrics` creates them on a meter and records a record with the
``context`` of the forward step where the sample was taken, so that the SDK's exemplars (filter
``OTEL_METRICS_EXEMPLAR_FILTER``, default ``trace_based``) carry that step's trace and span ids.

Cumulative totals. ``forward_ct``, ``verify_full`` and ``verify_swa`` are running totals kept by the
reporter. A Counter takes increments, so the last total seen per series (instrument and ``pool``) is kept
in a store of the caller (one per reporter: the sink's) and the difference is added. The SDK then exports the right numbers under
both cumulative and delta temporality (``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``).
A total lower than the previous one means the reporter was restarted (a new reporter starts from
0): the new total is added as the increment since the restart, the reset is counted in
``kv_cache.swa.reporter.resets`` and logged as a warning.

Reporter health (the ``observable_counter`` and ``observable_gauge`` rows of :data:`INSTRUMENTS`,
read from ``reporter.stats``) is observed by asynchronous instruments, summed over the reporters
attached with :meth:`SwaMetrics.attach`; the delivery delay (forward steps between the sample and
its delivery, ``reporter.forward_ct - record.forward_ct``) is a histogram recorded at delivery.
A reporter is held by a weak reference; when it is garbage-collected, its last counts seen (at the
latest collection or delivery, whichever came later) stay in the summed counters, so that they
never go down: no false reset under cumulative temporality, no negative point under delta.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_swa.record import VERIFY_SOURCES, SwaDivergenceRecord
from otel_swa.telemetry import semconv as sc

__all__ = ["InstrumentSpec", "INSTRUMENTS", "DELAY_BUCKETS", "SwaMetrics"]

_log = logging.getLogger(__name__)

Attributes = Mapping[str, str]
_FULL = {sc.ATTR_POOL: sc.POOL_FULL}
_SWA = {sc.ATTR_POOL: sc.POOL_SWA}
_POOL_SOURCE = {
    (pool, source): {sc.ATTR_POOL: pool, sc.ATTR_VERIFY_SOURCE: source}
    for pool in (sc.POOL_FULL, sc.POOL_SWA)
    for source in VERIFY_SOURCES
}
_NONE: Attributes = {}


def _pool(pool: str, record: SwaDivergenceRecord) -> Attributes:
    """``pool`` and, when the record knows it, ``kv_cache.swa.verify_source``."""
    if record.verify_source is None:
        return _FULL if pool == sc.POOL_FULL else _SWA
    return _POOL_SOURCE[pool, record.verify_source]

#: Bucket boundaries of the delivery-delay histogram, in forward steps. With a ring of a few slots a
#: sample normally lands one or two steps after it was taken; the tail shows a stalled copy.
DELAY_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)

# Kinds of instrument in the table.
TOTAL_COUNTER = "counter"  # Counter fed with the increment of a cumulative record total
GAUGE = "gauge"  # synchronous Gauge set to a value of the sampled step
DELAY_HISTOGRAM = "histogram"  # Histogram of reporter.forward_ct - record.forward_ct at delivery
EVENT_COUNTER = "event_counter"  # Counter incremented by the telemetry itself (resets)
STATS_COUNTER = "observable_counter"  # ObservableCounter of a cumulative ReporterStats field
STATS_GAUGE = "observable_gauge"  # ObservableGauge of a ReporterStats field


@dataclass(frozen=True)
class InstrumentSpec:
    """One instrument.

    Attributes:
        name: dotted lowercase metric name (``kv_cache.swa.`` namespace, see ``semconv``).
        kind: one of ``counter`` (increments of a cumulative record total), ``gauge``,
            ``histogram`` (delivery delay), ``event_counter``, ``observable_counter`` and
            ``observable_gauge`` (fields of ``reporter.stats``).
        unit: UCUM unit with annotation, e.g. ``{entry}``.
        description: what a data point means.
        source: the record field(s) or ``ReporterStats`` field it is read from (documentation).
        read: for ``counter``/``gauge``: record -> ``(value, attributes)`` pairs; for the
            observable kinds: the ``ReporterStats`` attribute name; otherwise ``None``.
    """

    name: str
    kind: str
    unit: str
    description: str
    source: str
    read: Any = None


INSTRUMENTS: tuple[InstrumentSpec, ...] = (
    InstrumentSpec(
        sc.NAMESPACE + "entries.verified", TOTAL_COUNTER, "{entry}",
        "KV cache entries checked per pool, over all forward steps (FULL covers [0, prefix_len), "
        "SWA only the window [max(0, prefix_len - window), prefix_len))",
        "verify_full (pool=full), verify_swa (pool=swa); kv_cache.swa.verify_source says whether "
        "they are entries attention read (attention) or entries SGLang's KV canary verified (kv_canary)",
        lambda r: ((r.verify_full, _pool(sc.POOL_FULL, r)), (r.verify_swa, _pool(sc.POOL_SWA, r))),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "forward_steps", TOTAL_COUNTER, "{forward}",
        "Forward steps seen by the reporter, as of its latest delivered sample",
        "forward_ct",
        lambda r: ((r.forward_ct, _NONE),),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "tokens.divergent", GAUGE, "{token}",
        "Live tokens of the sampled batch whose SWA slot is non-zero and differs from their FULL slot",
        "swa_full_idx_divergence (not recorded when divergence_applicable is false: vLLM)",
        lambda r: ((r.swa_full_idx_divergence, _NONE),) if r.divergence_applicable else (),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "tokens.out_of_window", GAUGE, "{token}",
        "Live tokens of the sampled batch whose SWA slot was freed (mapping 0: left the sliding window)",
        "swa_out_of_window_tokens",
        lambda r: ((r.swa_out_of_window_tokens, _NONE),),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "slots.leaked", GAUGE, "{slot}",
        "SWA slots of pages in use that no live token maps into: allocated and unreachable",
        "swa_leaked_slots (when the engine gives audit inputs)",
        lambda r: ((r.swa_leaked_slots, _NONE),) if r.swa_leaked_slots is not None else (),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "tokens.stale", GAUGE, "{token}",
        "Live tokens whose SWA page is on the free list: the slot may be handed to another request",
        "swa_stale_tokens (when the engine gives audit inputs)",
        lambda r: ((r.swa_stale_tokens, _NONE),) if r.swa_stale_tokens is not None else (),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "slots.shared", GAUGE, "{slot}",
        "SWA slots that two distinct live FULL slots map to: two tokens write one slot",
        "swa_shared_slots (when the engine gives audit inputs)",
        lambda r: ((r.swa_shared_slots, _NONE),) if r.swa_shared_slots is not None else (),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.delivery.delay", DELAY_HISTOGRAM, "{forward}",
        "Forward steps between taking a sample and delivering its record to the sinks",
        "reporter.forward_ct at delivery - forward_ct",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.resets", EVENT_COUNTER, "{reset}",
        "Records whose cumulative totals went backwards (the reporter was restarted)",
        "verify_full, verify_swa, forward_ct lower than in the previous record",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.samples.taken", STATS_COUNTER, "{sample}",
        "Samples the reporter started on the device", "ReporterStats.samples_taken", "samples_taken",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.samples.delivered", STATS_COUNTER, "{sample}",
        "Sample records handed to the sinks", "ReporterStats.samples_delivered", "samples_delivered",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.ring_full.waits", STATS_COUNTER, "{wait}",
        "Times the host waited for the oldest device-to-host copy because every ring slot was in flight",
        "ReporterStats.ring_full_waits", "ring_full_waits",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.sink.errors", STATS_COUNTER, "{error}",
        "Exceptions raised by sinks (caught and logged by the reporter)",
        "ReporterStats.sink_errors", "sink_errors",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.samples.invalid", STATS_COUNTER, "{sample}",
        "Samples whose values could not form a record (a negative total from a negative observe count); "
        "logged, never delivered",
        "ReporterStats.invalid_samples", "invalid_samples",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.samples.skipped", STATS_COUNTER, "{sample}",
        "Sampling steps skipped because the current CUDA stream was capturing a graph",
        "ReporterStats.skipped_captures", "skipped_captures",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.samples.pending", STATS_GAUGE, "{sample}",
        "Samples taken whose device-to-host copy has not been delivered yet",
        "ReporterStats.pending", "pending",
    ),
)


class SwaMetrics:
    """Creates the instruments of :data:`INSTRUMENTS` on ``meter`` and records records on them.

    Args:
        meter: an OpenTelemetry ``Meter`` (the package's, see ``setup``).

    Use :meth:`for_meter` rather than the constructor: the SDK keeps one instrument per name and
    meter, and a second ``create_observable_counter`` of a name returns the first instrument and
    drops the new callbacks, so a second ``SwaMetrics`` on one meter would never export the health
    of the reporters attached to it (two instrumentors, or ``configure()`` and an instrumentor, in
    one process).

    Thread safety: :meth:`record` may be called from any thread; the callers' last-total stores are
    updated under a lock.
    """

    _by_meter: "weakref.WeakKeyDictionary[Any, SwaMetrics]" = weakref.WeakKeyDictionary()
    _by_meter_lock = threading.Lock()

    @classmethod
    def for_meter(cls, meter: Meter) -> "SwaMetrics":
        """The one :class:`SwaMetrics` of ``meter`` (made at the first call)."""
        with cls._by_meter_lock:
            try:
                metrics = cls._by_meter.get(meter)
            except TypeError:  # a meter that cannot be weakly referenced: not shared
                return cls(meter)
            if metrics is None:
                metrics = cls(meter)
                cls._by_meter[meter] = metrics
            return metrics

    def __init__(self, meter: Meter) -> None:
        self._lock = threading.Lock()  # the callers' last-total stores
        # reentrant: a reporter's finalizer may run (garbage collection) while the lock is held
        self._stats_lock = threading.RLock()
        # live reporter -> (its last counts seen per ReporterStats counter field, its attributes)
        self._reporters: "weakref.WeakKeyDictionary[Any, tuple[dict[str, int], tuple]]" = weakref.WeakKeyDictionary()
        # counts of reporters that were garbage-collected, per (attributes, ReporterStats counter field)
        self._retired: dict[tuple, int] = {}
        self._counter_fields = tuple(spec.read for spec in INSTRUMENTS if spec.kind == STATS_COUNTER)
        self._instruments: dict[str, Any] = {}
        for spec in INSTRUMENTS:
            self._instruments[spec.name] = self._create(meter, spec)
        self._resets = self._instruments[sc.NAMESPACE + "reporter.resets"]
        self._delay = self._instruments[sc.NAMESPACE + "reporter.delivery.delay"]

    # ------------------------------------------------------------------ creation (the one loop)
    def _create(self, meter: Meter, spec: InstrumentSpec) -> Any:
        common = dict(name=spec.name, unit=spec.unit, description=spec.description)
        if spec.kind in (TOTAL_COUNTER, EVENT_COUNTER):
            return meter.create_counter(**common)
        if spec.kind == GAUGE:
            return meter.create_gauge(**common)
        if spec.kind == DELAY_HISTOGRAM:
            return meter.create_histogram(**common, explicit_bucket_boundaries_advisory=list(DELAY_BUCKETS))
        if spec.kind == STATS_COUNTER:
            return meter.create_observable_counter(callbacks=[self._stats_callback(spec.read, True)], **common)
        if spec.kind == STATS_GAUGE:
            return meter.create_observable_gauge(callbacks=[self._stats_callback(spec.read, False)], **common)
        raise ValueError(f"instrument {spec.name!r} has unknown kind {spec.kind!r}")

    def _stats_callback(self, field: str, cumulative: bool) -> Callable[[CallbackOptions], Iterator[Observation]]:
        """The callback of one health instrument: ``field`` of ``reporter.stats`` summed over the
        live reporters of each attribute set (their process ranks), plus (``cumulative``) the
        retired counts of garbage-collected ones."""

        def callback(options: CallbackOptions) -> Iterator[Observation]:
            with self._stats_lock:
                live = list(self._reporters.items())
                totals: dict[tuple, int] = {}
                if cumulative:
                    for (attributes, name), value in self._retired.items():
                        if name == field:
                            totals[attributes] = totals.get(attributes, 0) + value
                for reporter, (seen, attributes) in live:
                    try:
                        value = int(getattr(reporter.stats, field))
                    except Exception:  # telemetry never breaks the export cycle
                        _log.exception("could not read reporter.stats.%s", field)
                        value = seen.get(field, 0)
                    if cumulative:
                        value = max(value, seen.get(field, 0))
                        seen[field] = value
                    totals[attributes] = totals.get(attributes, 0) + value
            del live  # drop the strong references before yielding
            for attributes, total in totals.items():
                yield Observation(total, dict(attributes))

        return callback

    def _retire(self, seen: dict[str, int], attributes: tuple) -> None:
        """Finalizer of an attached reporter: keep its last counts seen in the summed counters."""
        with self._stats_lock:
            for field, value in seen.items():
                key = (attributes, field)
                self._retired[key] = self._retired.get(key, 0) + value

    # ------------------------------------------------------------------ recording
    def attach(self, reporter: Any, attributes: Mapping[str, Any] | None = None) -> None:
        """Observe ``reporter.stats`` in the asynchronous health instruments (the
        ``observable_counter`` and ``observable_gauge`` rows of :data:`INSTRUMENTS`, each naming
        its ``ReporterStats`` field), with ``attributes`` on its data points (its process ranks).
        Reporters with the same attributes are summed. The reporter is held by a weak
        reference; once it is garbage-collected its last counts seen stay in the counters (see the
        module docstring) and it no longer adds to the gauges. Attaching it again does nothing.

        Raises:
            TypeError: ``reporter`` cannot be weakly referenced or hashed.
        """
        key = tuple(sorted((attributes or {}).items()))
        with self._stats_lock:
            if reporter in self._reporters:
                return
            seen: dict[str, int] = {}
            self._reporters[reporter] = (seen, key)
        finalizer = weakref.finalize(reporter, self._retire, seen, key)
        finalizer.atexit = False

    def note_stats(self, reporter: Any) -> None:
        """Take the current counts of an attached ``reporter`` as its last seen (the sink calls
        this at each delivery, so that a reporter dropped between two collections still counts
        up to its last delivery). Unattached reporters are ignored; never raises."""
        with self._stats_lock:
            entry = self._reporters.get(reporter)
            if entry is None:
                return
            seen = entry[0]
            try:
                stats = reporter.stats
            except Exception:
                _log.exception("could not read reporter.stats")
                return
            for field in self._counter_fields:
                try:
                    value = int(getattr(stats, field))
                except Exception:  # the collection callback logs it
                    continue
                seen[field] = max(value, seen.get(field, 0))

    def record(
        self,
        record: SwaDivergenceRecord,
        context: Context | None = None,
        *,
        delivered_at: int | None = None,
        totals: dict,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Record one delivered sample.

        Args:
            record: the sample.
            context: the context of the forward step where it was taken (exemplars point there).
            delivered_at: ``reporter.forward_ct`` when the record was delivered; when given, the
                delivery delay ``delivered_at - record.forward_ct`` goes to the histogram.
            totals: where the last cumulative totals of this record's source (one reporter) are
                kept, so that several reporters can share the instruments: a dict owned by the
                caller, empty at first, passed again with every record of that source.
            extra: attributes added to every data point (the reporter's process ranks, bounded).

        Raises:
            TypeError: ``record`` is not a :class:`SwaDivergenceRecord`.
        """
        if not isinstance(record, SwaDivergenceRecord):
            raise TypeError(f"expected a SwaDivergenceRecord, got {type(record).__name__}")
        went_back = False
        for spec in INSTRUMENTS:
            if spec.kind == TOTAL_COUNTER:
                instrument = self._instruments[spec.name]
                for total, attributes in spec.read(record):
                    if extra:
                        attributes = {**attributes, **extra}
                    increment, reset = self._increment(totals, spec.name, attributes, total)
                    went_back = went_back or reset
                    # add(0) too: the series exists from the first record on
                    instrument.add(increment, attributes, context=context)
            elif spec.kind == GAUGE:
                instrument = self._instruments[spec.name]
                for value, attributes in spec.read(record):
                    instrument.set(value, {**attributes, **extra} if extra else attributes, context=context)
        if went_back:
            self._resets.add(1, extra, context=context)
        if delivered_at is not None:
            self._delay.record(max(0, delivered_at - record.forward_ct), extra, context=context)

    def _increment(self, totals: dict, name: str, attributes: Attributes, total: int) -> tuple[int, bool]:
        """The increment of a cumulative total since the last record, and whether it went back."""
        key = (name, tuple(sorted(attributes.items())))
        with self._lock:
            last = totals.get(key, 0)
            totals[key] = total
        if total >= last:
            return total - last, False
        _log.warning(
            "%s%s went back from %d to %d: the reporter was restarted; counting from 0 again",
            name, dict(attributes) or "", last, total,
        )
        return total, True
