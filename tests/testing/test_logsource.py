"""Log prefixes, records with their line numbers, and the follower of a growing log file."""

from otel_swa.logsource import LogFollower, LogPrefix, group_by_rank, logged_records, parse_log_prefix
from otel_swa.record import SwaDivergenceRecord

LINE = 'kv_canary_swa_divergence={"forward_ct":%d,"verify_full":%d,"verify_swa":%d,"swa_full_idx_divergence":%d,"swa_out_of_window_tokens":%d}'


def rec(ct, full=100, swa=40, div=3, oow=7):
    return SwaDivergenceRecord(ct, full, swa, div, oow)


def test_sglang_prefixes():
    assert parse_log_prefix("[2025-06-01 12:34:56 TP0] ") == LogPrefix("2025-06-01 12:34:56", "TP0")
    assert parse_log_prefix("[2025-06-01 12:34:56 DP1 TP0] ") == LogPrefix("2025-06-01 12:34:56", "DP1 TP0")
    assert parse_log_prefix("[2025-06-01 12:34:56 DP1 PP1 TP3 EP3] ") == LogPrefix("2025-06-01 12:34:56", "DP1 PP1 TP3 EP3")
    # newer SGLang: no year; single-GPU servers: no rank at all
    assert parse_log_prefix("[06-01 12:34:56 PP1 TP0] ") == LogPrefix("06-01 12:34:56", "PP1 TP0")
    assert parse_log_prefix("[2025-06-01 12:34:56] ") == LogPrefix("2025-06-01 12:34:56", None)
    assert parse_log_prefix("[2025-06-01 12:34:56.123 ATTN_CP1 TP2] ") == LogPrefix("2025-06-01 12:34:56.123", "ATTN_CP1 TP2")
    # coloured handler
    assert parse_log_prefix("\x1b[32m[2025-06-01 12:34:56 TP0]\x1b[0m ") == LogPrefix("2025-06-01 12:34:56", "TP0")


def test_plain_logging_and_unknown_prefixes():
    assert parse_log_prefix("2025-06-01 12:34:56,789 INFO ") == LogPrefix("2025-06-01 12:34:56,789", None)
    assert parse_log_prefix("INFO:root:") == LogPrefix(None, None)
    assert parse_log_prefix("") == LogPrefix(None, None)


def test_logged_records_keep_line_timestamp_rank():
    text = "\n".join(
        [
            "[2025-06-01 12:00:01 TP0] Load weight end.",
            "[2025-06-01 12:00:20 DP0 TP0] " + LINE % (20, 500, 200, 0, 0),
            "[2025-06-01 12:00:20 DP1 TP0] " + LINE % (20, 300, 150, 2, 9),
            "2025-06-01 12:00:40,017 INFO " + LINE % (40, 900, 300, 4, 11) + "\r",
            "noise kv_canary_swa_divergence={broken",
            LINE % (60, 1000, 400, 5, 12),
        ]
    )
    errors = []
    found = logged_records(text, errors=errors)
    assert [(f.line_no, f.timestamp, f.rank, f.record.forward_ct) for f in found] == [
        (2, "2025-06-01 12:00:20", "DP0 TP0", 20),
        (3, "2025-06-01 12:00:20", "DP1 TP0", 20),
        (4, "2025-06-01 12:00:40,017", None, 40),
        (6, None, None, 60),
    ]
    assert found[1].record == SwaDivergenceRecord(20, 300, 150, 2, 9)
    assert len(errors) == 1
    assert found[1].to_row(run=1) == {
        "line_no": 3, "timestamp": "2025-06-01 12:00:20", "rank": "DP1 TP0", "run": 1, "verify_source": None,
        "forward_ct": 20, "verify_full": 300, "verify_swa": 150, "swa_full_idx_divergence": 2,
        "swa_out_of_window_tokens": 9, "swa_leaked_slots": None, "swa_stale_tokens": None, "swa_shared_slots": None,
        "swa_pages_in_use": None, "swa_pages_referenced": None, "swa_premature_evictions": None,
        "swa_late_held_slots": None, "swa_read_checks": None, "swa_read_mismatches": None, "swa_read_unchecked": None,
        "kv_leaked_blocks": None, "kv_freed_blocks_in_use": None, "kv_shared_blocks": None, "micro_batch": None,
        "offenders": None, "kv_write_checks": None, "kv_write_mismatches": None, "kv_write_unchecked": None,
        "kv_stamp_checks": None, "kv_foreign_tokens": None, "kv_stamp_unchecked": None, "kv_checksum_checks": None,
        "kv_corrupt_tokens": None, "kv_cache_entries_checked": None, "kv_stale_cache_entries": None,
        "kv_foreign_blocks": None,
    }
    groups = group_by_rank(found)
    assert list(groups) == ["DP0 TP0", "DP1 TP0", None]
    assert [r.forward_ct for r in groups[None]] == [40, 60]


