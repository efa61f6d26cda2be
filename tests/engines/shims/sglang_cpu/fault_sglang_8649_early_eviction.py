"""sgl-project/sglang#8649 class (the chunk cache evicts in-window tokens): the SWA eviction bound one
page early.

Stands in for sglang 0.5.23's ``free_swa_out_of_window_slots`` (``srt/mem_cache/common.py``; the
unified radix cache's SWA component imports it by name): from step ``N`` on it is called with
``sliding_window_size - page_size``, so each eviction also frees the oldest page the next query
still reads. The allocator's bookkeeping stays consistent (the freed pages are unmapped and on the
free list): only a check of the window itself sees it. Needs evictions at every step
(``SGLANG_SWA_EVICTION_INTERVAL=1``) and no radix cache retain floor (``disable_radix_cache``).
"""

from __future__ import annotations

import sglang_cpu_patches
import sglang_faults
import sglang_step_probe

_MODULES = ("sglang.srt.mem_cache.common", "sglang.srt.mem_cache.unified_cache.components.swa")


def install(at_step: int) -> None:
    state = {"recorded": False}

    def patch(module) -> None:
        original = module.free_swa_out_of_window_slots

        def free_swa_out_of_window_slots(req, pre_len, *args, sliding_window_size, page_size, **kwargs):
            step = sglang_step_probe.current_step()
            if step >= at_step:
                sliding_window_size = max(0, sliding_window_size - page_size)
                if not state["recorded"]:
                    state["recorded"] = True
                    sglang_faults.record("early_eviction", step + 1)  # the eviction before forward step + 1
            return original(req, pre_len, *args, sliding_window_size=sliding_window_size, page_size=page_size,
                            **kwargs)

        module.free_swa_out_of_window_slots = free_swa_out_of_window_slots

    for name in _MODULES:
        sglang_cpu_patches.add_patch(name, patch)
