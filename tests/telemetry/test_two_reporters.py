"""Two real reporters attached to one telemetry object: each keeps its own cumulative totals, so
the counters add up both reporters' work and no false restart is reported."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from opentelemetry.sdk.metrics import ObservableCounter
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader

from otel_swa.reporter import KVPool, SwaDivergenceReporter
from otel_swa.telemetry import configure
from otel_swa.views.base import SwaBatch


def view():
    # one request of 4 tokens; FULL slots 1..4 map to SWA slots 1..4 (nothing remapped or freed)
    req_to_token = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    mapping = torch.tensor([0, 1, 2, 3, 4, 0], dtype=torch.int64)
    return SwaBatch(req_to_token, mapping, torch.tensor([0]), torch.tensor([4]))


def points(reader, name):
    data = reader.get_metrics_data()
    return {tuple(sorted(p.attributes.items())): p.value
            for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics if m.name == name
            for p in m.data.data_points}


def test_two_reporters_on_one_telemetry_count_separately(caplog):
    reader = InMemoryMetricReader()
    tel = configure(exporters="none", metric_readers=[reader], use_global=False, set_global=False, environ={})
    # reporter a: 3 steps of 1000 FULL / 10 SWA entries; reporter b: 5 steps of 300 / 3; interleaved
    plan = {"a": (3, 1000, 10), "b": (5, 300, 3)}
    reporters = {name: SwaDivergenceReporter(1, device="cpu", ring_size=2) for name in plan}
    for reporter in reporters.values():
        tel.attach(reporter)
    with caplog.at_level(logging.WARNING):
        for step in range(max(steps for steps, _, _ in plan.values())):
            for name, (steps, full, swa) in plan.items():
                if step < steps:
                    reporters[name].observe(KVPool.FULL, full)
                    reporters[name].observe(KVPool.SWA, swa)
                    reporters[name].step(view())
        for reporter in reporters.values():
            reporter.close()
    # plain recount: 3*1000 + 5*300 FULL, 3*10 + 5*3 SWA, 3 + 5 forward steps
    assert points(reader, "kv_cache.swa.entries.verified") == {
        (("kv_cache.swa.verify_source", "attention"), ("pool", "full")): 4500,
        (("kv_cache.swa.verify_source", "attention"), ("pool", "swa")): 45,
    }
    assert points(reader, "kv_cache.swa.forward_steps") == {(): 8}
    assert sum(points(reader, "kv_cache.swa.reporter.resets").values()) == 0
    assert "restarted" not in caplog.text
    # the health instruments sum both reporters: 8 samples taken and delivered
    assert points(reader, "kv_cache.swa.reporter.samples.delivered") == {(): 8}
    tel.shutdown()


def test_one_sink_refuses_a_second_reporter_and_ignores_a_repeated_attach():
    tel = configure(exporters="none", use_global=False, set_global=False, environ={})
    a, b = SwaDivergenceReporter(1), SwaDivergenceReporter(1)
    tel.sink.attach(a)
    tel.sink.attach(a)
    try:
        tel.sink.attach(b)
    except ValueError as exc:
        assert "for_another_reporter" in str(exc)
    else:
        raise AssertionError("a sink attached to a second reporter must raise")
    tel.attach(b)  # the pipeline gives b its own sink
    tel.attach(b)
    for reporter in (a, b):
        reporter.step(view())
        reporter.close()
    assert [sink.reporter for sink in tel.sinks] == [b]
    assert tel.sink.records == 1  # a's one record, delivered once
    assert tel.sinks[0] is not tel.sink and tel.sinks[0].records == 1
    tel.shutdown()


def run_steps(reporter, steps):
    for _ in range(steps):
        reporter.observe(KVPool.FULL, 10)
        reporter.step(view())


def collect(reader, *names):
    data = reader.get_metrics_data()  # one collection for all the names
    return [{tuple(sorted(p.attributes.items())): p.value
             for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics if m.name == name
             for p in m.data.data_points} for name in names]


@pytest.mark.parametrize("temporality", [AggregationTemporality.CUMULATIVE, AggregationTemporality.DELTA])
def test_health_counters_keep_the_counts_of_a_garbage_collected_reporter(temporality):
    reader = InMemoryMetricReader(preferred_temporality={ObservableCounter: temporality})
    tel = configure(exporters="none", metric_readers=[reader], use_global=False, set_global=False, environ={})
    names = ("kv_cache.swa.reporter.samples.taken", "kv_cache.swa.reporter.samples.delivered")
    keep = tel.attach(SwaDivergenceReporter(1, device="cpu", ring_size=2))
    drop = tel.attach(SwaDivergenceReporter(1, device="cpu", ring_size=2))
    run_steps(keep, 2)
    keep.flush()
    run_steps(drop, 3)
    drop.close()
    # interval 1: one sample per step; 2 + 3 taken and delivered
    assert collect(reader, *names) == [{(): 5}, {(): 5}]
    # a reporter that delivers and is dropped with no collection in between still counts
    late = tel.attach(SwaDivergenceReporter(1, device="cpu", ring_size=2))
    run_steps(late, 4)
    late.close()
    del drop, late
    gc.collect()
    run_steps(keep, 1)
    keep.flush()
    # keep 3 + dropped 3 + late 4 = 10 in all; 1 + 4 = 5 since the first collection (never negative)
    expected = 10 if temporality == AggregationTemporality.CUMULATIVE else 5
    assert collect(reader, *names) == [{(): expected}, {(): expected}]
    keep.close()
    tel.shutdown()
