"""A stray write into one deep layer's KV (issue 32's report, made the same way inside the real
sglang Engine: another request's fresh K/V copied over a live in-window slot of the LAST
sliding-window layer only changed 5 of 20 outputs while every check passed; a checksum of one
designated layer per pool, like SGLang's KV canary hashing ``k_buffer[0]`` / ``v_buffer[0]`` of each
sub-pool, ``srt/kv_canary/pool_patcher/adapters/swa.py``, never reads a deeper layer).

Stands in for any kernel that writes one layer's K/V buffer at a wrong row (a bad index in a fused
store of one layer, a misrouted copy): at one decode step from ``at_step`` on, before the forward,
the K and V rows of the last sliding-window layer (``SWAKVPool.layers_mapping``, sglang 0.5.23
``srt/mem_cache/swa_memory_pool.py``) at the SWA slot of the previous position of the batch's
request closest to finishing are overwritten with those of the next request closest to finishing
(its previous position: live, written one step before). Every other layer and every table stay
right. Undone before SGLang processes the step's results (after the step's sample), so the next
fault starts from a clean engine.
"""

from __future__ import annotations

import sglang_faults
import sglang_step_probe

NAME = "deep_layer_write"


def install(at_step: int, gate, order: int) -> None:
    undo: list = []

    def corrupt(runner, forward_batch, step) -> None:
        picked = sglang_faults.decode_pair(forward_batch, step, gate, at_step, order)
        if picked is None:
            return
        batch, (victim, source) = picked
        pool = runner.token_to_kv_pool
        layer, index = sglang_faults.last_layer(pool, swa=True)
        mapping = runner.token_to_kv_pool_allocator.full_to_swa_index_mapping
        req_to_token = runner.req_to_token_pool.req_to_token
        slots = []
        for entry in (victim, source):
            position = int(forward_batch.seq_lens[entry]) - 2
            full = int(req_to_token[int(forward_batch.req_pool_indices[entry]), position])
            slots.append((position, full, int(mapping[full])))
        (position, full, swa), (_, _, swa_source) = slots
        if position < 0 or swa == 0 or swa_source in (0, swa):
            return
        k, v = pool.swa_kv_pool.k_buffer[index], pool.swa_kv_pool.v_buffer[index]
        undo.append((k, v, swa, k[swa].clone(), v[swa].clone()))
        k[swa], v[swa] = k[swa_source], v[swa_source]
        rid = batch.reqs[victim].rid
        gate.made(step, [rid])
        sglang_faults.record(NAME, step, requests=[rid], row=int(forward_batch.req_pool_indices[victim]),
                             position=position, full_slot=full, swa_slot=swa, source_swa_slot=swa_source,
                             layer=int(layer), pool="swa")

    def restore(scheduler, batch, step) -> None:
        while undo:
            k, v, slot, k_row, v_row = undo.pop()
            k[slot], v[slot] = k_row, v_row

    sglang_step_probe.before_forward(corrupt)
    sglang_step_probe.before_result(restore)
