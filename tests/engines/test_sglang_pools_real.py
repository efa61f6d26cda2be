"""The pool usage reader against SGLang's real allocator and SGLang's own pool statistics (sglang 0.5.23).

Real: ``SWAKVPool``, ``SWATokenToKVPoolAllocator`` and ``ReqToTokenPool``, driven by
``_sglang_sim.SglangSim`` (admissions, decodes, window eviction, finishes), and SGLang's own
``SchedulerPoolStatsObserver.get_pool_stats()`` (what its Prometheus pool gauges report) as the
expected value at every step. Stand-in: the tree cache (:class:`PrefixCacheCounters`), since the
simulation has no radix tree; the real radix cache is covered by the engine suite
(``test_sglang_engine.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from otel_swa.views import sglang as adapter

pytestmark = pytest.mark.sglang


class PrefixCacheCounters:
    """Stands in for the size counters of SGLang's ``UnifiedRadixCache`` (``full_evictable_size``,
    ``swa_evictable_size``, ``evictable_size``: slots only the prefix cache holds): the test sets
    them to a share of the slots in use, as a radix tree holding finished requests' prefixes would."""

    def __init__(self) -> None:
        self.full = self.swa = 0

    def full_evictable_size(self) -> int:
        return self.full

    def swa_evictable_size(self) -> int:
        return self.swa

    def evictable_size(self) -> int:
        return self.full


def _scheduler(sim, tree, *, hybrid: bool = True) -> SimpleNamespace:
    """The attributes of SGLang's ``Scheduler`` the reader takes (names of sglang 0.5.23)."""
    return SimpleNamespace(
        token_to_kv_pool_allocator=sim.allocator, tree_cache=tree, is_hybrid_swa=hybrid, is_hybrid_ssm=False,
        enable_hisparse=False, full_tokens_per_layer=sim.size, swa_tokens_per_layer=sim.size_swa,
        max_total_num_tokens=sim.size, kv_shard_widening=1,
    )


def _sglang_stats(scheduler):
    from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver

    observer = SchedulerPoolStatsObserver(
        tree_cache=scheduler.tree_cache, token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator,
        req_to_token_pool=None, session_controller=None, hisparse_coordinator=None,
        is_hybrid_swa=scheduler.is_hybrid_swa, is_hybrid_ssm=False, enable_hisparse=False,
        full_tokens_per_layer=scheduler.full_tokens_per_layer, swa_tokens_per_layer=scheduler.swa_tokens_per_layer,
        max_total_num_tokens=scheduler.max_total_num_tokens,
    )
    return observer.get_pool_stats()


@pytest.mark.parametrize("page_size", [1, 4])
def test_pools_equal_sglangs_own_pool_stats_at_every_step(sglang_modules, page_size):
    sim = sglang_modules.SglangSim(page_size=page_size, window=16, seed=3 + page_size)
    tree = PrefixCacheCounters()
    scheduler = _scheduler(sim, tree)
    seen = set()
    for step in range(300):
        sim.step()
        # a third of the slots in use count as held only by the prefix cache (whole pages)
        full_used = sim.size - sim.allocator.full_available_size()
        swa_used = sim.size_swa - sim.allocator.swa_available_size()
        tree.full = full_used // 3 // page_size * page_size
        tree.swa = swa_used // 3 // page_size * page_size
        full, swa = adapter.scheduler_pool_usage(scheduler)
        stats = _sglang_stats(scheduler)
        assert (full.used, full.available, full.evictable, full.total) == (
            stats.full_num_used, stats.full_available_size, stats.full_evictable_size, stats.full_capacity), step
        assert (swa.used, swa.available, swa.evictable, swa.total) == (
            stats.swa_num_used, stats.swa_available_size, stats.swa_evictable_size, stats.swa_capacity), step
        assert full.usage == pytest.approx(stats.full_token_usage) and swa.usage == pytest.approx(stats.swa_token_usage)
        # and SGLang's Prometheus figures, as its metrics collector sets them
        figures = SimpleNamespace()
        stats.update_scheduler_stats(figures)
        assert (figures.kv_used_tokens, figures.swa_available_tokens, figures.swa_evictable_tokens) == (
            full.used, swa.available, swa.evictable)
        assert figures.token_usage == round(max(full.usage, swa.usage), 2)
        seen.add((full.used > swa.used, tree.swa > 0))
    assert (True, True) in seen  # the window kept the SWA pool below the FULL pool, with evictable slots


def test_a_pool_that_is_not_hybrid_is_one_full_pool(sglang_modules):
    sim = sglang_modules.SglangSim(page_size=1, window=16, seed=5)
    for _ in range(40):
        sim.step()
    tree = PrefixCacheCounters()
    tree.full = 7
    scheduler = _scheduler(sim, tree, hybrid=False)
    scheduler.token_to_kv_pool_allocator = sim.allocator.full_attn_allocator  # a plain token allocator
    (full,) = adapter.scheduler_pool_usage(scheduler)
    stats = _sglang_stats(scheduler)
    assert (full.pool, full.used, full.available, full.evictable, full.total) == (
        "full", stats.full_num_used, stats.full_available_size, stats.full_evictable_size, stats.full_capacity)
    assert adapter.scheduler_pool_usage(SimpleNamespace(**{**vars(scheduler), "is_hybrid_ssm": True})) is None


def test_swa_bytes_per_token_is_what_the_swa_pool_allocated(sglang_modules):
    sim = sglang_modules.SglangSim(page_size=1, window=16)
    swa = sim.kv_pool.swa_kv_pool
    # one SWA layer, 1 head of dim 4, float16, K and V: 1 x 1 x (4 + 4) x 2 bytes
    assert adapter.swa_kv_bytes_per_token(sim.kv_pool) == 16
    per_slot = sum(t[0].numel() * t.element_size() for t in list(swa.k_buffer) + list(swa.v_buffer))
    assert per_slot == 16
    assert adapter.swa_kv_bytes_per_token(swa) is None  # a pool without an SWA part
    assert adapter.swa_kv_bytes_per_token(None) is None


def test_a_scheduler_without_sglangs_attributes_is_a_type_error(sglang_modules):
    with pytest.raises(TypeError, match="scheduler SimpleNamespace has no attribute 'token_to_kv_pool_allocator'"):
        adapter.scheduler_pool_usage(SimpleNamespace())
