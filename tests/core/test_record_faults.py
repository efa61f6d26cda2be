"""The fault line: each fault's first offender, written after the audit line and read back onto
its record; the read check's and the KV block audit's fields on the audit line."""

from __future__ import annotations

import pytest

from otel_swa.record import (
    FAULT_FIELDS,
    MalformedRecordError,
    Offender,
    SwaDivergenceRecord,
    find_all,
)
from otel_swa.testing.judge import judge


def _record(forward_ct: int, mismatches: int, offenders=(), stale: int = 0) -> SwaDivergenceRecord:
    return SwaDivergenceRecord(
        forward_ct, 100 * forward_ct, 40 * forward_ct, 3, 5,
        swa_leaked_slots=0, swa_stale_tokens=stale, swa_shared_slots=0, swa_pages_in_use=4, swa_pages_referenced=4,
        swa_read_checks=8, swa_read_mismatches=mismatches, swa_read_unchecked=0,
        verify_source="attention", offenders=tuple(offenders),
    )


def test_fault_lines_are_written_after_the_audit_line_in_compact_json():
    record = _record(40, 2, [Offender("swa_read_mismatches", request="7", row=3, position=17, full_slot=130,
                                      swa_slot=12, swa_page=12, layer=1)])
    assert record.lines() == [
        'otel_swa[verify=attention] kv_canary_swa_divergence={"forward_ct":40,"verify_full":4000,"verify_swa":1600,'
        '"swa_full_idx_divergence":3,"swa_out_of_window_tokens":5}',
        'otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,"swa_leaked_slots":0,"swa_stale_tokens":0,'
        '"swa_shared_slots":0,"swa_pages_in_use":4,"swa_pages_referenced":4,"swa_read_checks":8,'
        '"swa_read_mismatches":2,"swa_read_unchecked":0}',
        'otel_swa[verify=attention] otel_swa_fault={"forward_ct":40,"fault":"swa_read_mismatches","request":"7",'
        '"row":3,"position":17,"full_slot":130,"swa_slot":12,"swa_page":12,"layer":1}',
    ]


def test_fault_lines_are_read_back_onto_their_record_per_rank():
    tp0 = _record(20, 1, [Offender("swa_read_mismatches", row=2, position=9, layer=0),
                          Offender("swa_stale_tokens", full_slot=88, swa_slot=9, swa_page=9)], stale=2)
    tp1 = _record(20, 0)
    lines = ([f"[12:00:00 TP0] {line}" for line in tp0.lines()[:2]] + [f"[12:00:00 TP1] {line}" for line in tp1.lines()]
             + [f"[12:00:00 TP0] {line}" for line in tp0.lines()[2:]])
    found = find_all("\n".join(lines))
    assert found.errors == []
    assert [m.rank for m in found.matches] == ["TP0", "TP1"]
    assert found[0].offenders == tp0.offenders and found[1].offenders == ()
    assert found[0].offender("swa_stale_tokens").swa_page == 9
    assert found[0].swa_read_mismatches == 1 and found[0].swa_read_checks == 8


def test_a_fault_line_without_its_record_is_a_malformed_line_with_its_reason():
    found = find_all('otel_swa[verify=attention] otel_swa_fault={"forward_ct":40,"fault":"swa_stale_tokens"}')
    assert len(found) == 0 and len(found.errors) == 1
    assert "no record with forward_ct=40 just before this fault line" in str(found.errors[0])


def test_a_fault_line_for_a_fault_its_record_counts_0_is_refused():
    record = _record(40, 0)  # swa_read_mismatches=0 on its audit line
    fault = 'otel_swa[verify=attention] otel_swa_fault={"forward_ct":40,"fault":"swa_read_mismatches","layer":1}'
    found = find_all("\n".join([record.line(), record.audit_line(), fault]))
    assert len(found) == 1 and found[0].offenders == ()
    assert len(found.errors) == 1
    assert "a swa_read_mismatches offender for the record with forward_ct=40, which counts swa_read_mismatches=0" in str(found.errors[0])


@pytest.mark.parametrize("body, reason", [
    ('{"fault":"swa_stale_tokens"}', "missing field forward_ct"),
    ('{"forward_ct":4,"fault":"swa_late_held_slots"}', 'fault="swa_late_held_slots" is not one of'),
    ('{"forward_ct":4,"fault":"swa_stale_tokens","position":-1}', "position=-1 is negative"),
    ('{"forward_ct":4,"fault":"swa_stale_tokens","request":7}', "request=7 is not a string"),
    ('{"forward_ct":4,"fault":"swa_stale_tokens","layer":1.5}', "layer=1.5 is not an integer"),
])
def test_bad_fault_lines_are_refused_with_the_reason(body, reason):
    record = _record(4, 0)
    found = find_all(record.line() + "\n" + record.audit_line() + "\notel_swa[verify=attention] otel_swa_fault=" + body)
    assert len(found) == 1 and found[0].offenders == ()
    assert len(found.errors) == 1 and reason in found.errors[0].reason, found.errors


