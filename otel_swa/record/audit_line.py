"""The audit line (:data:`~otel_swa.record.AUDIT_PREFIX`): the record's fields beyond SGLang's five,
written right after the record's line, same tag, same ``forward_ct``::

    otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,...}

(the whole line: :mod:`otel_swa.record`'s docstring).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from otel_swa.checks import fields_on
from otel_swa.record.matches import LineMatch
from otel_swa.record.values import logged_counts

__all__ = ["AUDIT_FIELDS", "AuditMatch", "audit_line_fields", "decode_audit", "audit_changes"]

#: Fields beyond SGLang's (never in SGLang's line; on the audit line): the fields of every check whose
#: line is ``audit`` (:data:`otel_swa.checks.CHECKS`: the SWA slot audit, the window check, the read
#: check, the KV block audit), in their order; each ``None`` when not measured.
AUDIT_FIELDS = fields_on("audit")


class AuditMatch(LineMatch):
    """One audit line found in a text (:class:`~otel_swa.record.LineMatch`); ``audit`` (its
    ``value``): the fields it holds besides ``forward_ct`` (``micro_batch``,
    ``divergence_applicable`` and names of :data:`AUDIT_FIELDS`; unknown keys left out)."""

    __slots__ = ()
    per_record = True
    audit = LineMatch.value


def audit_line_fields(record: Any) -> dict[str, "int | bool"]:
    """What the audit line of ``record`` carries besides ``forward_ct``: the micro-batch,
    ``divergence_applicable`` when false, then the audit fields present, in :data:`AUDIT_FIELDS`
    order; empty when the record has no audit line."""
    fields: dict[str, int | bool] = {}
    if record.micro_batch is not None:
        fields["micro_batch"] = record.micro_batch
    if not record.divergence_applicable:
        fields["divergence_applicable"] = False
    fields.update((name, getattr(record, name)) for name in AUDIT_FIELDS if getattr(record, name) is not None)
    return fields


def decode_audit(data: dict, fail: Callable[[str], Exception], source: str | None) -> tuple[dict, int]:
    """``(audit, forward_ct)`` of an audit line's JSON object; keys this version does not know are
    ignored, so fields can be added later.

    Raises:
        MalformedRecordError (through ``fail``): ``forward_ct`` missing, a field that is not a
            non-negative int64, a micro-batch above :data:`~otel_swa.record.MICRO_BATCH_MAX`, a
            ``divergence_applicable`` that is not ``true`` or ``false``.
    """
    audit, forward_ct = logged_counts(data, fail, AUDIT_FIELDS)
    if "divergence_applicable" in data:
        if type(data["divergence_applicable"]) is not bool:  # noqa: E721 - a JSON true/false only
            raise fail(f"divergence_applicable={json.dumps(data['divergence_applicable'])} is not true or false")
        audit["divergence_applicable"] = data["divergence_applicable"]
    return audit, forward_ct


def audit_changes(record: Any, audit: dict) -> dict:
    """The record fields an audit line sets on its record: every audit field (``None`` when the
    line lacks it), the micro-batch when it holds one, and ``divergence_applicable`` when it says
    false."""
    changes: dict = {name: audit.get(name) for name in AUDIT_FIELDS}
    if "micro_batch" in audit:
        changes["micro_batch"] = audit["micro_batch"]
    if audit.get("divergence_applicable") is False:
        changes["divergence_applicable"] = False
    return changes
