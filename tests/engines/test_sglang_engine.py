"""otel-swa inside a running sglang 0.5.23 ``Engine`` on CPU (marker ``sglang_engine``).

Each run starts ``sglang_engine/drive_engine.py`` as a user does, under ``opentelemetry-instrument``
or with plain ``python`` (otel-swa's SGLang plugin then loads through SGLang's ``load_plugins()``),
with a tiny random-weight hybrid-SWA model built at test time (Mellum: 3 sliding-window
layers with an 8-token window, 1 full layer), a 160-token KV pool with the radix cache on, 16
requests of the Azure LLM inference trace 2023 scaled down (prompts of 20-64 tokens sharing a
16-token system prompt, 8-48 output tokens), then 4 of them again (prefix cache hits), then
``Engine.shutdown()``. The SGLang scheduler runs in its own spawned process: otel-swa's
``swa_sglang`` instrumentor must load there through the ``opentelemetry_instrumentor`` entry point.

Expected values come from elsewhere than the code under test: SGLang's own KV canary line (its
reporter runs beside ours: ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``), a plain-Python
recount in the scheduler process after every forward step (``shims/sglang_cpu/sglang_step_probe.py``),
and what a real collector (``rotel-agent``) received.

Test-only shims (``shims/``, installed into the suite's environment by ``shims/install.py``): an
``sgl_kernel`` stand-in, a ``torchvision`` stand-in, the CPU patches of SGLang's KV canary and the
fix of the torch-native backend's SWA read (without it, divergence >= 1 means wrong attention reads
or an ``IndexError``).

The runs, each shared by the tests below it:

* ``traced``: page size 1, overlap scheduler on, SGLang's request tracing on (``enable_trace``,
  its OTLP traces to the same collector); under ``opentelemetry-instrument`` with otel-swa's
  plugin installed too (both at once: the plugin stands aside);
* ``paged``: page size 4, overlap scheduler off, and one SWA page taken off the free list after
  forward step :data:`LEAK_AT_STEP` (a leak made on purpose); plain ``python``: the plugin, with
  the same ``OTEL_*`` variables, gives what the instrumentor gives in ``traced``;
* ``chunked``: page size 1, chunked prefill of 8 tokens (as long as the window: SGLang's
  ``sliding_window_size`` 7 + 1), the radix cache off (SGLang then evicts before each extend
  forward, below ``prefix_len - sliding_window_size``), every forward step sampled;
* ``by_hand``: no instrumentor (``OTEL_SWA_DIVERGENCE_INTERVAL=0``: nothing is wrapped), SGLang's
  reporter replaced by otel-swa's ``KvCanaryHooks``, the substitution docs/engines.md describes;
* ``plain_script``: a user's plain script: plain ``python``, only
  ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL=20``, SGLang's KV canary off, no ``OTEL_*``
  variable and no collector (8 requests);
* ``switched_off``: the same with neither interval variable (2 requests).
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from otel_swa import environment_variables as ev

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_engine]

INTERVAL = 5
LEAK_AT_STEP = 60


def _require() -> None:
    missing = [name for name in ("sglang", "sglang_cpu_patches") if importlib.util.find_spec(name) is None]
    if not missing:
        return
    message = (f"{', '.join(missing)} not importable; the engine suite needs sglang 0.5.23 and the CPU shims "
               f"(python tests/engines/shims/install.py): run .ci/sglang-tests.sh")
    if os.environ.get(ev.OTEL_SWA_REQUIRE_SGLANG, "").strip() == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _require()
    from sglang_engine.harness import build_model

    return build_model(tmp_path_factory.mktemp("model"))


def _engine_run(tmp_path_factory, model, agent, name, *, engine, env, launcher=True):
    from sglang_engine.harness import read_probe, run_engine

    base = {"kv_canary": "raise"}
    both = {"OTEL_SWA_DIVERGENCE_INTERVAL": str(INTERVAL), "SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": str(INTERVAL)}
    directory = tmp_path_factory.mktemp(name)
    run = run_engine(directory, model, agent, engine={**base, **engine}, env={**both, **env}, launcher=launcher)
    # the scheduler's pool figures (SGLang's own and otel-swa's reader), from the probe
    run.pools = read_probe(directory / "probe", "pools")
    return run


@pytest.fixture(scope="module")
def traced(tmp_path_factory, model, agent_binary):
    # a span at every forward step here (the default spans the sampled steps only, as in `paged`)
    return _engine_run(tmp_path_factory, model, agent_binary, "traced",
                       engine={"page_size": 1, "enable_trace": True, "otlp_traces_endpoint": "{otlp_grpc}"},
                       env={"OTEL_SWA_FORWARD_SPANS": "all"})


@pytest.fixture(scope="module")
def paged(tmp_path_factory, model, agent_binary):
    return _engine_run(tmp_path_factory, model, agent_binary, "paged",
                       engine={"page_size": 4, "disable_overlap_schedule": True},
                       # SGLang's own idle check sees the leak too; warn instead of stopping the engine
                       env={"OTEL_SWA_TEST_SGLANG_LEAK_AT_STEP": str(LEAK_AT_STEP),
                            "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false"},
                       launcher=False)  # otel-swa's plugin, no opentelemetry-instrument


@pytest.fixture(scope="module")
def chunked(tmp_path_factory, model, agent_binary):
    return _engine_run(tmp_path_factory, model, agent_binary, "chunked",
                       engine={"page_size": 1, "chunked_prefill_size": 8, "disable_radix_cache": True},
                       env={"OTEL_SWA_DIVERGENCE_INTERVAL": "1", "SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": "1"})


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory, model, agent_binary):
    return _engine_run(tmp_path_factory, model, agent_binary, "by_hand", engine={"page_size": 1},
                       env={"OTEL_SWA_DIVERGENCE_INTERVAL": "0", "OTEL_SWA_TEST_SGLANG_BY_HAND": "1"})


@pytest.fixture(scope="module")
def plain_script(tmp_path_factory, model):
    from sglang_engine.harness import run_engine

    return run_engine(tmp_path_factory.mktemp("plain_script"), model, None, engine={"kv_canary": "none"},
                      env={"SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": "20"}, requests=8, repeat=0,
                      launcher=False, collector=False)


@pytest.fixture(scope="module")
def switched_off(tmp_path_factory, model):
    from sglang_engine.harness import run_engine

    return run_engine(tmp_path_factory.mktemp("switched_off"), model, None, engine={"kv_canary": "none"}, env={},
                      requests=2, repeat=0, launcher=False, collector=False)


@pytest.fixture(params=["traced", "paged"])
def instrumented(request):
    """Each run with otel-swa's instrumentor switched on."""
    return request.getfixturevalue(request.param)


