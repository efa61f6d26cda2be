"""The pool usage gauges and the window savings gauge (``otel_swa.telemetry.pools``), on the SDK's
in-memory reader: exact points for hand-made figures, one read of each source per collection,
sources that fail or go away."""

from __future__ import annotations

import gc
import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from otel_swa.pool_usage import PoolUsage
from otel_swa.record import SwaDivergenceRecord
from otel_swa.telemetry.pools import POOL_INSTRUMENTS, PoolMetrics, pool_metrics

NAMES = {"kv_cache.pool.tokens.used": "used", "kv_cache.pool.tokens.available": "available",
         "kv_cache.pool.tokens.evictable": "evictable", "kv_cache.pool.tokens.limit": "limit",
         "kv_cache.pool.utilization": "utilization"}


@pytest.fixture
def reader():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    reader.pools = pool_metrics(provider)
    yield reader
    provider.shutdown()


def collect(reader) -> dict:
    """``{(figure, pool, other attributes): value}`` of one collection; units checked on the way."""
    points = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name in NAMES:
                    assert metric.unit == ("1" if metric.name.endswith("utilization") else "{token}")
                    for point in metric.data.data_points:
                        attributes = dict(point.attributes)
                        pool = attributes.pop("pool")
                        points[(NAMES[metric.name], pool, tuple(sorted(attributes.items())))] = point.value
                elif metric.name == "kv_cache.swa.memory.saved":
                    assert metric.unit == "By"
                    for point in metric.data.data_points:
                        points[("saved", tuple(sorted(point.attributes.items())))] = (
                            point.value, [(e.span_id, e.trace_id) for e in point.exemplars])
    return points


def test_each_figure_of_each_pool_is_a_point_with_its_attributes(reader):
    full = PoolUsage("full", used=600, available=300, evictable=100, total=1000)
    swa = PoolUsage("swa", used=96, available=160, evictable=0, total=256)
    reader.pools.register(lambda: [full, swa], attributes={"otel_swa.tp_rank": 1})
    rank = (("otel_swa.tp_rank", 1),)
    assert collect(reader) == {
        ("used", "full", rank): 600, ("available", "full", rank): 300, ("evictable", "full", rank): 100,
        ("limit", "full", rank): 1000, ("utilization", "full", rank): 0.6,
        ("used", "swa", rank): 96, ("available", "swa", rank): 160, ("evictable", "swa", rank): 0,
        ("limit", "swa", rank): 256, ("utilization", "swa", rank): 0.375,
    }


def test_a_collection_reads_each_source_once_and_reports_one_moment(reader):
    calls = []

    def source():
        calls.append(1)
        n = len(calls)  # the pool changes between reads: used n, available 100 - n
        return [PoolUsage.from_free("full", total=100, available=100 - n)]

    reader.pools.register(source)
    for n in (1, 2, 3):
        points = collect(reader)
        assert len(calls) == n
        assert (points[("used", "full", ())], points[("available", "full", ())]) == (n, 100 - n)


def test_sources_with_the_same_attributes_add_up_and_others_stay_apart(reader):
    one = [PoolUsage("full", 10, 20, 5, 40), PoolUsage("swa", 1, 7, 0, 8)]
    two = [PoolUsage("full", 30, 0, 10, 40)]
    reader.pools.register(lambda: one)
    reader.pools.register(lambda: two)
    reader.pools.register(lambda: two, attributes={"otel_swa.dp_rank": 1})
    points = collect(reader)
    assert [points[(f, "full", ())] for f in ("used", "available", "evictable", "limit")] == [40, 20, 15, 80]
    assert points[("utilization", "full", ())] == 0.5
    assert points[("used", "swa", ())] == 1
    assert points[("used", "full", (("otel_swa.dp_rank", 1),))] == 30


