"""Records as they appear in logs: the log prefix (timestamp, rank) and files still being written.

The records themselves are always read by :mod:`otel_swa.record` (:func:`~otel_swa.record.iter_matches`);
this module only adds what stands around them in a log:

* the **log prefix** of the line a record was found on. Two shapes are recognised:

  - SGLang's scheduler processes log through ``logging`` with the format
    ``[%(asctime)s{prefix}] %(message)s`` (``sglang.srt.utils.configure_logger``), where ``asctime``
    uses the date format ``%Y-%m-%d %H:%M:%S`` (older releases) or ``%m-%d %H:%M:%S`` (newer ones,
    coloured), and ``prefix`` is built in ``run_scheduler_process`` from space-separated rank
    tokens such as `` DP1``, `` PP0``, `` TP3``, `` EP2`` (also ``ATTN_CP``/``MOE_DP`` in recent
    versions; the order varies between versions)::

        [2025-06-01 12:34:56 TP0] kv_canary_swa_divergence={...}
        [2025-06-01 12:34:56 DP1 TP0] kv_canary_swa_divergence={...}
        [06-01 12:34:56 PP1 TP0] kv_canary_swa_divergence={...}

  - plain Python ``logging`` whose format starts with ``%(asctime)s`` (default date format
    ``%Y-%m-%d %H:%M:%S,mmm``)::

        2025-06-01 12:34:56,789 INFO kv_canary_swa_divergence={...}

  The timestamp is kept as the text found in the log (no time zone is written there, so none is
  invented); the rank is the space-joined rank tokens (``"DP1 TP0"``), or ``None`` when the line
  names none.

* **line numbers** (``line_no``, 1-based) count lines as the log is read by
  :mod:`otel_swa.record`: LF, CRLF and a bare CR each end one line. A progress bar redrawn with
  bare CRs therefore takes one line per redraw, and a record's number is the number of line ends
  before it plus one. This can be higher than what ``wc -l`` or an editor that treats bare CR as
  ordinary text shows, but it is the same for a whole log read at once and for a log followed in
  chunks.

* :class:`LogFollower`: a log file that another process may still be appending to, read
  incrementally (only complete lines until the final read, so a half-written record is not taken
  for a malformed one).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

from otel_swa.record import FIELDS, MalformedRecordError, SwaDivergenceRecord, _clean, iter_matches

__all__ = [
    "LogPrefix",
    "LoggedRecord",
    "LogFollower",
    "parse_log_prefix",
    "logged_records",
    "read_log",
    "group_by_rank",
    "ROW_FIELDS",
]

#: Columns of a record as data (``otel-swa records``): where it was found, then the five fields.
ROW_FIELDS = ("line_no", "timestamp", "rank") + FIELDS

_TIME = r"\d{2}:\d{2}:\d{2}(?:[.,]\d+)?"
# SGLang: "[" asctime (with or without year, or time only) rank tokens "]".
_SGLANG_PREFIX_RE = re.compile(
    r"\[(?P<ts>(?:(?:\d{4}-)?\d{2}-\d{2} )?" + _TIME + r")(?P<rank>(?: [A-Z][A-Z_]*\d+)*)\]"
)
# Python logging: an ISO-like date and time at the start of the line (after optional blanks).
_PLAIN_PREFIX_RE = re.compile(r"^\s*(?P<ts>\d{4}-\d{2}-\d{2}[ T]" + _TIME + r")(?![\d:])")


@dataclass(frozen=True, slots=True)
class LogPrefix:
    """What a log line says before its record.

    Attributes:
        timestamp: the time text as written in the log (``"2025-06-01 12:34:56"``,
            ``"06-01 12:34:56"``, ``"2025-06-01 12:34:56,789"``), or ``None``.
        rank: the rank tokens of SGLang's prefix joined by one space (``"TP0"``, ``"DP1 TP0"``,
            ``"PP1 TP0"``), or ``None`` when the line names no rank.
    """

    timestamp: str | None = None
    rank: str | None = None


def parse_log_prefix(text: str) -> LogPrefix:
    """Read the timestamp and rank from the text that stands before a record on its line.

    ``text`` may hold ANSI colour codes; they are ignored. Text in neither recognised shape gives
    ``LogPrefix(None, None)``; nothing is raised.
    """
    text = _clean(text)
    match = _SGLANG_PREFIX_RE.search(text)
    if match is not None:
        rank = match.group("rank").strip()
        return LogPrefix(match.group("ts"), rank or None)
    match = _PLAIN_PREFIX_RE.search(text)
    if match is not None:
        return LogPrefix(match.group("ts"), None)
    return LogPrefix()


@dataclass(frozen=True, slots=True)
class LoggedRecord:
    """A record and where it was found in a log.

    Attributes:
        record: the record.
        line_no: 1-based line number in the log (LF, CRLF and bare CR each end a line; see the
            module docstring).
        timestamp: see :class:`LogPrefix`.
        rank: see :class:`LogPrefix`.
    """

    record: SwaDivergenceRecord
    line_no: int
    timestamp: str | None = None
    rank: str | None = None

    def to_row(self) -> dict[str, int | str | None]:
        """A flat dict with the keys of :data:`ROW_FIELDS`, in that order."""
        row: dict[str, int | str | None] = {
            "line_no": self.line_no,
            "timestamp": self.timestamp,
            "rank": self.rank,
        }
        row.update(self.record.to_dict())
        return row


def logged_records(
    text: str,
    *,
    first_line_no: int = 1,
    errors: list[MalformedRecordError] | None = None,
) -> list[LoggedRecord]:
    """Every record in ``text`` with its line number, timestamp and rank, in order.

    Lines are those of :mod:`otel_swa.record`'s reading (ANSI colour codes removed; LF, CRLF and
    bare CR each end a line), so the line number and the prefix are those of the line the record
    was found on.

    Args:
        text: log text (any number of lines).
        first_line_no: the line number of the first line of ``text`` in the whole log (when
            ``text`` is a later chunk of a file being followed).
        errors: when given, a :class:`~otel_swa.record.MalformedRecordError` is appended per
            malformed record (they are skipped).
    """
    lines: list[str] | None = None
    found: list[LoggedRecord] = []
    for match in iter_matches(text, errors):
        if lines is None:
            lines = _clean(text).split("\n")
        line = lines[match.line_no - 1] if match.line_no <= len(lines) else ""
        cut = line.find(match.text)
        prefix = parse_log_prefix(line[:cut] if cut >= 0 else line)
        found.append(
            LoggedRecord(match.record, first_line_no + match.line_no - 1, prefix.timestamp, prefix.rank)
        )
    return found


class LogFollower:
    """A log file read incrementally, while another process may still be appending to it.

    Each :meth:`poll` reads the bytes appended since the previous one and parses the complete lines
    among them; an unterminated last line is kept for the next poll, unless ``final=True``. The file
    may not exist yet (a server that has not started logging): :meth:`poll` then returns nothing and
    :attr:`missing` is true. A file that shrank (truncated by log rotation) is read again from its
    start, its line numbers from 1 again.

    Bytes are decoded as UTF-8; undecodable bytes become U+FFFD, so binary noise cannot stop the
    reader.

    Attributes:
        path: the file.
        records: every :class:`LoggedRecord` found so far, in order.
        errors: a :class:`~otel_swa.record.MalformedRecordError` per malformed record skipped.
        missing: the file did not exist at the last poll.
        error: the ``OSError`` of the last poll when the file exists but cannot be read
            (permission denied, a directory...), else ``None``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.records: list[LoggedRecord] = []
        self.errors: list[MalformedRecordError] = []
        self.missing = False
        self.error: OSError | None = None
        self._offset = 0
        self._next_line_no = 1
        self._pending = b""
        # the last byte parsed was a CR: a LF at the start of the next read completes that CRLF
        self._after_cr = False

    @property
    def malformed(self) -> int:
        """How many malformed records were skipped."""
        return len(self.errors)

    def poll(self, *, final: bool = False) -> list[LoggedRecord]:
        """Read what was appended since the last poll; return the new records.

        Args:
            final: also parse an unterminated last line (the writer is done or the wait is over).

        Never raises for a missing or unreadable file: see :attr:`missing` and :attr:`error`.
        """
        try:
            with open(self.path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if size < self._offset:  # truncated in place: start again from the top
                    self._offset = 0
                    self._pending = b""
                    self._next_line_no = 1
                    self._after_cr = False
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            self.missing = True
            self.error = None
            return []
        except OSError as exc:
            self.missing = False
            self.error = exc
            return []
        self.missing = False
        self.error = None
        self._offset += len(data)
        data = self._pending + data
        if final:
            complete, self._pending = data, b""
        else:
            cut = data.rfind(b"\n") + 1
            complete, self._pending = data[:cut], data[cut:]
        if not complete:
            return []
        if self._after_cr and complete.startswith(b"\n"):
            # the CR that ended the previous read was the first half of a CRLF: one line end
            complete = complete[1:]
        self._after_cr = complete.endswith(b"\r")
        if not complete:
            return []
        text = complete.decode("utf-8", errors="replace")
        new = logged_records(text, first_line_no=self._next_line_no, errors=self.errors)
        self._next_line_no += _clean(text).count("\n")
        self.records.extend(new)
        return new


def read_log(
    source: str | os.PathLike[str] | BinaryIO | None,
    *,
    errors: list[MalformedRecordError] | None = None,
) -> list[LoggedRecord]:
    """All records of a complete log: a file path, ``"-"`` (standard input, read to its end), or a
    binary stream.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: the file cannot be read.
    """
    if source is None or (isinstance(source, str) and source == "-"):
        stream: BinaryIO = sys.stdin.buffer
        data = stream.read()
    elif isinstance(source, (str, os.PathLike)):
        data = Path(source).read_bytes()
    else:
        data = source.read()
        if isinstance(data, str):
            return logged_records(data, errors=errors)
    return logged_records(data.decode("utf-8", errors="replace"), errors=errors)


def group_by_rank(records: Iterable[LoggedRecord]) -> dict[str | None, list[SwaDivergenceRecord]]:
    """The records of each rank, in log order; ranks in order of first appearance (``None`` = no rank)."""
    groups: dict[str | None, list[SwaDivergenceRecord]] = {}
    for item in records:
        groups.setdefault(item.rank, []).append(item.record)
    return groups

