"""The SGLang instrumentor on stand-in SGLang classes (module paths, method names and parameters of
sglang 0.5.23): wrapping, restoring, the off switch, version checks, and records, spans and
metrics from driven forward steps, every count recounted in plain Python.

The same instrumentor against SGLang's real classes: ``test_sglang_instrumentor_real.py``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from _instrumentation_support import install_standin, instrument_as_the_loader
from opentelemetry.instrumentation.swa_sglang import (
    CANARY_ATTRIBUTE, RUNNER_ATTRIBUTE, SglangVersionError, SwaSglangInstrumentor,
)

WINDOW = 6
FULL_SLOTS = 64
ROWS, WIDTH = 5, 16


class PoolKind:  # SGLang's enum members carry .name
    FULL = SimpleNamespace(name="FULL")
    SWA = SimpleNamespace(name="SWA")


def standin_classes(with_pre_ops: bool = True, positional_canary: bool = False):
    """Fresh stand-in ModelRunner / CanaryManager classes (fresh so no test sees another's wrapping).

    ``positional_canary``: ``CanaryManager.__init__`` takes its parameters by position too (sglang
    0.5.23 makes them keyword-only)."""

    class CanaryManager:
        def __init__(self, *, config=None, buffer_groups=(), device=None, req_to_token_pool=None,
                     swa_allocator=None, is_eagle_draft_decode=False):
            self._buffer_groups = tuple(buffer_groups)
            self.plan_counts = []  # per forward: {kind name: count}, set by the test

        def pre_ops_maybe_inside_graph(self, forward_batch):
            counts = self.plan_counts.pop(0)
            plans = tuple(SimpleNamespace(verify_num_valid=torch.tensor([counts[g.kind.name]], dtype=torch.int32))
                          for g in self._buffer_groups)
            return SimpleNamespace(verify_plans=plans)

    if not with_pre_ops:
        del CanaryManager.pre_ops_maybe_inside_graph
    if positional_canary:
        def __init__(self, config=None, buffer_groups=(), device=None, req_to_token_pool=None,
                     swa_allocator=None, is_eagle_draft_decode=False):
            self._buffer_groups = tuple(buffer_groups)
            self.plan_counts = []

        CanaryManager.__init__ = __init__

    class ModelRunner:
        def __init__(self, allocator, req_to_token_pool, canary_manager=None, is_draft_worker=False):
            self.device = "cpu"
            self.token_to_kv_pool_allocator = allocator
            self.req_to_token_pool = req_to_token_pool
            self.sliding_window_size = WINDOW
            self.canary_manager = canary_manager
            self.is_draft_worker = is_draft_worker
            self.forwards = 0

        def forward(self, forward_batch, skip_attn_backend_init=None, pp_proxy_tensors=None,
                    reinit_attn_backend=False, split_forward_count=1):
            if self.canary_manager is not None:
                self.canary_manager.pre_ops_maybe_inside_graph(forward_batch)
            self.forwards += 1
            return ("output", self.forwards)

        def init_cuda_graphs(self, capture_decode_cuda_graph=True):
            pass

    return ModelRunner, CanaryManager


@pytest.fixture
def sglang_standin(monkeypatch, tmp_path):
    def install(version: str = "0.5.23", with_pre_ops: bool = True, positional_canary: bool = False):
        ModelRunner, CanaryManager = standin_classes(with_pre_ops, positional_canary)
        install_standin(monkeypatch, tmp_path, "sglang", version, {
            "sglang.srt.model_executor.model_runner": {"ModelRunner": ModelRunner},
            "sglang.srt.kv_canary.runner.canary_manager": {"CanaryManager": CanaryManager},
        })
        return SimpleNamespace(ModelRunner=ModelRunner, CanaryManager=CanaryManager,
                               forward=ModelRunner.__dict__["forward"],
                               canary_init=CanaryManager.__dict__["__init__"],
                               pre_ops=CanaryManager.__dict__.get("pre_ops_maybe_inside_graph"))

    return install


@pytest.fixture
def instrumentor():
    made = SwaSglangInstrumentor()
    yield made
    made.uninstrument()


class CacheState:
    """A hybrid SWA cache state built by hand: ``req_to_token`` rows and a FULL-to-SWA mapping
    with identity, remapped and freed (0) entries, re-randomised every step."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.allocator = SimpleNamespace(full_to_swa_index_mapping=torch.zeros(FULL_SLOTS, dtype=torch.int64))
        self.pool = SimpleNamespace(req_to_token=torch.zeros((ROWS, WIDTH), dtype=torch.int32))

    def next_batch(self):
        rng = self.rng
        mapping = [0] + [rng.choice((0, f, rng.randrange(1, FULL_SLOTS))) for f in range(1, FULL_SLOTS)]
        self.allocator.full_to_swa_index_mapping.copy_(torch.tensor(mapping))
        rows = rng.sample(range(1, ROWS), rng.randint(1, ROWS - 1))
        lens = [rng.randint(1, WIDTH) for _ in rows]
        for r in rows:
            self.pool.req_to_token[r] = torch.tensor([rng.randrange(1, FULL_SLOTS) for _ in range(WIDTH)])
        return SimpleNamespace(
            batch_size=len(rows),
            forward_mode=SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False, is_mixed=lambda: False),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        )

    def recount(self, batch) -> tuple[int, int]:
        r2t, mapping = self.pool.req_to_token.tolist(), self.allocator.full_to_swa_index_mapping.tolist()
        divergence = out_of_window = 0
        for row, n in zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist()):
            for pos in range(n):
                full = r2t[row][pos]
                swa = mapping[full]
                out_of_window += swa == 0
                divergence += swa != 0 and swa != full
        return divergence, out_of_window


