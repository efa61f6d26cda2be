"""The checks otel-swa runs at a sampled step, one module each, and the one table that registers them.

A check (:class:`~otel_swa.checks.protocol.Check`) declares its record fields with their line kind
and role, its metric rows, what it stages on the device and how it reads that back on the host with
its first offenders, its replay summary row and its failure reason. The reporter, the record and its
lines, the CI judge, the replay summary, the metrics and the events loop over :data:`CHECKS`; none
of them spells a check's field names. How to add one: ``docs/checks.md``.

The order of :data:`CHECKS` is the order of the fields on each line (the ``otel_swa_audit=`` line
takes the ``audit`` checks' fields, the ``otel_swa_provenance=`` line the ``provenance`` ones'), of
the fault lines of a sample, of the judge's rules and of the summary's rows.

Importing this package imports neither torch nor OpenTelemetry.
"""

from __future__ import annotations

import re
from typing import Any

from otel_swa.checks import block_audit, block_hashes, provenance, read, slot_audit, window, write
from otel_swa.checks.protocol import LINE_KINDS, Check, CheckField, MetricRow, SampleBatch, Staging

__all__ = ["CHECKS", "CHECKS_BY_NAME", "Check", "CheckField", "MetricRow", "SampleBatch", "Staging", "LINE_KINDS",
           "fields_on", "faults_on", "record_fields", "fault_fields", "field_spec", "default_parts", "use_table"]

#: Every check, in the order of their fields on the lines and of their fault lines.
CHECKS: "tuple[Check, ...]" = (
    slot_audit.CHECK,
    window.CHECK,
    read.CHECK,
    write.CHECK,
    provenance.CHECK,
    block_audit.CHECK,
    block_hashes.CHECK,
)

#: The record's own fields and attributes, which no check field may take (SGLang's five and the rest).
RECORD_OWN = frozenset(("forward_ct", "verify_full", "verify_swa", "swa_full_idx_divergence",
                        "swa_out_of_window_tokens", "divergence_applicable", "verify_source", "micro_batch",
                        "offenders"))
_FIELD_NAME = re.compile(r"(swa|kv)_[a-z0-9_]+")

#: The checks by :attr:`~otel_swa.checks.protocol.Check.name`.
CHECKS_BY_NAME: "dict[str, Check]" = {}
_SPECS: "dict[str, CheckField]" = {}


def use_table(table: "tuple[Check, ...]") -> None:
    """Make ``table`` the registered checks (what :data:`CHECKS` says; a test of a new check runs
    with the table it would have). The record's fields are made from the table when
    :mod:`otel_swa.record` is first imported: call this before.

    Raises:
        ValueError: two checks with one name or one field, an unknown line kind.
    """
    global CHECKS
    specs: "dict[str, CheckField]" = {}
    owner: "dict[str, str]" = {}
    names = set()
    metrics: "dict[str, str]" = {}
    for check in table:
        if check.name in names:
            raise ValueError(f"two checks are named {check.name!r}")
        names.add(check.name)
        if check.line not in LINE_KINDS:
            raise ValueError(f"check {check.name!r}: line must be one of {', '.join(LINE_KINDS)}, got {check.line!r}")
        if not check.fields:
            raise ValueError(f"check {check.name!r} declares no field; expected at least one CheckField")
        for spec in check.fields:
            if spec.name in specs:
                raise ValueError(f"record field {spec.name!r} is declared by checks {owner[spec.name]!r} and "
                                 f"{check.name!r}")
            if spec.name in RECORD_OWN or not _FIELD_NAME.fullmatch(spec.name):
                raise ValueError(f"check {check.name!r}: field name {spec.name!r} is the record's own or not of the "
                                 "form swa_<words> / kv_<words> (lowercase letters, digits, underscores)")
            specs[spec.name] = spec
            owner[spec.name] = check.name
        for row in check.metrics:
            used = [row.field] if row.field is not None else [n for n in row.outcomes[1:] if n is not None]
            if any(n not in check.names for n in used):
                raise ValueError(f"check {check.name!r}: metric {row.name!r} reads {used}, expected its own fields "
                                 f"{list(check.names)}")
            if row.name in metrics:
                raise ValueError(f"metric {row.name!r} is declared by checks {metrics[row.name]!r} and {check.name!r}")
            metrics[row.name] = check.name
        try:
            check.reason.format(found="x")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"check {check.name!r}: reason {check.reason!r} must format with {{found}} only: "
                             f"{exc!r}") from None
    CHECKS = tuple(table)
    CHECKS_BY_NAME.clear()
    CHECKS_BY_NAME.update((check.name, check) for check in CHECKS)
    _SPECS.clear()
    _SPECS.update(specs)


use_table(CHECKS)


def fields_on(line: str) -> "tuple[str, ...]":
    """The record fields written on ``line`` (one of :data:`LINE_KINDS`), in line order."""
    return tuple(name for check in CHECKS if check.line == line for name in check.names)


def faults_on(line: str) -> "tuple[str, ...]":
    """The fault fields written on ``line``, in order."""
    return tuple(name for check in CHECKS if check.line == line for name in check.faults)


def record_fields() -> "tuple[str, ...]":
    """Every check field of the record, in :data:`CHECKS` order."""
    return tuple(_SPECS)


def fault_fields() -> "tuple[str, ...]":
    """Every fault field: the audit line's, then the provenance line's."""
    return tuple(name for line in LINE_KINDS for name in faults_on(line))


def field_spec(name: str) -> CheckField:
    """The :class:`~otel_swa.checks.protocol.CheckField` of record field ``name``.

    Raises:
        KeyError: no check declares ``name``.
    """
    return _SPECS[name]


def default_parts(kernels: Any, device: Any, **options: Any) -> "dict[str, Any]":
    """The device parts a new reporter makes on ``device`` (the checks'
    :meth:`~otel_swa.checks.protocol.Check.default_part`; ``kernels``: :mod:`otel_swa.device`)."""
    parts = {}
    for check in CHECKS:
        part = check.default_part(kernels, device, options)
        if part is not None:
            parts[check.name] = part
    return parts
