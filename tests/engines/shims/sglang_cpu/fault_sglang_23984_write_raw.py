"""sgl-project/sglang#23984 class (a sliding-window layer's new K/V written with FULL-pool write
indices: ``out_cache_loc`` not translated to the SWA pool; the write-side twin of sglang 0.5.23's
torch-native SWA read, the class of #20181): one new token's sliding-window K/V stored at its raw
FULL index instead of its SWA slot.

Stands in for the translation SGLang's backends do once per forward
(``swa_out_cache_loc = full_to_swa_index_mapping[out_cache_loc]``, passed to
``SWAKVPool.set_kv_buffer`` as ``KVWriteLoc.swa_loc``, sglang 0.5.23
``srt/mem_cache/swa_memory_pool.py``): at one decode step from ``at_step`` on, every sliding-window
layer stores the new token of the batch's request closest to finishing at SWA slot ``out_cache_loc``
(its FULL slot number) instead. The SWA slot the mapping names keeps what it held before; whatever
token owns SWA slot ``out_cache_loc`` has its K/V overwritten. The FULL layers and every table stay
right. Needs an SWA pool at least as large as the FULL slot number (``swa_full_tokens_ratio=1.0``);
a victim whose FULL slot is past the SWA pool is not picked.
"""

from __future__ import annotations

import dataclasses

import sglang_cpu_patches
import sglang_faults
import sglang_step_probe

NAME = "write_raw"
_ARMED: dict = {}


def _patch_pool(module) -> None:
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    pool_class = module.SWAKVPool
    original = pool_class.set_kv_buffer

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, *args, **kwargs):
        index = _ARMED.get("index")
        if (index is not None and self.layers_mapping[layer.layer_id][1] and isinstance(loc_info, KVWriteLoc)
                and loc_info.swa_loc is not None):
            swa_loc = loc_info.swa_loc.clone()
            swa_loc[index] = loc_info.loc[index]
            loc_info = dataclasses.replace(loc_info, swa_loc=swa_loc)
            _ARMED.setdefault("layers", []).append(int(layer.layer_id))
        return original(self, layer, loc_info, cache_k, cache_v, *args, **kwargs)

    set_kv_buffer.__wrapped__ = original
    pool_class.set_kv_buffer = set_kv_buffer


def install(at_step: int, gate, order: int) -> None:
    sglang_cpu_patches.add_patch("sglang.srt.mem_cache.swa_memory_pool", _patch_pool)
    state: dict = {}

    def arm(runner, forward_batch, step) -> None:
        if not gate.ready(step, at_step, order) or not forward_batch.forward_mode.is_decode():
            return
        batch = sglang_step_probe.current_batch()
        if batch is None or forward_batch.batch_size != len(batch.reqs):
            return
        allocator = runner.token_to_kv_pool_allocator
        swa_rows = int(runner.token_to_kv_pool.swa_kv_pool.k_buffer[0].shape[0])
        for i in sglang_faults.closest_to_finishing(batch, len(batch.reqs)):
            full = int(forward_batch.out_cache_loc[i])
            swa = int(allocator.full_to_swa_index_mapping[full])
            if full < swa_rows and swa not in (0, full):
                break
        else:
            return
        owners = (allocator.full_to_swa_index_mapping == full).nonzero().flatten().tolist()
        _ARMED.update(index=i, layers=[])
        rid = batch.reqs[i].rid
        gate.made(step, [rid])
        state.update(step=step, requests=[rid], row=int(forward_batch.req_pool_indices[i]),
                     position=int(forward_batch.seq_lens[i]) - 1, full_slot=full, swa_slot=swa,
                     overwritten_swa_slot=full, overwritten_swa_slot_full_slots=owners)

    def disarm(runner, forward_batch, step, line) -> None:
        if _ARMED.get("index") is None:
            return
        layers = _ARMED.get("layers", [])
        _ARMED.clear()
        sglang_faults.record(NAME, state.pop("step"), layers=layers, **state)
        state.clear()

    sglang_step_probe.before_forward(arm)
    sglang_step_probe.after_forward(disarm)
