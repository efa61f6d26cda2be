"""The pool usage gauges against vLLM 0.33.0's real KV cache manager and Scheduler (marker ``vllm``).

Real: ``KVCacheManager`` with a ``FullAttentionSpec`` group and a ``SlidingWindowSpec`` group over
one ``BlockPool`` (prefix caching on), driven through chunked prefill, decode past the window,
prefix hits and frees; and the ``Scheduler`` under the ``swa_vllm`` instrumentor, exporting to an
in-memory reader. Expected values are plain recounts: the distinct real blocks of each group's
tables, the free blocks walked through vLLM's own free queue (``get_all_free_blocks``) with their
hash's group id unpacked as vLLM does (``kv_cache_utils.get_group_id``), and vLLM's own usage figure
(``KVCacheManager.usage``, what ``vllm:kv_cache_usage_perc`` reports).
"""

from __future__ import annotations

import pytest

from otel_swa.views import vllm as vllm_view
from test_vllm_real import ManagerDriver
from vllm_support import BLOCK, PREEMPTING_BLOCKS, hybrid_kv_cache_config, make_scheduler, sampled, trace_requests, vllm_classes  # noqa: F401

pytestmark = pytest.mark.vllm


def recount_pools(kv) -> dict:
    """``{pool: (used, available, evictable, total)}`` in tokens, by plain loops over the real objects."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    managers = kv.coordinator.single_type_managers
    kinds = {i: ("swa" if type(m).__name__ == "SlidingWindowManager" else "full") for i, m in enumerate(managers)}
    pool = kv.coordinator.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    uncached = sum(1 for b in free if b.block_hash is None)
    out = {}
    for group, manager in enumerate(managers):
        held = set()
        for blocks in manager.req_to_blocks.values():
            for block in blocks:
                if block.block_id != 0:
                    held.add(block.block_id)
        cached = sum(1 for b in free if b.block_hash is not None and kinds[get_group_id(b.block_hash)] == kinds[group])
        out[kinds[group]] = (len(held) * BLOCK, uncached * BLOCK, cached * BLOCK, (pool.num_gpu_blocks - 1) * BLOCK)
    return out


def test_pool_usage_equals_the_real_managers_accounting_at_every_step(vllm_classes):
    v = vllm_classes
    config = hybrid_kv_cache_config(v, num_blocks=120, block_size=BLOCK, window=64)
    kv = v.KVCacheManager(config, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=True)
    hasher = v.get_request_block_hasher(BLOCK, v.sha256)

    def request(rid, prompt):
        return v.Request(rid, prompt, v.SamplingParams(max_tokens=512), None, block_hasher=hasher)

    shared = [(i * 37 + 5) % 1000 + 3 for i in range(256)]
    a = request("A", shared + [7] * 40)
    b = request("B", [(i * 11 + 1) % 1000 + 3 for i in range(100)])
    c = request("C", shared + [9] * 30)  # a prefix hit on A's blocks (full and SWA groups)
    d = request("D", [(i * 29 + 7) % 1000 + 3 for i in range(300)])
    driver = ManagerDriver(v, kv, chunk=96)
    seen_evictable = seen_both = False
    for step in range(1, 51):
        if step == 1:
            driver.admit(a)
        if step == 2:
            driver.admit(b)
        if step == 12:
            driver.finish(a)  # A's full blocks go back to the free queue still cached: evictable
        if step == 14:
            driver.admit(c)
        if step == 20:
            driver.admit(d)
        if step == 35:
            driver.finish(b)
        driver.step()
        usages = {u.pool: u for u in vllm_view.kv_cache_pool_usage(kv)}
        expected = recount_pools(kv)
        assert {p: (u.used, u.available, u.evictable, u.total) for p, u in usages.items()} == expected, step
        # vLLM's own figure: blocks not free over all blocks but the null one
        assert sum(u.used for u in usages.values()) / usages["full"].total == pytest.approx(kv.usage), step
        free = kv.coordinator.block_pool.get_num_free_blocks() * BLOCK
        assert usages["full"].available + usages["full"].evictable + usages["swa"].evictable == free, step
        seen_evictable |= usages["full"].evictable > 0
        seen_both |= usages["full"].used > usages["swa"].used > 0
    assert seen_evictable and seen_both  # the run exercised the prefix cache and the window
    assert driver.hits["C"] >= 256 - BLOCK


def test_the_instrumentor_exports_the_pools_of_a_real_scheduler(vllm_classes, tmp_path, monkeypatch):
    """The ``swa_vllm`` instrumentor registers the real ``Scheduler``'s KV cache at its first
    ``schedule()``; collections between steps (chunked prefill, prefix hits, preemption) give the
    recount of that moment."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from opentelemetry.instrumentation.swa_vllm import SwaVllmInstrumentor

    v = vllm_classes
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "5")
    reader = InMemoryMetricReader()
    instrumentor = SwaVllmInstrumentor()
    instrumentor.instrument(meter_provider=MeterProvider(metric_readers=[reader]))
    try:
        scheduler = make_scheduler(v, tmp_path / "tiny-llama", num_blocks=PREEMPTING_BLOCKS)
        for r in trace_requests(v):
            scheduler.add_request(r)
        assert _pool_points(reader) == {}  # nothing registered before the first schedule()
        compared, seen_evictable, preempted = 0, False, set()
        for step in range(2000):
            if not scheduler.get_num_unfinished_requests():
                break
            output = scheduler.schedule()
            ids = list(output.num_scheduled_tokens)
            preempted |= set(output.preempted_req_ids or ())
            if step % 5 == 2:  # a collection between two steps
                points = _pool_points(reader)
                expected = recount_pools(scheduler.kv_cache_manager)
                assert {k: v_ for k, v_ in points.items() if k[0] != "utilization"} == {
                    (name, pool): value for pool, values in expected.items()
                    for name, value in zip(("used", "available", "evictable", "limit"), values)}, step
                assert points[("utilization", "full")] + points[("utilization", "swa")] == pytest.approx(
                    scheduler.kv_cache_manager.usage)
                seen_evictable |= points[("evictable", "full")] > 0
                compared += 1
            sampled_ids = [[sampled(scheduler.requests[rid])]
                           if scheduler.requests[rid].num_computed_tokens >= scheduler.requests[rid].num_tokens
                           else [] for rid in ids]
            scheduler.update_from_output(output, v.ModelRunnerOutput(
                req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled_ids))
        assert scheduler.get_num_unfinished_requests() == 0
        assert compared >= 5 and seen_evictable and preempted
        # all finished: nothing used, every block free, the cached ones evictable
        points = _pool_points(reader)
        assert points[("used", "full")] == points[("used", "swa")] == 0
        assert points[("available", "full")] + points[("evictable", "full")] + points[("evictable", "swa")] == (
            points[("limit", "full")])
    finally:
        instrumentor.uninstrument()


def _pool_points(reader) -> dict:
    """``{(figure, pool): value}`` of the ``kv_cache.pool.`` gauges in one collection."""
    names = {"kv_cache.pool.tokens.used": "used", "kv_cache.pool.tokens.available": "available",
             "kv_cache.pool.tokens.evictable": "evictable", "kv_cache.pool.tokens.limit": "limit",
             "kv_cache.pool.utilization": "utilization"}
    points = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name in names:
                    for point in metric.data.data_points:
                        points[(names[metric.name], point.attributes["pool"])] = point.value
    return points
