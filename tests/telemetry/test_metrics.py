"""Metric values equal the records, under cumulative and delta temporality; exemplars; resets."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from otel_swa.record import SwaDivergenceRecord
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.telemetry import INSTRUMENTS, SwaTelemetrySink
from otel_swa.telemetry.metrics import DELAY_BUCKETS
from otel_swa.views.base import SwaBatch

R = SwaDivergenceRecord
# Three records as a reporter with interval 20 would deliver them.
RECORDS = [R(20, 5120, 2048, 17, 311), R(40, 9000, 3000, 25, 640), R(60, 15000, 4100, 3, 900)]


def value(points, **attributes):
    found = [p for p in points if dict(p.attributes) == attributes]
    assert len(found) == 1, (attributes, [dict(p.attributes) for p in points])
    return found[0].value


def test_instrument_table_names_units_are_well_formed():
    names = [spec.name for spec in INSTRUMENTS]
    assert len(set(names)) == len(names)
    for spec in INSTRUMENTS:
        assert spec.name == spec.name.lower() and spec.name.startswith("kv_cache.swa.")
        assert spec.unit.startswith("{") and spec.unit.endswith("}")
        assert spec.description


def test_cumulative_counters_equal_the_last_record_and_gauges_the_sampled_values(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    for record in RECORDS[:2]:
        sink(record, None)
    m = pipeline.metrics()
    assert m["kv_cache.swa.entries.verified"]["unit"] == "{entry}"
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="full") == 9000
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="swa") == 3000
    assert value(m["kv_cache.swa.forward_steps"]["points"]) == 40
    assert m["kv_cache.swa.forward_steps"]["data"].is_monotonic is True
    assert value(m["kv_cache.swa.tokens.divergent"]["points"]) == 25
    assert value(m["kv_cache.swa.tokens.out_of_window"]["points"]) == 640
    assert m["kv_cache.swa.tokens.out_of_window"]["unit"] == "{token}"
    sink(RECORDS[2], None)
    m = pipeline.metrics()
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="full") == 15000
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="swa") == 4100
    assert value(m["kv_cache.swa.forward_steps"]["points"]) == 60
    assert value(m["kv_cache.swa.tokens.divergent"]["points"]) == 3
    assert sink.errors == 0


def test_delta_temporality_exports_the_differences_between_records(make_pipeline):
    p = make_pipeline("delta")
    sink = SwaTelemetrySink(**p.providers())
    sink(RECORDS[0], None)
    m = p.metrics()
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="full") == 5120
    assert value(m["kv_cache.swa.forward_steps"]["points"]) == 20
    sink(RECORDS[1], None)
    sink(RECORDS[2], None)
    m = p.metrics()
    # (9000 - 5120) + (15000 - 9000), (3000 - 2048) + (4100 - 3000), 60 - 20
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="full") == 9880
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="swa") == 2052
    assert value(m["kv_cache.swa.forward_steps"]["points"]) == 40
    assert value(m["kv_cache.swa.tokens.out_of_window"]["points"]) == 900


def test_a_zero_total_still_creates_its_series(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(R(20, 640, 0, 0, 0), None)
    points = pipeline.metrics()["kv_cache.swa.entries.verified"]["points"]
    assert value(points, pool="swa") == 0 and value(points, pool="full") == 640


def test_a_restarted_reporter_is_counted_as_a_reset_and_totals_stay_monotonic(pipeline, caplog):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(RECORDS[1], None)  # totals 9000 / 3000 / 40
    with caplog.at_level("WARNING"):
        sink(R(20, 1000, 500, 1, 2), None)  # a new reporter starts from 0
    m = pipeline.metrics()
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="full") == 10000
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="swa") == 3500
    assert value(m["kv_cache.swa.forward_steps"]["points"]) == 60
    assert value(m["kv_cache.swa.reporter.resets"]["points"]) == 1
    assert "went back from 9000 to 1000" in caplog.text


def test_exemplars_point_at_the_forward_step_span(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    tracer = pipeline.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("forward step") as span:
        from opentelemetry import context

        forward_context = context.get_current()
    ids = (span.get_span_context().trace_id, span.get_span_context().span_id)
    # delivered later, outside the span, in another span's context
    with tracer.start_as_current_span("a later step"):
        sink(RECORDS[0], forward_context)
    m = pipeline.metrics()
    for name in ("kv_cache.swa.entries.verified", "kv_cache.swa.tokens.divergent", "kv_cache.swa.tokens.out_of_window",
                 "kv_cache.swa.forward_steps"):
        for point in m[name]["points"]:
            assert [(e.trace_id, e.span_id) for e in point.exemplars] == [ids], name
            assert point.exemplars[0].value == point.value


@pytest.mark.parametrize("exemplar_filter, expected", [("trace_based", 1), ("always_off", 0), ("always_on", 1)])
def test_exemplar_filter_variable_is_respected(make_pipeline, monkeypatch, exemplar_filter, expected):
    monkeypatch.setenv("OTEL_METRICS_EXEMPLAR_FILTER", exemplar_filter)
    p = make_pipeline()  # the MeterProvider reads the variable
    sink = SwaTelemetrySink(**p.providers())
    with p.tracer_provider.get_tracer("test").start_as_current_span("forward step") as span:
        from opentelemetry import context

        sink(RECORDS[0], context.get_current())
    point = p.metrics()["kv_cache.swa.tokens.divergent"]["points"][0]
    assert [(e.span_id, e.value) for e in point.exemplars] == [(span.get_span_context().span_id, 17)] * expected


def test_trace_based_filter_takes_no_exemplar_without_a_sampled_span(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(RECORDS[0], None)
    assert pipeline.metrics()["kv_cache.swa.tokens.divergent"]["points"][0].exemplars == []


class FakeReporter:
    """Just what the sink reads: add_sink, forward_ct, stats."""

    def __init__(self):
        self.sinks = []
        self.forward_ct = 0
        from types import SimpleNamespace

        self.stats = SimpleNamespace(samples_taken=0, samples_delivered=0, ring_full_waits=0, sink_errors=0, pending=0,
                                     invalid_samples=0, skipped_captures=0, view_faults={})

    def add_sink(self, sink):
        self.sinks.append(sink)


def test_health_instruments_read_the_attached_reporter(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    reporter = FakeReporter()
    sink.attach(reporter)
    assert reporter.sinks == [sink.handoff]  # records reach the sink through its delivery thread
    reporter.stats.samples_taken, reporter.stats.samples_delivered = 3, 2
    reporter.stats.ring_full_waits, reporter.stats.pending = 1, 1
    reporter.forward_ct = 21
    sink(RECORDS[0], None)  # delay 21 - 20 = 1
    reporter.forward_ct = 43
    sink(RECORDS[1], None)  # delay 3
    m = pipeline.metrics()
    assert value(m["kv_cache.swa.reporter.samples.taken"]["points"]) == 3
    assert value(m["kv_cache.swa.reporter.samples.delivered"]["points"]) == 2
    assert value(m["kv_cache.swa.reporter.ring_full.waits"]["points"]) == 1
    assert value(m["kv_cache.swa.reporter.sink.errors"]["points"]) == 0
    assert value(m["kv_cache.swa.reporter.samples.pending"]["points"]) == 1
    assert value(m["kv_cache.swa.reporter.samples.invalid"]["points"]) == 0
    assert value(m["kv_cache.swa.reporter.samples.skipped"]["points"]) == 0
    hist = m["kv_cache.swa.reporter.delivery.delay"]["points"][0]
    assert m["kv_cache.swa.reporter.delivery.delay"]["unit"] == "{forward}"
    assert (hist.count, hist.sum, hist.min, hist.max) == (2, 4, 1, 3)
    assert list(hist.explicit_bounds) == list(DELAY_BUCKETS)
    # buckets (-inf,0], (0,1], (1,2], (2,3], ...: one delay of 1 and one of 3
    assert list(hist.bucket_counts)[:5] == [0, 1, 0, 1, 0]


def test_two_sinks_built_apart_on_one_meter_both_export_their_reporters_health(pipeline):
    """As with ``configure()`` and an instrumentor, or two instrumentors, in one process: each builds
    its own sink on the same providers. The SDK keeps the first observable instrument of a name and
    drops a second one's callbacks, so both sinks must share one set of instruments."""
    from otel_swa.reporter import SwaDivergenceReporter

    first, second = SwaTelemetrySink(**pipeline.providers()), SwaTelemetrySink(**pipeline.providers())
    assert first.metrics is second.metrics
    a = first.attach(SwaDivergenceReporter(1))
    b = second.for_another_reporter({"otel_swa.tp_rank": 1}).attach(SwaDivergenceReporter(2))
    view = _empty_view()
    for _ in range(4):
        a.step(view)
        b.step(view)
    a.close()
    b.close()  # their records are delivered before the pipeline shuts down
    points = pipeline.metrics()["kv_cache.swa.reporter.samples.taken"]["points"]
    by_rank = {dict(p.attributes).get("otel_swa.tp_rank"): p.value for p in points}
    assert by_rank == {None: 4, 1: 2}  # reporter a: every step; reporter b (rank 1): every 2nd


