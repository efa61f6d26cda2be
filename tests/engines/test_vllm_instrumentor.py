"""The vLLM instrumentor on stand-in classes: what runs without vLLM, and the GPU model runners.

vLLM 0.33.0's real ``Scheduler`` and ``KVCacheManager`` drive the instrumentor in
``test_vllm_real.py`` (marker ``vllm``, ``.ci/vllm-tests.sh``). The stand-ins here serve two ends:

* the main suite, which has no vLLM, still runs the instrumentor's wiring, its version checks and
  its failure paths (a stand-in scheduler and ``SlidingWindowManager`` with the attributes it
  reads: ``schedule(self, throttle_prefills=False)``, ``requests``, ``kv_cache_manager.coordinator.
  single_type_managers``, ``req_to_blocks``, ``block_size``; blocks with ``block_id`` / ``is_null``,
  one shared null block);
* the GPU model runners, which need a GPU to be built, are tested through stand-ins of
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (V1) and
  ``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` (Model Runner V2) whose ``execute_model`` and
  ``sample_tokens`` have the real signatures: :func:`test_runner_standins_have_the_signatures_of_vllm_source`
  (marker ``vllm``) compares them with the installed vLLM source through ``ast``, without
  importing it.
"""

from __future__ import annotations

import ast
import inspect
import logging
import random
from collections import defaultdict
from types import SimpleNamespace

import pytest
from opentelemetry import trace

from _instrumentation_support import install_standin, instrument_as_the_loader, vllm_instrumentor
from opentelemetry.instrumentation.swa_vllm import SCHEDULER_ATTRIBUTE, VllmVersionError
from vllm_support import vllm_source_dir

BLOCK, WINDOW, NUM_BLOCKS = 4, 8, 400
V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"


class V1GPUModelRunner:
    """Stands in for V1's ``GPUModelRunner`` (a GPU is needed to build the real one)."""

    def __init__(self):
        self.calls = []

    def initialize_kv_cache(self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None):
        self.kv_cache_config = kv_cache_config

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self.calls.append(("forward", trace.get_current_span()))
        return None  # as in 0.33: the sampled tokens come from sample_tokens()

    def sample_tokens(self, grammar_output):
        return ("sampled", grammar_output)


class V2GPUModelRunner(V1GPUModelRunner):
    """Stands in for Model Runner V2's ``GPUModelRunner`` (a GPU is needed to build the real one)."""

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False,
                      skip_attn_for_dummy_run=False, is_profile=False, context_len=0,
                      valid_dummy_state_slots=False, randomize_inputs=False):
        self.calls.append(("forward", trace.get_current_span()))
        return None

    def sample_tokens(self, grammar_output):
        return ("sampled", grammar_output)


def standin_scheduler_classes():
    class KVCacheBlock:
        def __init__(self, block_id, is_null=False):
            self.block_id, self.is_null = block_id, is_null

    null_block = KVCacheBlock(0, True)

    class FullAttentionManager:
        def __init__(self):
            self.req_to_blocks = defaultdict(list)

    class SlidingWindowManager:
        def __init__(self):
            self.block_size = BLOCK
            self.req_to_blocks = defaultdict(list)
            self.free = list(range(1, NUM_BLOCKS))

        def grow(self, request_id, num_tokens, processed):
            blocks = self.req_to_blocks[request_id]
            # vLLM frees on the tokens already processed, before allocating this step's
            for i in range(max(0, processed - WINDOW + 1) // self.block_size):
                if not blocks[i].is_null:
                    self.free.append(blocks[i].block_id)
                    blocks[i] = null_block
            while len(blocks) * self.block_size < num_tokens:
                blocks.append(KVCacheBlock(self.free.pop(0)))

        def finish(self, request_id):
            self.free.extend(b.block_id for b in self.req_to_blocks.pop(request_id) if not b.is_null)

    class Scheduler:
        def __init__(self, seed):
            self.rng = random.Random(seed)
            self.swa = SlidingWindowManager()
            self.kv_cache_manager = SimpleNamespace(coordinator=SimpleNamespace(
                single_type_managers=(FullAttentionManager(), self.swa)))
            self.requests = {}
            self.targets = {}
            self.next_id = 0

        def schedule(self, throttle_prefills=False):
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
                self.swa.grow(rid, req.num_computed_tokens + new, req.num_computed_tokens)
                req.num_computed_tokens += new
                scheduled[rid] = new
            return SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()))

    return Scheduler, SlidingWindowManager


