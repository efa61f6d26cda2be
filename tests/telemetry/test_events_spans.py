"""Events tied to the forward step, forward-step span attributes and request links."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from otel_swa.record import SwaDivergenceRecord
from otel_swa.telemetry import (
    EVENT_NAME,
    ForwardSpans,
    RequestSpans,
    SwaTelemetrySink,
    format_traceparent,
    parse_traceparent,
)

RECORD = SwaDivergenceRecord(40, 9000, 3000, 25, 640)
ATTRS = {
    "kv_cache.swa.forward_ct": 40,
    "kv_cache.swa.verify_full": 9000,
    "kv_cache.swa.verify_swa": 3000,
    "kv_cache.swa.swa_full_idx_divergence": 25,
    "kv_cache.swa.swa_out_of_window_tokens": 640,
}


def forward_step_context(pipeline):
    """Run a 'forward step' span to its end and return (its context, trace id, span id)."""
    tracer = pipeline.tracer_provider.get_tracer("engine")
    with tracer.start_as_current_span("forward step") as span:
        ctx = otel_context.get_current()
    sc = span.get_span_context()
    return ctx, sc.trace_id, sc.span_id


def test_log_event_carries_the_fields_and_the_forward_step_trace_context(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    ctx, trace_id, span_id = forward_step_context(pipeline)
    with pipeline.tracer_provider.get_tracer("engine").start_as_current_span("later step"):
        sink(RECORD, ctx)
    (log,) = pipeline.logs.get_finished_logs()
    rec = log.log_record
    assert rec.event_name == "kv_cache.swa.divergence_sample" == EVENT_NAME
    assert dict(rec.attributes) == ATTRS
    assert (rec.trace_id, rec.span_id) == (trace_id, span_id)
    assert rec.body == 'kv_canary_swa_divergence={"forward_ct":40,"verify_full":9000,"verify_swa":3000,' \
                       '"swa_full_idx_divergence":25,"swa_out_of_window_tokens":640}'
    assert log.instrumentation_scope.name == "otel_swa"


def test_log_event_has_the_emission_time_as_timestamp(pipeline):
    import time

    sink = SwaTelemetrySink(**pipeline.providers())
    ctx, trace_id, span_id = forward_step_context(pipeline)
    before = time.time_ns()
    sink(RECORD, ctx)
    after = time.time_ns()
    (log,) = pipeline.logs.get_finished_logs()
    rec = log.log_record
    assert isinstance(rec.timestamp, int) and before <= rec.timestamp <= after
    assert (rec.trace_id, rec.span_id) == (trace_id, span_id)  # still the sampled forward step

def test_late_sample_goes_on_a_child_span_of_the_ended_forward_step(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    ctx, trace_id, span_id = forward_step_context(pipeline)
    sink(RECORD, ctx)
    spans = {s.name: s for s in pipeline.spans.get_finished_spans()}
    child = spans["swa divergence sample"]
    assert child.context.trace_id == trace_id
    assert child.parent.span_id == span_id
    assert child.kind == SpanKind.INTERNAL
    assert child.attributes["kv_cache.swa.forward_ct"] == 40
    (event,) = child.events
    assert event.name == EVENT_NAME and dict(event.attributes) == ATTRS
    assert spans["forward step"].events == ()


def test_sample_delivered_while_the_forward_step_records_goes_on_that_span(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    with pipeline.tracer_provider.get_tracer("engine").start_as_current_span("forward step"):
        sink(RECORD, otel_context.get_current())
    (span,) = pipeline.spans.get_finished_spans()
    assert [e.name for e in span.events] == [EVENT_NAME]
    assert dict(span.events[0].attributes) == ATTRS


def test_no_span_event_without_a_forward_step(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(RECORD, None)
    assert pipeline.spans.get_finished_spans() == ()
    assert len(pipeline.logs.get_finished_logs()) == 1


def test_traceparent_round_trip_and_invalid_values():
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    sc = parse_traceparent(tp)
    assert (sc.trace_id, sc.span_id, int(sc.trace_flags)) == (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1)
    assert sc.is_remote
    assert format_traceparent(sc) == tp
    assert format_traceparent(trace.INVALID_SPAN_CONTEXT) is None
    for bad in ("", "garbage", "00-00000000000000000000000000000000-b7ad6b7169203331-01", None, 17):
        assert parse_traceparent(bad) is None


def request_traceparents(pipeline, n):
    requests = RequestSpans(pipeline.tracer_provider.get_tracer("frontend"))
    return requests, {f"r{i}": requests.start(f"r{i}") for i in range(n)}


def test_forward_span_attributes_and_links_to_request_spans(pipeline):
    requests, tps = request_traceparents(pipeline, 3)
    forward = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"), requests)
    info = SimpleNamespace(forward_ct=7, batch_size=4, num_prefill=1, num_decode=3, request_ids=["r0", "r1", "r2", "r9"])
    with forward.forward_span(info) as span:
        assert span.is_recording()
    requests.end_all()
    spans = pipeline.spans.get_finished_spans()
    (fwd,) = [s for s in spans if s.name == "forward step"]
    assert fwd.kind == SpanKind.INTERNAL
    assert dict(fwd.attributes) == {
        "forward_step.forward_ct": 7, "forward_step.batch_size": 4, "forward_step.num_prefill": 1,
        "forward_step.num_decode": 3, "forward_step.links.dropped": 0, "forward_step.links.missing": 1,
    }
    request_spans = {s.context.span_id: s for s in spans if s.name == "request"}
    assert len(request_spans) == 3
    assert {(l.context.trace_id, l.context.span_id) for l in fwd.links} == {
        (s.context.trace_id, s.context.span_id) for s in request_spans.values()
    }
    # each request is the root of its own trace, kind SERVER
    assert all(s.parent is None and s.kind == SpanKind.SERVER for s in request_spans.values())
    assert len({s.context.trace_id for s in request_spans.values()}) == 3


def test_links_over_the_limit_are_counted_not_lost_silently(make_pipeline):
    p = make_pipeline(max_links=5)
    _, tps = request_traceparents(p, 8)
    forward = ForwardSpans(p.tracer_provider.get_tracer("engine"), tps, max_links=5)
    with forward.forward_span(forward_ct=1, batch_size=8, num_prefill=8, num_decode=0, request_ids=list(tps)):
        pass
    (fwd,) = [s for s in p.spans.get_finished_spans() if s.name == "forward step"]
    assert len(fwd.links) == 5
    assert fwd.dropped_links == 0
    assert fwd.attributes["forward_step.links.dropped"] == 3
    assert [(l.context.span_id) for l in fwd.links] == [parse_traceparent(tps[f"r{i}"]).span_id for i in range(5)]


def test_default_link_limit_is_the_sdk_default_128(pipeline):
    forward = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"), {})
    assert forward.max_links == 128


def test_a_traceparent_that_is_not_a_string_counts_as_missing(pipeline):
    forward = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"), {"a": ["not", "hashable"], "b": 7})
    with forward.forward_span(request_ids=["a", "b"]):
        pass
    (fwd,) = pipeline.spans.get_finished_spans()
    assert fwd.attributes["forward_step.links.missing"] == 2


def test_a_failing_traceparent_lookup_counts_as_missing(pipeline, caplog):
    def lookup(request_id):
        raise KeyError(request_id)

    forward = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"), lookup)
    with forward.forward_span(request_ids=["a", "b"]):
        pass
    (fwd,) = pipeline.spans.get_finished_spans()
    assert fwd.attributes["forward_step.links.missing"] == 2
    assert fwd.links == ()


def test_forward_span_records_an_engine_exception_and_reraises(pipeline):
    forward = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"))
    with pytest.raises(ZeroDivisionError):
        with forward.forward_span(forward_ct=3):
            1 / 0
    (fwd,) = pipeline.spans.get_finished_spans()
    assert fwd.status.status_code.name == "ERROR"
    assert fwd.events[0].name == "exception"


def test_bad_arguments_are_named(pipeline):
    tracer = pipeline.tracer_provider.get_tracer("engine")
    with pytest.raises(ValueError, match=r"max_links=-1; expected an integer >= 0"):
        ForwardSpans(tracer, max_links=-1)
    with pytest.raises(TypeError, match="mapping or a callable"):
        ForwardSpans(tracer, traceparents=42)
    requests = RequestSpans(tracer)
    requests.start("x")
    with pytest.raises(ValueError, match="request 'x' already has an open span"):
        requests.start("x")


def test_parse_traceparent_refuses_unhashable_values_without_raising():
    for bad in (["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"], {"traceparent": "x"}, bytearray(b"00")):
        assert parse_traceparent(bad) is None


def test_no_lookup_means_no_link_work_and_zero_counts(pipeline):
    forward = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"))

    def request_ids():
        raise AssertionError("request ids must not be read when there is no traceparent lookup")
        yield  # pragma: no cover

    assert forward.links(request_ids()) == ([], 0, 0)
    with forward.forward_span(forward_ct=3, batch_size=2, request_ids=["r0", "r1"]):
        pass
    (fwd,) = pipeline.spans.get_finished_spans()
    assert fwd.links == ()
    assert (fwd.attributes["forward_step.links.dropped"], fwd.attributes["forward_step.links.missing"]) == (0, 0)


def test_one_cache_serves_parsing_and_linking(pipeline):
    from otel_swa.telemetry import spans

    tp = "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01"
    spans._link.cache_clear()
    parsed = parse_traceparent(tp)  # first sight: one miss
    links, _, _ = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"), {"r": tp}).links(["r"])
    info = spans._link.cache_info()
    assert (info.misses, info.hits, info.currsize) == (1, 1, 1)  # the link reused the parse
    assert links[0].context.span_id == parsed.span_id == 0xC7AD6B7169203331


# ----------------------------------------------------------------- which forward steps get a span


def forward_steps(pipeline, spans, steps=12, **kwargs):
    """Run ``steps`` forward steps through ``spans``; returns the forward_ct of every exported
    forward-step span and what the body saw as the current span at each step."""
    inside = []
    for forward_ct in range(1, steps + 1):
        with spans.forward_span(forward_ct=forward_ct, batch_size=2, request_ids=["r0"], **kwargs) as span:
            inside.append((span.get_span_context().is_valid, trace.get_current_span() is span))
    exported = [s.attributes["forward_step.forward_ct"] for s in pipeline.spans.get_finished_spans()
                if s.name == "forward step"]
    return exported, inside


def test_sampled_mode_spans_only_the_steps_the_reporter_samples_and_keeps_their_links(pipeline):
    requests, _ = request_traceparents(pipeline, 1)
    spans = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"), requests, mode="sampled", interval=4)
    exported, inside = forward_steps(pipeline, spans)
    assert exported == [4, 8, 12]
    # the body's current span is the step's span; elsewhere the invalid span, the context unchanged
    assert inside == [(ct % 4 == 0, True) for ct in range(1, 13)]
    linked = [len(s.links) for s in pipeline.spans.get_finished_spans() if s.name == "forward step"]
    assert linked == [1, 1, 1]  # the sampled steps still link to the request


def test_the_sampled_step_span_is_the_context_the_reporter_gives_its_sinks(pipeline):
    """End to end with the reporter at interval 3 and spans at its samples: each record's context is
    the span of the step it was sampled at."""
    import torch

    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.views import SwaBatch

    seen = []
    reporter = SwaDivergenceReporter(3, sinks=[lambda r, c: seen.append((r.forward_ct, trace.get_current_span(c)))])
    spans = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"), mode="sampled", interval=reporter.interval)
    empty = torch.zeros(0, dtype=torch.int64)
    view = SwaBatch(torch.zeros((1, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.int64), empty, empty, ())
    for forward_ct in range(1, 10):
        with spans.forward_span(forward_ct=forward_ct):
            reporter.step(view)
    forward = {s.context.span_id: s.attributes["forward_step.forward_ct"] for s in pipeline.spans.get_finished_spans()}
    assert [(ct, forward[span.get_span_context().span_id]) for ct, span in seen] == [(3, 3), (6, 6), (9, 9)]


@pytest.mark.parametrize("mode, expected", [("all", list(range(1, 13))), ("off", [])])
def test_all_and_off(pipeline, mode, expected):
    spans = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"), mode=mode, interval=4)
    assert forward_steps(pipeline, spans)[0] == expected


def test_the_mode_comes_from_the_variable_and_the_interval_from_the_reporters_variables(pipeline):
    env = {"OTEL_SWA_FORWARD_SPANS": " Sampled ", "OTEL_SWA_DIVERGENCE_INTERVAL": "5"}
    spans = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"), environ=env)
    assert (spans.mode, spans.interval) == ("sampled", 5)
    assert forward_steps(pipeline, spans)[0] == [5, 10]
    # the default is sampled; with no interval known every step is spanned
    spans = ForwardSpans(pipeline.tracer_provider.get_tracer("engine"), environ={})
    assert (spans.mode, spans.interval) == ("sampled", None)
    assert spans.spans_step(7)


def test_a_bad_mode_is_named(pipeline):
    from otel_swa.config import ConfigError

    tracer = pipeline.tracer_provider.get_tracer("engine")
    with pytest.raises(ConfigError, match="OTEL_SWA_FORWARD_SPANS='every': expected one of sampled, all, off"):
        ForwardSpans(tracer, environ={"OTEL_SWA_FORWARD_SPANS": "every"})
    with pytest.raises(ValueError, match="mode='some'"):
        ForwardSpans(tracer, mode="some")
    with pytest.raises(ValueError, match="interval=0"):
        ForwardSpans(tracer, interval=0)