def _empty_view():
    import torch

    from otel_swa.views import SwaBatch

    empty = torch.zeros(0, dtype=torch.int64)
    return SwaBatch(torch.zeros((1, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.int64), empty, empty, ())


def test_a_failing_meter_never_raises_into_the_reporter(pipeline, caplog):
    sink = SwaTelemetrySink(**pipeline.providers())

    def broken(*args, **kwargs):
        raise RuntimeError("exporter down")

    sink.metrics.record = broken
    sink(RECORDS[0], None)  # must not raise
    assert sink.errors == 1
    assert "exporter down" in caplog.text
    # the events part still ran
    assert len(pipeline.logs.get_finished_logs()) == 1


def test_record_refuses_what_is_not_a_record(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    with pytest.raises(TypeError, match="expected a SwaDivergenceRecord, got dict"):
        sink.metrics.record({"forward_ct": 20}, None, store=sink.metrics.store())
    with pytest.raises(TypeError, match="store must be a RecordStore"):
        sink.metrics.record(RECORDS[0], None, store={})


def test_each_store_keeps_its_own_totals_and_the_counters_sum_them(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    with pytest.raises(TypeError, match="store"):
        sink.metrics.record(RECORDS[0], None)  # no hidden store shared by every caller
    a, b = sink.metrics.store(), sink.metrics.store()
    sink.metrics.record(RECORDS[0], None, store=a)  # source a: 20 steps, 5120 FULL entries
    sink.metrics.record(R(10, 1000, 400, 0, 0), None, store=b)  # source b: 10 steps, 1000 entries
    sink.metrics.record(RECORDS[1], None, store=a)  # a: 40 steps, 9000 entries
    m = pipeline.metrics()
    assert value(m["kv_cache.swa.forward_steps"]["points"]) == 40 + 10
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="full") == 9000 + 1000
    assert "kv_cache.swa.reporter.resets" not in m  # b's lower totals were not taken for a restart of a
    assert a.totals[("kv_cache.swa.forward_steps", ())] == 40 and b.totals[("kv_cache.swa.forward_steps", ())] == 10
    # b's reporter goes away: its totals stay in the counters (no false reset), a goes on
    del b
    gc.collect()
    sink.metrics.record(RECORDS[2], None, store=a)
    m = pipeline.metrics()
    assert value(m["kv_cache.swa.forward_steps"]["points"]) == 60 + 10
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="full") == 15000 + 1000


def _die_while_locked(lock, holder: list) -> bool:
    """Drop the last reference to ``holder[0]`` while ``lock`` is held, on another thread (as a
    garbage collection inside the delivery thread's locked section drops a dead reporter's store);
    True when that thread finished within 5 s."""
    def run():
        with lock:
            holder.clear()  # the object's finalizer runs here, on this thread, the lock held

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5)
    return not thread.is_alive()


