"""The swa_records fixture as the reporter's sink, on a batch whose counts are known by hand."""

import torch
from opentelemetry import context as otel_context

from otel_swa.reporter import KVPool, SwaDivergenceReporter
from otel_swa.views.base import SwaBatch


def test_fixture_collects_reporter_records(swa_records):
    # one request of 6 live tokens in FULL slots 1..6; SWA mapping: slots 1, 2 freed (0, out of
    # window), slot 3 kept as 3 (no remap), slots 4, 5, 6 remapped to 10, 11, 12 (divergence)
    req_to_token = torch.tensor([[1, 2, 3, 4, 5, 6, 0, 0]], dtype=torch.int64)
    mapping = torch.zeros(16, dtype=torch.int64)
    mapping[3], mapping[4], mapping[5], mapping[6] = 3, 10, 11, 12
    view = SwaBatch(req_to_token, mapping, torch.tensor([0]), torch.tensor([6]))
    ctx = otel_context.set_value("forward", "step")
    with SwaDivergenceReporter(interval=2, device="cpu", sinks=[swa_records]) as reporter:
        for _ in range(4):
            reporter.observe(KVPool.FULL, 6)
            reporter.observe(KVPool.SWA, 4)
            reporter.step(view, context=ctx)
    records = swa_records.records
    # recount: at steps 2 and 4 the totals are 6*step (FULL) and 4*step (SWA)
    assert [(r.forward_ct, r.verify_full, r.verify_swa) for r in records] == [(2, 12, 8), (4, 24, 16)]
    assert {(r.swa_full_idx_divergence, r.swa_out_of_window_tokens) for r in records} == {(3, 2)}
    assert swa_records.contexts == [ctx, ctx]
    obs = swa_records.assert_observed(min_divergence=3, min_out_of_window=2)
    assert obs.last.forward_ct == 4