@pytest.fixture
def vllm_standin(monkeypatch, tmp_path):
    def install(version: str = "0.33.0"):
        Scheduler, SlidingWindowManager = standin_scheduler_classes()
        runner_v1 = type("GPUModelRunner", (V1GPUModelRunner,), {
            "execute_model": V1GPUModelRunner.execute_model, "initialize_kv_cache": V1GPUModelRunner.initialize_kv_cache})
        runner_v2 = type("GPUModelRunner", (V2GPUModelRunner,), {
            "execute_model": V2GPUModelRunner.execute_model, "initialize_kv_cache": V2GPUModelRunner.initialize_kv_cache})
        install_standin(monkeypatch, tmp_path, "vllm", version, {
            "vllm.v1.core.sched.scheduler": {"Scheduler": Scheduler},
            "vllm.v1.core.single_type_kv_cache_manager": {"SlidingWindowManager": SlidingWindowManager},
            V1_RUNNER: {"GPUModelRunner": runner_v1},
            V2_RUNNER: {"GPUModelRunner": runner_v2},
        })
        return SimpleNamespace(Scheduler=Scheduler, V1=runner_v1, V2=runner_v2,
                               schedule=Scheduler.__dict__["schedule"],
                               execute_v1=runner_v1.__dict__["execute_model"],
                               execute_v2=runner_v2.__dict__["execute_model"])

    return install


instrumentor = pytest.fixture(vllm_instrumentor, name="instrumentor")


def recount(scheduler, output) -> tuple[int, int, int]:
    """(FULL tokens, tokens in real SWA blocks, tokens in null blocks), position by position."""
    full = held = out = 0
    for rid in output.num_scheduled_tokens:
        n = scheduler.requests[rid].num_computed_tokens
        blocks = scheduler.swa.req_to_blocks[rid]
        full += n
        for position in range(n):
            if blocks[position // BLOCK].is_null:
                out += 1
            else:
                held += 1
    return full, held, out


def test_off_wraps_nothing(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "0")
    monkeypatch.setattr("otel_swa.reporter.SwaDivergenceReporter.__init__",
                        lambda *a, **k: pytest.fail("reporter work while the interval is 0"))
    instrumentor.instrument(**pipeline.providers())
    assert v.Scheduler.__dict__["schedule"] is v.schedule
    assert v.V1.__dict__["execute_model"] is v.execute_v1 and v.V2.__dict__["execute_model"] is v.execute_v2
    scheduler = v.Scheduler(1)
    scheduler.schedule()
    assert SCHEDULER_ATTRIBUTE not in scheduler.__dict__


def test_instrument_wraps_uninstrument_restores_the_same_functions(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "5")
    instrumentor.instrument(**pipeline.providers())
    wrapped = v.Scheduler.__dict__["schedule"]
    assert wrapped is not v.schedule and wrapped.__wrapped__ is v.schedule
    assert v.V1.__dict__["execute_model"].__wrapped__ is v.execute_v1
    assert v.V2.__dict__["execute_model"].__wrapped__ is v.execute_v2
    instrumentor.instrument(**pipeline.providers())
    assert v.Scheduler.__dict__["schedule"] is wrapped
    instrumentor.uninstrument()
    instrumentor.uninstrument()
    assert v.Scheduler.__dict__["schedule"] is v.schedule
    assert v.V1.__dict__["execute_model"] is v.execute_v1 and v.V2.__dict__["execute_model"] is v.execute_v2


def test_driven_steps_give_records_recounted_from_the_tables(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "4")
    instrumentor.instrument(**pipeline.providers())
    scheduler = v.Scheduler(11)
    records, expected, totals = [], {}, [0, 0]
    for step in range(1, 61):
        output = scheduler.schedule()
        if step == 1:
            scheduler.__dict__[SCHEDULER_ATTRIBUTE].reporter.add_sink(lambda r, c: records.append(r))
        full, held, out = recount(scheduler, output)
        totals[0] += full
        totals[1] += held
        if step % 4 == 0:
            expected[step] = (totals[0], totals[1], 0, out)
    scheduler.__dict__[SCHEDULER_ATTRIBUTE].reporter.flush()
    got = {r.forward_ct: (r.verify_full, r.verify_swa, r.swa_full_idx_divergence, r.swa_out_of_window_tokens)
           for r in records}
    assert got == expected
    assert max(o for *_, o in expected.values()) >= 1  # blocks really left the window
    assert all(r.divergence_applicable is False for r in records)
    assert [e.attributes["kv_cache.swa.swa_out_of_window_tokens"] for e in pipeline.events()] == [
        o for *_, o in expected.values()]
    assert pipeline.points("kv_cache.swa.tokens.divergent") == []


def test_a_table_that_cannot_be_read_is_logged_once_and_its_step_still_counts(
    vllm_standin, instrumentor, pipeline, monkeypatch, caplog
):
    v = vllm_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "2")
    instrumentor.instrument(**pipeline.providers())
    scheduler = v.Scheduler(3)
    records = []
    scheduler.schedule()
    scheduler.__dict__[SCHEDULER_ATTRIBUTE].reporter.add_sink(lambda r, c: records.append(r))
    wiring = scheduler.__dict__[SCHEDULER_ATTRIBUTE]
    wiring.manager = SimpleNamespace(req_to_blocks={}, block_size=BLOCK)  # holds none of the requests
    with caplog.at_level(logging.ERROR):
        for _ in range(2):
            scheduler.schedule()
    wiring.manager = scheduler.swa
    output = scheduler.schedule()
    scheduler.__dict__[SCHEDULER_ATTRIBUTE].reporter.flush()
    ours = [r for r in caplog.records if r.name == "opentelemetry.instrumentation.swa_vllm"]
    assert len(ours) == 1 and "not read" in ours[0].getMessage() and ours[0].exc_info is not None
    # steps 2 and 3 counted an empty batch: the sample at step 2 sees no token, the one at step 4 its batch
    assert [(r.forward_ct, r.swa_out_of_window_tokens) for r in records] == [(2, 0), (4, recount(scheduler, output)[2])]