def test_unknown_keys_of_a_fault_line_are_ignored():
    record = _record(4, 1)
    found = find_all(record.line() + "\n" + record.audit_line()
                     + '\notel_swa[verify=attention] otel_swa_fault={"forward_ct":4,"fault":"swa_read_mismatches",'
                       '"layer":2,"head":5}')
    assert found.errors == [] and found[0].offenders == (Offender("swa_read_mismatches", layer=2),)


def test_offender_checks_its_values():
    with pytest.raises(ValueError, match="Offender.fault must be one of"):
        Offender("swa_late_held_slots")
    with pytest.raises(ValueError, match="Offender.swa_slot must be >= 0, got -3"):
        Offender("swa_stale_tokens", swa_slot=-3)
    with pytest.raises(TypeError, match="Offender.request must be a str"):
        Offender("swa_stale_tokens", request=5)
    with pytest.raises(TypeError, match="Offender.layer must be an int"):
        Offender("swa_read_mismatches", layer=True)
    with pytest.raises(TypeError, match="offenders must be a tuple of Offender"):
        SwaDivergenceRecord(1, 2, 1, 0, 0, offenders=[Offender("swa_stale_tokens")])
    assert set(FAULT_FIELDS) >= {"swa_read_mismatches", "kv_leaked_blocks", "kv_freed_blocks_in_use"}


def test_describe_names_every_location_known():
    assert Offender("swa_read_mismatches", request="a1", row=3, position=17, full_slot=130, swa_slot=12,
                    swa_page=3, layer=1).describe() == (
        "request a1 (row 3), position 17, FULL slot 130, SWA slot 12 (page 3), layer 1")
    assert Offender("swa_leaked_slots", swa_page=41).describe() == "SWA page 41"
    assert Offender("swa_shared_slots", full_slot=5, swa_slot=9, other_full_slot=77).describe() == (
        "FULL slot 5, SWA slot 9, also mapped from FULL slot 77")
    assert Offender("kv_leaked_blocks", block=12, kv_cache_group=1).describe() == "block 12 (KV cache group 1)"
    assert Offender("swa_stale_tokens").describe() == "no location"


def test_the_verdict_fails_a_read_mismatch_and_names_where_it_began():
    records = [_record(20, 0), _record(40, 3, [Offender("swa_read_mismatches", request="9", row=2, position=33,
                                                        full_slot=70, swa_slot=6, swa_page=6, layer=2)]),
               _record(60, 5, [Offender("swa_read_mismatches", request="4", row=1, position=50, layer=0)])]
    text = "\n".join(line for record in records for line in record.lines())
    verdict = judge(find_all(text).entries)
    assert not verdict.ok
    explanation = verdict.explain()
    assert ("5 checked query(ies) of a sliding-window layer read other KV than the mapping gives (their attention "
            "output differs from the one recomputed from the pool): peak swa_read_mismatches=5 at forward_ct=60 "
            "(line 6), first non-zero at forward_ct=40 (line 3): request 9 (row 2), position 33, FULL slot 70, "
            "SWA slot 6 (page 6), layer 2") in explanation, explanation


def test_a_clean_read_check_passes():
    records = [_record(20, 0), _record(40, 0)]
    text = "\n".join(line for record in records for line in record.lines())
    assert judge(find_all(text).entries).ok


def test_a_fault_line_read_while_two_log_prefixes_wait_is_attached_not_a_crash():
    # two processes' prefixes before one message (lines written in parts): the fault line's rank is
    # a guess between them; the reader used to raise ValueError on it (no rank_candidates field)
    record = _record(20, 0, [Offender("swa_stale_tokens", swa_slot=9)], stale=2)
    line, audit, fault = record.lines()
    p0, p1 = "[2026-01-01 00:00:00 TP0] ", "[2026-01-01 00:00:00 TP1] "
    found = find_all(f"{p0}{line}\n{p0}{audit}\n{p0}{p1}{fault}\n")
    assert found.errors == []
    assert found[0].offenders == (Offender("swa_stale_tokens", swa_slot=9),)
    assert found.entries[-1].rank_candidates == ("TP0", "TP1")
