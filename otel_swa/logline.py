"""The plain log-line sink: writes each record as SGLang's line through the ``logging`` module.

This is the sink for engines that want only the CI line; the OpenTelemetry pipeline has its own
log-line exporter (see :mod:`otel_swa.telemetry`) that writes the same bytes.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from otel_swa.record import SwaDivergenceRecord

__all__ = ["LogLineSink", "LOGGER_NAME", "line_logger", "write_lines"]

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


class LogLineSink:
    """``sink(record, context)`` that logs ``record.line()`` at ``level`` (the SGLang line after
    otel-swa's ``otel_swa[verify=...]`` tag).

    The log handler adds the usual prefix (time, level, rank...); SGLang's parser, and
    :func:`otel_swa.record.find_all`, find the record after it. The lines are never silently
    filtered (see :func:`line_logger`) nor lost for want of a handler (see :func:`write_lines`).
    """

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self.logger = line_logger(logger if logger is not None else logging.getLogger(LOGGER_NAME), level)
        self.level = level

    def __call__(self, record: SwaDivergenceRecord, context: Any = None) -> None:
        write_lines(self.logger, self.level, [record.line()])
