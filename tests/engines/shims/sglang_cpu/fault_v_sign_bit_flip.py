"""One bit flipped in a live V row past its first 64 bytes (issue 32's report, made the same way
inside the real sglang Engine: the sign of the last element of a live V row flipped changed 2 of 20
outputs while ``check`` passed with the checksum over each row's first 64 bytes; SGLang's KV canary
hashes the first bytes of ``k_buffer[0]`` of each sub-pool, ``srt/kv_canary/config.py``, and its
``real_kv_*`` self-tests flip byte 0 of a K row, ``srt/kv_canary/perturb/utils.py``).

Stands in for a single-bit memory or transfer error anywhere in a row: at one decode step from
``at_step`` on, before the forward, the sign bit of the last element of the V row of the FULL
pool's last layer (the model's last attention layer, the engine suite's only full-attention one) at
the slot of the previous position of the batch's request closest to finishing is flipped (its last
byte xor 0x80: little-endian floats keep the sign in the last byte; byte 127 of a float32 row of
the engine suite's model, byte 63 of a bf16 one). Undone before SGLang processes the step's results
(after the step's sample).
"""

from __future__ import annotations

import torch

import sglang_faults
import sglang_step_probe

NAME = "v_sign_bit_flip"


def install(at_step: int, gate, order: int) -> None:
    undo: list = []

    def corrupt(runner, forward_batch, step) -> None:
        pool = runner.token_to_kv_pool
        layer, index = sglang_faults.last_layer(pool, swa=False)
        picked = sglang_faults.decode_pair(forward_batch, step, gate, at_step, order)
        if picked is None:
            return
        batch, (victim, _) = picked
        position = int(forward_batch.seq_lens[victim]) - 2
        if position < 0:
            return
        row_index = int(forward_batch.req_pool_indices[victim])
        full = int(runner.req_to_token_pool.req_to_token[row_index, position])
        row = pool.full_kv_pool.v_buffer[index][full].view(-1).view(torch.uint8)
        row[-1] ^= 0x80  # past the first 64 bytes where the row is longer (float32 here: 128 bytes)
        undo.append(row)
        rid = batch.reqs[victim].rid
        gate.made(step, [rid])
        sglang_faults.record(NAME, step, requests=[rid], row=row_index, position=position, full_slot=full,
                             byte=int(row.shape[0]) - 1, layer=int(layer), pool="full")

    def restore(scheduler, batch, step) -> None:
        while undo:
            undo.pop()[-1] ^= 0x80

    sglang_step_probe.before_forward(corrupt)
    sglang_step_probe.before_result(restore)
