"""KV cache invariants of the reference engine after every forward step of a real-trace replay."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.reference.scheduler import RequestTooLargeError
from otel_swa.reference.trace import TraceRequest, load_trace


def check_invariants(engine, config):
    """Recount the pools in plain Python from req_to_token, the mapping and the free lists.

    Returns (divergent live tokens, out-of-window live tokens) of the running requests.
    """
    ps, window = config.page_size, config.window
    mapping = engine.pools.full_to_swa_index_mapping.tolist()
    req_to_token = engine.pools.req_to_token
    free_full = engine.free_full_slots()
    free_swa = engine.free_swa_slots()
    owned_full, owned_swa = [], []
    full_pages_held = swa_pages_held = 0
    divergent = out_of_window = 0
    for req in engine.running:
        seq_len = req.slots.seq_len
        row = req_to_token[req.slots.row, :seq_len].tolist()
        evicted = max(0, seq_len - window) // ps * ps  # whole pages, a prefix
        pages = -(-seq_len // ps)
        full_pages_held += pages
        swa_pages_held += pages - evicted // ps
        swa_row = [mapping[full] for full in row]
        assert not any(swa_row[:evicted]), f"request {req.rid}: a position < {evicted} left the window but keeps its SWA slot"
        live_swa = swa_row[evicted:]
        assert all(live_swa), f"request {req.rid}: a position >= {evicted} (seq_len {seq_len}) lost its SWA slot"
        if ps > 1:  # position p sits at offset p % ps of its FULL page and of its SWA page
            assert [full % ps for full in row] == [p % ps for p in range(seq_len)]
            assert [swa % ps for swa in live_swa] == [p % ps for p in range(evicted, seq_len)]
        out_of_window += evicted
        divergent += sum(1 for swa, full in zip(live_swa, row[evicted:]) if swa != full)
        owned_full.extend(row)
        owned_swa.extend(live_swa)
    # no slot owned twice; slot 0 (page 0) never handed out
    assert len(set(owned_full)) == len(owned_full)
    assert len(set(owned_swa)) == len(owned_swa)
    all_full, all_swa = owned_full + free_full, owned_swa + free_swa
    assert min(all_full, default=ps) >= ps and min(all_swa, default=ps) >= ps
    assert max(all_full, default=0) < config.full_pool_size + ps
    assert max(all_swa, default=0) < config.swa_pool_size + ps
    # free lists hold no duplicates and nothing in use
    assert len(set(free_full)) == len(free_full) and not set(free_full) & set(owned_full)
    assert len(set(free_swa)) == len(free_swa) and not set(free_swa) & set(owned_swa)
    # in use == referenced pages x page size: nothing leaked, nothing over-allocated
    assert config.full_pool_size - len(free_full) == full_pages_held * ps
    assert config.swa_pool_size - len(free_swa) == swa_pages_held * ps
    # no mapping entry outside the live tokens
    assert sum(1 for value in mapping if value != 0) == len(owned_swa)
    return divergent, out_of_window


@pytest.mark.parametrize("page_size", [1, 4])
def test_invariants_after_every_step_of_a_code_trace_replay(page_size):
    config = EngineConfig(
        window=64, full_pool_size=16384, swa_pool_size=4096, page_size=page_size, max_running=16,
        token_budget=1024, max_context_len=8192, run_model=False,
    )
    engine = ReferenceEngine(config)
    # 80 requests: the FULL pool is as close to full as with 200 (213 slots free at the least, both
    # page sizes), in 535 steps instead of 1207
    requests = load_trace("code", limit=80)
    for request in requests:
        engine.submit(request, arrival_s=0.0)
    peak_divergent = peak_out = steps = 0
    least_free_full = config.full_pool_size
    while engine.step() is not None:
        steps += 1
        divergent, out = check_invariants(engine, config)
        peak_divergent = max(peak_divergent, divergent)
        peak_out = max(peak_out, out)
        least_free_full = min(least_free_full, len(engine.free_full_slots()))
    assert engine.stats.finished_requests == 80
    assert peak_divergent >= 1 and peak_out >= 1
    assert least_free_full < config.full_pool_size // 20  # the pool ran nearly full: requests waited for it
    # everything freed at the end
    assert len(engine.free_full_slots()) == config.full_pool_size
    assert len(engine.free_swa_slots()) == config.swa_pool_size
    assert not any(engine.pools.full_to_swa_index_mapping.tolist())
    assert int(engine.pools.req_to_token.abs().sum()) == 0
    # every request got its tokens: prompt in chunks, then one token per decode step
    assert engine.stats.prefill_tokens == sum(max(1, r.context_tokens) for r in requests)
    assert engine.stats.decode_tokens == sum(max(0, r.generated_tokens - 1) for r in requests)
    assert steps == engine.stats.forward_steps


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=st.integers(1, 40),
    page_size=st.sampled_from([1, 2, 4]),
    swa_pages=st.integers(12, 40),
    full_pages=st.integers(40, 120),
    max_running=st.integers(1, 6),
    extra_budget=st.integers(0, 60),
    requests=st.lists(st.tuples(st.integers(0, 120), st.integers(0, 40)), min_size=1, max_size=12),
)
def test_random_small_engines_never_stall_and_keep_the_invariants(
    window, page_size, swa_pages, full_pages, max_running, extra_budget, requests
):
    config = EngineConfig(
        window=window, full_pool_size=full_pages * page_size, swa_pool_size=swa_pages * page_size,
        page_size=page_size, max_running=max_running, token_budget=max_running + extra_budget,
        max_context_len=200, run_model=False,
    )
    engine = ReferenceEngine(config)
    accepted = []
    for context, generated in requests:
        kv_len = max(1, context) + max(0, generated - 1)
        pages = -(-kv_len // page_size)
        swa_needed = min(pages, -(-(window + page_size - 1) // page_size) + 1)
        fits = pages <= full_pages and swa_needed <= swa_pages
        try:
            engine.submit(TraceRequest(0.0, context, generated))
            accepted.append((context, generated))
            assert fits
        except RequestTooLargeError:
            assert not fits
    bound = sum(max(1, c) + g for c, g in accepted) + 1
    steps = 0
    while engine.step() is not None:
        steps += 1
        assert steps <= bound, "the engine stalled"
        check_invariants(engine, config)
    assert engine.stats.finished_requests == len(accepted)
    assert len(engine.free_full_slots()) == config.full_pool_size
    assert len(engine.free_swa_slots()) == config.swa_pool_size