def test_off_wraps_nothing_and_does_no_reporter_work(sglang_standin, instrumentor, pipeline, monkeypatch):
    s = sglang_standin()
    monkeypatch.delenv("OTEL_SWA_DIVERGENCE_INTERVAL", raising=False)
    monkeypatch.setenv("SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL", "0")

    def no_reporter(*args, **kwargs):
        raise AssertionError("reporter work while the interval is 0")

    monkeypatch.setattr("otel_swa.reporter.SwaDivergenceReporter.__init__", no_reporter)
    instrumentor.instrument(**pipeline.providers())
    assert s.ModelRunner.__dict__["forward"] is s.forward
    assert s.CanaryManager.__dict__["pre_ops_maybe_inside_graph"] is s.pre_ops
    state = CacheState(1)
    runner = s.ModelRunner(state.allocator, state.pool)
    assert runner.forward(state.next_batch()) == ("output", 1)
    assert RUNNER_ATTRIBUTE not in runner.__dict__
    assert pipeline.forward_spans() == [] and pipeline.events() == []


def test_instrument_wraps_uninstrument_restores_the_same_functions(sglang_standin, instrumentor, pipeline, monkeypatch):
    s = sglang_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "4")
    instrumentor.instrument(**pipeline.providers())
    originals = {"forward": s.forward, "__init__": s.canary_init, "pre_ops_maybe_inside_graph": s.pre_ops}
    for name, original in originals.items():
        cls = s.ModelRunner if name == "forward" else s.CanaryManager
        assert cls.__dict__[name] is not original
        assert cls.__dict__[name].__wrapped__ is original
    wrapped = s.ModelRunner.__dict__["forward"]
    instrumentor.instrument(**pipeline.providers())  # second call: no second layer
    assert s.ModelRunner.__dict__["forward"] is wrapped
    instrumentor.uninstrument()
    instrumentor.uninstrument()
    assert s.ModelRunner.__dict__["forward"] is s.forward
    assert s.CanaryManager.__dict__["__init__"] is s.canary_init
    assert s.CanaryManager.__dict__["pre_ops_maybe_inside_graph"] is s.pre_ops


