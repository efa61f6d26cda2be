"""Records as they appear in logs: where each was found (line, time, rank) and files still being written.

The lines themselves (records, audit lines, run start markers, the log prefix before them) are
read by :mod:`otel_swa.record` (:func:`~otel_swa.record.iter_entries`,
:func:`~otel_swa.record.parse_log_prefix`); this module adds:

* :class:`LoggedRecord` and :class:`LoggedRunStart`: an entry with its line number and the
  timestamp and rank of the log prefix nearest before it on its line (SGLang's
  ``[2025-06-01 12:34:56 DP1 TP0]``, Python logging's ``2025-06-01 12:34:56,789``), the audit line
  attached to its record (:class:`~otel_swa.record.AuditPairing`);

* **line numbers** (``line_no``, 1-based) count lines as the log is read by
  :mod:`otel_swa.record`: LF, CRLF and a bare CR each end one line. A progress bar redrawn with
  bare CRs therefore takes one line per redraw, and a record's number is the number of line ends
  before it plus one. This can be higher than what ``wc -l`` or an editor that treats bare CR as
  ordinary text shows, but it is the same for a whole log read at once and for a log followed in
  chunks;

* :class:`LogFollower`: a log file that another process may still be appending to, read
  incrementally (only complete lines until the final read, so a half-written record is not taken
  for a malformed one);

* **a cut last line** (:func:`split_cut_line`, :class:`CutLine`): a log whose last line has no
  line end and holds a line of otel-swa's or SGLang's that cannot be read (a record, an audit,
  fault, provenance, run start or liveness line cut in the middle: a log still being written, or
  copied while it was) is read without that line, whatever its kind, by every reader (a file, a
  file followed while it grows, standard input, log text, captured output), and the readers say so
  in one line (:meth:`CutLine.describe`). A last line without a line end that reads whole is kept.
"""

from __future__ import annotations

import operator
import os
import select
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Union

from otel_swa.record import (
    AUDIT_FIELDS,
    FIELDS,
    PROVENANCE_FIELDS,
    AuditPairing,
    LivenessMatch,
    LogPrefix,
    MalformedRecordError,
    PrefixClaims,
    RecordGroup,
    RecordMatch,
    RunStartMatch,
    SwaDivergenceRecord,
    iter_entries,
    parse_log_prefix,
)
from otel_swa.record.cut_line import CutLine, unreadable, split_cut_line
from otel_swa.record.matches import rank_sure as _rank_sure

__all__ = [
    "LogPrefix",
    "LoggedRecord",
    "LoggedRunStart",
    "DuplicateLines",
    "LogFollower",
    "parse_log_prefix",
    "logged_entries",
    "logged_records",
    "read_entries",
    "read_data",
    "decode_log",
    "not_a_text_log",
    "read_log",
    "group_by_rank",
    "ROW_FIELDS",
    "CutLine",
    "split_cut_line",
]

#: Columns of a record as data (``otel-swa records``): where it was found, the run it belongs to,
#: what wrote it (``verify_source``: otel-swa's tag; empty for SGLang's own lines), the five
#: fields, the audit fields (empty when the record was not audited), ``micro_batch`` (empty
#: without pipeline parallelism), ``offenders``: the first offender of each fault its fault lines
#: name, a list of objects ``{"fault": ..., <location>: ...}`` (empty without faults), then the
#: provenance fields (empty when the record has no provenance line).
ROW_FIELDS = (("line_no", "timestamp", "rank", "run", "verify_source") + FIELDS + AUDIT_FIELDS
              + ("micro_batch", "offenders") + PROVENANCE_FIELDS)


