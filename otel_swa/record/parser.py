"""Every line of a text, of every kind in :data:`~otel_swa.record.kinds.LINE_KINDS`, found in order
(:func:`iter_entries`), and the records with the lines that belong to them attached
(:func:`find_all`, :func:`iter_matches`, :func:`find_last`)."""

from __future__ import annotations

import bisect
import re
import sys
from typing import Iterator

from otel_swa.record.decoding import MalformedRecordError, decode_object
from otel_swa.record.kinds import KIND_OF_PREFIX
from otel_swa.record.logtext import (
    NO_PREFIX,
    SGLANG_PREFIX_RE,
    LogPrefix,
    PrefixClaims,
    clean,
    clean_marked,
    glued_tag,
    nearest_prefix,
    tag_ending,
)
from otel_swa.record.matches import LineMatch
from otel_swa.record.pairing import AuditPairing
from otel_swa.record.prefixes import LINE_PREFIX, PREFIX_RE
from otel_swa.record.sglang_line import RecordMatch, SwaDivergenceRecord, register_reader
from otel_swa.record.whole_lines import WHOLE_LINE_RE, RecordGroup, record_groups, whole_line

__all__ = ["Entry", "RecordGroup", "FoundRecords", "decode_at", "parse_record", "iter_entries", "iter_matches", "find_all", "find_last"]

#: A line found in a text: a :class:`~otel_swa.record.LineMatch` of its kind's type.
Entry = LineMatch


def decode_at(text: str, match: re.Match, line_no: int | None, prefix: LogPrefix, line_start: int | None = None,
              head: str | None = None) -> Entry:
    """The entry whose prefix is ``match`` in the cleaned ``text`` (``line_start``: where its
    line starts, found when not given; ``head``: the text from there to the prefix, when known),
    decoded by its kind.

    Raises:
        MalformedRecordError: what follows the prefix is not valid (the reason says why).
    """
    kind = KIND_OF_PREFIX[match.group(0)]
    data, end = decode_object(text, match, line_no)
    shown = text[match.start():end]
    if line_start is None:
        line_start = text.rfind("\n", 0, match.start()) + 1
    if head is None:
        head = text[line_start:match.start()]
    source = tag_ending(head) if "]" in head else None
    if source is None and kind.pairs != "record":
        # an audit line or run start glued right after a record on one line belongs with that
        # record: it takes the tag the record had
        source = glued_tag(text, line_start, match.start())

    def fail(reason: str) -> MalformedRecordError:
        return MalformedRecordError(shown, reason, line_no, kind.prefix)

    value, forward_ct = kind.decode(data, fail, source)
    return kind.match_type(value, shown, line_no, prefix.rank, prefix.timestamp, source, (), forward_ct)


def iter_entries(
    text: str, errors: list[MalformedRecordError] | None = None, *, first_line_no: int = 1,
    prefixes: PrefixClaims | None = None, groups: bool = False,
) -> "Iterator[Entry | RecordGroup]":
    """Yield every line of every kind in ``text`` (records, audit lines, fault lines, run start
    markers, liveness warnings), in order, as found (a line that belongs to a record is not
    attached to it here: see :class:`~otel_swa.record.AuditPairing` and :func:`find_all`).

    Malformed ones are skipped; when ``errors`` is given, their errors (with line number and
    reason) are appended to it. ``first_line_no`` is the number of the first line of ``text`` in
    the whole log (a later chunk of a file being followed), ``prefixes`` the
    :class:`~otel_swa.record.PrefixClaims` of the chunks before it.

    With ``groups``, a record on a whole line (below) followed by whole lines of the same log
    prefix and tag that belong to it (``once`` kinds, such as its audit and provenance lines: its
    ``forward_ct``, one line per kind) is yielded as one :class:`RecordGroup`: the record carries
    their fields, read in one step (what :class:`~otel_swa.record.AuditPairing` would attach to it
    when its lines were yielded one by one: :func:`otel_swa.logsource.logged_entries` reads logs so).

    A line that is one writer's whole line (``[time ranks] otel_swa[verify=...] <prefix>{...}``
    and its line end, nothing else: what otel-swa's line sinks write) is read in one step
    (:mod:`otel_swa.record.whole_lines`); every other text by the general rules below. Both give the same
    entries (the tests hold them equal on every log they read).
    """
    cleaned, bare_crs = clean_marked(text)
    claims = PrefixClaims() if prefixes is None else prefixes
    line_no = first_line_no
    last_pos = 0
    consumed = 0  # end of the last object decoded: a prefix inside it is not a new entry
    size = len(cleaned)
    # bare CRs: line numbers need the general rules (and every line is read by them when the
    # whole-line pattern is unset: what the tests compare the one-step reading with)
    whole = None if bare_crs or WHOLE_LINE_RE is None else WHOLE_LINE_RE.match
    pos = 0  # where the next entry is looked for
    while pos < size:
        if whole is not None and (pos == 0 or cleaned[pos - 1] == "\n") and not claims.waiting:
            # whole lines: each one's own log prefix, the only one waiting, is claimed by it at
            # once, so the claims are left as they were (none waiting), as the general rules leave them
            if groups:
                read, end = record_groups(cleaned, pos, line_no + cleaned.count("\n", last_pos, pos))
                if read:
                    yield from read
                    last = read[-1]
                    line_no = (last.lines[-1] if type(last) is RecordGroup else last).line_no + 1
                    last_pos = pos = end
                    consumed = end - 1  # the last object's end (its line end follows)
                    continue
            line = whole(cleaned, pos)
            if line is not None:
                entry = whole_line(cleaned, line, line_no + cleaned.count("\n", last_pos, line.start(4)))
                if entry is not None:
                    last_pos, line_no = line.start(4), entry.line_no
                    pos = line.end()
                    consumed = pos - 1
                    yield entry
                    continue
        match = PREFIX_RE.search(cleaned, pos)
        if match is None:
            break
        start = match.start()
        if whole is not None:
            line_start = cleaned.rfind("\n", pos, start) + 1
            # lines without a prefix (the engine's own) before the entry's line, which begins with a
            # log prefix: their log prefixes are read for the claims as the entry's would read them
            # (each one's text up to the next prefix, here the one the entry's line begins with)
            if line_start > pos and SGLANG_PREFIX_RE.match(cleaned, line_start) is not None:
                claims.read(cleaned, consumed, line_start)
                consumed = pos = line_start
                continue  # the entry's line may be whole
        line_no += cleaned.count("\n", last_pos, start)
        if bare_crs:  # a bare CR ends a line for the parser, not for the line numbers
            line_no -= bisect.bisect_left(bare_crs, start) - bisect.bisect_left(bare_crs, last_pos)
        last_pos = start
        line_start = cleaned.rfind("\n", 0, start) + 1
        claims.read(cleaned, consumed, start)
        head = cleaned[line_start:start]
        prefix = nearest_prefix(head)
        claimed, rank, candidates = claims.claim()
        # its rank: the prefix nearest before it, when one stands between the entry before and it
        # (no rank's sequence known yet says otherwise: :mod:`otel_swa.testing.runs` may move it),
        # else the prefix it claims (it stands after another record, or at the start of a line)
        own = (prefix if consumed <= line_start else nearest_prefix(cleaned[consumed:start])).rank
        if own is not None:
            rank = own
        if claimed and rank != prefix.rank:
            prefix = LogPrefix(prefix.timestamp, rank)
        try:
            entry = decode_at(cleaned, match, line_no, prefix, line_start, head)
        except MalformedRecordError as exc:
            if errors is not None:
                errors.append(exc)
            consumed = pos = match.end()
            continue
        consumed = pos = match.start() + len(entry.text)
        if candidates:
            entry = entry._replace(rank_candidates=candidates)
        yield entry
        if cleaned.startswith("\n", pos):
            pos += 1  # the next line's start: it may be a whole line


