"""The plain log-line sink: writes each record as SGLang's line through the ``logging`` module.

This is the sink for engines that want only the CI line; the OpenTelemetry pipeline has its own
log-line exporter (see :mod:`otel_swa.telemetry`) that writes the same bytes.

What a line sink writes (formats in :mod:`otel_swa.record`), in order, each as one log message:

* once, before its first record with a known ``verify_source`` (every record of otel-swa's
  reporter): the run start marker ``otel_swa[verify=...] otel_swa_run_start={"pid":N}``, so a log
  that several runs append to shows where each began;
* per record, otel-swa's line ``otel_swa[verify=...] kv_canary_swa_divergence={...}`` (SGLang's
  record byte for byte after the tag);
* right after it, for an audited record, the audit line ``otel_swa[verify=...] otel_swa_audit={...}``;
* when the reporter is on and delivers no sample, its liveness warning
  ``otel_swa[verify=...] otel_swa_liveness={...}`` (at WARNING; the run start marker before it when
  it is the sink's first line).

A forked child's sink writes its own run start marker (the child's process id) before its first
line: the child's reporter counts from 0 again (:mod:`otel_swa.lifecycle`), a run of its own.

Neither extra line contains SGLang's prefix, so SGLang's own parser and greps read the log as
before.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from otel_swa.record import LivenessWarning, SwaDivergenceRecord, run_start_line

__all__ = ["LogLineSink", "LOGGER_NAME", "RecordLines", "line_logger", "write_lines"]

#: The logger the line is written to unless another is given.
LOGGER_NAME = "otel_swa"


def line_logger(logger: logging.Logger, level: int = logging.INFO) -> logging.Logger:
    """Make sure lines logged on ``logger`` at ``level`` are not dropped by an inherited level.

    Asking for the lines is asking to see them: when the logger's own level is unset (NOTSET) and
    the level it inherits would drop ``level`` (``logging.basicConfig()`` leaves the root at
    WARNING), the logger's level is set to ``level``. A level set on the logger itself is kept.
    Returns ``logger``.
    """
    if logger.level == logging.NOTSET and not logger.isEnabledFor(level):
        logger.setLevel(level)
    return logger


def write_lines(logger: logging.Logger, level: int, lines: list[str]) -> None:
    """Log each line on ``logger``; when no handler exists up its hierarchy, write them to
    ``sys.stderr`` instead of losing them (Python's last-resort handler drops INFO)."""
    if not logger.hasHandlers():
        sys.stderr.write("".join(line + "\n" for line in lines))
        sys.stderr.flush()
        return
    for line in lines:
        logger.log(level, "%s", line)


class RecordLines:
    """The lines of each record in turn, the run start marker before the first tagged one (see
    the module docstring), in each process (a forked child writes its own). Thread-safe: the
    marker is written once per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started_in: int | None = None  # the process whose marker was written

    def _first(self) -> bool:
        pid = os.getpid()
        if self._started_in is not None and self._started_in != pid:
            self._lock = threading.Lock()  # a forked child: the parent's lock may be held by a thread it lost
        with self._lock:
            first, self._started_in = self._started_in != pid, pid
        return first

    def of(self, record: SwaDivergenceRecord) -> list[str]:
        """The lines to write for ``record``: the marker (first tagged record of the process only),
        its line, its audit line (audited records only)."""
        lines = record.lines()
        if record.verify_source is not None and self._first():
            lines.insert(0, run_start_line(record.verify_source))
        return lines

    def of_liveness(self, warning: LivenessWarning) -> list[str]:
        """The lines to write for a liveness warning: the marker (when it is the process's first
        tagged line), then the warning's line."""
        lines = [warning.line()]
        if warning.verify_source is not None and self._first():
            lines.insert(0, run_start_line(warning.verify_source))
        return lines


class LogLineSink:
    """``sink(record, context)`` that logs a record's lines at ``level``: otel-swa's line (SGLang's
    record after the ``otel_swa[verify=...]`` tag), its audit line when audited, and, before the
    first one, the run start marker (see the module docstring).

    The log handler adds the usual prefix (time, level, rank...); SGLang's parser, and
    :func:`otel_swa.record.find_all`, find the record after it. The lines are never silently
    filtered (see :func:`line_logger`) nor lost for want of a handler (see :func:`write_lines`).
    """

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self.logger = line_logger(logger if logger is not None else logging.getLogger(LOGGER_NAME), level)
        self.level = level
        self._lines = RecordLines()

    def __call__(self, record: SwaDivergenceRecord, context: Any = None) -> None:
        write_lines(self.logger, self.level, self._lines.of(record))

    def liveness(self, warning: LivenessWarning, context: Any = None) -> None:
        """Log the reporter's liveness warning line (after the run start marker when first), at
        WARNING (or this sink's level when it is higher)."""
        level = max(self.level, logging.WARNING)
        lines = self._lines.of_liveness(warning)
        if len(lines) > 1:
            write_lines(self.logger, self.level, lines[:1])
        write_lines(self.logger, level, lines[-1:])
