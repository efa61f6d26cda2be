"""The provenance line (:data:`~otel_swa.record.PROVENANCE_PREFIX`): what the checks of the KV held
in the slots found (the write check, the provenance stamps, the content checksum, vLLM's block
hashes), written right after the record's audit line (or after the record when it has none), same
tag, same ``forward_ct``, ``micro_batch`` when known::

    otel_swa[verify=attention] otel_swa_provenance={"forward_ct":40,...}

An engine or configuration with provenance off writes no such line.
"""

from __future__ import annotations

from typing import Any, Callable

from otel_swa.checks import faults_on, fields_on
from otel_swa.record.matches import LineMatch
from otel_swa.record.values import logged_counts

__all__ = ["PROVENANCE_FIELDS", "PROVENANCE_FAULTS", "ProvenanceMatch", "provenance_line_fields", "decode_provenance",
           "provenance_changes"]

#: The provenance fields, in the order the provenance line writes them: the fields of every check
#: whose line is ``provenance`` (:data:`otel_swa.checks.CHECKS`: the write check, the provenance
#: stamps and content checksums, vLLM's block hashes; each check's module says what its fields
#: count); each an int >= 0, or ``None`` when not measured.
PROVENANCE_FIELDS = fields_on("provenance")

#: The provenance fields that are faults (each names its first offender on a fault line).
PROVENANCE_FAULTS = faults_on("provenance")


class ProvenanceMatch(LineMatch):
    """One provenance line found in a text (:class:`~otel_swa.record.LineMatch`); ``provenance``
    (its ``value``): the fields it holds besides ``forward_ct`` (``micro_batch`` and names of
    :data:`PROVENANCE_FIELDS`; unknown keys left out)."""

    __slots__ = ()
    per_record = True
    provenance = LineMatch.value


def provenance_line_fields(record: Any) -> dict[str, int]:
    """What the provenance line of ``record`` carries besides ``forward_ct``: the micro-batch when
    known, then the provenance fields present in :data:`PROVENANCE_FIELDS` order; empty (no line)
    when none is present."""
    fields = {name: getattr(record, name) for name in PROVENANCE_FIELDS if getattr(record, name) is not None}
    if fields and record.micro_batch is not None:
        return {"micro_batch": record.micro_batch, **fields}
    return fields


def decode_provenance(data: dict, fail: Callable[[str], Exception], source: str | None) -> tuple[dict, int]:
    """``(provenance, forward_ct)`` of a provenance line's JSON object; keys this version does not
    know are ignored, so fields can be added later.

    Raises:
        MalformedRecordError (through ``fail``): ``forward_ct`` missing, a field that is not a
            non-negative int64, a micro-batch above :data:`~otel_swa.record.MICRO_BATCH_MAX`.
    """
    return logged_counts(data, fail, PROVENANCE_FIELDS)


def provenance_changes(record: Any, provenance: dict) -> dict:
    """The record fields a provenance line sets on its record: the provenance fields it holds, and
    its micro-batch when the record has none (its audit line was lost)."""
    changes = {name: provenance[name] for name in PROVENANCE_FIELDS if name in provenance}
    if record.micro_batch is None and "micro_batch" in provenance:
        changes["micro_batch"] = provenance["micro_batch"]
    return changes
