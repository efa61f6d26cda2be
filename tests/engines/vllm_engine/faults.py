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


# ---------------------------------------------------------------- faults made through the tables
# The scheduler's step (``Scheduler.schedule`` calls that schedule tokens, the forward steps
# otel-swa counts) and the edits of a step's block tables: made in the scheduler's KV cache manager
# right after ``schedule()`` returns (``coordinator.single_type_managers[group].req_to_blocks``,
# vLLM 0.32.0 ``vllm/v1/core/single_type_kv_cache_manager.py``) and in the model runner's copy of the
# same rows right after ``GPUModelRunner._update_states`` (``input_batch.block_table[group]``,
# ``vllm/v1/worker/block_table.py``; before ``_prepare_inputs`` computes the slot mapping from it), so
# both keep one table, as vLLM's own would after the bug.
_STEP = [0]
_SCHEDULED: "list[Any]" = []  # (step, hook(scheduler, output)) run after schedule()
_RUNNER: "list[Any]" = []  # hook(runner) run after _update_states
_EDITS: "list[tuple[str, int, int, int]]" = []  # (request id, group, column, block id) for the runner


def _hook_engine() -> None:
    if _SCHEDULED or _RUNNER:
        return
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    schedule, update = Scheduler.schedule, GPUModelRunner._update_states

    def scheduled(self, *args, **kwargs):
        output = schedule(self, *args, **kwargs)
        if output.total_num_scheduled_tokens:
            _STEP[0] += 1
            for hook in list(_SCHEDULED):
                hook(self, output)
        return output

    def _update_states(self, scheduler_output):
        result = update(self, scheduler_output)
        while _EDITS:
            rid, group, column, block = _EDITS.pop()
            row = self.input_batch.req_id_to_index[rid]
            self.input_batch.block_table[group].block_table.np[row, column] = block
        for hook in list(_RUNNER):
            hook(self)
        return result

    Scheduler.schedule = scheduled
    GPUModelRunner._update_states = _update_states
    _SCHEDULED.append(lambda *_: None)


def _groups(scheduler) -> "tuple[int, int]":
    """``(full group, sliding-window group)`` indices of the scheduler's KV cache manager."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    kinds = [type(m).__name__ for m in managers]
    return kinds.index("FullAttentionManager"), kinds.index("SlidingWindowManager")


def _set_entry(scheduler, rid: str, group: int, column: int, block) -> None:
    """Request ``rid``'s block table entry ``column`` of ``group`` becomes ``block``, in the
    scheduler's manager now and in the runner's copy at the step's ``_update_states``."""
    scheduler.kv_cache_manager.coordinator.single_type_managers[group].req_to_blocks[rid][column] = block
    _EDITS.append((rid, group, column, block.block_id))


def _decoding(scheduler, output, min_blocks: int) -> list:
    """The scheduled requests decoding one token, with at least ``min_blocks`` blocks of the full group
    written and the last one partly written (the order of the scheduler's output)."""
    full, _ = _groups(scheduler)
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[full]
    bs = manager.block_size
    picked = []
    for rid, n in output.num_scheduled_tokens.items():
        request = scheduler.requests[rid]
        written = request.num_computed_tokens - n
        if n == 1 and written // bs >= min_blocks - 1 and written % bs >= 2:
            picked.append(rid)
    return picked


def _at_two_decoding(at: int, made: dict, edit) -> None:
    """Run ``edit(scheduler, a, b)`` (returns the fields ``made`` gets) once, at the first step from
    ``at`` on that schedules two decoding requests ``a``, ``b`` (:func:`_decoding`)."""

    def hook(scheduler, output):
        if "step" in made or _STEP[0] < at:
            return
        picked = _decoding(scheduler, output, 2)
        if len(picked) >= 2:
            made.update(step=_STEP[0], requests=picked[:2], **edit(scheduler, *picked[:2]))

    _hook_engine()
    _SCHEDULED.append(hook)


def _last_block(scheduler, group: int, rid: str) -> "tuple[int, Any]":
    """``(column, block)`` of the block holding request ``rid``'s last written position in ``group``."""
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[group]
    column = (scheduler.requests[rid].num_computed_tokens - 1) // manager.block_size
    return column, manager.req_to_blocks[rid][column]


def _blocks_swapped(at: int, made: dict) -> None:
    """``blocks_swapped``: two decoding requests exchange the partly written last block of their
    full-attention tables after their KV was written there (both the scheduler's tables and the
    runner's), for the class of vLLM's block-ownership bugs where a block changes owner while its
    KV stays (vllm#50702's stale block table entries; sgl-project/sglang#20181's swapped
    ``req_to_token`` rows): each request then reads the other's KV at its own positions."""

    def edit(scheduler, a, b):
        full, _ = _groups(scheduler)
        (ca, blk_a), (cb, blk_b) = _last_block(scheduler, full, a), _last_block(scheduler, full, b)
        _set_entry(scheduler, a, full, ca, blk_b)
        _set_entry(scheduler, b, full, cb, blk_a)
        return {"blocks": [blk_a.block_id, blk_b.block_id]}

    _at_two_decoding(at, made, edit)


