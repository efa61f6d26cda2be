"""sgl-project/sglang#27586 / #31486 class (a stale mapping frees a live slot; re-cached window KV read
stale, freed twice): a live request's in-window SWA page freed while its tokens still map into it,
then handed out again.

Stands in for a wrong free on the SWA side: after forward step ``N`` the page holding the
second-to-last token of the batch's first request (inside its window) is given back to the SWA
sub-allocator (``_release_page_ids``, sglang 0.5.23 ``srt/mem_cache/allocator/paged.py``) without
clearing ``full_to_swa_index_mapping``. The paged allocator hands freed pages out first, so the
next allocation gives it to another token: two FULL slots then map into one SWA page, and the
request reads another token's KV through its own mapping. Page size > 1.
"""

from __future__ import annotations

import torch

import sglang_faults


def install(at_step: int) -> None:
    import sglang_step_probe

    state = {"done": False}

    def inject(runner, forward_batch, step, line) -> None:
        if state["done"] or step < at_step or forward_batch.req_pool_indices is None:
            return
        allocator = runner.token_to_kv_pool_allocator
        rows, lengths = forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist()
        for row, length in zip(rows, lengths):
            if length < 2:
                continue
            full = int(runner.req_to_token_pool.req_to_token[row, length - 2])
            swa = int(allocator.full_to_swa_index_mapping[full])
            if swa > 0:
                page = swa // allocator.page_size
                allocator.swa_attn_allocator._release_page_ids(torch.tensor([page], dtype=torch.int64))
                state["done"] = True
                sglang_faults.record("freed_while_mapped", step, row=row, position=length - 2, full_slot=full,
                                     swa_slot=swa, page=page)
                return

    sglang_step_probe.after_forward(inject)
