"""SWA slot audit fields and vLLM's 'divergence not applicable' in metrics and events."""

from __future__ import annotations

from otel_swa.record import SwaDivergenceRecord
from otel_swa.telemetry import SwaTelemetrySink, record_attributes, record_from_attributes

R = SwaDivergenceRecord


def single(points):
    assert len(points) == 1
    return points[0].value


def test_audit_gauges_are_recorded_when_present(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(R(20, 100, 40, 3, 9, swa_leaked_slots=16, swa_stale_tokens=2, swa_shared_slots=1), None)
    m = pipeline.metrics()
    assert single(m["kv_cache.swa.slots.leaked"]["points"]) == 16
    assert m["kv_cache.swa.slots.leaked"]["unit"] == "{slot}"
    assert single(m["kv_cache.swa.tokens.stale"]["points"]) == 2
    assert single(m["kv_cache.swa.slots.shared"]["points"]) == 1
    events = pipeline.logs.get_finished_logs()
    attributes = dict(events[-1].log_record.attributes)
    assert attributes["kv_cache.swa.swa_leaked_slots"] == 16
    assert attributes["kv_cache.swa.swa_stale_tokens"] == 2
    assert attributes["kv_cache.swa.swa_shared_slots"] == 1


def test_no_audit_means_no_audit_series_and_no_audit_attributes(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(R(20, 100, 40, 3, 9), None)
    m = pipeline.metrics()
    assert "kv_cache.swa.slots.leaked" not in m
    assert "kv_cache.swa.tokens.stale" not in m
    attributes = dict(pipeline.logs.get_finished_logs()[-1].log_record.attributes)
    assert not any("leaked" in key or "stale" in key for key in attributes)


def test_divergence_not_applicable_is_not_a_measurement(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(R(20, 100, 40, 0, 9, divergence_applicable=False), None)
    m = pipeline.metrics()
    assert "kv_cache.swa.tokens.divergent" not in m
    assert single(m["kv_cache.swa.tokens.out_of_window"]["points"]) == 9
    attributes = dict(pipeline.logs.get_finished_logs()[-1].log_record.attributes)
    assert attributes["kv_cache.swa.divergence_applicable"] is False
    assert attributes["kv_cache.swa.swa_full_idx_divergence"] == 0  # kept for the SGLang line


def test_event_attributes_round_trip_with_extras():
    record = R(40, 9, 8, 7, 6, swa_leaked_slots=4, swa_stale_tokens=0, swa_shared_slots=2, divergence_applicable=False)
    assert record_from_attributes(record_attributes(record)) == record
    plain = R(40, 9, 8, 7, 6)
    assert record_from_attributes(record_attributes(plain)) == plain
    assert record.format() == plain.format()  # the line never carries the extras


def test_invalid_samples_are_visible_in_the_health_metrics(pipeline):
    import torch

    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.views import SwaBatch

    sink = SwaTelemetrySink(**pipeline.providers())
    reporter = SwaDivergenceReporter(1)
    sink.attach(reporter)
    reporter.observe("full", torch.tensor(-5))  # poisons the device total
    view = SwaBatch(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(3, dtype=torch.int64),
                    torch.tensor([1]), torch.tensor([2]), seq_lens_cpu=[2])
    for _ in range(3):
        reporter.step(view)
    reporter.flush()
    m = pipeline.metrics()
    assert single(m["kv_cache.swa.reporter.samples.invalid"]["points"]) == 3
    assert single(m["kv_cache.swa.reporter.samples.taken"]["points"]) == 3
    assert single(m["kv_cache.swa.reporter.samples.delivered"]["points"]) == 0


def test_window_check_gauges_and_attributes_are_recorded_when_present(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(R(20, 100, 40, 3, 9, swa_premature_evictions=5, swa_late_held_slots=12), None)
    m = pipeline.metrics()
    assert single(m["kv_cache.swa.tokens.evicted_in_window"]["points"]) == 5
    assert m["kv_cache.swa.tokens.evicted_in_window"]["unit"] == "{token}"
    assert single(m["kv_cache.swa.slots.held_out_of_window"]["points"]) == 12
    assert m["kv_cache.swa.slots.held_out_of_window"]["unit"] == "{slot}"
    assert "kv_cache.swa.slots.leaked" not in m  # no slot audit in this record
    attributes = dict(pipeline.logs.get_finished_logs()[-1].log_record.attributes)
    assert attributes["kv_cache.swa.swa_premature_evictions"] == 5
    assert attributes["kv_cache.swa.swa_late_held_slots"] == 12


def test_no_window_means_no_window_series():
    from otel_swa.telemetry.metrics import INSTRUMENTS

    plain = R(20, 100, 40, 3, 9)
    readers = {spec.name: spec.read for spec in INSTRUMENTS}
    assert readers["kv_cache.swa.tokens.evicted_in_window"](plain) == ()
    assert readers["kv_cache.swa.slots.held_out_of_window"](plain) == ()
    record = R(40, 9, 8, 7, 6, swa_premature_evictions=0, swa_late_held_slots=3)
    assert record_from_attributes(record_attributes(record)) == record
