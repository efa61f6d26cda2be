"""The Azure LLM inference trace loader: packaged files and bad input."""

import csv
from pathlib import Path

import pytest

from otel_swa.reference.trace import TraceFormatError, TraceRequest, load_trace

DATA = Path(__file__).resolve().parents[2] / "otel_swa" / "reference" / "data"


def _csv_rows(name):
    with open(DATA / name, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    "source, name",
    [("conv", "AzureLLMInferenceTrace_conv.csv"), ("code", "AzureLLMInferenceTrace_code.csv")],
)
def test_packaged_trace_matches_a_plain_csv_read(source, name):
    rows = _csv_rows(name)
    requests = load_trace(source)
    assert len(requests) == len(rows)
    assert [r.context_tokens for r in requests] == [int(row["ContextTokens"]) for row in rows]
    assert [r.generated_tokens for r in requests] == [int(row["GeneratedTokens"]) for row in rows]
    assert requests[0].arrival_s == 0.0


def test_packaged_counts_and_first_requests():
    conv = load_trace("conv")
    code = load_trace("code")
    assert (len(conv), len(code)) == (19366, 8819)
    # first two lines of the conversation file: 18:15:46.6805900,374,44 and 18:15:50.9951690,396,109
    assert conv[0] == TraceRequest(0.0, 374, 44)
    assert conv[1].context_tokens == 396 and conv[1].generated_tokens == 109
    assert conv[1].arrival_s == pytest.approx(4.314579, abs=1e-9)


def test_limit_takes_the_first_requests():
    assert load_trace("code", limit=3) == load_trace("code")[:3]
    with pytest.raises(ValueError, match="limit=0"):
        load_trace("code", limit=0)


def test_user_file_with_seven_digit_fractions_and_midnight(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        "2023-11-16 23:59:59.9000000,10,0\r\n"
        "2023-11-17 00:00:01.0000001,0,5\r\n"
        "\r\n"
        "2023-11-17 00:00:02,7,1\r\n"
    )
    requests = load_trace(path)
    assert [(r.context_tokens, r.generated_tokens) for r in requests] == [(10, 0), (0, 5), (7, 1)]
    assert requests[1].arrival_s == pytest.approx(1.1000001, abs=1e-9)
    assert requests[2].arrival_s == pytest.approx(2.1, abs=1e-9)


GOOD_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
GOOD_LINE = "2023-11-16 18:15:46.6805900,374,44\n"


@pytest.mark.parametrize(
    "text, line_no, value",
    [
        (GOOD_HEADER + GOOD_LINE + "2023-11-16 18:15:47.0000000,12x,44\n", 3, "'12x'"),
        (GOOD_HEADER + GOOD_LINE + "2023-11-16 18:15:47.0000000,12,-4\n", 3, "'-4'"),
        (GOOD_HEADER + "2023-13-16 18:15:46.6805900,374,44\n", 2, "'2023-13-16 18:15:46.6805900'"),
        (GOOD_HEADER + "2023-11-16T18:15:46,374,44\n", 2, "'2023-11-16T18:15:46'"),
        (GOOD_HEADER + "2023-11-16 18:15:46.,374,44\n", 2, "'2023-11-16 18:15:46.'"),
        (GOOD_HEADER + GOOD_LINE + GOOD_LINE + "2023-11-16 18:15:45.0000000,1,1\n", 4, "18:15:45"),
        (GOOD_HEADER + GOOD_LINE + "2023-11-16 18:15:47.0000000,12\n", 3, "got 2"),
        ("time,context,generated\n" + GOOD_LINE, 1, "'time,context,generated'"),
        ("TIMESTAMP,GeneratedTokens,ContextTokens\n" + GOOD_LINE, 1, "TIMESTAMP,GeneratedTokens,ContextTokens"),
        ("", 0, "empty file"),
        ("\n\n", 0, "empty file"),
    ],
)
def test_bad_file_names_file_line_and_value(tmp_path, text, line_no, value):
    path = tmp_path / "bad_trace.csv"
    path.write_text(text)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line_no}: ")
    assert value in message
    assert info.value.line_no == line_no
    assert info.value.file == str(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        load_trace(tmp_path / "nope.csv")


def test_a_trace_that_is_not_utf8_names_the_file(tmp_path):
    from otel_swa.reference.trace import TraceFormatError, load_trace

    path = tmp_path / "latin1.csv"
    path.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n\xe9\n")
    with pytest.raises(TraceFormatError, match=r"latin1.csv:3: the line is not UTF-8 text \(invalid continuation byte at byte 1 "):
        load_trace(path)


def test_a_byte_that_is_not_utf8_past_the_decoders_first_chunk_is_found_at_its_line(tmp_path):
    from otel_swa.reference.trace import TraceFormatError, load_trace

    path = tmp_path / "late.csv"
    rows = [f"2023-11-16 18:15:{i % 60:02d}.0000000,{i},1" for i in range(600)]  # ~21 KB before the bad byte
    rows.sort()
    path.write_bytes(("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n").encode()
                     + b"2023-11-16 18:16:00.0000000,7\xff,1\n")
    with pytest.raises(TraceFormatError, match=r"late.csv:602: the line is not UTF-8 text \(invalid start byte at byte 30 "):
        load_trace(path)
