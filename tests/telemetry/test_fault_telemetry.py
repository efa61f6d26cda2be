"""First offenders and the read check in OpenTelemetry: the sample event carries the offenders, one
``kv_cache.swa.fault`` event per offender, the read check's query counter, the block audit's gauges,
and the ``swa_logline`` exporter's fault lines."""

from __future__ import annotations

import io
import json

from opentelemetry import context as otel_context

from otel_swa.record import Offender, SwaDivergenceRecord, find_all
from otel_swa.telemetry import SwaTelemetrySink
from otel_swa.telemetry.events import record_attributes, record_from_attributes
from otel_swa.telemetry.logline import SwaLogLineExporter

READ = Offender("swa_read_mismatches", request="r7", row=3, position=17, full_slot=130, swa_slot=12, swa_page=12,
                layer=1)
STALE = Offender("swa_stale_tokens", full_slot=88, swa_slot=9, swa_page=9)


def _record(forward_ct, checks, mismatches, offenders=()):
    return SwaDivergenceRecord(forward_ct, 900, 300, 2, 4, swa_read_checks=checks, swa_read_mismatches=mismatches,
                               swa_read_unchecked=1, swa_stale_tokens=1 if STALE in offenders else 0,
                               swa_leaked_slots=0, swa_shared_slots=0, swa_pages_in_use=5, swa_pages_referenced=5,
                               verify_source="attention", offenders=tuple(offenders))


def test_the_sample_event_gives_the_record_back_with_its_offenders():
    record = _record(40, 8, 2, [READ, STALE])
    attributes = record_attributes(record)
    assert [json.loads(text) for text in attributes["kv_cache.swa.offenders"]] == [
        {"fault": "swa_read_mismatches", "request": "r7", "row": 3, "position": 17, "full_slot": 130, "swa_slot": 12,
         "swa_page": 12, "layer": 1},
        {"fault": "swa_stale_tokens", "full_slot": 88, "swa_slot": 9, "swa_page": 9},
    ]
    assert attributes["kv_cache.swa.swa_read_mismatches"] == 2 and attributes["kv_cache.swa.swa_read_checks"] == 8
    assert record_from_attributes(attributes) == record


def test_each_offender_is_an_event_in_the_forward_step(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers(), attributes={"otel_swa.tp_rank": 1})
    tracer = pipeline.tracer_provider.get_tracer("engine")
    with tracer.start_as_current_span("forward step") as span:
        ctx = otel_context.get_current()
        sink(_record(40, 8, 2, [READ, STALE]), ctx)
    sink.flush()
    logs = [log.log_record for log in pipeline.logs.get_finished_logs()]
    assert [log.event_name for log in logs] == ["kv_cache.swa.divergence_sample", "kv_cache.swa.fault",
                                                "kv_cache.swa.fault"]
    read_event = dict(logs[1].attributes)
    assert read_event == {
        "kv_cache.swa.forward_ct": 40, "kv_cache.swa.fault.kind": "swa_read_mismatches",
        "kv_cache.swa.fault.request": "r7", "kv_cache.swa.fault.row": 3, "kv_cache.swa.fault.position": 17,
        "kv_cache.swa.fault.full_slot": 130, "kv_cache.swa.fault.swa_slot": 12, "kv_cache.swa.fault.swa_page": 12,
        "kv_cache.swa.fault.layer": 1, "kv_cache.swa.verify_source": "attention", "otel_swa.tp_rank": 1,
    }
    assert logs[1].severity_text == "WARN" and logs[1].body.startswith("otel_swa[verify=attention] otel_swa_fault=")
    assert (logs[1].trace_id, logs[1].span_id) == (span.get_span_context().trace_id, span.get_span_context().span_id)
    (finished,) = [s for s in pipeline.spans.get_finished_spans() if s.name == "forward step"]
    assert [e.name for e in finished.events] == ["kv_cache.swa.divergence_sample", "kv_cache.swa.fault",
                                                 "kv_cache.swa.fault"]


def _points(pipeline, name):
    return [(dict(p.attributes), p.value) for p in pipeline.metrics()[name]["points"]]


def test_the_read_check_counter_sums_every_sample_by_outcome(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(_record(20, 8, 0), None)
    sink(_record(40, 8, 3, [READ]), None)
    sink(_record(60, 5, 0), None)  # a later clean sample does not hide the earlier disagreement
    sink.flush()
    points = {p[0]["kv_cache.swa.read_check.outcome"]: p[1] for p in _points(pipeline, "kv_cache.swa.read_check.queries")}
    assert points == {"agree": 8 + 5 + 5, "disagree": 3, "unchecked": 3}


def test_the_block_audit_gauges():
    from otel_swa.telemetry.metrics import INSTRUMENTS

    record = SwaDivergenceRecord(20, 10, 5, 0, 1, divergence_applicable=False, kv_leaked_blocks=4,
                                 kv_freed_blocks_in_use=1, kv_shared_blocks=2)
    read = {spec.name: spec.read(record) for spec in INSTRUMENTS if spec.name.startswith("kv_cache.swa.blocks.")}
    assert read == {"kv_cache.swa.blocks.leaked": ((4, {}),), "kv_cache.swa.blocks.freed_in_use": ((1, {}),),
                    "kv_cache.swa.blocks.shared": ((2, {}),), "kv_cache.swa.blocks.stale_cached": (),
                    "kv_cache.swa.blocks.foreign": ()}


def test_the_logline_exporter_writes_the_fault_lines_after_the_audit_line(pipeline):
    stream = io.StringIO()
    exporter = SwaLogLineExporter(stream=stream)
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor

    pipeline.logger_provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(_record(40, 8, 2, [READ, STALE]), None)
    sink.flush()
    lines = stream.getvalue().splitlines()
    assert [line.split(" ", 1)[1].split("=", 1)[0] for line in lines] == [
        "otel_swa_run_start", "kv_canary_swa_divergence", "otel_swa_audit", "otel_swa_fault", "otel_swa_fault"]
    (found,) = find_all(stream.getvalue())
    assert found.offenders == (READ, STALE)
