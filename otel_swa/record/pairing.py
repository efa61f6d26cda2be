"""Attaching the lines that belong to a record (every kind whose
:attr:`~otel_swa.record.kinds.LineKind.pairs` is ``once`` or ``each``) to their record while a log
is read, possibly in chunks and written by several processes at once (:class:`AuditPairing`)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

from otel_swa.record.decoding import MalformedRecordError
from otel_swa.record.kinds import LINE_KINDS, LineKind, kind_of
from otel_swa.record.matches import LineMatch
from otel_swa.record.sglang_line import SwaDivergenceRecord, _set_in_place

__all__ = ["AuditPairing"]

# A record remembered: (the caller's list of entries, its index there, its forward_ct).
_Slot = tuple


class _Unpaired:
    """The records still without their line of one ``once`` kind: the latest record of each tag
    and rank (:attr:`latest`), and every recent one by tag and ``forward_ct`` (:meth:`elsewhere`),
    at most :attr:`LIMIT` of them (the oldest are let go)."""

    LIMIT = 65536

    def __init__(self) -> None:
        self.latest: dict[tuple[str | None, str | None], _Slot] = {}
        self._waiting: dict[tuple, list] = {}  # (tag, forward_ct) -> [entries, index, rank, forgotten]
        self._order: collections.deque = collections.deque()
        self._outstanding = 0

    def add(self, entries: list, record: SwaDivergenceRecord, rank: str | None) -> None:
        self.latest[(record.verify_source, rank)] = (entries, len(entries) - 1, record.forward_ct)
        key = (record.verify_source, record.forward_ct)
        item = [entries, len(entries) - 1, rank, False]
        self._waiting.setdefault(key, []).append(item)
        order = self._order
        order.append((key, item))
        self._outstanding += 1
        while self._outstanding > self.LIMIT:  # the oldest records still without one are let go
            old_key, old_item = order.popleft()
            if not old_item[3]:
                self._forget(old_key, old_item)
        while order[0][1][3]:  # the oldest ones paired already: let go at once (memory bounded by the unpaired)
            order.popleft()
        if len(order) > 2 * self.LIMIT:
            self._order = collections.deque(pair for pair in order if not pair[1][3])

    def oldest(self, entries: list, waiting: bool = True) -> int | None:
        """The smallest index of ``entries`` this still holds a record at (the latest of its tag
        and rank, or, with ``waiting``, any still waiting), or ``None``."""
        low = None
        for slot in self.latest.values():
            if slot[0] is entries and (low is None or slot[1] < low):
                low = slot[1]
        if not waiting:
            return low
        for _, item in self._order:  # in the order added: the first still waiting is the oldest
            if not item[3]:
                if item[0] is entries and (low is None or item[1] < low):
                    low = item[1]
                break
        return low

    def _forget(self, key: tuple, item: list) -> None:
        item[3] = True
        self._outstanding -= 1
        items = self._waiting.get(key)
        if items is not None:
            items.remove(item)
            if not items:
                del self._waiting[key]

    def paired(self, entries: list, index: int) -> None:
        """The record at ``entries[index]`` has its line now."""
        record = entries[index].record
        key = (record.verify_source, record.forward_ct)
        for item in self._waiting.get(key, ()):
            if item[0] is entries and item[1] == index:
                self._forget(key, item)
                return

    def elsewhere(self, line: LineMatch) -> "_Slot | None":
        """A record of ``line``'s tag with its ``forward_ct`` and no such line yet, of its rank
        first, else the latest; taken (no longer waiting); ``None`` when there is none."""
        key = (line.verify_source, line.forward_ct)
        found = None
        for item in self._waiting.get(key, ()):
            if found is None or item[2] == line.rank or (found[2] != line.rank and item[1] > found[1]):
                found = item
        if found is None:
            return None
        entries, index, rank, _ = found
        latest = self.latest.get((line.verify_source, rank))
        if latest is not None and latest[0] is entries and latest[1] == index:
            del self.latest[(line.verify_source, rank)]
        self._forget(key, found)
        return entries, index, line.forward_ct


class AuditPairing:
    """Attaches the lines that belong to a record (audit lines, fault lines: the line kinds whose
    ``pairs`` is ``once`` or ``each``) to their records while a log is read, possibly in chunks.

    A line of a ``once`` kind (the audit line) belongs to the latest record before it with the same
    tag (``verify_source``) and the same log rank, when that record has the line's ``forward_ct``
    and no line of that kind yet (the line sinks write it right after the record's line, through the
    same logger). When there is none, it belongs to a recent record of its tag with its
    ``forward_ct`` and no line of that kind yet, of another rank or none (several processes writing
    one log at once can move a line's log prefix to another line: :mod:`otel_swa.testing.runs`). A
    line of an ``each`` kind (a fault line) belongs to the latest record before it with the same tag
    and rank, when that record has its ``forward_ct`` (a record may have several), else to the
    latest record of its tag with its ``forward_ct`` of any rank. Any other such line, or one its
    kind refuses for that record (a fault line for a fault the record counts 0), is an error
    (``MalformedRecordError`` with the reason).

    Use :meth:`add` for every record (or other entry) in order, into a list the caller keeps, and
    :meth:`attach` for every line whose ``per_record`` is true: the record's entry in that list is
    replaced by one whose record carries what the line sets (its kind's ``changes``). Entries are
    :class:`~otel_swa.record.RecordMatch` or any object with ``record`` and ``rank`` attributes that
    :func:`dataclasses.replace` can copy (or its ``with_record(record)`` method, when it has one).
    """

    def __init__(self) -> None:
        self._unpaired = {kind.prefix: _Unpaired() for kind in LINE_KINDS if kind.pairs == "once"}
        self._recent: dict[tuple[str | None, str | None], _Slot] = {}

    def add(self, entries: list, entry: Any, lines: "Sequence[LineMatch]" = ()) -> None:
        """Append ``entry`` to ``entries``; remember it when it holds a record (``lines``: the lines
        of ``once`` kinds it already carries, :meth:`joins`)."""
        entries.append(entry)
        record = getattr(entry, "record", None)
        if isinstance(record, SwaDivergenceRecord):
            paired = {kind_of(line).prefix for line in lines} if lines else ()
            self._recent[(record.verify_source, entry.rank)] = (entries, len(entries) - 1, record.forward_ct)
            for prefix, unpaired in self._unpaired.items():
                if prefix in paired:  # as attach() right after add() leaves it: no longer the latest without one
                    unpaired.latest.pop((record.verify_source, entry.rank), None)
                else:
                    unpaired.add(entries, record, entry.rank)

    def oldest_held(self, entries: list, waiting: bool = True) -> int:
        """The smallest index of ``entries`` whose entry a later line may still change: the latest
        record of each tag and rank and, with ``waiting``, every record still without a line of a
        ``once`` kind (up to 65,536 of them: such a line may come late, from another process);
        ``len(entries)`` when there is none. With ``waiting``, the entries before it are final;
        without, a later line may still reach one of them, rarely (a line far from its record)."""
        low = len(entries)
        for slot in self._recent.values():
            if slot[0] is entries and slot[1] < low:
                low = slot[1]
        for unpaired in self._unpaired.values():
            index = unpaired.oldest(entries, waiting)
            if index is not None and index < low:
                low = index
        return low

    @staticmethod
    def joins(record_entry: Any, lines: list, line: LineMatch) -> bool:
        """Whether :meth:`attach` would attach ``line`` to the record of ``record_entry`` were that
        record added (:meth:`add`) just before it and the ``lines`` attached to it: a ``once`` kind
        that takes every record, not among ``lines``, of the record's tag, rank and ``forward_ct``.
        Such lines are applied with the record (:meth:`with_lines`) and the record added once,
        instead of a copy of the record per line."""
        kind = kind_of(line)
        return (kind.pairs == "once" and kind.refusal is None and line.forward_ct == record_entry.forward_ct
                and line.rank == record_entry.rank and line.verify_source == record_entry.record.verify_source
                and all(type(other) is not type(line) for other in lines))

    @staticmethod
    def with_lines(record: SwaDivergenceRecord, lines: list, fresh: bool = False) -> SwaDivergenceRecord:
        """``record`` with what each of ``lines`` sets on it (:meth:`joins`), in order: the record
        :meth:`attach` would leave, in one copy; ``fresh``: ``record`` was just decoded and nobody
        else holds it, so it is changed itself (no copy) and returned."""
        if not lines:
            return record
        changes: dict = {}
        seen = _WithChanges(record, changes)
        for line in lines:
            changes.update(kind_of(line).changes(seen, line.value))
        if fresh:
            _set_in_place(record, changes)
            return record
        return record._replaced(changes)

    def attach(self, line: LineMatch) -> MalformedRecordError | None:
        """Attach a line that belongs to a record (an audit or fault line...) to its record; return
        the error when it has none or its kind refuses it (nothing changed)."""
        kind = kind_of(line)
        slot = self._find_once(kind, line) if kind.pairs == "once" else self._find_each(line)
        if slot is None:
            rank = f" of rank {line.rank}" if line.rank else ""
            return MalformedRecordError(
                line.text, f"no record{rank} with forward_ct={line.forward_ct} just before this {kind.words}",
                line.line_no, kind.prefix,
            )
        entries, index, _ = slot
        record = entries[index].record
        reason = kind.refusal(record, line.value) if kind.refusal is not None else None
        if reason is not None:
            return MalformedRecordError(line.text, reason, line.line_no, kind.prefix)
        entry = entries[index]
        record = record._replaced(kind.changes(record, line.value))
        if isinstance(entry, LineMatch):
            entries[index] = entry._replace(value=record)
        else:
            with_record = getattr(entry, "with_record", None)
            entries[index] = with_record(record) if with_record is not None else dataclasses.replace(entry, record=record)
        return None

    def _find_once(self, kind: LineKind, line: LineMatch) -> "_Slot | None":
        unpaired = self._unpaired[kind.prefix]
        key = (line.verify_source, line.rank)
        slot = unpaired.latest.pop(key, None)
        if slot is not None and slot[2] == line.forward_ct:
            unpaired.paired(slot[0], slot[1])
            return slot
        if slot is not None:
            unpaired.latest[key] = slot
        return unpaired.elsewhere(line)

    def _find_each(self, line: LineMatch) -> "_Slot | None":
        slot = self._recent.get((line.verify_source, line.rank))
        if slot is None or slot[2] != line.forward_ct:
            # its log prefix moved by another process's write: the latest record of its tag with its
            # forward_ct, of any rank
            candidates = [item for (tag, _), item in self._recent.items()
                          if tag == line.verify_source and item[2] == line.forward_ct]
            slot = max(candidates, key=lambda item: item[1]) if candidates else None
        return slot


class _WithChanges:
    """A record's fields as a line kind's ``changes`` reads them, with the changes of the lines
    applied before (:meth:`AuditPairing.with_lines`)."""

    __slots__ = ("_record", "_changes")

    def __init__(self, record: SwaDivergenceRecord, changes: dict) -> None:
        self._record = record
        self._changes = changes

    def __getattr__(self, name: str) -> Any:
        changes = self._changes
        return changes[name] if name in changes else getattr(self._record, name)
