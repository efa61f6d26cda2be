"""Faults made on purpose inside the real vLLM engine (``drive_llm.py``'s ``fault`` setting), each
standing for an upstream class of bug. Installed in the engine's process before ``vllm.LLM`` is
built, so that otel-swa's instrumentor wraps the faulty method as it would wrap vLLM's own.

``write_slot_off``: a KV store one slot off. From the ``at``-th forward step on, the first
sliding-window layer's ``CPUAttentionBackendImpl.do_kv_cache_update`` (``vllm/v1/attention/backends/
cpu_attn.py``, vLLM 0.32.0's CPU build) stores each new token's K/V at ``slot + 1`` instead of the
slot vLLM's slot mapping names (the pool's last slot at ``slot - 1``; padding, ``-1``, left as it
is). It stands for the class of
sgl-project/sglang#20181 (write indices taken from the wrong table: a sliding-window layer writing
at another slot than its own group's) and of vLLM's off-by-one slot-mapping bugs: attention then
reads, at the right slot, K/V that was never written there, and the neighbouring slot is
overwritten.

``read_stale_block``: attention reading through a stale block table. From the ``at``-th forward
step on, the first sliding-window layer's ``CPUAttentionBackendImpl.forward`` is given a block table
in which each request's row names, for the block of its last token, the block another request of
the batch holds there (the next one's, in batch order); the stores (``do_kv_cache_update``, called
apart) and the other layers are left as they are. It stands for the class of a block-table row
that still names a block freed and handed to another request (a missed block-table update after a
preemption or a prefix-cache eviction; sgl-project/sglang#20181's sibling on the read side, an
attention kernel reading the slots of another table): the KV in the pool is right, the attention
reads other KV. Only the read check can see it (the write check and the block audit find the
tables and the stores as they should be).
"""

from __future__ import annotations

from typing import Any

__all__ = ["FAULTS", "install"]

#: The layer the faults touch: the first sliding-window layer of ``build_model.py``'s model.
LAYER = "model.layers.0.self_attn.attn"


def _write_slot_off(at: int, made: dict) -> None:
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    original = CPUAttentionBackendImpl.do_kv_cache_update
    calls = [0]

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
        if getattr(layer, "layer_name", None) == LAYER:
            calls[0] += 1
            if calls[0] >= at:
                if "step" not in made:  # this layer is called once per forward step
                    made.update(step=calls[0], slots=slot_mapping[slot_mapping >= 0].tolist())
                made["stores"] = made.get("stores", 0) + 1
                last = kv_cache.shape[0] * kv_cache.shape[2] - 1  # the pool's last slot: stepped back from
                off = torch.where(slot_mapping == last, slot_mapping - 1, slot_mapping + 1)
                slot_mapping = torch.where(slot_mapping >= 0, off, slot_mapping)
        return original(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs)

    CPUAttentionBackendImpl.do_kv_cache_update = do_kv_cache_update


def _read_stale_block(at: int, made: dict) -> None:
    import dataclasses

    import torch

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    original = CPUAttentionBackendImpl.forward
    calls = [0]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if getattr(layer, "layer_name", None) == LAYER and attn_metadata is not None:
            calls[0] += 1
            batch = int(attn_metadata.seq_lens.shape[0])
            if calls[0] >= at and batch >= 2:
                table = attn_metadata.block_table.clone()
                block_size = kv_cache.shape[2]
                last = (attn_metadata.seq_lens.long() - 1) // block_size  # each request's last token's block
                rows = torch.arange(batch)
                table[rows, last] = attn_metadata.block_table[(rows + 1) % batch, last.roll(-1)]
                if "step" not in made:  # this layer is called once per forward step
                    made.update(step=calls[0])
                made["reads"] = made.get("reads", 0) + 1
                attn_metadata = dataclasses.replace(attn_metadata, block_table=table)
        return original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    CPUAttentionBackendImpl.forward = forward


#: Fault name -> installer ``(at, made)``; ``made`` gets ``step`` (the forward step of the first
#: faulty store, counted by the layer's own calls), ``slots`` (the slots vLLM named at that store,
#: padding left out) and ``stores`` (faulty stores in all).
FAULTS = {"write_slot_off": _write_slot_off, "read_stale_block": _read_stale_block}


def install(name: str, at: int) -> dict:
    """Install fault ``name`` from forward step ``at`` on; returns the dict it fills as it strikes."""
    made: dict[str, Any] = {"fault": name, "at": at}
    FAULTS[name](at, made)
    return made
