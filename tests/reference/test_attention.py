"""The paged forward of the reference model against dense attention with a sliding-window mask."""

import math

import pytest
import torch

from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.reference.trace import TraceRequest

# (context tokens, generated tokens): prompts shorter and longer than the window, long enough to
# be chunked, and outputs long enough for decode steps to leave the window.
REQUESTS = [(5, 9), (30, 20), (45, 3), (12, 15), (61, 1), (3, 30), (20, 0)]


def dense_hidden(model, token_ids):
    """Hidden states of every position of one sequence, K/V built densely, masks written out."""
    n = len(token_ids)
    positions = torch.arange(n)
    h = model.embed_tokens(torch.tensor(token_ids, dtype=torch.int64), positions)
    i = positions[:, None]
    j = positions[None, :]
    for layer, window in ((0, None), (1, model.window)):
        q, k, v = model.qkv(layer, h)
        mask = j <= i
        if window is not None:
            mask = mask & (j > i - window)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(model.head_dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        h = model.output(layer, h, torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return h


@pytest.mark.parametrize("page_size, num_heads, head_dim", [(1, 1, 16), (4, 2, 16), (2, 2, 32)])
def test_paged_forward_matches_dense_attention(page_size, num_heads, head_dim):
    config = EngineConfig(
        window=8, full_pool_size=512, swa_pool_size=64, page_size=page_size, max_running=4,
        token_budget=16, max_context_len=128, num_heads=num_heads, head_dim=head_dim, seed=3,
    )
    engine = ReferenceEngine(config)
    for context, generated in REQUESTS:
        engine.submit(TraceRequest(0.0, context, generated))
    # more tokens pass through the SWA pool than it has slots, so SWA slots are freed and reused
    assert sum(c + max(g - 1, 0) for c, g in REQUESTS) > 64
    chunked = decoded = 0
    while engine.step() is not None:
        hidden = engine.last_hidden
        offset = 0
        for item in engine.last_batch:
            req = item.req
            fed = (req.prompt_ids.tolist() + req.output_ids)[: item.seq_len]
            expected = dense_hidden(engine.model, fed)[item.prefix_len : item.seq_len]
            got = hidden[offset : offset + item.extend_len]
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            offset += item.extend_len
            chunked += (not item.decode) and item.prefix_len > 0
            decoded += item.decode
    assert chunked > 0 and decoded > 0
    assert engine.stats.swa_slots_freed > 0
    assert engine.stats.finished_requests == len(REQUESTS)


def test_greedy_output_matches_dense_argmax():
    config = EngineConfig(window=8, full_pool_size=256, swa_pool_size=32, max_running=2, token_budget=8, max_context_len=64)
    engine = ReferenceEngine(config)
    req = engine.submit(TraceRequest(0.0, 21, 12))
    engine.run_until_done()
    assert len(req.output_ids) == 12
    assert req.token_ids() == req.prompt_ids.tolist() + req.output_ids[:11]
    fed = req.prompt_ids.tolist() + req.output_ids[:-1]
    h = dense_hidden(engine.model, fed)
    expected = (h[20:] @ engine.model.lm_head).argmax(-1).tolist()
    assert req.output_ids == expected


def test_prompt_ids_are_deterministic_and_in_vocabulary():
    a = ReferenceEngine(EngineConfig(window=8, full_pool_size=256, swa_pool_size=32, max_running=2, token_budget=8, max_context_len=64))
    b = ReferenceEngine(EngineConfig(window=8, full_pool_size=256, swa_pool_size=32, max_running=2, token_budget=8, max_context_len=64))
    ra, rb = a.submit(TraceRequest(0.0, 40, 2)), b.submit(TraceRequest(0.0, 40, 2))
    a.run_until_done()
    b.run_until_done()
    assert ra.prompt_ids.tolist() == rb.prompt_ids.tolist()
    assert ra.output_ids == rb.output_ids
    assert 0 <= min(ra.prompt_ids.tolist()) and max(ra.prompt_ids.tolist()) < 128
    assert len(set(ra.prompt_ids.tolist())) > 10