class FoundRecords(list):
    """The records found in a text, in order (a ``list`` of
    :class:`~otel_swa.record.SwaDivergenceRecord`), each with the fields of the lines that belong
    to it (its audit line, its fault lines...) when they followed it.

    Attributes:
        matches: a :class:`~otel_swa.record.RecordMatch` per record, same order.
        entries: every line found, in order (records, audit and fault lines, run start markers,
            liveness warnings: :class:`~otel_swa.record.LineMatch` of each kind).
        malformed: how many prefixes were followed by something that is not valid; they were
            skipped.
        errors: the :class:`~otel_swa.record.MalformedRecordError` for each skipped one (line
            number and reason).
    """

    def __init__(self) -> None:
        super().__init__()
        self.matches: list[RecordMatch] = []
        self.entries: list[Entry] = []
        self.errors: list[MalformedRecordError] = []

    @property
    def malformed(self) -> int:
        return len(self.errors)


def find_all(text: str) -> FoundRecords:
    """Every record in ``text``, in order, the lines that belong to each attached
    (:class:`~otel_swa.record.AuditPairing`); an empty result when there is none.

    Malformed lines are skipped and counted in ``result.malformed`` (``result.errors`` says where
    and why); nothing is raised.
    """
    found = FoundRecords()
    pairing = AuditPairing()
    for entry in iter_entries(text, found.errors):
        if entry.per_record:
            error = pairing.attach(entry)
            if error is not None:
                found.errors.append(error)
            found.entries.append(entry)
        else:
            pairing.add(found.entries, entry)
    found.matches.extend(entry for entry in found.entries if isinstance(entry, RecordMatch))
    found.extend(match.record for match in found.matches)
    return found


def iter_matches(text: str, errors: list[MalformedRecordError] | None = None) -> Iterator[RecordMatch]:
    """Yield every record in ``text`` (any number of lines), in order, audit lines attached.

    Malformed lines are skipped; when ``errors`` is given, their errors are appended to it.
    """
    found = find_all(text)
    if errors is not None:
        errors.extend(found.errors)
    yield from found.matches


def find_last(text: str) -> tuple[SwaDivergenceRecord, str] | None:
    """The last valid record in ``text`` and the matched text, or ``None`` when there is none.

    Mirrors SGLang's ``find_last``; malformed records are skipped.
    """
    found = find_all(text)
    if not found.matches:
        return None
    last = found.matches[-1]
    return last.record, last.text


def parse_record(line: str) -> SwaDivergenceRecord:
    """The first record in ``line`` (:meth:`SwaDivergenceRecord.parse`).

    Raises:
        MalformedRecordError: no record prefix in ``line``, or what follows the first one is not a
            record.
    """
    text = clean(line)
    for match in PREFIX_RE.finditer(text):
        if match.group(0) != LINE_PREFIX:
            continue
        return decode_at(text, match, None, NO_PREFIX).record
    raise MalformedRecordError(text, f"no {LINE_PREFIX!r} prefix found")


register_reader(sys.modules[__name__])
