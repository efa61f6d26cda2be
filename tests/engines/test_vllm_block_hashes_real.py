"""The block-hash provenance check on vLLM 0.33.0's real Scheduler and AsyncScheduler (marker ``vllm``).

Real: vLLM's scheduler, ``KVCacheManager``, ``BlockPool`` (its prefix cache map, its blocks' hashes)
and requests (their ``block_hashes``), driven as vLLM's engine core drives them
(``vllm_support.SchedulerDriver``). Stand-ins: the model runner's output, and the prefix-cache
faults of ``tests/engines/shims/vllm_faults.py``. Expected values: ``vllm_support.block_hash_recount``
(plain loops with vLLM's own ``make_block_hash_with_group_id`` and ``get_group_id``) and
``block_audit_recount``, at the same moment.

The records' fields and the detection rows are in ``test_vllm_block_audit_real.py``; here, the
check's sweep under a small budget, and the block audit no longer excusing an unhashed block two
tables share because a stale map entry names it.
"""

from __future__ import annotations

import math
import time

import pytest

from otel_swa.views.vllm_block_hashes import BlockHashCheck, block_hash_findings
from shims import vllm_faults
from vllm_support import SchedulerDriver, block_audit_recount, block_hash_recount, make_scheduler, trace_requests
from vllm_support import vllm_classes  # noqa: F401

pytestmark = pytest.mark.vllm

BUDGET = 16


def test_the_check_and_its_budgeted_sweep_against_the_recount_with_stale_entries(vllm_classes, tmp_path):
    """An AsyncScheduler run with stale prefix-cache entries from step 30: at every step the whole
    check equals the recount (counts and first offenders); a sweep of ``BUDGET`` entries a sample
    counts each stale entry within ``2 * ceil(M / BUDGET)`` samples of its appearance (``M`` the
    map's largest size), and sees no fault before the fault was made."""
    started = time.perf_counter()
    v = vllm_classes
    scheduler = make_scheduler(v, tmp_path / "tiny-llama", async_scheduling=True)
    injection = vllm_faults.install(scheduler, "stale_cache_entry@30")
    kv = scheduler.kv_cache_manager
    sweep = BlockHashCheck(budget=BUDGET)
    steps = []

    def on_schedule(output):
        found = block_hash_findings(kv, scheduler.requests)
        recount = block_hash_recount(kv, scheduler.requests)
        assert (found.entries_checked, found.stale_entries, found.foreign_blocks) == (
            recount.checked, len(recount.stale), len(recount.foreign))
        if recount.stale:
            first = found.first_stale
            assert (first.block, first.kv_cache_group) == recount.stale[0]
            assert first.other_request is None or first.other_request in recount.holders[first.block]
        if recount.foreign:
            first = found.first_foreign
            assert (first.request, first.position, first.block, first.kv_cache_group) == recount.foreign[0]
            assert first.other_request is None or first.other_request in recount.holders[first.block]
        one_request = max((sum(len(m.req_to_blocks.get(rid, ())) for m in kv.coordinator.single_type_managers)
                           for rid in scheduler.requests), default=0)
        steps.append((recount, sweep.check(kv, scheduler.requests), len(kv.block_pool.cached_block_hash_to_block),
                      one_request))

    SchedulerDriver(scheduler, on_schedule=on_schedule).run(trace_requests(v))
    made = injection.injected_at
    assert made is not None and made >= 30
    assert all(not r.stale and not r.foreign and not s.stale_entries and not s.foreign_blocks
               for r, s, _, _ in steps[:made - 1])
    largest = max(step[2] for step in steps)
    window = 2 * math.ceil(largest / BUDGET)
    # an entry that stays stale for `window` samples is counted in one of them
    lasting = [i for i in range(len(steps) - window + 1)
               if set.intersection(*(steps[k][0].stale_keys for k in range(i, i + window)))]
    assert len(lasting) > 10  # the stale entries stay: the bound is tested, not vacuous
    for i in lasting:
        assert any(steps[k][1].stale_entries for k in range(i, i + window)), i
    # at most BUDGET map entries and BUDGET - 1 table entries plus one request's tables a sample
    assert all(s.entries_checked <= 2 * BUDGET - 1 + one for _, s, _, one in steps)
    assert sum(s.stale_entries for _, s, _, _ in steps) > 0
    stale_steps = [r for r, _, _, _ in steps if r.stale]
    print(f"\nstale entries: made at step {made}, {len(stale_steps)} steps with stale entries "
          f"(peak {max(len(r.stale) for r in stale_steps)}), map up to {largest} entries; "
          f"{time.perf_counter() - started:.1f} s")


def test_a_stale_entry_no_longer_excuses_an_unhashed_block_two_tables_share(vllm_classes, tmp_path):
    """The KV block audit's inputs count a block as cached only through a good map entry: in a run
    with stale entries, a block without a hash that two requests' tables hold, named by a stale
    entry, is among neither the cached ids nor excused, and its recount calls it shared."""
    v = vllm_classes
    scheduler = make_scheduler(v, tmp_path / "tiny-llama")
    vllm_faults.install(scheduler, "stale_cache_entry@30")
    kv = scheduler.kv_cache_manager
    seen = []

    def on_schedule(output):
        from otel_swa.views import vllm as vllm_view

        audit = block_audit_recount(kv)
        stale = {block for block, _ in block_hash_recount(kv, scheduler.requests).stale}
        cached = set(vllm_view.kv_block_audit_inputs(kv).cached_block_ids.tolist())
        assert cached == {b.block_id for b in kv.block_pool.blocks if b.block_hash is not None}
        seen.extend(b for b in audit.shared if b in stale)

    SchedulerDriver(scheduler, on_schedule=on_schedule).run(trace_requests(v))
    assert seen, "no unhashed block was shared through a stale entry in this run"
