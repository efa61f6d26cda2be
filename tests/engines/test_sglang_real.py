"""The SGLang adapter against SGLang's real allocator on CPU (sglang 0.5.23; see conftest.py).

Every expected value is a plain-Python recount over ``req_to_token`` and the mapping, or the output
of SGLang's own functions (``compute_swa_*`` and ``SwaDivergenceLog`` of its KV canary).
"""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import pytest
import torch

from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import sglang as adapter

pytestmark = pytest.mark.sglang

STEPS = 300
WINDOW = 16


def _collect():
    records = []
    return records, lambda record, context: records.append(record)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("host_lens", [True, False], ids=["live-gather", "dense-gather"])
def test_counts_match_recount_over_random_steps(sglang_modules, page_size, host_lens):
    s = sglang_modules
    sim = s.SglangSim(page_size=page_size, window=WINDOW, seed=7 + page_size)
    records, sink = _collect()
    reporter = SwaDivergenceReporter(interval=1, device="cpu", ring_size=4, sinks=[sink])
    expected = {}
    for _ in range(STEPS):
        sim.step()
        batch = sim.forward_batch()
        if not host_lens:
            batch.seq_lens_cpu = None
        reporter.step(adapter.batch_view(sim.allocator, sim.req_to_token_pool, batch))
        divergence, out_of_window = sim.recount()
        # SGLang's own dense computation agrees with the plain recount.
        assert int(s.compute_swa_full_idx_divergence(
            swa_allocator=sim.allocator, req_to_token_pool=sim.req_to_token_pool,
            maybe_inaccurate_forward_batch=batch)) == divergence
        assert int(s.compute_swa_out_of_window_tokens(
            swa_allocator=sim.allocator, req_to_token_pool=sim.req_to_token_pool,
            maybe_inaccurate_forward_batch=batch)) == out_of_window
        expected[reporter.forward_ct] = (divergence, out_of_window)
    reporter.close()
    got = {r.forward_ct: (r.swa_full_idx_divergence, r.swa_out_of_window_tokens) for r in records}
    assert got == expected
    # The run really exercised eviction and SWA slot reuse.
    assert max(d for d, _ in expected.values()) >= 1
    assert max(o for _, o in expected.values()) >= 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_fresh_pools_map_identity_and_divergence_needs_reuse(sglang_modules, page_size):
    s = sglang_modules
    sim = s.SglangSim(page_size=page_size, window=WINDOW, size=256, size_swa=128)
    req = sim.admit(8, 100)
    view = adapter.batch_view(sim.allocator, sim.req_to_token_pool, sim.forward_batch())
    rows = view.req_to_token[req.row, :8].long()
    assert view.full_to_swa_index_mapping[rows].tolist() == rows.tolist()
    assert sim.recount() == (0, 0)
    # Decode past the window: the oldest whole pages are freed (mapping 0).
    for _ in range(40):
        assert sim.decode(req)
    evicted = sum(1 for v in view.full_to_swa_index_mapping[view.req_to_token[req.row, :48].long()].tolist() if v == 0)
    assert evicted >= 48 - WINDOW - page_size and evicted % page_size == 0
    divergence, out_of_window = sim.recount()
    assert out_of_window == evicted
    if page_size == 1:
        # Freed SWA slots go to the end of the free list: no reuse yet, so no remap.
        assert divergence == 0
    else:
        # The paged allocator hands freed SWA pages out first: remaps come in whole pages.
        assert divergence >= page_size and divergence % page_size == 0