@dataclass(frozen=True, slots=True)
class LoggedRecord:
    """A record and where it was found in a log.

    Attributes:
        record: the record (with its audit fields when its audit line followed it).
        line_no: 1-based line number in the log (LF, CRLF and bare CR each end a line; see the
            module docstring).
        timestamp: see :class:`~otel_swa.record.LogPrefix`.
        rank: see :class:`~otel_swa.record.LogPrefix`.
        rank_candidates: see :class:`~otel_swa.record.RecordMatch`.
    """

    record: SwaDivergenceRecord
    line_no: int
    timestamp: str | None = None
    rank: str | None = None
    rank_candidates: tuple = ()

    rank_sure = property(_rank_sure)

    def with_record(self, record: SwaDivergenceRecord) -> "LoggedRecord":
        """The same entry holding ``record`` (what :func:`dataclasses.replace` gives, without its
        field lookups: called for every line attached to a record)."""
        return LoggedRecord(record, self.line_no, self.timestamp, self.rank, self.rank_candidates)

    def to_row(self, run: int | None = None) -> "dict[str, int | str | list | None]":
        """A flat dict with the keys of :data:`ROW_FIELDS`, in that order (``run`` as given)."""
        record = self.record
        row = dict(zip(_ROW_HEAD, (self.line_no, self.timestamp, self.rank, run, record.verify_source)))
        row.update(zip(_ROW_MIDDLE, _ROW_MIDDLE_VALUES(record)))
        row["offenders"] = [{"fault": o.fault, **o.location()} for o in record.offenders] or None
        row.update(zip(PROVENANCE_FIELDS, _PROVENANCE_VALUES(record)))
        return row


#: The row's columns before the record's fields, the record's fields to ``micro_batch`` (SGLang's
#: five, the audit fields, the micro-batch) and their values at once.
_ROW_HEAD = ("line_no", "timestamp", "rank", "run", "verify_source")
_ROW_MIDDLE = FIELDS + AUDIT_FIELDS + ("micro_batch",)
_ROW_MIDDLE_VALUES = operator.attrgetter(*_ROW_MIDDLE)
_PROVENANCE_VALUES = operator.attrgetter(*PROVENANCE_FIELDS)


@dataclass(frozen=True, slots=True)
class LoggedRunStart:
    """A run start marker (``otel_swa_run_start=``) and where it was found in a log.

    Attributes:
        line_no, timestamp, rank: as in :class:`LoggedRecord`.
        verify_source: the tag before it (the records of that run carry the same one).
        pid: the process id it names, or ``None``.
        rank_candidates: see :class:`~otel_swa.record.RecordMatch`.
    """

    line_no: int
    timestamp: str | None = None
    rank: str | None = None
    verify_source: str | None = None
    pid: int | None = None
    rank_candidates: tuple = ()

    rank_sure = property(_rank_sure)


LoggedEntry = Union[LoggedRecord, LoggedRunStart, LivenessMatch]


class DuplicateLines:
    """Exact duplicate adjacent lines, read once: an entry (record, audit line, run start marker,
    liveness warning) on the line right after one of the same kind, text, log prefix (time and
    rank, one of them at least) and tag is the same log message written twice (two handlers on one logger, a log shipped
    to the same file twice). A reporter never writes one record twice, so such a line is skipped
    and counted here.

    Attributes:
        count: duplicate lines skipped.
        first_line_no: the line of the first one, or ``None``.
    """

    def __init__(self) -> None:
        self.count = 0
        self.first_line_no: int | None = None
        self._previous: Any = None  # the entry read before

    @staticmethod
    def _key(entry: Any) -> tuple:
        source = entry.record.verify_source if isinstance(entry, RecordMatch) else getattr(entry, "verify_source", None)
        return (type(entry), entry.text, entry.rank, entry.timestamp, source)

    def is_repeat(self, entry: Any) -> bool:
        """Whether ``entry`` repeats the entry read just before it, on the line before (then counted).
        An entry without a log prefix (no time, no rank), or read while several processes' log
        prefixes were waiting for their messages (:class:`~otel_swa.record.PrefixClaims`), is never
        taken for a repeat: it may be another process's line (the same audit line of two tensor
        parallel ranks)."""
        previous, self._previous = self._previous, entry
        if previous is None or type(previous) is not type(entry) or entry.line_no != previous.line_no + 1:
            return False  # the usual case, told without the keys: a line of another kind
        if self._key(previous) != self._key(entry):
            return False
        if entry.timestamp is None and entry.rank is None:
            return False
        if not getattr(entry, "rank_sure", True) or not getattr(previous, "rank_sure", True):
            return False  # written while several processes' prefixes were waiting: no repeat of one
        self.count += 1
        if self.first_line_no is None:
            self.first_line_no = entry.line_no
        return True


