"""What the KV provenance check reads from vLLM's scheduler at a sample (vLLM 0.32 / 0.33 v1 engine;
nothing here imports vLLM): each scheduled request's block table in the full-attention and in the
sliding-window KV cache group, the positions whose KV was written before the step, and the
request's own token ids. The device side is :mod:`otel_swa.device.paged_provenance`; the stamps are
written in the model runner (``opentelemetry.instrumentation.swa_vllm.provenance``).

* the groups: ``KVCacheManager.coordinator.single_type_managers[g]`` (group ``g`` of
  ``kv_cache_config.kv_cache_groups``, the same index the runner's ``input_batch.block_table[g]``
  has), each with ``kv_cache_spec`` (``FullAttentionSpec`` / ``SlidingWindowSpec``), ``block_size``
  and ``req_to_blocks`` (request id -> list of ``KVCacheBlock``, ``block_id``; the null block, id 0,
  where a sliding-window table dropped a block);
* the positions verified: read right after ``Scheduler.schedule()``, ``Request.num_computed_tokens``
  counts the step's own scheduled tokens (``SchedulerOutput.num_scheduled_tokens``), not written yet:
  positions ``0 .. num_computed_tokens - num_scheduled - 1`` were written by earlier forward steps
  (of this request, or of the one whose cached blocks a prefix-cache hit gave it);
  except where a request's table names a block another request of the batch writes in this step
  (vLLM caches a block's hash when it is allocated, so a request admitted in the same step hits the
  prefix cache on blocks whose KV the step's forward is still computing): its positions stop at the
  first such block;
* the token ids: ``Request.all_token_ids`` (vLLM ``vllm/v1/request.py``: a read-only view of the
  prompt's and the outputs' ids, ``ConstantList``, no copy). Cost: one attribute read per request at
  a sample; the ids are sliced and converted only for the positions a sample verifies (at most the
  per-sample budget per group, and the chain's checkpoint every 1,024 positions:
  :class:`otel_swa.device.stamps.ChainCache`). The runner's input batch (``input_batch.token_ids_cpu``)
  holds the same ids, but only for the requests of the runner's batch and in its row order, which
  the scheduler's sample does not see.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import torch

from otel_swa.device.paged_provenance import BlockSlots
from otel_swa.views.vllm_write import _spec_kind

__all__ = ["provenance_groups", "provenance_view"]


def provenance_groups(kv_cache_manager: Any) -> "tuple[Any, Any] | None":
    """``(full manager, sliding-window manager)`` of the scheduler's KV cache manager, or ``None``
    unless it has exactly one group of each kind (the pools the provenance tables follow)."""
    managers = list(getattr(getattr(kv_cache_manager, "coordinator", None), "single_type_managers", ()) or ())
    kinds = [_spec_kind(getattr(m, "kv_cache_spec", None)) for m in managers]
    if kinds.count(False) != 1 or kinds.count(True) != 1:
        return None
    return managers[kinds.index(False)], managers[kinds.index(True)]


def _table(manager: Any, request_ids: Sequence[str], written: "list[int]", computed: Sequence[int],
           device: torch.device) -> BlockSlots:
    """The group's block table of the batch; cuts ``written[i]`` (in place) at the first block of
    request ``i`` that another request of the batch writes in this step (a prefix-cache hit on
    blocks whose KV this step's forward is still computing: their positions are not written yet)."""
    bs = int(manager.block_size)
    rows = [[b.block_id for b in manager.req_to_blocks.get(rid, ())] for rid in request_ids]
    pending: "dict[int, int]" = {}  # block id -> the request writing it in this step
    for i, row in enumerate(rows):
        for column in range(written[i] // bs, -(-computed[i] // bs)):
            if column < len(row) and row[column] != 0:
                pending.setdefault(row[column], i)
    for i, row in enumerate(rows):
        for column in range(min(-(-written[i] // bs), len(row))):
            if pending.get(row[column], i) != i:
                written[i] = column * bs
                break
    width = max((len(r) for r in rows), default=0) or 1
    table = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        if row:
            table[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
    return BlockSlots(table.to(device), bs)


def provenance_view(kv_cache_manager: Any, requests: Mapping[str, Any], request_ids: Sequence[str],
                    num_scheduled: Sequence[int], device: "str | torch.device" = "cpu") -> "SimpleNamespace | None":
    """The ``kv_provenance`` of a sample's view (:mod:`otel_swa.device.paged_provenance`), read right
    after ``Scheduler.schedule()`` (module docstring), or ``None`` without one full and one
    sliding-window group.

    Args:
        kv_cache_manager: the scheduler's ``KVCacheManager``.
        requests: ``Scheduler.requests`` (request id -> ``Request``).
        request_ids: the scheduled requests, in the sample's order (its ``request_ids``).
        num_scheduled: their scheduled tokens this step, same order.
        device: the provenance tables' device.

    Host work: one list of block ids per request and group, two ``int64 [B, max_blocks]`` tables.
    """
    groups = provenance_groups(kv_cache_manager)
    if groups is None:
        return None
    full, swa = groups
    managers = list(kv_cache_manager.coordinator.single_type_managers)
    device = torch.device(device)
    window = getattr(getattr(swa, "kv_cache_spec", None), "sliding_window", None) or getattr(swa, "sliding_window", None)
    computed = [int(requests[rid].num_computed_tokens) for rid in request_ids]
    written = [max(n - int(s), 0) for n, s in zip(computed, num_scheduled)]
    full_table = _table(full, request_ids, written, computed, device)
    swa_table = _table(swa, request_ids, written, computed, device)
    return SimpleNamespace(
        seq_lens_cpu=written,
        req_to_token=full_table,
        swa_req_to_token=swa_table,
        req_pool_indices=torch.arange(len(written), dtype=torch.int64, device=device),
        token_ids=[requests[rid].all_token_ids for rid in request_ids],
        request_ids=list(request_ids),
        full_to_swa_index_mapping=None,
        # the SWA positions taken: the window's and one block more (a partly skipped block is held)
        sliding_window=int(window) if type(window) is int else None,  # noqa: E721
        extend_lens_cpu=None,
        swa_eviction_allowance=int(swa.block_size),
        kv_cache_groups=(managers.index(full), managers.index(swa)),
    )