def _int(text: str) -> int:
    match = re.fullmatch(r"Int\((-?\d+)\)", text)
    assert match, text
    return int(match.group(1))


# ------------------------------------------------------------------ the same numbers as SGLang's own reporter
def test_our_lines_equal_sglangs_own_canary_lines_at_every_forward_ct(instrumented):
    ours = {r.forward_ct: r for r in instrumented.ours}
    sglangs = {r.forward_ct: r for r in instrumented.sglangs}
    expected_cts = list(range(INTERVAL, instrumented.forward_steps + 1, INTERVAL))
    # ours: every sample, the last one included (delivered at its step; no close() anywhere)
    assert sorted(ours) == expected_cts
    assert all(r.verify_source == "kv_canary" for r in ours.values())
    # SGLang's reporter prints a sample one step later and loses the one pending at shutdown
    assert set(sglangs) <= set(ours) and len(sglangs) >= len(expected_cts) - 1
    for forward_ct, theirs in sglangs.items():
        assert ours[forward_ct].to_dict() == theirs.to_dict(), forward_ct


def test_records_equal_a_recount_in_the_scheduler_at_the_sampled_step(instrumented):
    for record in instrumented.ours:
        recount = instrumented.recount(record.forward_ct)
        assert (record.swa_full_idx_divergence, record.swa_out_of_window_tokens) == (
            recount["divergence"], recount["out_of_window"]), record.forward_ct


