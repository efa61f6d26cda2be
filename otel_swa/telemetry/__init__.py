"""OpenTelemetry side of otel-swa: metrics, events, forward-step spans, setup, the log-line exporter.

This package imports OpenTelemetry and never torch; the only thing it receives from the device
side is the :class:`~otel_swa.record.SwaDivergenceRecord` (with the forward step's context).

Metrics (namespace ``kv_cache.swa.``; see :data:`otel_swa.telemetry.metrics.INSTRUMENTS`):

==========================================  ==============  ===========  ===================
name                                        kind            unit         from
==========================================  ==============  ===========  ===================
kv_cache.swa.entries.verified               ObservableCtr   {entry}      verify_full (pool=full), verify_swa (pool=swa), kv_cache.swa.verify_source
kv_cache.swa.forward_steps                  ObservableCtr   {forward}    forward_ct
kv_cache.swa.tokens.divergent               ObservableGauge {token}      swa_full_idx_divergence
kv_cache.swa.tokens.out_of_window           ObservableGauge {token}      swa_out_of_window_tokens
(each check's metrics)                      Gauge, Counter  (its own)    the check's fields: the metric rows of otel_swa.checks
kv_cache.swa.reporter.delivery.delay        Histogram       {forward}    reporter.forward_ct - forward_ct at delivery
kv_cache.swa.reporter.resets                Counter         {reset}      totals that went backwards
kv_cache.swa.reporter.samples.taken         ObservableCtr   {sample}     reporter.stats.samples_taken
kv_cache.swa.reporter.samples.delivered     ObservableCtr   {sample}     reporter.stats.samples_delivered
kv_cache.swa.reporter.ring_full.waits       ObservableCtr   {wait}       reporter.stats.ring_full_waits
kv_cache.swa.reporter.sink.errors           ObservableCtr   {error}      reporter.stats.sink_errors
kv_cache.swa.reporter.samples.invalid       ObservableCtr   {sample}     reporter.stats.invalid_samples
kv_cache.swa.reporter.samples.skipped       ObservableCtr   {sample}     step() calls ignored during CUDA graph capture
kv_cache.swa.reporter.view_faults           ObservableCtr   {sample}     reporter.stats.view_faults (kv_cache.swa.fault=...)
kv_cache.swa.reporter.samples.pending       ObservableGauge {sample}     reporter.stats.pending
kv_cache.swa.telemetry.records.dropped      ObservableCtr   {record}     records the full delivery queue dropped
kv_cache.swa.memory.saved                   ObservableGauge By           swa_out_of_window_tokens x SWA KV bytes per token
kv_cache.pool.tokens.used                   ObservableGauge {token}      the engine's pool (pool=full|swa), at collection
kv_cache.pool.tokens.available              ObservableGauge {token}      idem
kv_cache.pool.tokens.evictable              ObservableGauge {token}      idem (held only by the prefix cache)
kv_cache.pool.tokens.limit                  ObservableGauge {token}      idem (the pool's size)
kv_cache.pool.utilization                   ObservableGauge 1            idem (used / limit)
==========================================  ==============  ===========  ===================

Each check (:data:`otel_swa.checks.CHECKS`) adds its own gauges and counters, read from its record
fields (its module's ``metrics``; docs/telemetry.md lists them all). The ``kv_cache.pool.`` gauges and ``kv_cache.swa.memory.saved``: :mod:`otel_swa.telemetry.pools`.
Prometheus (``OTEL_METRICS_EXPORTER=prometheus``, ``exporters="prometheus"``): an endpoint per
process, :mod:`otel_swa.telemetry.prometheus`; the names as Prometheus gets them: docs/telemetry.md.

Events: ``kv_cache.swa.divergence_sample`` (Logs API event and span event), see
:mod:`otel_swa.telemetry.events`. Usage::

    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.telemetry import configure

    telemetry = configure(exporters="otlp,logline")       # or the OTEL_*_EXPORTER variables
    reporter = SwaDivergenceReporter.from_env(device="cpu")
    if reporter is not None:
        telemetry.attach(reporter)
    ...
    with telemetry.forward_span(batch_info):
        run_forward(batch)
        if reporter is not None:
            reporter.step(view)
    ...
    reporter.close(); telemetry.shutdown()
"""

from otel_swa.telemetry.events import SampleEvents, record_attributes, record_from_attributes
from otel_swa.telemetry.logline import SwaLogLineExporter
from otel_swa.telemetry.metrics import INSTRUMENTS, InstrumentSpec, SwaMetrics
from otel_swa.telemetry.pools import POOL_INSTRUMENTS, SAVINGS_INSTRUMENT, PoolMetrics, pool_metrics
from otel_swa.telemetry.semconv import EVENT_NAME, FORWARD_SPAN_NAME, NAMESPACE, SAMPLE_SPAN_NAME
from otel_swa.telemetry.setup import SwaTelemetry, configure, resolve_exporters
from otel_swa.telemetry.sink import SwaTelemetrySink
from otel_swa.telemetry.spans import ForwardSpans, RequestSpans, format_traceparent, parse_traceparent

__all__ = [
    "EVENT_NAME",
    "FORWARD_SPAN_NAME",
    "NAMESPACE",
    "SAMPLE_SPAN_NAME",
    "INSTRUMENTS",
    "InstrumentSpec",
    "SwaMetrics",
    "POOL_INSTRUMENTS",
    "SAVINGS_INSTRUMENT",
    "PoolMetrics",
    "pool_metrics",
    "SampleEvents",
    "record_attributes",
    "record_from_attributes",
    "SwaLogLineExporter",
    "SwaTelemetrySink",
    "ForwardSpans",
    "RequestSpans",
    "format_traceparent",
    "parse_traceparent",
    "SwaTelemetry",
    "configure",
    "resolve_exporters",
]
