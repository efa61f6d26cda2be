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

:func:`install` returns an :class:`Injection` that says when and where the fault was made.
``injected_at`` is the forward step it was made in: a fault made inside ``schedule()`` (the trims)
is there for that step's sample already; one made in ``update_from_output()`` (the frees, after
the step's forward) is first seen by the next step's sample.
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


#: The faults by name (see the module docstring).
FAULTS: "dict[str, Callable[[Any, Injection], None]]" = {
    "stale_table_entry": _stale_table_entry,
    "foreign_free": _foreign_free,
    "leaked_tail_block": _leaked_tail_block,
    "late_eviction": _late_eviction,
}
