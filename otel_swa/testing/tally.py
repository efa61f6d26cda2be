"""What the judge (:mod:`otel_swa.testing.judge`) keeps of the records it reads: running figures per
place, writer, run and rank, so that a record is let go once it has been counted.

:class:`Tally` takes :class:`~otel_swa.testing.runs.RunRecord` items one at a time, in log order
(:meth:`Tally.add`), and holds, per place (part) and writer (:class:`StreamTally`), what the
judge's notes and run rules need (the ranks in order of appearance, the runs of each rank, the
first line of each run, the marks of interleaved runs) and, per judged group of records
(:class:`GroupTally`: one run of one rank, or every run or rank together as the modes ask), the
peaks and first non-zero values of every rule, the counts, and the first and last record. Its
size grows with the number of places, writers, runs and ranks, never with the number of records.

This module does not import pytest.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable

from otel_swa.testing.verdict import AUDIT_RULES, PROVENANCE_RULES, REPORTED_RULES, AuditPeak, AuditRule

__all__ = ["EVERY_RANK", "RuleTally", "MissingLines", "GroupTally", "StreamTally", "Tally"]

#: The rank key of a group that holds every rank of its run (``ranks="all"``).
EVERY_RANK = object()


class RuleTally:
    """The peak of one rule's field over the records that carry it, and its first non-zero value.

    Attributes:
        rule: the :class:`~otel_swa.testing.verdict.AuditRule`.
        peak: the largest value (``None`` before any record carried the field).
        peak_item: the first :class:`~otel_swa.testing.runs.RunRecord` holding it.
        first: the first one whose value is above 0, or ``None``.
    """

    __slots__ = ("rule", "peak", "peak_item", "first")

    def __init__(self, rule: AuditRule) -> None:
        self.rule = rule
        self.peak: int | None = None
        self.peak_item: Any = None
        self.first: Any = None

    def add(self, value: int, item: Any) -> None:
        if self.peak_item is None or value > self.peak:
            self.peak, self.peak_item = value, item
        if value > 0 and self.first is None:
            self.first = item

    def result(self) -> AuditPeak:
        first = self.first if self.peak > 0 else None
        return AuditPeak(self.rule, self.peak, self.peak_item.record.forward_ct, self.peak_item.line_no,
                         first.record.forward_ct if first else None, first.line_no if first else None,
                         first.record.offender(self.rule.field) if first else None)


def _peaks(tallies: Iterable[RuleTally]) -> list[AuditPeak]:
    """The :class:`AuditPeak` of every rule some record carried, in the rules' order."""
    return [tally.result() for tally in tallies if tally.peak_item is not None]


class MissingLines:
    """otel-swa's records of a group without their line of one kind (the audit line, the
    provenance line), and whether any record of the group carries one: the first two lines of the
    missing ones, their count, and the count on the latest line among them (the log's last line may
    still be written: :meth:`missing` leaves it out)."""

    __slots__ = ("carried", "count", "first", "second", "top", "at_top")

    def __init__(self) -> None:
        self.carried = False
        self.count = 0
        self.first: int | None = None
        self.second: int | None = None  # the first missing line after ``first`` on another line
        self.top: int | None = None
        self.at_top = 0

    def add(self, line_no: int) -> None:
        self.count += 1
        if self.first is None:
            self.first = line_no
        elif self.second is None and line_no != self.first:
            self.second = line_no
        if self.top is None or line_no > self.top:
            self.top, self.at_top = line_no, 1
        elif line_no == self.top:
            self.at_top += 1

    def missing(self, end: int | None) -> tuple[int, int | None]:
        """How many are missing, and the line of the first, leaving out those on line ``end`` (the
        last line of the log: a line still to be written)."""
        if not self.carried or not self.count:
            return 0, None
        count = self.count - (self.at_top if end is not None and self.top == end else 0)
        first = self.second if self.first == end else self.first
        return count, (first if count else None)


