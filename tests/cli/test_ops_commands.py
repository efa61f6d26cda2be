"""otel-swa check / records / plot, run in process through the dispatcher."""

import csv
import io
import json
import os
import struct
import sys
import threading

import pytest

from otel_swa.cli import main
from otel_swa.record import SwaDivergenceRecord

R = SwaDivergenceRecord
RUN = [  # (rank, record): two data-parallel ranks, one noise line in between
    ("DP0 TP0", R(20, 1000, 400, 0, 0)),
    ("DP1 TP0", R(20, 800, 350, 0, 12)),
    ("DP0 TP0", R(40, 2100, 800, 6, 30)),
    ("DP1 TP0", R(40, 1700, 690, 3, 25)),
]


def write_log(path, items=RUN):
    lines = []
    for i, (rank, record) in enumerate(items):
        lines.append(f"[2025-06-01 12:00:{i:02d} {rank}] {record.format()}")
        if i == 1:
            lines.append("[2025-06-01 12:00:01 DP0 TP0] Decode batch. #running-req: 3")
    path.write_text("\n".join(lines) + "\n")
    return path


def set_stdin(monkeypatch, text):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))


# ------------------------------------------------------------------ check
def test_check_passes(tmp_path, capsys):
    assert main(["check", str(write_log(tmp_path / "s.log"))]) == 0
    out = capsys.readouterr().out
    assert "SWA path observed" in out and "peak swa_full_idx_divergence=6 at forward_ct=40" in out
    assert "last record (line 5):" in out


def test_check_fails_with_explanation(tmp_path, capsys):
    log = write_log(tmp_path / "s.log")
    assert main(["check", str(log), "--min-out-of-window", "31"]) == 1
    out = capsys.readouterr().out
    assert "FAILED out-of-window: peak swa_out_of_window_tokens=30 at forward_ct=40 (need >= 31)" in out
    assert main(["check", str(log), "--min-divergence", "0", "--min-out-of-window", "0", "-q"]) == 0
    assert capsys.readouterr().out == ""


def test_check_verify_lag_option(tmp_path, capsys):
    log = write_log(tmp_path / "s.log", [("TP0", R(20, 100, 40, 1, 1)), ("TP0", R(40, 200, 200, 1, 1))])
    assert main(["check", str(log)]) == 1
    assert main(["check", str(log), "--no-verify-lag"]) == 0


def test_check_stdin(monkeypatch, tmp_path, capsys):
    set_stdin(monkeypatch, write_log(tmp_path / "s.log").read_text())
    assert main(["check", "-"]) == 0
    assert "observed in standard input: 4 record(s) seen" in capsys.readouterr().out


def test_check_unusable_input(tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing.log")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["check", str(tmp_path)]) == 2  # a directory
    assert "cannot be read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["check", "x.log", "--wait", "-1"])
    assert info.value.code == 2
    assert "'-1' is not a finite number >= 0" in capsys.readouterr().err


BINARY = b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(range(256)) * 4  # an executable's start: NUL bytes


@pytest.mark.parametrize("command", [["check"], ["records"], ["plot", "-o", "x.png"]])
@pytest.mark.parametrize("content, why", [
    (b"", "is empty: no log text at all (did the engine log to another stream or file?)"),
    (b" \n\n\t\n", "is empty: no log text at all (did the engine log to another stream or file?)"),
    (BINARY, "is not a text log (a NUL byte at byte 7: a binary file, or text that is not UTF-8)"),
    (bytes(range(0x80, 0x100)) * 40 + b"\n", "is not a text log (5120 of its first 5121 bytes are not UTF-8)"),
])
def test_an_empty_file_or_one_that_is_no_text_log_is_unusable_input(tmp_path, capsys, monkeypatch, command, content, why):
    monkeypatch.chdir(tmp_path)
    _refused_from_a_file_and_stdin(tmp_path, capsys, monkeypatch, command, content, why)


def _refused_from_a_file_and_stdin(tmp_path, capsys, monkeypatch, command, content, why):
    """``command`` exits 2 with the one line saying ``why``, on a file and on standard input."""
    path = tmp_path / "in.log"
    path.write_bytes(content)
    assert main([command[0], str(path), *command[1:]]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"otel-swa: error: log file {str(path)!r} {why}\n" and captured.out == ""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(content)))
    assert main([command[0], "-", *command[1:]]) == 2
    assert capsys.readouterr().err == f"otel-swa: error: standard input {why}\n"


