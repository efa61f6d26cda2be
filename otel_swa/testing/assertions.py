"""Assert that a run shows the SWA path working, waiting for it while the log is being written.

The fronts of the one CI verdict, :func:`otel_swa.testing.judge.judge` (its module docstring has
the rules: peaks of divergence and out-of-window, the verify lag on the last record, a clean SWA
slot audit, the last run, every rank): :func:`wait_for_observation` reads a source (see
:func:`otel_swa.testing.sources.open_source`) until the verdict is a pass or the time is up, and
:func:`assert_swa_divergence_observed` raises :class:`SwaDivergenceNotObserved` when it is not.
``otel-swa check`` and the ``swa_records`` fixture use them too.

This module does not import pytest.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

from otel_swa.testing.judge import SIGNALS, SwaObservation, check_modes, judge
from otel_swa.testing.sources import Snapshot, Source, SourceLike, open_source
from otel_swa.testing.runs import RunRecord, RunRecords

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_POLL_S",
    "DEFAULT_QUIET_S",
    "UNTIL_MODES",
    "INTERRUPTED_NOTE",
    "SIGNALS",
    "SwaDivergenceNotObserved",
    "SwaObservation",
    "judge",
    "open_source",
    "judge_snapshot",
    "wait_for_observation",
    "assert_swa_divergence_observed",
]

#: Default wait for a source that can still grow (a log file, captured output), in seconds.
DEFAULT_TIMEOUT_S = 30.0
#: Default pause between two reads of a growing source, in seconds.
DEFAULT_POLL_S = 0.25
#: With ``until="end"``: seconds without anything new in the source after which its run has ended.
DEFAULT_QUIET_S = 5.0
#: When a wait ends: at the first read that passes, or at the end of the run being written.
UNTIL_MODES = ("pass", "end")
#: The note that starts the explanation of a wait ended by Ctrl-C (``judge_on_interrupt``).
INTERRUPTED_NOTE = "interrupted (Ctrl-C)"


class SwaDivergenceNotObserved(AssertionError):
    """The SWA path was not observed; the message explains what was seen.

    Attributes:
        observation: the :class:`~otel_swa.testing.judge.SwaObservation` that failed.
    """

    def __init__(self, observation: SwaObservation) -> None:
        self.observation = observation
        super().__init__(observation.explain())


def _is_seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def judge_snapshot(snapshot: Snapshot, describe: str, waited_s: float = 0.0, **rules) -> SwaObservation:
    """:func:`~otel_swa.testing.judge.judge` on what a source read (``rules``: its keyword arguments)."""
    observation = judge(snapshot.records, errors=snapshot.errors, source=describe, waited_s=waited_s,
                        problem=snapshot.problem, empty=snapshot.empty, duplicates=snapshot.duplicates,
                        first_duplicate_line_no=snapshot.first_duplicate_line_no, **rules)
    if snapshot.notes:  # what reading did (a cut last line left out), before the judge's notes
        observation = dataclasses.replace(observation, notes=snapshot.notes + observation.notes)
    return observation


def _awaits_audit_line(records: Sequence[RunRecord]) -> bool:
    """Whether the last record of some place is otel-swa's and has no audit line yet, or no
    provenance line where the place's records carry them (a line sink writes them right after the
    record, in writes of their own)."""
    last: dict = {}
    provenance: set = set()
    for item in records:
        last[item.part] = item.record
        if item.record.provenance_checked:
            provenance.add(item.part)
    return any(record.verify_source is not None
               and (record.audit_line() is None or (part in provenance and not record.provenance_checked))
               for part, record in last.items())


def _part_counts(records: Sequence[RunRecord]) -> dict:
    """How many records (and runs without records) each part (place of the source) holds."""
    counts: dict = {}
    for item in list(records) + list(getattr(records, "silent", ())):
        counts[item.part] = counts.get(item.part, 0) + 1
    return counts


def _extras(records: Sequence[RunRecord]) -> RunRecords:
    return records if isinstance(records, RunRecords) else RunRecords(records)


def _signature(snapshot: Snapshot) -> tuple:
    """What a read found, to tell a source that grew from one that stayed quiet."""
    records = snapshot.records
    return (len(records), len(getattr(records, "silent", ())), len(getattr(records, "warnings", ())),
            len(snapshot.errors), snapshot.problem)


def _last_runs(records: Sequence[RunRecord]) -> dict:
    """The latest run of each place and writer."""
    last: dict = {}
    for item in list(records) + list(getattr(records, "silent", ())):
        key = (item.part, item.writer)
        last[key] = max(last.get(key, 0), item.run)
    return last


def _up_to(snapshot: Snapshot, runs: dict) -> Snapshot:
    """``snapshot`` without the runs that began after ``runs`` (the latest run of each place and
    writer when the wait's run began)."""
    records = snapshot.records
    keep = lambda item: item.run <= runs.get((item.part, item.writer), item.run)  # noqa: E731
    extras = records if isinstance(records, RunRecords) else RunRecords(records)
    kept = extras.derive([item for item in records if keep(item)])
    kept.silent = tuple(run for run in kept.silent if keep(run))
    kept.warnings = tuple(w for w in kept.warnings if keep(w))
    return dataclasses.replace(snapshot, records=kept)


def _run_being_written(snapshot: Snapshot, already: dict) -> tuple[Snapshot, tuple[str, ...]]:
    """The records of the places (parts) that got records since the first read (``already``: the
    records of each part then), whole, so that the run being written is judged with its earlier
    records and its ranks' earlier runs (a dead rank); and the note saying what was left out."""
    records = snapshot.records
    counts = _part_counts(records)
    growing = {part for part, count in counts.items() if count > already.get(part, 0)}
    if not growing:
        before = sum(already.values())
        note = (f"new only: no record was written during the wait; the {before} record(s) already in the source "
                "when it began were not judged" if before else "new only: no record was written during the wait")
        return dataclasses.replace(snapshot, records=_extras(records).derive((), parts=set())), (note,)
    left_out = sum(count for part, count in counts.items() if part not in growing)
    kept = _extras(records).derive((item for item in records if item.part in growing), parts=growing)
    notes = (f"new only: {left_out} record(s) of places that got no record during the wait were not judged",) if left_out else ()
    return dataclasses.replace(snapshot, records=kept), notes


def wait_for_observation(
    source: SourceLike,
    *,
    min_divergence: int = 1,
    min_out_of_window: int = 1,
    require_verify_lag: bool = True,
    require_clean_audit: bool = True,
    runs: str = "last",
    ranks: str = "each",
    lines: str = "auto",
    timeout_s: float | None = None,
    poll_s: float = DEFAULT_POLL_S,
    new_only: bool = False,
    until: str = "pass",
    quiet_s: float = DEFAULT_QUIET_S,
    judge_on_interrupt: bool = False,
    on_waiting: Callable[[SwaObservation], None] | None = None,
) -> SwaObservation:
    """Read ``source`` until the verdict is a pass (``until="pass"``) or the run being written has
    ended (``until="end"``), or ``timeout_s`` has passed; never raises for what the source holds.

    A source that can grow (file, captured output, a capture following one) is read again every
    ``poll_s`` seconds until the verdict is a pass, up to ``timeout_s`` (default
    :data:`DEFAULT_TIMEOUT_S`; for a fixed source the default is 0, i.e. one read). The last read
    is a final one: an unterminated last line counts too. A missing log file is waited for like a
    late record; if it still does not exist at the end, :attr:`SwaObservation.problem` says so.
    The wait ends at the first read that passes: a fault logged later is not seen then (judge the
    finished log again for that). A pass whose last record is otel-swa's and has no audit line yet
    (or no provenance line where the records carry them) is read once more, one ``poll_s`` later:
    the line sink writes those lines right after it.

    ``new_only``: judge only the run being written, into a log that already holds finished runs
    (``--log-file`` appends): nothing passes until a record is written during the wait; then the
    runs judged (``runs``, default the last) are those of the places (a file, the capture's sink)
    that got it, with all their records, so the run being written is judged whole (a fault it
    logged before the wait began still fails it) and a rank of an earlier run that wrote nothing
    in it is a dead rank; a finished earlier run that passes never passes for the one being written.

    ``until="end"``: judge the run being written whole, once it has ended: when the source shows a
    run that began after it (the next run's start marker or records: that later run is left out
    and the ended one judged), or when nothing new was read for ``quiet_s`` seconds (default
    :data:`DEFAULT_QUIET_S`: the engine stopped writing), or, at the latest, at ``timeout_s`` (the
    explanation then says the run had not ended). A pass never ends the wait early, so a fault
    logged after the first passing read still fails. What a server log needs: judged after the
    requests, whole.

    Args:
        min_divergence, min_out_of_window, require_verify_lag, require_clean_audit, runs, ranks,
            lines: the rules and what is judged, as :func:`~otel_swa.testing.judge.judge`.
        judge_on_interrupt: a :class:`KeyboardInterrupt` (Ctrl-C) during a pause between two
            reads ends the wait: one final read is judged, with the note :data:`INTERRUPTED_NOTE`
            first (``otel-swa check``); default: it propagates, as anywhere else.
        on_waiting: called once, with the observation of the read before it, at the first pause
            that waits for the source to change (not the one poll a pass waits for an audit line).

    Raises:
        ValueError: a threshold is not an int >= 0, a mode is not one of its choices,
            ``timeout_s`` < 0, ``poll_s`` <= 0 or ``quiet_s`` <= 0 (or not finite), ``until`` not
            one of :data:`UNTIL_MODES`.
        TypeError: ``source`` is of no accepted kind (see :func:`open_source`).
    """
    if until not in UNTIL_MODES:
        raise ValueError(f"until={until!r}; expected one of {', '.join(UNTIL_MODES)}")
    if not _is_seconds(quiet_s) or not quiet_s > 0:
        raise ValueError(f"quiet_s must be a finite number of seconds > 0, got {quiet_s!r}")
    rules = dict(min_divergence=min_divergence, min_out_of_window=min_out_of_window,
                 require_verify_lag=require_verify_lag, require_clean_audit=require_clean_audit,
                 runs=runs, ranks=ranks, lines=lines)
    for name in ("min_divergence", "min_out_of_window"):
        value = rules[name]
        if type(value) is not int or value < 0:  # noqa: E721 - bool refused
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    check_modes(runs, ranks, lines)
    src: Source = open_source(source)
    if timeout_s is None:
        timeout_s = DEFAULT_TIMEOUT_S if src.growing else 0.0
    if not _is_seconds(timeout_s) or not timeout_s >= 0:
        raise ValueError(f"timeout_s must be a finite number of seconds >= 0, got {timeout_s!r}")
    if not _is_seconds(poll_s) or not poll_s > 0:
        raise ValueError(f"poll_s must be a finite number of seconds > 0, got {poll_s!r}")
    if not src.growing:
        timeout_s = 0.0  # a fixed source cannot change: one read, whatever timeout was asked
    start = time.monotonic()
    deadline = start + timeout_s
    already = None  # with new_only: records in the source when the wait began
    settled = None  # the record count at which a pass waited one poll for a last audit line
    runs_then = None  # with until="end": the latest runs when the run being judged was first read
    seen, changed = None, start  # with until="end": the last read's findings, and when they last changed
    interrupted = False
    first = True

    def pause(seconds: float, settling: bool = False) -> None:
        nonlocal interrupted, first
        try:  # a Ctrl-C right after the waiting line is one during the pause
            if first and not settling and on_waiting is not None:
                first = False
                on_waiting(observation)
            time.sleep(seconds)
        except KeyboardInterrupt:
            if not judge_on_interrupt:
                raise
            interrupted = True

    while True:
        now = time.monotonic()
        final = now >= deadline or interrupted
        waited = round(now - start, 3) if timeout_s else 0.0
        snapshot = src.read(final=final)
        notes: tuple[str, ...] = ()
        if new_only:
            if already is None:
                already = _part_counts(snapshot.records)
            snapshot, notes = _run_being_written(snapshot, already)
        ended = None
        if until == "end" and src.growing:
            if seen != _signature(snapshot):
                seen, changed = _signature(snapshot), time.monotonic()
            if runs_then is None and (snapshot.records or getattr(snapshot.records, "silent", ())):
                runs_then = _last_runs(snapshot.records)
            if runs_then is not None and any(run > runs_then.get(key, run) for key, run in _last_runs(snapshot.records).items()):
                snapshot, ended = _up_to(snapshot, runs_then), "a later run began"
            elif time.monotonic() - changed >= quiet_s:
                ended = f"nothing new for {quiet_s:g} s"
            elif final and not interrupted:
                notes += (f"until end: the run had not ended when the wait did ({timeout_s:g} s): judged as it "
                          "stood (a larger timeout_s / --wait, or a shorter quiet period)",)
            if ended is not None:
                notes += (f"until end: the run ended ({ended}); judged whole",)
        if interrupted:
            notes = (f"{INTERRUPTED_NOTE} after {waited:.1f} s of waiting: judged what was read by then",) + notes
        observation = judge_snapshot(snapshot, src.describe, waited, **rules)
        if notes:
            observation = dataclasses.replace(observation, notes=observation.notes + notes)
        if until == "end" and src.growing:
            if ended is not None or final:
                return observation
            pause(max(0.0, min(poll_s, deadline - time.monotonic())))
            continue
        if observation.ok and not final and src.growing and _awaits_audit_line(snapshot.records):
            # the last record may be followed by its audit line in a moment (a second write):
            # read once more before passing, or a fault on that line would be missed
            if settled != len(snapshot.records):
                settled = len(snapshot.records)
                pause(max(0.0, min(poll_s, deadline - time.monotonic())), settling=True)
                continue
        if observation.ok or final:
            return observation
        pause(max(0.0, min(poll_s, deadline - time.monotonic())))


def assert_swa_divergence_observed(
    source: SourceLike,
    *,
    min_divergence: int = 1,
    min_out_of_window: int = 1,
    require_verify_lag: bool = True,
    require_clean_audit: bool = True,
    runs: str = "last",
    ranks: str = "each",
    lines: str = "auto",
    timeout_s: float | None = None,
    poll_s: float = DEFAULT_POLL_S,
    new_only: bool = False,
    until: str = "pass",
    quiet_s: float = DEFAULT_QUIET_S,
) -> SwaObservation:
    """Assert that a run shows the SWA path working; wait for it while the log is being written.

    Passes when, in the last run of the log (``runs``), for every rank (``ranks``) of otel-swa's
    lines or else SGLang's (``lines``): the peak ``swa_full_idx_divergence`` is >= ``min_divergence``,
    the peak ``swa_out_of_window_tokens`` is >= ``min_out_of_window``, the last record has
    ``verify_swa < verify_full`` (when ``require_verify_lag``), the SWA slot audit, where present,
    found no leaked slot, stale token or shared slot, the provenance checks, where present, no
    fault (when ``require_clean_audit``), and no rank's runs are interleaved, and no run of otel-swa's lines is only its start marker or liveness
    warning. ``source`` is any of :func:`open_source`'s kinds; waiting follows
    :func:`wait_for_observation`: by default it returns at the first read that passes (a fault
    logged later is not seen); ``until="end"`` waits for the end of the run being written (the
    next run's start, or ``quiet_s`` seconds without anything new) and judges it whole, the form
    for a server log; ``new_only=True``: only what is written while it waits.

    Returns:
        the :class:`~otel_swa.testing.judge.SwaObservation` (groups, peaks, last record) for
        further checks.

    Raises:
        SwaDivergenceNotObserved: (an ``AssertionError``) the verdict was not a pass by the
            timeout, or the source could not be read; the message says what was read, what was
            judged, and each failure with its reason.
        ValueError, TypeError: bad arguments, as :func:`wait_for_observation`.
    """
    observation = wait_for_observation(
        source,
        min_divergence=min_divergence,
        min_out_of_window=min_out_of_window,
        require_verify_lag=require_verify_lag,
        require_clean_audit=require_clean_audit,
        runs=runs,
        ranks=ranks,
        lines=lines,
        timeout_s=timeout_s,
        poll_s=poll_s,
        new_only=new_only,
        until=until,
        quiet_s=quiet_s,
    )
    if not observation.ok:
        raise SwaDivergenceNotObserved(observation)
    return observation
