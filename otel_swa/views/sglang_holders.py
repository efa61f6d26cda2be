"""The SWA slot audit's inputs from SGLang (sglang 0.5.23): the FULL slots every live holder of KV
reads (the scheduler's requests, its sessions and the prefix cache), and the audit over SGLang's
allocator and ``ReqToTokenPool`` given the rows of every request that holds KV."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from otel_swa.device.audit import SwaSlotAudit, audit_swa_slots
from otel_swa.device.sample import live_full_slots
from otel_swa.views.sglang_pools import _attr, swa_free_pages

def _live_full_slots(
    req_to_token: torch.Tensor, req_pool_indices: Sequence[int], seq_lens: Sequence[int]
) -> torch.Tensor:
    if len(req_pool_indices) != len(seq_lens):
        raise ValueError(
            f"req_pool_indices has {len(req_pool_indices)} entries but seq_lens has {len(seq_lens)}"
        )
    num_rows, width = req_to_token.shape
    rows, lens = [int(r) for r in req_pool_indices], [int(n) for n in seq_lens]
    for row, length in zip(rows, lens):
        if not 0 <= row < num_rows:
            raise ValueError(f"req_pool_index {row} is outside req_to_token's {num_rows} rows")
        if not 0 <= length <= width:
            raise ValueError(f"seq_len {length} is outside [0, max_context_len={width}]")
    device = req_to_token.device
    lens_tensor = torch.tensor(lens, dtype=torch.int64)
    # With host lengths the gather is exactly the live tokens, and every row is in range (checked
    # above), so the mask selects them all.
    slots, _ = live_full_slots(
        req_to_token, torch.tensor(rows, dtype=torch.int64, device=device), lens_tensor.to(device),
        seq_lens_cpu=lens_tensor,
    )
    return slots


def audit_sglang_swa_slots(
    allocator: Any,
    req_to_token_pool: Any,
    req_pool_indices: Sequence[int],
    seq_lens: Sequence[int],
    *,
    held_full_slots: torch.Tensor | None = None,
) -> SwaSlotAudit:
    """:func:`audit_swa_slots` over SGLang's objects.

    Args:
        allocator: SGLang's ``SWATokenToKVPoolAllocator``.
        req_to_token_pool: SGLang's ``ReqToTokenPool``.
        req_pool_indices, seq_lens: the rows and live lengths of EVERY request that holds KV (not
            just one forward batch), as host ints.
        held_full_slots: FULL slots held outside requests (the prefix cache's), ``int [m]``.

    Raises:
        TypeError, RuntimeError: see :func:`swa_free_pages`; ValueError: see :func:`audit_swa_slots`.
    """
    free, num_pages = swa_free_pages(allocator)
    req_to_token = _attr(req_to_token_pool, "req_to_token", "req_to_token_pool")
    live = _live_full_slots(req_to_token, list(req_pool_indices), list(seq_lens))
    if held_full_slots is not None:
        live = torch.cat([live, held_full_slots.to(device=live.device, dtype=torch.int64).reshape(-1)])
    return audit_swa_slots(allocator.full_to_swa_index_mapping, free, num_pages, int(allocator.page_size), live)


def scheduler_holder_full_slots(scheduler: Any, batch: Any = None) -> torch.Tensor | None:
    """The FULL slots of every token a live holder of SGLang's KV cache reads, from its ``Scheduler``.

    Holders (sglang 0.5.23): every request with a ``req_to_token`` row (``req.kv.req_pool_idx``),
    over its first ``req.kv.kv_allocated_len`` positions, found in ``batch`` (the batch being run),
    ``scheduler.cur_batch``, ``last_batch``, ``running_batch``, the batches whose results are still
    queued (``result_queue``: the overlap scheduler releases a finished request only after the
    next forward), ``chunked_req`` and ``waiting_queue``, plus the sessions' rows (``tree_cache.session_records()``) and the prefix
    cache's own slots (``tree_cache.all_values_flatten()``: the radix tree's nodes, evictable or
    locked). Host work only (Python over the requests, one gather per request row); call it at
    sampling steps, not every step.

    Returns:
        ``int64 [n]`` on the KV device (duplicates possible: a request's prefix is also in the tree),
        or ``None`` when some allocated ``req_to_token`` row belongs to no request found above: the
        list would be incomplete, and an audit against it would report false leaks.

    Raises:
        TypeError: ``scheduler`` lacks ``req_to_token_pool``.
    """
    pool = _attr(scheduler, "req_to_token_pool", "scheduler")
    requests: dict[int, Any] = {}
    # with the overlap scheduler, the previous batch's requests are released only after this
    # forward, when its result (queued with a copy of the batch) is processed
    queued = [entry[0] for entry in getattr(scheduler, "result_queue", None) or ()]
    for source in (batch, getattr(scheduler, "cur_batch", None), getattr(scheduler, "last_batch", None),
                   getattr(scheduler, "running_batch", None), *queued):
        for req in getattr(source, "reqs", None) or ():
            requests[id(req)] = req
    for req in [getattr(scheduler, "chunked_req", None), *(getattr(scheduler, "waiting_queue", None) or ())]:
        if req is not None:
            requests[id(req)] = req
    lengths: dict[int, int] = {}
    records = [getattr(req, "kv", None) for req in requests.values()]
    tree = getattr(scheduler, "tree_cache", None)
    sessions = getattr(tree, "session_records", None)
    if callable(sessions):
        records.extend(sessions().values())
    for kv in records:
        row = getattr(kv, "req_pool_idx", None)
        if row is not None:
            lengths[int(row)] = max(lengths.get(int(row), 0), int(kv.kv_allocated_len))
    free = pool.free_slots
    free_rows = set(free.tolist() if isinstance(free, torch.Tensor) else free)
    allocated = set(range(1, int(pool.size) + 1)) - free_rows
    if not allocated.issubset(lengths):
        return None
    req_to_token = pool.req_to_token
    parts = []
    held = [(row, length) for row, length in lengths.items() if length > 0]
    if held:  # every row's first positions in one gather: flat index row * stride + position
        rows = np.fromiter((row for row, _ in held), dtype=np.int64, count=len(held))
        lens = np.fromiter((length for _, length in held), dtype=np.int64, count=len(held))
        index = np.repeat(rows * req_to_token.stride(0) - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
        flat = req_to_token if req_to_token.is_contiguous() else req_to_token.contiguous()
        parts.append(flat.view(-1).index_select(0, torch.from_numpy(index).to(req_to_token.device)).long())
    values = getattr(tree, "all_values_flatten", None)
    if callable(values):
        parts.append(values().reshape(-1).to(req_to_token.device, torch.int64))
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=req_to_token.device)
    return torch.cat(parts)
