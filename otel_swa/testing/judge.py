"""The CI verdict: whether a run shows the SWA path working. One pure function, :func:`judge`.

Records come in with their writer, rank and run (:func:`otel_swa.testing.runs.split_runs`); a
verdict per run and rank comes out (:class:`GroupVerdict`), each failure with its reason
(:class:`Failure`), and :meth:`SwaObservation.explain` says it in words. ``otel-swa check``, the
pytest assertion and the ``swa_records`` fixture are thin fronts over it; reading the sources
(files, text, a growing log, an in-process sink) is :mod:`otel_swa.testing.sources`' business.

The signals, as SGLang's CI helper ``assert_swa_divergence_observed`` defines the first three
(sgl-project/sglang PR #26820):

* ``divergence``: the **peak** ``swa_full_idx_divergence`` over the group's records is at least
  ``min_divergence`` (default 1); not judged for a group with a record that says
  ``divergence_applicable=false`` (an engine without a FULL-to-SWA mapping, vLLM: the line's 0 is
  a placeholder; one engine writes a rank's run, so a record whose audit line was lost does not
  turn the rule back on);
* ``out-of-window``: the **peak** ``swa_out_of_window_tokens`` is at least ``min_out_of_window``;
* ``verify lag``: the **last** record has ``verify_swa < verify_full`` (both counters are
  cumulative; a negative value, from a wrapped 32-bit counter, cannot show it);
* ``audit``: when the group's records carry the SWA slot audit or the sliding-window check
  (otel-swa's audit lines), the peak of each field of :data:`AUDIT_RULES` present is 0: no leaked
  SWA slots, no stale tokens, no shared SWA slots, no premature evictions (live tokens inside the
  window without an SWA slot) (``require_clean_audit``, default on). The late-held SWA slots
  (:data:`REPORTED_RULES`) are shown with their peak, never judged: an engine may keep a few by
  design, and more show as SWA pool usage first;
* ``provenance``: when the group's records carry otel-swa's provenance lines (the checks of the KV
  held in the slots), the peak of each fault of :data:`PROVENANCE_RULES` present is 0: no write
  to the wrong slot, no slot holding another token's KV, no K/V bytes changed after the write, no
  stale prefix-cache entry, no block holding other tokens' KV; a failure names the first offender
  (``require_clean_audit`` switches it off too). The unchecked counts (:data:`REPORTED_RULES`) are
  shown, never judged;
* ``runs``: no rank shows runs interleaved in one log (``forward_ct`` going back and forth: two
  runs writing the same log at once), which no rule can split;
* ``liveness``: a rank run whose otel-swa lines are only its run start marker or a liveness
  warning (``otel_swa_liveness=``: the reporter was on and delivered no sample, "instrumented, 0
  samples in N steps") fails, whatever other writers' lines show: otel-swa was on and not working.

A record without an audit line, in a group whose other records carry one, fails the audit signal
("audit line missing ...": its faults cannot be ruled out), unless it is the log's very last line
(still being written); a record without a provenance line, in a group whose other records carry
one, fails the provenance signal the same way. A group none of whose records carries one (an
engine or configuration with provenance off) is asked for none. An audit or provenance line that
cannot be read or attached to its record fails its signal. Exact duplicate adjacent lines were read once (the explanation says so).

Peaks, because under pipeline parallelism one micro-batch is sampled per interval and a single
sample may show an idle one.

What is judged:

* ``runs="last"`` (default): the last run of the log (runs are counted per writer); ``"each"``:
  every run, all must pass; ``"all"``: the whole log as one run (the rule before runs were told
  apart).
* ``ranks="each"`` (default): every rank on its own, all must pass; a rank that wrote records in
  another run of the log but none in the judged one fails (a dead rank). ``"all"``: the records
  of every rank of a run together (peaks over all, the verify lag on the last line), for pipeline
  parallelism where one micro-batch is sampled per interval.
* ``lines="auto"`` (default): otel-swa's tagged lines when there are any, else SGLang's own
  (untagged) lines; the explanation says when the other writer's lines were left out.
  ``"otel-swa"`` / ``"sglang"``: that writer only; ``"both"``: each writer on its own, both must
  pass.

This module does not import pytest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

from otel_swa.record import AUDIT_PREFIX, PROVENANCE_PREFIX, MalformedRecordError
from otel_swa.testing.runs import OTEL_SWA_LINES, SGLANG_LINES, RunRecord, RunRecords, split_runs
from otel_swa.testing.tally import EVERY_RANK, GroupTally, MissingLines, StreamTally, Tally
from otel_swa.testing.verdict import (
    ALL_RANKS,
    AUDIT_RULES,
    LINE_MODES,
    PROVENANCE_RULES,
    RANK_MODES,
    REPORTED_RULES,
    RUN_MODES,
    SIGNALS,
    AuditPeak,
    AuditRule,
    Failure,
    GroupVerdict,
    SwaObservation,
    lag_text,
)

__all__ = [
    "SIGNALS",
    "RUN_MODES",
    "RANK_MODES",
    "LINE_MODES",
    "ALL_RANKS",
    "AuditRule",
    "AUDIT_RULES",
    "REPORTED_RULES",
    "PROVENANCE_RULES",
    "Failure",
    "AuditPeak",
    "GroupVerdict",
    "SwaObservation",
    "judge",
    "judge_tally",
    "check_rules",
    "check_modes",
]


def _check_threshold(name: str, value: object) -> int:
    if type(value) is not int or value < 0:  # noqa: E721 - bool refused
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def check_rules(min_divergence: int, min_out_of_window: int, runs: str, ranks: str, lines: str) -> None:
    """Check the thresholds (each an int >= 0) and the modes of :func:`judge`.

    Raises:
        ValueError: one is not (the message names it).
    """
    _check_threshold("min_divergence", min_divergence)
    _check_threshold("min_out_of_window", min_out_of_window)
    check_modes(runs, ranks, lines)


def check_modes(runs: str, ranks: str, lines: str) -> None:
    """Check the three mode arguments of :func:`judge`.

    Raises:
        ValueError: a mode is not one of its choices (the message names the value and the choices).
    """
    for name, value, choices in (("runs", runs, RUN_MODES), ("ranks", ranks, RANK_MODES), ("lines", lines, LINE_MODES)):
        if value not in choices:
            raise ValueError(f"{name}={value!r}; expected one of {', '.join(choices)}")


def _evaluate(
    tally: GroupTally,
    *,
    writer: str,
    run: int | None,
    rank: str | None,
    part: str | None,
    missing_from: tuple[int, ...],
    min_divergence: int,
    min_out_of_window: int,
    require_verify_lag: bool,
    require_clean_audit: bool,
    log_end: dict | None = None,
) -> GroupVerdict:
    # one engine writes a rank's run: a record that says divergence is not applicable (vLLM) says it
    # for the run, also for a record whose audit line was lost (a kill between its two lines)
    applicable = tally.applicable
    top = tally.divergence if applicable else None
    peak_div, peak_div_at = (top.record.swa_full_idx_divergence, top.record.forward_ct) if top else (0, None)
    top = tally.out_of_window
    peak_oow, peak_oow_at = (top.record.swa_out_of_window_tokens, top.record.forward_ct) if top else (0, None)
    last_item = tally.last
    last = last_item.record if last_item is not None else None
    where = "" if rank is None or rank == ALL_RANKS else f" from {rank}"
    failures: list[Failure] = []
    if applicable and (peak_div_at is None or peak_div < min_divergence):
        failures.append(Failure("divergence", f"peak swa_full_idx_divergence={peak_div}{where}, need >= {min_divergence}"
                                if tally.records else f"no record{where}"))
    if peak_oow_at is None or peak_oow < min_out_of_window:
        failures.append(Failure("out-of-window", f"peak swa_out_of_window_tokens={peak_oow}{where}, need >= {min_out_of_window}"
                                if tally.records else f"no record{where}"))
    if require_verify_lag:
        if last is None:
            failures.append(Failure("verify lag", "no last record (need verify_swa < verify_full)"))
        elif last.verify_full < 0 or last.verify_swa < 0:
            failures.append(Failure("verify lag", (
                f"last record verify_swa={last.verify_swa}, verify_full={last.verify_full}: a negative total cannot "
                "show the lag (a 32-bit verify counter wrapped past 2**31 - 1?); check an earlier run or "
                "--no-verify-lag")))
        elif not last.verify_swa < last.verify_full:
            failures.append(Failure("verify lag", lag_text(last)))
    peaks = tally.audit_peaks()
    provenance_peaks = tally.provenance_peaks()
    if require_clean_audit:
        for signal, judged, faults, what in (("audit", tally.audited, peaks, "audited"),
                                              ("provenance", tally.checked, provenance_peaks, "provenance-checked")):
            faults = [p for p in faults if p.peak > 0]
            if faults:
                failures.append(Failure(signal, "; ".join(_audit_reason(p) for p in faults)
                                        + f" (in {judged} {what} record(s){where}; each must stay 0)"))
        end = (log_end or {}).get(part)
        _add_missing_lines(failures, tally.audit_lines, end, "audit")
        _add_missing_lines(failures, tally.provenance_lines, end, "provenance")
    return GroupVerdict(
        writer=writer, run=run, rank=rank, part=part, records=tally.records,
        first_line_no=tally.first.line_no if tally.first is not None else None,
        last_line_no=last_item.line_no if last_item is not None else None,
        peak_divergence=peak_div, peak_divergence_at=peak_div_at,
        peak_out_of_window=peak_oow, peak_out_of_window_at=peak_oow_at,
        last=last, audited=tally.audited, audit_peaks=tuple(peaks),
        failures=tuple(failures), missing_from=missing_from, reported_peaks=tuple(tally.reported_peaks()),
        divergence_applicable=applicable, provenance_checked=tally.checked, provenance_peaks=tuple(provenance_peaks),
    )


def _audit_reason(peak: AuditPeak) -> str:
    line = lambda n: "" if n is None else f" (line {n})"  # noqa: E731
    head = peak.rule.explain.format(peak=peak.peak) if peak.rule.explain else peak.rule.label
    text = f"{head}: peak {peak.rule.field}={peak.peak} at forward_ct={peak.peak_at}{line(peak.peak_line_no)}"
    if peak.first_at is not None and (peak.first_at != peak.peak_at or peak.first_offender is not None):
        text += f", first non-zero at forward_ct={peak.first_at}{line(peak.first_line_no)}"
        if peak.first_offender is not None:
            text += f": {peak.first_offender.describe()}"
    return text


def _runs_note(count: int, stream: StreamTally, judged: str, writer_word: str, silent: Sequence[Any] = ()) -> str:
    starts = dict(stream.starts)
    for run in silent:
        if run.line_no is not None and (starts.get(run.run) is None or run.line_no < starts[run.run]):
            starts[run.run] = run.line_no
    starts = dict(sorted(starts.items()))
    begun = [f"run {n} at line {line}" for n, line in starts.items() if line is not None and n > 1]
    if len(begun) > 4:
        begun = begun[:3] + [f"... run {count} at line {starts[count]}"]
    begun = f" ({', '.join(begun)})" if begun else ""
    if judged == "last":
        return (f"runs: {count} runs in {writer_word}{begun}; judged the last, run {count}; "
                "--run each judges every run, --run all the whole log as one")
    if judged == "each":
        return f"runs: {count} runs in {writer_word}{begun}; judged each"
    return f"runs: {count} runs in {writer_word}{begun}; judged together as one (--run all)"


def judge(
    records: Iterable[Any],
    *,
    min_divergence: int = 1,
    min_out_of_window: int = 1,
    require_verify_lag: bool = True,
    require_clean_audit: bool = True,
    runs: str = "last",
    ranks: str = "each",
    lines: str = "auto",
    source: str = "records",
    errors: Sequence[MalformedRecordError] = (),
    malformed: int | None = None,
    waited_s: float = 0.0,
    problem: str | None = None,
    empty: bool = False,
    last_line_no: int | None = None,
    duplicates: int = 0,
    first_duplicate_line_no: int | None = None,
) -> SwaObservation:
    """Judge ``records`` (in log order) by the rules of the module docstring.

    Args:
        records: :class:`~otel_swa.testing.runs.RunRecord` items (writer, rank and run known), or
            anything :func:`~otel_swa.testing.runs.split_runs` takes (plain records, log entries),
            which it then splits.
        min_divergence, min_out_of_window, require_verify_lag, require_clean_audit: the rules.
        runs, ranks, lines: what is judged (see the module docstring).
        source, errors, malformed, waited_s, problem, empty: what the source says about itself,
            reported as they are (``malformed`` defaults to ``len(errors)``).
        last_line_no: the line of the last record when ``records`` has no line numbers.
        duplicates, first_duplicate_line_no: exact duplicate adjacent lines the source read once
            (:class:`otel_swa.logsource.DuplicateLines`), said in the explanation.

    Raises:
        ValueError: a threshold is not an int >= 0, or a mode is not one of its choices.
    """
    check_rules(min_divergence, min_out_of_window, runs, ranks, lines)
    extras = records if isinstance(records, RunRecords) else None
    items = list(records)
    if not all(isinstance(item, RunRecord) for item in items):
        extras = items = split_runs(items)
    return judge_tally(Tally(runs, ranks).add_all(items), extras, min_divergence=min_divergence,
                       min_out_of_window=min_out_of_window, require_verify_lag=require_verify_lag,
                       require_clean_audit=require_clean_audit, runs=runs, ranks=ranks, lines=lines, source=source,
                       errors=errors, malformed=malformed, waited_s=waited_s, problem=problem, empty=empty,
                       last_line_no=last_line_no, duplicates=duplicates, first_duplicate_line_no=first_duplicate_line_no)


def judge_tally(
    tally: Tally,
    extras: "RunRecords | None",
    *,
    min_divergence: int,
    min_out_of_window: int,
    require_verify_lag: bool,
    require_clean_audit: bool,
    runs: str,
    ranks: str,
    lines: str,
    source: str = "records",
    errors: Sequence[MalformedRecordError] = (),
    malformed: int | None = None,
    waited_s: float = 0.0,
    problem: str | None = None,
    empty: bool = False,
    last_line_no: int | None = None,
    duplicates: int = 0,
    first_duplicate_line_no: int | None = None,
) -> SwaObservation:
    """:func:`judge` on the running figures of records read one at a time (``tally``: a
    :class:`~otel_swa.testing.tally.Tally` made with the same ``runs`` and ``ranks``, every record
    added in log order), with what else the log showed (``extras``: the run start markers, silent
    runs, liveness warnings and rank notes of :class:`~otel_swa.testing.runs.RunRecords`, or
    ``None``). The other arguments are :func:`judge`'s, already checked."""
    silent = extras.silent if extras is not None else ()
    run_warnings = extras.warnings if extras is not None else ()
    rules = dict(min_divergence=min_divergence, min_out_of_window=min_out_of_window,
                 require_verify_lag=bool(require_verify_lag), require_clean_audit=bool(require_clean_audit))
    rules["log_end"] = _log_end(tally, silent)

    streams: dict[tuple[str | None, str], StreamTally] = dict(tally.streams)
    for run in silent:  # a writer whose lines are only run start markers or liveness warnings is here too
        if (run.part, run.writer) not in streams:
            streams[(run.part, run.writer)] = StreamTally(runs != "all", ranks != "all")
    parts = list(dict.fromkeys(part for part, _ in streams))
    judged: list[tuple[GroupVerdict, GroupTally | None]] = []
    failures: list[Failure] = []
    notes: list[str] = _reading_notes(extras, duplicates, first_duplicate_line_no)
    for part in parts:
        present = [w for w in (OTEL_SWA_LINES, SGLANG_LINES) if (part, w) in streams]
        if lines == "auto":
            chosen = present[:1]
            if len(present) == 2 and not streams[(part, OTEL_SWA_LINES)].count:
                chosen = present  # otel-swa on and silent: its runs fail beside SGLang's verdict
                notes.append("lines: otel-swa's lines here are only run start markers or liveness warnings (its "
                             "reporter delivered no sample); judged both writers: otel-swa's runs fail, SGLang's own "
                             "lines are judged on their own (--lines sglang judges only those)")
            elif len(present) == 2:
                ours, theirs = streams[(part, OTEL_SWA_LINES)], streams[(part, SGLANG_LINES)]
                later = _run_after(theirs, ours)
                if later is not None:
                    chosen = present  # a restart without otel-swa's lines: its run must be judged too
                    notes.append(f"lines: SGLang's own lines hold a run that began after otel-swa's last record "
                                 f"(line {later}: a restart without otel-swa's reporter?); judged both writers' lines")
                else:
                    notes.append(f"lines: otel-swa's tagged lines ({ours.count} records) and SGLang's own untagged "
                                 f"lines ({theirs.count}) are both here; judged otel-swa's (--lines sglang or --lines "
                                 "both judges SGLang's)")
        elif lines == "both":
            chosen = present
        else:
            chosen = [lines] if lines in present else []
            other = [w for w in present if w != lines]
            if other:
                notes.append(f"lines: judged {lines} lines only; {streams[(part, other[0])].count} record(s) of "
                             f"{other[0]} lines left out")
        for writer in chosen:
            quiet = [run for run in silent if run.part == part and run.writer == writer]
            warned = [w for w in run_warnings if w.part == part and w.writer == writer]
            judged.extend(_judge_stream(streams[(part, writer)], writer, part, runs, ranks, notes, failures, rules,
                                        len(chosen) > 1, quiet, warned, getattr(extras, "other_names", {})))
    if not judged:
        judged.append((_evaluate(GroupTally(), writer=lines if lines in (OTEL_SWA_LINES, SGLANG_LINES) else OTEL_SWA_LINES,
                                 run=None, rank=None, part=None, missing_from=(), **rules), None))
    groups = [group for group, _ in judged]
    if require_clean_audit:
        # an audit line otel-swa wrote but that cannot be read or attached to its record may carry
        # the very fault the audit exists to report: it never passes for a clean audit (with --run
        # last, one before the first record judged is an earlier run's: a line follows its record)
        begins = [t.first.line_no for _, t in judged if t is not None and t.first is not None and t.first.line_no]
        judged_from = min(begins) if runs == "last" and begins else None
        for prefix, signal, words in ((AUDIT_PREFIX, "audit", "SWA slot audit line(s)"),
                                      (PROVENANCE_PREFIX, "provenance", "provenance line(s)")):
            unread = [e for e in errors if getattr(e, "prefix", None) == prefix
                      and (judged_from is None or e.line_no is None or e.line_no >= judged_from)]
            if unread:
                where = f"line {unread[0].line_no}" if unread[0].line_no is not None else "one"
                failures.append(Failure(signal, f"{len(unread)} {words} could not be read or attached to their "
                                                f"record ({where}: {unread[0].reason}); their faults cannot be ruled out"))
    counted = [group_tally for _, group_tally in judged if group_tally is not None and group_tally.records]
    failed_names = {f.signal for f in failures} | {f.signal for g in groups for f in g.failures}
    # the latest record with the largest line number (the last of equals: max over the reversed list)
    last_item = max((g.latest for g in reversed(counted)), key=lambda item: item.line_no or 0, default=None)
    (peak_div, peak_div_at), (peak_oow, peak_oow_at) = _summary_peaks(counted)
    return SwaObservation(
        source=source,
        records=tally.records + len(getattr(extras, "left_out", ())),
        malformed=len(errors) if malformed is None else malformed,
        peak_divergence=peak_div,
        peak_divergence_at=peak_div_at,
        peak_out_of_window=peak_oow,
        peak_out_of_window_at=peak_oow_at,
        last=last_item.record if last_item is not None else None,
        last_line_no=(last_item.line_no if last_item.line_no is not None else last_line_no) if last_item else None,
        min_divergence=min_divergence,
        min_out_of_window=min_out_of_window,
        require_verify_lag=bool(require_verify_lag),
        failed=tuple(name for name in SIGNALS if name in failed_names),
        waited_s=waited_s,
        problem=problem,
        empty=bool(empty) and not tally.records,
        groups=tuple(groups),
        failures=tuple(failures),
        notes=tuple(notes),
        errors=tuple(errors),
        require_clean_audit=bool(require_clean_audit),
        runs_mode=runs,
        ranks_mode=ranks,
        lines_mode=lines,
    )