def test_hooks_log_the_line_sglang_logs_byte_for_byte(sglang_modules, caplog):
    """Same allocator, same batches: SGLang's own reporter code and our hooks log identical lines."""
    s = sglang_modules
    from sglang.srt.kv_canary.runner.swa_divergence import SwaDivergenceReporter as SglangReporter

    sim = s.SglangSim(page_size=4, window=WINDOW, seed=3)
    ours_stream, theirs_stream = io.StringIO(), io.StringIO()
    fmt = logging.Formatter("[%(asctime)s TP0] %(message)s")
    ours_log = logging.getLogger("otel_swa.test.ours")
    theirs_log = logging.getLogger(adapter.SGLANG_LOGGER_NAME)
    handlers = []
    for log, stream in ((ours_log, ours_stream), (theirs_log, theirs_stream)):
        handler = logging.StreamHandler(stream)
        handler.setFormatter(fmt)
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        handlers.append((log, handler))
    try:
        reporter = SwaDivergenceReporter.from_env(
            device="cpu",
            sinks=[adapter.log_line_sink(ours_log)],
            environ={"SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": "20"},
        )
        hooks = adapter.KvCanaryHooks(reporter, swa_allocator=sim.allocator, req_to_token_pool=sim.req_to_token_pool)
        # SGLang's real reporter; its delayed device-to-host handler needs CUDA pinned memory, so
        # the test runs its two halves itself, back to back (what the handler does one step later).
        theirs = SglangReporter(device=torch.device("cpu"), d2h_stream=None, interval=20,
                                swa_allocator=sim.allocator, req_to_token_pool=sim.req_to_token_pool)
        for outer in range(1, 201):
            sim.step()
            batch = sim.forward_batch()
            full = sum(r.seq_len for r in sim.requests)
            swa = sum(min(r.seq_len, WINDOW) for r in sim.requests)
            for kind, count in ((s.PoolKind.FULL, full), (s.PoolKind.SWA, swa)):
                plan = SimpleNamespace(verify_num_valid=torch.tensor([count], dtype=torch.int32))
                group = SimpleNamespace(kind=kind)
                hooks.observe_after_invoke_plan(group=group, verify_plan=plan)
                theirs.observe_after_invoke_plan(group=group, verify_plan=plan)
            hooks.step(outer_step_counter=outer, maybe_inaccurate_forward_batch=batch)
            theirs._forward_ct += 1
            staged = theirs._compute_on_device(outer_step_counter=outer, maybe_inaccurate_forward_batch=batch)
            if staged is not None:
                theirs._postprocess_on_host({k: (v.clone() if torch.is_tensor(v) else v) for k, v in staged.items()})
        hooks.close()
    finally:
        for log, handler in handlers:
            log.removeHandler(handler)
    ours = s.SwaDivergenceLog.find_all(ours_stream.getvalue())
    theirs_found = s.SwaDivergenceLog.find_all(theirs_stream.getvalue())
    assert len(theirs_found) == 10
    assert [text for _, text in ours] == [text for _, text in theirs_found]
    # SGLang's e2e rule (assert_swa_divergence_observed): peaks >= 1, verify lag on the last line.
    assert max(p.swa_out_of_window_tokens for p, _ in ours) >= 1
    assert max(p.swa_full_idx_divergence for p, _ in ours) >= 1
    assert ours[-1][0].verify_swa < ours[-1][0].verify_full


# ----------------------------------------------------------------------------- leak / stale audit


