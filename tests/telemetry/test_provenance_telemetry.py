"""The provenance fields in OpenTelemetry: the write check's, the stamps' and the checksums' counters
by outcome, the fault gauges, the sample event's attributes, the fault events' new location keys,
and the ``swa_logline`` exporter's provenance line."""

from __future__ import annotations

import io

from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor

from otel_swa.record import Offender, SwaDivergenceRecord, find_all
from otel_swa.telemetry import SwaTelemetrySink
from otel_swa.telemetry.events import record_attributes, record_from_attributes
from otel_swa.telemetry.logline import SwaLogLineExporter

FOREIGN = Offender("kv_foreign_tokens", request="r7", row=3, position=17, swa_slot=12, pool="swa", expected_token=42,
                   expected_position=17, found_token=99, found_position=4, other_request="r9")
NEW_INSTRUMENTS = ("kv_cache.swa.write_check.tokens", "kv_cache.swa.provenance.stamps",
                   "kv_cache.swa.provenance.checksums", "kv_cache.swa.tokens.foreign", "kv_cache.swa.tokens.corrupt",
                   "kv_cache.swa.provenance.block_hashes", "kv_cache.swa.blocks.stale_cached",
                   "kv_cache.swa.blocks.foreign")


def _sglang(forward_ct, writes, write_bad, stamps, foreign, checksums, corrupt, offenders=(), micro_batch=None):
    return SwaDivergenceRecord(forward_ct, 900, 300, 2, 4, verify_source="attention", micro_batch=micro_batch,
                               kv_write_checks=writes, kv_write_mismatches=write_bad, kv_write_unchecked=1,
                               kv_stamp_checks=stamps, kv_foreign_tokens=foreign, kv_stamp_unchecked=3,
                               kv_checksum_checks=checksums, kv_corrupt_tokens=corrupt, offenders=tuple(offenders))


def _points(metrics, name):
    return [(dict(p.attributes), p.value) for p in metrics[name]["points"]]


