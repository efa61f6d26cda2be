"""The reference-engine instrumentor end to end in process: reporter -> records -> metrics, events
under forward-step spans linked to request spans, and the SGLang line, all from one run."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from reference_app_support import REFERENCE_APP

from otel_swa.record import find_all

pytest.importorskip("otel_swa.reference.engine")

from opentelemetry.instrumentation.swa_reference import ENGINE_ATTRIBUTE, SwaReferenceInstrumentor  # noqa: E402
from otel_swa.reference.engine import EngineConfig, ReferenceEngine  # noqa: E402
from otel_swa.telemetry import SwaLogLineExporter  # noqa: E402

# prompts longer than the window so the SWA pool evicts and remaps
REQUESTS = [SimpleNamespace(arrival_s=0.0, context_tokens=c, generated_tokens=g)
            for c, g in ((40, 12), (25, 20), (70, 6), (33, 15))]
CONFIG = EngineConfig(window=16, full_pool_size=1024, swa_pool_size=256, max_running=4, token_budget=64,
                      max_context_len=256, step_time_s=0.0)


@pytest.fixture
def instrumented(pipeline, monkeypatch):
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "3")
    monkeypatch.setenv("OTEL_SWA_RING_SIZE", "2")
    monkeypatch.setenv("OTEL_SWA_FORWARD_SPANS", "all")  # every step's span and its request links
    lines = io.StringIO()
    pipeline.logger_provider.add_log_record_processor(SimpleLogRecordProcessor(SwaLogLineExporter(lines)))
    instrumentor = SwaReferenceInstrumentor()
    instrumentor.instrument(**pipeline.providers())
    yield pipeline, lines
    instrumentor.uninstrument()


def run_engine():
    engine = ReferenceEngine(CONFIG)
    for request in REQUESTS:
        engine.submit(request, arrival_s=0.0)
    engine.run_until_done()
    return engine


def test_one_run_gives_metrics_events_and_lines_that_agree(instrumented):
    pipeline, lines = instrumented
    engine = run_engine()
    assert engine.reporter is not None and engine.reporter.interval == 3
    records = list(find_all(lines.getvalue()))
    # every multiple of 3 up to the last step was sampled and delivered (run_until_done flushes)
    assert [r.forward_ct for r in records] == list(range(3, engine.forward_ct + 1, 3))
    assert engine.reporter.stats.pending == 0
    last = records[-1]
    assert max(r.swa_out_of_window_tokens for r in records) >= 1
    assert last.verify_swa < last.verify_full

    metrics = pipeline.metrics()
    verified = {dict(p.attributes)["pool"]: p.value for p in metrics["kv_cache.swa.entries.verified"]["points"]}
    assert verified == {"full": last.verify_full, "swa": last.verify_swa}
    assert metrics["kv_cache.swa.forward_steps"]["points"][0].value == last.forward_ct
    assert metrics["kv_cache.swa.tokens.out_of_window"]["points"][0].value == last.swa_out_of_window_tokens
    assert metrics["kv_cache.swa.tokens.divergent"]["points"][0].value == last.swa_full_idx_divergence
    assert metrics["kv_cache.swa.reporter.samples.delivered"]["points"][0].value == len(records)

    spans = pipeline.spans.get_finished_spans()
    forward = {s.attributes["forward_step.forward_ct"]: s for s in spans if s.name == "forward step"}
    assert sorted(forward) == list(range(1, engine.forward_ct + 1))
    requests = {(s.context.trace_id, s.context.span_id) for s in spans if s.name == "request"}
    assert len(requests) == len(REQUESTS)
    # each forward step links to exactly the request spans of its batch
    for span in forward.values():
        assert len(span.links) == span.attributes["forward_step.batch_size"]
        assert {(l.context.trace_id, l.context.span_id) for l in span.links} <= requests
        assert span.attributes["forward_step.links.missing"] == 0

    events = [l.log_record for l in pipeline.logs.get_finished_logs()
              if l.log_record.event_name == "kv_cache.swa.divergence_sample"]
    assert len(events) == len(records)
    for event, record in zip(events, records):
        assert event.attributes["kv_cache.swa.forward_ct"] == record.forward_ct
        step = forward[record.forward_ct]  # the step where it was sampled, not where it landed
        assert (event.trace_id, event.span_id) == (step.context.trace_id, step.context.span_id)
    samples = [s for s in spans if s.name == "swa divergence sample"]
    for s in samples:
        assert s.parent.span_id == forward[s.attributes["kv_cache.swa.forward_ct"]].context.span_id
    on_step = [e for s in forward.values() for e in s.events if e.name == "kv_cache.swa.divergence_sample"]
    assert len(samples) + len(on_step) == len(records)


def test_request_spans_carry_genai_prompt_and_limit_attributes(instrumented):
    pipeline, _ = instrumented
    run_engine()
    spans = [s for s in pipeline.spans.get_finished_spans() if s.name == "request"]
    got = sorted((s.attributes["gen_ai.usage.input_tokens"], s.attributes["gen_ai.request.max_tokens"]) for s in spans)
    assert got == [(25, 20), (33, 15), (40, 12), (70, 6)]
    assert all("gen_ai.usage.output_tokens" not in s.attributes for s in spans)


def test_request_span_hooks_keep_traceparents_while_requests_run():
    from otel_swa.engine_wrapping import request_span_hooks

    started, ended, traceparents = [], [], {}
    hooks = request_span_hooks(lambda rid, attributes: started.append((rid, attributes)) or f"tp-{rid}",
                               ended.append, traceparents)
    hooks["on_submit"](SimpleNamespace(rid=1), SimpleNamespace(context_tokens=7, generated_tokens=3))
    front_end = SimpleNamespace(context_tokens=5, generated_tokens=2, traceparent="00-ab-cd-01")
    hooks["on_submit"](SimpleNamespace(rid=2), front_end)  # a front end's span: none started here
    assert started == [(1, {"gen_ai.usage.input_tokens": 7, "gen_ai.request.max_tokens": 3})]
    assert traceparents == {1: "tp-1", 2: "00-ab-cd-01"}
    hooks["on_step"](SimpleNamespace(finished=[1]))
    assert traceparents == {2: "00-ab-cd-01"} and ended == [1]


def test_interval_zero_means_no_reporter(pipeline, monkeypatch):
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "0")
    monkeypatch.delenv("SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL", raising=False)
    instrumentor = SwaReferenceInstrumentor()
    instrumentor.instrument(**pipeline.providers())
    try:
        engine = ReferenceEngine(CONFIG)
        assert engine.reporter is None
        assert getattr(engine, ENGINE_ATTRIBUTE).sink is None
    finally:
        instrumentor.uninstrument()


def test_instrument_and_uninstrument_are_idempotent_and_restore_the_class(pipeline, monkeypatch):
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "5")
    original_init = ReferenceEngine.__init__
    instrumentor = SwaReferenceInstrumentor()
    instrumentor.instrument(**pipeline.providers())
    wrapped = ReferenceEngine.__init__
    instrumentor.instrument(**pipeline.providers())  # second call: no double wrapping
    assert ReferenceEngine.__init__ is wrapped is not original_init
    instrumentor.uninstrument()
    instrumentor.uninstrument()
    assert ReferenceEngine.__init__ is original_init
    engine = ReferenceEngine(CONFIG)
    assert engine.reporter is None and not hasattr(engine, ENGINE_ATTRIBUTE)


def test_a_bad_interval_is_logged_and_the_engine_still_runs(pipeline, monkeypatch, caplog):
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "often")
    instrumentor = SwaReferenceInstrumentor()
    instrumentor.instrument(**pipeline.providers())
    try:
        engine = ReferenceEngine(CONFIG)
        assert engine.reporter is None
        assert "OTEL_SWA_DIVERGENCE_INTERVAL='often'" in caplog.text
    finally:
        instrumentor.uninstrument()


def test_dependencies_are_declared():
    assert list(SwaReferenceInstrumentor().instrumentation_dependencies()) == ["otel-swa >= 0.1.0"]


def test_opentelemetry_instrument_finds_the_instrumentor_and_the_logline_exporter(tmp_path):
    """Entry points end to end: the SGLang lines appear with no code change in the application."""
    import os
    import shutil
    import subprocess
    import sys

    from importlib.metadata import entry_points

    launcher = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    if launcher is None or not list(entry_points(group="opentelemetry_configurator")):
        # opentelemetry-instrument configures the SDK only through a distro's configurator
        pytest.skip("opentelemetry-instrument or a distro (pip install opentelemetry-distro) is missing")
    app = tmp_path / "app.py"
    app.write_text(REFERENCE_APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env.update({"OTEL_SWA_DIVERGENCE_INTERVAL": "5", "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                "OTEL_LOGS_EXPORTER": "swa_logline", "OTEL_BLRP_SCHEDULE_DELAY": "10"})
    run = subprocess.run([launcher, sys.executable, str(app)], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    forward_ct = int(run.stdout.split("forward_ct")[1])
    records = list(find_all(run.stderr))
    assert [r.forward_ct for r in records] == list(range(5, forward_ct + 1, 5))


@pytest.mark.parametrize("configure_first", [True, False], ids=["configure-first", "instrument-first"])
def test_health_metrics_are_exported_whichever_of_configure_and_instrument_comes_first(configure_first, monkeypatch):
    """configure() builds a sink on the same meter as the instrumentor's: both must export the
    health of their reporters (the SDK keeps one observable instrument per name and meter)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.telemetry import configure

    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "3")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    instrumentor = SwaReferenceInstrumentor()
    try:
        if configure_first:
            telemetry = configure(exporters="none", meter_provider=provider, set_global=False)
            instrumentor.instrument(meter_provider=provider)
        else:
            instrumentor.instrument(meter_provider=provider)
            telemetry = configure(exporters="none", meter_provider=provider, set_global=False)
        own = telemetry.attach(SwaDivergenceReporter(2))
        view = lambda: None  # noqa: E731 - never called: the own reporter samples at step 2
        own.step(view)
        engine = run_engine()
        totals = {}
        for rm in reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    totals[metric.name] = sum(getattr(p, "value", 0) for p in metric.data.data_points)
        taken = engine.reporter.stats.samples_taken
        assert taken > 0
        # the engine's reporter (from the instrumentor) and configure()'s own (1 step: no sample)
        assert totals["kv_cache.swa.reporter.samples.taken"] == taken
        assert totals["kv_cache.swa.reporter.samples.delivered"] == engine.reporter.stats.samples_delivered == taken
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
