"""The reference engine's pools as pool usage gauges, and what its window saves.

Expected values are recounts from the engine's own request state (the pages each open request
holds) and hand-computed byte sizes, never the gauges' own source read back."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from opentelemetry.instrumentation.swa_reference import SwaReferenceInstrumentor
from otel_swa.record import SwaDivergenceRecord
from otel_swa.reference.config import EngineConfig
from otel_swa.reference.engine import ReferenceEngine
from otel_swa.reference.pools import HybridKVPools
from otel_swa.reference.trace import TraceRequest, load_trace

CONFIG = EngineConfig(window=16, full_pool_size=2048, swa_pool_size=256, page_size=4, max_running=6,
                      token_budget=96, max_context_len=1024, num_heads=2, head_dim=8, step_time_s=0.0)


def gauges(reader) -> dict:
    points = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    if hasattr(point, "value"):  # gauges and sums (not the delay histogram)
                        points[(metric.name, point.attributes.get("pool"))] = point.value
    return points


def recount(engine) -> dict:
    """Slots held per pool, from the pages each open request holds (a 0 SWA page was freed)."""
    ps = engine.config.page_size
    full = sum(len(req.full_pages) for req in engine.pools.requests.values()) * ps
    swa = sum(1 for req in engine.pools.requests.values() for page in req.swa_pages if page) * ps
    return {"full": full, "swa": swa}


@pytest.fixture
def instrumented(monkeypatch):
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "4")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    records: list[SwaDivergenceRecord] = []
    instrumentor = SwaReferenceInstrumentor()
    instrumentor.instrument(meter_provider=provider)
    yield reader, records
    instrumentor.uninstrument()
    provider.shutdown()


def test_the_gauges_equal_the_pages_requests_hold_at_every_step(instrumented):
    reader, records = instrumented
    engine = ReferenceEngine(CONFIG)
    engine.reporter.add_sink(lambda record, context: records.append(record))
    for request in load_trace("conv", limit=12):
        engine.submit(TraceRequest(0.0, request.context_tokens // 8, request.generated_tokens // 4), arrival_s=0.0)
    steps = peak_full = 0
    while engine.step() is not None:
        steps += 1
        points = gauges(reader)
        held = recount(engine)
        for pool, size in (("full", 2048), ("swa", 256)):
            assert points[("kv_cache.pool.tokens.used", pool)] == held[pool], (steps, pool)
            assert points[("kv_cache.pool.tokens.available", pool)] == size - held[pool]
            assert points[("kv_cache.pool.tokens.evictable", pool)] == 0  # no prefix cache
            assert points[("kv_cache.pool.tokens.limit", pool)] == size
            assert points[("kv_cache.pool.utilization", pool)] == held[pool] / size
        assert points[("kv_cache.pool.tokens.available", "full")] == len(engine.free_full_slots())
        peak_full = max(peak_full, held["full"])
        if records:
            # 2 heads x 8 dims x float32 (4 bytes), K and V, one SWA layer: 128 bytes per token
            assert points[("kv_cache.swa.memory.saved", None)] == records[-1].swa_out_of_window_tokens * 128
    assert peak_full > 0 and max(r.swa_out_of_window_tokens for r in records) > 0
    points = gauges(reader)
    assert points[("kv_cache.pool.tokens.used", "full")] == points[("kv_cache.pool.tokens.used", "swa")] == 0


def test_an_engine_without_the_model_has_pool_gauges_but_no_savings(instrumented):
    reader, _ = instrumented
    engine = ReferenceEngine(EngineConfig(window=16, full_pool_size=512, swa_pool_size=64, max_running=4,
                                          token_budget=64, max_context_len=256, run_model=False))
    engine.submit(TraceRequest(0.0, 100, 20), arrival_s=0.0)
    for _ in range(6):
        engine.step()
    names = {name for name, _ in gauges(reader)}
    assert "kv_cache.pool.tokens.used" in names and "kv_cache.swa.memory.saved" not in names


def test_pool_usage_of_fresh_and_filled_pools():
    pools = HybridKVPools(full_size=64, swa_size=32, page_size=4, max_running=2, max_context_len=64)
    full, swa = pools.usage()
    assert (full.pool, full.used, full.available, full.evictable, full.total) == ("full", 0, 64, 0, 64)
    assert (swa.used, swa.available, swa.total) == (0, 32, 32)
    req = pools.open_request()
    pools.extend([(req, 10)])  # 3 pages in each pool
    pools.evict_out_of_window([req], window=4)  # positions < 6 leave: 1 whole SWA page freed
    full, swa = pools.usage()
    assert (full.used, full.available) == (12, 52)
    assert (swa.used, swa.available) == (8, 24)