def test_driven_steps_give_recounted_records_spans_and_metrics(sglang_standin, instrumentor, pipeline, monkeypatch):
    s = sglang_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "3")
    monkeypatch.setenv("OTEL_SWA_FORWARD_SPANS", "all")  # a span at every forward step, not only sampled ones
    instrumentor.instrument(**pipeline.providers())
    instrumentor.instrument(**pipeline.providers())  # harmless twice
    state = CacheState(7)
    runner = s.ModelRunner(state.allocator, state.pool)
    records = []
    expected, full_total, swa_total = {}, 0, 0
    for step in range(1, 31):
        batch = state.next_batch()
        lens = batch.seq_lens.tolist()
        full_total += sum(lens)
        swa_total += sum(min(n, WINDOW + 1) for n in lens)  # sliding_window_size excludes the current token
        assert runner.forward(batch) == ("output", step)
        if step == 1:
            runner.__dict__[RUNNER_ATTRIBUTE].reporter.add_sink(lambda r, c: records.append(r))
        if step % 3 == 0:
            expected[step] = (full_total, swa_total) + state.recount(batch)
    reporter = runner.__dict__[RUNNER_ATTRIBUTE].reporter
    assert reporter.forward_ct == 30
    reporter.flush()
    got = {r.forward_ct: (r.verify_full, r.verify_swa, r.swa_full_idx_divergence, r.swa_out_of_window_tokens)
           for r in records}
    assert got == expected
    assert max(v[2] for v in expected.values()) >= 1 and max(v[3] for v in expected.values()) >= 1

    spans = pipeline.forward_spans()
    assert [sp.attributes["forward_step.forward_ct"] for sp in spans] == list(range(1, 31))
    assert all(sp.attributes["forward_step.num_decode"] == sp.attributes["forward_step.batch_size"] for sp in spans)
    # each sample's event belongs to the forward-step span of the step where it was taken
    span_of_step = {sp.attributes["forward_step.forward_ct"]: sp.context.span_id for sp in spans}
    events = pipeline.events()
    assert sorted(e.attributes["kv_cache.swa.forward_ct"] for e in events) == sorted(expected)
    assert all(e.span_id == span_of_step[e.attributes["kv_cache.swa.forward_ct"]] for e in events)
    last = expected[30]
    verified = {dict(p.attributes)["pool"]: p.value for p in pipeline.points("kv_cache.swa.entries.verified")}
    assert verified == {"full": last[0], "swa": last[1]}
    assert pipeline.points("kv_cache.swa.tokens.out_of_window")[0].value == last[3]


def test_counts_come_from_the_canary_plans_when_the_canary_is_installed(sglang_standin, instrumentor, pipeline, monkeypatch):
    s = sglang_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "2")
    instrumentor.instrument(**pipeline.providers())
    state = CacheState(3)
    groups = (SimpleNamespace(kind=PoolKind.FULL), SimpleNamespace(kind=PoolKind.SWA))
    canary = s.CanaryManager(buffer_groups=groups, device="cpu", req_to_token_pool=state.pool,
                             swa_allocator=state.allocator, is_eagle_draft_decode=False)
    reporter = getattr(canary, CANARY_ATTRIBUTE)
    records = []
    reporter.add_sink(lambda r, c: records.append(r))
    runner = s.ModelRunner(state.allocator, state.pool, canary_manager=canary)
    plans = [(11, 4), (9, 6), (30, 6), (1, 1)]
    canary.plan_counts = [{"FULL": f, "SWA": w} for f, w in plans]
    for _ in plans:
        runner.forward(state.next_batch())
    assert runner.__dict__[RUNNER_ATTRIBUTE].reporter is reporter  # one reporter per runner
    reporter.flush()
    assert [(r.forward_ct, r.verify_full, r.verify_swa) for r in records] == [(2, 20, 10), (4, 51, 17)]
    # a draft worker's canary gets no reporter
    draft = s.CanaryManager(buffer_groups=groups, device="cpu", is_eagle_draft_decode=True)
    assert getattr(draft, CANARY_ATTRIBUTE) is None


def test_canary_built_before_instrument_still_gets_read_entry_counts(sglang_standin, instrumentor, pipeline, monkeypatch):
    # The canary carries no reporter, so its pre_ops hook counts nothing: the runner's own
    # reporter must count the entries attention reads (seq_len in FULL, min(seq_len, window + 1) in SWA).
    s = sglang_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "2")
    state = CacheState(11)
    groups = (SimpleNamespace(kind=PoolKind.FULL), SimpleNamespace(kind=PoolKind.SWA))
    canary = s.CanaryManager(buffer_groups=groups, device="cpu")  # before instrument()
    instrumentor.instrument(**pipeline.providers())
    assert getattr(canary, CANARY_ATTRIBUTE, None) is None
    runner = s.ModelRunner(state.allocator, state.pool, canary_manager=canary)
    canary.plan_counts = [{"FULL": 1000, "SWA": 1000}] * 4  # never counted: no reporter on the canary
    records, full_total, swa_total, expected = [], 0, 0, []
    for step in range(1, 5):
        batch = state.next_batch()
        lens = batch.seq_lens.tolist()
        full_total += sum(lens)
        swa_total += sum(min(n, WINDOW + 1) for n in lens)  # sliding_window_size excludes the current token
        runner.forward(batch)
        if step == 1:
            runner.__dict__[RUNNER_ATTRIBUTE].reporter.add_sink(lambda r, c: records.append(r))
        if step % 2 == 0:
            expected.append((step, full_total, swa_total))
    runner.__dict__[RUNNER_ATTRIBUTE].reporter.flush()
    assert [(r.forward_ct, r.verify_full, r.verify_swa) for r in records] == expected
    assert expected[-1][1] > 0 and expected[-1][2] > 0


