"""The sliding-window check against SGLang's real allocator on CPU (sglang 0.5.23; see conftest.py).

SGLang's own ``SWATokenToKVPoolAllocator`` and ``ReqToTokenPool`` hold one request; SGLang's own
``free_swa_out_of_window_slots`` evicts it as ``ScheduleBatch.maybe_evict_swa`` does at a decode
step (``pre_len = seqlen - 1``), with and without a prefix-sharing tree cache; ``free_swa_segment``
(what that eviction calls) frees one in-window page on purpose. Page sizes 1, 64, 128 and 256, with
the window boundary inside a page and on a page edge. An extend (chunked prefill) batch too: its
next chunk allocated by SGLang's ``alloc``/``alloc_extend``, evicted as ``maybe_evict_swa`` does
before an extend forward (``pre_len = prefix_lens[i]``), the previous chunk's tail page freed on
purpose. Every expected count is worked out by hand from the positions (the comments say how).
"""

from __future__ import annotations

from types import SimpleNamespace

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


# ------------------------------------------------------------------ an extend (chunked prefill) batch
def chunked_request(sglang_modules, page_size, prefix_len, extend_len):
    """A request whose first chunk (``prefix_len`` prompt tokens) is in SGLang's real pools and
    whose next chunk (``extend_len`` more) has just been allocated, as ``ScheduleBatch`` does before
    the extend forward; nothing evicted yet. Returns ``(sim, req)``, ``req.seq_len = prefix_len +
    extend_len``."""
    s = sglang_modules

    class ByHand(s.SglangSim):
        def evict(self, sim_req):  # the test evicts, as SGLang's scheduler would
            pass

    sim = ByHand(page_size=page_size, window=SWS, size=4096, size_swa=4096, max_reqs=2, max_context_len=2048)
    req = sim.admit(prefix_len, prefix_len + extend_len + 10)
    assert req is not None
    slots = sim._alloc_tokens(req, req.row, prefix_len, extend_len)  # SGLang's alloc / alloc_extend
    assert slots is not None
    sim.req_to_token_pool.req_to_token[req.row, prefix_len:prefix_len + extend_len] = slots.to(torch.int32)
    req.seq_len = prefix_len + extend_len
    req.req.kv.kv_allocated_len = req.seq_len
    return sim, req


def evict_for_extend(sim, req, prefix_len, prefix_sharing):
    """SGLang's eviction before an extend forward (``ScheduleBatch.maybe_evict_swa``: ``pre_len =
    prefix_lens[i]``, without overlap scheduling)."""
    from sglang.srt.mem_cache.common import free_swa_out_of_window_slots

    free_swa_out_of_window_slots(
        req.req, prefix_len, sliding_window_size=SWS, page_size=sim.page_size,
        req_to_token_pool=sim.req_to_token_pool, token_to_kv_pool_allocator=sim.allocator,
        supports_prefix_sharing=prefix_sharing,
    )


def sample_extend(sim, req, extend_len):
    """The window counts of the extend batch as the instrumentor samples it: the ``ForwardBatch``
    fields SGLang sets for an extend forward (``forward_mode.is_extend()``, ``extend_seq_lens_cpu``),
    the window and allowance of :func:`sglang_window`."""
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda record, context: records.append(record)])
    window, allowance = adapter.sglang_window(SWS, sim.page_size)
    batch = SimpleNamespace(
        req_pool_indices=torch.tensor([req.row]), seq_lens=torch.tensor([req.seq_len]), seq_lens_cpu=[req.seq_len],
        forward_mode=SimpleNamespace(is_extend=lambda: True), extend_seq_lens_cpu=[extend_len],
    )
    reporter.step(adapter.batch_view(sim.allocator, sim.req_to_token_pool, batch, sliding_window=window,
                                     swa_eviction_allowance=allowance))
    reporter.close()
    (record,) = records
    return record.swa_premature_evictions, record.swa_late_held_slots


# (page size, prefix_len, extend_len): the previous chunk ends on a page edge or inside a page; every
# chunk at least as long as the window (WINDOW = 201), as SGLang's chunked_prefill_size usually is
EXTEND_CASES = [
    (1, 300, 256), (1, 257, 512),
    (64, 640, 256), (64, 640 + 17, 256),
    (128, 512, 512), (128, 512 + 100, 256),
    (256, 768, 256), (256, 768 + 255, 512),
]


@pytest.mark.parametrize("page_size, prefix_len, extend_len", EXTEND_CASES)
@pytest.mark.parametrize("prefix_sharing", [True, False], ids=["prefix-sharing", "no-prefix-sharing"])
def test_an_extend_batch_after_sglangs_own_eviction_counts_no_premature_eviction(
        sglang_modules, page_size, prefix_len, extend_len, prefix_sharing):
    sim, req = chunked_request(sglang_modules, page_size, prefix_len, extend_len)
    evict_for_extend(sim, req, prefix_len, prefix_sharing)
    # SGLang frees below prefix_len - kept (kept = SWS without prefix sharing), rounded down to a
    # page; the chunk's first query, at prefix_len, reads from prefix_len - SWS on
    kept = ceil_to(max(SWS, page_size), page_size) if prefix_sharing else SWS
    evicted = (prefix_len - kept) // page_size * page_size
    assert first_held(sim, req) == evicted > 0
    assert evicted <= prefix_len - SWS  # nothing the chunk reads was freed
    assert sample_extend(sim, req, extend_len) == (0, 0)


@pytest.mark.parametrize("page_size, prefix_len, extend_len", EXTEND_CASES)
def test_the_previous_chunks_tail_freed_on_purpose_is_counted_exactly(sglang_modules, page_size, prefix_len,
                                                                       extend_len):
    """The sgl-project/sglang#8649 / #23982 class: the page holding the previous chunk's last
    position freed before the extend forward. The chunk's first query (at ``prefix_len``) reads
    ``prefix_len - SWS .. prefix_len``; a check of the last WINDOW positions only (``seq_len -
    WINDOW`` on, past ``prefix_len`` since the chunk is at least WINDOW long) would count none."""
    sim, req = chunked_request(sglang_modules, page_size, prefix_len, extend_len)
    evict_for_extend(sim, req, prefix_len, False)
    lo = (prefix_len - 1) // page_size * page_size
    hi = min(lo + page_size, req.seq_len)
    row = sim.req_to_token_pool.req_to_token[req.row, lo:hi].long()
    sim.allocator.free_swa_segment(row, start_pos=lo)  # SGLang's own per-segment SWA free
    oldest_read = prefix_len - SWS
    expected = hi - max(lo, oldest_read)  # the page's positions the chunk's queries read
    assert expected >= 1 and req.seq_len - WINDOW >= hi  # invisible to the last WINDOW positions
    assert sample_extend(sim, req, extend_len) == (expected, 0)
