"""The write check on vLLM's KV cache, wired by the vLLM instrumentor, on the CPU.

vLLM 0.33's GPU worker is replaced by the stand-ins of :mod:`shims.vllm_attention` (a
``GPUModelRunner`` with ``initialize_kv_cache`` / ``execute_model``, a ``FlashAttentionImpl``
whose ``do_kv_cache_update`` stores with ``reshape_and_cache_flash``'s semantics into a cache of
0.33's layout, the ``Attention`` layer, the forward context); the scheduler side is the
instrumentor's own, driven by a stand-in ``Scheduler``. The instrumentor wires the check on CUDA
and on the CPU (vLLM's CPU model runner); the test of the device condition takes ``"cpu"`` out of
``WIRED_DEVICE_TYPES`` (monkeypatched) to stand for a device type otel-swa does not wire. The loop is vLLM's ``EngineCore.step``: ``schedule()`` then
``execute_model()``.

Expected counts are recounted from what the stand-in runner stored at each step (its slot
mappings, positions, batch order), not from otel-swa's code: with at most 8 slots per step
(:data:`~shims.vllm_attention.GRAPH_TOKENS`, the write check's ``max_tokens``) every slot of a
checked layer is compared, so a sampled step checks, per KV cache group kind, each of its tokens
whose slot is not padding.
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
from types import SimpleNamespace

import pytest
import torch

from _instrumentation_support import install_standin
from opentelemetry.instrumentation.swa_vllm import SwaVllmInstrumentor
from opentelemetry.instrumentation.swa_vllm import write_check as vllm_write
from shims import vllm_attention as shim
from vllm_support import vllm_source_dir

INTERVAL = 3
STEPS = 12  # samples at forward_ct 3, 6, 9, 12; each carries the check of the forward before it


@pytest.fixture
def engine(monkeypatch, tmp_path):
    """Stand-in vLLM installed, the instrumentor on (interval 3), ``cpu`` allowed as a CUDA device
    would be; yields a factory ``make(**runner_options) -> (scheduler, runner, records, log)``."""
    from _instrumentation_support import Pipeline
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor

    from otel_swa.telemetry.logline import SwaLogLineExporter

    runner_v2 = type("GPUModelRunner", (), {"execute_model": lambda self, scheduler_output, intermediate_tensors=None,
                                            dummy_run=False: None,
                                            "initialize_kv_cache": shim.GPUModelRunner.initialize_kv_cache})
    install_standin(monkeypatch, tmp_path, "vllm", "0.33.0", {
        "vllm.v1.core.sched.scheduler": {"Scheduler": shim.Scheduler},
        "vllm.v1.core.single_type_kv_cache_manager": {"SlidingWindowManager": shim.SlidingWindowManager},
        "vllm.v1.worker.gpu_model_runner": {"GPUModelRunner": shim.GPUModelRunner},
        "vllm.v1.worker.gpu.model_runner": {"GPUModelRunner": runner_v2},
        "vllm.forward_context": {"get_forward_context": shim.get_forward_context},
    })
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", str(INTERVAL))
    monkeypatch.setattr(vllm_write, "WIRED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(vllm_write, "_LOGGED", set())
    saved = {name: shim.GPUModelRunner.__dict__[name] for name in ("execute_model", "initialize_kv_cache")}
    saved_store = shim.FlashAttentionImpl.__dict__["do_kv_cache_update"]
    monkeypatch.setattr(shim.FlashAttentionImpl, "fault", None)
    pipeline = Pipeline.make()
    stream = io.StringIO()
    pipeline.logger_provider.add_log_record_processor(SimpleLogRecordProcessor(SwaLogLineExporter(stream=stream)))
    records = []
    instrumentor = SwaVllmInstrumentor()
    made = []

    def make(**options):
        instrumentor.instrument(**pipeline.providers())
        runner = shim.GPUModelRunner(**options)
        runner.initialize_kv_cache(kv_cache_config())
        scheduler = shim.Scheduler()
        made.append((scheduler, runner))
        return scheduler, runner, records, stream

    yield make
    instrumentor.uninstrument()
    pipeline.shutdown()
    assert {n: shim.GPUModelRunner.__dict__[n] for n in saved} == saved
    assert shim.FlashAttentionImpl.__dict__["do_kv_cache_update"] is saved_store


def kv_cache_config():
    """Stands in for vLLM's ``KVCacheConfig``: ``kv_cache_groups[i].layer_names`` / ``.kv_cache_spec``."""
    specs = (shim.FullAttentionSpec(), shim.SlidingWindowSpec())
    groups = [SimpleNamespace(layer_names=[n for n, g in shim.LAYERS if g == group], kv_cache_spec=spec)
              for group, spec in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups)


