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
import operator
from typing import Any, Callable, Iterable, Sequence

from otel_swa.record import (
    AUDIT_FIELDS,
    AUDIT_PREFIX,
    PROVENANCE_PREFIX,
    MalformedRecordError,
    SwaDivergenceRecord,
)
from otel_swa.testing.runs import OTEL_SWA_LINES, SGLANG_LINES, RunRecord, RunRecords, split_runs
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
    "check_modes",
]

def _check_threshold(name: str, value: object) -> int:
    if type(value) is not int or value < 0:  # noqa: E721 - bool refused
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def check_modes(runs: str, ranks: str, lines: str) -> None:
    """Check the three mode arguments of :func:`judge`.

    Raises:
        ValueError: a mode is not one of its choices (the message names the value and the choices).
    """
    for name, value, choices in (("runs", runs, RUN_MODES), ("ranks", ranks, RANK_MODES), ("lines", lines, LINE_MODES)):
        if value not in choices:
            raise ValueError(f"{name}={value!r}; expected one of {', '.join(choices)}")


def _evaluate(
    items: Sequence[RunRecord],
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
    peak_div, peak_div_at, peak_oow, peak_oow_at = 0, None, 0, None
    # one engine writes a rank's run: a record that says divergence is not applicable (vLLM) says it
    # for the run, also for a record whose audit line was lost (a kill between its two lines)
    applicable = all(item.record.divergence_applicable for item in items)
    for item in items:
        record = item.record
        if applicable and (peak_div_at is None or record.swa_full_idx_divergence > peak_div):
            peak_div, peak_div_at = record.swa_full_idx_divergence, record.forward_ct
        if peak_oow_at is None or record.swa_out_of_window_tokens > peak_oow:
            peak_oow, peak_oow_at = record.swa_out_of_window_tokens, record.forward_ct
    last_item = items[-1] if items else None
    last = last_item.record if last_item is not None else None
    where = "" if rank is None or rank == ALL_RANKS else f" from {rank}"
    failures: list[Failure] = []
    if applicable and (peak_div_at is None or peak_div < min_divergence):
        failures.append(Failure("divergence", f"peak swa_full_idx_divergence={peak_div}{where}, need >= {min_divergence}"
                                if items else f"no record{where}"))
    if peak_oow_at is None or peak_oow < min_out_of_window:
        failures.append(Failure("out-of-window", f"peak swa_out_of_window_tokens={peak_oow}{where}, need >= {min_out_of_window}"
                                if items else f"no record{where}"))
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
    audited_fields = operator.attrgetter(*(rule.field for rule in AUDIT_RULES), "forward_ct")  # a tuple, whatever the count
    audited = [item for item in items if audited_fields(item.record).count(None) < len(AUDIT_RULES)]
    peaks = _peaks(audited, AUDIT_RULES)
    checked = [item for item in items if item.record.provenance_checked]
    provenance_peaks = _peaks(checked, PROVENANCE_RULES)
    if require_clean_audit:
        for signal, judged, faults, what in (("audit", audited, peaks, "audited"),
                                              ("provenance", checked, provenance_peaks, "provenance-checked")):
            faults = [p for p in faults if p.peak > 0]
            if faults:
                failures.append(Failure(signal, "; ".join(_audit_reason(p) for p in faults)
                                        + f" (in {len(judged)} {what} record(s){where}; each must stay 0)"))
        _add_missing_lines(failures, items, log_end, "audit", _has_audit_line)
        _add_missing_lines(failures, items, log_end, "provenance", _has_provenance_line)
    return GroupVerdict(
        writer=writer, run=run, rank=rank, part=part, records=len(items),
        first_line_no=items[0].line_no if items else None,
        last_line_no=last_item.line_no if last_item is not None else None,
        peak_divergence=peak_div, peak_divergence_at=peak_div_at,
        peak_out_of_window=peak_oow, peak_out_of_window_at=peak_oow_at,
        last=last, audited=len(audited), audit_peaks=tuple(peaks),
        failures=tuple(failures), missing_from=missing_from, reported_peaks=tuple(_peaks(items, REPORTED_RULES)),
        divergence_applicable=applicable, provenance_checked=len(checked), provenance_peaks=tuple(provenance_peaks),
    )


def _peaks(items: Sequence[RunRecord], rules: Sequence[AuditRule]) -> list[AuditPeak]:
    peaks: list[AuditPeak] = []
    records = [item.record for item in items]
    for rule in rules:
        values, kept = list(map(operator.attrgetter(rule.field), records)), items
        if None in values:  # some records without the field: judge those that have it
            kept = [item for value, item in zip(values, items) if value is not None]
            values = [value for value in values if value is not None]
        if not values:
            continue
        peak = max(values)
        peak_item = kept[values.index(peak)]  # the first of the largest
        first = None if peak <= 0 else next(item for value, item in zip(values, kept) if value > 0)
        peaks.append(AuditPeak(rule, peak, peak_item.record.forward_ct, peak_item.line_no,
                               first.record.forward_ct if first else None, first.line_no if first else None,
                               first.record.offender(rule.field) if first else None))
    return peaks


def _audit_reason(peak: AuditPeak) -> str:
    line = lambda n: "" if n is None else f" (line {n})"  # noqa: E731
    head = peak.rule.explain.format(peak=peak.peak) if peak.rule.explain else peak.rule.label
    text = f"{head}: peak {peak.rule.field}={peak.peak} at forward_ct={peak.peak_at}{line(peak.peak_line_no)}"
    if peak.first_at is not None and (peak.first_at != peak.peak_at or peak.first_offender is not None):
        text += f", first non-zero at forward_ct={peak.first_at}{line(peak.first_line_no)}"
        if peak.first_offender is not None:
            text += f": {peak.first_offender.describe()}"
    return text


def _runs_note(count: int, items: Sequence[RunRecord], judged: str, writer_word: str, silent: Sequence[Any] = ()) -> str:
    starts = {}
    for item in items:
        starts.setdefault(item.run, item.line_no)
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
    _check_threshold("min_divergence", min_divergence)
    _check_threshold("min_out_of_window", min_out_of_window)
    check_modes(runs, ranks, lines)
    extras = records if isinstance(records, RunRecords) else None
    items = list(records)
    if not all(isinstance(item, RunRecord) for item in items):
        extras = items = split_runs(items)
    silent = extras.silent if extras is not None else ()
    run_warnings = extras.warnings if extras is not None else ()
    rules = dict(min_divergence=min_divergence, min_out_of_window=min_out_of_window,
                 require_verify_lag=bool(require_verify_lag), require_clean_audit=bool(require_clean_audit))
    rules["log_end"] = _log_end(items, silent)

    streams: dict[tuple[str | None, str], list[RunRecord]] = {}
    for item in items:
        streams.setdefault((item.part, item.writer), []).append(item)
    for run in silent:  # a writer whose lines are only run start markers or liveness warnings is here too
        streams.setdefault((run.part, run.writer), [])
    parts = list(dict.fromkeys(part for part, _ in streams))
    groups: list[GroupVerdict] = []
    failures: list[Failure] = []
    notes: list[str] = _reading_notes(extras, duplicates, first_duplicate_line_no)
    for part in parts:
        present = [w for w in (OTEL_SWA_LINES, SGLANG_LINES) if (part, w) in streams]
        if lines == "auto":
            chosen = present[:1]
            if len(present) == 2 and not streams[(part, OTEL_SWA_LINES)]:
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
                    notes.append(f"lines: otel-swa's tagged lines ({len(ours)} records) and SGLang's own untagged "
                                 f"lines ({len(theirs)}) are both here; judged otel-swa's (--lines sglang or --lines "
                                 "both judges SGLang's)")
        elif lines == "both":
            chosen = present
        else:
            chosen = [lines] if lines in present else []
            other = [w for w in present if w != lines]
            if other:
                notes.append(f"lines: judged {lines} lines only; {len(streams[(part, other[0])])} record(s) of "
                             f"{other[0]} lines left out")
        for writer in chosen:
            stream = streams[(part, writer)]
            quiet = [run for run in silent if run.part == part and run.writer == writer]
            warned = [w for w in run_warnings if w.part == part and w.writer == writer]
            groups.extend(_judge_stream(stream, writer, part, runs, ranks, notes, failures, rules, len(chosen) > 1,
                                        quiet, warned, getattr(extras, "other_names", {})))
    if not groups:
        groups.append(_evaluate([], writer=lines if lines in (OTEL_SWA_LINES, SGLANG_LINES) else OTEL_SWA_LINES,
                                run=None, rank=None, part=None, missing_from=(), **rules))
    if require_clean_audit:
        # an audit line otel-swa wrote but that cannot be read or attached to its record may carry
        # the very fault the audit exists to report: it never passes for a clean audit
        for prefix, signal, words in ((AUDIT_PREFIX, "audit", "SWA slot audit line(s)"),
                                      (PROVENANCE_PREFIX, "provenance", "provenance line(s)")):
            unread = [e for e in errors if getattr(e, "prefix", None) == prefix]
            if unread:
                first = unread[0]
                where = f"line {first.line_no}" if first.line_no is not None else "one"
                failures.append(Failure(signal, f"{len(unread)} {words} could not be read or attached to their "
                                                f"record ({where}: {first.reason}); their faults cannot be ruled out"))

    judged = [item for group in groups for item in _group_items(items, group)]
    judged.sort(key=lambda item: (item.line_no is None, item.line_no or 0))
    summary = _evaluate(judged, writer="", run=None, rank=None, part=None, missing_from=(), **rules) if judged else None
    failed_names = {f.signal for f in failures} | {f.signal for g in groups for f in g.failures}
    last_item = None
    for group in groups:
        for item in _group_items(items, group):
            if last_item is None or (item.line_no or 0) >= (last_item.line_no or 0):
                last_item = item
    return SwaObservation(
        source=source,
        records=len(items) + len(getattr(extras, "left_out", ())),
        malformed=len(errors) if malformed is None else malformed,
        peak_divergence=summary.peak_divergence if summary else 0,
        peak_divergence_at=summary.peak_divergence_at if summary else None,
        peak_out_of_window=summary.peak_out_of_window if summary else 0,
        peak_out_of_window_at=summary.peak_out_of_window_at if summary else None,
        last=last_item.record if last_item is not None else None,
        last_line_no=(last_item.line_no if last_item.line_no is not None else last_line_no) if last_item else None,
        min_divergence=min_divergence,
        min_out_of_window=min_out_of_window,
        require_verify_lag=bool(require_verify_lag),
        failed=tuple(name for name in SIGNALS if name in failed_names),
        waited_s=waited_s,
        problem=problem,
        empty=bool(empty) and not items,
        groups=tuple(groups),
        failures=tuple(failures),
        notes=tuple(notes),
        errors=tuple(errors),
        require_clean_audit=bool(require_clean_audit),
        runs_mode=runs,
        ranks_mode=ranks,
        lines_mode=lines,
    )


def _run_after(theirs: Sequence[RunRecord], ours: Sequence[RunRecord]) -> int | None:
    """The line where ``theirs``' last run begins, when that is after ``ours``' last record (both
    from one log with line numbers), else ``None``."""
    last_ours = max((item.line_no for item in ours if item.line_no is not None), default=None)
    last_run = theirs[-1].run if theirs else None
    first = next((item.line_no for item in theirs if item.run == last_run and item.line_no is not None), None)
    if last_ours is None or first is None or first <= last_ours:
        return None
    return first


def _log_end(items: Sequence[RunRecord], silent: Sequence[Any]) -> dict:
    """The last line seen in each place (part): of its records, run start markers and warnings."""
    end: dict = {}
    for item in items:
        if item.line_no is not None and item.line_no > end.get(item.part, 0):
            end[item.part] = item.line_no
    for run in silent:
        for line_no in (run.line_no, run.warning_line_no):
            if line_no is not None and line_no > end.get(run.part, 0):
                end[run.part] = line_no
    return end


#: What each signal's line of a record is called (:func:`_add_missing_lines`, unread lines).
_LINE_WORDS = {"audit": "audit line", "provenance": "provenance line"}


def _add_missing_lines(failures: list[Failure], items: Sequence[RunRecord], log_end: dict | None, signal: str,
                       has_line: Callable[[SwaDivergenceRecord], bool]) -> None:
    """Fail ``signal`` for otel-swa records without their line of it (the audit line, the
    provenance line: ``has_line``) in a group whose other records carry one (lost: its faults cannot
    be ruled out), but the log's very last line (a line still to be written). A group none of whose
    records carries one (an engine or configuration without it) is not asked for one."""
    logged = [item for item in items if item.line_no is not None and item.record.verify_source is not None]
    carries = [has_line(item.record) for item in logged]
    if not any(carries):
        return
    missing = [item for item, has in zip(logged, carries) if not has and item.line_no != (log_end or {}).get(item.part)]
    if not missing:
        return
    words = _LINE_WORDS[signal]
    reason = f"{words} missing for the record at line {missing[0].line_no}: its faults cannot be ruled out"
    if len(missing) > 1:
        reason += f" (and {len(missing) - 1} more record(s) without their {words})"
    for index, failure in enumerate(failures):
        if failure.signal == signal:
            failures[index] = Failure(signal, f"{failure.reason}; {reason}")
            return
    failures.append(Failure(signal, reason))


def _has_audit_line(record: SwaDivergenceRecord) -> bool:
    """Whether ``record`` came with an audit line (:meth:`SwaDivergenceRecord.audit_line` is not
    ``None``), without formatting it."""
    return (record.micro_batch is not None or not record.divergence_applicable
            or any(getattr(record, name) is not None for name in AUDIT_FIELDS))


def _has_provenance_line(record: SwaDivergenceRecord) -> bool:
    """Whether ``record`` came with a provenance line (a provenance field is present)."""
    return record.provenance_checked


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


def _group_items(items: Sequence[RunRecord], group: GroupVerdict) -> list[RunRecord]:
    return [
        item for item in items
        if item.part == group.part and item.writer == group.writer
        and (group.run is None or item.run == group.run)
        and (group.rank == ALL_RANKS or item.rank == group.rank)
    ]


def _judge_stream(
    stream: Sequence[RunRecord],
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
) -> list[GroupVerdict]:
    writer_word = ("otel-swa's lines" if writer == OTEL_SWA_LINES else "SGLang's lines") if several_writers else "this log"
    if part is not None:
        writer_word = f"{writer_word} of {part}"
    other_names = other_names or {}
    run_numbers = list(dict.fromkeys([item.run for item in stream] + [run.run for run in silent]))
    count = max(run_numbers)
    if count > 1:
        notes.append(_runs_note(count, stream, runs, writer_word, silent))
    rank_list = list(dict.fromkeys([item.rank for item in stream] + [run.rank for run in silent]))
    runs_of_rank: dict[str | None, list[int]] = {}
    for item in stream:
        seen = runs_of_rank.setdefault(item.rank, [])
        if not seen or seen[-1] != item.run:
            seen.append(item.run)
    named = [rank for rank in rank_list if rank is not None]
    if len(rank_list) > 1 and ranks == "each":
        shown = ", ".join(rank if rank is not None else "no rank" for rank in rank_list)
        notes.append(f"ranks: judged each rank on its own ({shown}); --ranks all judges them together "
                     "(pipeline parallelism, where one micro-batch is sampled per interval)")
    elif named and ranks == "all" and len(rank_list) > 1:
        notes.append(f"ranks: judged {len(rank_list)} ranks together (--ranks all)")
    # interleaved runs: a rank whose forward_ct went back and came forward again more than once
    for rank in rank_list:
        marks = [item for item in stream if item.rank == rank and item.back_and_forth]
        if len(marks) >= 2:
            who = rank if rank is not None else "the lines"
            lines_of = f" (lines {marks[0].line_no}, {marks[1].line_no}, ...)" if marks[0].line_no is not None else ""
            failures.append(Failure("runs", (
                f"forward_ct of {who}{' of ' + part if part else ''} went back and came forward again "
                f"{len(marks)} times{lines_of}: several runs wrote this log at the same time, or every line was "
                "logged twice; their records cannot be told apart (give each run its own log)")))
    if runs == "all":
        selected: list[int | None] = [None]
    elif runs == "last":
        selected = [count]
    else:
        selected = list(range(1, count + 1))
    groups = []
    for run in selected:
        in_run = [item for item in stream if run is None or item.run == run]
        quiet = [q for q in silent if run is None or q.run == run]
        said = [w for w in warnings if run is None or w.run == run]
        for q in quiet:
            what = "wrote a run start marker and no record" if q.warning is None else q.warning
            notes.append(f"ranks: {q.rank or 'a writer without rank'} {what}" if q.warning is None
                         else f"liveness: {q.rank + ': ' if q.rank else ''}{what}")
        if ranks == "all":
            label = ALL_RANKS if named else None
            if in_run or not quiet:
                groups.append(_with_warnings(_evaluate(in_run, writer=writer, run=run, rank=label, part=part,
                                                       missing_from=(), **rules), said))
            else:  # no rank of the run wrote a record
                groups.append(_silent_group(quiet[0], writer, label, part, run))
            continue
        for rank in rank_list:
            of_rank = [item for item in in_run if item.rank == rank]
            others = other_names.get((part, writer, run, rank), ())
            if not of_rank:
                q = next((q for q in quiet if q.rank == rank), None)
                if q is not None:
                    groups.append(_silent_group(q, writer, rank, part, run))
                    continue
                if rank not in runs_of_rank:
                    continue  # silent in another run only
            missing = tuple(runs_of_rank[rank]) if not of_rank else ()
            group = _evaluate(of_rank, writer=writer, run=run, rank=rank, part=part, missing_from=missing, **rules)
            if others:
                group = dataclasses.replace(group, other_names=others)
            groups.append(_with_warnings(group, [w for w in said if w.rank == rank]))
    return groups


def _with_warnings(group: GroupVerdict, warnings: Sequence[Any]) -> GroupVerdict:
    """``group`` with the liveness warnings of its rank run (shown, not judged)."""
    if not warnings:
        return group
    texts = tuple(w.warning + (f" (line {w.line_no})" if w.line_no is not None else "") for w in warnings)
    return dataclasses.replace(group, warnings=texts)