def _other_group_block(at: int, made: dict) -> None:
    """``other_group_block``: a decoding request's sliding-window table gets, in place of its last
    block, a block another request holds in the full-attention group (vllm#47574: a block of one KV
    cache group handed to the other while in use). The two groups share one KV tensor per layer
    pair, so the sliding-window layers' new K/V overwrite the full-attention layers' KV of that block."""

    def edit(scheduler, a, b):
        full, swa = _groups(scheduler)
        column, own = _last_block(scheduler, swa, a)
        _, victim = _last_block(scheduler, full, b)
        _set_entry(scheduler, a, swa, column, victim)
        return {"blocks": [own.block_id, victim.block_id]}

    _at_two_decoding(at, made, edit)


def _stale_prefix_entry(at: int, made: dict) -> None:
    """``stale_prefix_entry``: from step ``at`` on, an evicted block's hash stays in the prefix
    cache's map (``BlockPool._remove_cached_block_hashes`` resets the block's hash but leaves
    ``cached_block_hash_to_block`` as it was), so a later request hits a block that now holds other
    KV: the class of vllm#50702 / #50749 (stale prefix-cache entries after eviction)."""
    from vllm.v1.core.block_pool import BlockPool

    def _remove_cached_block_hashes(self, block):
        if _STEP[0] < at:
            return original(self, block)
        hashes = []
        if block.block_hash is not None:
            hashes.append(block.block_hash)
        hashes.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        if hashes:
            made.setdefault("step", _STEP[0])
            made["stale"] = made.get("stale", 0) + 1
        block.reset_hash()  # the map keeps the hashes: stale entries
        return hashes

    original = BlockPool._remove_cached_block_hashes
    BlockPool._remove_cached_block_hashes = _remove_cached_block_hashes
    _hook_engine()


def _cached_byte(at: int, made: dict) -> None:
    """``cached_byte``: at step ``at``, before the forward, one byte of a block the prefix cache holds
    (the shared system prompt's first block, full-attention group) is changed in the third layer's
    KV (``model.layers.3``, a full-attention layer sharing its tensor with sliding-window layer 2):
    a stray write or bit flip in cached KV that later prefix hits read (the class SGLang's KV canary
    hunts, and vLLM's CPU ``_zero_block_ids`` guards against)."""

    def hook(runner):
        if "step" in made or _STEP[0] < at or runner.input_batch.num_reqs == 0:
            return
        groups = runner.kv_cache_config.kv_cache_groups
        full = next(i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "FullAttentionSpec")
        block = int(runner.input_batch.block_table[full].block_table.np[0, 0])
        kv = runner.compilation_config.static_forward_context["model.layers.3.self_attn.attn"].kv_cache
        kv = kv[0] if isinstance(kv, list) else kv
        raw = kv[block].view(-1).view(torch.uint8)
        raw[3 + 4 * 5] ^= 0x80  # the sign of element 5 (K of token 5, head 0) of the block
        made.update(step=_STEP[0], blocks=[block], request=runner.input_batch.req_ids[0])

    import torch

    _hook_engine()
    _RUNNER.append(hook)


def _wrong_position(at: int, made: dict) -> None:
    """``wrong_position``: at step ``at`` one decoding token's position is one ahead in the model's
    input (``GPUModelRunner._model_forward``'s ``positions``, the runner's buffer, after the slot
    mapping was computed from the right one): its K is rotated for the wrong position and stored at
    the right slot, as in vllm#33656 (KV written with wrong position ids)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._model_forward

    def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        if "step" not in made and _STEP[0] >= at and positions is not None and self.input_batch.num_reqs > 0:
            row = self.input_batch.num_reqs - 1
            token = int(self.query_start_loc.np[row])  # the last request's first token this step
            made.update(step=_STEP[0], request=self.input_batch.req_ids[row], position=int(positions[token]))
            positions[token] += 1
        return original(self, input_ids, positions, *args, **kwargs)

    GPUModelRunner._model_forward = _model_forward
    _hook_engine()


#: Fault name -> installer ``(at, made)``; ``made`` gets ``step`` (the forward step of the first
#: faulty store, counted by the layer's own calls), ``slots`` (the slots vLLM named at that store,
#: padding left out) and ``stores`` (faulty stores in all).
FAULTS = {"write_slot_off": _write_slot_off, "blocks_swapped": _blocks_swapped, "other_group_block": _other_group_block,
          "stale_prefix_entry": _stale_prefix_entry, "cached_byte": _cached_byte, "wrong_position": _wrong_position,
          "read_stale_block": _read_stale_block}


def install(name: str, at: int) -> dict:
    """Install fault ``name`` from forward step ``at`` on; returns the dict it fills as it strikes."""
    made: dict[str, Any] = {"fault": name, "at": at}
    FAULTS[name](at, made)
    return made
