"""The provenance line (:data:`~otel_swa.record.PROVENANCE_PREFIX`): what the checks of the KV held
in the slots found (the write check, the provenance stamps, the content checksum, vLLM's block
hashes), written right after the record's audit line (or after the record when it has none), same
tag, same ``forward_ct``, ``micro_batch`` when known::

    otel_swa[verify=attention] otel_swa_provenance={"forward_ct":40,"kv_write_checks":16,"kv_write_mismatches":0,...}

An engine or configuration with provenance off writes no such line.
"""

from __future__ import annotations

from typing import Any, Callable

from otel_swa.record.matches import LineMatch
from otel_swa.record.values import logged_counts

__all__ = ["PROVENANCE_FIELDS", "PROVENANCE_FAULTS", "ProvenanceMatch", "provenance_line_fields", "decode_provenance",
           "provenance_changes"]

#: The provenance fields, in the order the provenance line writes them; each an int >= 0, or
#: ``None`` when not measured:
#:
#: * ``kv_write_checks``: (token, layer) pairs whose stored K and V were compared with what the layer
#:   was given to store; ``kv_write_mismatches``: of which the pool held other values at the slot
#:   the tables name (a write to the wrong index, into another token's slot; a fault);
#:   ``kv_write_unchecked``: pairs that could not be compared (fp8/quantized cache, a layout the
#:   check does not cover);
#: * ``kv_stamp_checks``: live token slots (FULL and SWA pools together) whose provenance stamp was
#:   compared with the stamp expected from the request's own tokens; ``kv_foreign_tokens``: of which
#:   the slot's stamp was another token's (swapped ownership, stale prefix / radix reuse, a slot
#:   overwritten by another request, a wrong position written) or none (never stamped: no forward
#:   step wrote the slot since otel-swa started; a fault); ``kv_stamp_unchecked``: live slots not
#:   judged (token ids unknown, over the per-sample budget; never stamped, for an engine wired after
#:   it held KV);
#: * ``kv_checksum_checks``: live token slots whose K/V bytes were hashed again and compared with
#:   the hash taken at the write; ``kv_corrupt_tokens``: of which the bytes changed after the write
#:   (a stray kernel, a bad load-back, a bit flip; a fault);
#: * ``kv_cache_entries_checked`` (vLLM): prefix-cache map entries and table entries whose block hash
#:   was compared; ``kv_stale_cache_entries``: map entries naming a block whose own hash is not the
#:   key (a fault); ``kv_foreign_blocks``: blocks in a request's table at a full-block index whose
#:   hash is not the request's block hash for that index, or blocks of another KV cache group (a
#:   fault).
PROVENANCE_FIELDS = (
    "kv_write_checks",
    "kv_write_mismatches",
    "kv_write_unchecked",
    "kv_stamp_checks",
    "kv_foreign_tokens",
    "kv_stamp_unchecked",
    "kv_checksum_checks",
    "kv_corrupt_tokens",
    "kv_cache_entries_checked",
    "kv_stale_cache_entries",
    "kv_foreign_blocks",
)

#: The provenance fields that are faults (each names its first offender on a fault line).
PROVENANCE_FAULTS = (
    "kv_write_mismatches",
    "kv_foreign_tokens",
    "kv_corrupt_tokens",
    "kv_stale_cache_entries",
    "kv_foreign_blocks",
)

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
