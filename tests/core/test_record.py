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
        'kv_canary_swa_divergence={"swa_out_of_window_tokens":311,"forward_ct":40,"verify_swa":2048,"verify_full":5120,"swa_full_idx_divergence":17,"new_key":[1,2]} trailing words',
    ],
)
def test_parse_real_log_lines(line):
    assert SwaDivergenceRecord.parse(line) == R


@pytest.mark.parametrize(
    "line, reason",
    [
        ("kv_canary_swa_divergence={not json}", "not JSON"),
        ("kv_canary_swa_divergence=", "not JSON"),
        ('kv_canary_swa_divergence=[1,2,3]', "JSON object"),
        ('kv_canary_swa_divergence={"forward_ct":1,"verify_full":2}', "missing field"),
        ('kv_canary_swa_divergence={"forward_ct":1,"verify_full":2,"verify_swa":1,"swa_full_idx_divergence":"3","swa_out_of_window_tokens":0}', "must be an int"),
        ('kv_canary_swa_divergence={"forward_ct":1.5,"verify_full":2,"verify_swa":1,"swa_full_idx_divergence":3,"swa_out_of_window_tokens":0}', "must be an int"),
        ('kv_canary_swa_divergence={"forward_ct":true,"verify_full":2,"verify_swa":1,"swa_full_idx_divergence":3,"swa_out_of_window_tokens":0}', "must be an int"),
        ('kv_canary_swa_divergence={"forward_ct":-1,"verify_full":2,"verify_swa":1,"swa_full_idx_divergence":3,"swa_out_of_window_tokens":0}', ">= 0"),
        ("no record here", "no 'kv_canary_swa_divergence=' prefix"),
    ],
)
def test_parse_malformed_raises_clear_error(line, reason):
    with pytest.raises(MalformedRecordError) as info:
        SwaDivergenceRecord.parse(line)
    assert reason in str(info.value)


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


@pytest.mark.parametrize("bad", [-1, 1.0, "1", True, None])
def test_constructor_refuses_non_int(bad):
    with pytest.raises((TypeError, ValueError)) as info:
        SwaDivergenceRecord(bad, 0, 0, 0, 0)
    assert "forward_ct" in str(info.value)


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
    assert [m.line_no for m in found.matches] == [1, 2]


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
