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
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from otel_swa.record import (
    AUDIT_FIELDS,
    AUDIT_PREFIX,
    LINE_PREFIX,
    PROVENANCE_PREFIX,
    MalformedRecordError,
    Offender,
    SwaDivergenceRecord,
)
from otel_swa.testing.runs import OTEL_SWA_LINES, SGLANG_LINES, RunRecord, RunRecords, split_runs

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


#: The audit fields judged, one rule each: their peak over a group's audited records must be 0.
AUDIT_RULES = (
    AuditRule("swa_leaked_slots", "leaked SWA slots", "SWA slots of pages in use that no live token maps into"),
    AuditRule("swa_stale_tokens", "stale tokens", "live tokens whose SWA page is on the free list"),
    AuditRule("swa_shared_slots", "shared SWA slots", "SWA slots that two distinct live FULL slots map to"),
    AuditRule("swa_premature_evictions", "premature evictions",
              "live tokens inside the sliding window whose SWA mapping is 0",
              "{peak} live token(s) inside the sliding window had no SWA slot (premature eviction: attention "
              "read freed KV)"),
    AuditRule("swa_read_mismatches", "read mismatches",
              "checked queries whose sliding-window attention output differs from one recomputed from the KV "
              "pool through the mapping",
              "{peak} checked query(ies) of a sliding-window layer read other KV than the mapping gives (their "
              "attention output differs from the one recomputed from the pool)"),
    AuditRule("kv_leaked_blocks", "leaked KV blocks",
              "KV blocks in use that no request and no prefix-cache entry holds"),
    AuditRule("kv_freed_blocks_in_use", "KV blocks freed while in use",
              "KV blocks a running request's block table references that are on the free queue"),
    AuditRule("kv_shared_blocks", "KV blocks handed out twice",
              "KV blocks not in the prefix cache that two requests' block tables reference"),
)

#: The provenance fields judged (the faults of the provenance line), one rule each: their peak over a
#: group's records that carry them must be 0.
PROVENANCE_RULES = (
    AuditRule("kv_write_mismatches", "KV write mismatches",
              "token-layer pairs whose K/V in the pool differs from what the layer was given to store",
              "{peak} token-layer pair(s) of a step's new tokens were not stored at the slot the tables name (the "
              "pool holds other K/V there: a write to the wrong index)"),
    AuditRule("kv_foreign_tokens", "foreign tokens",
              "live token slots whose provenance stamp is not the one the request's own tokens give",
              "{peak} live token slot(s) hold another token's KV (their provenance stamp is not the request's own: "
              "swapped ownership, a stale prefix reuse, a slot overwritten, a wrong position)"),
    AuditRule("kv_corrupt_tokens", "corrupt tokens",
              "live token slots whose K/V bytes changed after they were written",
              "{peak} live token slot(s) hold K/V bytes that changed after they were written (their checksum differs: "
              "a stray write, a bad load-back, a bit flip)"),
    AuditRule("kv_stale_cache_entries", "stale prefix-cache entries",
              "prefix-cache map entries naming a block whose own hash is not the entry's key",
              "{peak} prefix-cache entr(ies) name a block whose own hash is not the key (stale after eviction or "
              "reuse: a hit would read other tokens' KV)"),
    AuditRule("kv_foreign_blocks", "foreign KV blocks",
              "blocks in a request's table whose hash is not the request's block hash for that index",
              "{peak} block(s) in a request's table hold other tokens' KV (their hash is not the request's for that "
              "index, or they belong to another KV cache group)"),
)

#: Audit and provenance fields shown with their peak but never judged.
REPORTED_RULES = (
    AuditRule("swa_late_held_slots", "late-held SWA slots",
              "SWA slots still held by tokens older than the step's sliding windows plus the engine's eviction allowance"),
    AuditRule("swa_read_unchecked", "unchecked reads",
              "queries of sliding-window layers the read check could not recompute (an attention variant it does "
              "not cover, a step replayed from a CUDA graph)"),
    AuditRule("kv_write_unchecked", "unchecked KV writes",
              "token-layer pairs the write check could not compare (a quantized cache, a layout it does not cover)"),
    AuditRule("kv_stamp_unchecked", "unchecked stamps",
              "live token slots whose provenance stamp was not judged (token ids unknown, over the per-sample "
              "budget; never stamped, for an engine wired after it held KV)"),
)


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
        audited: how many of its records carry the SWA slot audit or the window check.
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
        out.append(f"{verdict('verify lag')} verify lag: {failed.get('verify lag') or _lag_text(group.last)}")
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


def _lag_text(last: SwaDivergenceRecord | None) -> str:
    if last is None:
        return "no last record (need verify_swa < verify_full)"
    relation = "<" if last.verify_swa < last.verify_full else "is not <"
    return f"last record verify_swa={last.verify_swa} {relation} verify_full={last.verify_full}"


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
            failures.append(Failure("verify lag", _lag_text(last)))
    audited = [item for item in items if any(getattr(item.record, rule.field) is not None for rule in AUDIT_RULES)]
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
    for rule in rules:
        present = [item for item in items if getattr(item.record, rule.field) is not None]
        if not present:
            continue
        peak_item = max(present, key=lambda item: getattr(item.record, rule.field))  # first of the largest
        first = next((item for item in present if getattr(item.record, rule.field) > 0), None)
        peaks.append(AuditPeak(
            rule, getattr(peak_item.record, rule.field), peak_item.record.forward_ct, peak_item.line_no,
            first.record.forward_ct if first else None, first.line_no if first else None,
            first.record.offender(rule.field) if first else None,
        ))
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
