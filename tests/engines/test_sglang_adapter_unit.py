"""The SGLang adapter's engine-neutral parts on hand-built tensors (no SGLang needed)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import sglang as adapter


def test_audit_on_hand_built_pool():
    # page_size 2, SWA pages 1..4 (slots 2..9); free pages: 4.
    # live FULL slots 10, 11 -> SWA 2, 3 (page 1); FULL 12 -> SWA 8 (page 4, on the free list: stale);
    # FULL 13 -> 0 (out of window). Pages 2 and 3 are in use and unreferenced: leaked, 2 x 2 slots.
    mapping = torch.zeros(20, dtype=torch.int64)
    mapping[10], mapping[11], mapping[12] = 2, 3, 8
    audit = adapter.audit_swa_slots(mapping, torch.tensor([4]), 4, 2, torch.tensor([10, 11, 12, 13]))
    assert audit == adapter.SwaSlotAudit(
        page_size=2, live_tokens=4, swa_slots_in_use=6, swa_slots_referenced=2,
        leaked_swa_slots=4, stale_tokens=1, duplicate_swa_slots=0,
    )
    assert not audit.ok


def test_audit_counts_swa_slots_shared_by_two_full_slots_but_not_prefix_sharing():
    mapping = torch.zeros(10, dtype=torch.int64)
    mapping[4], mapping[5] = 1, 1  # two FULL slots, one SWA slot: corrupt
    mapping[6] = 2
    # FULL slot 6 appears twice (two requests sharing a prefix): fine.
    audit = adapter.audit_swa_slots(mapping, torch.tensor([], dtype=torch.int64), 2, 1, torch.tensor([4, 5, 6, 6]))
    assert (audit.duplicate_swa_slots, audit.leaked_swa_slots, audit.stale_tokens) == (1, 0, 0)


def test_audit_rejects_out_of_range_input():
    mapping = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="page_size"):
        adapter.audit_swa_slots(mapping, torch.tensor([1]), 4, 0, torch.tensor([1]))
    with pytest.raises(ValueError, match="free list"):
        adapter.audit_swa_slots(mapping, torch.tensor([9]), 4, 1, torch.tensor([1]))
    with pytest.raises(ValueError, match="live FULL slots"):
        adapter.audit_swa_slots(mapping, torch.tensor([1]), 4, 1, torch.tensor([8]))


def test_batch_view_reads_sglang_attributes_by_reference():
    allocator = SimpleNamespace(full_to_swa_index_mapping=torch.tensor([0, 1, 0, 3, -1]))
    pool = SimpleNamespace(req_to_token=torch.tensor([[0, 0], [1, 2], [3, 0]], dtype=torch.int32))
    batch = SimpleNamespace(req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor([2, 1]), seq_lens_cpu=None)
    view = adapter.batch_view(allocator, pool, batch)
    assert view.req_to_token is pool.req_to_token
    assert view.full_to_swa_index_mapping is allocator.full_to_swa_index_mapping
    assert view.seq_lens_cpu is None
    with pytest.raises(TypeError, match="full_to_swa_index_mapping"):
        adapter.batch_view(SimpleNamespace(), pool, batch)
    # Through the reporter: tokens (row 1) FULL 1 -> 1, FULL 2 -> 0; (row 2) FULL 3 -> 3:
    # 1 out of window, no divergence.
    records = []
    reporter = SwaDivergenceReporter(interval=1, sinks=[lambda r, c: records.append(r)])
    reporter.step(view)
    reporter.close()
    assert (records[0].swa_full_idx_divergence, records[0].swa_out_of_window_tokens) == (0, 1)


def test_hooks_without_allocator_report_zero_and_count_verified_entries():
    lines = []
    reporter = SwaDivergenceReporter(interval=2, sinks=[lambda r, c: lines.append(r.format())])
    hooks = adapter.KvCanaryHooks(reporter)
    for step in (1, 2, 3, 4):
        hooks.observe_after_invoke_plan(group=SimpleNamespace(kind=SimpleNamespace(name="FULL")),
                                        verify_plan=SimpleNamespace(verify_num_valid=torch.tensor([10], dtype=torch.int32)))
        hooks.observe_after_invoke_plan(group="swa", verify_plan=SimpleNamespace(verify_num_valid=torch.tensor([4])))
        hooks.step(outer_step_counter=step, maybe_inaccurate_forward_batch=None)
    hooks.close()
    assert lines == [
        'kv_canary_swa_divergence={"forward_ct":2,"verify_full":20,"verify_swa":8,"swa_full_idx_divergence":0,"swa_out_of_window_tokens":0}',
        'kv_canary_swa_divergence={"forward_ct":4,"verify_full":40,"verify_swa":16,"swa_full_idx_divergence":0,"swa_out_of_window_tokens":0}',
    ]
    assert hooks.verify_total_count_device.tolist() == [40, 16]
    with pytest.raises(ValueError, match="pool kind"):
        adapter.observe_verified(reporter, "mamba", 1)
    with pytest.raises(ValueError, match="one count"):
        adapter.observe_verified(reporter, "full", torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="req_to_token_pool"):
        adapter.KvCanaryHooks(reporter, swa_allocator=object())


def test_hooks_step_errors_are_counted_and_logged_once_per_kind_never_raised(caplog):
    reporter = SwaDivergenceReporter(interval=2)
    allocator = SimpleNamespace(full_to_swa_index_mapping=torch.zeros(8, dtype=torch.int64))
    pool = SimpleNamespace(req_to_token=torch.zeros((2, 4), dtype=torch.int32))
    hooks = adapter.KvCanaryHooks(reporter, swa_allocator=allocator, req_to_token_pool=pool)
    broken = SimpleNamespace()  # no req_pool_indices: batch_view raises TypeError, at sampling steps only
    with caplog.at_level(logging.ERROR, logger="otel_swa.views.sglang"):
        for step in range(1, 6):
            hooks.step(outer_step_counter=step, maybe_inaccurate_forward_batch=broken)
        assert hooks.step_errors == 2  # steps 2 and 4
        # the view is built but the reporter rejects it (4 lengths for 1 index): a second kind
        bad = SimpleNamespace(req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([1, 1, 1, 1]),
                              seq_lens_cpu=None)
        hooks.step(outer_step_counter=6, maybe_inaccurate_forward_batch=bad)
    assert hooks.step_errors == 3
    assert reporter.forward_ct == 6
    logged = [r for r in caplog.records if r.name == "otel_swa.views.sglang"]
    assert len(logged) == 2 and all(r.exc_info for r in logged)
    assert "TypeError" in logged[0].getMessage() and "ValueError" in logged[1].getMessage()
    hooks.close()


def test_sglang_audit_gathers_exactly_the_live_tokens_of_every_request():
    # page_size 1, SWA slots 1..4, slot 4 free. Row 1 holds FULL 5, 6, 7 (live 3 of 4 positions),
    # row 2 holds FULL 8, 9 (live 2). FULL 5 -> SWA 1, 6 -> 0 (out of window), 7 -> 2,
    # 8 -> 4 (on the free list: stale), 9 -> 0; FULL 10 -> 3 is held by no request: SWA 3 leaked.
    mapping = torch.zeros(12, dtype=torch.int64)
    mapping[5], mapping[7], mapping[8], mapping[10] = 1, 2, 4, 3
    allocator = SimpleNamespace(
        full_to_swa_index_mapping=mapping, page_size=1,
        swa_attn_allocator=SimpleNamespace(free_pages=torch.tensor([4]), size=4),
    )
    pool = SimpleNamespace(req_to_token=torch.tensor([[0, 0, 0, 0], [5, 6, 7, 10], [8, 9, 0, 0]], dtype=torch.int32))
    audit = adapter.audit_sglang_swa_slots(allocator, pool, [1, 2], [3, 2])
    assert (audit.live_tokens, audit.stale_tokens, audit.leaked_swa_slots, audit.duplicate_swa_slots) == (5, 1, 1, 0)
    # FULL 10 held by the prefix cache: nothing leaked any more
    held = adapter.audit_sglang_swa_slots(allocator, pool, [1, 2], [3, 2], held_full_slots=torch.tensor([10]))
    assert (held.live_tokens, held.leaked_swa_slots) == (6, 0)
    none = adapter.audit_sglang_swa_slots(allocator, pool, [], [])
    assert (none.live_tokens, none.stale_tokens) == (0, 0)
    with pytest.raises(ValueError, match="req_pool_index 3 is outside"):
        adapter.audit_sglang_swa_slots(allocator, pool, [3], [1])
    with pytest.raises(ValueError, match="seq_len 5 is outside"):
        adapter.audit_sglang_swa_slots(allocator, pool, [1], [5])
    with pytest.raises(ValueError, match="2 entries but seq_lens has 1"):
        adapter.audit_sglang_swa_slots(allocator, pool, [1, 2], [1])


def test_log_line_sink_writes_the_sglang_line_to_sglang_logger(caplog):
    from otel_swa.logline import LogLineSink
    from otel_swa.record import SwaDivergenceRecord

    sink = adapter.log_line_sink()
    assert isinstance(sink, LogLineSink)
    with caplog.at_level(logging.INFO, logger="sglang.srt.kv_canary.runner.swa_divergence"):
        sink(SwaDivergenceRecord(20, 100, 40, 3, 7), None)
    assert [(r.name, r.getMessage()) for r in caplog.records] == [(
        "sglang.srt.kv_canary.runner.swa_divergence",
        'kv_canary_swa_divergence={"forward_ct":20,"verify_full":100,"verify_swa":40,'
        '"swa_full_idx_divergence":3,"swa_out_of_window_tokens":7}',
    )]


# ---------------------------------------------------------------- holders from the scheduler
def _req(row, allocated):
    return SimpleNamespace(kv=SimpleNamespace(req_pool_idx=row, kv_allocated_len=allocated))


def _scheduler(free_slots, *, running=(), queued=(), tree=(), waiting=()):
    """Stands in for SGLang 0.5.23's Scheduler: only the attributes the holder list reads (its
    req_to_token pool with rows 1..4, the running batch, the overlap scheduler's result queue of
    (batch copy, result), the waiting queue and the radix tree's flattened slots)."""
    req_to_token = torch.arange(5 * 6, dtype=torch.int32).reshape(5, 6)
    return SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token, size=4, free_slots=list(free_slots)),
        running_batch=SimpleNamespace(reqs=list(running)),
        result_queue=[(SimpleNamespace(reqs=list(queued)), object())],
        waiting_queue=list(waiting),
        chunked_req=None,
        tree_cache=SimpleNamespace(all_values_flatten=lambda: torch.tensor(list(tree), dtype=torch.int64)),
    )