def test_the_runs_remap_swa_slots_evict_retract_and_hit_the_prefix_cache(instrumented):
    assert max(r.swa_full_idx_divergence for r in instrumented.ours) >= 1
    assert max(r.swa_out_of_window_tokens for r in instrumented.ours) >= 1
    assert instrumented.ours[-1].verify_swa < instrumented.ours[-1].verify_full
    assert "Retract requests" in instrumented.log
    second_wave = [r for r in instrumented.results["requests"] if r["wave"] == 1]
    assert second_wave and all(r["cached_tokens"] >= 16 for r in second_wave)


def test_sglangs_own_parser_reads_the_engine_log_with_our_lines_in_it(instrumented):
    from sglang.srt.kv_canary.runner.swa_divergence import SwaDivergenceLog

    parsed = [log for log, _ in SwaDivergenceLog.find_all(instrumented.log)]
    assert len(parsed) == len(instrumented.ours) + len(instrumented.sglangs)
    assert sorted(p.forward_ct for p in parsed) == sorted(r.forward_ct for r in instrumented.ours + instrumented.sglangs)


# ------------------------------------------------------------------ OTLP from the scheduler process
def test_the_collector_gets_every_sample_as_an_event_and_metrics_from_the_scheduler(instrumented):
    lines = instrumented.ours
    events = instrumented.events()
    assert [_int(e["attributes"]["kv_cache.swa.forward_ct"]) for e in events] == [r.forward_ct for r in lines]
    for event, record in zip(events, lines):
        assert _int(event["attributes"]["kv_cache.swa.swa_out_of_window_tokens"]) == record.swa_out_of_window_tokens
        assert event["attributes"]["kv_cache.swa.verify_source"] == "Str(kv_canary)"
        assert _int(event["attributes"]["otel_swa.tp_rank"]) == 0 and _int(event["attributes"]["otel_swa.pp_rank"]) == 0
        assert event["resource"]["service.name"] == "Str(sglang-engine-test)"
    last = lines[-1]

    def total(name, **attributes):
        points = [p for p in instrumented.points(name)
                  if all(p["attributes"].get(k) == v for k, v in attributes.items())]
        assert len(points) == 1, (name, attributes, points)  # one export: the flush at shutdown
        return points[0]["value"]

    assert total("kv_cache.swa.entries.verified", pool="Str(full)") == last.verify_full
    assert total("kv_cache.swa.entries.verified", pool="Str(swa)") == last.verify_swa
    assert total("kv_cache.swa.forward_steps") == last.forward_ct
    assert total("kv_cache.swa.reporter.samples.delivered") == len(lines)
    assert total("kv_cache.swa.reporter.samples.taken") == len(lines)
    assert total("kv_cache.swa.tokens.out_of_window") == last.swa_out_of_window_tokens
    for point in instrumented.points("kv_cache.swa.forward_steps"):
        assert _int(point["attributes"]["otel_swa.tp_rank"]) == 0


def test_forward_steps_have_their_spans_every_step_or_the_sampled_ones(traced, paged):
    every = sorted(_int(s["attributes"]["forward_step.forward_ct"]) for s in traced.spans("forward step"))
    assert every == list(range(1, traced.forward_steps + 1))  # OTEL_SWA_FORWARD_SPANS=all
    sampled = sorted(_int(s["attributes"]["forward_step.forward_ct"]) for s in paged.spans("forward step"))
    assert sampled == list(range(INTERVAL, paged.forward_steps + 1, INTERVAL))  # the default