def test_a_store_dying_inside_the_metrics_lock_neither_deadlocks_nor_loses_its_totals(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    a, b = sink.metrics.store(), sink.metrics.store()
    sink.metrics.record(RECORDS[0], None, store=a)  # a: 20 steps, 5120 FULL entries
    sink.metrics.record(R(10, 1000, 400, 0, 0), None, store=b)  # b: 10 steps, 1000 FULL entries
    holder = [b]
    del b
    assert _die_while_locked(sink.metrics._lock, holder), "the store's finalizer deadlocked on the metrics lock"
    m = pipeline.metrics()
    assert value(m["kv_cache.swa.forward_steps"]["points"]) == 20 + 10
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="full") == 5120 + 1000
    assert "kv_cache.swa.reporter.resets" not in m


def test_a_reporter_dying_inside_the_stats_lock_neither_deadlocks_nor_loses_its_counts(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    reporter = SwaDivergenceReporter(1, device="cpu", ring_size=2)
    sink.attach(reporter)
    view = SwaBatch(torch.tensor([[1, 2, 3]], dtype=torch.int32), torch.tensor([0, 1, 2, 3, 0]), torch.tensor([0]),
                    torch.tensor([3]))
    for _ in range(3):  # interval 1: 3 samples taken and delivered
        reporter.step(view)
    reporter.close()
    holder = [reporter]
    del reporter
    assert _die_while_locked(sink.metrics._stats_lock, holder), "the reporter's finalizer deadlocked on the stats lock"
    gc.collect()
    m = pipeline.metrics()
    assert value(m["kv_cache.swa.reporter.samples.delivered"]["points"]) == 3


def test_dead_stores_are_folded_in_when_the_next_store_is_made_without_any_collection(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    for _ in range(50):  # reporters made and dropped, no metric collection in between
        store = sink.metrics.store()
        sink.metrics.record(R(10, 1000, 400, 0, 0), None, store=store)
        del store
    assert len(sink.metrics._dead_stores) <= 1  # the last one only: each new store folded the one before
    m = pipeline.metrics()
    assert value(m["kv_cache.swa.forward_steps"]["points"]) == 50 * 10


def test_values_are_read_at_collection_and_delivery_calls_the_sdk_once(pipeline, monkeypatch):
    """A delivered record only updates the store; the instruments read it when the SDK collects.
    The one SDK call per record is the delivery-delay histogram (with a known delivery step)."""
    sink = SwaTelemetrySink(**pipeline.providers())
    calls = []
    monkeypatch.setattr(sink.metrics._delay, "record", lambda *a, **k: calls.append("histogram"))
    monkeypatch.setattr(sink.metrics._resets, "add", lambda *a, **k: calls.append("resets"))
    sink.metrics.record(RECORDS[0], None, delivered_at=21, store=sink._store)
    sink.metrics.record(RECORDS[1], None, store=sink._store)
    assert calls == ["histogram"]
    m = pipeline.metrics()
    assert value(m["kv_cache.swa.tokens.out_of_window"]["points"]) == 640
    assert value(m["kv_cache.swa.entries.verified"]["points"], pool="swa") == 3000


def test_audit_page_gauges_and_the_latest_audited_value_stays(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(R(20, 10, 5, 1, 2, swa_leaked_slots=8, swa_stale_tokens=0, swa_shared_slots=0,
           swa_pages_in_use=12, swa_pages_referenced=10), None)
    sink(R(40, 20, 9, 1, 2), None)  # not audited: the last audited values are the ones shown
    m = pipeline.metrics()
    assert m["kv_cache.swa.pages.in_use"]["unit"] == "{page}"
    assert value(m["kv_cache.swa.pages.in_use"]["points"]) == 12
    assert value(m["kv_cache.swa.pages.referenced"]["points"]) == 10
    assert value(m["kv_cache.swa.slots.leaked"]["points"]) == 8
    assert value(m["kv_cache.swa.tokens.out_of_window"]["points"]) == 2


def test_view_faults_are_exported_per_fault(pipeline):
    import torch

    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.views import SwaBatch

    sink = SwaTelemetrySink(**pipeline.providers())
    reporter = SwaDivergenceReporter(1)
    sink.attach(reporter)
    r2t = torch.tensor([[0, 0], [1, 2]], dtype=torch.int32)
    mapping = torch.tensor([0, 1, 2])
    for rows, device_lens, host_lens in (([5], [1], [1]), ([1], [1], [2]), ([1], [1], [2]), ([1], [2], [2])):
        reporter.step(SwaBatch(r2t, mapping, torch.tensor(rows), torch.tensor(device_lens), seq_lens_cpu=host_lens))
    reporter.flush()
    m = pipeline.metrics()
    faults = {dict(p.attributes)["kv_cache.swa.fault"]: p.value for p in m["kv_cache.swa.reporter.view_faults"]["points"]}
    assert faults == {"req_pool_index_out_of_range": 1, "seq_lens_cpu_mismatch": 2, "full_slot_out_of_range": 0,
                      "seq_len_beyond_width": 0, "negative_seq_len": 0}
    assert value(m["kv_cache.swa.reporter.samples.invalid"]["points"]) == 3
    assert value(m["kv_cache.swa.reporter.samples.delivered"]["points"]) == 1


def test_every_reporter_stats_field_has_one_health_instrument():
    from dataclasses import fields

    from otel_swa.reporter import ReporterStats

    observed = [spec.read for spec in INSTRUMENTS if spec.kind in ("observable_counter", "observable_gauge")]
    assert sorted(observed) == sorted(f.name for f in fields(ReporterStats))
    assert len(observed) == 9
