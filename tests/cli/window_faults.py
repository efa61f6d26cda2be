"""Reference engines whose SWA window eviction is wrong on purpose: too early, or never.

Both stand in for ``otel_swa.reference.pools.HybridKVPools.evict_out_of_window`` (the reference
engine's counterpart of SGLang's ``free_swa_out_of_window_slots``):

* :func:`install_premature` evicts as if the window were ``2 * page_size`` tokens shorter (the
  sgl-project/sglang#29860 class: an off-by-some window bound frees SWA pages attention still
  reads). The pages freed are whole pages of a prefix, as the real eviction frees them, so the SWA
  pool's bookkeeping stays consistent (the slot audit stays clean) and only the window check sees
  it: at the next decode step (``seq_len`` one more) between ``page_size`` and ``2 * page_size -
  1`` of the oldest in-window positions of each request longer than the window have mapping 0.
* :func:`install_never_evict` frees nothing: every token keeps its SWA slot until its request
  finishes (late eviction; the SWA pool fills up as the FULL pool does).
"""

from __future__ import annotations

from otel_swa.reference import pools


def install_premature(monkeypatch) -> dict:
    """Make every eviction free ``2 * page_size`` positions too many (rounded down to pages);
    return the counts (``calls``: evictions made)."""
    real = pools.HybridKVPools.evict_out_of_window
    counts = {"calls": 0}

    def evict_out_of_window(self, reqs, window):
        counts["calls"] += 1
        return real(self, reqs, max(1, window - 2 * self.page_size))

    monkeypatch.setattr(pools.HybridKVPools, "evict_out_of_window", evict_out_of_window)
    return counts


def install_never_evict(monkeypatch) -> dict:
    """Make eviction free nothing; return the counts (``calls``: evictions skipped)."""
    counts = {"calls": 0}

    def evict_out_of_window(self, reqs, window):
        counts["calls"] += 1
        return 0

    monkeypatch.setattr(pools.HybridKVPools, "evict_out_of_window", evict_out_of_window)
    return counts