def test_each_sample_event_is_in_the_span_of_its_forward_step(instrumented):
    spans = instrumented.spans("forward step")
    assert {_int(s["attributes"]["otel_swa.tp_rank"]) for s in spans} == {0}
    # each event carries the trace context of the forward step where its sample was taken
    by_ct = {_int(s["attributes"]["forward_step.forward_ct"]): s for s in spans}
    for event in instrumented.events():
        step = by_ct[_int(event["attributes"]["kv_cache.swa.forward_ct"])]
        assert (event["trace_id"], event["span_id"]) == (step["trace_id"], step["span_id"])


def test_forward_step_spans_link_to_sglangs_own_request_spans(traced):
    request_spans = [s for s in traced.seen["spans"] if re.fullmatch(r"\s*Req [0-9a-f]{1,8}", s.get("name", ""))]
    assert len(request_spans) == len(traced.results["requests"])  # one root span per request, SGLang's
    request_traces = {s["trace_id"]: s["span_id"] for s in request_spans}
    linked = set()
    for span in traced.spans("forward step"):
        links = {(link["Trace ID"], link["ID"]) for link in span["links"]}
        assert len(links) == _int(span["attributes"]["forward_step.batch_size"])
        assert _int(span["attributes"]["forward_step.links.missing"]) == 0
        linked |= links
    assert linked == set(request_traces.items())


def test_trace_ids_do_not_repeat_across_runs_seeded_alike(traced, paged):
    # SGLang seeds Python's random module (random_seed=0) in both runs
    first = {s["trace_id"] for s in traced.spans("forward step")}
    second = {s["trace_id"] for s in paged.spans("forward step")}
    assert len(first) == len(traced.spans("forward step")) and not first & second


# ------------------------------------------------------------------ KV pool usage
POOL_FIGURES = ("used", "available", "evictable", "limit")


def test_the_pool_reader_equals_sglangs_own_pool_stats_after_every_batch(instrumented):
    lines = [line for line in instrumented.pools if line["at"] == "run_batch"]
    assert len(lines) >= instrumented.forward_steps and not [l for l in lines if "error" in l]
    for line in lines:
        assert line["ours"] == line["sglang"], line
    # the run filled the pools, evicted from the window and left prefixes in the radix cache
    assert max(l["sglang"]["full"][0] for l in lines) > max(l["sglang"]["swa"][0] for l in lines) > 0
    assert max(l["sglang"]["full"][2] for l in lines) > 0 and max(l["sglang"]["swa"][2] for l in lines) > 0


def test_the_collector_gets_the_pools_as_sglang_counted_them_at_the_collection(instrumented):
    (flush,) = [line for line in instrumented.pools if line["at"] == "flush"]
    figures = flush["sglang"]
    for pool in ("full", "swa"):
        for index, figure in enumerate(POOL_FIGURES):
            points = [p for p in instrumented.points(f"kv_cache.pool.tokens.{figure}")
                      if p["attributes"]["pool"] == f"Str({pool})"]
            assert len(points) == 1, (figure, pool, points)  # one collection: the flush at shutdown
            assert points[0]["value"] == figures[pool][index], (figure, pool)
            assert _int(points[0]["attributes"]["otel_swa.tp_rank"]) == 0
        (usage,) = [p for p in instrumented.points("kv_cache.pool.utilization") if p["attributes"]["pool"] == f"Str({pool})"]
        assert usage["value"] == pytest.approx(figures[pool][0] / figures[pool][3])
    # idle at shutdown: nothing used but the page the paged run leaked on purpose (4 SWA slots),
    # and the radix cache holds the prefixes it kept
    leaked = 4 if any("leaked_page" in line for line in instrumented.probe) else 0
    assert (figures["full"][0], figures["swa"][0]) == (0, leaked) and figures["full"][2] > 0


def test_the_window_savings_are_out_of_window_tokens_times_the_swa_pools_bytes_per_token(instrumented):
    # the test model (build_model.py): 3 SWA layers x 2 KV heads x (K 16 + V 16 dims) x float32 (4 bytes)
    (point,) = instrumented.points("kv_cache.swa.memory.saved")
    assert point["value"] == instrumented.ours[-1].swa_out_of_window_tokens * 3 * 2 * 32 * 4
    assert _int(point["attributes"]["otel_swa.tp_rank"]) == 0


