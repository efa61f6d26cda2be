"""Whole lines read in one step (:mod:`otel_swa.record.whole_lines`) give what the general rules give:
the same entries, records, errors and duplicates, on the golden logs and on logs built from every
kind of line, whole or not, valid or not (the general rules alone are what the readers did before
the one-step reading existed: the parser's whole-line matcher and group reader switched off)."""

import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import otel_swa.record.parser as parser
from otel_swa.logsource import LogFollower, LoggedRecord, logged_entries
from otel_swa.record import RecordGroup, RecordMatch, find_all, iter_entries

GOLDEN = sorted((Path(__file__).resolve().parent.parent / "golden" / "data").glob("*.log"))


def general_rules(monkeypatch):
    """The parser without its one-step readers (whole lines, groups, the lines skipped on the way
    to an entry): every line read by the general rules."""
    monkeypatch.setattr(parser, "WHOLE_LINE_RE", None)


def read(text, chunk=None, tmp_path=None):
    """What every reader makes of ``text``: the entries one by one, the records with their lines,
    a log's entries with line numbers, errors and duplicates, and (``chunk``) the same read from a
    file in chunks of that many bytes."""
    errors = []
    logged = logged_entries(text, errors=errors)
    found = find_all(text)
    out = {
        "entries": list(iter_entries(text)),
        "found": (list(found), found.entries, [(e.line_no, e.prefix, e.reason, e.text) for e in found.errors]),
        "logged": (logged, [(e.line_no, e.prefix, e.reason, e.text) for e in errors]),
    }
    grouped = []  # the lines as read with groups, the records without their values (which carry the lines')
    for item in iter_entries(text, groups=True):
        entry, lines = (item.entry, item.lines) if type(item) is RecordGroup else (item, ())
        grouped += [entry._replace(value=None) if type(entry) is RecordMatch else entry, *lines]
    out["grouped"] = grouped
    if chunk is not None:
        path = tmp_path / "run.log"
        path.write_bytes(text.encode())
        follower = LogFollower(path)
        follower.poll(final=True, chunk_bytes=chunk)
        out["followed"] = (follower.entries, [(e.line_no, e.reason) for e in follower.errors],
                           follower.duplicates.count, follower.duplicates.first_line_no, follower.cut_line)
    return out