def _values(rules: "tuple[AuditRule, ...]") -> Any:
    """A function giving a record's values of ``rules``' fields as a tuple, whatever their count."""
    if len(rules) == 1:
        one = operator.attrgetter(rules[0].field)
        return lambda record: (one(record),)
    if not rules:
        return lambda record: ()
    return operator.attrgetter(*(rule.field for rule in rules))


_AUDIT_VALUES = _values(AUDIT_RULES)
_PROVENANCE_VALUES = _values(PROVENANCE_RULES)
_REPORTED_VALUES = _values(REPORTED_RULES)
_AUDITED = len(AUDIT_RULES)


def _add_values(tallies: "list[RuleTally]", values: tuple, item: Any) -> None:
    for tally, value in zip(tallies, values):
        if value is not None:
            tally.add(value, item)


class GroupTally:
    """The running figures of one judged group of records (see the module docstring).

    Attributes:
        records: how many records it holds.
        first, last: its first and last :class:`~otel_swa.testing.runs.RunRecord`.
        latest: the last one with the largest line number (a record without one counts as 0).
        applicable: no record said ``divergence_applicable=false``.
        divergence, out_of_window: the first record holding the largest ``swa_full_idx_divergence``
            and ``swa_out_of_window_tokens``.
        audited, checked: how many records carry an audit-line check's field, a provenance line.
        audit, provenance, reported: a :class:`RuleTally` per rule of
            :data:`~otel_swa.testing.verdict.AUDIT_RULES`, ``PROVENANCE_RULES``, ``REPORTED_RULES``.
        audit_lines, provenance_lines: :class:`MissingLines` of each kind.
    """

    __slots__ = ("records", "first", "last", "latest", "applicable", "divergence", "out_of_window", "audited",
                 "checked", "audit", "provenance", "reported", "audit_lines", "provenance_lines", "_seen")

    def __init__(self) -> None:
        self.records = 0
        self.first: Any = None
        self.last: Any = None
        self.latest: Any = None
        self.applicable = True
        self.divergence: Any = None
        self.out_of_window: Any = None
        self.audited = 0
        self.checked = 0
        self.audit = [RuleTally(rule) for rule in AUDIT_RULES]
        self.provenance = [RuleTally(rule) for rule in PROVENANCE_RULES]
        self.reported = [RuleTally(rule) for rule in REPORTED_RULES]
        self.audit_lines = MissingLines()
        self.provenance_lines = MissingLines()
        # the values of the audit, provenance and reported fields last counted: a record with the same
        # values changes no peak and no first non-zero (the usual record, all 0), so it is not counted again
        self._seen: list = [None, None, None]

    def add(self, item: Any) -> None:
        record = item.record
        self.records += 1
        if self.first is None:
            self.first = item
        self.last = item
        latest = self.latest
        if latest is None or (item.line_no or 0) >= (latest.line_no or 0):
            self.latest = item
        if not record.divergence_applicable:
            self.applicable = False
        best = self.divergence
        if best is None or record.swa_full_idx_divergence > best.record.swa_full_idx_divergence:
            self.divergence = item
        best = self.out_of_window
        if best is None or record.swa_out_of_window_tokens > best.record.swa_out_of_window_tokens:
            self.out_of_window = item
        seen = self._seen
        values = _AUDIT_VALUES(record)
        audited = values.count(None) < _AUDITED
        if audited:
            self.audited += 1
            if values != seen[0]:
                seen[0] = values
                _add_values(self.audit, values, item)
        checked = record.provenance_checked
        if checked:
            self.checked += 1
            values = _PROVENANCE_VALUES(record)
            if values != seen[1]:
                seen[1] = values
                _add_values(self.provenance, values, item)
        values = _REPORTED_VALUES(record)
        if values != seen[2]:
            seen[2] = values
            _add_values(self.reported, values, item)
        if item.line_no is not None and record.verify_source is not None:  # otel-swa's line of a log
            lines = self.audit_lines
            if audited or record.micro_batch is not None or not record.divergence_applicable or any(
                    getattr(record, name) is not None for name in _OTHER_AUDIT_FIELDS):
                lines.carried = True
            else:
                lines.add(item.line_no)
            if checked:
                self.provenance_lines.carried = True
            else:
                self.provenance_lines.add(item.line_no)

    def audit_peaks(self) -> list[AuditPeak]:
        return _peaks(self.audit)

    def provenance_peaks(self) -> list[AuditPeak]:
        return _peaks(self.provenance)

    def reported_peaks(self) -> list[AuditPeak]:
        return _peaks(self.reported)


