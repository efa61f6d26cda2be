"""otel-swa's vLLM support against vLLM 0.33.0's real classes, on CPU (marker ``vllm``).

Run by ``.ci/vllm-tests.sh`` in its own environment. Without vLLM these tests are skipped; with
``OTEL_SWA_REQUIRE_VLLM=1`` a failed vLLM import fails them.

Real: ``KVCacheManager`` with its ``HybridKVCacheCoordinator`` (a ``FullAttentionSpec`` group and a
``SlidingWindowSpec`` group over one ``BlockPool``), ``SlidingWindowManager``, ``KVCacheBlock``,
``Request``, ``SamplingParams``, ``VllmConfig`` (``DeviceConfig(device="cpu")``, a tiny Llama
``config.json`` written at test time) and the ``Scheduler`` with its ``schedule()`` /
``update_from_output()``, driven until every request finishes.

Stand-in: only the GPU model runner's output. No model runs here (a GPU model runner cannot be
built on CPU), so each step's ``ModelRunnerOutput`` is written by the test: one sampled token for
each request whose prompt is complete, none for a prefill chunk. The runners' own wrapping is
tested on stand-ins with the real signatures in ``test_vllm_instrumentor.py``; here the real
runner classes are only checked to be wrapped and restored.

Every expected value is recounted by plain loops over the real tables
(``SlidingWindowManager.req_to_blocks``, ``KVCacheBlock.is_null`` / ``block_id``), position by
position (:func:`vllm_support.recount`); never from ``get_num_skipped_tokens``, which the tables
lag.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from opentelemetry.instrumentation.swa_vllm import SCHEDULER_ATTRIBUTE, SwaVllmInstrumentor
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.testing import assert_swa_divergence_observed
from otel_swa.views import vllm as vllm_view
from vllm_support import (  # noqa: F401
    BLOCK,
    PREEMPTING_BLOCKS,
    WINDOW,
    hybrid_kv_cache_config,
    make_scheduler,
    recount,
    sampled,
    swa_manager,
    trace_requests,
    vllm_classes,
    window_recount,
)

pytestmark = pytest.mark.vllm


# ---------------------------------------------------------------------------------------- formula
@pytest.mark.parametrize("window, extra", [(1, 0), (5, 0), (64, 0), (64, 3), (128, 17)])
def test_num_skipped_tokens_is_the_real_method(vllm_classes, window, extra):
    v = vllm_classes
    config = hybrid_kv_cache_config(v, num_blocks=8, block_size=BLOCK, window=window, extra_retained_tokens=extra)
    manager = swa_manager(v, v.KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK,
                                              hash_block_size=BLOCK))
    assert manager.extra_retained_tokens == extra
    for n in range(0, 400):
        assert vllm_view.num_skipped_tokens(n, window, extra) == manager.get_num_skipped_tokens(n), (n, window, extra)


# ------------------------------------------------------------------------------ KV cache manager
class ManagerDriver:
    """Drives a real ``KVCacheManager`` the way vLLM's scheduler calls it, one step at a time."""

    def __init__(self, v, manager, chunk: int):
        self.v, self.manager, self.chunk = v, manager, chunk
        self.running: list = []
        self.hits: dict[str, int] = {}

    def admit(self, request) -> None:
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        self.hits[request.request_id] = hit
        self.running.append((request, blocks, hit))

    def step(self) -> list:
        """Allocate and compute one step for every running request; the requests stepped."""
        stepped = []
        for index, (request, blocks, hit) in enumerate(self.running):
            first = request.status != self.v.RequestStatus.RUNNING
            done = request.num_computed_tokens + (hit if first else 0)
            new = min(self.chunk, request.num_tokens - done)
            allocated = self.manager.allocate_slots(
                request, new, num_new_computed_tokens=hit if first else 0,
                new_computed_blocks=blocks if first else None)
            assert allocated is not None, f"out of blocks for {request.request_id}"
            request.num_computed_tokens = done + new
            request.status = self.v.RequestStatus.RUNNING
            if request.num_computed_tokens == request.num_tokens:  # prompt complete: a token is sampled
                request.append_output_token_ids(sampled(request))
            self.running[index] = (request, None, 0)
            stepped.append(request)
        return stepped

    def finish(self, request) -> None:
        self.manager.free(request)
        self.running = [entry for entry in self.running if entry[0] is not request]


