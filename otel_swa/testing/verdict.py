"""The verdict of :mod:`otel_swa.testing.judge` and how it reads: the signals it judges, the rules the
registered checks give it (:data:`otel_swa.checks.CHECKS`: every ``fault`` field must stay 0, every
``info`` field is shown with its peak), the verdict on one group of records (:class:`GroupVerdict`)
and over a whole source (:class:`SwaObservation`), with its words for a CI log.

This module does not import pytest.
"""

from __future__ import annotations

from dataclasses import dataclass
from otel_swa.checks import CHECKS
from otel_swa.record import LINE_PREFIX, MalformedRecordError, Offender, SwaDivergenceRecord

__all__ = ["SIGNALS", "RUN_MODES", "RANK_MODES", "LINE_MODES", "ALL_RANKS", "AuditRule", "AUDIT_RULES",
           "REPORTED_RULES", "PROVENANCE_RULES", "Failure", "AuditPeak", "GroupVerdict", "SwaObservation", "lag_text"]

#: The signals, by name, in the order they are judged and reported.
SIGNALS = ("divergence", "out-of-window", "verify lag", "audit", "provenance", "runs")
SIGNALS += ("liveness",)  # a reporter on and delivering nothing (a run of only its marker or warning)
RUN_MODES = ("last", "each", "all")
RANK_MODES = ("each", "all")
LINE_MODES = ("auto", "otel-swa", "sglang", "both")
#: :attr:`GroupVerdict.rank` of a group that holds every rank (``ranks="all"``).
ALL_RANKS = "all ranks"

#: At most this many malformed lines are listed without ``verbose``.
_ERRORS_SHOWN = 1


@dataclass(frozen=True)
class AuditRule:
    """One SWA slot audit field the judge requires to be 0.

    Attributes:
        field: the record field (one of :data:`otel_swa.record.AUDIT_FIELDS` or
            :data:`otel_swa.record.PROVENANCE_FIELDS`).
        label: what a non-zero value is, in words.
        meaning: what the field counts.
        explain: how a failure reads, a format with ``{peak}``, or ``None`` for ``label``.
    """

    field: str
    label: str
    meaning: str
    explain: str | None = None


def _rules(line: "str | None", role: str) -> "tuple[AuditRule, ...]":
    """One rule per field of ``role`` of the registered checks (:data:`otel_swa.checks.CHECKS`) on
    ``line`` (``None``: every line), in the checks' order."""
    return tuple(AuditRule(f.name, f.label, f.meaning, f.explain)
                 for check in CHECKS if line is None or check.line == line for f in check.fields if f.role == role)


#: The fault fields of the audit line's checks, one rule each: their peak over a group's audited
#: records must be 0.
AUDIT_RULES = _rules("audit", "fault")

#: The fault fields of the provenance line's checks, one rule each: their peak over a group's
#: records that carry them must be 0.
PROVENANCE_RULES = _rules("provenance", "fault")

#: The checks' ``info`` fields: shown with their peak, never judged.
REPORTED_RULES = _rules(None, "info")


@dataclass(frozen=True)
class Failure:
    """One failed signal and why, in words a CI log reader understands.

    Attributes:
        signal: one of :data:`SIGNALS`.
        reason: what was seen against what was needed.
    """

    signal: str
    reason: str


@dataclass(frozen=True)
class AuditPeak:
    """The peak of one audit field over a group.

    Attributes:
        rule: the :class:`AuditRule`.
        peak: the largest value.
        peak_at, peak_line_no: ``forward_ct`` and line of the first record holding it.
        first_at, first_line_no: ``forward_ct`` and line of the first non-zero value (``None`` if none).
        first_offender: the first offender that record's fault line names
            (:class:`otel_swa.record.Offender`), ``None`` when it has none.
    """

    rule: AuditRule
    peak: int
    peak_at: int | None
    peak_line_no: int | None
    first_at: int | None = None
    first_line_no: int | None = None
    first_offender: "Offender | None" = None


