"""Continuous batching: admission held back by the pools, the token budget, requests that never fit."""

import pytest

from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.reference.pools import HybridKVPools
from otel_swa.reference.scheduler import RequestState, RequestTooLargeError, Scheduler
from otel_swa.reference.trace import TraceRequest, load_trace


def _three_requests():
    return [RequestState(rid, context_tokens=10, generated_tokens=50) for rid in range(3)]


def _first_schedule(full_size: int, swa_size: int):
    """Three requests (10 context tokens, 50 generated) added to a scheduler (window 16, page 1, 8
    running at most, a budget of 64 tokens) over pools of ``full_size`` / ``swa_size`` slots; its
    first ``schedule()``: ``(scheduler, items)``."""
    pools = HybridKVPools(full_size=full_size, swa_size=swa_size, page_size=1, max_running=8, max_context_len=128)
    scheduler = Scheduler(pools, window=16, max_running=8, token_budget=64)
    for req in _three_requests():
        scheduler.add(req)
    return scheduler, scheduler.schedule()


def test_admission_held_when_the_swa_pool_is_short():
    # window 16, page 1: each request reserves min(59, 16 + 1) = 17 SWA slots; 40 hold two.
    scheduler, items = _first_schedule(full_size=1000, swa_size=40)
    assert [(it.req.rid, it.prefix_len, it.extend_len) for it in items] == [(0, 0, 10), (1, 0, 10)]
    assert [req.rid for req in scheduler.waiting] == [2]
    assert scheduler.last_hold == "swa"
    assert scheduler.admission.held_swa == 1 and scheduler.admission.held_full == 0


def test_admission_held_when_the_full_pool_is_short():
    # each request keeps 59 FULL slots for its whole life; 100 hold one.
    scheduler, items = _first_schedule(full_size=100, swa_size=1000)
    assert [it.req.rid for it in items] == [0]
    assert scheduler.last_hold == "full"


def test_held_requests_stay_queued_and_all_finish():
    config = EngineConfig(window=16, full_pool_size=1000, swa_pool_size=40, max_running=8, token_budget=64, max_context_len=128)
    engine = ReferenceEngine(config)
    for _ in range(5):
        engine.submit(TraceRequest(0.0, 10, 50))
    most_running = 0
    while engine.step() is not None:
        most_running = max(most_running, len({it.req.rid for it in engine.last_batch}))
    assert most_running == 2
    assert engine.stats.finished_requests == 5
    assert engine.stats.admission_held.get("swa", 0) > 0
    assert len(engine.free_swa_slots()) == 40 and len(engine.free_full_slots()) == 1000


@pytest.mark.parametrize("page_size", [1, 4])
def test_token_budget_is_respected_and_long_prompts_are_chunked(page_size):
    requests = load_trace("conv", limit=30)
    config = EngineConfig(
        window=32, full_pool_size=16384, swa_pool_size=2048, page_size=page_size, max_running=8,
        token_budget=64, max_context_len=8192, run_model=False,
    )
    engine = ReferenceEngine(config)
    for request in requests:
        engine.submit(request, arrival_s=0.0)
    chunks: dict[int, int] = {}
    full_steps = total = 0
    while engine.step() is not None:
        batch = engine.last_batch
        tokens = sum(item.extend_len for item in batch)
        assert tokens <= 64
        assert len(batch) <= 8
        full_steps += tokens == 64
        total += tokens
        for item in batch:
            if not item.decode:
                chunks[item.req.rid] = chunks.get(item.req.rid, 0) + 1
    assert full_steps > 0
    # every prompt token and every fed-back output token passed through exactly once
    assert total == sum(r.context_tokens + r.generated_tokens - 1 for r in requests)
    for rid, request in enumerate(requests):
        assert chunks[rid] >= -(-request.context_tokens // 64)


def test_a_request_that_can_never_fit_is_rejected_at_submission():
    engine = ReferenceEngine(EngineConfig(window=16, full_pool_size=512, swa_pool_size=64, max_running=4, token_budget=64, max_context_len=1024))
    with pytest.raises(RequestTooLargeError, match=r"request 0 \(context 2000 \+ generated 5 tokens\).*max_context_len is 1024"):
        engine.submit(TraceRequest(0.0, 2000, 5))
    with pytest.raises(RequestTooLargeError, match=r"request 7 .*needs 600 FULL slots; the FULL pool has 512"):
        engine.submit(TraceRequest(0.0, 590, 11), rid=7)
    small_swa = ReferenceEngine(EngineConfig(window=16, full_pool_size=512, swa_pool_size=16, max_running=4, token_budget=64, max_context_len=1024))
    with pytest.raises(RequestTooLargeError, match=r"needs 17 SWA slots \(window 16\); the SWA pool has 16"):
        small_swa.submit(TraceRequest(0.0, 100, 1))
    # a request shorter than the window needs no more SWA slots than its length
    small_swa.submit(TraceRequest(0.0, 10, 3))
    assert small_swa.run_until_done().finished_requests == 1


def test_arrivals_follow_the_virtual_clock():
    config = EngineConfig(window=16, full_pool_size=512, swa_pool_size=64, max_running=4, token_budget=64, max_context_len=256, step_time_s=0.5)
    engine = ReferenceEngine(config)
    first = engine.submit(TraceRequest(0.0, 4, 2))
    second = engine.submit(TraceRequest(10.0, 4, 2))
    engine.run_until_done()
    # first: prefill (step 1) + one decode (step 2); clock 1.0 s, then idle until 10 s
    assert (first.admitted_at, first.finished_at) == (1, 2)
    assert (second.admitted_at, second.finished_at) == (3, 4)
    assert engine.clock_s == pytest.approx(11.0)


def test_zero_token_requests():
    engine = ReferenceEngine(EngineConfig(window=16, full_pool_size=512, swa_pool_size=64, max_running=4, token_budget=64, max_context_len=256))
    no_prompt = engine.submit(TraceRequest(0.0, 0, 3))
    no_output = engine.submit(TraceRequest(0.0, 5, 0))
    engine.run_until_done()
    assert no_prompt.context_tokens == 1 and len(no_prompt.output_ids) == 3
    assert no_output.output_ids == [] and no_output.finished_at == 1


def test_bad_configuration_is_named():
    with pytest.raises(ValueError, match="EngineConfig.window=0"):
        EngineConfig(window=0)
    with pytest.raises(ValueError, match="swa_pool_size=100 is not a multiple of page_size=8"):
        EngineConfig(swa_pool_size=100, page_size=8)
    with pytest.raises(ValueError, match="token_budget=4 is below max_running=8"):
        EngineConfig(token_budget=4, max_running=8)
