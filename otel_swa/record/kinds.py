"""The table of line kinds: for each prefix, how its line is decoded, what it is found as, and,
for a line that belongs to a record, what it sets on that record. The parser
(:mod:`otel_swa.record.parser`) and the pairing (:class:`~otel_swa.record.AuditPairing`) loop over
it; a new line kind is a module of its own and one row here (and its prefix in
:mod:`otel_swa.record.prefixes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from otel_swa.record.audit_line import AuditMatch, audit_changes, decode_audit
from otel_swa.record.fault_line import FaultMatch, decode_fault, fault_changes, fault_refusal
from otel_swa.record.liveness_line import LivenessMatch, decode_liveness
from otel_swa.record.matches import LineMatch
from otel_swa.record.prefixes import (
    AUDIT_PREFIX,
    FAULT_PREFIX,
    LINE_PREFIX,
    LIVENESS_PREFIX,
    PREFIX_WORDS,
    PROVENANCE_PREFIX,
    RUN_START_PREFIX,
)
from otel_swa.record.provenance_line import ProvenanceMatch, decode_provenance, provenance_changes
from otel_swa.record.run_start_line import RunStartMatch, decode_run_start
from otel_swa.record.sglang_line import RecordMatch, decode_record

__all__ = ["LineKind", "LINE_KINDS", "KIND_OF_PREFIX", "KIND_OF_MATCH", "PAIRS", "kind_of"]

#: How a line kind stands to the records (:attr:`LineKind.pairs`): ``record``: it is the record;
#: ``once``: at most one per record, written right after it (or after the record's earlier lines);
#: ``each``: any number per record; ``alone``: belongs to no record (run start, liveness).
PAIRS = ("record", "once", "each", "alone")


@dataclass(frozen=True)
class LineKind:
    """One kind of line otel-swa writes or reads.

    Attributes:
        prefix: its prefix (:mod:`otel_swa.record.prefixes`).
        match_type: what a line of it is found as (a :class:`~otel_swa.record.LineMatch` subclass).
        decode: ``decode(data, fail, verify_source) -> (value, forward_ct)``: the line's JSON
            object checked and decoded (``fail(reason)`` is the error to raise), ``forward_ct``
            ``None`` when the line names none.
        pairs: one of :data:`PAIRS`.
        changes: for a line that belongs to a record: ``changes(record, value) -> dict``, the record
            fields the line sets on its record.
        refusal: for such a line: ``refusal(record, value) -> str | None``, why the line cannot
            belong to that record (``None`` when it can).
    """

    prefix: str
    match_type: type
    decode: Callable[[dict, Callable[[str], Exception], "str | None"], "tuple[Any, int | None]"]
    pairs: str
    changes: "Callable[[Any, Any], dict] | None" = None
    refusal: "Callable[[Any, Any], str | None] | None" = None

    def __post_init__(self) -> None:
        if self.pairs not in PAIRS:
            raise ValueError(f"LineKind.pairs must be one of {', '.join(PAIRS)}, got {self.pairs!r}")
        if self.prefix not in PREFIX_WORDS:
            raise ValueError(f"LineKind.prefix {self.prefix!r} is not in the prefix table")
        if self.match_type.per_record != (self.pairs in ("once", "each")):
            raise ValueError(f"{self.match_type.__name__}.per_record does not fit pairs={self.pairs!r}")

    @property
    def words(self) -> str:
        """What its line is called (``"audit line"``)."""
        return PREFIX_WORDS[self.prefix]


#: Every line kind, in the order a line sink writes them for one record (run start and liveness
#: stand apart from records).
LINE_KINDS: tuple[LineKind, ...] = (
    LineKind(LINE_PREFIX, RecordMatch, decode_record, "record"),
    LineKind(AUDIT_PREFIX, AuditMatch, decode_audit, "once", audit_changes),
    LineKind(PROVENANCE_PREFIX, ProvenanceMatch, decode_provenance, "once", provenance_changes),
    LineKind(FAULT_PREFIX, FaultMatch, decode_fault, "each", fault_changes, fault_refusal),
    LineKind(RUN_START_PREFIX, RunStartMatch, decode_run_start, "alone"),
    LineKind(LIVENESS_PREFIX, LivenessMatch, decode_liveness, "alone"),
)

KIND_OF_PREFIX: dict[str, LineKind] = {kind.prefix: kind for kind in LINE_KINDS}
KIND_OF_MATCH: dict[type, LineKind] = {kind.match_type: kind for kind in LINE_KINDS}


def kind_of(match: LineMatch) -> LineKind:
    """The kind of a line found (:data:`KIND_OF_MATCH` of its type)."""
    return KIND_OF_MATCH[type(match)]