def logged_entries(
    text: str,
    *,
    first_line_no: int = 1,
    errors: list[MalformedRecordError] | None = None,
    pairing: AuditPairing | None = None,
    into: list | None = None,
    duplicates: DuplicateLines | None = None,
    prefixes: PrefixClaims | None = None,
) -> list[LoggedEntry]:
    """Every record, run start marker and liveness warning in ``text`` with its line number,
    timestamp and rank, in order; each audit line attached to its record; exact duplicate adjacent
    lines read once (:class:`DuplicateLines`).

    Args:
        text: log text (any number of lines).
        first_line_no: the line number of the first line of ``text`` in the whole log (when
            ``text`` is a later chunk of a file being followed).
        errors: when given, a :class:`~otel_swa.record.MalformedRecordError` is appended per
            malformed line (they are skipped), with its line number and reason.
        pairing, into: to read a log in chunks, the same :class:`~otel_swa.record.AuditPairing`
            and the list that holds the entries read so far (the new ones are appended to it, and
            an audit line may complete a record of an earlier chunk there).
        duplicates: to read a log in chunks, the same :class:`DuplicateLines` (it counts the
            duplicate lines skipped).
        prefixes: to read a log in chunks, the same :class:`~otel_swa.record.PrefixClaims`.

    Returns:
        the new entries, in order.
    """
    pairing = AuditPairing() if pairing is None else pairing
    duplicates = DuplicateLines() if duplicates is None else duplicates
    out = [] if into is None else into
    begin = len(out)
    # the latest record and the lines right after it that belong to it (its audit and provenance
    # lines), added with them at once: one copy of the record instead of one per line
    held, lines, applied = None, [], 0  # applied: how many of lines the held record carries already
    for entry in _ungrouped_repeats(iter_entries(text, errors, first_line_no=first_line_no, prefixes=prefixes,
                                                 groups=True), duplicates):
        if type(entry) is RecordGroup:  # a record read with its lines (their duplicates looked at)
            if held is not None:
                _add_record(pairing, out, held, lines, applied)
            held, lines = entry.entry, list(entry.lines)
            applied = len(lines)
            continue
        if duplicates.is_repeat(entry):
            continue
        if held is not None:
            if entry.per_record and pairing.joins(held, lines, entry):
                lines.append(entry)
                continue
            _add_record(pairing, out, held, lines, applied)
            held, lines, applied = None, [], 0
        if isinstance(entry, LivenessMatch):
            out.append(entry)
        elif entry.per_record:
            error = pairing.attach(entry)
            if error is not None and errors is not None:
                errors.append(error)
        elif isinstance(entry, RunStartMatch):
            out.append(LoggedRunStart(entry.line_no, entry.timestamp, entry.rank, entry.verify_source, entry.pid,
                                      entry.rank_candidates))
        else:
            held = entry
    if held is not None:
        _add_record(pairing, out, held, lines, applied)
    return out[begin:]


def _ungrouped_repeats(entries: Iterable, duplicates: DuplicateLines) -> Iterable:
    """``entries`` with each :class:`~otel_swa.record.RecordGroup` looked at for duplicates: its
    record and lines, in order (:meth:`DuplicateLines.is_repeat`); a group whose record repeats the
    entry before it is given as its lines alone, each to be looked at again (the record is skipped,
    its lines read one by one, as when read apart)."""
    for entry in entries:
        if type(entry) is RecordGroup:
            if duplicates.is_repeat(entry.entry):
                yield from entry.lines
                continue
            for line in entry.lines:  # after the record: another kind each, never a repeat
                duplicates.is_repeat(line)
        yield entry


