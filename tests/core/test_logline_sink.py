"""The plain log-line sink: its lines are never filtered by an inherited level nor lost without a handler."""

import io
import logging
import os

from otel_swa.logline import LogLineSink
from otel_swa.record import SwaDivergenceRecord, find_all

LINE = ('kv_canary_swa_divergence={"forward_ct":20,"verify_full":9,"verify_swa":4,'
        '"swa_full_idx_divergence":1,"swa_out_of_window_tokens":2}')
RECORD = SwaDivergenceRecord(20, 9, 4, 1, 2)


def test_line_reaches_a_handler_above_a_warning_root(monkeypatch):
    root = logging.getLogger()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    monkeypatch.setattr(root, "level", logging.WARNING)  # as logging.basicConfig() leaves it
    root.addHandler(handler)
    logger = logging.getLogger("otel_swa.test_sink_a")
    try:
        LogLineSink(logger)(RECORD, None)
    finally:
        root.removeHandler(handler)
    assert stream.getvalue() == LINE + "\n"


def test_a_level_set_by_the_application_is_kept(monkeypatch):
    logger = logging.getLogger("otel_swa.test_sink_b")
    logger.setLevel(logging.ERROR)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        LogLineSink(logger)(RECORD, None)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert stream.getvalue() == ""


def test_without_any_handler_the_line_goes_to_stderr(monkeypatch, capsys):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    logger = logging.getLogger("otel_swa.test_sink_c")
    monkeypatch.setattr(logger, "propagate", True)
    LogLineSink(logger)(RECORD, None)
    assert capsys.readouterr().err == LINE + "\n"


def _collect(logger_name):
    logger = logging.getLogger(logger_name)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.propagate = False
    return logger, stream, handler


def test_run_start_marker_first_then_each_line_and_its_audit_line():
    logger, stream, handler = _collect("otel_swa.test_sink_d")
    audited = dict(swa_leaked_slots=0, swa_stale_tokens=1, swa_shared_slots=0, swa_pages_in_use=3, swa_pages_referenced=3)
    try:
        sink = LogLineSink(logger)
        sink(SwaDivergenceRecord(20, 9, 4, 1, 2, verify_source="attention", **audited), None)
        sink(SwaDivergenceRecord(40, 19, 8, 1, 2, verify_source="attention"), None)
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue().splitlines() == [
        f'otel_swa[verify=attention] otel_swa_run_start={{"pid":{os.getpid()}}}',
        'otel_swa[verify=attention] ' + LINE,
        'otel_swa[verify=attention] otel_swa_audit={"forward_ct":20,"swa_leaked_slots":0,"swa_stale_tokens":1,'
        '"swa_shared_slots":0,"swa_pages_in_use":3,"swa_pages_referenced":3}',
        'otel_swa[verify=attention] kv_canary_swa_divergence={"forward_ct":40,"verify_full":19,"verify_swa":8,'
        '"swa_full_idx_divergence":1,"swa_out_of_window_tokens":2}',
    ]
    # and read back: the audit on its record, the marker as a run start
    found = find_all(stream.getvalue())
    assert found[0].swa_stale_tokens == 1 and not found[1].audited
    assert type(found.entries[0]).__name__ == "RunStartMatch" and found.malformed == 0


def test_a_record_without_a_tag_gets_no_marker():
    # SGLang's bare line (verify_source unknown) is written exactly as SGLang's reporter writes it
    logger, stream, handler = _collect("otel_swa.test_sink_e")
    try:
        LogLineSink(logger)(RECORD, None)
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == LINE + "\n"