@pytest.mark.parametrize("command", [["check"], ["records"], ["plot", "-o", "x.png"]])
def test_a_log_with_records_and_nul_bytes_is_unusable_input_for_every_command_and_source(tmp_path, capsys,
                                                                                      monkeypatch, command):
    # a passing log (its records alone pass `check`) followed by a binary file's bytes
    text = write_log(tmp_path / "text.log").read_bytes()
    content = text + BINARY
    nul = len(text) + BINARY.index(b"\0")  # the first NUL byte, counted from the file's start
    why = f"is not a text log (a NUL byte at byte {nul}: a binary file, or text that is not UTF-8)"
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(tmp_path / "text.log")]) == 0  # the records alone pass
    capsys.readouterr()
    _refused_from_a_file_and_stdin(tmp_path, capsys, monkeypatch, command, content, why)
    # a named pipe is read once, as it comes (never opened twice to look at its start first)
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_bytes, args=(content,))
    writer.start()
    try:
        assert main([command[0], str(fifo), *command[1:]]) == 2
    finally:
        writer.join(timeout=10)
    assert not writer.is_alive()
    assert capsys.readouterr().err == f"otel-swa: error: log file {str(fifo)!r} {why}\n"


def test_check_of_a_text_log_without_records_is_a_failed_check_not_unusable_input(tmp_path, capsys):
    path = tmp_path / "server.log"
    path.write_text("[2025-06-01 12:00:00 TP0] Decode batch. #running-req: 3\n" + "caf\u00e9 \xff\n")
    assert main(["check", str(path)]) == 1
    assert "no 'kv_canary_swa_divergence=' record found" in capsys.readouterr().out


def test_check_waits_for_growing_file(tmp_path, capsys):
    log = tmp_path / "s.log"
    log.write_text(f"[2025-06-01 12:00:00 TP0] {R(20, 100, 100, 0, 0).format()}\n")

    def append():
        with open(log, "a") as f:
            f.write(f"[2025-06-01 12:00:01 TP0] {R(40, 300, 120, 2, 5).format()}\n")

    timer = threading.Timer(0.3, append)
    timer.start()
    try:
        rc = main(["check", str(log), "--wait", "30", "--poll", "0.05"])
    finally:
        timer.join()
    assert rc == 0
    assert "2 record(s) seen" in capsys.readouterr().out


