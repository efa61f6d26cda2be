"""Where the judged records come from: a log file (possibly still growing), log text, captured
output, a list of records, or the ``swa_records`` capture.

Each source reads what it has so far and hands the judge (:mod:`otel_swa.testing.judge`) its
records with writer, rank and run (:func:`otel_swa.testing.runs.split_runs`), plus what it can
say about itself (malformed lines, an unreadable file, empty text). Sources never judge.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence, Union

from otel_swa.logsource import CutLine, DuplicateLines, LogFollower, logged_entries, split_cut_line
from otel_swa.record import LINE_PREFIX, MalformedRecordError, SwaDivergenceRecord
from otel_swa.testing.runs import RunRecord, split_runs

__all__ = ["Snapshot", "Source", "SourceLike", "open_source", "text_source", "text_of", "follower_problem",
           "cut_line_note", "CUT_LINE_NOTE"]

#: How the note about a cut last line begins in an explanation.
CUT_LINE_NOTE = "cut line:"


def cut_line_note(cut: CutLine, where: str | None = None) -> str:
    """The explanation's note for a last line left out (:class:`otel_swa.logsource.CutLine`)."""
    return f"{CUT_LINE_NOTE} {'' if where is None else where + ': '}{cut.describe()}"


@dataclass
class Snapshot:
    """What a source holds at one read.

    Attributes:
        records: every record so far, with writer, rank and run.
        errors: the malformed lines skipped (line number and reason).
        problem: why the source cannot be read, else ``None``.
        empty: the source holds no text at all.
        duplicates, first_duplicate_line_no: exact duplicate adjacent lines read once
            (:class:`otel_swa.logsource.DuplicateLines`).
        notes: what the reading did that the explanation should say (a cut last line left out).
    """

    records: list[RunRecord]
    errors: list[MalformedRecordError] = field(default_factory=list)
    problem: str | None = None
    empty: bool = False
    duplicates: int = 0
    first_duplicate_line_no: int | None = None
    notes: tuple[str, ...] = ()


class Source:
    """A readable source of records: ``read(final)`` returns everything seen so far.

    Attributes:
        describe: the source in words, for the explanation.
        growing: whether it can still grow (and is worth waiting for).
    """

    describe = "records"
    growing = False

    def read(self, final: bool = False) -> Snapshot:  # pragma: no cover - interface
        raise NotImplementedError


def text_of(value: str | bytes) -> str:
    """``value`` as text (bytes decoded as UTF-8, undecodable bytes as U+FFFD).

    Raises:
        TypeError: ``value`` is neither ``str`` nor ``bytes``.
    """
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if not isinstance(value, str):
        raise TypeError(f"a text source must return str or bytes, got {type(value).__name__}")
    return value


def follower_problem(follower: LogFollower) -> str | None:
    """Why a followed file cannot be read (missing, permission...) or is no text log (a NUL byte:
    :attr:`~otel_swa.logsource.LogFollower.not_text`), else ``None``."""
    path = os.fspath(follower.path)
    if follower.missing:
        return f"log file {path!r} does not exist"
    if follower.error is not None:
        return f"log file {path!r} cannot be read ({follower.error.strerror or follower.error})"
    if follower.not_text is not None:  # a binary file, whether records stand in it or not
        return f"log file {path!r} is {follower.not_text}"
    return None


class _FileSource(Source):
    growing = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.follower = LogFollower(path)
        self.describe = os.fspath(path)

    def read(self, final: bool = False) -> Snapshot:
        follower = self.follower
        follower.poll(final=final)
        cut = () if follower.cut_line is None else (cut_line_note(follower.cut_line),)
        return Snapshot(split_runs(follower.entries), list(follower.errors), follower_problem(follower),
                        duplicates=follower.duplicates.count,
                        first_duplicate_line_no=follower.duplicates.first_line_no, notes=cut)


class _TextSource(Source):
    def __init__(self, get_text: Callable[[], str | bytes], describe: str, growing: bool) -> None:
        self.get_text = get_text
        self.describe = describe
        self.growing = growing

    def read(self, final: bool = False) -> Snapshot:
        text = text_of(self.get_text())
        errors: list[MalformedRecordError] = []
        duplicates = DuplicateLines()
        whole, cut = split_cut_line(text)
        entries = logged_entries(whole, errors=errors, duplicates=duplicates)
        return Snapshot(split_runs(entries), errors, empty=not text.strip(), duplicates=duplicates.count,
                        first_duplicate_line_no=duplicates.first_line_no,
                        notes=() if cut is None else (cut_line_note(cut),))


def text_source(text: str | bytes, describe: str) -> Source:
    """A fixed source of log text read once (``describe``: the text in words, e.g. "standard input")."""
    return _TextSource(lambda: text, describe, growing=False)


class _RecordsSource(Source):
    def __init__(self, items: Sequence[SwaDivergenceRecord], describe: str) -> None:
        for record in items:
            if not isinstance(record, SwaDivergenceRecord):
                raise TypeError(f"expected SwaDivergenceRecord items, got {type(record).__name__}: {record!r}")
        self.items = list(items)
        self.describe = describe

    def read(self, final: bool = False) -> Snapshot:
        return Snapshot(split_runs(self.items))


#: What :func:`open_source` accepts (see there); ``object`` stands for a ``SwaRecordCapture``.
SourceLike = Union[
    str, "os.PathLike[str]", bytes, Callable[[], Union[str, bytes]], Iterable[SwaDivergenceRecord], object
]


def open_source(source: SourceLike) -> Source:
    """Adapt what the caller has to a record source.

    Accepted:
        * a :class:`Source` (returned as it is);
        * a :class:`~otel_swa.testing.SwaRecordCapture` (the ``swa_records`` fixture): its sink,
          captured logging and followed files; grows when it follows a file or captured output;
        * a path (``str`` or ``os.PathLike``) of a log file, possibly still being written (grows);
        * log text: a ``str`` holding a newline or the record prefix, an empty or blank ``str``
          (e.g. the empty ``stdout`` of an engine that crashed: no records, judged at once), or
          ``bytes`` (fixed);
        * a callable returning the whole log text so far, e.g. captured server output (grows);
        * an object with ``getvalue()`` (``io.StringIO``) holding the log text (grows);
        * an iterable of :class:`~otel_swa.record.SwaDivergenceRecord` (fixed; no rank, runs
          where ``forward_ct`` goes back).

    Raises:
        TypeError: ``source`` is none of these, or an iterable holds something else than records.
    """
    if isinstance(source, Source):
        return source
    as_source = getattr(source, "_as_source", None)
    if callable(as_source):
        return as_source()
    if isinstance(source, bytes):
        return _TextSource(lambda: source, "log text", growing=False)
    if isinstance(source, str):
        if not source.strip():
            return _TextSource(lambda: source, "empty log text", growing=False)
        if "\n" in source or LINE_PREFIX in source:
            return _TextSource(lambda: source, "log text", growing=False)
        return _FileSource(source)
    if isinstance(source, os.PathLike):
        return _FileSource(source)
    getvalue = getattr(source, "getvalue", None)
    if callable(getvalue):
        return _TextSource(getvalue, "captured output", growing=True)
    if callable(source):
        return _TextSource(source, "captured output", growing=True)
    if isinstance(source, Iterable):
        return _RecordsSource(list(source), "records")
    raise TypeError(
        "source must be a log file path, log text, a callable returning log text, a SwaRecordCapture or "
        f"an iterable of SwaDivergenceRecord; got {type(source).__name__}: {source!r}"
    )
