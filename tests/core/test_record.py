"""The record and its SGLang line: byte-exact format, parse, find_* on real log text."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from otel_swa.record import (
    FIELDS,
    LINE_PREFIX,
    MalformedRecordError,
    SwaDivergenceRecord,
    find_all,
    find_last,
    run_start_line,
)

R = SwaDivergenceRecord(40, 5120, 2048, 17, 311)


def test_format_is_byte_identical_to_sglang_line():
    # typed by hand in SGLang's field order, compact separators
    expected = (
        'kv_canary_swa_divergence={"forward_ct":40,"verify_full":5120,"verify_swa":2048,'
        '"swa_full_idx_divergence":17,"swa_out_of_window_tokens":311}'
    )
    assert R.format() == expected
    assert R.format().encode() == expected.encode()


def test_format_zero_record():
    assert SwaDivergenceRecord(0, 0, 0, 0, 0).format() == (
        'kv_canary_swa_divergence={"forward_ct":0,"verify_full":0,"verify_swa":0,'
        '"swa_full_idx_divergence":0,"swa_out_of_window_tokens":0}'
    )


def test_fields_order():
    assert FIELDS == ("forward_ct", "verify_full", "verify_swa", "swa_full_idx_divergence", "swa_out_of_window_tokens")
    assert list(json.loads(R.format()[len(LINE_PREFIX):]).keys()) == list(FIELDS)


@pytest.mark.parametrize(
    "line",
    [
        '[2025-06-01 12:34:56 TP0] kv_canary_swa_divergence={"forward_ct":40,"verify_full":5120,"verify_swa":2048,"swa_full_idx_divergence":17,"swa_out_of_window_tokens":311}',
        '2025-06-01 12:34:56,789 INFO kv_canary_swa_divergence={"forward_ct":40,"verify_full":5120,"verify_swa":2048,"swa_full_idx_divergence":17,"swa_out_of_window_tokens":311}\r\n',
        '\x1b[32m[2025-06-01 12:34:56 DP1 TP0]\x1b[0m kv_canary_swa_divergence={"forward_ct":40,"verify_full":5120,"verify_swa":2048,"swa_full_idx_divergence":17,"swa_out_of_window_tokens":311}\x1b[0m',
        # keys in any order, words after the record
        'kv_canary_swa_divergence={"swa_out_of_window_tokens":311,"forward_ct":40,"verify_swa":2048,"verify_full":5120,"swa_full_idx_divergence":17} trailing words',
    ],
)
def test_parse_real_log_lines(line):
    assert SwaDivergenceRecord.parse(line) == R


@pytest.mark.parametrize(
    "line, reason",
    [
        ("kv_canary_swa_divergence={not json}", "not JSON"),
        ("kv_canary_swa_divergence=", "nothing follows the prefix"),
        ("kv_canary_swa_divergence= {}", "nothing follows the prefix"),
        ('kv_canary_swa_divergence=[1,2,3]', "expected a JSON object, got list"),
        ('kv_canary_swa_divergence={"forward_ct":1,"verify_full":2}', "missing field(s) verify_swa, swa_full_idx_divergence"),
        # json.dumps without separators: SGLang's \S+ stops at the first space
        ('kv_canary_swa_divergence={"forward_ct": 1, "verify_full": 2, "verify_swa": 1, "swa_full_idx_divergence": 3, '
         '"swa_out_of_window_tokens": 0}', "the JSON holds spaces"),
        # SGLang's SwaDivergenceLog(**fields) raises TypeError on a key it does not have
        ('kv_canary_swa_divergence={"forward_ct":1,"verify_full":2,"verify_swa":1,"swa_full_idx_divergence":3,'
         '"swa_out_of_window_tokens":0,"new_key":[1,2]}', "unknown key(s) 'new_key'"),
        ('kv_canary_swa_divergence={"forward_ct":1,"verify_full":2,"verify_swa":1,"swa_full_idx_divergence":"3","swa_out_of_window_tokens":0}', 'swa_full_idx_divergence="3" is not an integer'),
        ('kv_canary_swa_divergence={"forward_ct":1.5,"verify_full":2,"verify_swa":1,"swa_full_idx_divergence":3,"swa_out_of_window_tokens":0}', "forward_ct=1.5 is not an integer"),
        ('kv_canary_swa_divergence={"forward_ct":true,"verify_full":2,"verify_swa":1,"swa_full_idx_divergence":3,"swa_out_of_window_tokens":0}', "forward_ct=true is not an integer"),
        ('kv_canary_swa_divergence={"forward_ct":1,"verify_full":9223372036854775808,"verify_swa":1,"swa_full_idx_divergence":3,"swa_out_of_window_tokens":0}', "verify_full=9223372036854775808 is outside int64"),
        ('kv_canary_swa_divergence={"forward_ct":1,"verify_full":2,"verify_swa":1,"swa_full_idx_divergence":3,"swa_out_of_window_tokens":0}xyz', "text glued after the JSON object ('xyz')"),
        ("no record here", "no 'kv_canary_swa_divergence=' prefix"),
    ],
)
def test_parse_malformed_raises_clear_error(line, reason):
    with pytest.raises(MalformedRecordError) as info:
        SwaDivergenceRecord.parse(line)
    assert reason in str(info.value)
    assert reason in info.value.reason or reason.startswith("no ")


def test_what_sglangs_parser_takes_is_taken():
    # SGLang's SwaDivergenceLog defaults swa_out_of_window_tokens to 0, and takes negative ints
    # (its int32 verify counters wrap past 2**31 - 1)
    older = 'kv_canary_swa_divergence={"forward_ct":20,"verify_full":9,"verify_swa":4,"swa_full_idx_divergence":1}'
    assert SwaDivergenceRecord.parse(older) == SwaDivergenceRecord(20, 9, 4, 1, 0)
    wrapped = SwaDivergenceRecord.parse(
        'kv_canary_swa_divergence={"forward_ct":20,"verify_full":-2147483000,"verify_swa":4,"swa_full_idx_divergence":1,'
        '"swa_out_of_window_tokens":2}')
    assert (wrapped.forward_ct, wrapped.verify_full, wrapped.verify_swa) == (20, -2147483000, 4)
    assert wrapped.format().endswith('"verify_full":-2147483000,"verify_swa":4,"swa_full_idx_divergence":1,"swa_out_of_window_tokens":2}')


def test_malformed_lines_in_a_log_carry_their_line_number_and_reason():
    text = ("[t TP0] starting\n"
            '[t TP0] kv_canary_swa_divergence={"forward_ct": 20}\n'
            + R.format() + "\n")
    found = find_all(text)
    assert list(found) == [R]
    assert [(e.line_no, e.reason.split(":")[0]) for e in found.errors] == [(2, "the JSON holds spaces")]
    assert str(found.errors[0]).startswith("line 2: malformed 'kv_canary_swa_divergence=' record: the JSON holds spaces")


def test_find_all_several_records_in_one_chunk_and_skips_malformed():
    text = (
        "[t TP0] starting\n"
        '[t TP0] kv_canary_swa_divergence={"forward_ct":20,"verify_full":100,"verify_swa":90,"swa_full_idx_divergence":0,"swa_out_of_window_tokens":0}\r\n'
        "[t TP0] kv_canary_swa_divergence={broken\n"
        '[t TP0] kv_canary_swa_divergence={"forward_ct":40,"verify_full":200,"verify_swa":150,"swa_full_idx_divergence":3,"swa_out_of_window_tokens":7} '
        'kv_canary_swa_divergence={"forward_ct":60,"verify_full":300,"verify_swa":210,"swa_full_idx_divergence":5,"swa_out_of_window_tokens":9}\n'
    )
    found = find_all(text)
    assert [r.forward_ct for r in found] == [20, 40, 60]
    assert found[2] == SwaDivergenceRecord(60, 300, 210, 5, 9)
    assert found.malformed == 1
    assert [m.line_no for m in found.matches] == [2, 4, 4]
    last = find_last(text)
    assert last is not None
    assert last[0] == SwaDivergenceRecord(60, 300, 210, 5, 9)
    assert last[1] == 'kv_canary_swa_divergence={"forward_ct":60,"verify_full":300,"verify_swa":210,"swa_full_idx_divergence":5,"swa_out_of_window_tokens":9}'


def test_find_without_record():
    assert find_last("nothing\nat all\n") is None
    found = find_all("")
    assert list(found) == [] and found.malformed == 0


def test_find_last_skips_trailing_malformed():
    text = R.format() + "\n" + "kv_canary_swa_divergence={\"forward_ct\":\n"
    assert find_last(text)[0] == R


@pytest.mark.parametrize("bad", [-1, 1.0, "1", True, None, 2**63])
def test_constructor_refuses_non_int(bad):
    with pytest.raises((TypeError, ValueError)) as info:
        SwaDivergenceRecord(bad, 0, 0, 0, 0)
    assert "forward_ct" in str(info.value)


@pytest.mark.parametrize("name", ["verify_full", "swa_out_of_window_tokens", "swa_leaked_slots", "swa_pages_in_use"])
def test_every_field_is_bounded_to_int64_with_its_name_and_value(name):
    assert R.replace(**{name: 2**63 - 1}).to_dict() is not None  # the maximum itself is fine
    with pytest.raises(ValueError) as info:
        R.replace(**{name: 2**63})
    assert str(info.value) == (f"SwaDivergenceRecord.{name}=9223372036854775808 is above the int64 maximum "
                               "2**63 - 1 = 9223372036854775807 (OTLP carries int64)")


ints = st.integers(min_value=0, max_value=2**63 - 1)


@given(ints, ints, ints, ints, ints, st.sampled_from(["", "[2025-01-01 00:00:00 TP3] ", "INFO:otel_swa:"]))
def test_round_trip(a, b, c, d, e, prefix):
    record = SwaDivergenceRecord(a, b, c, d, e)
    assert SwaDivergenceRecord.parse(prefix + record.format()) == record
    assert find_last(prefix + record.format() + "\n")[0] == record


def test_bare_carriage_returns_end_lines():
    a = SwaDivergenceRecord(20, 1, 1, 0, 0)
    b = SwaDivergenceRecord(40, 2, 1, 1, 1)
    found = find_all(a.format() + "\r" + b.format() + "\r")
    assert list(found) == [a, b] and found.malformed == 0
    # numbered as grep -n numbers them: no LF before either, both on line 1
    assert [m.line_no for m in found.matches] == [1, 1]


def test_line_tags_otel_swa_lines_and_keeps_the_record_byte_identical():
    canary = R.replace(verify_source="kv_canary")
    assert canary.line() == (
        'otel_swa[verify=kv_canary] kv_canary_swa_divergence={"forward_ct":40,"verify_full":5120,'
        '"verify_swa":2048,"swa_full_idx_divergence":17,"swa_out_of_window_tokens":311}'
    )
    assert canary.format() == R.format()  # the tag is never part of the record's text
    assert R.line() == R.format()  # unknown source: SGLang's bare line


def test_find_all_reads_the_tag_back_and_tells_our_lines_from_sglangs():
    text = (
        "[2026-01-01 00:00:00 TP0] " + R.format() + "\n"  # SGLang's own line
        + "[2026-01-01 00:00:00 TP0] " + R.replace(verify_source="kv_canary").line() + "\n"
        + "[2026-01-01 00:00:01 TP0] " + R.replace(forward_ct=60, verify_source="attention").line() + "\r\n"
        # a tag on another line, or not right before the record, is not this record's
        + "otel_swa[verify=kv_canary]\n" + R.replace(forward_ct=80).format() + "\n"
        + "otel_swa[verify=kv_canary] and more " + R.replace(forward_ct=100).format() + "\n"
        + "otel_swa[verify=bogus] " + R.replace(forward_ct=120).format() + "\n"
    )
    found = find_all(text)
    assert [(r.forward_ct, r.verify_source) for r in found] == [
        (40, None), (40, "kv_canary"), (60, "attention"), (80, None), (100, None), (120, None),
    ]
    assert SwaDivergenceRecord.parse("x otel_swa[verify=attention] " + R.format()).verify_source == "attention"


def test_unknown_verify_source_is_refused_with_its_value():
    with pytest.raises(ValueError, match="verify_source.*'reads'"):
        R.replace(verify_source="reads")


def test_pages_in_use_and_referenced_are_optional_audit_fields_never_in_the_line():
    audited = R.replace(swa_leaked_slots=4, swa_stale_tokens=0, swa_shared_slots=0,
                        swa_pages_in_use=9, swa_pages_referenced=5)
    assert (audited.swa_pages_in_use, audited.swa_pages_referenced) == (9, 5)
    assert audited.audit_dict() == {"swa_leaked_slots": 4, "swa_stale_tokens": 0, "swa_shared_slots": 0,
                                    "swa_pages_in_use": 9, "swa_pages_referenced": 5}
    assert audited.format() == R.format()
    assert (R.swa_pages_in_use, R.swa_pages_referenced) == (None, None)
    with pytest.raises(TypeError, match="swa_pages_in_use must be an int"):
        R.replace(swa_pages_in_use=1.0)
    with pytest.raises(TypeError):
        SwaDivergenceRecord(1, 2, 3, 4, 5, 6)  # keyword-only


# ------------------------------------------------------------------ glued records (two writers, no line end)
A = SwaDivergenceRecord(20, 100, 40, 3, 7)
B = SwaDivergenceRecord(40, 200, 80, 5, 9)


def test_two_records_glued_on_one_line_are_both_recovered():
    found = find_all("[2025-06-01 12:00:00 TP0] " + A.format() + B.format() + "\n")
    assert list(found) == [A, B] and found.malformed == 0
    assert [m.text for m in found.matches] == [A.format(), B.format()]


def test_each_glued_record_takes_the_rank_of_the_nearest_prefix_before_it():
    line = ("[2025-06-01 12:00:00 TP0] " + A.format()
            + "[2025-06-01 12:00:00 TP1] otel_swa[verify=attention] " + B.format() + "\n")
    found = find_all(line)
    assert [(m.record.forward_ct, m.rank, m.record.verify_source) for m in found.matches] == [
        (20, "TP0", None), (40, "TP1", "attention")]
    # a tag glued right after the first record belongs to the second
    glued_tag = "[2025-06-01 12:00:00 TP0] " + A.format() + "otel_swa[verify=kv_canary] " + B.format()
    assert [(r.forward_ct, r.verify_source) for r in find_all(glued_tag)] == [(20, None), (40, "kv_canary")]


# ------------------------------------------------------------------ the audit line and the run start marker
AUDITED = B.replace(verify_source="attention", swa_leaked_slots=4, swa_stale_tokens=0, swa_shared_slots=1,
                    swa_pages_in_use=10, swa_pages_referenced=6)


def test_audit_line_format_typed_by_hand():
    assert AUDITED.audit_line() == (
        'otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,"swa_leaked_slots":4,"swa_stale_tokens":0,'
        '"swa_shared_slots":1,"swa_pages_in_use":10,"swa_pages_referenced":6}'
    )
    assert AUDITED.lines() == [AUDITED.line(), AUDITED.audit_line()]
    assert B.audit_line() is None and B.lines() == [B.line()]
    assert "kv_canary_swa_divergence=" not in AUDITED.audit_line()  # SGLang's parser never matches it


def test_run_start_line_format():
    assert run_start_line("attention", pid=4242) == 'otel_swa[verify=attention] otel_swa_run_start={"pid":4242}'
    assert run_start_line(None, pid=7) == 'otel_swa_run_start={"pid":7}'
    with pytest.raises(ValueError, match="'reads'"):
        run_start_line("reads")


def test_find_all_attaches_each_audit_line_to_its_record_and_returns_every_line_in_order():
    text = "\n".join([
        "[2026-01-01 00:00:00 TP0] " + run_start_line("attention", pid=1),
        "[2026-01-01 00:00:00 TP1] " + run_start_line("attention", pid=2),
        "[2026-01-01 00:00:00 TP0] " + AUDITED.line(),
        "[2026-01-01 00:00:00 TP1] " + AUDITED.replace(swa_leaked_slots=0, swa_pages_referenced=10).line(),
        # both ranks sampled the same step: their audit lines come after both records
        "[2026-01-01 00:00:00 TP1] " + AUDITED.replace(swa_leaked_slots=0, swa_pages_referenced=10).audit_line(),
        "[2026-01-01 00:00:00 TP0] " + AUDITED.audit_line(),
        "[2026-01-01 00:00:00 TP0] " + B.format(),  # SGLang's own line of that step: no audit
    ]) + "\n"
    found = find_all(text)
    assert [(r.forward_ct, r.verify_source, r.swa_leaked_slots, r.swa_pages_referenced) for r in found] == [
        (40, "attention", 4, 6), (40, "attention", 0, 10), (40, None, None, None)]
    assert found[0] == AUDITED
    kinds = [(type(e).__name__, e.rank, e.line_no) for e in found.entries]
    assert kinds == [("RunStartMatch", "TP0", 1), ("RunStartMatch", "TP1", 2), ("RecordMatch", "TP0", 3),
                     ("RecordMatch", "TP1", 4), ("AuditMatch", "TP1", 5), ("AuditMatch", "TP0", 6),
                     ("RecordMatch", "TP0", 7)]
    assert [e.pid for e in found.entries[:2]] == [1, 2]
    assert found.malformed == 0


def test_audit_line_ignores_keys_it_does_not_know_and_rejects_bad_values():
    later = 'otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,"swa_leaked_slots":0,"swa_future_count":3}'
    found = find_all(B.replace(verify_source="attention").line() + "\n" + later + "\n")
    assert found[0].swa_leaked_slots == 0 and found.malformed == 0
    bad = find_all(B.replace(verify_source="attention").line() + "\n"
                   + 'otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,"swa_leaked_slots":-1}\n')
    assert not bad[0].audited
    assert [(e.line_no, e.reason) for e in bad.errors] == [(2, "swa_leaked_slots=-1 is negative")]


def test_an_audit_line_without_its_record_is_an_error_with_the_reason():
    found = find_all(A.replace(verify_source="attention").line() + "\n"
                     + AUDITED.audit_line() + "\n")  # forward_ct 40 after the record of 20
    assert not found[0].audited
    assert [(e.line_no, e.reason) for e in found.errors] == [
        (2, "no record with forward_ct=40 just before this audit line")]


def test_micro_batch_rides_the_audit_line_and_is_read_back():
    plain = B.replace(verify_source="attention", micro_batch=2)
    # no audit: the audit line holds forward_ct and the micro-batch only
    assert plain.lines() == [plain.line(), 'otel_swa[verify=attention] otel_swa_audit={"forward_ct":%d,"micro_batch":2}' % B.forward_ct]
    assert plain.line() == B.replace(verify_source="attention").line()  # SGLang's line unchanged
    audited = AUDITED.replace(micro_batch=0)
    assert audited.audit_line() == (
        'otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,"micro_batch":0,"swa_leaked_slots":4,'
        '"swa_stale_tokens":0,"swa_shared_slots":1,"swa_pages_in_use":10,"swa_pages_referenced":6}'
    )
    found = find_all("\n".join(plain.lines() + audited.lines()) + "\n")
    assert list(found) == [plain, audited] and found.malformed == 0
    assert found[0].micro_batch == 2 and not found[0].audited


@pytest.mark.parametrize("value, reason", [(-1, "micro_batch=-1 is negative"), (1024, "micro_batch=1024 is above 1023"),
                                           ("1", 'micro_batch="1" is not an integer')])
def test_a_bad_micro_batch_on_the_audit_line_is_malformed_with_the_reason(value, reason):
    text = (B.replace(verify_source="attention").line() + "\n"
            + 'otel_swa[verify=attention] otel_swa_audit={"forward_ct":%d,"micro_batch":%s}\n' % (B.forward_ct, json.dumps(value)))
    found = find_all(text)
    assert found[0].micro_batch is None
    assert [(e.line_no, e.reason) for e in found.errors] == [(2, reason)]


@pytest.mark.parametrize("value", [-1, 1024, True, 1.0])
def test_a_record_refuses_a_micro_batch_outside_its_range(value):
    with pytest.raises((TypeError, ValueError), match="micro_batch"):
        B.replace(micro_batch=value)


def test_divergence_not_applicable_rides_the_audit_line():
    vllm = B.replace(verify_source="attention", divergence_applicable=False)
    assert vllm.audit_line() == (
        'otel_swa[verify=attention] otel_swa_audit={"forward_ct":%d,"divergence_applicable":false}' % B.forward_ct)
    found = find_all("\n".join(vllm.lines()) + "\n")
    assert found[0].divergence_applicable is False and found.malformed == 0
    assert found[0] == vllm
    bad = find_all(vllm.line() + "\n" + 'otel_swa[verify=attention] otel_swa_audit={"forward_ct":%d,"divergence_applicable":0}\n'
                   % B.forward_ct)
    assert bad[0].divergence_applicable is True
    assert [(e.line_no, e.reason) for e in bad.errors] == [(2, "divergence_applicable=0 is not true or false")]