def _other_audit_fields() -> tuple[str, ...]:
    from otel_swa.record import AUDIT_FIELDS

    judged = {rule.field for rule in AUDIT_RULES}
    return tuple(name for name in AUDIT_FIELDS if name not in judged)


#: The audit line's fields no rule judges: a record carrying one came with its audit line too.
_OTHER_AUDIT_FIELDS = _other_audit_fields()


class StreamTally:
    """The records of one writer in one place (part), as the judge's run and rank rules see them.

    Attributes:
        count: how many records.
        ranks: the ranks in order of their first record (a dict used as an ordered set).
        runs_of_rank: rank -> the runs of its records, in order (a run again after another counts again).
        marks: rank -> ``[count, first line, second line]`` of its records marked
            :attr:`~otel_swa.testing.runs.RunRecord.back_and_forth`.
        starts: run -> the line of its first record (``None`` off a log); first_lines: run -> the
            first line of its records that has one.
        last_run: the run of the last record.
        top_line: the largest line of its records (``None`` without any).
        groups: (run or ``None``, rank or :data:`EVERY_RANK`) -> :class:`GroupTally`.
    """

    __slots__ = ("count", "ranks", "runs_of_rank", "marks", "starts", "first_lines", "last_run", "top_line",
                 "groups", "_each_run", "_each_rank")

    def __init__(self, each_run: bool, each_rank: bool) -> None:
        self.count = 0
        self.ranks: dict = {}
        self.runs_of_rank: dict = {}
        self.marks: dict = {}
        self.starts: dict = {}
        self.first_lines: dict = {}
        self.last_run: int | None = None
        self.top_line: int | None = None
        self.groups: dict = {}
        self._each_run = each_run
        self._each_rank = each_rank

    def add(self, item: Any) -> None:
        self.count += 1
        rank, run, line_no = item.rank, item.run, item.line_no
        seen = self.runs_of_rank.get(rank)
        if seen is None:
            self.ranks[rank] = None
            seen = self.runs_of_rank[rank] = []
        if not seen or seen[-1] != run:
            seen.append(run)
        if item.back_and_forth:
            mark = self.marks.setdefault(rank, [0, None, None])
            mark[0] += 1
            if mark[0] <= 2:
                mark[mark[0]] = line_no
        if run not in self.starts:
            self.starts[run] = line_no
        if line_no is not None:
            self.first_lines.setdefault(run, line_no)
            if self.top_line is None or line_no > self.top_line:
                self.top_line = line_no
        self.last_run = run
        key = (run if self._each_run else None, rank if self._each_rank else EVERY_RANK)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = GroupTally()
        group.add(item)

    def group(self, run: int | None, rank: Any) -> GroupTally:
        """The tally of ``run`` (``None``: every run) and ``rank`` (:data:`EVERY_RANK`: every
        rank); an empty one when no record went there."""
        return self.groups.get((run, rank)) or GroupTally()


class Tally:
    """Every :class:`StreamTally` of a source, by ``(part, writer)`` in order of appearance.

    Args:
        runs, ranks: the judge's modes (``runs="all"``: one group for every run; ``ranks="all"``: one
            for every rank of a run).
    """

    def __init__(self, runs: str, ranks: str) -> None:
        self.streams: dict = {}
        self.records = 0
        self._each_run = runs != "all"
        self._each_rank = ranks != "all"

    def add(self, item: Any) -> None:
        self.records += 1
        key = (item.part, item.writer)
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = StreamTally(self._each_run, self._each_rank)
        stream.add(item)

    def add_all(self, items: Iterable[Any]) -> "Tally":
        for item in items:
            self.add(item)
        return self
