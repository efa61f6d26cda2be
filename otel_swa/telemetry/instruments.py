"""The table of every instrument otel-swa's metrics create: one row each (name, kind, unit, description,
where its value comes from and how it is read from a record), the checks' rows made from their
declarations (:data:`otel_swa.checks.CHECKS`, each check's ``metrics``). :mod:`otel_swa.telemetry.metrics`
creates them on a meter and feeds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from otel_swa.checks import CHECKS, MetricRow
from otel_swa.record import VERIFY_SOURCES, SwaDivergenceRecord
from otel_swa.telemetry import semconv as sc

__all__ = ["InstrumentSpec", "INSTRUMENTS", "DELAY_BUCKETS", "ATTR_FAULT", "TOTAL_COUNTER", "GAUGE", "DELAY_HISTOGRAM",
           "EVENT_COUNTER", "STATS_COUNTER", "STATS_GAUGE", "SINK_COUNTER", "SAMPLE_COUNTER", "with_micro_batch"]

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


def with_micro_batch(base: Attributes, micro_batch: int) -> Attributes:
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


def _check_instrument(row: MetricRow) -> "InstrumentSpec":
    """The instrument of a check's metric row (:class:`otel_swa.checks.MetricRow`)."""
    if row.outcomes is not None:
        attribute, checks, disagree, unchecked = row.outcomes
        read = _outcomes(sc.NAMESPACE + attribute, checks, disagree, unchecked)
    else:
        read = _field(row.field)
    return InstrumentSpec(sc.NAMESPACE + row.name, GAUGE if row.kind == "gauge" else SAMPLE_COUNTER, row.unit,
                          row.description, row.source, read)


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
    *(_check_instrument(row) for check in CHECKS for row in check.metrics),
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
    # the reporter's health counters (ReporterStats), one row each: name, unit, field, description
    *(InstrumentSpec(sc.NAMESPACE + name, STATS_COUNTER, unit, description, "ReporterStats." + field, field)
      for name, unit, field, description in (
        ("reporter.samples.taken", "{sample}", "samples_taken",
         "Samples the reporter started on the device"),
        ("reporter.samples.delivered", "{sample}", "samples_delivered",
         "Sample records handed to the sinks"),
        ("reporter.ring_full.waits", "{wait}", "ring_full_waits",
         "Times the host waited for the oldest device-to-host copy because every ring slot was in flight"),
        ("reporter.sink.errors", "{error}", "sink_errors",
         "Exceptions raised by sinks (caught and logged by the reporter)"),
        ("reporter.samples.invalid", "{sample}", "invalid_samples",
         "Samples that gave no record: a negative total (a negative observe count) or a fault of the "
         "view (kv_cache.swa.reporter.view_faults); logged, never delivered"),
        ("reporter.view_faults", "{sample}", "view_faults",
         "Samples whose view showed a fault, per fault (kv_cache.swa.fault): req_pool_index_out_of_range, "
         "full_slot_out_of_range, seq_len_beyond_width, negative_seq_len, seq_lens_cpu_mismatch; "
         "such a sample gives no record"),
        ("reporter.samples.skipped", "{sample}", "skipped_captures",
         "step() calls ignored because the current CUDA stream was capturing a graph"),
        ("reporter.liveness.warnings", "{warning}", "liveness_warnings",
         "Liveness warnings: the reporter was on and delivered no sample for OTEL_SWA_LIVENESS_STEPS forward "
         "steps, or in its whole life (no forward step reached it); each also an event and a log line"),
    )),
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