# ------------------------------------------------------------------ the radix cache and the audit
def test_the_audit_is_clean_while_the_radix_cache_holds_swa_slots(traced):
    events = traced.events()
    audited = [e for e in events if "kv_cache.swa.swa_leaked_slots" in e["attributes"]]
    assert len(audited) == len(events)
    for event in audited:
        for name in ("swa_leaked_slots", "swa_stale_tokens", "swa_shared_slots"):
            assert _int(event["attributes"][f"kv_cache.swa.{name}"]) == 0, (name, event["attributes"])


def test_healthy_runs_count_no_premature_eviction_at_any_sample(instrumented):
    # the window check is on every audit line, equal to the recount in the scheduler (window:
    # sliding_window_size 7 + 1), and 0: SGLang never frees an SWA slot its attention still reads
    audits = [line for line in instrumented.log.splitlines() if "otel_swa_audit=" in line]
    assert len(audits) == len(instrumented.ours) and all('"swa_premature_evictions":' in a for a in audits)
    for record in instrumented.ours:
        assert record.swa_premature_evictions == instrumented.recount(record.forward_ct)["premature"] == 0, record
        # SGLang keeps up to SGLANG_SWA_EVICTION_INTERVAL - 1 = 127 tokens past the window by design
        # (the allowance), longer than any request here: nothing is late-held
        assert record.swa_late_held_slots == 0, record
    # the runs do hold SWA slots past the window between evictions: the allowance is what hides them
    assert max(instrumented.recount(r.forward_ct)["held_past_window"] for r in instrumented.ours) >= 1


def test_chunked_prefill_counts_no_premature_eviction_where_a_chunk_reads_the_previous_one(chunked):
    # every forward step sampled; a chunk's first query reads the previous chunk's last 7 positions:
    # the recount (query by query, with SGLang's extend_seq_lens_cpu) and each record agree, and 0
    chunk_steps = [line["step"] for line in chunked.probe
                   if any(q >= 8 and n > q for q, n in zip(line.get("queries", ()), line.get("seq_lens", ())))]
    assert chunk_steps, "no chunk after a prefix ran"
    by_ct = {record.forward_ct: record for record in chunked.ours}
    assert set(chunk_steps) <= set(by_ct)
    for record in chunked.ours:
        assert record.swa_premature_evictions == chunked.recount(record.forward_ct)["premature"] == 0, record
    assert max(r.swa_out_of_window_tokens for r in chunked.ours) >= 1  # SGLang did evict from the window


def test_a_page_taken_off_the_free_list_is_reported_as_leaked(paged):
    leaked_at = [line for line in paged.probe if "leaked_page" in line]
    assert [line["step"] for line in leaked_at] == [LEAK_AT_STEP]
    by_ct = {_int(e["attributes"]["kv_cache.swa.forward_ct"]): e["attributes"] for e in paged.events()}
    before = [ct for ct in by_ct if ct < LEAK_AT_STEP]
    after = [ct for ct in by_ct if ct > LEAK_AT_STEP]
    assert before and after
    for ct in before:
        assert _int(by_ct[ct]["kv_cache.swa.swa_leaked_slots"]) == 0, ct
    for ct in after:  # one page of 4 slots, from the next sample on, until the end
        assert _int(by_ct[ct]["kv_cache.swa.swa_leaked_slots"]) == 4, ct
        assert _int(by_ct[ct]["kv_cache.swa.swa_stale_tokens"]) == 0, ct
    # SGLang's own check, when the scheduler goes idle, agrees
    assert "memory leak detected" in paged.log


