"""The provenance line: the checks of the KV held in the slots, written after the audit line (after
the record without one), read back onto its record as the audit line is; its faults' offenders."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from otel_swa.logsource import LogFollower
from otel_swa.record import (
    FAULT_FIELDS,
    OFFENDER_KEYS,
    PROVENANCE_FIELDS,
    Offender,
    SwaDivergenceRecord,
    find_all,
)
from otel_swa.testing.judge import judge

TAG = "otel_swa[verify=attention] "
P0, P1 = "[2026-01-01 00:00:00 TP0] ", "[2026-01-01 00:00:00 TP1] "
# every provenance field, a value of its own (the spec's order)
EVERY = dict(kv_write_checks=16, kv_write_mismatches=1, kv_write_unchecked=2, kv_stamp_checks=530,
             kv_foreign_tokens=3, kv_stamp_unchecked=12, kv_checksum_checks=520, kv_corrupt_tokens=4,
             kv_cache_entries_checked=77, kv_stale_cache_entries=5, kv_foreign_blocks=6)
RECORD_LINE = (TAG + 'kv_canary_swa_divergence={"forward_ct":40,"verify_full":4000,"verify_swa":1600,'
               '"swa_full_idx_divergence":3,"swa_out_of_window_tokens":5}')


def _record(forward_ct: int = 40, audit: bool = True, offenders=(), **provenance) -> SwaDivergenceRecord:
    audit_fields = dict(swa_leaked_slots=0, swa_stale_tokens=0, swa_shared_slots=0) if audit else {}
    return SwaDivergenceRecord(forward_ct, 100 * forward_ct, 40 * forward_ct, 3, 5, verify_source="attention",
                               offenders=tuple(offenders), **audit_fields, **provenance)


def test_the_fields_and_faults_are_the_specs():
    assert PROVENANCE_FIELDS == tuple(EVERY)
    assert FAULT_FIELDS[-5:] == ("kv_write_mismatches", "kv_foreign_tokens", "kv_corrupt_tokens",
                                 "kv_stale_cache_entries", "kv_foreign_blocks")
    assert OFFENDER_KEYS[-6:] == ("pool", "expected_token", "expected_position", "found_token", "found_position",
                                  "other_request")


def test_the_provenance_line_comes_after_the_audit_line_typed_by_hand():
    record = _record(**EVERY)
    assert record.lines() == [
        RECORD_LINE,
        TAG + 'otel_swa_audit={"forward_ct":40,"swa_leaked_slots":0,"swa_stale_tokens":0,"swa_shared_slots":0}',
        TAG + 'otel_swa_provenance={"forward_ct":40,"kv_write_checks":16,"kv_write_mismatches":1,'
              '"kv_write_unchecked":2,"kv_stamp_checks":530,"kv_foreign_tokens":3,"kv_stamp_unchecked":12,'
              '"kv_checksum_checks":520,"kv_corrupt_tokens":4,"kv_cache_entries_checked":77,'
              '"kv_stale_cache_entries":5,"kv_foreign_blocks":6}',
    ]
    # SGLang's line is untouched by the new fields
    assert record.format() == SwaDivergenceRecord(40, 4000, 1600, 3, 5).format()


def test_without_an_audit_line_it_follows_the_record_with_the_micro_batch():
    record = _record(audit=False, kv_stamp_checks=9, kv_foreign_tokens=0).replace(micro_batch=2)
    assert record.lines() == [
        RECORD_LINE,
        TAG + 'otel_swa_audit={"forward_ct":40,"micro_batch":2}',
        TAG + 'otel_swa_provenance={"forward_ct":40,"micro_batch":2,"kv_stamp_checks":9,"kv_foreign_tokens":0}',
    ]
    bare = _record(audit=False, kv_write_checks=8)
    assert bare.lines() == [RECORD_LINE, TAG + 'otel_swa_provenance={"forward_ct":40,"kv_write_checks":8}']


def test_provenance_off_writes_no_provenance_line():
    record = _record()
    assert record.provenance_line() is None and not record.provenance_checked
    assert [line.split(" ", 1)[1].split("=", 1)[0] for line in record.lines()] == [
        "kv_canary_swa_divergence", "otel_swa_audit"]


def test_every_field_reads_back_onto_its_record():
    offender = Offender("kv_foreign_tokens", request="r7", row=3, position=17, full_slot=130, swa_slot=12, pool="swa",
                        expected_token=42, expected_position=17, found_token=99, found_position=4, other_request="r9")
    record = _record(offenders=[offender], **EVERY)
    found = find_all("\n".join(record.lines()) + "\n")
    assert found.errors == [] and list(found) == [record]
    assert {name: getattr(found[0], name) for name in PROVENANCE_FIELDS} == EVERY
    assert found[0].offender("kv_foreign_tokens") == offender
    assert found[0].provenance_dict() == EVERY


@given(st.fixed_dictionaries({}, optional={name: st.integers(0, 2**63 - 1) for name in PROVENANCE_FIELDS}),
       st.one_of(st.none(), st.integers(0, 1023)), st.booleans())
def test_any_provenance_fields_round_trip(provenance, micro_batch, audit):
    record = _record(audit=audit, **provenance).replace(micro_batch=micro_batch)
    lines = record.lines()
    assert sum("otel_swa_provenance=" in line for line in lines) == (1 if provenance else 0)
    found = find_all("\n".join(lines))
    assert found.errors == [] and list(found) == [record]


@pytest.mark.parametrize("value, error", [(-1, ValueError), (True, TypeError), (1.0, TypeError), ("3", TypeError),
                                          (2**63, ValueError)])
@pytest.mark.parametrize("name", PROVENANCE_FIELDS)
def test_a_provenance_field_is_an_int_from_0_to_int64_or_none(name, value, error):
    with pytest.raises(error, match=f"SwaDivergenceRecord.{name}"):
        _record(**{name: value})


def test_lines_of_two_ranks_interleaved_each_reach_their_own_record():
    tp0 = _record(20, kv_stamp_checks=100, kv_foreign_tokens=0)
    tp1 = _record(20, kv_stamp_checks=200, kv_foreign_tokens=2,
                  offenders=[Offender("kv_foreign_tokens", position=5, pool="full", expected_token=1, found_token=2)])
    # both ranks sampled step 20; each one's lines after both records, TP1's first
    lines = ([P0 + tp0.line(), P1 + tp1.line()] + [P1 + line for line in tp1.lines()[1:]]
             + [P0 + line for line in tp0.lines()[1:]])
    found = find_all("\n".join(lines))
    assert found.errors == []
    assert [(m.rank, m.record.kv_stamp_checks, m.record.kv_foreign_tokens, len(m.record.offenders))
            for m in found.matches] == [("TP0", 100, 0, 0), ("TP1", 200, 2, 1)]
    assert [type(e).__name__ for e in found.entries] == [
        "RecordMatch", "RecordMatch", "AuditMatch", "ProvenanceMatch", "FaultMatch", "AuditMatch", "ProvenanceMatch"]


def test_a_provenance_line_whose_log_prefix_another_process_took_reaches_the_record_without_one():
    # three processes writing in parts: TP1's provenance line stands after TP0's prefix, after TP0's
    # own provenance line; it belongs to TP1's record (the only one of step 20 still without one)
    tp0, tp1 = _record(20, kv_write_checks=8), _record(20, kv_write_checks=16)
    text = "\n".join([P0 + tp0.line(), P1 + tp1.line(), P0 + tp0.audit_line(), P1 + tp1.audit_line(),
                      P0 + tp0.provenance_line(), P0 + tp1.provenance_line()])
    found = find_all(text)
    assert found.errors == []
    assert [(m.rank, m.record.kv_write_checks) for m in found.matches] == [("TP0", 8), ("TP1", 16)]


def test_a_follower_attaches_a_provenance_line_read_in_a_later_poll(tmp_path):
    record = _record(20, kv_corrupt_tokens=0, kv_checksum_checks=64)
    path = tmp_path / "server.log"
    follower = LogFollower(path)
    path.write_text("".join(P0 + line + "\n" for line in record.lines()[:2]))
    assert [n.record.kv_checksum_checks for n in follower.poll()] == [None]
    with open(path, "a") as f:
        f.write(P0 + record.provenance_line() + "\n")
    assert follower.poll() == [] and [r.record for r in follower.records] == [record]
    assert follower.malformed == 0


def test_a_provenance_line_without_its_record_is_an_error_with_the_reason():
    found = find_all(_record(20).line() + "\n" + _record(40, kv_write_checks=8).provenance_line())
    assert found[0].kv_write_checks is None
    assert [(e.line_no, e.reason) for e in found.errors] == [
        (2, "no record with forward_ct=40 just before this provenance line")]
    assert "malformed 'otel_swa_provenance=' provenance line" in str(found.errors[0])


def test_a_second_provenance_line_for_one_record_is_an_error():
    record = _record(20, kv_write_checks=8)
    found = find_all("\n".join(record.lines() + [record.provenance_line()]))
    assert [(e.line_no, e.reason) for e in found.errors] == [
        (4, "no record with forward_ct=20 just before this provenance line")]


@pytest.mark.parametrize("body, reason", [
    ('{"kv_write_checks":3}', "missing field forward_ct"),
    ('{"forward_ct":40,"kv_foreign_tokens":-1}', "kv_foreign_tokens=-1 is negative"),
    ('{"forward_ct":40,"kv_corrupt_tokens":1.5}', "kv_corrupt_tokens=1.5 is not an integer"),
    ('{"forward_ct":40,"kv_stamp_checks":true}', "kv_stamp_checks=true is not an integer"),
    ('{"forward_ct":40,"micro_batch":1024}', "micro_batch=1024 is above 1023"),
    ('{"forward_ct":40,"kv_foreign_blocks":9223372036854775808}', "kv_foreign_blocks=9223372036854775808 is outside int64"),
])
def test_bad_provenance_lines_are_refused_with_the_reason(body, reason):
    found = find_all(_record(40).line() + "\n" + TAG + "otel_swa_provenance=" + body)
    assert not found[0].provenance_checked
    assert len(found.errors) == 1 and reason in found.errors[0].reason, found.errors


def test_unknown_keys_of_a_provenance_line_are_ignored():
    found = find_all(_record(40).line() + "\n" + TAG + 'otel_swa_provenance={"forward_ct":40,"kv_write_checks":4,'
                     '"kv_future_count":7}')
    assert found.errors == [] and found[0].provenance_dict() == {"kv_write_checks": 4}


@pytest.mark.parametrize("fault", ["kv_write_mismatches", "kv_foreign_tokens", "kv_corrupt_tokens",
                                   "kv_stale_cache_entries", "kv_foreign_blocks"])
def test_a_fault_line_for_a_provenance_fault_its_record_counts_0_is_refused(fault):
    record = _record(40, **{fault: 0})
    line = TAG + 'otel_swa_fault={"forward_ct":40,"fault":"%s","block":3}' % fault
    found = find_all("\n".join(record.lines() + [line]))
    assert found[0].offenders == ()
    assert [e.reason for e in found.errors] == [
        f"a {fault} offender for the record with forward_ct=40, which counts {fault}=0"]
    counted = _record(40, **{fault: 2})
    found = find_all("\n".join(counted.lines() + [line]))
    assert found.errors == [] and found[0].offenders == (Offender(fault, block=3),)


def test_the_new_offender_keys_ride_the_fault_line_in_their_order():
    offender = Offender("kv_foreign_blocks", request="r1", block=41, kv_cache_group=1, other_request="r0")
    record = _record(40, kv_cache_entries_checked=12, kv_foreign_blocks=1, offenders=[offender])
    assert record.fault_lines() == [TAG + 'otel_swa_fault={"forward_ct":40,"fault":"kv_foreign_blocks","request":"r1",'
                                          '"block":41,"kv_cache_group":1,"other_request":"r0"}']


@pytest.mark.parametrize("body, reason", [
    ('"pool":"mamba"', 'pool="mamba" is not one of full, swa'),
    ('"pool":1', "pool=1 is not a string"),
    ('"other_request":9', "other_request=9 is not a string"),
    ('"found_token":-2', "found_token=-2 is negative"),
    ('"expected_position":"3"', 'expected_position="3" is not an integer'),
])
def test_bad_new_offender_keys_are_refused_with_the_reason(body, reason):
    record = _record(40, kv_foreign_tokens=1)
    found = find_all("\n".join(record.lines()) + "\n" + TAG
                     + 'otel_swa_fault={"forward_ct":40,"fault":"kv_foreign_tokens",%s}' % body)
    assert found[0].offenders == () and len(found.errors) == 1 and reason in found.errors[0].reason, found.errors


def test_the_offender_checks_its_new_keys():
    with pytest.raises(ValueError, match="Offender.pool must be None or one of full, swa, got 'SWA'"):
        Offender("kv_foreign_tokens", pool="SWA")
    with pytest.raises(TypeError, match="Offender.other_request must be a str or None"):
        Offender("kv_foreign_blocks", other_request=3)
    with pytest.raises(ValueError, match="Offender.expected_token must be >= 0, got -1"):
        Offender("kv_foreign_tokens", expected_token=-1)
    with pytest.raises(TypeError, match="Offender.found_position must be an int"):
        Offender("kv_foreign_tokens", found_position=True)


def test_describe_says_the_stamps_in_words():
    assert Offender("kv_foreign_tokens", request="r7", row=3, position=17, swa_slot=12, pool="swa",
                    expected_token=42, expected_position=17, found_token=99, found_position=4,
                    other_request="r9").describe() == (
        "request r7 (row 3), position 17, SWA slot 12, SWA pool, expected token 42 at position 17, "
        "found token 99 at position 4, KV of request r9")
    # never stamped: the stamp names nothing
    assert Offender("kv_foreign_tokens", full_slot=5, pool="full", expected_token=8, expected_position=2).describe() == (
        "FULL slot 5, FULL pool, expected token 8 at position 2, found a slot never stamped")
    assert Offender("kv_write_mismatches", position=6, swa_slot=30, layer=3, pool="swa").describe() == (
        "position 6, SWA slot 30, layer 3, SWA pool")
    assert Offender("kv_corrupt_tokens", expected_position=9).describe() == "expected position 9"
    assert Offender("kv_stale_cache_entries", block=7, kv_cache_group=0, other_request="a").describe() == (
        "block 7 (KV cache group 0), KV of request a")


def test_the_verdict_asks_no_provenance_line_of_an_engine_without_provenance():
    records = [_record(ct) for ct in (20, 40, 60)]
    text = "".join(P0 + line + "\n" for record in records for line in record.lines())
    found = find_all(text)
    verdict = judge(found.matches, errors=found.errors, source="log")
    assert verdict.ok, verdict.explain()
    assert "provenance" not in verdict.explain()


def test_a_lost_provenance_line_fails_as_a_lost_audit_line_does():
    records = [_record(ct, kv_stamp_checks=50, kv_foreign_tokens=0) for ct in (20, 40, 60, 80)]
    lines = [line for record in records for line in record.lines()]
    del lines[5]  # the provenance line of step 40 (line 6: record, audit, provenance per step)
    assert "otel_swa_provenance" not in lines[5] and '"forward_ct":40' in lines[3]
    found = find_all("".join(P0 + line + "\n" for line in lines))
    verdict = judge(found.matches, errors=found.errors, source="log")
    assert verdict.failed == ("provenance",)
    assert ("provenance line missing for the record at line 4: its faults cannot be ruled out"
            in verdict.explain()), verdict.explain()
    # the log's very last record may still be waiting for its provenance line
    ok = find_all("".join(P0 + line + "\n" for record in records[:3] for line in record.lines())
                  + P0 + records[3].line() + "\n" + P0 + records[3].audit_line() + "\n")
    assert judge(ok.matches, errors=ok.errors).ok


def test_an_unreadable_provenance_line_fails_the_provenance_signal():
    record = _record(20, kv_write_checks=8, kv_write_mismatches=0)
    bad = TAG + 'otel_swa_provenance={"forward_ct":20,"kv_write_mismatches":-4}'
    found = find_all("".join(P0 + line + "\n" for line in [*record.lines()[:2], bad]))
    verdict = judge(found.matches, errors=found.errors, source="log")
    assert verdict.failed == ("provenance",)
    assert [f.reason for f in verdict.failures] == [
        "1 provenance line(s) could not be read or attached to their record (line 3: kv_write_mismatches=-4 is "
        "negative); their faults cannot be ruled out"]
    assert judge(found.matches, errors=found.errors, require_clean_audit=False).ok


def test_the_lines_are_json_of_the_record_fields():
    record = _record(40, **EVERY)
    body = json.loads(record.provenance_line().split("otel_swa_provenance=", 1)[1])
    assert body == {"forward_ct": 40, **EVERY}
