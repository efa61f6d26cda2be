"""``SwaDivergenceReporter.attach_read_check``: a read check the engine's model runner runs with a gate
of its own (vLLM: made on the runner's device before the scheduler's reporter exists, its queries
the runner's batch rows), and what ``otel_swa.views.vllm_read.read_args`` gives it from a call of a
vLLM attention implementation (stand-ins with vLLM 0.32.0 CPU_ATTN's attributes)."""

from types import SimpleNamespace

import pytest
import torch

from otel_swa.device.gate import SamplingGate
from otel_swa.device.read_check import ReadCheck, read_counts
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import vllm
from otel_swa.views.vllm_read import layer_window, read_args
from otel_swa.views.vllm_write import WriteLayer
from paged_pool import PagedPool


class _Manager:
    block_size = 32

    def __init__(self):
        self.req_to_blocks = {}


def _view():
    return vllm.read_window_table(_Manager(), [], []).view()


class CPUAttentionBackendImpl:  # the attributes vllm/v1/attention/backends/cpu_attn.py sets
    def __init__(self, pool: PagedPool, window: int):
        self.scale, self.num_heads, self.head_size = pool.scaling, pool.q_heads, pool.head_dim
        self.sliding_window, self.logits_soft_cap, self.sinks = window, 0, None


def _call(pool: PagedPool, window: int, table=None):
    """``(layer, impl, query, output, kv_cache, metadata)`` of one CPU_ATTN call: every request
    brings one new token (a decode batch), its output computed through ``table``."""
    impl = CPUAttentionBackendImpl(pool, window)
    layer = WriteLayer("model.layers.0.self_attn.attn", SimpleNamespace(isa="vec", impl=impl), 0, 1, True)
    batch = pool.q.shape[0]
    output = pool.engine_output(window, table).reshape(batch, -1)
    metadata = SimpleNamespace(query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens=pool.seq_lens,
                               block_table=pool.block_table, num_actual_tokens=batch)
    return layer, impl, pool.q, output, pool.kv_cache, metadata


def test_the_attached_check_follows_the_reporters_decision_and_names_the_runners_batch():
    records = []
    reporter = SwaDivergenceReporter(2, sinks=[lambda r, c: records.append(r)])
    gate = SamplingGate("cpu")
    check = ReadCheck("cpu", gate=gate)
    batch = ["r0", "r1", "r2", "r3", "r4"]
    reporter.attach_read_check(check, batch=lambda: batch, layers={0: ("model.layers.0.self_attn.attn", 1, True)})
    assert reporter.read_check is check
    pool = PagedPool()
    stale = pool.block_table.clone()
    stale[3, 1] = pool.block_table[0, 0]
    for step in range(4):  # schedule() then the forward, as vLLM orders them
        reporter.step(_view)
        reporter.before_forward()
        assert gate.due == (step % 2 == 0)
        if gate.wanted():
            layer, impl, q, out, kv, metadata = _call(pool, 32, stale if step >= 2 else None)
            check.check_layer(**read_args(layer, impl, q, out, kv, metadata))
    reporter.step(_view)
    reporter.close()
    assert [(r.forward_ct, r.swa_read_checks, r.swa_read_mismatches) for r in records] == [(2, 5, 0), (4, 5, 1)]
    first = records[-1].offender("swa_read_mismatches")
    position = int(pool.seq_lens[3]) - 1
    assert (first.request, first.row, first.position, first.swa_slot) == ("r3", 3, position, pool.slot(3, position))
    assert (first.layer, first.layer_name, first.kv_cache_group) == (0, "model.layers.0.self_attn.attn", 1)


def test_only_a_read_check_can_be_attached():
    with pytest.raises(TypeError, match="ReadCheck"):
        SwaDivergenceReporter(1).attach_read_check(object())


@pytest.mark.parametrize("window, expected", [(32, 32), (-1, None), (None, None), ((31, 0), 32), ((31, 4), None),
                                              (True, None)])
def test_the_window_is_named_as_each_backend_keeps_it(window, expected):
    assert layer_window(SimpleNamespace(sliding_window=window)) == expected


def test_calls_the_check_cannot_read_give_their_reason():
    pool = PagedPool()
    layer, impl, q, out, kv, metadata = _call(pool, 32)
    amx = WriteLayer(layer.name, SimpleNamespace(isa="amx", impl=impl), 0, 1, True)
    assert "instruction set 'amx'" in read_args(amx, impl, q, out, kv, metadata)
    assert "not [blocks" in read_args(layer, impl, q, out, kv[..., :-1], metadata)
    assert "no query_start_loc" in read_args(layer, impl, q, out, kv, SimpleNamespace(num_actual_tokens=5))
    impl.sliding_window = -1
    assert "cannot be named" in read_args(layer, impl, q, out, kv, metadata)
    other = type("FlashInferImpl", (), {})()
    assert "not one the read check reads" in read_args(layer, other, q, out, kv, metadata)


def test_a_clean_call_read_through_read_args_agrees():
    pool = PagedPool()
    check = ReadCheck("cpu")
    check.check_layer(**read_args(*_call(pool, 32)))
    assert read_counts(check.take().tolist()) == (5, 0, 0)
