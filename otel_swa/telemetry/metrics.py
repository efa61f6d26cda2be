"""The metrics of a delivered sample: one table describing each instrument, one loop creating them.

Every instrument is described once in :data:`INSTRUMENTS` (:mod:`otel_swa.telemetry.instruments`: name,
kind, unit, description, and how its value is read). :class:`SwaMetrics` creates them on a meter.

Record values are read when the SDK collects. Delivering a record stores its values in the
:class:`RecordStore` of its reporter (a few dict writes, no SDK call); the ``counter``, ``gauge`` and
``sample_counter`` rows of :data:`INSTRUMENTS` are observable instruments whose callbacks, on the
SDK's collecting thread (``OTEL_METRIC_EXPORT_INTERVAL``, or a ``force_flush``), report the latest
value of every series with the context of the forward step where its sample was taken, so that the
SDK's exemplars (filter ``OTEL_METRICS_EXEMPLAR_FILTER``, default ``trace_based``) carry that step's
trace and span ids. A ``sample_counter`` series is the running sum of what every record delivered
added to it, kept in the store like a total. Per delivered record the SDK is called once (the
delivery-delay histogram: a histogram has no observable form), instead of once per series: a
synchronous ``Counter.add`` or ``Histogram.record`` costs 8 - 15 us on 2 CPU cores (the measurement,
its attributes hashed, the exemplar offered), a dict write well under one.

Cumulative totals. ``forward_ct``, ``verify_full`` and ``verify_swa`` are running totals kept by the
reporter, reported as they are by ``ObservableCounter`` s (summed over the reporters whose points
have the same attributes). The SDK turns them into the right points under both cumulative and delta
temporality (``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``). A total lower than the previous
one means the reporter was restarted (a new reporter starts from 0): the total before the restart
is kept as an offset, so the series never goes down, the reset is counted in
``kv_cache.swa.reporter.resets`` and logged as a warning. The totals of a reporter whose store is
garbage-collected stay in the sums (no false reset, no negative delta point); its gauges go.

Reporter health (the ``observable_counter`` and ``observable_gauge`` rows of :data:`INSTRUMENTS`,
read from ``reporter.stats``) is observed by asynchronous instruments, summed over the reporters
attached with :meth:`SwaMetrics.attach`; the delivery delay (forward steps between the sample and
its delivery, ``reporter.forward_ct - record.forward_ct``) is a histogram recorded at delivery.
A reporter is held by a weak reference; when it is garbage-collected, its last counts seen (at the
latest collection or delivery, whichever came later) stay in the summed counters, so that they
never go down: no false reset under cumulative temporality, no negative point under delta.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import weakref
from typing import Any, Callable, Iterator, Mapping

from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_swa.record import SwaDivergenceRecord
from otel_swa.telemetry import semconv as sc
from otel_swa.telemetry.instruments import (  # the table, re-exported here
    ATTR_FAULT,
    DELAY_BUCKETS,
    DELAY_HISTOGRAM,
    EVENT_COUNTER,
    GAUGE,
    INSTRUMENTS,
    SAMPLE_COUNTER,
    SINK_COUNTER,
    STATS_COUNTER,
    STATS_GAUGE,
    TOTAL_COUNTER,
    Attributes,
    InstrumentSpec,
    with_micro_batch,
)

__all__ = ["InstrumentSpec", "INSTRUMENTS", "DELAY_BUCKETS", "SwaMetrics", "RecordStore", "ATTR_FAULT"]

_log = logging.getLogger(__name__)


_sequence = itertools.count(1)  # delivery order across stores: the latest value of a gauge wins


class RecordStore:
    """What one reporter's delivered records left for the record instruments: the latest value of
    every series with its context, and the cumulative totals with their restart offsets. Made by
    :meth:`SwaMetrics.store`, one per reporter (its sink's); passed to :meth:`SwaMetrics.record`.

    Attributes:
        attributes: added to every point of this store (the reporter's process ranks, bounded).
        totals: ``(instrument name, attribute items) -> last total delivered`` (before offsets).
    """

    __slots__ = ("attributes", "totals", "offsets", "latest", "_keyed", "__weakref__")

    def __init__(self, attributes: Mapping[str, Any] | None = None) -> None:
        self.attributes = dict(attributes) if attributes else {}
        self.totals: dict[tuple, int] = {}
        self.offsets: dict[tuple, int] = {}
        self.latest: dict[tuple, tuple] = {}  # key -> (value, attributes, context, sequence)
        self._keyed: dict[str, dict[int, tuple]] = {}  # name -> id(base) -> (key, attributes, base)

    def key(self, name: str, base: Attributes) -> tuple[tuple, dict]:
        """The series key and full attributes of ``name`` with ``base`` attributes (cached per
        instrument name: the table's attribute dicts are module constants)."""
        cached = self.keys(name).get(id(base))
        if cached is None or cached[2] is not base:
            cached = self._keyed_new(name, base)
        return cached[0], cached[1]

    def keys(self, name: str) -> dict:
        """``id(base) -> (series key, full attributes, base)`` of ``name`` (what :meth:`key` caches;
        an entry whose ``base`` is not the dict asked for is stale: :meth:`key` makes it again)."""
        cache = self._keyed.get(name)
        if cache is None:
            cache = self._keyed[name] = {}
        return cache

    def _keyed_new(self, name: str, base: Attributes) -> tuple:
        attributes = {**base, **self.attributes}
        cached = ((name, tuple(sorted(attributes.items()))), attributes, base)
        self.keys(name)[id(base)] = cached
        return cached


class SwaMetrics:
    """Creates the instruments of :data:`INSTRUMENTS` on ``meter`` and records records on them.

    Args:
        meter: an OpenTelemetry ``Meter`` (the package's, see ``setup``).

    Use :meth:`for_meter` rather than the constructor: the SDK keeps one instrument per name and
    meter, and a second ``create_observable_counter`` of a name returns the first instrument and
    drops the new callbacks, so a second ``SwaMetrics`` on one meter would never export the health
    of the reporters attached to it (two instrumentors, or ``configure()`` and an instrumentor, in
    one process).

    Thread safety: :meth:`record` may be called from any thread (the sinks' delivery thread); the
    stores are read by the SDK's collecting thread under the same lock.
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
        self._lock = threading.Lock()  # the record stores
        self._stores: "weakref.WeakSet[RecordStore]" = weakref.WeakSet()
        self._retired_totals: dict[tuple, int] = {}  # totals of garbage-collected stores, per series
        # The finalizers of stores and reporters run wherever garbage collection finds them dead: on
        # any thread, inside any allocation, this object's own locked sections included (taking a
        # lock there deadlocks the delivery thread against itself; a reentrant one lets the
        # finalizer change a dict the section is iterating). So a finalizer only appends here (a
        # deque's append is atomic) and the readers fold the queue in under their lock.
        self._dead_stores: "collections.deque[tuple[dict, dict]]" = collections.deque()
        self._stats_lock = threading.Lock()
        # live reporter -> (its last counts seen per ReporterStats counter field, its attributes, its sink)
        self._reporters: "weakref.WeakKeyDictionary[Any, tuple[dict, tuple, Any]]" = weakref.WeakKeyDictionary()
        # counts of reporters that were garbage-collected, per (attributes, field, fault)
        self._retired: dict[tuple, int] = {}
        self._dead_reporters: "collections.deque[tuple[dict, tuple]]" = collections.deque()
        self._counter_fields = tuple((spec.read, spec.kind) for spec in INSTRUMENTS if spec.kind in (STATS_COUNTER, SINK_COUNTER))
        self._instruments: dict[str, Any] = {}
        for spec in INSTRUMENTS:
            self._instruments[spec.name] = self._create(meter, spec)
        self._resets = self._instruments[sc.NAMESPACE + "reporter.resets"]
        self._delay = self._instruments[sc.NAMESPACE + "reporter.delivery.delay"]
        # the rows a record gives points to, as (kind, name, read)
        self._record_specs = tuple((spec.kind, spec.name, spec.read) for spec in INSTRUMENTS
                                   if spec.kind in (TOTAL_COUNTER, SAMPLE_COUNTER, GAUGE))

    # ------------------------------------------------------------------ creation (the one loop)
    def _create(self, meter: Meter, spec: InstrumentSpec) -> Any:
        common = dict(name=spec.name, unit=spec.unit, description=spec.description)
        if spec.kind in (TOTAL_COUNTER, SAMPLE_COUNTER):
            return meter.create_observable_counter(callbacks=[self._totals_callback(spec.name)], **common)
        if spec.kind == GAUGE:
            return meter.create_observable_gauge(callbacks=[self._gauge_callback(spec.name)], **common)
        if spec.kind == EVENT_COUNTER:
            return meter.create_counter(**common)
        if spec.kind == DELAY_HISTOGRAM:
            return meter.create_histogram(**common, explicit_bucket_boundaries_advisory=list(DELAY_BUCKETS))
        if spec.kind in (STATS_COUNTER, SINK_COUNTER):
            return meter.create_observable_counter(callbacks=[self._stats_callback(spec.read, True, spec.kind)], **common)
        if spec.kind == STATS_GAUGE:
            return meter.create_observable_gauge(callbacks=[self._stats_callback(spec.read, False, spec.kind)], **common)
        raise ValueError(f"instrument {spec.name!r} has unknown kind {spec.kind!r}")

    # ------------------------------------------------------------------ record instruments
    def store(self, attributes: Mapping[str, Any] | None = None) -> RecordStore:
        """A new :class:`RecordStore` for one reporter, with ``attributes`` on its points. When it
        is garbage-collected its totals stay in the counters (module docstring)."""
        store = RecordStore(attributes)
        with self._lock:
            self._retire_dead_stores()  # (without a metric reader nothing else would: the queue stays short)
            self._stores.add(store)
        finalizer = weakref.finalize(store, self._dead_stores.append, (store.totals, store.offsets))
        finalizer.atexit = False
        return store

    def _retire_dead_stores(self) -> None:
        """Fold the totals of the stores garbage-collected so far into the retired totals (with
        ``_lock`` held). A reader lists the live stores first, then calls this: a store missing
        from that list died before it, so its finalizer has queued its totals already."""
        while self._dead_stores:
            totals, offsets = self._dead_stores.popleft()
            for key, total in totals.items():
                self._retired_totals[key] = self._retired_totals.get(key, 0) + total + offsets.get(key, 0)

    def _totals_callback(self, name: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        """Each series of ``name``: the sum over the stores (and retired stores) of offset + total,
        with the context of the latest record among them."""

        def callback(options: CallbackOptions) -> Iterator[Observation]:
            sums: dict[tuple, list] = {}
            with self._lock:
                stores = list(self._stores)  # (strong references: none of these dies meanwhile)
                self._retire_dead_stores()
                for key, value in self._retired_totals.items():
                    if key[0] == name:
                        sums[key[1]] = [value, None, None, 0]
                for store in stores:
                    for key, total in store.totals.items():
                        if key[0] != name:
                            continue
                        _, attributes, context, sequence = store.latest[key]
                        entry = sums.setdefault(key[1], [0, attributes, None, 0])
                        entry[0] += total + store.offsets.get(key, 0)
                        entry[1] = attributes
                        if sequence > entry[3]:
                            entry[2], entry[3] = context, sequence
            for items, (value, attributes, context, _) in sums.items():
                yield Observation(value, attributes if attributes is not None else dict(items), context=context)

        return callback

    def _gauge_callback(self, name: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        """Each series of ``name``: the value of the latest record that had it, with its context."""

        def callback(options: CallbackOptions) -> Iterator[Observation]:
            latest: dict[tuple, tuple] = {}
            with self._lock:
                for store in list(self._stores):
                    for key, entry in store.latest.items():
                        if key[0] == name and (key[1] not in latest or entry[3] > latest[key[1]][3]):
                            latest[key[1]] = entry
            for value, attributes, context, _ in latest.values():
                yield Observation(value, attributes, context=context)

        return callback

    def record(
        self,
        record: SwaDivergenceRecord,
        context: Context | None = None,
        *,
        delivered_at: int | None = None,
        store: RecordStore,
    ) -> None:
        """Record one delivered sample: its values go to ``store`` (read at the next collection),
        the delivery delay to the histogram, a reset (a total lower than before) to the resets
        counter.

        Args:
            record: the sample.
            context: the context of the forward step where it was taken (exemplars point there).
            delivered_at: ``reporter.forward_ct`` when the record was delivered; when given, the
                delivery delay ``delivered_at - record.forward_ct`` goes to the histogram.
            store: the reporter's :class:`RecordStore` (from :meth:`store`).

        Raises:
            TypeError: ``record`` is not a :class:`SwaDivergenceRecord`, or ``store`` is not a
                :class:`RecordStore`.
        """
        if not isinstance(record, SwaDivergenceRecord):
            raise TypeError(f"expected a SwaDivergenceRecord, got {type(record).__name__}")
        if not isinstance(store, RecordStore):
            raise TypeError(f"store must be a RecordStore from SwaMetrics.store(), got {type(store).__name__}")
        sequence = next(_sequence)
        went_back = []
        totals, offsets, latest, keys, keyed_new = store.totals, store.offsets, store.latest, store.keys, store._keyed_new
        # the record's points, each (kind, name, key, attributes, value), their keys from the store's cache
        points = []
        for kind, name, read in self._record_specs:
            cache = keys(name)
            for value, base in read(record):
                if kind == GAUGE and record.micro_batch is not None:
                    base = with_micro_batch(base, record.micro_batch)
                hit = cache.get(id(base))
                if hit is None or hit[2] is not base:
                    hit = keyed_new(name, base)
                points.append((kind, name, hit[0], hit[1], value))
        with self._lock:
            for kind, name, key, attributes, value in points:
                if kind == TOTAL_COUNTER:
                    last = totals.get(key, 0)
                    if value < last:
                        offsets[key] = offsets.get(key, 0) + last
                        went_back.append((name, attributes, last, value))
                    totals[key] = value
                elif kind == SAMPLE_COUNTER:  # every outcome is added, 0 too: the series exist from the first checked sample
                    value = totals[key] = totals.get(key, 0) + value
                latest[key] = (value, attributes, context, sequence)
        extra = store.attributes or None
        if went_back:
            for name, attributes, last, total in went_back:
                _log.warning(
                    "%s%s went back from %d to %d: the reporter was restarted; counting from 0 again",
                    name, dict(attributes) or "", last, total,
                )
            self._resets.add(1, extra, context=context)
        if delivered_at is not None:
            self._delay.record(max(0, delivered_at - record.forward_ct), extra, context=context)

    # ------------------------------------------------------------------ health instruments
    def _stats_callback(self, field: str, cumulative: bool, kind: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        """The callback of one health instrument: ``field`` of ``reporter.stats`` (or of the
        reporter's sink, for ``sink_counter``) summed over the live reporters of each attribute set
        (their process ranks), plus (``cumulative``) the retired counts of garbage-collected ones. A
        mapping field gives one point per key (attribute :data:`ATTR_FAULT`)."""

        def read(reporter: Any, sink: Any) -> Any:
            if kind == SINK_COUNTER:
                return getattr(sink, field, 0) if sink is not None else 0
            return getattr(reporter.stats, field)

        def callback(options: CallbackOptions) -> Iterator[Observation]:
            with self._stats_lock:
                live = list(self._reporters.items())  # (strong references: none of these dies meanwhile)
                self._retire_dead_reporters()
                totals: dict[tuple, int] = {}
                if cumulative:
                    for (attributes, name, part), value in self._retired.items():
                        if name == field:
                            totals[attributes, part] = totals.get((attributes, part), 0) + value
                for reporter, (seen, attributes, sink_ref) in live:
                    try:
                        value = read(reporter, sink_ref() if sink_ref is not None else None)
                        parts = dict(value) if isinstance(value, Mapping) else {None: int(value)}
                    except Exception:  # telemetry never breaks the export cycle
                        _log.exception("could not read %s of an SWA divergence reporter", field)
                        parts = {part: count for (name, part), count in seen.items() if name == field}
                    for part, count in parts.items():
                        if cumulative:
                            count = max(int(count), seen.get((field, part), 0))
                            seen[field, part] = count
                        totals[attributes, part] = totals.get((attributes, part), 0) + int(count)
            del live  # drop the strong references before yielding
            for (attributes, part), total in totals.items():
                points = dict(attributes)
                if part is not None:
                    points[ATTR_FAULT] = part
                yield Observation(total, points)

        return callback

    def _retire_dead_reporters(self) -> None:
        """Keep the last counts seen of the reporters garbage-collected so far in the summed
        counters (with ``_stats_lock`` held; their finalizers queued them: see ``__init__``)."""
        while self._dead_reporters:
            seen, attributes = self._dead_reporters.popleft()
            for (field, part), value in seen.items():
                key = (attributes, field, part)
                self._retired[key] = self._retired.get(key, 0) + value

    def attach(self, reporter: Any, attributes: Mapping[str, Any] | None = None, sink: Any = None) -> None:
        """Observe ``reporter.stats`` in the asynchronous health instruments (the
        ``observable_counter`` and ``observable_gauge`` rows of :data:`INSTRUMENTS`, each naming
        its ``ReporterStats`` field, and the ``sink_counter`` rows, read from ``sink``), with
        ``attributes`` on its data points (its process ranks). Reporters with the same attributes
        are summed. The reporter and the sink are held by weak references; once the reporter is
        garbage-collected its last counts seen stay in the counters (see the module docstring) and
        it no longer adds to the gauges. Attaching it again does nothing.

        Raises:
            TypeError: ``reporter`` cannot be weakly referenced or hashed.
        """
        key = tuple(sorted((attributes or {}).items()))
        with self._stats_lock:
            if reporter in self._reporters:
                return
            self._retire_dead_reporters()  # (as in store(): the queue stays short without a reader)
            seen: dict = {}
            self._reporters[reporter] = (seen, key, weakref.ref(sink) if sink is not None else None)
        finalizer = weakref.finalize(reporter, self._dead_reporters.append, (seen, key))
        finalizer.atexit = False

    def note_stats(self, reporter: Any) -> None:
        """Take the current counts of an attached ``reporter`` as its last seen (the sink calls
        this at each delivery, so that a reporter dropped between two collections still counts
        up to its last delivery). Unattached reporters are ignored; never raises."""
        with self._stats_lock:
            entry = self._reporters.get(reporter)
            if entry is None:
                return
            seen, _, sink_ref = entry
            try:
                stats = reporter.stats
            except Exception:
                _log.exception("could not read reporter.stats")
                return
            sink = sink_ref() if sink_ref is not None else None
            for field, kind in self._counter_fields:
                try:
                    value = getattr(sink if kind == SINK_COUNTER else stats, field)
                    parts = dict(value) if isinstance(value, Mapping) else {None: int(value)}
                except Exception:  # the collection callback logs it
                    continue
                for part, count in parts.items():
                    seen[field, part] = max(int(count), seen.get((field, part), 0))
