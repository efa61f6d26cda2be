"""The SGLang instrumentor against SGLang's real classes (sglang 0.5.23 on CPU; see conftest.py).

``ModelRunner.forward`` and ``CanaryManager`` cannot run on this machine without a model and
SGLang's published server configuration, so the driving tests put a light body with the real
parameters in place of the method (pytest's ``monkeypatch`` restores it) and wrap that, on the real
classes, with SGLang's real allocator, ``ReqToTokenPool``, ``ForwardBatch``, ``PoolKind`` and
``VerifyPlan``. Expected counts are the plain recount of ``_sglang_sim``.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from opentelemetry.instrumentation.swa_sglang import CANARY_ATTRIBUTE, RUNNER_ATTRIBUTE, SwaSglangInstrumentor

pytestmark = pytest.mark.sglang

WINDOW = 16


@pytest.fixture
def real(sglang_modules):
    from sglang.kernels.ops.kv_canary.verify import VerifyPlan
    from sglang.srt.kv_canary.runner.canary_manager import CanaryManager
    from sglang.srt.kv_canary.single_forward_manager.manager import _PreOpsMaybeInsideGraphOutput
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner

    return SimpleNamespace(ModelRunner=ModelRunner, CanaryManager=CanaryManager, ForwardBatch=ForwardBatch,
                           ForwardMode=ForwardMode, VerifyPlan=VerifyPlan, PreOpsOutput=_PreOpsMaybeInsideGraphOutput,
                           sim=sglang_modules)


@pytest.fixture
def instrumentor():
    made = SwaSglangInstrumentor()
    yield made
    made.uninstrument()


def test_real_methods_are_wrapped_with_their_signatures_and_restored(real, instrumentor, pipeline, monkeypatch):
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "20")
    targets = [(real.ModelRunner, "forward"), (real.CanaryManager, "__init__"),
               (real.CanaryManager, "pre_ops_maybe_inside_graph")]
    originals = {t: t[0].__dict__[t[1]] for t in targets}
    instrumentor.instrument(**pipeline.providers())
    for (cls, name), original in originals.items():
        wrapped = cls.__dict__[name]
        assert wrapped is not original and wrapped.__wrapped__ is original
        assert inspect.signature(wrapped) == inspect.signature(original)
    instrumentor.uninstrument()
    for (cls, name), original in originals.items():
        assert cls.__dict__[name] is original


def _real_batch(real, sim):
    b = sim.forward_batch()
    n = int(b.seq_lens.numel())
    return real.ForwardBatch(
        forward_mode=real.ForwardMode.DECODE, batch_size=n, input_ids=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens, out_cache_loc=torch.zeros(n, dtype=torch.int64),
        seq_lens_sum=int(b.seq_lens.sum()), seq_lens_cpu=b.seq_lens_cpu,
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_forward_on_the_real_allocator_gives_recounted_records(real, instrumentor, pipeline, monkeypatch, page_size):
    def forward(self, forward_batch, skip_attn_backend_init=None, pp_proxy_tensors=None,
                reinit_attn_backend=False, split_forward_count=1):
        return "output"

    monkeypatch.setattr(real.ModelRunner, "forward", forward)
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "5")
    monkeypatch.setenv("OTEL_SWA_FORWARD_SPANS", "all")  # a span at every forward step, not only sampled ones
    instrumentor.instrument(**pipeline.providers())
    sim = real.sim.SglangSim(page_size=page_size, window=WINDOW, seed=3 + page_size)
    runner = real.ModelRunner.__new__(real.ModelRunner)
    runner.__dict__.update(device="cpu", token_to_kv_pool_allocator=sim.allocator, req_to_token_pool=sim.req_to_token_pool,
                           sliding_window_size=WINDOW, canary_manager=None, is_draft_worker=False)
    records, expected, full, swa = [], {}, 0, 0
    for step in range(1, 201):
        sim.step()
        batch = _real_batch(real, sim)
        lens = batch.seq_lens_cpu.tolist()
        full += sum(lens)
        swa += sum(min(n, WINDOW + 1) for n in lens)  # sliding_window_size excludes the current token
        assert runner.forward(batch) == "output"
        if step == 1:
            runner.__dict__[RUNNER_ATTRIBUTE].reporter.add_sink(lambda r, c: records.append(r))
        if step % 5 == 0:
            expected[step] = (full, swa) + sim.recount()
    runner.__dict__[RUNNER_ATTRIBUTE].reporter.flush()
    got = {r.forward_ct: (r.verify_full, r.verify_swa, r.swa_full_idx_divergence, r.swa_out_of_window_tokens)
           for r in records}
    assert got == expected
    assert max(v[2] for v in expected.values()) >= 1 and max(v[3] for v in expected.values()) >= 1
    assert len(pipeline.forward_spans()) == 200


def test_canary_plans_of_real_verify_plans_are_counted_per_pool(real, instrumentor, pipeline, monkeypatch):
    full_group, swa_group = (SimpleNamespace(kind=real.sim.PoolKind.FULL), SimpleNamespace(kind=real.sim.PoolKind.SWA))
    counts = iter([(12, 5), (40, 16), (7, 7)])

    def pre_ops_maybe_inside_graph(self, forward_batch):
        plans = []
        for value in next(counts):
            plan = real.VerifyPlan.allocate(verify_capacity=64, device=torch.device("cpu"))
            plan.verify_num_valid.fill_(value)
            plans.append(plan)
        return real.PreOpsOutput(verify_plans=tuple(plans), write_plans=(), expected_inputs=None)

    monkeypatch.setattr(real.CanaryManager, "pre_ops_maybe_inside_graph", pre_ops_maybe_inside_graph)
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "3")
    instrumentor.instrument(**pipeline.providers())
    manager = real.CanaryManager.__new__(real.CanaryManager)
    manager._buffer_groups = (full_group, swa_group)
    reporter = instrumentor._new_reporter("cpu")  # what the wrapped __init__ attaches
    setattr(manager, CANARY_ATTRIBUTE, reporter)
    for _ in range(3):
        manager.pre_ops_maybe_inside_graph(None)
    assert reporter.totals.tolist() == [12 + 40 + 7, 5 + 16 + 7]