def test_the_checks_count_every_sample_by_outcome(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(_sglang(20, 16, 0, 100, 0, 90, 0), None)
    sink(_sglang(40, 16, 2, 120, 5, 110, 1, [FOREIGN]), None)
    sink(_sglang(60, 8, 0, 130, 0, 130, 0), None)  # a later clean sample does not hide the earlier faults
    sink.flush()
    metrics = pipeline.metrics()
    assert dict((p["kv_cache.swa.write_check.outcome"], v) for p, v in _points(metrics, "kv_cache.swa.write_check.tokens")) == {
        "agree": 16 + 14 + 8, "disagree": 2, "unchecked": 3}
    assert dict((p["kv_cache.swa.provenance.outcome"], v) for p, v in _points(metrics, "kv_cache.swa.provenance.stamps")) == {
        "agree": 100 + 115 + 130, "disagree": 5, "unchecked": 9}
    assert dict((p["kv_cache.swa.provenance.outcome"], v) for p, v in _points(metrics, "kv_cache.swa.provenance.checksums")) == {
        "agree": 90 + 109 + 130, "disagree": 1}
    assert [metrics[name]["unit"] for name in NEW_INSTRUMENTS[:3]] == ["{token}", "{slot}", "{slot}"]
    # the gauges show the latest sample
    assert _points(metrics, "kv_cache.swa.tokens.foreign") == [({}, 0)]
    assert _points(metrics, "kv_cache.swa.tokens.corrupt") == [({}, 0)]


def test_the_fault_gauges_show_the_sample_with_its_micro_batch(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(_sglang(20, 16, 0, 100, 6, 90, 2, micro_batch=1), None)
    vllm = SwaDivergenceRecord(40, 10, 5, 0, 1, divergence_applicable=False, verify_source="attention",
                               kv_cache_entries_checked=40, kv_stale_cache_entries=3, kv_foreign_blocks=2)
    sink(vllm, None)
    sink(vllm.replace(forward_ct=60, kv_cache_entries_checked=25, kv_stale_cache_entries=0, kv_foreign_blocks=0), None)
    sink.flush()
    metrics = pipeline.metrics()
    assert _points(metrics, "kv_cache.swa.tokens.foreign") == [({"kv_cache.swa.micro_batch": 1}, 6)]
    assert _points(metrics, "kv_cache.swa.tokens.corrupt") == [({"kv_cache.swa.micro_batch": 1}, 2)]
    assert _points(metrics, "kv_cache.swa.blocks.stale_cached") == [({}, 0)]
    assert _points(metrics, "kv_cache.swa.blocks.foreign") == [({}, 0)]
    assert _points(metrics, "kv_cache.swa.provenance.block_hashes") == [({}, 65)]
    assert [metrics[name]["unit"] for name in NEW_INSTRUMENTS[3:]] == ["{token}", "{token}", "{entry}", "{block}",
                                                                       "{block}"]


def test_no_provenance_no_series(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(SwaDivergenceRecord(20, 900, 300, 2, 4, swa_leaked_slots=0, swa_stale_tokens=0, swa_shared_slots=0,
                             verify_source="attention"), None)
    sink.flush()
    metrics = pipeline.metrics()
    assert [name for name in NEW_INSTRUMENTS if metrics.get(name, {}).get("points")] == []
    (event,) = [log.log_record for log in pipeline.logs.get_finished_logs()]
    assert not any(key.startswith("kv_cache.swa.kv_") for key in event.attributes)


def test_the_sample_event_carries_the_fields_and_gives_the_record_back():
    record = _sglang(40, 16, 2, 120, 5, 110, 1, [FOREIGN])
    attributes = record_attributes(record)
    assert {key: value for key, value in attributes.items() if key.startswith("kv_cache.swa.kv_")} == {
        "kv_cache.swa.kv_write_checks": 16, "kv_cache.swa.kv_write_mismatches": 2, "kv_cache.swa.kv_write_unchecked": 1,
        "kv_cache.swa.kv_stamp_checks": 120, "kv_cache.swa.kv_foreign_tokens": 5, "kv_cache.swa.kv_stamp_unchecked": 3,
        "kv_cache.swa.kv_checksum_checks": 110, "kv_cache.swa.kv_corrupt_tokens": 1}
    assert record_from_attributes(attributes) == record


def test_the_fault_event_names_the_new_location_keys(pipeline):
    sink = SwaTelemetrySink(**pipeline.providers())
    sink(_sglang(40, 16, 0, 120, 5, 110, 0, [FOREIGN]), None)
    sink.flush()
    logs = [log.log_record for log in pipeline.logs.get_finished_logs()]
    assert [log.event_name for log in logs] == ["kv_cache.swa.divergence_sample", "kv_cache.swa.fault"]
    assert dict(logs[1].attributes) == {
        "kv_cache.swa.forward_ct": 40, "kv_cache.swa.fault.kind": "kv_foreign_tokens",
        "kv_cache.swa.fault.request": "r7", "kv_cache.swa.fault.row": 3, "kv_cache.swa.fault.position": 17,
        "kv_cache.swa.fault.swa_slot": 12, "kv_cache.swa.fault.pool": "swa", "kv_cache.swa.fault.expected_token": 42,
        "kv_cache.swa.fault.expected_position": 17, "kv_cache.swa.fault.found_token": 99,
        "kv_cache.swa.fault.found_position": 4, "kv_cache.swa.fault.other_request": "r9",
        "kv_cache.swa.verify_source": "attention",
    }


def test_the_logline_exporter_writes_the_provenance_line_before_the_fault_lines(pipeline):
    stream = io.StringIO()
    pipeline.logger_provider.add_log_record_processor(SimpleLogRecordProcessor(SwaLogLineExporter(stream=stream)))
    sink = SwaTelemetrySink(**pipeline.providers())
    record = _sglang(40, 16, 0, 120, 5, 110, 0, [FOREIGN]).replace(swa_leaked_slots=0)
    sink(record, None)
    sink.flush()
    lines = stream.getvalue().splitlines()
    assert [line.split(" ", 1)[1].split("=", 1)[0] for line in lines] == [
        "otel_swa_run_start", "kv_canary_swa_divergence", "otel_swa_audit", "otel_swa_provenance", "otel_swa_fault"]
    assert lines[3] == ('otel_swa[verify=attention] otel_swa_provenance={"forward_ct":40,"kv_write_checks":16,'
                        '"kv_write_mismatches":0,"kv_write_unchecked":1,"kv_stamp_checks":120,"kv_foreign_tokens":5,'
                        '"kv_stamp_unchecked":3,"kv_checksum_checks":110,"kv_corrupt_tokens":0}')
    (found,) = find_all(stream.getvalue())
    assert found == record
