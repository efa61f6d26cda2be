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
* :func:`install_chunk_tail_freed` stands in for ``ReferenceEngine._after_forward``'s eviction of
  a request still in chunked prefill: after each chunk it frees the request's whole SWA prefix,
  the chunk's tail included, as if a prompt's KV were not needed by its own next chunk (the
  sgl-project/sglang#8649 / #23982 class). The next chunk's first query, at ``seq_len``, reads
  ``seq_len - window + 1 .. seq_len``: those freed positions are premature evictions, invisible to
  a check that looks only at the last ``window`` positions when the chunk is at least that long.
"""

from __future__ import annotations

from otel_swa.reference import engine, pools


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


def install_chunk_tail_freed(monkeypatch) -> dict:
    """After every forward step, free the whole SWA prefix (whole pages) of each request still in
    chunked prefill; return the counts (``calls``: requests whose prefix was freed so)."""
    real = engine.ReferenceEngine._after_forward
    counts = {"calls": 0}

    def _after_forward(self, items, next_ids, full_read, swa_read):
        result = real(self, items, next_ids, full_read, swa_read)
        mid_prefill = [req.slots for req in self.scheduler.running if req.in_prefill and req.prefilled > 0]
        counts["calls"] += len(mid_prefill)
        self.pools.evict_out_of_window(mid_prefill, 0)
        return result

    monkeypatch.setattr(engine.ReferenceEngine, "_after_forward", _after_forward)
    return counts
