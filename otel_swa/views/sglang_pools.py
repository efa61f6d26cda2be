"""Reading SGLang's KV pools (names and layouts from sglang 0.5.23, ``python/sglang/srt/mem_cache/``;
nothing here imports SGLang): the SWA pool's free lists (``SWATokenToKVPoolAllocator``), how full
the pools are as SGLang's own pool gauges compute it, and the KV bytes one token takes in the
sliding-window layers. Also the attribute read every SGLang view uses (:func:`_attr`: a missing
attribute names what SGLang object was expected)."""

from __future__ import annotations

from typing import Any

import torch

from otel_swa.pool_usage import POOL_FULL, POOL_SWA, PoolUsage

#: The SGLang versions whose allocator layout this adapter was tested against (pip specifier).
SUPPORTED_SGLANG = "sglang >= 0.5.23, < 0.6"


def _attr(obj: Any, name: str, what: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise TypeError(
            f"{what} {type(obj).__name__} has no attribute {name!r}; expected SGLang's {what} "
            f"({SUPPORTED_SGLANG})"
        ) from None


def swa_free_pages(allocator: Any) -> tuple[torch.Tensor, int]:
    """The SWA pool's free pages and its page count, read from SGLang's allocator: the lists of
    :func:`swa_free_page_lists` in one ``int64`` tensor (a copy).

    Returns:
        ``(free_page_ids int64 [k], num_pages)``.

    Raises:
        TypeError, RuntimeError: see :func:`swa_free_page_lists`.
    """
    lists, num_pages = swa_free_page_lists(allocator)
    if not lists:
        return torch.zeros(0, dtype=torch.int64, device=allocator.full_to_swa_index_mapping.device), num_pages
    return torch.cat([t.long() for t in lists]), num_pages


def swa_free_page_lists(allocator: Any) -> "tuple[tuple[torch.Tensor, ...], int]":
    """The SWA pool's free lists as SGLang keeps them (no copy) and its page count.

    For ``page_size == 1`` SGLang's ``TokenToKVPoolAllocator`` keeps free slots in ``free_pages``
    and, with ``need_sort``, ``release_pages``; the paged allocator keeps free page ids in
    ``free_pages`` and ``staged_pages`` (a list of tensors). Pool ids run ``1 .. size`` (page 1) or
    ``1 .. num_pages``. sglang 0.5.23 never writes into these tensors: every allocation and free
    replaces them (a slice, a ``torch.cat``, a sort), so the audit may read them over several
    samples (:class:`otel_swa.device.audit.SwaAuditSweep`).

    Returns:
        ``(free lists: 1-D int tensors, num_pages)``; empty lists left out.

    Raises:
        TypeError: not an SGLang SWA allocator.
        RuntimeError: a free group is open (frees are held back until ``free_group_end``), or the
            allocator uses the per-request SWA ring, which has no SWA free list.
    """
    if getattr(allocator, "swa_req_ring", False):
        raise RuntimeError("the per-request SWA ring has no SWA free list to audit")
    if getattr(allocator, "free_group", None) is not None:
        raise RuntimeError("a free group is open on the allocator; audit between free_group_end and the next begin")
    swa = _attr(allocator, "swa_attn_allocator", "allocator")
    page_size = int(_attr(allocator, "page_size", "allocator"))
    lists = [_attr(swa, "free_pages", "SWA allocator")]
    if page_size == 1:
        release = getattr(swa, "release_pages", None)
        if release is not None:
            lists.append(release)
        num_pages = int(swa.size)
    else:
        lists.extend(getattr(swa, "staged_pages", ()) or ())
        num_pages = int(swa.num_pages)
    return tuple(t.reshape(-1) for t in lists if t.numel()), num_pages


def scheduler_pool_usage(scheduler: Any) -> "tuple[PoolUsage, ...] | None":
    """How full SGLang's KV pools are, computed as SGLang computes its own pool gauges.

    The computation of sglang 0.5.23's ``SchedulerPoolStatsObserver.get_pool_stats``
    (``managers/scheduler_components/pool_stats_observer.py``), whose fields become the Prometheus
    gauges ``sglang:kv_/swa_ used/available/evictable _tokens`` and ``full_/swa_token_usage``:

    * hybrid SWA (``scheduler.is_hybrid_swa``): ``(capacity, available)`` of each pool from the
      allocator's ``swa_capacity_and_available(full_capacity=scheduler.full_tokens_per_layer,
      swa_capacity=scheduler.swa_tokens_per_layer)``; evictable from the tree cache's
      ``full_evictable_size()`` / ``swa_evictable_size()`` (0 for the SWA pool under the
      per-request SWA ring, ``allocator.swa_req_ring``); ``used = capacity - (available +
      evictable)``; an empty pool (capacity 0) reports 0 used and 0 available;
    * otherwise, one FULL pool: ``allocator.available_size()``, ``tree_cache.evictable_size()``,
      capacity ``scheduler.max_total_num_tokens x scheduler.kv_shard_widening``;
    * hybrid SSM without SWA (``scheduler.is_hybrid_ssm``, mamba state pools): ``None``, not read.

    Host work only: the allocator's free-list lengths and the tree cache's counters, no device
    tensor is read. Call it between the scheduler's updates (e.g. the metric collection) or from
    another thread: the figures are then those of one moment give or take an update in flight.

    Returns:
        ``(full, swa)`` for hybrid SWA, ``(full,)`` otherwise, in tokens; ``None`` for hybrid SSM.

    Raises:
        TypeError: ``scheduler`` lacks SGLang's attributes (the message names the missing one).
        ValueError: the figures are inconsistent (available + evictable above capacity: HiSparse's
            transient over-release, which SGLang's gauges clamp to 0 used); that read gives nothing.
    """
    allocator = _attr(scheduler, "token_to_kv_pool_allocator", "scheduler")
    tree = _attr(scheduler, "tree_cache", "scheduler")
    if getattr(scheduler, "is_hybrid_swa", False):
        (full_cap, full_avail), (swa_cap, swa_avail) = allocator.swa_capacity_and_available(
            full_capacity=_attr(scheduler, "full_tokens_per_layer", "scheduler"),
            swa_capacity=_attr(scheduler, "swa_tokens_per_layer", "scheduler"),
        )
        full_evict = int(tree.full_evictable_size())
        swa_evict = 0 if getattr(allocator, "swa_req_ring", False) else int(tree.swa_evictable_size())
        return (
            _pool(POOL_FULL, int(full_cap), int(full_avail), full_evict),
            _pool(POOL_SWA, int(swa_cap), int(swa_avail), swa_evict),
        )
    if getattr(scheduler, "is_hybrid_ssm", False):
        return None
    capacity = int(_attr(scheduler, "max_total_num_tokens", "scheduler")) * int(getattr(scheduler, "kv_shard_widening", 1))
    return (_pool(POOL_FULL, capacity, int(allocator.available_size()), int(tree.evictable_size())),)


def _pool(pool: str, capacity: int, available: int, evictable: int) -> PoolUsage:
    if not capacity:  # SGLang: an empty pool counts 0 used and 0 available
        return PoolUsage(pool, 0, 0, evictable, 0)
    return PoolUsage.from_free(pool, total=capacity, available=available, evictable=evictable)


def swa_kv_bytes_per_token(kv_pool: Any) -> "int | None":
    """KV bytes one token takes in all the sliding-window layers of SGLang's ``SWAKVPool``.

    ``layer_num x head_num x (head_dim + v_head_dim) x store_dtype.itemsize`` of its
    ``swa_kv_pool`` (an ``MHATokenToKVPool``: one K and one V row per token and layer; the per-token
    scales of FP8/FP4 pools are not counted). ``kv_pool`` is the allocator's ``get_kvcache()`` (or
    ``ModelRunner.token_to_kv_pool``). Reads attributes only.

    Returns:
        bytes per token (int >= 1), or ``None`` when ``kv_pool`` has no SWA pool of that kind
        (not a hybrid SWA model, or an MLA-style SWA pool without K/V heads).
    """
    swa = getattr(kv_pool, "swa_kv_pool", None)
    try:
        layers, heads = int(swa.layer_num), int(swa.head_num)
        dims = int(swa.head_dim) + int(swa.v_head_dim)
        itemsize = int(swa.store_dtype.itemsize)
    except (AttributeError, TypeError, ValueError):
        return None
    size = layers * heads * dims * itemsize
    return size if size > 0 else None