# ------------------------------------------------------------------ records
def test_records_of_a_log_whose_records_are_all_malformed_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.log"
    path.write_text('[2025-06-01 12:00:00 TP0] kv_canary_swa_divergence={"forward_ct":20,"verify_full":1}\n')
    assert main(["records", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "otel-swa: 1 malformed line(s) skipped",
        "otel-swa:   line 1: missing field(s) verify_swa, swa_full_idx_divergence",
        f"otel-swa: error: no valid record in log file {str(path)!r}: its 1 record line(s) are all malformed",
    ]
    # one good record beside it: the good one is printed, the bad one counted, exit 0
    path.write_text(path.read_text() + f"[2025-06-01 12:00:01 TP0] {R(20, 100, 40, 1, 1).format()}\n")
    assert main(["records", str(path)]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["line_no"] for line in captured.out.splitlines()] == [2]
    assert "1 malformed line(s) skipped" in captured.err
    # a text log without any record: nothing to print, and no error
    path.write_text("[2025-06-01 12:00:00 TP0] Decode batch.\n")
    assert main(["records", str(path)]) == 0
    assert capsys.readouterr() == ("", "")


def test_records_jsonl(tmp_path, capsys):
    assert main(["records", str(write_log(tmp_path / "s.log"))]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == {"line_no": 1, "timestamp": "2025-06-01 12:00:00", "rank": "DP0 TP0", "run": 1,
                       "verify_source": None, "forward_ct": 20, "verify_full": 1000, "verify_swa": 400,
                       "swa_full_idx_divergence": 0, "swa_out_of_window_tokens": 0, "swa_leaked_slots": None,
                       "swa_stale_tokens": None, "swa_shared_slots": None, "swa_pages_in_use": None,
                       "swa_pages_referenced": None, "swa_premature_evictions": None,
                       "swa_late_held_slots": None, "swa_read_checks": None, "swa_read_mismatches": None,
                       "swa_read_unchecked": None, "kv_leaked_blocks": None, "kv_freed_blocks_in_use": None,
                       "kv_shared_blocks": None, "micro_batch": None, "offenders": None, "kv_write_checks": None,
                       "kv_write_mismatches": None, "kv_write_unchecked": None, "kv_stamp_checks": None,
                       "kv_foreign_tokens": None, "kv_stamp_unchecked": None, "kv_checksum_checks": None,
                       "kv_corrupt_tokens": None, "kv_cache_entries_checked": None, "kv_stale_cache_entries": None,
                       "kv_foreign_blocks": None}
    assert [(r["line_no"], r["rank"], r["forward_ct"], r["swa_out_of_window_tokens"]) for r in rows] == [
        (1, "DP0 TP0", 20, 0), (2, "DP1 TP0", 20, 12), (4, "DP0 TP0", 40, 30), (5, "DP1 TP0", 40, 25)]


def test_records_csv_from_stdin_plain_logging(monkeypatch, capsys):
    text = (f"2025-06-01 12:34:56,789 INFO {R(20, 10, 4, 1, 2).format()}\n"
            "kv_canary_swa_divergence={bad\n"
            f"{R(40, 20, 8, 3, 4).format()}\n")
    set_stdin(monkeypatch, text)
    assert main(["records", "-", "--format", "csv"]) == 0
    captured = capsys.readouterr()
    assert list(csv.reader(io.StringIO(captured.out))) == [
        ["line_no", "timestamp", "rank", "run", "verify_source", "forward_ct", "verify_full", "verify_swa",
         "swa_full_idx_divergence", "swa_out_of_window_tokens", "swa_leaked_slots", "swa_stale_tokens",
         "swa_shared_slots", "swa_pages_in_use", "swa_pages_referenced", "swa_premature_evictions",
         "swa_late_held_slots", "swa_read_checks", "swa_read_mismatches", "swa_read_unchecked", "kv_leaked_blocks",
         "kv_freed_blocks_in_use", "kv_shared_blocks", "micro_batch", "offenders", "kv_write_checks",
         "kv_write_mismatches", "kv_write_unchecked", "kv_stamp_checks", "kv_foreign_tokens", "kv_stamp_unchecked",
         "kv_checksum_checks", "kv_corrupt_tokens", "kv_cache_entries_checked", "kv_stale_cache_entries",
         "kv_foreign_blocks"],
        ["1", "2025-06-01 12:34:56,789", "", "1", "", "20", "10", "4", "1", "2"] + [""] * 26,
        ["3", "", "", "1", "", "40", "20", "8", "3", "4"] + [""] * 26,
    ]
    assert captured.err.splitlines() == [
        "otel-swa: 1 malformed line(s) skipped",
        "otel-swa:   line 2: the text after the prefix is not JSON (Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1))",
    ]


def test_records_missing_file(tmp_path, capsys):
    assert main(["records", str(tmp_path / "nope.log")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------ plot
def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_one_row_per_rank(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run.png"
    assert main(["plot", str(write_log(tmp_path / "s.log")), "-o", str(out)]) == 0
    assert "4 records, 2 panel row(s)" in capsys.readouterr().out
    # figure: 12 in wide, 1.2 + 2.9 in per rank row, at 110 dpi; matplotlib
    # releases differ in rounding the pixel height (4.1 in x 110 dpi = 451.00000000000006:
    # 3.8 truncates it, later ones round), so the height is taken within one pixel
    width, height = png_size(out)
    assert width == 1320 and abs(height - (1.2 + 2 * 2.9) * 110) < 1
    single = tmp_path / "one.png"
    assert main(["plot", str(write_log(tmp_path / "t.log", [("TP0", r) for _, r in RUN[::2]])), "-o", str(single)]) == 0
    width, height = png_size(single)
    assert width == 1320 and abs(height - (1.2 + 2.9) * 110) < 1


def test_plot_without_records_or_matplotlib(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    assert main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 2
    assert "nothing to plot" in capsys.readouterr().err
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # makes the import raise ImportError
    assert main(["plot", str(write_log(tmp_path / "s.log")), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install 'otel-swa[plot]'" in err
    assert not (tmp_path / "x.png").exists()


def test_records_write_int64_values_exactly(tmp_path, capsys):
    big = 2**63 - 1  # above 2**53: JavaScript viewers and jq 1.6 round it; jsonl and csv keep it
    log = tmp_path / "big.log"
    log.write_text(R(20, big, big - 1, 3, 5).format() + "\n")
    assert main(["records", str(log)]) == 0
    line = capsys.readouterr().out.strip()
    assert '"verify_full":9223372036854775807,"verify_swa":9223372036854775806' in line
    assert main(["records", str(log), "--format", "csv"]) == 0
    assert "9223372036854775807,9223372036854775806" in capsys.readouterr().out
