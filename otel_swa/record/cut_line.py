"""A log's last line cut in the middle (:class:`CutLine`, :func:`split_cut_line`): a log still
being written, or copied while it was, ends in a line without its line end that holds a line of
otel-swa's or SGLang's that cannot be read; every reader (:mod:`otel_swa.logsource`) reads the log
without it and says so in one line."""

from __future__ import annotations

from dataclasses import dataclass

from otel_swa.record.decoding import MalformedRecordError
from otel_swa.record.parser import iter_entries

__all__ = ["CutLine", "split_cut_line", "unreadable"]


@dataclass(frozen=True, slots=True)
class CutLine:
    """The last line of a log, without a line end, whose line of otel-swa's or SGLang's cannot be
    read: left out (see the module docstring).

    Attributes:
        line_no: its 1-based line number.
        reason: why it cannot be read (the first malformed line kind's reason).
    """

    line_no: int
    reason: str

    def describe(self) -> str:
        """One line for the reader: ``the last line (19) has no line end and cannot be read (...):
        the log is still being written, or was cut there; read without it``."""
        return (f"the last line ({self.line_no}) has no line end and cannot be read ({self.reason}): the log is still "
                "being written, or was cut there; read without it")


def _line_end_before(text: str) -> int:
    """Where the last line of ``text`` begins (after its last LF or CR)."""
    return max(text.rfind("\n"), text.rfind("\r")) + 1


def unreadable(line: str) -> MalformedRecordError | None:
    """The first malformed line kind in ``line`` (a line without its line end), else ``None``."""
    errors: list[MalformedRecordError] = []
    for _ in iter_entries(line, errors):
        pass
    return errors[0] if errors else None


def split_cut_line(text: str, first_line_no: int = 1) -> "tuple[str, CutLine | None]":
    """``text`` without its last line when that line has no line end and cannot be read
    (:class:`CutLine`), and that line; else ``(text, None)``.

    Args:
        text: log text (the whole log, or its last chunk).
        first_line_no: the line number of the first line of ``text`` in the whole log.
    """
    if not text or text.endswith(("\n", "\r")):
        return text, None
    start = _line_end_before(text)
    error = unreadable(text[start:])
    if error is None:
        return text, None
    return text[:start], CutLine(first_line_no + text.count("\n", 0, start), error.reason)
