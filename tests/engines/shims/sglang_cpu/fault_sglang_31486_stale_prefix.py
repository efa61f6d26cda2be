"""sgl-project/sglang#31486 class (the radix cache re-caches window-evicted KV: a later prefix hit
reads SWA slots the allocator has already handed to other requests, and frees them twice): at a
prefix-cache hit, a window-evicted SWA slot put back into the mapping of a matched token.

Stands in for the SWA value the prefix cache returns for a matched token (sglang 0.5.23:
``UnifiedRadixCache.match_prefix`` hands back FULL slots, and the SWA slot of each is
``SWATokenToKVPoolAllocator.full_to_swa_index_mapping[full_slot]``): the probe remembers the SWA
slot each FULL slot held before SGLang's window eviction cleared it (``free_swa_out_of_window_slots``
sets the entry to 0 and frees the slot, which the allocator hands out again). At the first extend
step from ``at_step`` on in which a request's prefix was matched, the mapping entry of the last
matched token (inside the window of the request's first new token) is set to such an evicted SWA
slot that now belongs to another token: its own old slot when it has one, else the most recently
evicted one. The request then reads another token's K/V there; its own SWA slot is no longer
mapped (a leak) and the evicted one is mapped twice (freed twice later), as in #31486.
"""

from __future__ import annotations

import sglang_faults
import sglang_step_probe

NAME = "stale_prefix"


def install(at_step: int, gate, order: int) -> None:
    state: dict = {"before": None, "evicted": {}}

    def remember_and_corrupt(runner, forward_batch, step) -> None:
        mapping = runner.token_to_kv_pool_allocator.full_to_swa_index_mapping
        before = state["before"]
        if before is not None and before.shape == mapping.shape:
            cleared = ((before != 0) & (mapping == 0)).nonzero().flatten().tolist()
            for full in cleared:  # in slot order; the newest eviction wins below by step
                state["evicted"][full] = (int(before[full]), step)
        state["before"] = mapping.clone()
        if not gate.ready(step, at_step, order, aligned=False) or not forward_batch.forward_mode.is_extend():
            return
        batch = sglang_step_probe.current_batch()
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        if batch is None or prefix_lens is None or len(prefix_lens) != len(batch.reqs):
            return
        hits = [i for i, n in enumerate(prefix_lens) if int(n) >= 1]
        if not hits:
            return
        i = min(hits, key=lambda j: int(batch.reqs[j].sampling_params.max_new_tokens))
        row, position = int(forward_batch.req_pool_indices[i]), int(prefix_lens[i]) - 1
        full = int(batch.req_to_token_pool.req_to_token[row, position])
        current = int(mapping[full])
        if current == 0:
            return
        reused = [(s, at) for f, (s, at) in state["evicted"].items()
                  if s != current and bool((mapping == s).any())]
        own = state["evicted"].get(full)
        if own is not None and own[0] != current and bool((mapping == own[0]).any()):
            stale = own[0]
        elif reused:
            stale = max(reused, key=lambda item: item[1])[0]
        else:
            return
        owners = (mapping == stale).nonzero().flatten().tolist()
        mapping[full] = stale
        state["before"][full] = stale
        rid = batch.reqs[i].rid
        gate.made(step, [rid])
        sglang_faults.record(NAME, step, requests=[rid], row=row, position=position, prefix_len=int(prefix_lens[i]),
                             full_slot=full, swa_slot=current, stale_swa_slot=stale, stale_swa_slot_full_slots=owners)

    sglang_step_probe.before_forward(remember_and_corrupt)
