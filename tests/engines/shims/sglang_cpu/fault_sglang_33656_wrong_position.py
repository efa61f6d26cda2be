"""sgl-project/sglang#33656 class (DeepSeek-V4 + hierarchical cache: SWA KV written with the wrong
position, found by SGLang's KV canary as ``write_position`` and by nothing else): one new token's
KV computed and stored for a position it does not have.

Stands in for a wrong position in the forward batch (sglang 0.5.23 computes ``positions`` in
``ForwardBatch.init_new``, ``srt/model_executor/forward_batch_info.py``, from the scheduler's
lengths): at one decode step from ``at_step`` on, the position of the new token of the batch's
request closest to finishing is one too far. The model applies rotary embedding at that position,
and the K/V stored at the token's own slot are those of another position; the tables are right.
"""

from __future__ import annotations

import sglang_faults
import sglang_step_probe

NAME = "wrong_position"
SHIFT = 1


def install(at_step: int, gate, order: int) -> None:
    def corrupt(forward_batch, step) -> None:
        if not gate.ready(step, at_step, order) or not forward_batch.forward_mode.is_decode():
            return
        batch = sglang_step_probe.current_batch()
        picked = sglang_faults.closest_to_finishing(batch)
        if not picked or forward_batch.batch_size != len(batch.reqs):
            return
        i = picked[0]
        positions = forward_batch.positions.clone()
        position = int(positions[i])
        positions[i] = position + SHIFT
        forward_batch.positions = positions
        rid = batch.reqs[i].rid
        gate.made(step, [rid])
        sglang_faults.record(NAME, step, requests=[rid], row=int(forward_batch.req_pool_indices[i]),
                             position=position, written_position=position + SHIFT,
                             full_slot=int(forward_batch.out_cache_loc[i]))

    sglang_step_probe.on_forward_batch(corrupt)
