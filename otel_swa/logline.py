"""The plain log-line sink: writes each record as SGLang's line through the ``logging`` module.

This is the sink for engines that want only the CI line; the OpenTelemetry pipeline has its own
log-line exporter (see :mod:`otel_swa.telemetry`) that writes the same bytes.
"""

from __future__ import annotations

import logging
from typing import Any

from otel_swa.record import SwaDivergenceRecord

__all__ = ["LogLineSink", "LOGGER_NAME"]

#: The logger the line is written to unless another is given.
LOGGER_NAME = "otel_swa"


class LogLineSink:
    """``sink(record, context)`` that logs ``record.format()`` at ``level``.

    The log handler adds the usual prefix (time, level, rank...); SGLang's parser, and
    :func:`otel_swa.record.find_all`, find the record after it.
    """

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self.logger = logger if logger is not None else logging.getLogger(LOGGER_NAME)
        self.level = level

    def __call__(self, record: SwaDivergenceRecord, context: Any = None) -> None:
        self.logger.log(self.level, "%s", record.format())
