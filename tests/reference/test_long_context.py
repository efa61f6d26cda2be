"""Long contexts: requests that cannot fit are skipped with a count (the others run), the trace
stretched to contexts of 128K tokens runs, and stretched traces write and read back."""

from __future__ import annotations

import logging

import pytest

from otel_swa.reference.config import EngineConfig
from otel_swa.reference.replay import LOGGED_SKIPS, replay
from otel_swa.reference.trace import TraceRequest, load_trace, scale_contexts, write_trace


def test_requests_that_cannot_fit_are_skipped_with_a_count_and_the_rest_run(caplog):
    config = EngineConfig(window=16, full_pool_size=1024, swa_pool_size=128, max_running=4, token_budget=64,
                          max_context_len=512, run_model=False)
    requests = [TraceRequest(0.0, 100, 10)] + [TraceRequest(0.0, 600 + i, 5) for i in range(LOGGED_SKIPS + 2)]
    requests.append(TraceRequest(0.0, 50, 3))
    with caplog.at_level(logging.WARNING, logger="otel_swa.reference.replay"):
        summary = replay(requests, config)
    assert (summary.requests_total, summary.requests_finished, summary.requests_skipped) == (2, 2, LOGGED_SKIPS + 2)
    assert [s.index for s in summary.skipped] == list(range(1, LOGGED_SKIPS + 3))
    assert summary.skipped[0].reason == (
        "request 1 (context 600 + generated 5 tokens) needs 604 KV positions; max_context_len is 512")
    assert summary.skipped_line() == f"{LOGGED_SKIPS + 2} (too long for this engine; first: {summary.skipped[0].reason})"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == LOGGED_SKIPS + 1
    assert messages[-1] == f"skipped 2 more request(s) that cannot fit ({LOGGED_SKIPS + 2} in all)"
    # a request that fits max_context_len but not the FULL pool is skipped too
    summary = replay([TraceRequest(0.0, 500, 10)], EngineConfig(window=16, full_pool_size=256, swa_pool_size=128,
                     max_running=4, token_budget=64, max_context_len=1024, run_model=False))
    assert summary.requests_skipped == 1 and "the FULL pool has 256" in summary.skipped[0].reason
    assert replay([TraceRequest(0.0, 10, 2)], config).skipped_line() == "0"


def test_scale_contexts_stretches_every_prompt_by_one_factor():
    requests = [TraceRequest(0.0, 100, 11), TraceRequest(1.5, 400, 1), TraceRequest(2.0, 0, 4)]
    scaled = scale_contexts(requests, 1000)
    # room: 1000 - 10 = 990 for the first (x9.9), 1000 for the second (x2.5): the factor is 2.5
    assert scaled == [TraceRequest(0.0, 250, 11), TraceRequest(1.5, 1000, 1), TraceRequest(2.0, 1, 4)]
    with pytest.raises(ValueError, match="request 0 generates 2000 tokens; no prompt fits in longest=1000"):
        scale_contexts([TraceRequest(0.0, 5, 2000)], 1000)
    with pytest.raises(ValueError, match=r"longest=0; expected an integer >= 1"):
        scale_contexts(requests, 0)


def test_a_written_trace_reads_back(tmp_path):
    requests = [TraceRequest(0.0, 11931, 44), TraceRequest(4.3145790, 12633, 109), TraceRequest(3600.25, 7, 0)]
    path = tmp_path / "long.csv"
    write_trace(requests, path)
    assert path.read_text().splitlines()[:3] == [
        "TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.0000000,11931,44",
        "2023-11-16 18:15:50.3145790,12633,109"]
    back = load_trace(str(path))
    assert [(r.context_tokens, r.generated_tokens) for r in back] == [(11931, 44), (12633, 109), (7, 0)]
    assert [round(r.arrival_s, 6) for r in back] == [0.0, 4.314579, 3600.25]


def test_the_trace_stretched_to_128k_tokens_runs():
    requests = scale_contexts(load_trace("conv", limit=4), 131072)
    assert max(r.context_tokens + r.generated_tokens - 1 for r in requests) == 131072
    config = EngineConfig(max_context_len=131072, full_pool_size=262144, swa_pool_size=4096, run_model=False)
    summary = replay(requests, config)
    assert (summary.requests_finished, summary.requests_skipped) == (4, 0)
    assert summary.peak_full_slots >= max(r.context_tokens for r in requests)
    assert summary.peak_swa_slots <= 4096
