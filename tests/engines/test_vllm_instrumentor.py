"""The vLLM instrumentor on stand-in classes.

vLLM does not install on this CPU-only machine, so the stand-ins copy, as facts read from vLLM
0.33's source, what the instrumentor touches: the module paths
``vllm.v1.core.sched.scheduler.Scheduler`` (``schedule(self)``, ``requests``, ``cache_config.num_gpu_blocks``,
``kv_cache_manager.coordinator.single_type_managers``), ``vllm.v1.core.single_type_kv_cache_manager``
(``SlidingWindowManager``: ``req_to_blocks``, ``block_size``, ``sliding_window``; blocks that left the
window become the null block, id 0, ``max(0, n - window + 1)`` skipped tokens in whole blocks) and
``vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model(self, scheduler_output, intermediate_tensors=None)``.
A test against the real classes is missing.
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from types import SimpleNamespace

import pytest

from _instrumentation_support import install_standin
from opentelemetry.instrumentation.swa_vllm import SCHEDULER_ATTRIBUTE, SwaVllmInstrumentor, VllmVersionError

WINDOW, BLOCK, NUM_BLOCKS = 8, 4, 400


def standin_classes():
    class KVCacheBlock:
        def __init__(self, block_id):
            self.block_id = block_id

    class FullAttentionManager:
        def __init__(self):
            self.req_to_blocks = defaultdict(list)

    class SlidingWindowManager:
        def __init__(self, block_size, sliding_window):
            self.block_size = block_size
            self.sliding_window = sliding_window
            self.req_to_blocks = defaultdict(list)
            self.free = list(range(1, NUM_BLOCKS))  # block 0 is the pool's null block

        def get_num_skipped_tokens(self, num_computed_tokens):
            return max(0, num_computed_tokens - self.sliding_window + 1)

        def grow(self, request_id, num_tokens):
            blocks = self.req_to_blocks[request_id]
            while len(blocks) * self.block_size < num_tokens:
                blocks.append(KVCacheBlock(self.free.pop(0)))
            for i in range(self.get_num_skipped_tokens(num_tokens) // self.block_size):
                if blocks[i].block_id != 0:
                    self.free.append(blocks[i].block_id)
                    blocks[i] = KVCacheBlock(0)

        def finish(self, request_id):
            self.free.extend(b.block_id for b in self.req_to_blocks.pop(request_id) if b.block_id != 0)

    class Scheduler:
        def __init__(self, seed):
            self.rng = random.Random(seed)
            self.swa = SlidingWindowManager(BLOCK, WINDOW)
            self.kv_cache_manager = SimpleNamespace(coordinator=SimpleNamespace(
                single_type_managers=(FullAttentionManager(), self.swa)))
            self.cache_config = SimpleNamespace(num_gpu_blocks=NUM_BLOCKS)
            self.requests = {}
            self.targets = {}
            self.next_id = 0

        def schedule(self):
            rng, scheduled = self.rng, {}
            while len(self.requests) < 4:
                rid = f"req-{self.next_id}"
                self.next_id += 1
                self.requests[rid] = SimpleNamespace(request_id=rid, num_computed_tokens=0)
                self.targets[rid] = rng.randint(5, 40)
            for rid, req in list(self.requests.items()):
                if req.num_computed_tokens >= self.targets[rid]:
                    del self.requests[rid]
                    self.swa.finish(rid)
                    continue
                new = rng.randint(3, 12) if req.num_computed_tokens == 0 else 1
                req.num_computed_tokens += new
                self.swa.grow(rid, req.num_computed_tokens)
                scheduled[rid] = new
            return SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()))

    class GPUModelRunner:
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            return ("sampled", len(scheduler_output.num_scheduled_tokens))

    return Scheduler, GPUModelRunner, SlidingWindowManager


@pytest.fixture
def vllm_standin(monkeypatch, tmp_path):
    def install(version: str = "0.33.0"):
        Scheduler, GPUModelRunner, SlidingWindowManager = standin_classes()
        install_standin(monkeypatch, tmp_path, "vllm", version, {
            "vllm.v1.core.sched.scheduler": {"Scheduler": Scheduler},
            "vllm.v1.core.single_type_kv_cache_manager": {"SlidingWindowManager": SlidingWindowManager},
            "vllm.v1.worker.gpu_model_runner": {"GPUModelRunner": GPUModelRunner},
        })
        return SimpleNamespace(Scheduler=Scheduler, GPUModelRunner=GPUModelRunner,
                               schedule=Scheduler.__dict__["schedule"],
                               execute_model=GPUModelRunner.__dict__["execute_model"])

    return install


@pytest.fixture
def instrumentor():
    made = SwaVllmInstrumentor()
    yield made
    made.uninstrument()


def recount(scheduler, output) -> tuple[int, int, int]:
    """(FULL entries, SWA entries, out-of-window tokens) of one scheduled batch, by plain loops."""
    full = swa = out = 0
    for rid in output.num_scheduled_tokens:
        n = scheduler.requests[rid].num_computed_tokens
        blocks = [b.block_id for b in scheduler.swa.req_to_blocks[rid]]
        full += n
        swa += min(n, WINDOW)
        out += sum(1 for pos in range(n) if blocks[pos // BLOCK] == 0)
    return full, swa, out


def test_off_wraps_nothing(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "0")
    monkeypatch.setattr("otel_swa.reporter.SwaDivergenceReporter.__init__",
                        lambda *a, **k: pytest.fail("reporter work while the interval is 0"))
    instrumentor.instrument(**pipeline.providers())
    assert v.Scheduler.__dict__["schedule"] is v.schedule
    assert v.GPUModelRunner.__dict__["execute_model"] is v.execute_model
    scheduler = v.Scheduler(1)
    scheduler.schedule()
    assert SCHEDULER_ATTRIBUTE not in scheduler.__dict__


def test_instrument_wraps_uninstrument_restores_the_same_functions(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "5")
    instrumentor.instrument(**pipeline.providers())
    wrapped = v.Scheduler.__dict__["schedule"]
    assert wrapped is not v.schedule and wrapped.__wrapped__ is v.schedule
    assert v.GPUModelRunner.__dict__["execute_model"].__wrapped__ is v.execute_model
    instrumentor.instrument(**pipeline.providers())
    assert v.Scheduler.__dict__["schedule"] is wrapped
    instrumentor.uninstrument()
    instrumentor.uninstrument()
    assert v.Scheduler.__dict__["schedule"] is v.schedule
    assert v.GPUModelRunner.__dict__["execute_model"] is v.execute_model


def test_driven_engine_steps_give_recounted_records_and_spans(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "4")
    instrumentor.instrument(**pipeline.providers())
    scheduler, runner = v.Scheduler(11), v.GPUModelRunner()
    records, expected, totals = [], {}, [0, 0]
    for step in range(1, 61):
        output = scheduler.schedule()
        if step == 1:
            scheduler.__dict__[SCHEDULER_ATTRIBUTE].reporter.add_sink(lambda r, c: records.append(r))
        full, swa, out = recount(scheduler, output)
        totals[0] += full
        totals[1] += swa
        if step % 4 == 0:
            expected[step] = (totals[0], totals[1], 0, out)
        assert runner.execute_model(output) == ("sampled", len(output.num_scheduled_tokens))
    reporter = scheduler.__dict__[SCHEDULER_ATTRIBUTE].reporter
    reporter.flush()
    got = {r.forward_ct: (r.verify_full, r.verify_swa, r.swa_full_idx_divergence, r.swa_out_of_window_tokens)
           for r in records}
    assert got == expected
    assert max(o for *_, o in expected.values()) >= 1  # blocks really left the window
    spans = pipeline.forward_spans()
    assert [s.attributes["forward_step.forward_ct"] for s in spans] == list(range(1, 61))
    assert len(pipeline.events()) == len(expected)


def test_missing_method_fails_with_the_version_and_the_method(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin()
    del v.GPUModelRunner.execute_model
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    with pytest.raises(VllmVersionError, match=r"0\.33\.0.*GPUModelRunner\.execute_model\(scheduler_output"):
        instrumentor.instrument(**pipeline.providers())
    assert v.Scheduler.__dict__["schedule"] is v.schedule


def test_unsupported_version_is_not_instrumented(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin(version="0.9.2")
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    instrumentor.instrument(**pipeline.providers())
    assert v.Scheduler.__dict__["schedule"] is v.schedule



def test_unsupported_version_under_the_loaders_call_warns_once_and_wraps_nothing(
    vllm_standin, instrumentor, pipeline, monkeypatch, caplog
):
    v = vllm_standin(version="0.9.2")
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    with caplog.at_level(logging.WARNING):
        instrumentor.instrument(skip_dep_check=True, **pipeline.providers())  # as opentelemetry-instrument
    assert v.Scheduler.__dict__["schedule"] is v.schedule
    assert v.GPUModelRunner.__dict__["execute_model"] is v.execute_model
    ours = [r.getMessage() for r in caplog.records if r.name == "opentelemetry.instrumentation.swa_vllm"]
    assert ours == ["swa_vllm: installed vllm 0.9.2 is outside the supported vllm >= 0.10, < 0.34; "
                    "vLLM is not instrumented"]

def test_vllm_records_mark_divergence_not_applicable_and_export_no_divergent_point(
    vllm_standin, instrumentor, pipeline, monkeypatch
):
    v = vllm_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "4")
    instrumentor.instrument(**pipeline.providers())
    scheduler, runner = v.Scheduler(5), v.GPUModelRunner()
    out_of_window = {}
    for step in range(1, 21):
        output = scheduler.schedule()
        if step % 4 == 0:
            out_of_window[step] = recount(scheduler, output)[2]
        runner.execute_model(output)
    scheduler.__dict__[SCHEDULER_ATTRIBUTE].reporter.flush()
    events = pipeline.events()
    assert [e.attributes["kv_cache.swa.forward_ct"] for e in events] == [4, 8, 12, 16, 20]
    assert [e.attributes["kv_cache.swa.divergence_applicable"] for e in events] == [False] * 5
    assert [e.attributes["kv_cache.swa.swa_out_of_window_tokens"] for e in events] == list(out_of_window.values())
    assert pipeline.points("kv_cache.swa.tokens.divergent") == []
    assert [p.value for p in pipeline.points("kv_cache.swa.tokens.out_of_window")] == [out_of_window[20]]