def _summary_peaks(counted: Sequence[GroupTally]) -> tuple[tuple[int, int | None], tuple[int, int | None]]:
    """The peaks over every judged record, as ``(value, forward_ct)`` of divergence and of
    out-of-window: of the first record in log order holding the largest value (groups in their
    order where records have no line); divergence ``(0, None)`` when a record says it does not apply."""
    out = []
    for name, field in (("divergence", "swa_full_idx_divergence"), ("out_of_window", "swa_out_of_window_tokens")):
        best, best_key = None, None
        for index, group_tally in enumerate(counted):
            item = getattr(group_tally, name)
            key = (-getattr(item.record, field), item.line_no is None, item.line_no or 0, index)
            if best_key is None or key < best_key:
                best, best_key = item, key
        if best is None or (name == "divergence" and not all(g.applicable for g in counted)):
            out.append((0, None))
        else:
            out.append((getattr(best.record, field), best.record.forward_ct))
    return out[0], out[1]


def _run_after(theirs: StreamTally, ours: StreamTally) -> int | None:
    """The line where ``theirs``' last run begins, when that is after ``ours``' last record (both
    from one log with line numbers), else ``None``."""
    last_ours = ours.top_line
    first = theirs.first_lines.get(theirs.last_run) if theirs.count else None
    if last_ours is None or first is None or first <= last_ours:
        return None
    return first