def in_order(value):
    """``value`` with each dict in it as its items in order (a line's fields keep the order read)."""
    if isinstance(value, dict):
        return [(key, in_order(item)) for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return type(value)(in_order(item) for item in value) if not hasattr(value, "_fields") \
            else type(value)(*(in_order(item) for item in value))
    return value


def both(monkeypatch, text, **kwargs):
    fast = read(text, **kwargs)
    with monkeypatch.context() as patched:
        general_rules(patched)
        general = read(text, **kwargs)
    return ({key: in_order(value) for key, value in fast.items()},
            {key: in_order(value) for key, value in general.items()})


def golden_text(path):
    return path.read_text().replace("<time>", "2026-12-07 10:00:00").replace("<pid>", "4242")


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_the_golden_logs_read_the_same_and_mostly_in_one_step(monkeypatch, path, tmp_path):
    text = golden_text(path)
    fast, general = both(monkeypatch, text, chunk=4096, tmp_path=tmp_path)
    assert fast == general
    # the groups were read in one step: every record of the log but those its fault lines follow
    grouped = [item for item in iter_entries(text, groups=True) if type(item) is RecordGroup]
    records = [entry for entry in fast["logged"][0] if isinstance(entry, LoggedRecord)]
    assert records and len(grouped) >= len(records) - text.count("otel_swa_fault=")


def test_a_group_carries_its_lines_fields_as_pairing_them_would(monkeypatch):
    head = "[2026-12-07 10:00:00 PP1 TP2] otel_swa[verify=attention] "
    text = (head + 'kv_canary_swa_divergence={"forward_ct":5,"verify_full":14,"verify_swa":4,'
            '"swa_full_idx_divergence":-2,"swa_out_of_window_tokens":3}\n'
            + head + 'otel_swa_audit={"forward_ct":5,"micro_batch":1,"swa_leaked_slots":2,"swa_pages_in_use":7}\n'
            + head + 'otel_swa_provenance={"forward_ct":5,"micro_batch":3,"kv_write_checks":16,'
            '"kv_corrupt_tokens":1}\n')
    (group,) = iter_entries(text, groups=True)
    assert type(group) is RecordGroup and [type(line).__name__ for line in group.lines] == ["AuditMatch",
                                                                                           "ProvenanceMatch"]
    record = group.entry.record
    # the values written above, each where its line puts it; the provenance line's micro-batch is
    # not the record's (its audit line named one), the audit fields not written are unmeasured
    assert (record.forward_ct, record.verify_full, record.verify_swa, record.swa_full_idx_divergence,
            record.swa_out_of_window_tokens) == (5, 14, 4, -2, 3)
    assert (record.micro_batch, record.swa_leaked_slots, record.swa_pages_in_use, record.swa_stale_tokens) == (
        1, 2, 7, None)
    assert (record.kv_write_checks, record.kv_corrupt_tokens, record.kv_stamp_checks) == (16, 1, None)
    assert record.verify_source == "attention" and group.entry.rank == "PP1 TP2"
    assert [line.line_no for line in group.lines] == [2, 3] and group.entry.line_no == 1
    fast, general = both(monkeypatch, text)
    assert fast == general


def test_a_log_prefix_waiting_before_a_line_of_another_shape_is_read_as_the_general_rules_read_it(monkeypatch):
    # TP1's prefix is followed, up to the next prefix, by the plain-logging line's own text: it is
    # another log line's prefix, no message's, so the record names no rank (read line by line, the
    # prefix would seem to wait for a message)
    record = ('kv_canary_swa_divergence={"forward_ct":4,"verify_full":104,"verify_swa":44,'
              '"swa_full_idx_divergence":0,"swa_out_of_window_tokens":0}')
    text = ("[2026-12-07 10:00:01 TP0] otel_swa[verify=attention] " + record + "\n[12-07 10:00:01 TP1] \r\n"
            + "2026-12-07 10:00:00,123 INFO " + record + "\n")
    fast, general = both(monkeypatch, text)
    assert fast == general
    assert [entry.rank for entry in iter_entries(text)] == ["TP0", None]


# --- logs of every kind of line, whole or not, valid or not ---------------------------------------

TIMES = ("2026-12-07 10:00:00", "2026-12-07 10:00:01", "12-07 10:00:01", "10:00:02")
RANKS = ("", " TP0", " TP1", " DP1 TP0")
TAGS = ("attention", "kv_canary", "attention", "kv_canary", "other")


def _record(ct, rng):
    return {"forward_ct": ct, "verify_full": 100 + ct, "verify_swa": 40 + ct,
            "swa_full_idx_divergence": rng.choice([0, 3, -1]), "swa_out_of_window_tokens": rng.choice([0, 5])}


def _audit(ct, rng):
    fields = {"forward_ct": ct}
    if rng.random() < 0.3:
        fields["micro_batch"] = rng.choice([0, 2, 1023, 1024])
    for name in ("swa_leaked_slots", "swa_stale_tokens", "swa_pages_in_use", "swa_read_checks"):
        if rng.random() < 0.8:
            fields[name] = rng.choice([0, 1, 7])
    return fields


def _provenance(ct, rng):
    fields = {"forward_ct": ct}
    if rng.random() < 0.3:
        fields["micro_batch"] = rng.choice([0, 5])
    for name in ("kv_write_checks", "kv_write_mismatches", "kv_stamp_checks", "kv_corrupt_tokens"):
        if rng.random() < 0.8:
            fields[name] = rng.choice([0, 2, 9])
    return fields


def _spoil(payload, rng):
    """The object written in a way the one-step reader leaves to the general rules, or not valid."""
    how = rng.randrange(9)
    if how == 0:
        return payload.replace(":", ": ", 1)  # spaces: SGLang's rule reads to the first one
    if how == 1:
        return re.sub(r":(\d)", r":0\1", payload, count=1)  # a leading zero: not JSON
    if how == 2:
        return payload.replace('"forward_ct"', '"unknown_key":1,"forward_ct"')
    if how == 3:
        return payload[:-1] + ',"forward_ct":999}'  # a repeated key: JSON keeps the last
    if how == 4:
        return payload[:-1]  # cut
    if how == 5:
        return payload + "glued"
    if how == 6:
        return re.sub(r":(\d+)", r":-\1", payload, count=2)  # negative counts
    if how == 7:
        return payload.replace("{", '{"divergence_applicable":false,', 1)
    return re.sub(r":(\d+)", ":" + "9" * 19, payload, count=1)  # past int64


@st.composite
def logs(draw):
    rng = random.Random(draw(st.integers(0, 2**32)))  # even odds (hypothesis's own leans to the rare branches)
    lines = []
    ct = 0
    for _ in range(draw(st.integers(1, 25))):
        ct += rng.choice([1, 1, 1, 0, -3])
        head = f"[{rng.choice(TIMES)}{rng.choice(RANKS)}] otel_swa[verify={rng.choice(TAGS)}] "
        if rng.random() < 0.1:
            head = rng.choice(["", "2026-12-07 10:00:00,123 INFO ", "\x1b[32m" + head + "\x1b[0m", head[:-1],
                               head.split("otel_swa[")[0]])  # ... SGLang's own line (no tag)
        kind = rng.random()
        if kind < 0.06:
            lines.append(head + 'otel_swa_run_start={"pid":%d}' % rng.randrange(9))
            continue
        if kind < 0.1:
            lines.append(f"[{rng.choice(TIMES)} TP0] Decode batch. #running-req: 1")
            continue
        if kind < 0.13:  # a log prefix whose message comes later (claimed by the next message)
            lines.append(f"[{rng.choice(TIMES)} TP1] " + rng.choice(["", "otel_swa[verify=attention] "]))
            continue
        objects = [("kv_canary_swa_divergence=", _record(ct, rng))]
        if rng.random() < 0.8:
            objects.append(("otel_swa_audit=", _audit(ct + (rng.random() < 0.05), rng)))
        if rng.random() < 0.7:
            objects.append(("otel_swa_provenance=", _provenance(ct, rng)))
        if rng.random() < 0.1:
            objects.append(("otel_swa_fault=", {"forward_ct": ct, "fault": "swa_leaked_slots", "slot": 3}))
        if rng.random() < 0.1:
            rng.shuffle(objects)
        for prefix, fields in objects:
            if rng.random() < 0.05:
                first, *rest = fields.items()
                fields = dict([first, *reversed(rest)])  # another key order
            payload = json.dumps(fields, separators=(",", ":"))
            if rng.random() < 0.08:
                payload = _spoil(payload, rng)
            line_head = head if rng.random() < 0.9 else f"[{rng.choice(TIMES)}{rng.choice(RANKS)}] otel_swa[verify=attention] "
            lines.append(line_head + prefix + payload)
            if rng.random() < 0.04:
                lines.append(lines[-1])  # written twice
    # other line ends in some logs (a bare CR anywhere sends the whole text to the general rules)
    # and lines glued (a process writing its line in parts while others write theirs)
    ends = rng.choice([["\n"], ["\n"], ["\n"] * 12 + ["\r\n", ""], ["\n"] * 12 + ["\r\n", "\r", ""]])
    ends = [rng.choice(ends) for _ in lines]
    return "".join(line + end for line, end in zip(lines, ends)) + rng.choice(["", "\n", "[10:00:03 TP1] "])


@settings(max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=logs(), chunk=st.sampled_from([64, 700, 1 << 20]))
def test_any_log_reads_the_same_as_by_the_general_rules(monkeypatch, tmp_path, text, chunk):
    fast, general = both(monkeypatch, text, chunk=chunk, tmp_path=tmp_path)
    assert fast == general