@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_the_forward_step_span_covers_the_runners_forward(vllm_standin, instrumentor, pipeline, monkeypatch, runner):
    v = vllm_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "4")
    monkeypatch.setenv("OTEL_SWA_FORWARD_SPANS", "all")  # every forward step, not only the sampled ones
    instrumentor.instrument(**pipeline.providers())
    model_runner = getattr(v, runner)()
    batches = [{"a": 5, "b": 1}, {"a": 1}, {"a": 1, "b": 1, "c": 9}]
    for scheduled in batches:
        output = SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()))
        assert model_runner.execute_model(output) is None
        assert model_runner.sample_tokens("grammar") == ("sampled", "grammar")  # not wrapped
    spans = pipeline.forward_spans()
    assert [s.attributes["forward_step.forward_ct"] for s in spans] == [1, 2, 3]
    assert [s.attributes["forward_step.batch_size"] for s in spans] == [2, 1, 3]
    # each forward ran inside its own span
    assert [call[1].get_span_context().span_id for call in model_runner.calls] == [
        s.context.span_id for s in spans]


def test_v2_warm_up_runs_and_empty_steps_are_not_forward_steps(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "4")
    monkeypatch.setenv("OTEL_SWA_FORWARD_SPANS", "all")  # every forward step, not only the sampled ones
    instrumentor.instrument(**pipeline.providers())
    runner = v.V2()
    batch = SimpleNamespace(num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3)
    empty = SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    runner.execute_model(batch, dummy_run=True)
    runner.execute_model(batch, None, True)  # dummy_run given by position
    runner.execute_model(empty)
    runner.execute_model(batch)
    assert len(runner.calls) == 4  # every call still ran
    spans = pipeline.forward_spans()
    assert [s.attributes["forward_step.forward_ct"] for s in spans] == [1]
    assert runner.calls[3][1].get_span_context().span_id == spans[0].context.span_id


def test_missing_method_fails_with_the_version_and_the_method(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin()
    del v.V1.execute_model
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    with pytest.raises(VllmVersionError, match=r"0\.33\.0.*GPUModelRunner\.execute_model\(scheduler_output"):
        instrumentor.instrument(**pipeline.providers())
    assert v.Scheduler.__dict__["schedule"] is v.schedule


def test_v2_without_dummy_run_is_an_unsupported_build(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin()
    v.V2.execute_model = lambda self, scheduler_output, intermediate_tensors=None: None
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    with pytest.raises(VllmVersionError, match=r"lack \['dummy_run'\]"):
        instrumentor.instrument(**pipeline.providers())


def test_unsupported_version_is_not_instrumented(vllm_standin, instrumentor, pipeline, monkeypatch):
    v = vllm_standin(version="0.31.0")
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    instrumentor.instrument(**pipeline.providers())
    assert v.Scheduler.__dict__["schedule"] is v.schedule


def test_unsupported_version_under_the_loaders_call_warns_once_and_wraps_nothing(
    vllm_standin, instrumentor, pipeline, monkeypatch, caplog
):
    v = vllm_standin(version="0.34.0")
    ours = instrument_as_the_loader(instrumentor, pipeline, monkeypatch, caplog, "opentelemetry.instrumentation.swa_vllm")
    assert v.Scheduler.__dict__["schedule"] is v.schedule
    assert v.V1.__dict__["execute_model"] is v.execute_v1 and v.V2.__dict__["execute_model"] is v.execute_v2
    assert ours == ["swa_vllm: installed vllm 0.34.0 is outside the supported vllm >= 0.32.0, < 0.34; "
                    "vLLM is not instrumented"]


def _method_parameters(source: str, class_name: str, method: str) -> list[tuple[str, str | None]]:
    """``[(name, default source or None)]`` of ``class_name.method`` in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    args = item.args
                    defaults = [None] * (len(args.args) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
                    return [(a.arg, d) for a, d in zip(args.args, defaults)]
    raise AssertionError(f"{class_name}.{method} is not in the source")


@pytest.mark.vllm
@pytest.mark.parametrize("path, standin", [
    ("v1/worker/gpu_model_runner.py", V1GPUModelRunner),
    ("v1/worker/gpu/model_runner.py", V2GPUModelRunner),
])
def test_runner_standins_have_the_signatures_of_vllm_source(path, standin):
    source = (vllm_source_dir() / path).read_text()
    for method in ("execute_model", "sample_tokens", "initialize_kv_cache"):
        ours = [(name, None if p.default is inspect.Parameter.empty else repr(p.default))
                for name, p in inspect.signature(getattr(standin, method)).parameters.items()]
        assert ours == _method_parameters(source, "GPUModelRunner", method), (path, method)
