"""A complete regular log file read once, each record handed on with its run, for ``records`` and ``plot``.

:func:`stream_runs` reads the file with :func:`~otel_swa.logstream.stream_log` and splits its runs
with :class:`~otel_swa.testing.runs.RunSplitter` as it goes (``whole=None``): memory bounded by
the log's ranks and one chunk. It gives up, and the caller reads the log whole, exactly when the
streamed split could differ from :func:`~otel_swa.testing.runs.split_runs` on the whole log.
"""

from __future__ import annotations

import sys
from typing import Callable

from otel_swa.commands._loginput import source_name
from otel_swa.logsource import LoggedRecord, LogFollower
from otel_swa.logstream import ReleasedEntryError, stream_log
from otel_swa.testing.runs import RunRecord, RunSplitter

__all__ = ["stream_runs"]

#: Entries read between two looks at :attr:`RunSplitter.unsure` (a log that needs the whole read
#: is given up early).
_LOOK_EVERY = 4096


class _NeedsWholeLog(Exception):
    """The runs of this log need the whole log to be split (:attr:`RunSplitter.unsure`)."""


def stream_runs(path: str, on_record: Callable[[LoggedRecord, RunRecord], None]) -> LogFollower | None:
    """Read the complete regular file at ``path`` once, calling ``on_record(entry, item)`` with
    each record as it is read and its :class:`~otel_swa.testing.runs.RunRecord` (its writer, run
    and rank as :func:`~otel_swa.testing.runs.split_runs` names them on the whole log, once this
    returns a follower).

    Returns:
        the :class:`~otel_swa.logsource.LogFollower` that read it (``errors``: the malformed
        lines; a cut last line is said on stderr, ``otel-swa: log file 'run.log': the last line
        ...``), or ``None`` when the log must be read whole, and what ``on_record`` was given
        thrown away: the runs need the whole log (lines of several processes at once, a record
        that fits no rank and is left out, names that the prefixes' votes change), a line belongs
        to a record already handed on (:class:`~otel_swa.logstream.ReleasedEntryError`), or the
        file could not be read to its end (removed, an error, not text).
    """
    splitter = RunSplitter(whole=None)
    read = 0

    def consume(entry: object) -> None:
        nonlocal read
        item = splitter.add(entry)
        if isinstance(entry, LoggedRecord):
            if item is None:
                raise _NeedsWholeLog  # left out: the whole log's rows say how
            on_record(entry, item)
        read += 1
        if read % _LOOK_EVERY == 0 and splitter.unsure:
            raise _NeedsWholeLog

    try:
        follower = stream_log(path, consume)
    except (_NeedsWholeLog, ReleasedEntryError):
        return None
    splitter.finish()
    if follower.missing or follower.error is not None or follower.not_text is not None or splitter.unsure:
        return None
    if follower.cut_line is not None:
        print(f"otel-swa: {source_name(path)}: {follower.cut_line.describe()}", file=sys.stderr)
    return follower
