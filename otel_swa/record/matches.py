"""One shape for a line of any kind found in a text (:class:`LineMatch`); each line kind names its
value with a subclass of one line (:class:`~otel_swa.record.RecordMatch`,
:class:`~otel_swa.record.AuditMatch`...)."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["LineMatch", "rank_sure"]


def rank_sure(entry: Any) -> bool:
    """Whether the entry's rank is sure: no other process's log prefix was waiting when it was
    read (``rank_candidates`` empty, :class:`~otel_swa.record.PrefixClaims`)."""
    return not entry.rank_candidates


class LineMatch(NamedTuple):
    """One line found in a text, of any kind (the subclass says which).

    Attributes:
        value: what the line holds, decoded and checked by its kind: the record
            (:attr:`RecordMatch.record`), the audit line's fields (:attr:`AuditMatch.audit`), the
            fault line's :class:`~otel_swa.record.Offender` (:attr:`FaultMatch.offender`), the JSON
            object of a run start marker or liveness warning (``fields``)...
        text: the matched text: the prefix and its JSON object, exactly as in the log.
        line_no: 1-based number of the line (of the cleaned text) it was found on; ``None`` for a
            line that was not read from a log.
        rank, timestamp: from the log prefix nearest before it on its line
            (:class:`~otel_swa.record.LogPrefix`); when it stands after another record or at the
            start of a line, the rank is that of the prefix it claims
            (:class:`~otel_swa.record.PrefixClaims`).
        verify_source: from the otel-swa tag before it, ``None`` without one.
        rank_candidates: when several log prefixes were waiting for their messages as it was read
            (processes writing one log in parts), their ranks (its own among them: its ``rank`` is
            then a guess); empty when its rank is sure.
        forward_ct: the ``forward_ct`` it names (a record's own; an audit or fault line's: its
            record's), ``None`` for a line that names none.

    ``per_record`` (a class attribute) is true for the kinds that belong to a record written just
    before them (:class:`~otel_swa.record.AuditPairing` attaches them).
    """

    value: Any
    text: str
    line_no: int | None
    rank: str | None = None
    timestamp: str | None = None
    verify_source: str | None = None
    rank_candidates: tuple = ()
    forward_ct: int | None = None

    per_record = False
    rank_sure = property(rank_sure)