def _log_end(tally: Tally, silent: Sequence[Any]) -> dict:
    """The last line seen in each place (part): of its records, run start markers and warnings."""
    end: dict = {}
    for (part, _), stream in tally.streams.items():
        if stream.top_line is not None and stream.top_line > end.get(part, 0):
            end[part] = stream.top_line
    for run in silent:
        for line_no in (run.line_no, run.warning_line_no):
            if line_no is not None and line_no > end.get(run.part, 0):
                end[run.part] = line_no
    return end


#: What each signal's line of a record is called (:func:`_add_missing_lines`, unread lines).
_LINE_WORDS = {"audit": "audit line", "provenance": "provenance line"}


def _add_missing_lines(failures: list[Failure], lines: MissingLines, end: int | None, signal: str) -> None:
    """Fail ``signal`` for otel-swa records without their line of it (the audit line, the
    provenance line: ``lines``) in a group whose other records carry one (lost: its faults cannot
    be ruled out), but the log's very last line (``end``: a line still to be written). A group none
    of whose records carries one (an engine or configuration without it) is not asked for one."""
    count, first = lines.missing(end)
    if not count:
        return
    words = _LINE_WORDS[signal]
    reason = f"{words} missing for the record at line {first}: its faults cannot be ruled out"
    if count > 1:
        reason += f" (and {count - 1} more record(s) without their {words})"
    for index, failure in enumerate(failures):
        if failure.signal == signal:
            failures[index] = Failure(signal, f"{failure.reason}; {reason}")
            return
    failures.append(Failure(signal, reason))