def drive(scheduler, runner, steps=STEPS):
    """vLLM's ``EngineCore.step`` loop: ``schedule()``, then ``execute_model()``; the records as
    delivered (the reporter on the CPU delivers at once)."""
    wiring = None
    records = []
    for _ in range(steps):
        output = scheduler.schedule()
        if wiring is None:
            from opentelemetry.instrumentation.swa_vllm import SCHEDULER_ATTRIBUTE

            wiring = scheduler.__dict__[SCHEDULER_ATTRIBUTE]
            wiring.reporter.add_sink(lambda record, context: records.append(record))
        runner.execute_model(output)
    wiring.reporter.flush()
    return records


def recount(step) -> int:
    """(token, layer) pairs a sampled step checks: one layer per KV cache group kind, each token
    whose slot is not padding (every slot is compared: at most 8 per step)."""
    return sum(2 for s in step.slot_mappings[shim.LAYERS[0][0]].tolist() if s >= 0)


def checked_forward(record):
    """The forward step (1-based) whose check a record carries: the one before its schedule()."""
    return record.forward_ct - 1


def test_clean_steps_count_every_token_of_each_kind_and_nothing_between(engine):
    scheduler, runner, _, _ = engine()
    records = drive(scheduler, runner)
    assert [r.forward_ct for r in records] == [3, 6, 9, 12]
    expected = [recount(runner.steps[checked_forward(r) - 1]) for r in records]
    assert [(r.kv_write_checks, r.kv_write_mismatches, r.kv_write_unchecked) for r in records] == [
        (n, 0, 0) for n in expected]
    assert all(n > 0 for n in expected)
    assert all(r.offender("kv_write_mismatches") is None for r in records)


def test_a_store_one_slot_off_is_counted_and_named(engine, tmp_path):
    from otel_swa.cli import main as otel_swa_cli

    scheduler, runner, _, stream = engine()
    shim.FlashAttentionImpl.fault = "slot+1"
    records = drive(scheduler, runner)
    record = records[0]
    step = runner.steps[checked_forward(record) - 1]
    assert (record.kv_write_checks, record.kv_write_mismatches) == (recount(step), recount(step))
    offender = record.offender("kv_write_mismatches")
    # the first offender is one of the step's tokens, and every field agrees with what was stored
    names = dict(shim.LAYERS)
    assert offender.layer_name in names and offender.kv_cache_group == names[offender.layer_name]
    assert offender.layer == int(offender.layer_name.split(".")[2])
    slots = step.slot_mappings[offender.layer_name].tolist()
    token = next(i for i, (row, position) in enumerate(zip(step.rows, step.positions))
                 if row == offender.row and position == offender.position)
    assert offender.request == step.order[offender.row]
    swa = names[offender.layer_name] == 1
    assert (offender.pool, offender.swa_slot if swa else offender.full_slot) == ("swa" if swa else "full", slots[token])
    assert (offender.full_slot if swa else offender.swa_slot) is None
    log = tmp_path / "vllm.log"
    log.write_text(stream.getvalue())
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = otel_swa_cli(["check", str(log), "--min-divergence", "0", "--min-out-of-window", "0"])
    text = out.getvalue()
    assert status == 1, text
    assert "kv_write_mismatches" in text and f"request {offender.request}" in text, text
    assert f"layer {offender.layer} ({offender.layer_name})" in text, text