def test_holders_are_every_requests_allocated_positions_and_the_tree():
    scheduler = _scheduler([3, 4], running=[_req(1, 2)], queued=[_req(2, 3)], tree=[100, 101])
    holders = adapter.scheduler_holder_full_slots(scheduler, SimpleNamespace(reqs=[_req(1, 2)]))
    # row 1: slots 6, 7; row 2 (a finished request still queued for release): 12, 13, 14; tree: 100, 101
    assert sorted(holders.tolist()) == [6, 7, 12, 13, 14, 100, 101]


def test_holders_are_none_when_an_allocated_row_belongs_to_no_request_found():
    # rows 1 and 2 allocated, only row 1's request is known: an audit would report row 2's pages
    # as leaked, so there is no holder list (and no audit) for this sample
    scheduler = _scheduler([3, 4], running=[_req(1, 2)])
    assert adapter.scheduler_holder_full_slots(scheduler) is None


def test_hooks_skip_the_audit_when_holders_are_unknown_and_audit_otherwise():
    mapping = torch.arange(40, dtype=torch.int64)
    allocator = SimpleNamespace(
        full_to_swa_index_mapping=mapping, page_size=1,
        swa_attn_allocator=SimpleNamespace(free_pages=torch.tensor([39]), size=39),
    )
    pool = SimpleNamespace(req_to_token=torch.arange(12, dtype=torch.int32).reshape(2, 6))
    batch = SimpleNamespace(req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([6]), seq_lens_cpu=None)
    answers = [None, torch.arange(1, 39)]
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: records.append(r)])
    hooks = adapter.KvCanaryHooks(reporter, swa_allocator=allocator, req_to_token_pool=pool,
                                  holder_full_slots=lambda: answers.pop(0))
    hooks.step(outer_step_counter=1, maybe_inaccurate_forward_batch=batch)
    hooks.step(outer_step_counter=2, maybe_inaccurate_forward_batch=batch)
    assert [r.audited for r in records] == [False, True]
    assert (records[1].swa_leaked_slots, records[1].swa_stale_tokens) == (0, 0)