def test_kv_cache_manager_counts_equal_the_real_tables_at_every_step(vllm_classes):
    """Chunked prefill, decode past the window, a prefix hit: at every step the view's counts, its
    sample through the reporter and the tensor path equal the recount of the real tables."""
    v = vllm_classes
    window = 128
    config = hybrid_kv_cache_config(v, num_blocks=200, block_size=BLOCK, window=window)
    kv = v.KVCacheManager(config, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=True)
    assert type(kv.coordinator).__name__ == "HybridKVCacheCoordinator"
    swa = swa_manager(v, kv)
    hasher = v.get_request_block_hasher(BLOCK, v.sha256)

    def request(rid, prompt):
        return v.Request(rid, prompt, v.SamplingParams(max_tokens=512), None, block_hasher=hasher)

    prompt_a = [(i * 37 + 5) % 1000 + 3 for i in range(300)]
    a = request("A", prompt_a)
    b = request("B", [(i * 11 + 1) % 1000 + 3 for i in range(100)])
    c = request("C", prompt_a[:288] + [(i * 13 + 2) % 1000 + 3 for i in range(42)])  # shares A's prefix
    d = request("D", [(i * 29 + 7) % 1000 + 3 for i in range(600)])
    driver = ManagerDriver(v, kv, chunk=128)
    records = []
    reporters = {name: SwaDivergenceReporter(1, sinks=[lambda r, ctx, name=name: records.append((name, r))])
                 for name in ("table", "tensor")}
    totals, lagged, nulls_at_admission, peak_out = [0, 0], 0, {}, 0
    for step in range(1, 61):
        if step == 1:
            driver.admit(a)
        if step == 2:
            driver.admit(b)
        if step == 8:
            driver.admit(c)
        if step == 10:
            driver.admit(d)
        if step == 40:
            driver.finish(b)
        stepped = driver.step()
        ids = [r.request_id for r in stepped]
        lens = [r.num_computed_tokens for r in stepped]
        full, held, out = recount(swa, ids, lens)
        peak_out = max(peak_out, out)
        if step == 8:
            nulls_at_admission = {rid: sum(blk.is_null for blk in swa.req_to_blocks[rid]) for rid in ("C",)}
        for r in stepped:
            null_blocks = sum(blk.is_null for blk in swa.req_to_blocks[r.request_id])
            formula_blocks = vllm_view.num_skipped_tokens(r.num_computed_tokens, window) // BLOCK
            assert null_blocks <= formula_blocks  # the table never frees ahead of vLLM's formula
            lagged += null_blocks < formula_blocks
        table = vllm_view.read_window_table(swa, ids, lens)
        assert table.counts == vllm_view.WindowCounts(full, held, out), step
        ids_table = vllm_view.block_table_from_manager(swa, ids)
        tokens = torch.tensor(lens, dtype=torch.int64)
        assert vllm_view.window_counts(ids_table, tokens, BLOCK) == table.counts, step
        totals[0] += full
        totals[1] += held
        for reporter in reporters.values():
            vllm_view.observe_counts(reporter, table.counts)
        records.clear()
        reporters["table"].step(table.view)
        reporters["tensor"].step(vllm_view.batch_view(ids_table, tokens, BLOCK, num_blocks=kv.block_pool.num_gpu_blocks,
                                                      num_tokens_cpu=lens))
        for reporter in reporters.values():
            reporter.flush()
        got = {name: (r.forward_ct, r.verify_full, r.verify_swa, r.swa_out_of_window_tokens) for name, r in records}
        assert got == {name: (step, totals[0], totals[1], out) for name in reporters}, step
    assert driver.hits["C"] >= 256  # a real prefix hit on A's blocks
    assert nulls_at_admission["C"] >= 1  # null entries at admission, from the hit alone
    assert lagged >= 1  # the table lagged get_num_skipped_tokens at some step
    assert peak_out >= window  # requests decoded well past the window
    for r in (a, c, d):
        driver.finish(r)
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_gpu_blocks - 1


# ------------------------------------------------------------------------------------ scheduler
INTERVAL = 5


