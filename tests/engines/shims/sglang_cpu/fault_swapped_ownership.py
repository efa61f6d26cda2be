"""Swapped ownership (the mapping half of sgl-project/sglang#27586 and #25889: a full-to-SWA mapping
entry naming another token's SWA slot), made without a free so that every count stays right: two
requests' new tokens' SWA mapping entries exchanged after their KV was written.

Stands in for a wrong update of ``SWATokenToKVPoolAllocator.full_to_swa_index_mapping`` (sglang
0.5.23 ``srt/mem_cache/allocator/swa.py``): after forward step ``N`` (from ``at_step`` on, a decode
step with at least two requests), the entries of the new tokens of the two requests closest to
finishing are exchanged. Both SWA slots stay live and mapped once, the allocator's counts and free
lists stay right, and the divergence counts do not move; each token now reads the other request's
K/V in every sliding-window layer until it leaves the window.
"""

from __future__ import annotations

import sglang_faults
import sglang_step_probe

NAME = "swapped_ownership"


def install(at_step: int, gate, order: int) -> None:
    def swap(runner, forward_batch, step, line) -> None:
        pair = sglang_faults.decode_pair(forward_batch, step, gate, at_step, order)
        if pair is None:
            return
        batch, picked = pair
        mapping = runner.token_to_kv_pool_allocator.full_to_swa_index_mapping
        full = [int(forward_batch.out_cache_loc[i]) for i in picked]
        swa = [int(mapping[f]) for f in full]
        if 0 in swa or swa[0] == swa[1]:
            return
        mapping[full[0]], mapping[full[1]] = swa[1], swa[0]
        rids = [batch.reqs[i].rid for i in picked]
        gate.made(step, rids)
        sglang_faults.record(NAME, step, requests=rids, rows=[int(forward_batch.req_pool_indices[i]) for i in picked],
                             positions=[int(forward_batch.seq_lens[i]) - 1 for i in picked], full_slots=full,
                             swa_slots=swa)

    sglang_step_probe.after_forward(swap)