@dataclass(frozen=True)
class GroupVerdict:
    """The verdict on one run of one rank (or of all ranks) of one writer.

    Attributes:
        writer: ``otel-swa`` or ``sglang`` (see :mod:`otel_swa.testing.runs`).
        run: the run number, or ``None`` when the whole log was judged as one (``runs="all"``).
        rank: the rank, ``None`` without ranks, :data:`ALL_RANKS` for ``ranks="all"``.
        part: which place the records came from when there are several, else ``None``.
        records: how many records the group holds.
        first_line_no, last_line_no: lines of its first and last record (``None`` off a log).
        peak_divergence, peak_divergence_at: the largest ``swa_full_idx_divergence`` and the
            ``forward_ct`` of the first record holding it (0 and ``None`` without records).
        peak_out_of_window, peak_out_of_window_at: the same for ``swa_out_of_window_tokens``.
        last: the last record, or ``None``.
        last_line_no: its line, or ``None``.
        audited: how many of its records carry a field of an audit-line check (:data:`otel_swa.checks.CHECKS`).
        audit_peaks: one :class:`AuditPeak` per :data:`AUDIT_RULES` field present.
        reported_peaks: one :class:`AuditPeak` per :data:`REPORTED_RULES` field present.
        provenance_checked: how many of its records carry provenance fields (a provenance line).
        provenance_peaks: one :class:`AuditPeak` per :data:`PROVENANCE_RULES` field present.
        failures: the failed signals with their reasons, in :data:`SIGNALS` order.
        missing_from: for a rank without records in this run, the runs where it has some.
        divergence_applicable: ``False`` when a record of the group says its engine has no
            FULL-to-SWA mapping (vLLM: ``"divergence_applicable":false`` on the audit line): the
            divergence rule is then not judged (its 0 is a placeholder, not a measurement).
        liveness: for a run of this rank without records (a run start marker, or a liveness
            warning), what its lines said; the group fails ``liveness``.
        warnings: liveness warnings of this rank run that has records too (samples stopped for a
            while), in words with their lines; shown, not judged.
        other_names: the other ranks its lines' log prefixes pointed to nearly as often (several
            processes wrote their lines at once, in parts): its rank name is a guess among them.
    """

    writer: str
    run: int | None
    rank: str | None
    part: str | None
    records: int
    first_line_no: int | None
    last_line_no: int | None
    peak_divergence: int
    peak_divergence_at: int | None
    peak_out_of_window: int
    peak_out_of_window_at: int | None
    last: SwaDivergenceRecord | None
    audited: int
    audit_peaks: tuple[AuditPeak, ...]
    failures: tuple[Failure, ...]
    missing_from: tuple[int, ...] = ()
    reported_peaks: tuple[AuditPeak, ...] = ()
    divergence_applicable: bool = True
    liveness: str | None = None
    warnings: tuple[str, ...] = ()
    other_names: tuple[str, ...] = ()
    provenance_checked: int = 0
    provenance_peaks: tuple[AuditPeak, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(f.signal for f in self.failures)


@dataclass(frozen=True)
class SwaObservation:
    """The verdict over a source: every judged group, what was left out, and why.

    Attributes:
        source: what was read, in words (a path, "in-process sink"...).
        records: how many valid records were seen in the source (judged or not).
        malformed: how many malformed lines were skipped.
        errors: their :class:`~otel_swa.record.MalformedRecordError` (line number and reason).
        groups: one :class:`GroupVerdict` per judged run and rank.
        failures: failures of the source as a whole (interleaved runs), beside the groups'.
        notes: what was seen and not judged, and how to judge it (runs, ranks, writers).
        peak_divergence, peak_divergence_at, peak_out_of_window, peak_out_of_window_at: over the
            judged records.
        last: the last judged record in log order, or ``None``; last_line_no: its line.
        min_divergence, min_out_of_window, require_verify_lag, require_clean_audit: the rules.
        runs_mode, ranks_mode, lines_mode: what was judged (see the module docstring).
        failed: the names (from :data:`SIGNALS`) of every signal that failed anywhere, in order.
        waited_s: seconds spent waiting for the source to grow.
        problem: why the source could not be read (missing file, permission...), else ``None``.
        empty: the source held no text at all (e.g. the captured output of an engine that crashed
            before logging anything), as opposed to text without records.
    """

    source: str
    records: int
    malformed: int
    peak_divergence: int
    peak_divergence_at: int | None
    peak_out_of_window: int
    peak_out_of_window_at: int | None
    last: SwaDivergenceRecord | None
    last_line_no: int | None
    min_divergence: int
    min_out_of_window: int
    require_verify_lag: bool
    failed: tuple[str, ...]
    waited_s: float = 0.0
    problem: str | None = None
    empty: bool = False
    groups: tuple[GroupVerdict, ...] = ()
    failures: tuple[Failure, ...] = ()
    notes: tuple[str, ...] = ()
    errors: tuple[MalformedRecordError, ...] = ()
    require_clean_audit: bool = True
    runs_mode: str = "last"
    ranks_mode: str = "each"
    lines_mode: str = "auto"

    @property
    def ok(self) -> bool:
        """Every judged group passed, nothing failed for the source as a whole, and it was readable."""
        return not self.failed and self.problem is None

    def explain(self, verbose: bool = False) -> str:
        """A multi-line account for a CI log: what was read, what was judged, each signal's verdict
        per run and rank, with the reason of each failure; ``verbose`` lists every malformed line."""
        head = "SWA path observed" if self.ok else "SWA path NOT observed"
        seen = f"{self.records} record(s) seen"
        if self.malformed:
            seen += f" ({self.malformed} malformed skipped)"
        waited = f", waited {self.waited_s:.1f} s" if self.waited_s else ""
        lines = [f"{head} in {self.source}: {seen}{waited}"]
        if self.problem is not None:
            lines.append(f"  unusable source: {self.problem}")
        if self.empty and self.problem is None:
            lines.append("  the source was empty (no text at all): did the engine crash, or log to another stream?")
        elif self.records == 0 and self.problem is None:
            lines.append(
                f"  no {LINE_PREFIX!r} record found; is the reporter on (interval > 0) and the run long enough?"
            )
        shown = self.errors if verbose else self.errors[:_ERRORS_SHOWN]
        for error in shown:
            where = f"line {error.line_no}" if error.line_no is not None else "a line"
            lines.append(f"  malformed, skipped: {where}: {error.reason}")
        if len(self.errors) > len(shown):
            lines.append(f"  ... and {len(self.errors) - len(shown)} more malformed line(s) (--verbose lists them)")
        for note in self.notes:
            lines.append(f"  {note}")
        for failure in self.failures:
            lines.append(f"  FAILED {failure.signal}: {failure.reason}")
        flat = len(self.groups) == 1 and _label(self.groups[0], self) == ""
        for group in self.groups:
            indent = "  " if flat else "    "
            if not flat:
                verdict = "ok" if group.ok else "FAILED"
                where = _lines_of(group)
                lines.append(f"  {_label(group, self)}: {verdict}, {group.records} record(s){where}")
            lines.extend(indent + text for text in _group_lines(group, self))
        return "\n".join(lines)


def _label(group: GroupVerdict, obs: SwaObservation) -> str:
    parts = []
    if group.part is not None:
        parts.append(group.part)
    if obs.lines_mode == "both" or len({g.writer for g in obs.groups}) > 1:
        parts.append(f"{group.writer} lines")
    if group.run is not None and any(n.startswith("runs:") for n in obs.notes):
        parts.append(f"run {group.run}")
    if group.rank is not None:
        parts.append(group.rank if not group.other_names else
                     f"{group.rank} (or {', '.join(group.other_names)}: lines written at once, the rank is a guess)")
    elif any(n.startswith("ranks:") for n in obs.notes):
        parts.append("no rank")  # records without a rank prefix, judged beside ranked ones
    return ", ".join(parts) or "records"


def _lines_of(group: GroupVerdict) -> str:
    if group.first_line_no is None:
        return ""
    if group.first_line_no == group.last_line_no:
        return f", line {group.first_line_no}"
    return f", lines {group.first_line_no}-{group.last_line_no}"


def _group_lines(group: GroupVerdict, obs: SwaObservation) -> list[str]:
    failed = {f.signal: f.reason for f in group.failures}

    def verdict(name: str) -> str:
        return "FAILED" if name in failed else "ok    "

    at = lambda ct: "" if ct is None else f" at forward_ct={ct}"  # noqa: E731
    out = []
    if group.liveness is not None:
        return [f"FAILED liveness: {failed.get('liveness', group.liveness)}"]
    if group.missing_from:
        runs = ", ".join(map(str, group.missing_from))
        out.append(f"no record from {group.rank} in this run (it wrote records in run {runs}): a dead rank?")
    if group.divergence_applicable:
        out.append(
            f"{verdict('divergence')} divergence: peak swa_full_idx_divergence={group.peak_divergence}"
            f"{at(group.peak_divergence_at)} (need >= {obs.min_divergence})"
        )
    else:
        out.append("n/a    divergence: not judged: the engine has no FULL-to-SWA mapping (vLLM), its records "
                   "say divergence_applicable=false")
    out.append(
        f"{verdict('out-of-window')} out-of-window: peak swa_out_of_window_tokens={group.peak_out_of_window}"
        f"{at(group.peak_out_of_window_at)} (need >= {obs.min_out_of_window})"
    )
    if not obs.require_verify_lag:
        out.append("skip   verify lag: not required")
    else:
        out.append(f"{verdict('verify lag')} verify lag: {failed.get('verify lag') or lag_text(group.last)}")
    for signal, label, count, peaks, clean in (
            ("audit", "SWA slot audit", group.audited, group.audit_peaks, "clean in {n} audited record(s)"),
            ("provenance", "provenance", group.provenance_checked, group.provenance_peaks,
             "the KV in the slots is the tokens' own in {n} checked record(s)")):
        if not count and signal not in failed:
            continue
        if not obs.require_clean_audit:
            out.append(f"skip   {label}: not required")
        elif signal in failed:
            out.append(f"FAILED {label}: {failed[signal]}")
        else:
            fields = ", ".join(f"{p.rule.field}=0" for p in peaks)
            out.append(f"ok     {label}: {clean.format(n=count)} ({fields} throughout)")
    for peak in group.reported_peaks:
        out.append(f"info   {peak.rule.label}: peak {peak.rule.field}={peak.peak}{at(peak.peak_at)} "
                   f"({peak.rule.meaning}; reported, not judged)")
    out.extend(f"info   liveness: {warning} (reported, not judged: the run has records)" for warning in group.warnings)
    if group.last is not None:
        line_no = group.last_line_no if group.last_line_no is not None or len(obs.groups) > 1 else obs.last_line_no
        where = f" (line {line_no})" if line_no is not None else ""
        out.append(f"last record{where}: {group.last.format()}")
    return out


def lag_text(last: SwaDivergenceRecord | None) -> str:
    """Why the last record does or does not show the verify lag (``verify_swa < verify_full``), in words."""
    if last is None:
        return "no last record (need verify_swa < verify_full)"
    relation = "<" if last.verify_swa < last.verify_full else "is not <"
    return f"last record verify_swa={last.verify_swa} {relation} verify_full={last.verify_full}"
