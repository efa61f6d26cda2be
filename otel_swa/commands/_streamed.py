"""A complete regular log file read once, each record handed on with its run, for ``records`` and ``plot``.

:func:`stream_runs` reads the file and splits its runs as it goes
(:func:`~otel_swa.testing.streaming.stream_split`, as ``check`` judges it): memory bounded by the
log's ranks and one chunk. It gives up, and the caller reads the log whole, exactly when the
streamed split could differ from :func:`~otel_swa.testing.runs.split_runs` on the whole log.
"""

from __future__ import annotations

import sys
from typing import Callable

from otel_swa.commands._loginput import source_name
from otel_swa.logsource import LoggedRecord, LogFollower
from otel_swa.testing.runs import RunRecord
from otel_swa.testing.streaming import stream_split

__all__ = ["stream_runs"]


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
    read = stream_split(path, on_record, left_out_ok=False)
    if read is None:
        return None
    follower, _ = read
    if follower.cut_line is not None:
        print(f"otel-swa: {source_name(path)}: {follower.cut_line.describe()}", file=sys.stderr)
    return follower