# ------------------------------------------------------------------ by hand, and the gate off
def test_by_hand_hooks_replace_sglangs_reporter_and_match_the_recount(by_hand):
    assert by_hand.sglangs == []  # SGLang's own reporter was replaced
    assert [r.forward_ct for r in by_hand.ours] == list(range(INTERVAL, by_hand.forward_steps + 1, INTERVAL))
    for record in by_hand.ours:
        recount = by_hand.recount(record.forward_ct)
        assert (record.swa_full_idx_divergence, record.swa_out_of_window_tokens) == (
            recount["divergence"], recount["out_of_window"])
    assert max(r.swa_full_idx_divergence for r in by_hand.ours) >= 1


def test_interval_zero_wraps_nothing_in_the_engine(by_hand):
    assert by_hand.spans("forward step") == []
    assert by_hand.events() == []
    assert [m for m in by_hand.seen["metrics"] if m.get("name", "").startswith("kv_cache.swa.")] == []


def test_otel_swa_check_passes_the_clean_engine_log_and_fails_the_leaking_one(traced, paged, tmp_path):
    from otel_swa.cli import main

    for name, run, expected in (("traced", traced, 0), ("paged", paged, 1)):
        path = tmp_path / f"{name}.log"
        path.write_text(run.log)
        assert main(["check", str(path)]) == expected, name


# ------------------------------------------------------------------ the read check and the false-positive count
def test_healthy_runs_read_what_the_mapping_says_at_every_sample(traced, paged, chunked):
    # the torch-native SWA read fixed (the shims): every sample checks its queries and none disagrees
    for name, run in (("traced", traced), ("paged", paged), ("chunked", chunked)):
        assert run.ours and all(r.read_checked for r in run.ours), name
        assert sum(r.swa_read_checks for r in run.ours) >= len(run.ours), name
        assert [r.forward_ct for r in run.ours if r.swa_read_mismatches] == [], name
        assert sum(r.swa_read_unchecked for r in run.ours) == 0, name


def test_clean_runs_report_no_fault_of_any_kind(traced, chunked, by_hand, paged):
    """The false-positive count of every detector over the suite's clean runs (the paged run before
    its leak made on purpose): 0."""
    from otel_swa.record import FAULT_FIELDS

    samples = [r for run in (traced, chunked, by_hand) for r in run.ours] + [
        r for r in paged.ours if r.forward_ct < LEAK_AT_STEP]
    false_faults = {name: sum(getattr(r, name) or 0 for r in samples) for name in FAULT_FIELDS}
    assert len(samples) > 40 and false_faults == {name: 0 for name in FAULT_FIELDS}
    assert all(r.offenders == () for r in samples)


# ------------------------------------------------------------------ the plugin, and both at once
#: What the probe finds wrapped in a scheduler process (``sglang_step_probe.otel_swa_wrappers``).
#: Under the plugin SGLang's ``load_plugins()`` runs first thing in ``run_scheduler_process``, when
#: the scheduler, the attention layer and ``sglang.srt.utils.common`` are already imported: their
#: hooks go through SGLang's HookRegistry; the model runner and the KV canary are imported later,
#: when the scheduler builds its worker, and wrapped at that import.
SCHEDULER_UNDER_THE_PLUGIN = {
    "ModelRunner.forward": "direct", "ModelRunner.init_cuda_graphs": "direct", "CanaryManager.__init__": "direct",
    "CanaryManager.pre_ops_maybe_inside_graph": "direct", "Scheduler.run_batch": "hook_registry",
    "RadixAttention.forward": "hook_registry", "common.kill_process_tree": "hook_registry",
    "Scheduler.otel_swa_flush": "added",
}
#: Under opentelemetry-instrument the instrumentor runs at interpreter start, before any SGLang import.
SCHEDULER_UNDER_THE_INSTRUMENTOR = {name: ("added" if how == "added" else "direct")
                                    for name, how in SCHEDULER_UNDER_THE_PLUGIN.items()}


def _scheduler(run) -> dict:
    (process,) = [p for p in run.processes if p["role"] == "scheduler"]
    return process


