"""sgl-project/sglang#29860 / #34870 class (an all-tombstone leaf leaks; "pool memory leak detected"
on every rank): one SWA page of an evicted or finished request never returned.

Stands in for the SWA sub-allocator's release of freed pages (``PagedTokenToKVPoolAllocator
._release_page_ids``, sglang 0.5.23 ``srt/mem_cache/allocator/paged.py``, which every SWA free of a
paged pool ends in): the first release after step ``N`` drops its first page. The page's mapping
was cleared by the caller, so it is neither free nor mapped by any token: leaked. Page size > 1.
"""

from __future__ import annotations

import sglang_faults
import sglang_step_probe


def install(at_step: int) -> None:
    state = {"done": False, "wrapped": False}

    def arm(runner, forward_batch, step, line) -> None:
        if state["wrapped"]:
            return
        state["wrapped"] = True
        swa = runner.token_to_kv_pool_allocator.swa_attn_allocator
        release = swa._release_page_ids

        def _release_page_ids(*page_ids):
            step_now = sglang_step_probe.current_step()
            if not state["done"] and step_now >= at_step and page_ids and page_ids[0].numel() > 0:
                state["done"] = True
                dropped = int(page_ids[0][0])
                sglang_faults.record("leak_on_free", step_now + 1, page=dropped)
                page_ids = (page_ids[0][1:],) + tuple(page_ids[1:])
            return release(*page_ids)

        swa._release_page_ids = _release_page_ids

    sglang_step_probe.after_forward(arm)