def test_scheduler_on_the_trace_gives_records_equal_to_the_real_tables(vllm_classes, tmp_path, pipeline, monkeypatch):
    """The instrumentor wraps the real ``Scheduler.schedule``; over a run with chunked prefill,
    prefix hits and preemption, every record, event and metric equals the recount."""
    v = vllm_classes
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", str(INTERVAL))
    original = v.Scheduler.__dict__["schedule"]
    instrumentor = SwaVllmInstrumentor()
    instrumentor.instrument(**pipeline.providers())
    records = []
    try:
        assert v.Scheduler.__dict__["schedule"].__wrapped__ is original
        scheduler = make_scheduler(v, tmp_path / "tiny-llama", num_blocks=PREEMPTING_BLOCKS)
        assert type(scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
        swa = swa_manager(v, scheduler.kv_cache_manager)
        requests = trace_requests(v)
        for r in requests:
            scheduler.add_request(r)
        forward, totals, expected, window_expected, held_past_window = 0, [0, 0], {}, {}, 0
        old_rule = 0  # what the SWA count was before: min(n, window) per request
        preempted, chunked, hits = set(), 0, 0
        for _ in range(2000):
            if not scheduler.get_num_unfinished_requests():
                break
            output = scheduler.schedule()
            ids = list(output.num_scheduled_tokens)
            if forward == 0 and ids:
                scheduler.__dict__[SCHEDULER_ATTRIBUTE].reporter.add_sink(lambda r, c: records.append(r))
            preempted |= set(output.preempted_req_ids or ())
            hits += sum(1 for new in output.scheduled_new_reqs if new.num_computed_tokens > 0)
            if ids:
                forward += 1
                lens = [scheduler.requests[rid].num_computed_tokens for rid in ids]
                chunked += sum(1 for rid, n in zip(ids, lens) if n < scheduler.requests[rid].num_prompt_tokens)
                full, held, out = recount(swa, ids, lens)
                totals[0] += full
                totals[1] += held
                old_rule += sum(min(n, WINDOW) for n in lens)
                if forward % INTERVAL == 0:
                    expected[forward] = (totals[0], totals[1], 0, out)
                    window_expected[forward] = list(window_recount(scheduler, output, swa)[:2])
                    held_past_window += sum(not swa.req_to_blocks[rid][p // BLOCK].is_null
                                            for rid, n in zip(ids, lens) for p in range(max(0, n - WINDOW)))
            sampled_ids = [[sampled(scheduler.requests[rid])]
                           if scheduler.requests[rid].num_computed_tokens >= scheduler.requests[rid].num_tokens
                           else [] for rid in ids]
            scheduler.update_from_output(output, v.ModelRunnerOutput(
                req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled_ids))
        assert scheduler.get_num_unfinished_requests() == 0
    finally:
        instrumentor.uninstrument()  # flushes the reporter
    assert v.Scheduler.__dict__["schedule"] is original
    # the run had what it was built for
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in requests)
    assert preempted, "no request was preempted"
    assert chunked >= 1, "no prefill was chunked"
    assert hits >= 1, "no prefix-cache hit"
    assert max(out for *_, out in expected.values()) >= 1
    assert totals[1] != old_rule  # the tables hold other than min(n, window) tokens: verify_swa counts them
    # records, events and metrics against the recount
    got = {r.forward_ct: (r.verify_full, r.verify_swa, r.swa_full_idx_divergence, r.swa_out_of_window_tokens)
           for r in records}
    assert got == expected
    assert all(r.divergence_applicable is False for r in records)
    # the window check: equal to the tables position by position (vllm_support.window_recount); a
    # healthy vLLM frees no block the next query reads, and keeps none past its own trimming
    assert {r.forward_ct: [r.swa_premature_evictions, r.swa_late_held_slots] for r in records} == window_expected
    assert {tuple(counts) for counts in window_expected.values()} == {(0, 0)}
    assert held_past_window >= 1  # the tables do hold blocks past the window: the allowance is needed
    events = pipeline.events()
    fields = ("forward_ct", "verify_full", "verify_swa", "swa_full_idx_divergence", "swa_out_of_window_tokens")
    assert {e.attributes["kv_cache.swa.forward_ct"]: tuple(e.attributes[f"kv_cache.swa.{f}"] for f in fields[1:])
            for e in events} == expected
    assert all(e.attributes["kv_cache.swa.divergence_applicable"] is False for e in events)
    last = max(expected)
    verified = {p.attributes["pool"]: p.value for p in pipeline.points("kv_cache.swa.entries.verified")}
    assert verified == {"full": expected[last][0], "swa": expected[last][1]}
    assert [p.value for p in pipeline.points("kv_cache.swa.tokens.out_of_window")] == [expected[last][3]]
    assert [p.value for p in pipeline.points("kv_cache.swa.forward_steps")] == [last]
    assert pipeline.points("kv_cache.swa.tokens.divergent") == []
    # the CI verdict on this healthy run's lines, as a line sink writes them: it passes, the
    # divergence placeholder (0) not judged
    log = tmp_path / "vllm.log"
    log.write_text("".join(line + "\n" for r in records for line in r.lines()))
    assert '"divergence_applicable":false' in log.read_text()
    observation = assert_swa_divergence_observed(str(log))
    assert not observation.groups[0].divergence_applicable


# ---------------------------------------------------------------------------------- model runners
@pytest.mark.parametrize("module_name", ["vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner"])
def test_the_real_model_runner_classes_are_wrapped_and_restored(vllm_classes, pipeline, monkeypatch, module_name):
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "5")
    instrumentor = SwaVllmInstrumentor()
    instrumentor.instrument(**pipeline.providers())
    try:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # the runner modules import GPU libraries; not every machine has them
            pytest.skip(f"{module_name} does not import here ({exc!r})")
        wrapped = module.GPUModelRunner.__dict__["execute_model"]
        original = wrapped.__wrapped__
        assert wrapped is not original
    finally:
        instrumentor.uninstrument()
    assert module.GPUModelRunner.__dict__["execute_model"] is original
