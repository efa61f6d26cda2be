"""The metrics of a delivered sample: one table describing each instrument, one loop creating them.

Every instrument is described once in :data:`INSTRUMENTS` (name, kind, unit, description, and how its
value is read). :class:`SwaMetrics` creates them on a meter.

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
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_swa.record import VERIFY_SOURCES, SwaDivergenceRecord
from otel_swa.telemetry import semconv as sc

__all__ = ["InstrumentSpec", "INSTRUMENTS", "DELAY_BUCKETS", "SwaMetrics", "RecordStore", "ATTR_FAULT"]

_log = logging.getLogger(__name__)

#: Attribute of ``kv_cache.swa.reporter.view_faults``: which fault of the view
#: (:data:`otel_swa.device.FAULTS`, e.g. ``seq_lens_cpu_mismatch``). Bounded: five values.
ATTR_FAULT = sc.ATTR_FAULT

Attributes = Mapping[str, Any]
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


_MICRO_BATCH_BASES: dict[tuple[int, int], tuple[Attributes, Attributes]] = {}


def _with_micro_batch(base: Attributes, micro_batch: int) -> Attributes:
    """``base`` with ``kv_cache.swa.micro_batch``: one constant dict per (base, micro-batch), so that
    :meth:`RecordStore.key` keeps caching by identity (the bases are the table's module constants
    and micro-batches are bounded by :data:`otel_swa.record.MICRO_BATCH_MAX`)."""
    cached = _MICRO_BATCH_BASES.get((id(base), micro_batch))
    if cached is None or cached[0] is not base:
        cached = (base, {**base, sc.ATTR_MICRO_BATCH: micro_batch})
        _MICRO_BATCH_BASES[(id(base), micro_batch)] = cached
    return cached[1]


def _field(name: str) -> Callable[[SwaDivergenceRecord], tuple]:
    """Reader of an optional record field: one point when it is present, none when ``None``."""

    def read(record: SwaDivergenceRecord) -> tuple:
        value = getattr(record, name, None)
        return ((value, _NONE),) if value is not None else ()

    return read

def _outcomes(attribute: str, checks: str, disagree: str, unchecked: str | None = None) -> Callable[[SwaDivergenceRecord], tuple]:
    """Reader of a check's counts by outcome (``attribute`` = ``agree``, ``disagree``,
    ``unchecked``): ``checks - disagree``, ``disagree`` and, when named, ``unchecked``; no point when
    the record has no ``checks`` (the engine does not run the check). Every outcome is given, 0
    too, so the series exist from the first checked sample."""
    agree_at, disagree_at, unchecked_at = ({attribute: value} for value in (sc.READ_AGREE, sc.READ_DISAGREE,
                                                                             sc.READ_UNCHECKED))

    def read(record: SwaDivergenceRecord) -> tuple:
        total = getattr(record, checks)
        if total is None:
            return ()
        bad = getattr(record, disagree) or 0
        points = ((max(0, total - bad), agree_at), (bad, disagree_at))
        if unchecked is None:
            return points
        return points + ((getattr(record, unchecked) or 0, unchecked_at),)

    return read


#: Bucket boundaries of the delivery-delay histogram, in forward steps. With a ring of a few slots a
#: sample normally lands one or two steps after it was taken; the tail shows a stalled copy.
DELAY_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)

# Kinds of instrument in the table.
TOTAL_COUNTER = "counter"  # ObservableCounter of a cumulative record total (latest delivered, kept monotonic)
GAUGE = "gauge"  # ObservableGauge of a value of the latest delivered sample
DELAY_HISTOGRAM = "histogram"  # Histogram of reporter.forward_ct - record.forward_ct at delivery
EVENT_COUNTER = "event_counter"  # Counter incremented by the telemetry itself (resets)
STATS_COUNTER = "observable_counter"  # ObservableCounter of a cumulative ReporterStats field
STATS_GAUGE = "observable_gauge"  # ObservableGauge of a ReporterStats field
SINK_COUNTER = "sink_counter"  # ObservableCounter of a count kept by the reporter's telemetry sink
SAMPLE_COUNTER = "sample_counter"  # ObservableCounter of the running sum of a per-sample value of each delivered record


@dataclass(frozen=True)
class InstrumentSpec:
    """One instrument.

    Attributes:
        name: dotted lowercase metric name (``kv_cache.swa.`` namespace, see ``semconv``).
        kind: one of ``counter`` (a cumulative record total, read at collection), ``gauge`` (a
            value of the latest record, read at collection), ``sample_counter`` (the running sum of a
            per-sample value over every record delivered, read at collection with the latest
            record's context: a fault seen in one sample stays counted whatever later samples say),
            ``histogram`` (delivery delay),
            ``event_counter``, ``observable_counter`` and ``observable_gauge`` (fields of
            ``reporter.stats``; a mapping field gives one point per key), ``sink_counter`` (a
            count of the reporter's telemetry sink).
        unit: UCUM unit with annotation, e.g. ``{entry}``.
        description: what a data point means.
        source: the record field(s) or ``ReporterStats`` field it is read from (documentation).
        read: for ``counter``/``gauge``/``sample_counter``: record -> ``(value, attributes)`` pairs; for the
            observable kinds: the ``ReporterStats`` (or sink) attribute name; otherwise ``None``.
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
        _field("swa_leaked_slots"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "tokens.stale", GAUGE, "{token}",
        "Live tokens whose SWA page is on the free list: the slot may be handed to another request",
        "swa_stale_tokens (when the engine gives audit inputs)",
        _field("swa_stale_tokens"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "slots.shared", GAUGE, "{slot}",
        "SWA slots that two distinct live FULL slots map to: two tokens write one slot",
        "swa_shared_slots (when the engine gives audit inputs)",
        _field("swa_shared_slots"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "pages.in_use", GAUGE, "{page}",
        "SWA pages allocated (not on the SWA free list) when the sample was taken",
        "swa_pages_in_use (when the engine gives audit inputs)",
        _field("swa_pages_in_use"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "pages.referenced", GAUGE, "{page}",
        "SWA pages in use that at least one live token maps into (in use - referenced = leaked pages)",
        "swa_pages_referenced (when the engine gives audit inputs)",
        _field("swa_pages_referenced"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "tokens.evicted_in_window", GAUGE, "{token}",
        "Live tokens of the sampled batch inside the sliding window (the positions the forward step's "
        "queries read) whose SWA slot was freed (mapping 0): attention reads KV that is gone (premature "
        "eviction); must be 0",
        "swa_premature_evictions (when the engine gives its sliding window)",
        _field("swa_premature_evictions"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "slots.held_out_of_window", GAUGE, "{slot}",
        "SWA slots still held by live tokens older than the positions the forward step reads plus the "
        "engine's eviction allowance (late eviction; growing: runaway SWA usage)",
        "swa_late_held_slots (when the engine gives its sliding window)",
        _field("swa_late_held_slots"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "read_check.queries", SAMPLE_COUNTER, "{query}",
        "Queries of sliding-window layers whose attention output the read check recomputed from the KV pool "
        "through the FULL-to-SWA mapping, by outcome (kv_cache.swa.read_check.outcome): agree, disagree "
        "(attention read other KV than the mapping's: must stay 0), unchecked (a variant the check does not cover)",
        "swa_read_checks - swa_read_mismatches (agree), swa_read_mismatches (disagree), swa_read_unchecked "
        "(unchecked), when the engine runs the read check",
        _outcomes(sc.ATTR_READ_OUTCOME, "swa_read_checks", "swa_read_mismatches", "swa_read_unchecked"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "write_check.tokens", SAMPLE_COUNTER, "{token}",
        "New tokens' K/V writes (one token at one layer each) the write check compared with what the KV pool "
        "holds at the slot the engine's tables name, by outcome (kv_cache.swa.write_check.outcome): agree, "
        "disagree (the pool holds other values there: a write to the wrong index; must stay 0), unchecked (a "
        "quantized cache or a layout the check does not cover)",
        "kv_write_checks - kv_write_mismatches (agree), kv_write_mismatches (disagree), kv_write_unchecked "
        "(unchecked), when the engine runs the write check",
        _outcomes(sc.ATTR_WRITE_OUTCOME, "kv_write_checks", "kv_write_mismatches", "kv_write_unchecked"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "provenance.stamps", SAMPLE_COUNTER, "{slot}",
        "Live token slots (FULL and SWA pools) whose provenance stamp was compared with the one the request's "
        "own tokens give, by outcome (kv_cache.swa.provenance.outcome): agree, disagree (the slot holds another "
        "token's KV, or none: never stamped; must stay 0), unchecked (token ids unknown, over the per-sample "
        "budget; never stamped, for an engine wired after it held KV)",
        "kv_stamp_checks - kv_foreign_tokens (agree), kv_foreign_tokens (disagree), kv_stamp_unchecked "
        "(unchecked), when the engine stamps its slots",
        _outcomes(sc.ATTR_PROVENANCE_OUTCOME, "kv_stamp_checks", "kv_foreign_tokens", "kv_stamp_unchecked"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "provenance.checksums", SAMPLE_COUNTER, "{slot}",
        "Live token slots whose K/V bytes were hashed again and compared with the hash taken at the write, by "
        "outcome (kv_cache.swa.provenance.outcome): agree, disagree (the bytes changed after the write; must "
        "stay 0)",
        "kv_checksum_checks - kv_corrupt_tokens (agree), kv_corrupt_tokens (disagree), when the engine "
        "checksums its slots",
        _outcomes(sc.ATTR_PROVENANCE_OUTCOME, "kv_checksum_checks", "kv_corrupt_tokens"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "tokens.foreign", GAUGE, "{token}",
        "Live token slots of the sampled step whose provenance stamp is another token's: the slot holds other "
        "KV than the tables say (swapped ownership, stale prefix reuse, a slot overwritten, a wrong position); "
        "must be 0",
        "kv_foreign_tokens (when the engine stamps its slots)",
        _field("kv_foreign_tokens"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "tokens.corrupt", GAUGE, "{token}",
        "Live token slots of the sampled step whose K/V bytes changed after they were written (a stray write, a "
        "bad load-back, a bit flip); must be 0",
        "kv_corrupt_tokens (when the engine checksums its slots)",
        _field("kv_corrupt_tokens"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "blocks.leaked", GAUGE, "{block}",
        "KV blocks in use that no request and no prefix-cache entry holds: allocated and unreachable "
        "(block-pool engines: vLLM)",
        "kv_leaked_blocks (when the engine gives the KV block audit's inputs)",
        _field("kv_leaked_blocks"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "blocks.freed_in_use", GAUGE, "{block}",
        "KV blocks a running request's block table references that are on the free queue: the pool may "
        "hand them to another request (block-pool engines: vLLM)",
        "kv_freed_blocks_in_use (when the engine gives the KV block audit's inputs)",
        _field("kv_freed_blocks_in_use"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "blocks.shared", GAUGE, "{block}",
        "KV blocks not in the prefix cache that two requests' block tables reference: a block handed out again "
        "while in use (block-pool engines: vLLM)",
        "kv_shared_blocks (when the engine gives the KV block audit's inputs)",
        _field("kv_shared_blocks"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "provenance.block_hashes", SAMPLE_COUNTER, "{entry}",
        "Prefix-cache map entries and block-table entries whose block hash was compared with the key or the "
        "request's block hash for that index (block-pool engines: vLLM)",
        "kv_cache_entries_checked (when the engine checks its block hashes)",
        _field("kv_cache_entries_checked"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "blocks.stale_cached", GAUGE, "{block}",
        "Prefix-cache map entries naming a block whose own hash is not the entry's key: a stale entry left after "
        "eviction or reuse, whose hit reads other tokens' KV (block-pool engines: vLLM); must be 0",
        "kv_stale_cache_entries (when the engine checks its block hashes)",
        _field("kv_stale_cache_entries"),
    ),
    InstrumentSpec(
        sc.NAMESPACE + "blocks.foreign", GAUGE, "{block}",
        "Blocks in a request's block table whose hash is not the request's block hash for that index, or blocks "
        "of another KV cache group: they hold other tokens' KV (block-pool engines: vLLM); must be 0",
        "kv_foreign_blocks (when the engine checks its block hashes)",
        _field("kv_foreign_blocks"),
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
        "Samples that gave no record: a negative total (a negative observe count) or a fault of the "
        "view (kv_cache.swa.reporter.view_faults); logged, never delivered",
        "ReporterStats.invalid_samples", "invalid_samples",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.view_faults", STATS_COUNTER, "{sample}",
        "Samples whose view showed a fault, per fault (kv_cache.swa.fault): req_pool_index_out_of_range, "
        "full_slot_out_of_range, seq_len_beyond_width, negative_seq_len, seq_lens_cpu_mismatch; "
        "such a sample gives no record",
        "ReporterStats.view_faults", "view_faults",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.samples.skipped", STATS_COUNTER, "{sample}",
        "step() calls ignored because the current CUDA stream was capturing a graph",
        "ReporterStats.skipped_captures", "skipped_captures",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.liveness.warnings", STATS_COUNTER, "{warning}",
        "Liveness warnings: the reporter was on and delivered no sample for OTEL_SWA_LIVENESS_STEPS forward "
        "steps, or in its whole life (no forward step reached it); each also an event and a log line",
        "ReporterStats.liveness_warnings", "liveness_warnings",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "telemetry.records.dropped", SINK_COUNTER, "{record}",
        "Records the telemetry sink could not hand to its delivery thread (its queue was full): not in "
        "the metrics, events and line; the forward step never waits for the queue",
        "SwaTelemetrySink.dropped", "dropped",
    ),
    InstrumentSpec(
        sc.NAMESPACE + "reporter.samples.pending", STATS_GAUGE, "{sample}",
        "Samples taken whose device-to-host copy has not been delivered yet",
        "ReporterStats.pending", "pending",
    ),
)


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
                    base = _with_micro_batch(base, record.micro_batch)
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
