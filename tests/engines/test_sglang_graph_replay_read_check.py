"""A sampled forward step replayed from a CUDA graph runs no ``RadixAttention.forward`` in Python,
so the read check sees no layer: the instrumentor counts that step's queries as unchecked (never
as checked, never as a fault), and an eager sampled step that did check a layer adds nothing.

No sglang needed: ``_after_forward`` is driven with a real reporter and read check, and a
stand-in for SGLang's ``ForwardBatch`` (``batch_size``, ``req_pool_indices``) and for the KV
canary hooks the instrumentor steps (``KvCanaryHooks.step``, here a call of ``reporter.step``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from opentelemetry.instrumentation.swa_sglang import SwaSglangInstrumentor
from otel_swa.device.read_check import read_counts
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views.base import SwaBatch

# one request of 4 tokens, FULL slots 1-4 mapped to SWA slots 1-4
VIEW = SwaBatch(req_to_token=torch.arange(8, dtype=torch.int32).reshape(1, 8), full_to_swa_index_mapping=torch.arange(9),
                req_pool_indices=torch.zeros(1, dtype=torch.int64), seq_lens=torch.full((1,), 4))


def _wiring(reporter):
    check = reporter.enable_read_check(max_queries=8)
    hooks = SimpleNamespace(step=lambda **_: reporter.step(VIEW))
    return SimpleNamespace(reporter=reporter, counts_from_canary=True, read_check=check, hooks=hooks), check


def test_a_sampled_step_replayed_from_a_graph_counts_its_queries_unchecked():
    reporter = SwaDivergenceReporter(2, device="cpu")
    wiring, check = _wiring(reporter)
    taken = []
    original_take = check.take

    def take(out=None):  # the reporter's take at each sampled step, its counts kept
        cells = original_take(out)
        taken.append(read_counts(cells.tolist()))
        return cells

    check.take = take
    instrumentor = SwaSglangInstrumentor()
    batch = SimpleNamespace(batch_size=5, req_pool_indices=torch.arange(5))
    instrumentor._after_forward(wiring, batch)  # forward_ct 1: not a sampling step
    assert check.layer_calls == 0 and int(check.cells[2]) == 0
    instrumentor._after_forward(wiring, batch)  # forward_ct 2: sampled, replayed (no layer called)
    instrumentor._after_forward(wiring, SimpleNamespace(batch_size=3, req_pool_indices=torch.arange(3)))
    check.layer_calls = 1  # forward_ct 4: an eager sampled step whose layer was checked
    instrumentor._after_forward(wiring, batch)
    reporter.close()
    # (checked, mismatched, unchecked) taken at forward_ct 2 and 4: 5 requests -> 5 queries of at
    # most 8 unchecked at the replay; nothing added at the eager step
    assert taken[:2] == [(0, 0, 5), (0, 0, 0)]


def test_a_replay_of_a_graph_that_holds_the_check_counts_nothing_unchecked():
    """Once a capture recorded the check (``recorded_calls``), a replayed sampled step was checked by
    the graph itself: the instrumentor adds no unchecked queries for it."""
    taken = []
    for recorded in (0, 1):  # a graph captured without the check, then one captured with it
        reporter = SwaDivergenceReporter(1, device="cpu")
        wiring, check = _wiring(reporter)
        check.recorded_calls = recorded
        original_take = check.take
        check.take = lambda out=None, take=original_take: taken.append(read_counts(take(out).tolist()))
        SwaSglangInstrumentor()._after_forward(wiring, SimpleNamespace(batch_size=5, req_pool_indices=torch.arange(5)))
        reporter.close()
    assert taken == [(0, 0, 5), (0, 0, 0)]


class GraphRunner:
    """Stands for sglang 0.5.23's ``CudaGraphRunner`` of a model runner built before
    ``instrument()``: its captured graphs hold no check; ``can_run_graph(forward_batch)`` is what
    ``ModelRunner._forward_raw`` asks before replaying (True: every batch size was captured)."""

    def can_run_graph(self, forward_batch):
        return True


def test_a_runner_wired_after_its_capture_runs_its_sampled_steps_eagerly_and_counts_none_unchecked():
    from opentelemetry.instrumentation.swa_sglang import _captured_graphs, _graphs_without_checks

    reporter = SwaDivergenceReporter(3, device="cpu")
    wiring, check = _wiring(reporter)
    taken = []
    original_take = check.take
    check.take = lambda out=None, take=original_take: taken.append(read_counts(take(out).tolist()))
    graphs = GraphRunner()
    runner = SimpleNamespace(decode_cuda_graph_runner=graphs,
                             prefill_cuda_graph_runner=type("EagerRunner", (), {"can_run_graph": lambda self, fb: False})())
    assert _captured_graphs(runner) == [graphs]  # SGLang's EagerRunner replays nothing
    assert _graphs_without_checks(runner, reporter)
    instrumentor = SwaSglangInstrumentor()
    batch = SimpleNamespace(batch_size=5, req_pool_indices=torch.arange(5))
    replayed = []
    for _ in range(9):
        reporter.before_forward()
        # sglang 0.5.23 ModelRunner._forward_raw: replay when the graph runner can run the batch,
        # else the eager forward, whose sliding-window layer runs (and is checked) in Python
        replay = runner.decode_cuda_graph_runner.can_run_graph(batch)
        replayed.append(replay)
        if not replay:
            check.layer_calls += 1  # what check_layer counts for the layer the eager step ran
        instrumentor._after_forward(wiring, batch)
        check.layer_calls = 0
    reporter.close()
    # forward_ct 3, 6, 9 are the sampling steps: eager; every other step replays
    assert replayed == [True, True, False, True, True, False, True, True, False]
    assert [unchecked for _, _, unchecked in taken] == [0, 0, 0]
