"""What the KV's provenance check reads from SGLang (sglang 0.5.23): where the provenance of an
``SWAKVPool`` lives, whether SGLang fills KV slots without a forward step (the stamps do not follow
it), the slots the prefix cache holds (the sweep) and each request's token ids."""

from __future__ import annotations

from typing import Any

import torch

def provenance_layout(kv_pool: Any) -> "dict[str, Any] | None":
    """Where the KV's provenance of an SGLang ``SWAKVPool`` lives (sglang 0.5.23
    ``srt/mem_cache/swa_memory_pool.py``): its slots per pool and the layers that matter.

    ``kv_pool.full_kv_pool`` / ``swa_kv_pool`` each hold one K and one V buffer per layer of their
    kind (``k_buffer[i]``: ``[slots, heads, head_dim]``, indexed by FULL slot, resp. by SWA slot
    ``full_to_swa_index_mapping[full_slot]``); ``layers_mapping`` maps a model layer id to ``(index
    in its sub-pool, is_swa)``. The checksum's designated layer of each pool is the one at index 0 of
    its sub-pool, the layer whose K/V bytes SGLang's KV canary hashes (``--kv-canary-real-data``,
    ``srt/kv_canary/pool_patcher/adapters/swa.py``: ``k_buffer[0]`` of each sub-pool), so that a
    byte the canary's self-tests flip there is one otel-swa hashed too.

    Returns:
        ``{"full_slots", "swa_slots", "checksum_layers": {"full": id, "swa": id}, "checksum_order":
        {"full": (id, ...), "swa": (id, ...)}, "first_layer", "swa_layers": frozenset}``
        (``checksum_order``: each pool's layer ids in increasing order, the order a forward step
        calls them; ``first_layer``: the lowest model layer id of the pool, the attention layer that
        runs first in a forward step), or ``None`` when ``kv_pool`` is not an
        ``SWAKVPool`` of K/V buffers (MLA, quantized, another layout): no provenance then.
    """
    mapping = getattr(kv_pool, "layers_mapping", None)
    try:
        full = int(kv_pool.full_kv_pool.k_buffer[0].shape[0])
        swa = int(kv_pool.swa_kv_pool.k_buffer[0].shape[0])
        layers = {int(layer): (int(index), bool(is_swa)) for layer, (index, is_swa) in mapping.items()}
    except (AttributeError, TypeError, IndexError, ValueError):
        return None
    if not layers:
        return None
    designated = {("swa" if is_swa else "full"): layer for layer, (index, is_swa) in layers.items() if index == 0}
    return {
        "full_slots": full, "swa_slots": swa, "checksum_layers": designated, "first_layer": min(layers),
        "checksum_order": {pool: tuple(sorted(layer for layer, (_, is_swa) in layers.items() if is_swa == swa))
                           for pool, swa in (("full", False), ("swa", True))},
        "swa_layers": frozenset(layer for layer, (_, is_swa) in layers.items() if is_swa),
    }


#: Settings under which SGLang fills KV cache slots without a forward step (sglang 0.5.23 names):
#: ``(server argument, runtime-context bag, the values under which the forward step writes every
#: slot, what fills the slots otherwise)``.
_KV_FILLED_OUTSIDE_FORWARD = (
    ("enable_lmcache", "memory", (False,), "LMCache loads KV from its store"),
    ("enable_unified_memory", "memory", (False,), "unified memory compacts KV pages by copying them"),
    ("disaggregation_mode", "disagg", ("null", "prefill"), "a disaggregated decode receives the prefill's KV"),
)


def kv_filled_outside_forward(runner: Any) -> "str | None":
    """Why SGLang may fill ``runner``'s KV cache slots without a forward step, or ``None``.

    Such slots hold KV whose provenance the stamps do not follow (the forward step writes them, and a
    load-back or transfer moves bytes only): LMCache
    (``--enable-lmcache``), unified memory (``--enable-unified-memory``: its compaction moves KV
    pages per sub-pool, ``UnifiedMHATokenToKVPool.move_kv_cache``), a disaggregated decode instance
    (``--disaggregation-mode decode``; a prefill instance computes its KV itself).
    Read from the model runner's ``server_args`` (sglang 0.5.23 ``ModelRunner.server_args``), else
    from SGLang's runtime context (``sglang.srt.runtime_context.get_memory()`` / ``get_disagg()``);
    a setting that cannot be read counts as off. HiCache (``--enable-hierarchical-cache``) is not
    one of them: its host pools' copies move the stamps too (the SGLang instrumentor's ``hicache``
    module).

    Returns:
        the first such setting in words (``"LMCache loads KV from its store"``), or ``None``.
    """
    args = getattr(runner, "server_args", None)
    for name, bag, written, what in _KV_FILLED_OUTSIDE_FORWARD:
        value = getattr(args, name, None) if args is not None else None
        if value is None:
            try:
                from sglang.srt import runtime_context

                value = getattr(getattr(runtime_context, f"get_{bag}")(), name, None)
            except Exception:  # not published in this process, or another SGLang
                value = None
        value = getattr(value, "value", value)  # an enum (DisaggregationMode) by its value
        if value is not None and value not in written and value != "":
            return what
    return None


def scheduler_prefix_cache_full_slots(scheduler: Any) -> "torch.Tensor | None":
    """The FULL slots SGLang's prefix cache holds (``scheduler.tree_cache.all_values_flatten()``: the
    radix tree's nodes, evictable or locked; sglang 0.5.23 ``srt/mem_cache/``), ``int64`` on the KV
    device, for the provenance check's sweep; ``None`` without a tree cache that lists them (the
    chunk cache of ``disable_radix_cache``). Host work: a walk of the tree (call it once per sweep
    pass, not every step)."""
    values = getattr(getattr(scheduler, "tree_cache", None), "all_values_flatten", None)
    if not callable(values):
        return None
    slots = values()
    return slots.reshape(-1).to(torch.int64) if isinstance(slots, torch.Tensor) else None


def request_token_ids(schedule_batch: Any, batch_size: int) -> "list | None":
    """Each request's token ids for the provenance check, from SGLang's ``ScheduleBatch`` (the batch
    whose forward step is being sampled; its ``reqs`` are in the forward batch's order): per request
    ``origin_input_ids`` (the prompt, a list) then ``output_ids`` (the generated tokens, an
    ``array("q")``), joined without a copy (:class:`otel_swa.views.base.JoinedTokenIds`). With the
    overlap scheduler the last generated token is still on the device when the next step runs: that
    request's ids are then one short of its ``seq_len`` and its slots are counted unchecked.

    Host work: one small object per request; the ids themselves are read only for the positions a
    sample verifies. Returns ``None`` when the batch has no ``reqs`` or not ``batch_size`` of them.
    """
    from otel_swa.views.base import JoinedTokenIds

    reqs = getattr(schedule_batch, "reqs", None)
    if reqs is None or len(reqs) != batch_size:
        return None
    return [JoinedTokenIds(req.origin_input_ids, req.output_ids) for req in reqs]