def test_a_skipped_token_is_the_one_named(engine):
    scheduler, runner, _, _ = engine()
    # forward 5 (checked, carried by the record at forward_ct 6) writes position 6 of req-1 and req-0
    shim.FlashAttentionImpl.fault = ("skip", "req-1", 6)
    records = drive(scheduler, runner)
    faulty = []
    for record in records:
        step = runner.steps[checked_forward(record) - 1]
        lost = [i for i, (row, p) in enumerate(zip(step.rows, step.positions)) if (step.order[row], p) == ("req-1", 6)]
        # one layer of each kind checked per sampled step: the token is lost in both
        assert (record.kv_write_checks, record.kv_write_mismatches) == (recount(step), 2 * len(lost))
        if lost:
            faulty.append((record, step, lost[0]))
    assert [f[0].forward_ct for f in faulty] == [6]
    record, step, token = faulty[0]
    offender = record.offender("kv_write_mismatches")
    assert (offender.request, offender.row, offender.position) == ("req-1", step.rows[token], 6)
    # the k-th sample's forward checks the (k mod 2)-th layer of each kind; the first of them in
    # model order finds the lost token first: the second sample, layers 2 (SWA) and 3 (full)
    k = records.index(record)
    kinds = [[n for n, g in shim.LAYERS if g == group] for group in (0, 1)]
    checked = [kinds[0][k % 2], kinds[1][k % 2]]
    first = offender.layer_name
    assert first == min(checked, key=[n for n, _ in shim.LAYERS].index) == shim.LAYERS[2][0]
    assert offender.kv_cache_group == dict(shim.LAYERS)[first] and offender.layer == 2
    slot = step.slot_mappings[first].tolist()[token]
    assert (offender.swa_slot, offender.full_slot) == ((slot, None) if offender.kv_cache_group == 1 else (None, slot))


def test_clean_run_passes_otel_swa_check(engine, tmp_path):
    from otel_swa.cli import main as otel_swa_cli

    scheduler, runner, _, stream = engine()
    drive(scheduler, runner)
    log = tmp_path / "vllm.log"
    log.write_text(stream.getvalue())
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = otel_swa_cli(["check", str(log), "--min-divergence", "0", "--min-out-of-window", "0",
                               "--no-verify-lag"])  # the stand-in's requests never outgrow a window
    assert status == 0, out.getvalue()
    assert "kv_write_mismatches=0 throughout" in out.getvalue()


def test_fp8_cache_is_counted_unchecked(engine):
    scheduler, runner, _, _ = engine(kv_cache_dtype="fp8", cache_dtype=torch.uint8)
    shim.FlashAttentionImpl.fault = "slot+1"  # not seen: an fp8 cache is not compared
    records = drive(scheduler, runner)
    assert [(r.kv_write_checks, r.kv_write_mismatches, r.kv_write_unchecked) for r in records] == [
        (0, 0, recount(runner.steps[checked_forward(r) - 1])) for r in records]