def _add_record(pairing: AuditPairing, out: list, entry: RecordMatch, lines: list, applied: int = 0) -> None:
    """Add the record of ``entry`` with the ``lines`` that joined it (:meth:`AuditPairing.joins`),
    the first ``applied`` of them already applied to it."""
    record = pairing.with_lines(entry.record, lines[applied:], fresh=True)  # decoded for this entry, held nowhere else
    pairing.add(out, LoggedRecord(record, entry.line_no, entry.timestamp, entry.rank, entry.rank_candidates), lines)


def logged_records(
    text: str,
    *,
    first_line_no: int = 1,
    errors: list[MalformedRecordError] | None = None,
) -> list[LoggedRecord]:
    """Every record in ``text`` with its line number, timestamp and rank, in order (see
    :func:`logged_entries`; run start markers left out)."""
    return [e for e in logged_entries(text, first_line_no=first_line_no, errors=errors) if isinstance(e, LoggedRecord)]


#: How much of a log :class:`LogFollower` reads at once (bytes): the most text it holds.
READ_CHUNK_BYTES = 8 * 2**20


class LogFollower:
    """A log file read incrementally, while another process may still be appending to it.

    Each :meth:`poll` reads the bytes appended since the previous one and parses the complete lines
    among them; an unterminated last line is kept for the next poll, unless ``final=True``. The file
    may not exist yet (a server that has not started logging): :meth:`poll` then returns nothing and
    :attr:`missing` is true. A file that shrank (truncated by log rotation) is read again from its
    start, its line numbers from 1 again.

    Bytes are decoded as UTF-8; undecodable bytes become U+FFFD, so binary noise cannot stop the
    reader. Only the entries are kept, not the text.

    Attributes:
        path: the file.
        entries: every :class:`LoggedRecord`, :class:`LoggedRunStart` and
            :class:`~otel_swa.record.LivenessMatch` found so far, in order (the ``entries`` list
            given, such as an :class:`otel_swa.logstream.EntryWindow` that holds only its tail).
        duplicates: the exact duplicate adjacent lines skipped (:class:`DuplicateLines`).
        errors: a :class:`~otel_swa.record.MalformedRecordError` per malformed line skipped.
        cut_line: the unterminated last line at the last poll when it cannot be read (left out:
            :class:`CutLine`), else ``None``.
        missing: the file did not exist at the last poll.
        error: the ``OSError`` of the last poll when the file exists but cannot be read
            (permission denied, a directory...), else ``None``.
    """

    def __init__(self, path: str | os.PathLike[str], entries: "list[LoggedEntry] | None" = None) -> None:
        self.path = Path(path)
        self.entries: list[LoggedEntry] = [] if entries is None else entries
        self.errors: list[MalformedRecordError] = []
        self.missing = False
        self.error: OSError | None = None
        self.cut_line: CutLine | None = None
        self._pairing = AuditPairing()
        self.duplicates = DuplicateLines()
        self._prefixes = PrefixClaims()
        self._offset = 0
        self._next_line_no = 1
        self._pending = b""
        # the last byte parsed was a CR: a LF at the start of the next read completes that CRLF
        self._after_cr = False
        self._head = b""  # the file's first TEXT_PROBE_BYTES bytes read so far (not_a_text_log)

    @property
    def records(self) -> list[LoggedRecord]:
        """Every :class:`LoggedRecord` found so far, in order."""
        return [entry for entry in self.entries if isinstance(entry, LoggedRecord)]

    @property
    def malformed(self) -> int:
        """How many malformed lines were skipped."""
        return len(self.errors)

    def poll(self, *, final: bool = False, each_chunk: "Callable[[], None] | None" = None,
             chunk_bytes: int | None = None) -> list[LoggedRecord]:
        """Read what was appended since the last poll; return the new records.

        Args:
            final: also parse an unterminated last line (the writer is done or the wait is over),
                unless it cannot be read: then it is left out and kept for a later poll. At any
                poll, :attr:`cut_line` says when the unterminated last line cannot be read.
            each_chunk: called after each chunk is parsed (to take the entries that are final:
                :meth:`settled`); the new records are then not returned (an empty list).
            chunk_bytes: how much to read at once (default :data:`READ_CHUNK_BYTES`).

        Never raises for a missing or unreadable file: see :attr:`missing` and :attr:`error`
        (what ``each_chunk`` raises, or a :attr:`entries` list that refuses a line, stops the read).
        """
        try:
            with open(self.path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if size < self._offset:  # truncated in place: start again from the top
                    self._offset = 0
                    self._pending = b""
                    self._next_line_no = 1
                    self._after_cr = False
                    self._pairing = AuditPairing()
                    self.duplicates = DuplicateLines()
                    self._prefixes = PrefixClaims()
                    self._head = b""
                if self._offset:  # a pipe (`check <(engine ...)`) cannot seek, and is read from its start once
                    handle.seek(self._offset)
                new: list[LoggedRecord] = []
                while True:  # in chunks: the text held at once is one chunk, whatever the file's size
                    data = handle.read(chunk_bytes or READ_CHUNK_BYTES)
                    if not data:
                        break
                    if len(self._head) < TEXT_PROBE_BYTES:
                        self._head += data[:TEXT_PROBE_BYTES - len(self._head)]
                    self._offset += len(data)
                    parsed = self._parse(data, final=False)
                    if each_chunk is None:
                        new += parsed
                    else:
                        each_chunk()
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
        new += self._parse(b"", final=final)
        if each_chunk is not None:
            each_chunk()
            return []
        return new

    @property
    def not_text(self) -> str | None:
        """Why the file is not a text log (:func:`not_a_text_log` on its first
        :data:`TEXT_PROBE_BYTES` bytes read so far: a NUL byte, mostly bytes that are not UTF-8),
        else ``None`` (an empty file, or one of blanks so far, is not refused here: it may grow)."""
        why = not_a_text_log(self._head) if self._head else None
        return None if why == "empty" else why

    def settled(self, waiting: bool = True) -> int:
        """How many of :attr:`entries` are final: no line still to be read can change them (their
        records have every line that pairs with them, or can get none any more); without
        ``waiting``, how many no line is expected to change (the latest record of each tag and rank
        excepted: a record still waiting for a line written far from it is counted too, see
        :meth:`~otel_swa.record.AuditPairing.oldest_held`)."""
        return self._pairing.oldest_held(self.entries, waiting)

    def _parse(self, data: bytes, final: bool) -> list[LoggedRecord]:
        """Parse the complete lines of what is pending plus ``data`` (and, when ``final``, the
        last line without its line end, unless it cannot be read); return the new records."""
        data = self._pending + data
        cut = data.rfind(b"\n") + 1
        complete, self._pending = data[:cut], data[cut:]
        self.cut_line = None
        if self._pending:  # a last line without its line end: cut in the middle, or whole?
            end = max(cut, data.rfind(b"\r") + 1)
            last = data[end:]
            error = unreadable(last.decode("utf-8", errors="replace")) if last else None
            if error is not None:  # left out (and kept, in case the file grows), and said
                self.cut_line = CutLine(self._next_line_no + complete.count(b"\n"), error.reason)
                if final:
                    complete, self._pending = data[:end], last
            elif final:  # whole, or lines ended by bare CRs: read at the final poll
                complete, self._pending = data, b""
        if not complete:
            return []
        if self._after_cr and complete.startswith(b"\n"):
            # the CR that ended the previous read was the first half of a CRLF: one line end,
            # counted here (line numbers count LF line ends, as grep -n does)
            complete = complete[1:]
            self._next_line_no += 1
        self._after_cr = complete.endswith(b"\r")
        if not complete:
            return []
        text = complete.decode("utf-8", errors="replace")
        new = logged_entries(text, first_line_no=self._next_line_no, errors=self.errors,
                             pairing=self._pairing, into=self.entries, duplicates=self.duplicates,
                             prefixes=self._prefixes)
        self._next_line_no += text.count("\n")  # LF line ends: a bare CR does not start a numbered line
        return [entry for entry in new if isinstance(entry, LoggedRecord)]


def read_data(source: str | os.PathLike[str] | BinaryIO | None) -> "bytes | str":
    """The whole content of a log: a file path, ``"-"`` or ``None`` (standard input, read to its
    end), or a binary (or text) stream.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: the file cannot be read.
    """
    if source is None or (isinstance(source, str) and source == "-"):
        return sys.stdin.buffer.read()
    if isinstance(source, (str, os.PathLike)):
        if os.path.isfile(source):
            return Path(source).read_bytes()
        with open(source, "rb", buffering=0) as stream:  # a FIFO, a pipe's path, a character device
            return _read_to_end(stream)
    return source.read()


def _read_to_end(stream: BinaryIO) -> bytes:
    """``stream`` (unbuffered) read to its end, a chunk at a time, waiting in ``select`` for at most
    0.25 s at once: a Ctrl-C that comes between two reads (the C read loop of ``stream.read()``
    would not see it until more data came: the command then hung on a FIFO whose writer stayed
    open) is handled within that time."""
    fd = stream.fileno()
    chunks = []
    while True:
        ready, _, _ = select.select([fd], [], [], 0.25)
        if not ready:
            continue  # the interpreter runs a pending signal handler here
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def decode_log(data: "bytes | str") -> str:
    """Log content as text: bytes decoded as UTF-8, undecodable bytes as U+FFFD."""
    return data if isinstance(data, str) else data.decode("utf-8", errors="replace")


#: How much of a log :func:`not_a_text_log` looks at (bytes).
TEXT_PROBE_BYTES = 65536
#: The share of undecodable bytes in that much above which a log is not UTF-8 text.
UNDECODABLE_SHARE = 0.1


def not_a_text_log(data: "bytes | str") -> str | None:
    """Why ``data`` (a log's content, or its start) is no log to read records from, else ``None``:
    ``"empty"`` (no text at all, or only blanks), or ``"not a text log"`` with the reason (a NUL
    byte, which text never holds: a binary file, or text in UTF-16; or more than
    :data:`UNDECODABLE_SHARE` of the first :data:`TEXT_PROBE_BYTES` bytes not UTF-8)."""
    if not data.strip():
        return "empty"
    if isinstance(data, str):
        return None
    head = data[:TEXT_PROBE_BYTES]
    nul = head.find(b"\0")
    if nul >= 0:
        return f"not a text log (a NUL byte at byte {nul}: a binary file, or text that is not UTF-8)"
    bad = head.decode("utf-8", errors="replace").count("\ufffd") - head.decode("utf-8", errors="ignore").count("\ufffd")
    if bad > UNDECODABLE_SHARE * len(head):
        return f"not a text log ({bad} of its first {len(head)} bytes are not UTF-8)"
    return None


def _read_text(source: str | os.PathLike[str] | BinaryIO | None) -> str:
    return decode_log(read_data(source))


def read_entries(
    source: str | os.PathLike[str] | BinaryIO | None,
    *,
    errors: list[MalformedRecordError] | None = None,
) -> list[LoggedEntry]:
    """All records and run start markers of a complete log (see :func:`logged_entries`): a file
    path, ``"-"`` (standard input, read to its end), or a binary (or text) stream.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: the file cannot be read.
    """
    return logged_entries(_read_text(source), errors=errors)


def read_log(
    source: str | os.PathLike[str] | BinaryIO | None,
    *,
    errors: list[MalformedRecordError] | None = None,
) -> list[LoggedRecord]:
    """All records of a complete log (see :func:`read_entries`; run start markers left out).

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: the file cannot be read.
    """
    return [entry for entry in read_entries(source, errors=errors) if isinstance(entry, LoggedRecord)]


def group_by_rank(records: Iterable[LoggedRecord]) -> dict[str | None, list[SwaDivergenceRecord]]:
    """The records of each rank, in log order; ranks in order of first appearance (``None`` = no rank)."""
    groups: dict[str | None, list[SwaDivergenceRecord]] = {}
    for item in records:
        groups.setdefault(item.rank, []).append(item.record)
    return groups