def test_follower_reads_only_complete_lines_and_counts_lines(tmp_path):
    path = tmp_path / "server.log"
    follower = LogFollower(path)
    assert follower.poll() == [] and follower.missing
    full = "[2025-06-01 12:00:20 TP0] " + LINE % (20, 10, 5, 1, 1) + "\n"
    with open(path, "w") as f:
        f.write("starting\n" + full[:40])  # the writer is mid-line
    assert follower.poll() == [] and not follower.missing
    with open(path, "a") as f:
        f.write(full[40:] + "other line\n" + LINE % (40, 20, 9, 2, 3))
    new = follower.poll()
    assert [(n.line_no, n.record.forward_ct, n.rank) for n in new] == [(2, 20, "TP0")]
    assert follower.malformed == 0  # the half-written line was never parsed on its own
    last = follower.poll(final=True)  # unterminated last line counts at the end
    assert [(n.line_no, n.record.forward_ct) for n in last] == [(4, 40)]
    assert [r.record.forward_ct for r in follower.records] == [20, 40]


def test_follower_restarts_after_truncation(tmp_path):
    path = tmp_path / "server.log"
    path.write_text(LINE % (20, 10, 5, 1, 1) + "\n" + LINE % (40, 20, 9, 1, 1) + "\n")
    follower = LogFollower(path)
    assert len(follower.poll()) == 2
    path.write_text(LINE % (60, 30, 12, 1, 1) + "\n")  # rotated by copy-and-truncate
    assert [(n.line_no, n.record.forward_ct) for n in follower.poll()] == [(1, 60)]


def test_follower_reports_unreadable_path(tmp_path):
    follower = LogFollower(tmp_path)  # a directory
    assert follower.poll() == []
    assert follower.error is not None and not follower.missing


def test_bare_carriage_returns_end_lines_for_numbers_and_prefixes():
    # a progress bar redrawn with bare CR, then a record: CR ends a line for the record finder (the
    # prefix after it is the record's), not for the numbers, which are grep -n's (LF line ends)
    text = "p 10%\rp 20%\n[2025-06-01 12:34:56 TP3] " + LINE % (20, 10, 5, 1, 1) + "\n"
    text += "\x1b[32m[2025-06-01 12:35:10 TP3]\x1b[0m x\r\n" + "[2025-06-01 12:35:11 TP1] " + LINE % (40, 20, 9, 2, 3)
    found = logged_records(text)
    assert [(f.line_no, f.timestamp, f.rank, f.record.forward_ct) for f in found] == [
        (2, "2025-06-01 12:34:56", "TP3", 20),
        (4, "2025-06-01 12:35:11", "TP1", 40),
    ]
    lf_lines = text.split("\n")  # what grep -n and an editor number
    assert LINE % (20, 10, 5, 1, 1) in lf_lines[2 - 1] and LINE % (40, 20, 9, 2, 3) in lf_lines[4 - 1]


def test_follower_numbers_lines_as_grep_does_across_bare_carriage_returns(tmp_path):
    path = tmp_path / "server.log"
    follower = LogFollower(path)
    with open(path, "w", newline="") as f:
        f.write("load 1/3\rload 2/3\rload 3/3\nready\r\n")  # two LF line ends: lines 1 and 2
    assert follower.poll() == []
    with open(path, "a", newline="") as f:
        f.write("[2025-06-01 12:00:20 TP0] " + LINE % (20, 10, 5, 1, 1) + "\n")
    assert [(n.line_no, n.rank) for n in follower.poll()] == [(3, "TP0")]


def test_follower_final_read_ending_in_cr_then_lf(tmp_path):
    # a final read that stops between the CR and the LF of one CRLF counts that line end once
    path = tmp_path / "server.log"
    follower = LogFollower(path)
    path.write_bytes(b"one\r")
    assert follower.poll(final=True) == []
    with open(path, "ab") as f:
        f.write(b"\n" + (LINE % (20, 10, 5, 1, 1)).encode() + b"\n")
    assert [n.line_no for n in follower.poll()] == [2]


def test_follower_attaches_an_audit_line_read_in_a_later_poll(tmp_path):
    from otel_swa.logsource import LoggedRunStart
    from otel_swa.record import run_start_line

    record = SwaDivergenceRecord(20, 10, 5, 1, 1, verify_source="attention", swa_leaked_slots=2, swa_stale_tokens=0,
                                 swa_shared_slots=0)
    path = tmp_path / "server.log"
    follower = LogFollower(path)
    path.write_text("[2025-06-01 12:00:20 TP0] " + run_start_line("attention", pid=9) + "\n"
                    + "[2025-06-01 12:00:20 TP0] " + record.line() + "\n")
    assert [n.record.audited for n in follower.poll()] == [False]
    with open(path, "a") as f:
        f.write("[2025-06-01 12:00:20 TP0] " + record.audit_line() + "\n")
    assert follower.poll() == []  # no new record; the one read before now carries its audit
    assert [r.record for r in follower.records] == [record]
    assert follower.entries[0] == LoggedRunStart(1, "2025-06-01 12:00:20", "TP0", "attention", 9)
    assert follower.malformed == 0