def test_the_plugin_wraps_what_the_instrumentor_wraps_through_sglangs_hook_registry(paged, traced):
    assert _scheduler(paged)["wrappers"] == SCHEDULER_UNDER_THE_PLUGIN
    assert _scheduler(traced)["wrappers"] == SCHEDULER_UNDER_THE_INSTRUMENTOR
    # the Engine's own process: Engine.__init__ calls load_plugins() after sglang.srt.entrypoints.engine
    # imported the scheduler, the attention layer and sglang.srt.utils.common (the model runner never)
    assert paged.results["main_process"]["wrappers"] == {
        "Scheduler.run_batch": "hook_registry", "Engine.shutdown": "hook_registry",
        "RadixAttention.forward": "hook_registry", "common.kill_process_tree": "hook_registry",
        "Scheduler.otel_swa_flush": "added"}
    # Engine.shutdown's flush reached the scheduler over SGLang's RPC, as under opentelemetry-instrument
    assert "handle_rpc_request: otel_swa_flush" in paged.log


def test_with_opentelemetry_instrument_and_the_plugin_at_once_each_sample_has_one_line_and_one_reporter(traced):
    from importlib.metadata import entry_points

    # the plugin is installed beside the instrumentor here, and SGLang ran it in every process
    assert [ep.value for ep in entry_points(group="sglang.srt.plugins") if ep.name == "otel_swa"] == [
        "opentelemetry.instrumentation.swa_plugins:load_sglang"]
    assert _scheduler(traced)["reporters"] == 1
    forward_cts = [r.forward_ct for r in traced.ours]
    assert forward_cts == list(range(INTERVAL, traced.forward_steps + 1, INTERVAL))  # no line twice
    assert [_int(e["attributes"]["kv_cache.swa.forward_ct"]) for e in traced.events()] == forward_cts


def test_a_plain_script_with_only_sglangs_variable_gets_otel_swas_lines_and_check_passes(plain_script, tmp_path):
    """The user of SGLang's knob: ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL=20 python script.py``,
    SGLang's KV canary off (its own reporter lives in the canary: with the canary off SGLang does
    nothing with the variable), no OpenTelemetry variable: otel-swa's lines in the engine's log."""
    from otel_swa.cli import main

    assert plain_script.sglangs == []
    assert [r.forward_ct for r in plain_script.ours] == list(range(20, plain_script.forward_steps + 1, 20))
    assert {r.verify_source for r in plain_script.ours} == {"attention"}
    for record in plain_script.ours:
        recount = plain_script.recount(record.forward_ct)
        assert (record.swa_full_idx_divergence, record.swa_out_of_window_tokens) == (
            recount["divergence"], recount["out_of_window"]), record.forward_ct
    assert _scheduler(plain_script)["wrappers"] == SCHEDULER_UNDER_THE_PLUGIN
    assert _scheduler(plain_script)["reporters"] == 1
    path = tmp_path / "engine.log"
    path.write_text(plain_script.log)
    assert main(["check", str(path)]) == 0


def test_without_the_variable_the_plugin_leaves_every_process_alone(switched_off):
    assert "otel_swa" not in switched_off.log and "otel-swa" not in switched_off.log
    assert [r for r in switched_off.results["requests"] if r["completion_tokens"] < 16] == []  # it served
    for process in [_scheduler(switched_off), switched_off.results["main_process"]]:
        # nothing wrapped, no reporter, and the instrumentor's module never imported: the plugin
        # read the variable and returned
        assert (process["wrappers"], process["reporters"], process["instrumentor_imported"]) == ({}, 0, False)


def test_check_judges_both_reporters_lines_in_one_log(traced, tmp_path):
    # SGLang's own lines (its canary is on in this run) and otel-swa's, each judged on its own
    from otel_swa.cli import main

    path = tmp_path / "traced.log"
    path.write_text(traced.log)
    assert traced.sglangs and traced.ours
    for lines in ("otel-swa", "sglang", "both"):
        assert main(["check", "--lines", lines, str(path)]) == 0, lines
