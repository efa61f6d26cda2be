"""otel-swa's lines against SGLang's own parser (sglang 0.5.23 ``SwaDivergenceLog`` of its KV canary).

* A log as otel-swa's line sinks write it (run start markers, tagged lines, audit, provenance and
  fault lines), beside
  SGLang's own lines, two ranks, two runs: SGLang's ``find_all`` reads every record line for line,
  exactly the records (and matched texts) otel-swa's ``find_all`` reads, and nothing of the extra
  lines.
* Line by line, a record is accepted by otel-swa's reader when SGLang's parser accepts it and
  rejected when SGLang's rejects it, with the documented differences spelled out.
"""

from __future__ import annotations

import io
import json
import logging

import pytest

from otel_swa.logline import LogLineSink
from otel_swa.record import Offender, SwaDivergenceRecord, find_all

pytestmark = pytest.mark.sglang

R = SwaDivergenceRecord
SGLANG_FORMAT = "[%(asctime)s{rank}] %(message)s"  # sglang.srt.utils.configure_logger's shape


def _rank_logger(name: str, rank: str, stream: io.StringIO) -> tuple[logging.Logger, logging.Handler]:
    logger = logging.getLogger(f"otel_swa.test_compat.{name}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(SGLANG_FORMAT.format(rank=f" {rank}"), "%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    return logger, handler


def test_sglangs_find_all_reads_our_log_with_audit_lines_and_run_starts_line_for_line(sglang_modules):
    SwaDivergenceLog = sglang_modules.SwaDivergenceLog
    stream = io.StringIO()
    loggers = {rank: _rank_logger(rank, rank, stream) for rank in ("TP0", "TP1")}
    try:
        for run in range(2):  # a log two runs appended to
            sinks = {rank: LogLineSink(logger) for rank, (logger, _) in loggers.items()}  # a new sink per run
            for ct in (20, 40, 60):
                for n, (rank, sink) in enumerate(sinks.items()):
                    audit = dict(swa_leaked_slots=n, swa_stale_tokens=0, swa_shared_slots=0,
                                 swa_pages_in_use=30 + ct, swa_pages_referenced=30 + ct - n)
                    # pipeline parallelism in the second run: each record says which micro-batch it sampled
                    micro_batch = (ct // 20) % 2 if run else None
                    # the checks of the KV in the slots: TP1 finds a foreign token at step 40
                    foreign = int(rank == "TP1" and ct == 40)
                    provenance = dict(kv_write_checks=16, kv_write_mismatches=0, kv_stamp_checks=ct,
                                      kv_foreign_tokens=foreign, kv_stamp_unchecked=1)
                    offenders = (Offender("kv_foreign_tokens", request="r7", position=3, swa_slot=70, pool="swa",
                                          expected_token=11, expected_position=3, found_token=12, found_position=3,
                                          other_request="r9"),) if foreign else ()
                    sink(R(ct, 90 * ct, 30 * ct + run, 5 + n, 40, verify_source="kv_canary", micro_batch=micro_batch,
                           offenders=offenders, **audit, **provenance), None)
                    # SGLang's own reporter logs its line of the same step through the same handler
                    loggers[rank][0].info(SwaDivergenceLog(forward_ct=ct, verify_full=90 * ct, verify_swa=30 * ct,
                                                           swa_full_idx_divergence=5, swa_out_of_window_tokens=40).format())
    finally:
        for logger, handler in loggers.values():
            logger.removeHandler(handler)
    text = stream.getvalue()
    assert text.count("otel_swa_run_start=") == 4 and text.count("otel_swa_audit=") == 12
    assert text.count("otel_swa_provenance=") == 12 and text.count("otel_swa_fault=") == 2

    theirs = SwaDivergenceLog.find_all(text)  # raises on any line it cannot take
    ours = find_all(text)
    assert ours.malformed == 0
    assert [(log, matched) for log, matched in theirs] == [
        (SwaDivergenceLog(**m.record.to_dict()), m.text) for m in ours.matches]
    assert len(theirs) == 24  # 2 runs x 3 steps x 2 ranks x (ours + SGLang's own)
    # SGLang's parser, line by line: a record on every line that has one, none on the others
    for line in text.splitlines():
        parsed = SwaDivergenceLog.parse(line)
        if "kv_canary_swa_divergence=" in line:
            assert parsed == SwaDivergenceLog(**R.parse(line).to_dict())
        else:
            assert parsed is None and any(prefix in line for prefix in (
                "otel_swa_audit=", "otel_swa_run_start=", "otel_swa_provenance=", "otel_swa_fault="))
    # ours keeps what SGLang's does not: the audit on its record, the tag, the rank
    audited = [(m.rank, m.record.swa_leaked_slots) for m in ours.matches if m.record.verify_source]
    assert audited == [("TP0", 0), ("TP1", 1)] * 6
    micro_batches = [m.record.micro_batch for m in ours.matches if m.record.verify_source]
    assert micro_batches == [None] * 6 + [1, 1, 0, 0, 1, 1]
    stamps = [(m.rank, m.record.kv_stamp_checks, m.record.kv_foreign_tokens, len(m.record.offenders))
              for m in ours.matches if m.record.verify_source]
    assert stamps == [("TP0", 20, 0, 0), ("TP1", 20, 0, 0), ("TP0", 40, 0, 0), ("TP1", 40, 1, 1),
                      ("TP0", 60, 0, 0), ("TP1", 60, 0, 0)] * 2


COMPACT = '{"forward_ct":20,"verify_full":9,"verify_swa":4,"swa_full_idx_divergence":1,"swa_out_of_window_tokens":2}'

#: (line, what otel-swa reads: a record's five values, or the start of the rejection reason)
LINES = [
    (COMPACT, (20, 9, 4, 1, 2)),
    ('{"swa_out_of_window_tokens":2,"forward_ct":20,"verify_swa":4,"verify_full":9,"swa_full_idx_divergence":1}',
     (20, 9, 4, 1, 2)),
    ('{"forward_ct":20,"verify_full":9,"verify_swa":4,"swa_full_idx_divergence":1}', (20, 9, 4, 1, 0)),
    ('{"forward_ct":20,"verify_full":-2147483000,"verify_swa":4,"swa_full_idx_divergence":1,"swa_out_of_window_tokens":2}',
     (20, -2147483000, 4, 1, 2)),
    (json.dumps(json.loads(COMPACT)), "the JSON holds spaces"),
    ('{"forward_ct":20,"verify_full":9,"verify_swa":4,"swa_full_idx_divergence":1,"swa_out_of_window_tokens":2,"x":1}',
     "unknown key(s) 'x'"),
    ('{"forward_ct":20,"verify_full":9,"swa_full_idx_divergence":1,"swa_out_of_window_tokens":2}', "missing field(s) verify_swa"),
    ("[20,9,4,1,2]", "expected a JSON object"),
    ("{broken", "the text after the prefix is not JSON"),
    (COMPACT + "trailing", "text glued after the JSON object"),
]


@pytest.mark.parametrize("payload, ours", LINES)
def test_accepted_and_rejected_as_sglangs_parser_does(sglang_modules, payload, ours):
    SwaDivergenceLog = sglang_modules.SwaDivergenceLog
    line = "[2026-01-01 00:00:00 TP0] kv_canary_swa_divergence=" + payload
    try:
        theirs = SwaDivergenceLog.find_all(line)
    except (TypeError, ValueError):
        theirs = None
    found = find_all(line)
    if isinstance(ours, tuple):
        assert theirs is not None and len(theirs) == 1, "SGLang's parser takes this line"
        assert [tuple(r.to_dict().values()) for r in found] == [ours] and found.malformed == 0
        assert SwaDivergenceLog(**found[0].to_dict()) == theirs[0][0]
    else:
        assert theirs is None, "SGLang's parser rejects this line"
        assert list(found) == [] and [e.reason[:len(ours)] for e in found.errors] == [ours]


def test_a_prefix_with_nothing_after_it_is_no_record_for_either(sglang_modules):
    line = "[2026-01-01 00:00:00 TP0] kv_canary_swa_divergence= the rest"
    assert sglang_modules.SwaDivergenceLog.find_all(line) == []
    assert list(find_all(line)) == []


@pytest.mark.parametrize("payload, reason", [
    ('{"forward_ct":20.5,"verify_full":9,"verify_swa":4,"swa_full_idx_divergence":1,"swa_out_of_window_tokens":2}',
     "forward_ct=20.5 is not an integer"),
    ('{"forward_ct":20,"verify_full":9223372036854775808,"verify_swa":4,"swa_full_idx_divergence":1,'
     '"swa_out_of_window_tokens":2}', "verify_full=9223372036854775808 is outside int64"),
])
def test_refused_though_sglangs_parser_takes_it(sglang_modules, payload, reason):
    # a count that is no integer, or no int64 (what OTLP carries), cannot be judged or exported
    line = "kv_canary_swa_divergence=" + payload
    assert len(sglang_modules.SwaDivergenceLog.find_all(line)) == 1
    assert [e.reason for e in find_all(line).errors] == [reason + (" (-2**63 .. 2**63 - 1, what OTLP carries)"
                                                                   if "int64" in reason else "")]


def test_glued_records_are_recovered_where_sglangs_parser_rejects_the_line(sglang_modules):
    a = R(20, 9, 4, 1, 2).format()
    b = R(40, 19, 8, 3, 4).format()
    line = "[2026-01-01 00:00:00 TP0] " + a + "[2026-01-01 00:00:00 TP1] " + b
    with pytest.raises(ValueError):
        sglang_modules.SwaDivergenceLog.find_all(line)
    assert [(m.record.forward_ct, m.rank) for m in find_all(line).matches] == [(20, "TP0"), (40, "TP1")]