def test_canary_given_its_device_by_position_gets_a_reporter(sglang_standin, instrumentor, pipeline, monkeypatch):
    s = sglang_standin(positional_canary=True)
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "2")
    instrumentor.instrument(**pipeline.providers())
    groups = (SimpleNamespace(kind=PoolKind.FULL), SimpleNamespace(kind=PoolKind.SWA))
    canary = s.CanaryManager(None, groups, "cpu")
    reporter = getattr(canary, CANARY_ATTRIBUTE)
    assert reporter is not None and reporter.device == torch.device("cpu")
    draft = s.CanaryManager(None, groups, "cpu", None, None, True)  # is_eagle_draft_decode by position
    assert getattr(draft, CANARY_ATTRIBUTE) is None


def test_draft_worker_and_non_swa_runner_are_not_observed(sglang_standin, instrumentor, pipeline, monkeypatch):
    s = sglang_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    instrumentor.instrument(**pipeline.providers())
    state = CacheState(5)
    draft = s.ModelRunner(state.allocator, state.pool, is_draft_worker=True)
    plain = s.ModelRunner(SimpleNamespace(), state.pool)  # allocator without an SWA mapping
    for runner in (draft, plain):
        assert runner.forward(state.next_batch()) == ("output", 1)
        assert runner.__dict__[RUNNER_ATTRIBUTE] is None
    assert pipeline.forward_spans() == []


def test_a_broken_batch_never_breaks_the_forward(sglang_standin, instrumentor, pipeline, monkeypatch):
    s = sglang_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    instrumentor.instrument(**pipeline.providers())
    state = CacheState(2)
    runner = s.ModelRunner(state.allocator, state.pool)
    assert runner.forward(SimpleNamespace()) == ("output", 1)  # no seq_lens, no mode: logged only
    assert len(pipeline.forward_spans()) == 1


def test_missing_method_fails_with_the_version_and_the_method(sglang_standin, instrumentor, pipeline, monkeypatch):
    s = sglang_standin(with_pre_ops=False)
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    with pytest.raises(SglangVersionError, match=r"0\.5\.23.*CanaryManager\.pre_ops_maybe_inside_graph\(forward_batch"):
        instrumentor.instrument(**pipeline.providers())
    assert s.ModelRunner.__dict__["forward"] is s.forward  # checked before anything was wrapped


def test_unsupported_version_is_not_instrumented(sglang_standin, instrumentor, pipeline, monkeypatch):
    s = sglang_standin(version="0.4.9")
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    instrumentor.instrument(**pipeline.providers())
    assert s.ModelRunner.__dict__["forward"] is s.forward
    assert instrumentor.instrumentation_dependencies() == ("sglang >= 0.5.23, < 0.6",)


def test_unsupported_version_under_the_loaders_call_warns_once_and_wraps_nothing(
    sglang_standin, instrumentor, pipeline, monkeypatch, caplog
):
    s = sglang_standin(version="0.4.9")
    ours = instrument_as_the_loader(instrumentor, pipeline, monkeypatch, caplog, "opentelemetry.instrumentation.swa_sglang")
    assert s.ModelRunner.__dict__["forward"] is s.forward
    assert ours == ["swa_sglang: installed sglang 0.4.9 is outside the supported sglang >= 0.5.23, < 0.6; "
                    "SGLang is not instrumented"]


