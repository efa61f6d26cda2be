"""The plain log-line sink: its lines are never filtered by an inherited level nor lost without a handler."""

import io
import logging

from otel_swa.logline import LogLineSink
from otel_swa.record import SwaDivergenceRecord

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