def _reading_notes(extras: Any, duplicates: int, first_duplicate_line_no: int | None) -> list[str]:
    """What reading the log did beyond the records: duplicates read once, records given to the rank
    whose sequence they continue, orphans left out."""
    notes = []
    if duplicates:
        where = f" (first at line {first_duplicate_line_no})" if first_duplicate_line_no is not None else ""
        notes.append(f"lines: {duplicates} exact duplicate line(s) read once{where}: the same line logged twice "
                     "(two handlers on one logger?)")
    moved = getattr(extras, "reattributed", 0)
    if moved:
        notes.append(f"ranks: {moved} record(s) stood after another process's log prefix or none (several processes "
                     "writing one log, each line in parts): each was given to the rank whose sequence it continues")
    left_out = getattr(extras, "left_out", ())
    if left_out:
        first = next((n for n in left_out if n is not None), None)
        where = f" (first at line {first})" if first is not None else ""
        notes.append(f"ranks: {len(left_out)} record(s) whose log prefix several processes' writes left unclear fit "
                     f"no rank's sequence: left out{where}")
    return notes


def _silent_group(run: Any, writer: str, rank: str | None, part: str | None, judged_run: int | None) -> GroupVerdict:
    """The failing group of a rank run whose otel-swa lines are only a run start marker or a
    liveness warning."""
    if run.warning is not None:
        where = f" (line {run.warning_line_no})" if run.warning_line_no is not None else ""
        said = f"{run.warning}{where}; otel-swa was on in this run and delivered no record"
    else:
        where = f" (line {run.line_no})" if run.line_no is not None else ""
        said = (f"a run start marker{where} and no record: otel-swa's line sink started and its reporter delivered "
                "no sample (instrumented, 0 samples)")
    first = run.line_no if run.line_no is not None else run.warning_line_no
    last = run.warning_line_no if run.warning_line_no is not None else run.line_no
    return GroupVerdict(
        writer=writer, run=judged_run, rank=rank, part=part, records=0, first_line_no=first, last_line_no=last,
        peak_divergence=0, peak_divergence_at=None, peak_out_of_window=0, peak_out_of_window_at=None, last=None,
        audited=0, audit_peaks=(), failures=(Failure("liveness", said),), liveness=said,
    )


