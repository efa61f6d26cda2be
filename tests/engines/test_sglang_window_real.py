"""The sliding-window check against SGLang's real allocator on CPU (sglang 0.5.23; see conftest.py).

SGLang's own ``SWATokenToKVPoolAllocator`` and ``ReqToTokenPool`` hold one request; SGLang's own
``free_swa_out_of_window_slots`` evicts it as ``ScheduleBatch.maybe_evict_swa`` does at a decode
step (``pre_len = seqlen - 1``), with and without a prefix-sharing tree cache; ``free_swa_segment``
(what that eviction calls) frees one in-window page on purpose. Page sizes 1, 64, 128 and 256, with
the window boundary inside a page and on a page edge. Every expected count is worked out by hand
from the positions (the comments say how).
"""

from __future__ import annotations

import pytest
import torch

from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import sglang as adapter

pytestmark = pytest.mark.sglang

SWS = 200  # SGLang's sliding_window_size: attention reads q_pos - 200 .. q_pos, 201 positions
WINDOW = SWS + 1


def one_request(sglang_modules, page_size, seq_len):
    """A request of ``seq_len`` tokens (a prompt of ``seq_len - 1`` and one decode) in SGLang's real
    pools, nothing evicted yet."""
    s = sglang_modules

    class ByHand(s.SglangSim):
        def evict(self, sim_req):  # the test evicts, as SGLang's scheduler would
            pass

    sim = ByHand(page_size=page_size, window=SWS, size=4096, size_swa=4096, max_reqs=2, max_context_len=2048)
    req = sim.admit(seq_len - 1, seq_len + 10)
    assert req is not None and sim.decode(req) and req.seq_len == seq_len
    return sim, req


def evict(sim, req, prefix_sharing):
    from sglang.srt.mem_cache.common import free_swa_out_of_window_slots

    free_swa_out_of_window_slots(
        req.req, req.seq_len - 1, sliding_window_size=SWS, page_size=sim.page_size,
        req_to_token_pool=sim.req_to_token_pool, token_to_kv_pool_allocator=sim.allocator,
        supports_prefix_sharing=prefix_sharing,
    )


def sample(sim, req, allowance):
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda record, context: records.append(record)])
    view = adapter.batch_view(
        sim.allocator, sim.req_to_token_pool, req_pool_indices=torch.tensor([req.row]),
        seq_lens=torch.tensor([req.seq_len]), seq_lens_cpu=[req.seq_len], sliding_window=WINDOW,
        swa_eviction_allowance=allowance,
    )
    reporter.step(view)
    reporter.close()
    (record,) = records
    return record.swa_premature_evictions, record.swa_late_held_slots


def first_held(sim, req):
    """The first position whose SWA mapping is not 0 (what SGLang evicted is a prefix)."""
    row = sim.req_to_token_pool.req_to_token[req.row, : req.seq_len].long()
    held = (sim.allocator.full_to_swa_index_mapping[row] != 0).nonzero()
    return int(held[0]) if held.numel() else req.seq_len


def ceil_to(value, page):
    return -(-value // page) * page


# (page size, seq_len): seq_len - WINDOW, the window's first position, on a page edge or inside a page
CASES = [
    (1, 700), (1, 201 + 333),
    (64, 201 + 640), (64, 201 + 640 + 17),
    (128, 201 + 512), (128, 201 + 512 + 100),
    (256, 201 + 768), (256, 201 + 768 + 255),
]


@pytest.mark.parametrize("page_size, seq_len", CASES)
@pytest.mark.parametrize("prefix_sharing", [True, False], ids=["prefix-sharing", "no-prefix-sharing"])
def test_healthy_eviction_counts_no_premature_eviction(sglang_modules, page_size, seq_len, prefix_sharing):
    sim, req = one_request(sglang_modules, page_size, seq_len)
    evict(sim, req, prefix_sharing)
    # SGLang frees below pre_len - kept, pre_len = seq_len - 1, rounded down to a page; kept is
    # ceil_align(max(SWS, page), page) with prefix sharing, SWS without
    kept = ceil_to(max(SWS, page_size), page_size) if prefix_sharing else SWS
    evicted = (seq_len - 1 - kept) // page_size * page_size
    assert first_held(sim, req) == evicted
    start = seq_len - WINDOW  # the first position the last query reads
    late_without_allowance = start - evicted  # held, older than the window
    assert 0 <= late_without_allowance < kept - SWS + page_size
    assert sample(sim, req, 0) == (0, late_without_allowance)
    window, allowance = adapter.sglang_window(SWS, page_size)
    assert window == WINDOW
    assert sample(sim, req, allowance) == (0, 0)


@pytest.mark.parametrize("page_size, seq_len", CASES)
def test_one_in_window_page_freed_on_purpose_is_counted_exactly(sglang_modules, page_size, seq_len):
    sim, req = one_request(sglang_modules, page_size, seq_len)
    evict(sim, req, True)
    start = seq_len - WINDOW
    page = start // page_size  # the page holding the window's first position (partly before it when inside)
    lo, hi = page * page_size, min((page + 1) * page_size, seq_len)
    assert lo >= first_held(sim, req)  # still held: SGLang keeps at least the window
    row = sim.req_to_token_pool.req_to_token[req.row, lo:hi].long()
    sim.allocator.free_swa_segment(row, start_pos=lo)  # SGLang's own per-segment SWA free
    in_window = hi - max(lo, start)  # the page's positions at or after the window's first one
    assert in_window >= 1
    _, allowance = adapter.sglang_window(SWS, page_size)
    assert sample(sim, req, allowance)[0] == in_window


@pytest.mark.parametrize("page_size, seq_len", CASES)
def test_never_evicting_counts_every_position_past_the_window_and_allowance(sglang_modules, page_size, seq_len):
    sim, req = one_request(sglang_modules, page_size, seq_len)
    _, allowance = adapter.sglang_window(SWS, page_size)
    # positions 0 .. seq_len - WINDOW - allowance - 1 all still hold their SWA slot
    assert sample(sim, req, allowance) == (0, max(0, seq_len - WINDOW - allowance))
    assert sample(sim, req, 0) == (0, seq_len - WINDOW)