def test_a_failing_source_is_logged_once_and_the_others_still_report(reader, caplog):
    def broken():
        raise RuntimeError("allocator gone")

    reader.pools.register(broken)
    reader.pools.register(lambda: ["not a PoolUsage"])
    reader.pools.register(lambda: None)  # the engine cannot say now: skipped silently
    reader.pools.register(lambda: [PoolUsage("swa", 1, 2, 3, 6)])
    with caplog.at_level(logging.ERROR, logger="otel_swa.telemetry.pools"):
        for _ in range(3):
            points = collect(reader)
            assert points[("used", "swa", ())] == 1 and len(points) == 5
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # once per source and kind of fault
    assert any("RuntimeError" in m for m in messages) and any("TypeError" in m for m in messages)


def test_an_empty_pool_has_no_utilization_point(reader):
    reader.pools.register(lambda: [PoolUsage("swa", 0, 0, 0, 0)])
    points = collect(reader)
    assert points[("limit", "swa", ())] == 0 and ("utilization", "swa", ()) not in points


def test_a_source_goes_with_its_owner_and_unregister_stops_it(reader):
    class Engine:
        pass

    engine = Engine()
    reader.pools.register(lambda owner: [PoolUsage("full", 1, 1, 0, 2)], owner=engine)
    registration = reader.pools.register(lambda: [PoolUsage("swa", 2, 0, 0, 2)])
    assert len(collect(reader)) == 10
    del engine
    gc.collect()
    assert {key[1] for key in collect(reader)} == {"swa"}
    registration.unregister()
    assert collect(reader) == {}


def test_one_set_of_gauges_per_meter():
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    assert pool_metrics(provider) is pool_metrics(provider)
    assert isinstance(pool_metrics(provider), PoolMetrics)
    assert [spec.name for spec in POOL_INSTRUMENTS] == list(NAMES)
    with pytest.raises(TypeError, match="source must be callable"):
        pool_metrics(provider).register(42)
    provider.shutdown()


def test_the_savings_gauge_is_out_of_window_tokens_times_bytes_per_token_with_the_steps_exemplar(reader):
    tracer = TracerProvider().get_tracer("test")
    sink = reader.pools.savings_sink(256, {"otel_swa.tp_rank": 0})
    assert collect(reader) == {}  # no sample yet: nothing measured, nothing reported
    record = SwaDivergenceRecord(forward_ct=20, verify_full=900, verify_swa=300, swa_full_idx_divergence=4,
                                 swa_out_of_window_tokens=37)
    with tracer.start_as_current_span("forward step") as span:
        context = trace.set_span_in_context(span)
        sink(record, context)
    value, exemplars = collect(reader)[("saved", (("otel_swa.tp_rank", 0),))]
    assert value == 37 * 256
    assert exemplars == [(span.get_span_context().span_id, span.get_span_context().trace_id)]
    sink(SwaDivergenceRecord(forward_ct=40, verify_full=1900, verify_swa=600, swa_full_idx_divergence=0,
                             swa_out_of_window_tokens=0), None)
    assert collect(reader)[("saved", (("otel_swa.tp_rank", 0),))][0] == 0
    with pytest.raises(ValueError, match=r"bytes_per_token=0; expected an integer >= 1"):
        reader.pools.savings_sink(0)


def test_pool_usage_refuses_inconsistent_figures():
    with pytest.raises(ValueError, match=r"PoolUsage.pool='mamba'; expected one of full, swa"):
        PoolUsage("mamba", 0, 0, 0, 0)
    with pytest.raises(ValueError, match=r"PoolUsage.used=-1 for pool 'full'; expected an integer >= 0"):
        PoolUsage("full", -1, 0, 0, 0)
    with pytest.raises(ValueError, match=r"available 8 \+ evictable 3 exceed total 10"):
        PoolUsage.from_free("swa", total=10, available=8, evictable=3)
    with pytest.raises(ValueError, match=r"used 5 \+ available 4 \+ evictable 2 exceed total 10"):
        PoolUsage("full", 5, 4, 2, 10)
    assert PoolUsage.from_free("full", total=10, available=4, evictable=2) == PoolUsage("full", 4, 4, 2, 10)