def _audit(sim):
    return adapter.audit_sglang_swa_slots(
        sim.allocator, sim.req_to_token_pool, [r.row for r in sim.requests], [r.seq_len for r in sim.requests]
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_audit_is_clean_on_a_healthy_run(sglang_modules, page_size):
    sim = sglang_modules.SglangSim(page_size=page_size, window=WINDOW, seed=11)
    for step in range(150):
        sim.step()
        if step % 15 == 0:
            audit = _audit(sim)
            assert (audit.leaked_swa_slots, audit.stale_tokens, audit.duplicate_swa_slots) == (0, 0, 0)
            # In-use slots agree with the allocator's own count of free ones.
            assert audit.swa_slots_in_use == sim.size_swa - sim.allocator.swa_available_size()
            assert audit.live_tokens == sum(r.seq_len for r in sim.requests)


def _sim_after_60_steps(sglang_modules, page_size: int, seed: int):
    """A simulated SGLang run (window ``WINDOW``) after 60 steps: requests live, some tokens out of
    the window."""
    sim = sglang_modules.SglangSim(page_size=page_size, window=WINDOW, seed=seed)
    for _ in range(60):
        sim.step()
    return sim


def _mapped_token(sim):
    mapping = sim.allocator.full_to_swa_index_mapping
    for r in sim.requests:
        for pos in range(r.seq_len - 1, -1, -1):
            full = int(sim.req_to_token_pool.req_to_token[r.row, pos])
            if int(mapping[full]) > 0:
                return full, int(mapping[full])
    raise AssertionError("no live token holds an SWA slot")


@pytest.mark.parametrize("page_size", [1, 4])
def test_audit_finds_a_leaked_swa_page(sglang_modules, page_size):
    sim = _sim_after_60_steps(sglang_modules, page_size, seed=5)
    full, _ = _mapped_token(sim)
    # The fault: forget the FULL page's SWA peers without freeing them (what a lost free does).
    page_start = full // page_size * page_size
    sim.allocator.clear_full_to_swa_mapping(torch.arange(page_start, page_start + page_size))
    audit = _audit(sim)
    assert audit.leaked_swa_slots == page_size
    assert audit.stale_tokens == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_audit_finds_stale_tokens_of_a_freed_swa_page(sglang_modules, page_size):
    sim = _sim_after_60_steps(sglang_modules, page_size, seed=9)
    _, swa = _mapped_token(sim)
    swa_page = swa // page_size
    # The fault: return the SWA page to the free list while live tokens still map to it.
    sim.allocator.swa_attn_allocator.free_page_ids(torch.tensor([swa_page]))
    mapping = sim.allocator.full_to_swa_index_mapping.tolist()
    r2t = sim.req_to_token_pool.req_to_token.tolist()
    expected = sum(
        1
        for r in sim.requests
        for pos in range(r.seq_len)
        if mapping[r2t[r.row][pos]] > 0 and mapping[r2t[r.row][pos]] // page_size == swa_page
    )
    audit = _audit(sim)
    assert expected >= 1
    assert audit.stale_tokens == expected
    assert audit.leaked_swa_slots == 0


def test_audit_refuses_an_open_free_group(sglang_modules):
    sim = sglang_modules.SglangSim(page_size=1, window=WINDOW)
    sim.allocator.free_group_begin()
    with pytest.raises(RuntimeError, match="free group"):
        _audit(sim)
    sim.allocator.free_group_end()


def _holders(sim):
    r2t = sim.req_to_token_pool.req_to_token
    parts = [r2t[r.row, : r.seq_len] for r in sim.requests]
    return torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.int64)


@pytest.mark.parametrize("page_size", [1, 4])
def test_reporter_audits_the_real_allocator_in_its_sample(sglang_modules, page_size):
    """Through the reporter's own device pass: clean, then a leaked page, on SGLang's allocator."""
    sim = _sim_after_60_steps(sglang_modules, page_size, seed=5)
    records, sink = _collect()
    reporter = SwaDivergenceReporter(1, sinks=[sink])

    def sample():
        view = adapter.batch_view(
            sim.allocator, sim.req_to_token_pool,
            req_pool_indices=torch.tensor([r.row for r in sim.requests]),
            seq_lens=torch.tensor([r.seq_len for r in sim.requests]),
            holder_full_slots=_holders(sim),
        )
        reporter.step(view)
        reporter.flush()
        return records[-1]

    healthy = sample()
    host = _audit(sim)
    assert (healthy.swa_leaked_slots, healthy.swa_stale_tokens, healthy.swa_shared_slots) == (0, 0, 0)
    assert (host.leaked_swa_slots, host.stale_tokens) == (0, 0)
    full, _ = _mapped_token(sim)
    page_start = full // page_size * page_size
    sim.allocator.clear_full_to_swa_mapping(torch.arange(page_start, page_start + page_size))
    faulty = sample()
    assert faulty.swa_leaked_slots == page_size == _audit(sim).leaked_swa_slots
    assert faulty.format() == faulty.replace(swa_leaked_slots=None, swa_stale_tokens=None, swa_shared_slots=None).format()