# ------------------------------------------------------------------ the sliding-window check
SWS = 200  # SGLang's sliding_window_size: its attention reads q_pos - 200 .. q_pos


def test_the_window_is_one_more_than_sglangs_and_the_allowance_what_it_keeps():
    # page 1, interval 1: SGLang frees below seqlen - 1 - 200: nothing past the window is kept
    assert adapter.sglang_window(SWS, 1) == (201, 0)
    # SGLANG_SWA_EVICTION_INTERVAL=128 (sglang 0.5.23's default): up to 127 tokens wait past the window
    assert adapter.sglang_window(SWS, 1, 128) == (201, 127)
    # page 64: ceil_align(200, 64) = 256 kept before pre_len, 56 past the window, + 63 of page rounding
    assert adapter.sglang_window(SWS, 64) == (201, 56 + 63)
    assert adapter.sglang_window(SWS, 256) == (201, 56 + 255)
    assert adapter.sglang_window(SWS, 256, 512) == (201, 511)
    with pytest.raises(ValueError, match="page_size must be an int >= 1, got 0"):
        adapter.sglang_window(SWS, 0)


def _pool():
    req_to_token = torch.zeros((2, 32), dtype=torch.int32)
    req_to_token[1, :20] = torch.arange(1, 21)
    return SimpleNamespace(full_to_swa_index_mapping=torch.arange(40)), SimpleNamespace(req_to_token=req_to_token)