def test_a_failing_check_never_breaks_the_store(engine, monkeypatch, caplog):
    scheduler, runner, _, _ = engine()

    def broken(*args, **kwargs):
        raise RuntimeError("otel-swa's part failed")

    monkeypatch.setattr("otel_swa.views.vllm_write.layer_store", broken)
    with caplog.at_level(logging.ERROR, logger="opentelemetry.instrumentation.swa_vllm"):
        drive(scheduler, runner)
    failures = [r for r in caplog.records if "write check" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    step = runner.steps[-1]
    for name, _ in shim.LAYERS:  # every store still happened
        key, _ = step.stored[name]
        slots = step.slot_mappings[name].tolist()
        kv = runner.layers[name].kv_cache
        for i, s in enumerate(slots):
            if s >= 0:
                assert torch.equal(kv[s // shim.BLOCK, :, s % shim.BLOCK, :shim.HEAD_SIZE], key[i].to(kv.dtype))


@pytest.mark.parametrize("options, reason", [
    ({"executor": "mp"}, "the executor is 'mp', not 'uni'"),
    ({"world_size": 2}, "the world size is 2"),
])
def test_not_wired_with_a_multiprocess_executor_or_several_ranks(engine, caplog, options, reason):
    with caplog.at_level(logging.INFO, logger="opentelemetry.instrumentation.swa_vllm"):
        scheduler, runner, _, _ = engine(**options)
        records = drive(scheduler, runner)
    assert vllm_write.RUNNER_ATTRIBUTE not in runner.__dict__
    assert all(r.kv_write_checks is None for r in records)
    messages = [r.getMessage() for r in caplog.records]
    assert any("write check is not wired" in m and reason in m for m in messages), messages
    assert any("no model runner here has one" in m for m in messages), messages


def test_not_wired_without_cuda(engine, monkeypatch, caplog):
    monkeypatch.setattr(vllm_write, "WIRED_DEVICE_TYPES", ("cuda",))  # cpu stands for a device not wired
    with caplog.at_level(logging.INFO, logger="opentelemetry.instrumentation.swa_vllm"):
        scheduler, runner, _, _ = engine()
        records = drive(scheduler, runner)
    assert vllm_write.RUNNER_ATTRIBUTE not in runner.__dict__
    assert "do_kv_cache_update" in shim.FlashAttentionImpl.__dict__
    assert not hasattr(shim.FlashAttentionImpl.__dict__["do_kv_cache_update"], "__wrapped__")
    assert all(r.kv_write_checks is None for r in records)
    assert any("the model runner's device is cpu, not CUDA" in r.getMessage() for r in caplog.records)


def test_two_runners_in_one_process_are_not_paired(engine, caplog):
    with caplog.at_level(logging.WARNING, logger="opentelemetry.instrumentation.swa_vllm"):
        scheduler, runner, _, _ = engine()
        other = shim.GPUModelRunner()
        other.initialize_kv_cache(kv_cache_config())
        records = drive(scheduler, runner)
    assert all(r.kv_write_checks is None for r in records)
    assert any("pairing is ambiguous" in r.getMessage() for r in caplog.records)


def _parameters(source: str, class_name: str, method: str) -> "list[str]":
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return [a.arg for a in item.args.args]
    raise AssertionError(f"{class_name}.{method} is not in the source")


def _function_parameters(source: str, name: str) -> "list[str]":
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return [a.arg for a in node.args.args]
    raise AssertionError(f"{name} is not in the source")


@pytest.mark.vllm
def test_shim_signatures_match_vllm_source():
    root = vllm_source_dir()
    ours = _parameters(open(shim.__file__).read(), "FlashAttentionImpl", "do_kv_cache_update")
    for path, cls in (("v1/attention/backends/flash_attn.py", "FlashAttentionImpl"),
                      ("v1/attention/backends/triton_attn.py", "TritonAttentionImpl"),
                      ("v1/attention/backends/flashinfer.py", "FlashInferImpl")):
        assert _parameters((root / path).read_text(), cls, "do_kv_cache_update") == ours, path
    source = (root / "model_executor/layers/attention/attention.py").read_text()
    assert _function_parameters(source, "unified_kv_cache_update") == ["key", "value", "layer_name"]
    assert "attn_layer.impl.do_kv_cache_update(" in source
    split = "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)"
    assert split in (root / "v1/attention/backends/flash_attn.py").read_text()
    ops = (root / "_custom_ops.py").read_text()
    assert _function_parameters(ops, "reshape_and_cache_flash") == [
        "key", "value", "key_cache", "value_cache", "slot_mapping", "kv_cache_dtype", "k_scale", "v_scale"]
    for path in ("v1/worker/gpu_model_runner.py", "v1/worker/gpu/model_runner.py"):
        assert _parameters((root / path).read_text(), "GPUModelRunner", "initialize_kv_cache") == [
            "self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context"]


def test_flashinfer_metadata_has_no_rows_so_no_request_is_named(engine):
    # FlashInfer's metadata has no query_start_loc: the entry is a token index, not a batch row
    flashinfer = type("FlashInferImpl", (shim.FlashAttentionImpl,), {})  # inherits the store
    scheduler, runner, _, _ = engine()
    for layer in runner.layers.values():
        layer.impl = flashinfer(shim.HEAD_SIZE)
    runner.initialize_kv_cache(kv_cache_config())  # wired again, with these layers
    shim.FlashAttentionImpl.fault = "slot+1"
    records = drive(scheduler, runner)
    step = runner.steps[checked_forward(records[0]) - 1]
    offender = records[0].offender("kv_write_mismatches")
    assert records[0].kv_write_mismatches == recount(step)
    assert (offender.request, offender.row) == (None, None)
    assert offender.position in step.positions and offender.layer_name in dict(shim.LAYERS)
    assert "do_kv_cache_update" in flashinfer.__dict__  # wrapped on the class that runs it


def test_a_kv_cache_initialized_again_after_pairing_replaces_the_check(engine):
    scheduler, runner, _, _ = engine()
    drive(scheduler, runner, steps=3)  # paired at the first schedule()
    runner.initialize_kv_cache(kv_cache_config())  # vLLM may allocate the KV cache again
    shim.FlashAttentionImpl.fault = "slot+1"
    records = drive(scheduler, runner, steps=3)
    step = runner.steps[checked_forward(records[-1]) - 1]
    assert (records[-1].kv_write_checks, records[-1].kv_write_mismatches) == (recount(step), recount(step))


@pytest.mark.parametrize("isa, checked", [("vec", 2), ("vec16", 2), ("amx", 0), ("neon", 0), (None, 0)])
def test_cpu_attn_is_read_in_the_layout_of_its_instruction_set(isa, checked):
    """vLLM's CPU_ATTN (``CPUAttentionBackendImpl``, stand-in class of that name) packs K by
    instruction set (``layer.isa``): the ``vec`` / ``vec16`` layout is read, the others are counted
    unchecked, never compared in a layout they do not have."""
    from otel_swa.device.gate import SamplingGate
    from otel_swa.device.write_check import WriteCheck, write_counts
    from otel_swa.views.vllm_write import WriteLayer, layer_store

    impl = type("CPUAttentionBackendImpl", (), {"head_size": 32, "kv_cache_dtype": "auto"})()
    layer = SimpleNamespace(isa=isa) if isa is not None else SimpleNamespace()
    blocks, heads, block_size, head = 3, 2, 32, 32
    kv_cache = torch.zeros(blocks, heads, block_size, 2 * head)
    key, value = torch.randn(2, heads, head), torch.randn(2, heads, head)
    slots = torch.tensor([33, 34])
    halves = kv_cache.view(blocks, heads, 2, block_size * head)  # the vec layout, written by hand
    for i, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, block_size)
        halves[b, :, 0].view(heads, head, block_size)[:, :, o] = key[i]
        halves[b, :, 1].view(heads, block_size, head)[:, o] = value[i]
    check = WriteCheck("cpu", SamplingGate("cpu"))
    check.check_layer(layer_store(WriteLayer("model.layers.0.self_attn.attn", layer, 0, 0, True), impl, key, value,
                                  kv_cache, slots, query_start_loc=torch.tensor([0, 2], dtype=torch.int32)))
    assert write_counts(check.take().tolist()) == (checked, 0, 2 - checked)
