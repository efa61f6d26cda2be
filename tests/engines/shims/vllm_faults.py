"""Faults made on purpose inside vLLM 0.33's real KV cache manager: the vLLM suite's bug zoo.

Test-only. Each fault puts vLLM's real ``BlockPool`` and ``SingleTypeKVCacheManager`` tables into
the state an upstream bug class leaves them in, from inside the real ``Scheduler`` (or
``AsyncScheduler``) run, so that the suite can show which otel-swa signal flags it, at which forward
step, and what it names. Switched by the environment variable :data:`FAULT_VARIABLE`, read by
:func:`install`: ``<fault>@<step>`` (``leaked_tail_block@20``), the fault made at the first
occasion at or after forward step ``<step>`` (the count of ``schedule()`` calls that scheduled
tokens, otel-swa's ``forward_ct``). Unset or empty: nothing is changed.

The faults (:data:`FAULTS`):

``stale_table_entry``
    vllm-project/vllm#42273 ("SWA eviction leaves stale block table entries"; the corrupted
    outputs of #50702 / #50749 followed once the freed block was reused). The sliding-window trim
    (``SlidingWindowManager.remove_skipped_blocks``) of one request returns the blocks that left
    the window to the ``BlockPool`` but leaves their ids in the request's table instead of the
    null block. In #42273 the stale ids were in the GPU worker's copy of the table, which otel-swa
    does not read; here they stay in the scheduler's table (``req_to_blocks``), the one the KV
    block audit reads: the table references blocks the pool may hand to another request.
``foreign_free``
    the class of vllm-project/vllm#39589 ("KV cache read/write index corruption under concurrent
    prefill": a request's KV read and written in blocks another request owns; there through stale
    block-table tails in the GPU worker, fixed by #39591) and of the full-pool corruption of
    #50702: when a finished request is freed (``KVCacheManager.free``), the blocks of another,
    running request go back to the pool too (``BlockPool.free_blocks``, tail first as vLLM frees),
    its tables untouched. The pool hands them out again while that request still reads and writes
    them, and vLLM's own bookkeeping breaks later (``BlockPool.get_new_blocks`` asserts
    ``ref_cnt == 0``).
``leaked_tail_block``
    the class of neuralmagic/vllm#71 (a KV block leak in disaggregated prefill "in edge case where
    prompt_len < block size": the leaked block was a partly filled one) and of the usage that never
    comes down in vllm-project/vllm#27073: when a finished request is freed, the last block of each of its
    tables that has no block hash (the partly filled tail) is dropped from the table and never
    returned: ``ref_cnt`` stays 1, the block is in no table, not on the free queue and not in the
    prefix cache.
``late_eviction``
    the sliding-window trim keeps one block more than vLLM 0.33's rule, the rule
    vllm-project/vllm#33711 proposed ("keep one extra block", closed): from the step on, every
    trim runs on ``block_size`` tokens fewer. Blocks that left the window stay held: late-held
    SWA slots, which otel-swa reports and does not fail.
``stale_cache_entry``
    the class of local-inference-lab/vllm#480 ("KV-cache corruption under prefix-cache churn
    (phantom APC hits after full eviction)": requests received foreign KV, localised to stale
    prefix-cache hits after eviction, scheduler-side) and of vllm-project/vllm#49125 (a superseded
    prefix-cache hash put back into the map while its block holds other content): from the step
    on, every eviction of a cached block (``BlockPool._maybe_evict_cached_block``, when
    ``get_new_blocks`` hands a free cached block out again) resets the block's hash as vLLM does
    but leaves its map entries behind. The block goes to another request; a later request whose
    prefix has the old hash "hits" it and reads the new owner's KV. vLLM says nothing.
``other_group_block``
    vllm-project/vllm#47574 (a KV block of one KV cache group handed to another group): from the
    step on, the sliding-window group's prefix-cache lookups (``BlockPool.get_cached_block`` for
    that group) find the full-attention group's blocks (the key built with group 0's id), so a
    request's sliding-window table holds blocks whose KV the full-attention layers wrote.
``hash_of_another_index``
    the class of ovg-project/kvcached#446 (fixed by #451: vLLM blocks "cached under incorrect
    prefix hashes" when the hash block size was lost, Gemma-4's sliding-window model diverging
    with prefix caching on): from the step on, ``BlockPool.cache_full_blocks`` caches each new
    full block ``j >= 1`` under the request's hash of block ``j - 1`` (the prefix one block
    shorter; block 0 is left uncached), so a later request sharing only that shorter prefix may
    take a block holding tokens it does not have.

:func:`install` returns an :class:`Injection` that says when and where the fault was made.
``injected_at`` is the forward step it was made in: a fault made inside ``schedule()`` (the trims)
is there for that step's sample already; one made in ``update_from_output()`` (the frees, after
the step's forward) is first seen by the next step's sample. The prefix-cache faults
(``stale_cache_entry``, ``other_group_block``, ``hash_of_another_index``) are made inside
``schedule()`` (an allocation's eviction, an admission's lookup, the caching of a step's full
blocks); they stay armed after the first time (``times`` counts them) and keep the first one's
step, request and blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

#: ``<fault>@<step>``: the fault to make and the forward step from which it is made.
FAULT_VARIABLE = "OTEL_SWA_TEST_VLLM_FAULT"


@dataclass
class Injection:
    """One fault made on purpose (host values, filled in when it is made).

    Attributes:
        fault: one of :data:`FAULTS`.
        step: the forward step from which the fault is armed.
        injected_at: the forward step it was made in (``None``: not made yet).
        request: the request whose table or blocks it touched.
        blocks: the block ids it freed early, leaked or kept (``late_eviction``: the first trim's).
        times: how many times it was made (``late_eviction``: every trim after ``step``).
    """

    fault: str
    step: int
    injected_at: "int | None" = None
    request: "str | None" = None
    blocks: tuple = ()
    times: int = 0
    forward_ct: int = field(default=0, repr=False)  # schedule() calls that scheduled tokens, so far
    in_schedule: bool = field(default=False, repr=False)
    seen: set = field(default_factory=set, repr=False)  # requests a fault was already made for

    @property
    def armed(self) -> bool:
        """Whether the step being scheduled (inside ``schedule()``) or just scheduled has come."""
        return self.forward_ct + (1 if self.in_schedule else 0) >= self.step

    @property
    def current_step(self) -> int:
        return self.forward_ct + (1 if self.in_schedule else 0)

    def made(self, request: str, blocks) -> None:
        self.times += 1
        if self.injected_at is None:
            self.injected_at, self.request, self.blocks = self.current_step, request, tuple(blocks)


def parse(spec: str) -> "tuple[str, int]":
    """``"<fault>@<step>"`` -> ``(fault, step)``.

    Raises:
        ValueError: not of that form, an unknown fault, or a step below 1.
    """
    fault, at, step = spec.strip().partition("@")
    if not at or fault not in FAULTS or not step.isdigit() or int(step) < 1:
        raise ValueError(f"{FAULT_VARIABLE}={spec!r}: expected <fault>@<step> with a fault among "
                         f"{', '.join(FAULTS)} and a step >= 1")
    return fault, int(step)


def install(scheduler: Any, spec: "str | None" = None) -> "Injection | None":
    """Arm the fault ``spec`` (default: :data:`FAULT_VARIABLE`) on this scheduler instance only
    (its methods are shadowed on the instance; the class, and the otel-swa instrumentor's wrapping
    of it, stay as they are). Returns the :class:`Injection`, or ``None`` when no fault is asked."""
    spec = os.environ.get(FAULT_VARIABLE, "") if spec is None else spec
    if not spec.strip():
        return None
    fault, step = parse(spec)
    injection = Injection(fault, step)

    def counting_schedule(*args, **kwargs):
        injection.in_schedule = True
        try:  # the class's method, as the instrumentor may have wrapped it
            output = type(scheduler).schedule(scheduler, *args, **kwargs)
        finally:
            injection.in_schedule = False
        if output.total_num_scheduled_tokens > 0:
            injection.forward_ct += 1
        return output

    scheduler.schedule = counting_schedule
    FAULTS[fault](scheduler, injection)
    return injection


def _managers(scheduler: Any) -> tuple:
    return tuple(scheduler.kv_cache_manager.coordinator.single_type_managers)


def _sliding_window_manager(scheduler: Any) -> Any:
    return next(m for m in _managers(scheduler) if type(m).__name__ == "SlidingWindowManager")


def _stale_table_entry(scheduler: Any, injection: Injection) -> None:
    manager = _sliding_window_manager(scheduler)
    trim = manager.remove_skipped_blocks

    def remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens=None):
        before = list(manager.req_to_blocks.get(request_id, ()))
        trim(request_id, processed_computed_tokens, num_prompt_tokens)
        if injection.armed and injection.injected_at is None:
            table = manager.req_to_blocks[request_id]
            freed = [j for j, (old, new) in enumerate(zip(before, table)) if old is not new]
            if freed:
                for j in freed:  # the freed block's id stays in the table instead of the null block
                    table[j] = before[j]
                injection.made(request_id, [before[j].block_id for j in freed])

    manager.remove_skipped_blocks = remove_skipped_blocks


def _on_free(scheduler: Any, injection: Injection, act: Callable[[Any, Any], "Callable[[], None] | None"]) -> None:
    """Run ``act(kv_cache_manager, request)`` in ``KVCacheManager.free`` of a finished request
    once armed, until the fault is made; ``act`` runs before the real free and may return a
    callable to run after it. (Preemption frees through the same method; it is left alone.)"""
    kv = scheduler.kv_cache_manager
    free = kv.free

    def wrapped_free(request):
        due = injection.armed and injection.injected_at is None and request.is_finished()
        after = act(kv, request) if due else None
        free(request)
        if after is not None:
            after()

    kv.free = wrapped_free


def _foreign_free(scheduler: Any, injection: Injection) -> None:
    managers = _managers(scheduler)

    def act(kv, request):
        victims = [r for r in scheduler.running if r.request_id != request.request_id
                   and all(m.req_to_blocks.get(r.request_id) for m in managers)]
        if not victims:
            return None
        victim = victims[0].request_id

        def after():
            blocks = [b for m in managers for b in m.req_to_blocks[victim] if not b.is_null]
            kv.block_pool.free_blocks(list(reversed(blocks)))
            injection.made(victim, [b.block_id for b in blocks])

        return after

    _on_free(scheduler, injection, act)


def _leaked_tail_block(scheduler: Any, injection: Injection) -> None:
    managers = _managers(scheduler)

    def act(kv, request):
        leaked = []
        for manager in managers:
            table = manager.req_to_blocks.get(request.request_id)
            if not table:
                continue
            tail = next((j for j in range(len(table) - 1, -1, -1)
                         if not table[j].is_null and table[j].block_hash is None), None)
            if tail is not None:
                leaked.append(table.pop(tail).block_id)  # out of the table: the free below skips it
        if leaked:
            injection.made(request.request_id, leaked)
        return None

    _on_free(scheduler, injection, act)


def _late_eviction(scheduler: Any, injection: Injection) -> None:
    manager = _sliding_window_manager(scheduler)
    trim = manager.remove_skipped_blocks

    def remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens=None):
        if not injection.armed:
            return trim(request_id, processed_computed_tokens, num_prompt_tokens)
        late = max(0, processed_computed_tokens - manager.block_size)
        kept = manager.get_num_skipped_tokens(processed_computed_tokens) // manager.block_size
        table = manager.req_to_blocks.get(request_id, ())
        if 0 < kept <= len(table) and not table[kept - 1].is_null:
            injection.made(request_id, [table[kept - 1].block_id])
        return trim(request_id, late, num_prompt_tokens)

    manager.remove_skipped_blocks = remove_skipped_blocks


def _stale_cache_entry(scheduler: Any, injection: Injection) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    evict = pool._maybe_evict_cached_block

    def maybe_evict_cached_block(block):
        if not injection.armed or block.block_hash is None:
            return evict(block)
        keys = [block.block_hash, *pool.cached_block_hashes_by_block.get(block.block_id, ())]
        evicted = evict(block)  # removes every entry of the block and resets its hash
        if evicted:
            for key in keys:  # the entries stay behind
                pool.cached_block_hash_to_block.insert(key, block)
            owner = next((rid for m in _managers(scheduler) for rid, t in m.req_to_blocks.items()
                          if any(b is block for b in t)), None)
            injection.made(owner, [block.block_id])
        return evicted

    pool._maybe_evict_cached_block = maybe_evict_cached_block


def _other_group_block(scheduler: Any, injection: Injection) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    swa = _sliding_window_manager(scheduler)
    group = swa.kv_cache_group_id
    other = next(m.kv_cache_group_id for m in _managers(scheduler) if type(m).__name__ == "FullAttentionManager")
    lookup, allocate = pool.get_cached_block, kv.allocate_slots

    def get_cached_block(block_hash, kv_cache_group_ids):
        if injection.armed and list(kv_cache_group_ids) == [group]:
            return lookup(block_hash, [other])
        return lookup(block_hash, kv_cache_group_ids)

    def allocate_slots(request, *args, **kwargs):
        blocks = allocate(request, *args, **kwargs)
        if blocks is not None and injection.armed:
            taken = [b.block_id for b in swa.req_to_blocks.get(request.request_id, ())
                     if not b.is_null and b.block_hash is not None
                     and int.from_bytes(bytes(b.block_hash)[-4:], "big") != group]
            if taken and request.request_id not in injection.seen:
                injection.seen.add(request.request_id)
                injection.made(request.request_id, taken)
        return blocks

    pool.get_cached_block = get_cached_block
    kv.allocate_slots = allocate_slots


class _HashesOneBlockBack:
    """A request whose ``block_hashes`` are its own moved one block on: entry ``k`` is the request's
    hash ``k - 1`` (entry 0 its hash 0, left uncached by the caller)."""

    def __init__(self, request: Any) -> None:
        self._request = request
        self.block_hashes = [*request.block_hashes[:1], *request.block_hashes]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def _hash_of_another_index(scheduler: Any, injection: Injection) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    cache_full_blocks = pool.cache_full_blocks

    def cache(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask=None):
        if not injection.armed or num_cached_blocks >= num_full_blocks:
            return cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                     kv_cache_group_id, block_mask=block_mask)
        mask = list(block_mask) if block_mask is not None else [True] * (num_full_blocks - num_cached_blocks)
        if num_cached_blocks == 0:
            mask[0] = False  # block 0 has no shorter prefix
        cache_full_blocks(_HashesOneBlockBack(request), blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, block_mask=mask)
        moved = [blocks[num_cached_blocks + i].block_id for i, on in enumerate(mask)
                 if on and not blocks[num_cached_blocks + i].is_null]
        if moved:
            injection.made(request.request_id, moved)

    pool.cache_full_blocks = cache


#: The faults by name (see the module docstring).
FAULTS: "dict[str, Callable[[Any, Injection], None]]" = {
    "stale_table_entry": _stale_table_entry,
    "foreign_free": _foreign_free,
    "leaked_tail_block": _leaked_tail_block,
    "late_eviction": _late_eviction,
    "stale_cache_entry": _stale_cache_entry,
    "other_group_block": _other_group_block,
    "hash_of_another_index": _hash_of_another_index,
}