@pytest.mark.parametrize("extend", [False, True])
def test_an_extend_batch_counts_no_late_held_slot(extend):
    allocator, pool = _pool()
    mode = SimpleNamespace(is_extend=lambda: extend)
    batch = SimpleNamespace(req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([20]), seq_lens_cpu=[20],
                            forward_mode=mode, extend_seq_lens_cpu=[4] if extend else None)
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda record, context: records.append(record)])
    reporter.step(adapter.batch_view(allocator, pool, batch, sliding_window=5, swa_eviction_allowance=2))
    reporter.close()
    # every position holds its slot: 20 - 5 - 2 = 13 are older than the window and the allowance,
    # which a prefill holds by design (SGLang evicts from the second decode step on)
    assert (records[0].swa_premature_evictions, records[0].swa_late_held_slots) == (0, 0 if extend else 13)


def _window_record(allocator, pool, batch, **kwargs):
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda record, context: records.append(record)])
    reporter.step(adapter.batch_view(allocator, pool, batch, sliding_window=5, swa_eviction_allowance=2, **kwargs))
    reporter.close()
    return records[0].swa_premature_evictions, records[0].swa_late_held_slots


@pytest.mark.parametrize("lengths_from", ["ForwardBatch", "ScheduleBatch", "given"])
def test_an_extend_batch_reads_from_its_first_querys_window(lengths_from):
    """A ForwardBatch (stand-in: SGLang's ``ForwardBatch`` fields the view reads) extending row 1 by
    its second chunk, positions 12..19 (``extend_seq_lens_cpu`` [8]), window 5 (sliding_window_size
    4): query 12 reads 8..12, so positions 8..19 are read. Position 10 (FULL slot 11), the first
    chunk's tail, freed: 1 premature eviction; a decode reading 15..19 would not see it."""
    allocator, pool = _pool()
    allocator.full_to_swa_index_mapping[11] = 0
    fields = {"ForwardBatch": {"extend_seq_lens_cpu": [8]}, "ScheduleBatch": {"extend_lens": [8]}, "given": {}}
    batch = SimpleNamespace(req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([20]), seq_lens_cpu=[20],
                            forward_mode=SimpleNamespace(is_extend=lambda: True), **fields[lengths_from])
    given = {"extend_lens_cpu": [8]} if lengths_from == "given" else {}
    assert _window_record(allocator, pool, batch, **given) == (1, 0)
    decode = SimpleNamespace(req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([20]), seq_lens_cpu=[20],
                             forward_mode=SimpleNamespace(is_extend=lambda: False))
    assert _window_record(allocator, pool, decode) == (0, 20 - 5 - 2 - 1)  # position 10 freed: not held