def test_pipeline_micro_batch_of_each_record_from_the_scheduler(sglang_standin, instrumentor, pipeline, monkeypatch, tmp_path):
    """Under pipeline parallelism SGLang's event loop runs ``scheduler.mbs[mb_id]`` through
    ``Scheduler.run_batch``: each record carries the micro-batch it sampled, every micro-batch of a
    sampled round with OTEL_SWA_MICRO_BATCHES=every."""
    ModelRunner, CanaryManager = standin_classes()

    class Scheduler:  # stands in for sglang.srt.managers.scheduler.Scheduler: run_batch and the PP loop's mbs
        def __init__(self, runner, pp_size):
            self.model_runner, self.mbs = runner, [None] * pp_size

        def run_batch(self, batch):
            return self.model_runner.forward(batch.forward_batch)

    install_standin(monkeypatch, tmp_path, "sglang", "0.5.23", {
        "sglang.srt.model_executor.model_runner": {"ModelRunner": ModelRunner},
        "sglang.srt.kv_canary.runner.canary_manager": {"CanaryManager": CanaryManager},
        "sglang.srt.managers.scheduler": {"Scheduler": Scheduler},
    })
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "4")
    monkeypatch.setenv("OTEL_SWA_MICRO_BATCHES", "every")
    instrumentor.instrument(**pipeline.providers())
    # the stand-in scheduler keeps no request queues or prefix cache: no SWA slot audit here
    monkeypatch.setattr(instrumentor, "_holder_full_slots", lambda: None)
    state = CacheState(3)
    scheduler = Scheduler(ModelRunner(state.allocator, state.pool), pp_size=3)
    expected, records = {}, []
    for step in range(1, 25):
        mb_id = (step - 1) % 3  # SGLang: for mb_id in range(pp_loop_size)
        scheduler.mbs[mb_id] = SimpleNamespace(forward_batch=state.next_batch(), reqs=[])
        scheduler.run_batch(scheduler.mbs[mb_id])
        if step == 1:
            scheduler.model_runner.__dict__[RUNNER_ATTRIBUTE].reporter.add_sink(lambda r, c: records.append(r))
        expected[step] = (mb_id, state.recount(scheduler.mbs[mb_id].forward_batch))
    # interval 4 with 3 micro-batches: forward 4 is micro-batch 0, then 5 (1) and 6 (2) finish the
    # round; forward 8 is micro-batch 1, then 9 (2) and 10 (0)...
    sampled = [4, 5, 6, 8, 9, 10, 12, 13, 14, 16, 17, 18, 20, 21, 22, 24]
    scheduler.model_runner.__dict__[RUNNER_ATTRIBUTE].reporter.flush()  # the events' delivery thread too
    got = {r.forward_ct: (r.micro_batch, (r.swa_full_idx_divergence, r.swa_out_of_window_tokens)) for r in records}
    assert got == {ct: expected[ct] for ct in sampled}
    events = {e.attributes["kv_cache.swa.forward_ct"]: e.attributes["kv_cache.swa.micro_batch"] for e in pipeline.events()}
    assert events == {ct: expected[ct][0] for ct in sampled}


def test_swa_entries_read_in_an_extend_batch_are_the_union_of_the_new_tokens_windows(
        sglang_standin, instrumentor, pipeline, monkeypatch):
    """A prefill chunk's queries each read sliding_window_size + 1 keys, their own included: the
    union over the chunk is min(seq_len, sliding_window_size + extend_len) per request."""
    s = sglang_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    instrumentor.instrument(**pipeline.providers())
    state = CacheState(5)
    runner = s.ModelRunner(state.allocator, state.pool)
    batch = state.next_batch()
    lens = [16, 3, 10]  # with WINDOW 6: the windows of 4 new tokens of 16, of all 3 of 3, of 2 new of 10
    extend = [4, 3, 2]
    batch.req_pool_indices = torch.tensor([1, 2, 3])
    batch.seq_lens = batch.seq_lens_cpu = torch.tensor(lens, dtype=torch.int32)
    batch.batch_size = 3
    batch.extend_seq_lens_cpu = extend
    batch.forward_mode = SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True, is_mixed=lambda: False)
    records = []
    runner.forward(batch)
    reporter = runner.__dict__[RUNNER_ATTRIBUTE].reporter
    reporter.add_sink(lambda r, c: records.append(r))
    decode = state.next_batch()
    runner.forward(decode)
    reporter.flush()
    # by hand: min(16, 6 + 4) + min(3, 6 + 3) + min(10, 6 + 2) = 10 + 3 + 8 = 21, then the decode
    # batch min(n, 7) per request
    assert records[-1].verify_swa == 21 + sum(min(n, WINDOW + 1) for n in decode.seq_lens.tolist())
    assert records[-1].verify_full == 29 + sum(decode.seq_lens.tolist())


def test_sglangs_per_request_swa_ring_gets_no_reporter(sglang_standin, instrumentor, pipeline, monkeypatch):
    """sglang 0.5.23's ring mode (``SWATokenToKVPoolAllocator.swa_req_ring``) never writes
    full_to_swa_index_mapping: sampling it would report every token as out of window."""
    s = sglang_standin()
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    instrumentor.instrument(**pipeline.providers())
    state = CacheState(2)
    state.allocator.swa_req_ring = True
    runner = s.ModelRunner(state.allocator, state.pool)
    assert runner.forward(state.next_batch()) == ("output", 1)
    assert runner.__dict__[RUNNER_ATTRIBUTE] is None
    assert pipeline.events() == []
