"""sgl-project/sglang#25889 class (a cached full-to-SWA write location kept after the mapping was
rebuilt: KV written at stale locations): one new token's K/V written into another request's live
slot.

Stands in for a stale write location: at one decode step from ``at_step`` on, the write location
(``ForwardBatch.out_cache_loc``, sglang 0.5.23 ``srt/model_executor/forward_batch_info.py``) of the
new token of the batch's request closest to finishing is the FULL slot of the previous token of
the next request closest to finishing (inside its sliding window, so its SWA slot is overwritten
too). The token's own slot, which ``req_to_token`` names, is not written at that step; the other
request's token now holds this token's K/V in every layer.
"""

from __future__ import annotations

import sglang_faults
import sglang_step_probe

NAME = "stale_write_loc"


def install(at_step: int, gate, order: int) -> None:
    def redirect(forward_batch, step) -> None:
        pair = sglang_faults.decode_pair(forward_batch, step, gate, at_step, order)
        if pair is None:
            return
        batch, picked = pair
        writer, owner = picked
        owner_row = int(forward_batch.req_pool_indices[owner])
        owner_position = int(forward_batch.seq_lens[owner]) - 2
        if owner_position < 0:
            return
        req_to_token = batch.req_to_token_pool.req_to_token
        victim_slot = int(req_to_token[owner_row, owner_position])
        out_cache_loc = forward_batch.out_cache_loc.clone()
        own_slot = int(out_cache_loc[writer])
        out_cache_loc[writer] = victim_slot
        forward_batch.out_cache_loc = out_cache_loc
        rids = [batch.reqs[writer].rid, batch.reqs[owner].rid]
        gate.made(step, rids)
        sglang_faults.record(NAME, step, requests=rids, row=int(forward_batch.req_pool_indices[writer]),
                             position=int(forward_batch.seq_lens[writer]) - 1, full_slot=own_slot,
                             written_slot=victim_slot, other_row=owner_row, other_position=owner_position)

    sglang_step_probe.on_forward_batch(redirect)
