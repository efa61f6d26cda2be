"""vLLM's whole ``BlockPool`` beside the batch (vLLM 0.33's v1 ``KVCacheManager``; nothing here
imports vLLM): its free queue, the blocks the prefix cache holds, the KV block audit's inputs
(:func:`kv_block_audit_inputs`) and the pool usage gauges (:func:`kv_cache_pool_usage`, free
counted as vLLM's ``get_usage()`` counts it)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from otel_swa.pool_usage import POOL_FULL, POOL_SWA, PoolUsage
from otel_swa.views.base import KvBlockAuditInputs
from otel_swa.views.vllm_block_hashes import good_entry
from otel_swa.views.vllm_window import _BLOCK_ID, NULL_BLOCK_ID, SUPPORTED_VLLM, _block_size, _req_to_blocks

#: Which managers' groups make up each pool (``type(manager).__mro__`` names, vLLM 0.33's
#: ``single_type_kv_cache_manager.py``). Other kinds (chunked local attention, Mamba, cross
#: attention, RSWA, circular buffer...) belong to neither pool.
_POOL_OF_MANAGER = {"SlidingWindowManager": POOL_SWA}
_FULL_MANAGERS = ("FullAttentionManager",)


class FreeQueueMoved(RuntimeError):
    """The free queue changed while it was walked (read from another thread than the scheduler's)."""


def _pool_of(manager: Any) -> "str | None":
    if type(manager).__name__ in _FULL_MANAGERS:
        return POOL_FULL
    for cls in type(manager).__mro__:
        if cls.__name__ in _POOL_OF_MANAGER:
            return _POOL_OF_MANAGER[cls.__name__]
    return None


def _group_id(block_hash: Any) -> int:
    """The KV cache group of a ``BlockHashWithGroupId``: its last 4 bytes, big-endian (vLLM 0.33's
    ``kv_cache_utils.make_block_hash_with_group_id``)."""
    return int.from_bytes(bytes(block_hash)[-4:], "big", signed=False)


def _parts(kv_cache_manager: Any) -> "tuple[Sequence[Any], Any]":
    """``(single_type_managers, block_pool)`` of a ``KVCacheManager``."""
    try:
        coordinator = kv_cache_manager.coordinator
        return coordinator.single_type_managers, coordinator.block_pool
    except AttributeError as exc:
        raise TypeError(
            f"{type(kv_cache_manager).__name__} is not vLLM's KVCacheManager ({SUPPORTED_VLLM}): {exc}"
        ) from None


def free_queue(block_pool: Any) -> list:
    """The blocks on vLLM's free queue (``BlockPool.free_block_queue``, a linked list through
    ``KVCacheBlock.next_free_block`` between two sentinel blocks), front first: the blocks
    ``BlockPool.get_num_free_blocks()`` and ``get_usage()`` count as free (cached ones included:
    evictable).

    Host work, one attribute read per free block, bounded by the pool's size.

    Raises:
        TypeError: not vLLM's ``BlockPool``.
        FreeQueueMoved: the walk did not end at the queue's tail within ``num_gpu_blocks`` blocks, or
            found another number of blocks than ``free_block_queue.num_free_blocks`` (the queue
            changed during the walk: read from another thread than the scheduler's).
    """
    try:
        queue = block_pool.free_block_queue
        expected = queue.num_free_blocks
        block = queue.fake_free_list_head.next_free_block
        tail = queue.fake_free_list_tail
        limit = int(block_pool.num_gpu_blocks)
    except AttributeError as exc:
        raise TypeError(f"{type(block_pool).__name__} is not vLLM's BlockPool ({SUPPORTED_VLLM}): {exc}") from None
    blocks = []
    while block is not tail:
        if block is None or len(blocks) >= limit:
            raise FreeQueueMoved(f"the free queue did not end at its tail within {limit} blocks")
        blocks.append(block)
        block = block.next_free_block
    if len(blocks) != expected:
        raise FreeQueueMoved(f"walked {len(blocks)} free blocks, the queue counts {expected}")
    return blocks


def _cached_block_ids(block_pool: Any) -> list[int]:
    """Ids of the blocks the prefix cache holds (``cached_block_hash_to_block``: a
    ``BlockHashToBlockMap`` whose values are a ``KVCacheBlock`` or a dict of them by id), through
    good entries only (:func:`otel_swa.views.vllm_block_hashes.good_entry`: the key is the block's
    own hash or one of its secondary keys): a stale entry, left behind when its block was evicted,
    does not make the block cached (it would excuse an unhashed block two tables share)."""
    cache = getattr(block_pool.cached_block_hash_to_block, "_cache", None)
    if not isinstance(cache, dict):
        raise TypeError(f"BlockPool.cached_block_hash_to_block has no dict _cache; expected {SUPPORTED_VLLM}")
    secondary = getattr(block_pool, "cached_block_hashes_by_block", {})
    ids: list[int] = []
    for key, entry in list(cache.items()):
        for block in (entry.values() if isinstance(entry, dict) else (entry,)):
            if good_entry(key, block, secondary):
                ids.append(block.block_id)
    return ids


def kv_block_audit_inputs(kv_cache_manager: Any, *, device: "str | torch.device" = "cpu") -> KvBlockAuditInputs:
    """What the KV block audit reads, from vLLM 0.33's ``KVCacheManager`` (its one ``BlockPool``
    and every KV cache group's ``SingleTypeKVCacheManager``), read now on the host.

    * ``free_block_ids``: the free queue (:func:`free_queue`), front first;
    * ``cached_block_ids``: every block the prefix cache maps a hash to
      (``BlockPool.cached_block_hash_to_block``), free or not, through a good entry only (a stale
      entry, whose key is not the block's own hash, makes no block cached);
    * held entries: every entry of every request's table (``req_to_blocks``) of every group, in
      group order, then request order, then block order; the null block (``block_id`` 0,
      ``BlockPool.null_block``) left out. ``held_positions``: entry ``j`` of a group of block size
      ``bs`` covers positions from ``j * bs``; ``held_rows`` index ``held_request_ids`` (each
      request once, in the order first met);
    * ``num_blocks``: ``BlockPool.num_gpu_blocks``; ``null_block_id``: 0.

    Read on the scheduler's thread (the instrumentor reads it right after ``schedule()``, at
    sampling steps only): host work of one attribute read per free block, per cached hash and per
    table entry, then one tensor per field on ``device`` (``int64``).

    A block held outside the tables is not seen: runs whose KV connector defers frees
    (``Scheduler.deferred_frees``) or pins blocks should not be audited (the instrumentor leaves
    the audit off when a connector is set).

    Raises:
        TypeError: not vLLM's ``KVCacheManager`` (the message names what is missing).
        FreeQueueMoved: see :func:`free_queue`.
    """
    managers, block_pool = _parts(kv_cache_manager)
    free_ids = list(map(_BLOCK_ID, free_queue(block_pool)))
    cached_ids = _cached_block_ids(block_pool)
    rows: dict[str, int] = {}
    ids: list[int] = []
    segments: list[tuple[int, int, int, int]] = []  # (group, row, entries, block size) per table
    for group, manager in enumerate(managers):
        bs = _block_size(manager)
        for request_id, blocks in list(_req_to_blocks(manager).items()):
            if blocks:
                ids.extend(map(_BLOCK_ID, blocks))
                segments.append((group, rows.setdefault(request_id, len(rows)), len(blocks), bs))
    held = np.array(ids, dtype=np.int64)
    if segments:
        groups, held_rows, lens, sizes = np.array(segments, dtype=np.int64).T
        starts = np.cumsum(lens) - lens
        positions = (np.arange(held.shape[0]) - np.repeat(starts, lens)) * np.repeat(sizes, lens)
        groups, held_rows = np.repeat(groups, lens), np.repeat(held_rows, lens)
        keep = held != NULL_BLOCK_ID  # the null entries (the window's skipped blocks, prefix hits) left out
        held, groups, held_rows, positions = held[keep], groups[keep], held_rows[keep], positions[keep]
    else:
        groups = held_rows = positions = held
    t = torch.from_numpy
    device = torch.device(device)
    return KvBlockAuditInputs(
        num_blocks=int(block_pool.num_gpu_blocks),
        free_block_ids=t(np.array(free_ids, dtype=np.int64)).to(device),
        cached_block_ids=t(np.array(cached_ids, dtype=np.int64)).to(device),
        held_block_ids=t(held).to(device),
        held_groups=t(groups).to(device),
        held_rows=t(held_rows).to(device),
        held_positions=t(positions).to(device),
        held_request_ids=tuple(rows),
        null_block_id=NULL_BLOCK_ID,
    )


def kv_cache_pool_usage(kv_cache_manager: Any) -> "tuple[PoolUsage, ...] | None":
    """How full vLLM's KV cache is, per pool kind, in tokens (vLLM 0.33's v1 ``KVCacheManager``).

    vLLM keeps one ``BlockPool`` (``kv_cache_manager.coordinator.block_pool``) for every KV cache
    group; each group (``coordinator.single_type_managers[i]``) takes its blocks from it. A pool
    here is the groups of one kind: ``full`` the ``FullAttentionManager`` groups, ``swa`` the
    ``SlidingWindowManager`` groups (other kinds are in neither). Free means on the free queue
    (:func:`free_queue`), as vLLM counts it (``BlockPool.get_num_free_blocks``). Per pool, in token
    slots of the shared pool (blocks x the groups' ``block_size``):

    * ``available``: free blocks not in the prefix cache (``block_hash`` unset), shared: the same in
      both pools;
    * ``evictable``: free blocks still in the prefix cache whose hash belongs to one of the pool's
      groups (``BlockHashWithGroupId``'s group id);
    * ``used``: the blocks not free that the pool's groups' tables hold (``req_to_blocks``, the
      null block, ``is_null``, being no block; a block in the tables of both kinds, which only a
      corrupted pool has, counted once, in ``full``), plus the blocks not free that no table holds (leaked: the KV block audit
      names them): by their hash's group when cached, else in ``full`` (``swa`` when there is no
      full-attention group), since vLLM counts them as used;
    * ``total``: ``num_gpu_blocks - 1`` (block 0 is the null block), shared: the same in both.

    So over the pools ``sum(used) / total`` is vLLM's own ``kv_cache_usage_perc``
    (``BlockPool.get_usage()``, ``1 - num_free_blocks / (num_gpu_blocks - 1)``) when every group
    is of one of the two kinds, leak or not; a block a table holds while it is on the free queue
    (freed while in use) counts as free, as vLLM counts it.

    Host work only (no device tensor): one pass over the free queue and one over the groups' block
    tables (one attribute read per entry), then a few numpy passes over one flag per block: call it
    at metric collection, not every step. Read from another thread while the scheduler runs, the free
    queue may change during the walk: the read is tried three times, then ``None`` is returned (no
    figure rather than a wrong one).

    Returns:
        one :class:`~otel_swa.pool_usage.PoolUsage` per pool kind present (``full`` first), or
        ``None`` when the free queue kept moving.

    Raises:
        TypeError: not vLLM's ``KVCacheManager`` (the message names the missing attribute).
        ValueError: the groups of one pool have different block sizes (no single token unit), or
            the counts are inconsistent.
    """
    managers, block_pool = _parts(kv_cache_manager)
    try:
        blocks = block_pool.blocks
        total_blocks = int(block_pool.num_gpu_blocks) - 1
    except AttributeError as exc:
        raise TypeError(f"{type(block_pool).__name__} is not vLLM's BlockPool ({SUPPORTED_VLLM}): {exc}") from None
    groups: dict[str, list[tuple[int, Any]]] = {}
    for group_id, manager in enumerate(managers):
        pool = _pool_of(manager)
        if pool is not None:
            groups.setdefault(pool, []).append((group_id, manager))
    if not groups:
        return ()
    sizes = {}
    for pool, members in groups.items():
        found = {_block_size(manager) for _, manager in members}
        if len(found) != 1:
            raise ValueError(f"the {pool} KV cache groups have block sizes {sorted(found)}; expected one")
        sizes[pool] = found.pop()
    pool_of_group = {group_id: pool for pool, members in groups.items() for group_id, _ in members}
    for attempt in range(3):
        try:
            free = free_queue(block_pool)
            break
        except FreeQueueMoved:
            if attempt == 2:
                return None
    available_blocks = 0
    evictable_blocks = dict.fromkeys(groups, 0)
    for block in free:
        block_hash = block.block_hash
        if block_hash is None:
            available_blocks += 1
            continue
        pool = pool_of_group.get(_group_id(block_hash))
        if pool is not None:
            evictable_blocks[pool] += 1
    n = len(blocks)
    held = {POOL_FULL: [], POOL_SWA: [], None: []}  # block ids by the kind of the tables holding them
    for group_id, manager in enumerate(managers):
        ids = held[pool_of_group.get(group_id)]
        for req_blocks in list(_req_to_blocks(manager).values()):
            ids.extend(map(_BLOCK_ID, req_blocks))
    marks = {}
    for kind, ids in held.items():
        mark = np.zeros(n, dtype=bool)
        mark[np.array(ids, dtype=np.int64)] = True
        marks[kind] = mark
    in_use = np.ones(n, dtype=bool)
    in_use[np.array(list(map(_BLOCK_ID, free)), dtype=np.int64)] = False
    in_use[NULL_BLOCK_ID] = False
    full = marks[POOL_FULL] & in_use  # a block in the tables of both kinds (a corrupted pool) counts in full
    used_blocks = {POOL_FULL: int(np.count_nonzero(full)),
                   POOL_SWA: int(np.count_nonzero(marks[POOL_SWA] & in_use & ~full))}
    rest = POOL_FULL if POOL_FULL in groups else POOL_SWA
    for block_id in np.flatnonzero(in_use & ~marks[POOL_FULL] & ~marks[POOL_SWA] & ~marks[None]).tolist():
        block_hash = blocks[block_id].block_hash  # in use, in no table: by its hash's group when cached
        used_blocks[pool_of_group.get(_group_id(block_hash), rest) if block_hash is not None else rest] += 1
    return tuple(
        PoolUsage(pool, used_blocks[pool] * sizes[pool], available_blocks * sizes[pool],
                  evictable_blocks[pool] * sizes[pool], total_blocks * sizes[pool])
        for pool in (POOL_FULL, POOL_SWA) if pool in groups
    )


def scheduler_pool_usage(scheduler: Any) -> "tuple[PoolUsage, ...] | None":
    """:func:`kv_cache_pool_usage` of a vLLM ``Scheduler``'s ``kv_cache_manager``."""
    return kv_cache_pool_usage(scheduler.kv_cache_manager)
