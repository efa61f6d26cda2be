"""``SwaDivergenceReporter.attach_write_check``: a write check the engine runs with a gate of its
own (vLLM: made on the model runner's device before the scheduler's reporter exists)."""

import pytest
import torch

from otel_swa.device.gate import SamplingGate
from otel_swa.device.paged_write import paged_layer_store
from otel_swa.device.write_check import WriteCheck
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import vllm

H, D, BS = 1, 4, 4


class _Manager:
    block_size = BS

    def __init__(self):
        self.req_to_blocks = {"a": [], "b": []}


def _view():
    return vllm.read_window_table(_Manager(), [], []).view()


def _store(check, cache, slots, wrong=(), step=0):
    k = torch.arange(len(slots) * H * D, dtype=torch.float32).reshape(len(slots), H, D) + 1 + 100 * step
    for i, s in enumerate(slots):
        target = s + 1 if i in wrong else s
        cache[target // BS, :, target % BS, :D] = k[i]
        cache[target // BS, :, target % BS, D:] = -k[i]
    if check.gate.wanted() and check.wants(0, True):
        check.check_layer(paged_layer_store(0, True, k, -k, cache, torch.tensor(slots), head_size=D,
                                            query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32)))


def test_the_attached_check_follows_the_reporters_decision_and_names_the_batch():
    records = []
    reporter = SwaDivergenceReporter(2, sinks=[lambda r, c: records.append(r)])
    gate = SamplingGate("cpu")
    check = WriteCheck("cpu", gate)
    batch = ["r0", "r1"]
    reporter.attach_write_check(check, batch=lambda: batch, layers={0: ("model.layers.0.attn", 1, True)})
    assert reporter.write_check is check
    cache = torch.zeros(8, H, BS, 2 * D)
    for step in range(4):  # schedule() then the forward, as vLLM orders them
        reporter.step(_view)
        reporter.before_forward()
        assert gate.due == (step % 2 == 0) and bool(gate.flag) == gate.due  # forward 1 and 3 precede samples
        _store(check, cache, [5, 6, 9], wrong={2} if step >= 2 else (), step=step)
    reporter.step(_view)
    reporter.close()
    # each record carries the forward before it (steps 0 and 2); steps 1 and 3 are not checked
    assert [(r.forward_ct, r.kv_write_checks, r.kv_write_mismatches) for r in records] == [(2, 3, 0), (4, 3, 1)]
    first = records[-1].offender("kv_write_mismatches")
    assert first is not None
    assert (first.request, first.row, first.position, first.swa_slot, first.full_slot) == ("r1", 1, None, 9, None)
    assert (first.layer, first.layer_name, first.kv_cache_group, first.pool) == (0, "model.layers.0.attn", 1, "swa")


def test_a_layer_without_rows_names_no_request():
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: records.append(r)])
    check = WriteCheck("cpu", SamplingGate("cpu"))
    reporter.attach_write_check(check, batch=lambda: ["r0", "r1"], layers={0: ("L0", 1, False)})
    reporter.before_forward()
    _store(check, torch.zeros(8, H, BS, 2 * D), [5, 6, 9], wrong={0})
    reporter.step(_view)
    reporter.close()
    first = records[0].offender("kv_write_mismatches")
    assert (first.request, first.row, first.swa_slot) == (None, None, 5)


def test_only_a_write_check_can_be_attached():
    with pytest.raises(TypeError, match="WriteCheck"):
        SwaDivergenceReporter(1).attach_write_check(object())
