"""The SGLang log line as an OpenTelemetry log exporter.

:class:`SwaLogLineExporter` is a ``LogRecordExporter``: for each
``kv_cache.swa.divergence_sample`` event in a batch it writes otel-swa's line
``otel_swa[verify=attention] kv_canary_swa_divergence={"forward_ct":...}``
(``SwaDivergenceRecord.line()``: the record part byte-identical to SGLang's line, after a tag that
says otel-swa wrote it and what the verify counts are) and ignores every other log record. So the line that SGLang's CI greps for is one more
exporter on the same pipeline as OTLP, and ``otel-swa check`` reads it back. Like the plain sink
(:mod:`otel_swa.logline`), it writes the run start marker before its first line and, right after
the line of an audited sample (the audit fields are event attributes), its audit line; for a
``kv_cache.swa.reporter.liveness`` event (a reporter on and delivering no sample), the liveness
warning line ``otel_swa[verify=...] otel_swa_liveness={...}`` at WARNING. The events otel-swa's
sink emits carry their record (:class:`otel_swa.telemetry.events.SampleLogRecord`), which is written
as it is; any other event of those names (another emitter, a record read back) is rebuilt from its
attributes.

Where the line goes:

* by default through Python ``logging``, logger ``otel_swa``, level INFO, so the application's
  log format (time, level, rank...) stands before it as in SGLang; when that logger has no
  handler anywhere up its hierarchy the line is written to ``sys.stderr`` instead of being lost.
  Selecting this exporter asks for the lines, so when the logger's own level is unset (NOTSET)
  and the level it inherits would drop INFO (``logging.basicConfig()`` leaves the root at
  WARNING), creating the exporter sets that logger's level to INFO. A level the application set
  on the logger itself is kept (``logging.getLogger("otel_swa").setLevel(logging.WARNING)``
  silences the lines). The ``otel_swa`` logger is the parent of the package's other loggers,
  which log warnings and errors only;
* or to a text stream given as ``stream=`` (one line, ``\\n``-terminated, flushed).

Registered under the entry point group ``opentelemetry_logs_exporter`` as ``swa_logline``, so
``OTEL_LOGS_EXPORTER=swa_logline`` (alone or in a comma list) selects it under
``opentelemetry-instrument`` and in :func:`otel_swa.telemetry.setup.configure`.
"""

from __future__ import annotations

import logging
import threading
from typing import IO, Sequence

from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult

from otel_swa.logline import LOGGER_NAME, RecordLines, line_logger, write_lines
from otel_swa.record import LivenessWarning, SwaDivergenceRecord
from otel_swa.telemetry import semconv as sc
from otel_swa.telemetry.events import liveness_from_attributes, record_from_attributes

__all__ = ["SwaLogLineExporter", "LOGGER_NAME"]


_log = logging.getLogger(__name__)


class SwaLogLineExporter(LogRecordExporter):
    """Writes the SGLang line of every SWA divergence sample event.

    Args:
        stream: a text stream to write to; ``None`` (default): Python logging, logger
            ``logger_name``.
        logger_name: the logger used when ``stream`` is ``None`` (default ``otel_swa``).
        level: the logging level of the lines (default INFO). With ``stream=None``, a logger
            whose own level is NOTSET and which would not pass ``level`` is set to ``level``
            (see the module docstring).

    Records whose attributes do not form a valid record are counted in :attr:`malformed` and
    logged; the export still succeeds for the others.

    Attributes:
        lines_written: samples written (one SGLang line each; the run start marker and audit lines
            are not counted).
        malformed: sample events without a valid record (no line written for them).
    """

    def __init__(self, stream: IO[str] | None = None, *, logger_name: str = LOGGER_NAME, level: int = logging.INFO) -> None:
        self._stream = stream
        self._logger = logging.getLogger(logger_name)
        self._level = level
        if stream is None:
            line_logger(self._logger, level)
        self._lock = threading.Lock()
        self._lines = RecordLines()
        self._shutdown = False
        self.lines_written = 0
        self.malformed = 0

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        if self._shutdown:
            return LogRecordExportResult.FAILURE
        records = []
        for readable in batch:
            log_record = readable.log_record
            # otel-swa's own events carry their record (SampleLogRecord): taken as it is, not rebuilt
            sample = getattr(log_record, "sample", None)
            if log_record.event_name == sc.LIVENESS_EVENT_NAME:
                self._write_liveness(log_record.attributes or {}, sample if isinstance(sample, LivenessWarning) else None)
                continue
            if log_record.event_name != sc.EVENT_NAME:
                continue
            if isinstance(sample, SwaDivergenceRecord):
                records.append(sample)
                continue
            try:
                records.append(record_from_attributes(log_record.attributes or {}))
            except (KeyError, TypeError, ValueError) as exc:
                self.malformed += 1
                _log.warning("%s event without a valid record (%s); no line written", sc.EVENT_NAME, exc)
        if not records:
            return LogRecordExportResult.SUCCESS
        try:
            with self._lock:
                self._write([line for record in records for line in self._lines.of(record)])
                self.lines_written += len(records)
        except Exception:  # an unwritable stream must not break the pipeline
            _log.exception("could not write the lines of %d SWA divergence sample(s)", len(records))
            return LogRecordExportResult.FAILURE
        return LogRecordExportResult.SUCCESS

    def _write_liveness(self, attributes, warning: "LivenessWarning | None" = None) -> None:
        """Write the line of a liveness warning event (after the run start marker when first);
        ``warning``: the one the event carries, else rebuilt from ``attributes``."""
        try:
            if warning is None:
                warning = liveness_from_attributes(attributes)
            lines = self._lines.of_liveness(warning)
            with self._lock:
                if self._stream is None:
                    if len(lines) > 1:  # the run start marker at the lines' level, the warning at WARNING
                        write_lines(self._logger, self._level, lines[:-1])
                    write_lines(self._logger, max(self._level, logging.WARNING), lines[-1:])
                else:
                    self._write(lines)
        except Exception:  # an unwritable stream or a bad event must not break the pipeline
            _log.exception("could not write the line of a %s event", sc.LIVENESS_EVENT_NAME)

    def _write(self, lines: list[str]) -> None:
        if self._stream is None:
            write_lines(self._logger, self._level, lines)
            return
        self._stream.write("".join(line + "\n" for line in lines))
        self._stream.flush()

    def shutdown(self) -> None:
        self._shutdown = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