def _judge_stream(
    stream: StreamTally,
    writer: str,
    part: str | None,
    runs: str,
    ranks: str,
    notes: list[str],
    failures: list[Failure],
    rules: dict,
    several_writers: bool,
    silent: Sequence[Any] = (),
    warnings: Sequence[Any] = (),
    other_names: dict | None = None,
) -> list[tuple[GroupVerdict, GroupTally | None]]:
    writer_word = ("otel-swa's lines" if writer == OTEL_SWA_LINES else "SGLang's lines") if several_writers else "this log"
    if part is not None:
        writer_word = f"{writer_word} of {part}"
    other_names = other_names or {}
    run_numbers = list(stream.starts) + [run.run for run in silent]
    count = max(run_numbers)
    if count > 1:
        notes.append(_runs_note(count, stream, runs, writer_word, silent))
    rank_list = list(dict.fromkeys(list(stream.ranks) + [run.rank for run in silent]))
    runs_of_rank = stream.runs_of_rank
    named = [rank for rank in rank_list if rank is not None]
    if len(rank_list) > 1 and ranks == "each":
        shown = ", ".join(rank if rank is not None else "no rank" for rank in rank_list)
        notes.append(f"ranks: judged each rank on its own ({shown}); --ranks all judges them together "
                     "(pipeline parallelism, where one micro-batch is sampled per interval)")
    elif named and ranks == "all" and len(rank_list) > 1:
        notes.append(f"ranks: judged {len(rank_list)} ranks together (--ranks all)")
    # interleaved runs: a rank whose forward_ct went back and came forward again more than once
    for rank in rank_list:
        marks, first, second = stream.marks.get(rank, (0, None, None))
        if marks >= 2:
            who = rank if rank is not None else "the lines"
            lines_of = f" (lines {first}, {second}, ...)" if first is not None else ""
            failures.append(Failure("runs", (
                f"forward_ct of {who}{' of ' + part if part else ''} went back and came forward again "
                f"{marks} times{lines_of}: several runs wrote this log at the same time, or every line was "
                "logged twice; their records cannot be told apart (give each run its own log)")))
    if runs == "all":
        selected: list[int | None] = [None]
    elif runs == "last":
        selected = [count]
    else:
        selected = list(range(1, count + 1))
    groups = []
    for run in selected:
        quiet = [q for q in silent if run is None or q.run == run]
        said = [w for w in warnings if run is None or w.run == run]
        for q in quiet:
            what = "wrote a run start marker and no record" if q.warning is None else q.warning
            notes.append(f"ranks: {q.rank or 'a writer without rank'} {what}" if q.warning is None
                         else f"liveness: {q.rank + ': ' if q.rank else ''}{what}")
        if ranks == "all":
            label = ALL_RANKS if named else None
            in_run = stream.group(run, EVERY_RANK)
            if in_run.records or not quiet:
                groups.append((_with_warnings(_evaluate(in_run, writer=writer, run=run, rank=label, part=part,
                                                        missing_from=(), **rules), said), in_run))
            else:  # no rank of the run wrote a record
                groups.append((_silent_group(quiet[0], writer, label, part, run), None))
            continue
        for rank in rank_list:
            of_rank = stream.group(run, rank)
            others = other_names.get((part, writer, run, rank), ())
            if not of_rank.records:
                q = next((q for q in quiet if q.rank == rank), None)
                if q is not None:
                    groups.append((_silent_group(q, writer, rank, part, run), None))
                    continue
                if rank not in runs_of_rank:
                    continue  # silent in another run only
            missing = tuple(runs_of_rank[rank]) if not of_rank.records else ()
            group = _evaluate(of_rank, writer=writer, run=run, rank=rank, part=part, missing_from=missing, **rules)
            if others:
                group = dataclasses.replace(group, other_names=others)
            groups.append((_with_warnings(group, [w for w in said if w.rank == rank]), of_rank))
    return groups


def _with_warnings(group: GroupVerdict, warnings: Sequence[Any]) -> GroupVerdict:
    """``group`` with the liveness warnings of its rank run (shown, not judged)."""
    if not warnings:
        return group
    texts = tuple(w.warning + (f" (line {w.line_no})" if w.line_no is not None else "") for w in warnings)
    return dataclasses.replace(group, warnings=texts)