def test_a_mixed_batch_takes_each_requests_extend_length():
    """SGLang's MIXED mode (``is_extend()`` true): row 1 extends by 8 (reads 8..19 with window 5),
    row 2 decodes (``extend_seq_lens_cpu`` 1: reads 15..19). Both rows have FULL slots 1..20 here;
    slot 11 (position 10) freed: premature in row 1 only."""
    allocator, pool = _pool()
    pool.req_to_token = torch.cat([pool.req_to_token, pool.req_to_token[1:2]])
    allocator.full_to_swa_index_mapping[11] = 0
    batch = SimpleNamespace(req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor([20, 20]),
                            seq_lens_cpu=[20, 20], forward_mode=SimpleNamespace(is_extend=lambda: True),
                            extend_seq_lens_cpu=[8, 1])
    assert _window_record(allocator, pool, batch) == (1, 0)


def test_an_extend_batch_without_its_extend_lengths_gets_no_window_check():
    allocator, pool = _pool()
    allocator.full_to_swa_index_mapping[11] = 0
    batch = SimpleNamespace(req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([20]), seq_lens_cpu=[20],
                            forward_mode=SimpleNamespace(is_extend=lambda: True), extend_seq_lens_cpu=[8, 8])
    view = adapter.batch_view(allocator, pool, batch, sliding_window=5, swa_eviction_allowance=2)
    assert (view.sliding_window, view.swa_eviction_allowance, view.extend_lens_cpu) == (None, None, None)
    assert _window_record(allocator, pool, batch) == (None, None)


@pytest.mark.parametrize("extend", [False, True])
def test_the_per_request_swa_ring_gets_no_window_check(extend):
    """Stand-in for SGLang's ``SWATokenToKVPoolAllocator`` in per-request SWA ring mode
    (``swa_req_ring`` true, sglang 0.5.23 ``srt/mem_cache/allocator/swa.py``): ring mode never
    writes ``full_to_swa_index_mapping``, so every mapping entry is 0. With a window every
    in-window token would count as premature; the view carries none."""
    _, pool = _pool()
    ring = SimpleNamespace(full_to_swa_index_mapping=torch.zeros(40, dtype=torch.int64), swa_req_ring=True)
    batch = SimpleNamespace(req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([20]), seq_lens_cpu=[20],
                            forward_mode=SimpleNamespace(is_extend=lambda: extend), extend_seq_lens_cpu=[8])
    view = adapter.batch_view(ring, pool, batch, sliding_window=5, swa_eviction_allowance=2)
    assert (view.sliding_window, view.swa_eviction_allowance, view.extend_lens_cpu) == (None, None, None)
    assert _window_record(ring, pool, batch) == (None, None)
    # the paged mode of the same allocator (swa_req_ring false) keeps the check: 5 (decode) or
    # 5 + 8 - 1 = 12 (extend) in-window tokens without a slot
    paged = SimpleNamespace(full_to_swa_index_mapping=torch.zeros(40, dtype=torch.int64), swa_req_ring=False)
    assert _window_record(paged, pool, batch)[0] == (12 if extend else 5)


def test_hooks_carry_the_window_into_every_view():
    allocator, pool = _pool()
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda record, context: records.append(record)])
    allocator.full_to_swa_index_mapping[18] = 0  # position 17, inside the window of 5 (15 .. 19)
    hooks = adapter.KvCanaryHooks(reporter, swa_allocator=allocator, req_to_token_pool=pool,
                                  sliding_window=5, swa_eviction_allowance=0)
    batch = SimpleNamespace(req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([20]), seq_lens_cpu=[20])
    hooks.step(outer_step_counter=1, maybe_inaccurate_forward_batch=batch)
    hooks.close()
    assert hooks.step_errors == 0
    assert (records[0].swa_premature_evictions, records[0].swa_late_held_slots) == (1, 15)
