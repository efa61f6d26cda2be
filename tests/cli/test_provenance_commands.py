"""``otel-swa check`` and ``otel-swa records`` on logs with provenance lines: a provenance fault
fails the check naming its first offender, a clean run passes and says so, the records carry the
provenance columns."""

from __future__ import annotations

import csv
import io
import json

from otel_swa.cli import main
from otel_swa.record import Offender, SwaDivergenceRecord

PREFIX = "[2026-01-01 00:00:00 TP0] "
AUDIT = dict(swa_leaked_slots=0, swa_stale_tokens=0, swa_shared_slots=0)


def _record(ct: int, foreign: int = 0, offenders=()) -> SwaDivergenceRecord:
    return SwaDivergenceRecord(ct, 100 * ct, 40 * ct, 3, 7, verify_source="attention", kv_write_checks=16,
                               kv_write_mismatches=0, kv_write_unchecked=0, kv_stamp_checks=10 * ct,
                               kv_foreign_tokens=foreign, kv_stamp_unchecked=2, offenders=tuple(offenders), **AUDIT)


def _log(path, records):
    path.write_text("".join(PREFIX + line + "\n" for record in records for line in record.lines()))
    return path


def test_check_fails_a_foreign_token_and_names_its_first_offender(tmp_path, capsys):
    first = Offender("kv_foreign_tokens", request="r7", row=3, position=17, swa_slot=12, pool="swa", expected_token=42,
                     expected_position=17, found_token=99, found_position=17, other_request="r9")
    later = Offender("kv_foreign_tokens", request="r2", position=5, pool="full", expected_token=8)
    log = _log(tmp_path / "run.log", [_record(20), _record(40, 2, [first]), _record(60, 6, [later])])
    assert main(["check", str(log)]) == 1
    out = capsys.readouterr().out
    # lines: 3 a record (record, audit, provenance; the faulty ones a fault line more)
    assert ("FAILED provenance: 6 live token slot(s) hold another token's KV (their provenance stamp is not the "
            "request's own: swapped ownership, a stale prefix reuse, a slot overwritten, a wrong position): peak "
            "kv_foreign_tokens=6 at forward_ct=60 (line 8), first non-zero at forward_ct=40 (line 4): request r7 "
            "(row 3), position 17, SWA slot 12, SWA pool, expected token 42 at position 17, found token 99 at "
            "position 17, KV of request r9 (in 3 provenance-checked record(s) from TP0; each must stay 0)") in out, out
    assert "ok     SWA slot audit" in out
    assert main(["check", str(log), "--no-audit"]) == 0
    assert "skip   provenance: not required" in capsys.readouterr().out


def test_check_passes_a_clean_run_and_shows_the_unchecked_counts(tmp_path, capsys):
    log = _log(tmp_path / "run.log", [_record(20), _record(40)])
    assert main(["check", str(log)]) == 0
    out = capsys.readouterr().out
    assert ("ok     provenance: the KV in the slots is the tokens' own in 2 checked record(s) "
            "(kv_write_mismatches=0, kv_foreign_tokens=0 throughout)") in out, out
    assert ("info   unchecked stamps: peak kv_stamp_unchecked=2 at forward_ct=20 (live token slots whose provenance "
            "stamp was not judged (token ids unknown, over the per-sample budget; never stamped, for an engine wired "
            "after it held KV); reported, not "
            "judged)") in out, out


def test_records_have_the_provenance_columns(tmp_path, capsys):
    log = _log(tmp_path / "run.log", [_record(20), SwaDivergenceRecord(40, 4000, 1600, 3, 7, verify_source="attention")])
    assert main(["records", str(log)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["kv_stamp_checks"], row["kv_foreign_tokens"], row["kv_corrupt_tokens"]) for row in rows] == [
        (200, 0, None), (None, None, None)]
    assert list(rows[0])[-11:] == ["kv_write_checks", "kv_write_mismatches", "kv_write_unchecked", "kv_stamp_checks",
                                   "kv_foreign_tokens", "kv_stamp_unchecked", "kv_checksum_checks",
                                   "kv_corrupt_tokens", "kv_cache_entries_checked", "kv_stale_cache_entries",
                                   "kv_foreign_blocks"]
    assert main(["records", str(log), "--format", "csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(row["kv_write_checks"], row["kv_foreign_blocks"]) for row in table] == [("16", ""), ("", "")]
