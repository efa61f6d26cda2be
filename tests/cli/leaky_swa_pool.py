"""A reference engine whose SWA pool loses one page in every ``every`` it frees by window eviction.

Stands in for the SWA allocator bugs that leak pages (SGLang #27789, #36081: SWA slots freed from
the mapping but never returned to the free list). It wraps the real
``otel_swa.reference.pools.HybridKVPools.evict_out_of_window``: the eviction runs as usual (the
mapping of the evicted tokens is cleared), then every ``every``-th page put back on the SWA free
list is taken off it again, so it stays "in use" with no live token mapping into it: a leaked
page, and nothing else changes.
"""

from __future__ import annotations

from otel_swa.reference import pools


def install(monkeypatch, every: int = 1000) -> dict:
    """Make the reference engine leak one SWA page in ``every`` evicted ones; return the counts
    (``freed``: pages the eviction freed, ``leaked``: pages taken back off the free list)."""
    real = pools.HybridKVPools.evict_out_of_window
    counts = {"freed": 0, "leaked": 0}

    def evict_out_of_window(self, reqs, window):
        before = len(self._swa_free)
        slots = real(self, reqs, window)
        for _ in range(len(self._swa_free) - before):
            counts["freed"] += 1
            if counts["freed"] % every == 0:
                # page size 1 appends freed pages, larger pages go first (see HybridKVPools._release)
                self._swa_free.pop() if self.page_size == 1 else self._swa_free.popleft()
                counts["leaked"] += 1
        return slots

    monkeypatch.setattr(pools.HybridKVPools, "evict_out_of_window", evict_out_of_window)
    return counts
