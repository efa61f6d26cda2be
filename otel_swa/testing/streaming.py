"""The verdict on a complete log file read once, in order, without holding its records: each
record is split into its run and rank (:class:`~otel_swa.testing.runs.RunSplitter`) and counted
(:class:`~otel_swa.testing.tally.Tally`) as it is read, then let go, so memory is bounded by the
log's ranks and runs, not by its length.

:func:`judge_log_file` gives the verdict :func:`~otel_swa.testing.assertions.wait_for_observation`
gives for one final read of the file, or ``None`` when the log needs what only the whole log shows
to split its runs (lines written by several processes at once, a rank's run begun by a guess,
names its prefixes' votes change) or to pair its lines (a line written far from its record:
:class:`~otel_swa.logstream.ReleasedEntryError`): the caller then reads it whole.

This module does not import pytest.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from otel_swa.logsource import LoggedRecord, LogFollower
from otel_swa.logstream import ReleasedEntryError, stream_log
from otel_swa.testing.judge import SwaObservation, check_rules, judge_tally
from otel_swa.testing.runs import RunRecord, RunSplitter
from otel_swa.testing.sources import cut_line_note, follower_problem
from otel_swa.testing.tally import Tally

__all__ = ["judge_log_file", "stream_split"]

#: How many entries are read between two looks at whether the split still holds.
_LOOK_EVERY = 4096


class _NeedsWholeLog(Exception):
    """The split of this log needs the whole log (:attr:`RunSplitter.unsure`)."""


def stream_split(path: "str | os.PathLike[str]", on_item: Callable[[Any, RunRecord], None], *,
                 left_out_ok: bool = True) -> "tuple[LogFollower, Any] | None":
    """Read the complete log file at ``path`` once, splitting its entries into runs and ranks as
    they are read (:class:`~otel_swa.testing.runs.RunSplitter`), and call ``on_item(entry, item)``
    with each record's entry and its :class:`~otel_swa.testing.runs.RunRecord`, then let it go.

    Returns:
        the :class:`~otel_swa.logsource.LogFollower` that read it and what the split found besides
        (:meth:`RunSplitter.finish`); ``None`` when the log must be read whole, and what
        ``on_item`` was given thrown away: the runs need the whole log (lines of several processes
        at once, names that the prefixes' votes change; with ``left_out_ok`` false, a record that
        fits no rank and is left out), a line belongs to a record already handed on
        (:class:`~otel_swa.logstream.ReleasedEntryError`), or the file could not be read to its end
        (missing, an error, not text).
    """
    splitter = RunSplitter(whole=None)
    read = 0

    def consume(entry: object) -> None:
        nonlocal read
        item = splitter.add(entry)
        if item is not None:
            on_item(entry, item)
        elif not left_out_ok and isinstance(entry, LoggedRecord):
            raise _NeedsWholeLog  # left out: only the whole log says how
        read += 1
        if read % _LOOK_EVERY == 0 and splitter.unsure:
            raise _NeedsWholeLog

    try:
        follower = stream_log(path, consume)
    except (_NeedsWholeLog, ReleasedEntryError):
        return None
    if follower_problem(follower) is not None:
        return None
    extras = splitter.finish()
    if splitter.unsure:
        return None
    return follower, extras


def judge_log_file(
    path: "str | os.PathLike[str]",
    *,
    min_divergence: int = 1,
    min_out_of_window: int = 1,
    require_verify_lag: bool = True,
    require_clean_audit: bool = True,
    runs: str = "last",
    ranks: str = "each",
    lines: str = "auto",
    name: str | None = None,
) -> SwaObservation | None:
    """Judge the complete log file at ``path`` (the rules and modes of
    :func:`~otel_swa.testing.judge.judge`) reading it once and keeping no record.

    Returns:
        the :class:`~otel_swa.testing.judge.SwaObservation` of one final read of the file
        (``source`` is ``name``, else the path; a cut last line is left out and noted), or ``None`` when the file
        cannot be read (missing, permission...) or its runs and ranks need the whole log to be
        split: read it whole then (:func:`~otel_swa.testing.assertions.wait_for_observation`).

    Raises:
        ValueError: a threshold is not an int >= 0, or a mode is not one of its choices.
    """
    check_rules(min_divergence, min_out_of_window, runs, ranks, lines)
    tally = Tally(runs, ranks)
    read = stream_split(path, lambda entry, item: tally.add(item))
    if read is None:
        return None
    follower, extras = read
    observation = judge_tally(
        tally, extras, min_divergence=min_divergence, min_out_of_window=min_out_of_window,
        require_verify_lag=require_verify_lag, require_clean_audit=require_clean_audit, runs=runs, ranks=ranks,
        lines=lines, source=name or os.fspath(path), errors=list(follower.errors), duplicates=follower.duplicates.count,
        first_duplicate_line_no=follower.duplicates.first_line_no)
    if follower.cut_line is not None:  # what reading did, before the judge's notes
        observation = dataclasses.replace(observation, notes=(cut_line_note(follower.cut_line),) + observation.notes)
    return observation
