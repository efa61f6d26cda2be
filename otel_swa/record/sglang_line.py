"""SGLang's record line (:data:`~otel_swa.record.LINE_PREFIX`) and the record it carries
(:class:`SwaDivergenceRecord`), which also writes the lines otel-swa adds after it::

    kv_canary_swa_divergence={"forward_ct":40,"verify_full":5120,"verify_swa":2048,"swa_full_idx_divergence":17,"swa_out_of_window_tokens":311}

The rules by which it is read (SGLang's parser's) are in :mod:`otel_swa.record`'s docstring.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

from otel_swa.checks import CHECKS_BY_NAME, record_fields
from otel_swa.record.audit_line import AUDIT_FIELDS, audit_changes, audit_line_fields
from otel_swa.record.fault_line import Offender, fault_line_fields
from otel_swa.record.matches import LineMatch
from otel_swa.record.prefixes import (
    AUDIT_PREFIX,
    FAULT_PREFIX,
    LINE_PREFIX,
    PROVENANCE_PREFIX,
    VERIFY_SOURCES,
    tagged,
)
from otel_swa.record.provenance_line import PROVENANCE_FIELDS, provenance_line_fields
from otel_swa.record.values import INT64_MAX, INT64_MIN, MICRO_BATCH_MAX, check_int, check_optional_ints, compact, logged_int

__all__ = ["FIELDS", "SwaDivergenceRecord", "RecordMatch", "decode_record", "register_reader"]

#: The record's fields, in SGLang's order (the order of the JSON keys in the line).
FIELDS = (
    "forward_ct",
    "verify_full",
    "verify_swa",
    "swa_full_idx_divergence",
    "swa_out_of_window_tokens",
)
_FIELD_SET = frozenset(FIELDS)
#: The fields of the registered checks, each ``int | None`` on the record.
_CHECK_FIELDS = record_fields()
#: SGLang's record keys (``SwaDivergenceLog``); ``swa_out_of_window_tokens`` defaults to 0 there.
_SGLANG_DEFAULTS = {"swa_out_of_window_tokens": 0}


def _with_check_fields(cls: type) -> type:
    """Give the record class one keyword-only field per check field (:func:`otel_swa.checks.record_fields`,
    ``int | None``, default ``None``), after its own, before it becomes a dataclass."""
    for name in _CHECK_FIELDS:
        cls.__annotations__[name] = "int | None"
        setattr(cls, name, field(default=None, kw_only=True))
    return cls


@dataclass(frozen=True, slots=True)
@_with_check_fields
class SwaDivergenceRecord:
    """One sample of the SWA KV cache, as SGLang's SWA divergence reporter defines it.

    All fields are Python ``int`` (``bool`` is refused) from 0 to :data:`INT64_MAX`. (Records read
    from a log keep what the log says: SGLang's parser takes negative integers, so the readers of
    this module do too; see the module docstring.)

    Attributes:
        forward_ct: host-side count of forward steps the reporter had seen when the sample was
            taken (a non-zero multiple of the sampling interval).
        verify_full: cumulative number of KV entries checked (read) in the FULL pool, over all
            forward steps so far, unit ``{entry}``.
        verify_swa: the same for the SWA pool. Smaller than ``verify_full`` once prompts exceed
            the sliding window.
        swa_full_idx_divergence: at the sampled step, the number of live tokens of the batch whose
            SWA slot is non-zero and differs from their FULL slot (the SWA allocator remapped).
        swa_out_of_window_tokens: at the sampled step, the number of live tokens whose SWA slot is
            0 (freed because the token left the window; slot 0 is the reserved "none").

    Beyond SGLang's five fields, keyword-only and never written into SGLang's line:

    Attributes:
        divergence_applicable: ``False`` for engines without a FULL-to-SWA mapping (vLLM): the
            line still carries ``swa_full_idx_divergence`` (0) for compatibility, but telemetry
            does not report it as a measurement.
        <each check's fields>: every field of every registered check (:data:`otel_swa.checks.CHECKS`;
            each check's module says what its fields count and in which unit), an int >= 0, or
            ``None`` when the check did not run at this sample; on the check's line
            (:meth:`audit_line` or :meth:`provenance_line`), never in SGLang's line.
        offenders: the first offender of each fault the sample shows (:class:`Offender`, at most
            one per fault of :data:`FAULT_FIELDS`), on the fault lines; ``()`` when none is known.
        verify_source: what ``verify_full`` / ``verify_swa`` count, one of :data:`VERIFY_SOURCES`,
            or ``None`` when unknown (a line SGLang itself wrote, which counts what its canary
            verified). Written as the line's tag by :meth:`line`, never into the JSON.
        micro_batch: under pipeline parallelism, the index of the micro-batch the sampled forward
            step ran (``0 .. MICRO_BATCH_MAX``; SGLang's ``mb_id``), or ``None`` when the engine
            gave none. On the audit line, never in SGLang's line.

    Raises:
        TypeError: a field is not an ``int`` (or is a ``bool``); an audit or provenance field is
            neither ``None`` nor an ``int``; ``divergence_applicable`` is not a ``bool``.
        ValueError: a field is negative or above :data:`INT64_MAX` (the message names the field
            and the value); ``verify_source`` is not ``None`` nor one of :data:`VERIFY_SOURCES`;
            ``micro_batch`` is outside ``0 .. MICRO_BATCH_MAX``.
    """

    forward_ct: int
    verify_full: int
    verify_swa: int
    swa_full_idx_divergence: int
    swa_out_of_window_tokens: int
    divergence_applicable: bool = field(default=True, kw_only=True)
    verify_source: "str | None" = field(default=None, kw_only=True)
    micro_batch: "int | None" = field(default=None, kw_only=True)
    offenders: "tuple[Offender, ...]" = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        for name in FIELDS:
            check_int("SwaDivergenceRecord", name, getattr(self, name), 0)
        check_optional_ints("SwaDivergenceRecord", self, _CHECK_FIELDS)
        if type(self.divergence_applicable) is not bool:
            raise TypeError(f"SwaDivergenceRecord.divergence_applicable must be a bool, got {self.divergence_applicable!r}")
        if self.verify_source is not None and self.verify_source not in VERIFY_SOURCES:
            raise ValueError(
                f"SwaDivergenceRecord.verify_source must be None or one of {', '.join(VERIFY_SOURCES)}, "
                f"got {self.verify_source!r}"
            )
        if self.micro_batch is not None:
            check_int("SwaDivergenceRecord", "micro_batch", self.micro_batch, 0)
            if self.micro_batch > MICRO_BATCH_MAX:
                raise ValueError(
                    f"SwaDivergenceRecord.micro_batch must be from 0 to {MICRO_BATCH_MAX}, got {self.micro_batch}"
                )
        if type(self.offenders) is not tuple or not all(isinstance(o, Offender) for o in self.offenders):  # noqa: E721
            raise TypeError(f"SwaDivergenceRecord.offenders must be a tuple of Offender, got {self.offenders!r}")

    @classmethod
    def _as_logged(cls, values: dict[str, int], verify_source: str | None, audit: dict[str, int] | None = None,
                   divergence_applicable: bool = True) -> "SwaDivergenceRecord":
        """A record as a log line holds it: the five fields already checked to be int64 (negative
        ones included, as SGLang's parser takes them), audit-line fields (the audit fields and
        ``micro_batch``) already checked >= 0."""
        filled = list(_DEFAULTS)
        for name in FIELDS:
            filled[_INDEX[name]] = values[name]
        filled[_INDEX["divergence_applicable"]] = divergence_applicable
        filled[_INDEX["verify_source"]] = verify_source
        record = _unchecked(cls, filled)
        return record if audit is None else record._replaced(audit_changes(record, audit))

    def _replaced(self, changes: "dict[str, Any]") -> "SwaDivergenceRecord":
        """A copy with ``changes`` (field name -> value), not checked again (a record read from a
        log may hold negative totals, which the constructor refuses): what a line read after the
        record sets on it."""
        values = list(_VALUES(self))
        index = _INDEX
        for name, value in changes.items():
            values[index[name]] = value
        return _unchecked(type(self), values)

    def offender(self, fault: str) -> "Offender | None":
        """The first offender of ``fault`` (one of :data:`FAULT_FIELDS`) in this sample, or ``None``."""
        return next((o for o in self.offenders if o.fault == fault), None)

    def checked(self, check: str) -> bool:
        """Whether the fields of the check named ``check`` (:data:`otel_swa.checks.CHECKS_BY_NAME`)
        are present: it ran at this sample."""
        return CHECKS_BY_NAME[check].present(self)

    @property
    def read_checked(self) -> bool:
        """Whether the read check's fields are present (the engine checks what attention read)."""
        return self.checked("read")

    @property
    def audited(self) -> bool:
        """Whether the SWA slot audit fields are present."""
        return self.checked("slot_audit")

    @property
    def window_checked(self) -> bool:
        """Whether the sliding-window check fields are present (the engine gave its window)."""
        return self.checked("window")

    def audit_dict(self) -> dict[str, int]:
        """The audit fields that are present (empty when not audited)."""
        return {name: getattr(self, name) for name in AUDIT_FIELDS if getattr(self, name) is not None}

    @property
    def provenance_checked(self) -> bool:
        """Whether any provenance field is present (the engine checks the KV in the slots)."""
        return _PROVENANCE_VALUES(self).count(None) < len(PROVENANCE_FIELDS)

    def provenance_dict(self) -> dict[str, int]:
        """The provenance fields that are present (empty when provenance is off)."""
        return {name: getattr(self, name) for name in PROVENANCE_FIELDS if getattr(self, name) is not None}

    # ------------------------------------------------------------------ conversions
    def to_dict(self) -> dict[str, int]:
        """SGLang's five fields as a dict, in SGLang's key order (the line's JSON object)."""
        return {name: getattr(self, name) for name in FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SwaDivergenceRecord":
        """Build a record from a dict of the five fields; other keys are ignored (the line readers
        are stricter: see the module docstring).

        Raises:
            KeyError: a field is missing.
            TypeError, ValueError: as the constructor.
        """
        missing = [name for name in FIELDS if name not in data]
        if missing:
            raise KeyError(f"missing field(s) {', '.join(missing)}")
        return cls(**{name: data[name] for name in FIELDS})

    def replace(self, **changes: int) -> "SwaDivergenceRecord":
        """A copy with some fields changed (checked as by the constructor)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ the lines
    def format(self) -> str:
        """The SGLang line body: ``kv_canary_swa_divergence=`` + compact JSON, no spaces.

        Byte-identical to SGLang's ``json.dumps(..., separators=(",", ":"))`` output for the same
        five values. The logging prefix (time, level, rank...) is the log handler's business.
        """
        return LINE_PREFIX + compact(self.to_dict())

    def _tagged(self, body: str) -> str:
        return tagged(self.verify_source, body)

    def _per_record_line(self, prefix: str, fields: dict) -> str:
        """A line that belongs to this record: the tag, ``prefix``, then compact JSON of
        ``forward_ct`` and ``fields``."""
        return self._tagged(prefix + compact({"forward_ct": self.forward_ct, **fields}))

    def line(self) -> str:
        """The message otel-swa logs: :meth:`format`, after the tag ``otel_swa[verify=<source>]``
        when :attr:`verify_source` is known (``otel_swa[verify=kv_canary] kv_canary_swa_divergence={...}``).

        The record part stays byte-identical to SGLang's line, so greps for the prefix and SGLang's
        ``SwaDivergenceLog.find_all`` read it; :func:`find_all` reads the tag back into
        :attr:`verify_source`.
        """
        return self._tagged(self.format())

    def audit_line(self) -> str | None:
        """The audit line of a record, written right after :meth:`line`, or ``None`` when the
        record carries no :data:`AUDIT_FIELDS` field (the slot audit, the window check or both), no
        micro-batch and an applicable divergence: the same tag, then :data:`AUDIT_PREFIX` and
        compact JSON of ``forward_ct``, ``micro_batch`` when known, ``"divergence_applicable":false``
        when so, and the audit fields present, in :data:`AUDIT_FIELDS` order::

            otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,...}
            otel_swa[verify=attention] otel_swa_audit={"forward_ct":41,"micro_batch":1}
            otel_swa[verify=attention] otel_swa_audit={"forward_ct":42,"divergence_applicable":false,...}
        """
        audit = audit_line_fields(self)
        return self._per_record_line(AUDIT_PREFIX, audit) if audit else None

    def provenance_line(self) -> str | None:
        """The provenance line of a record, written right after :meth:`audit_line` (right after
        :meth:`line` when there is none), or ``None`` when the record carries no provenance field
        (provenance off): the same tag, then :data:`~otel_swa.record.PROVENANCE_PREFIX` and compact
        JSON of ``forward_ct``, ``micro_batch`` when known, and the provenance fields present, in
        :data:`~otel_swa.record.PROVENANCE_FIELDS` order::

            otel_swa[verify=attention] otel_swa_provenance={"forward_ct":40,...}
        """
        provenance = provenance_line_fields(self)
        return self._per_record_line(PROVENANCE_PREFIX, provenance) if provenance else None

    def fault_lines(self) -> list[str]:
        """One fault line per offender (:attr:`offenders`, in their order), written after the audit
        and provenance lines: the same tag, then :data:`FAULT_PREFIX` and compact JSON of ``forward_ct``, ``fault``
        and the locations known (:data:`OFFENDER_KEYS` order)::

            otel_swa[verify=attention] otel_swa_fault={"forward_ct":40,"fault":...,"full_slot":88,"swa_slot":9,"swa_page":9}
        """
        return [self._per_record_line(FAULT_PREFIX, fault_line_fields(o)) for o in self.offenders]

    def lines(self) -> list[str]:
        """What a line sink logs for this record: :meth:`line`, then :meth:`audit_line` and
        :meth:`provenance_line` if any, then :meth:`fault_lines`."""
        optional = (self.audit_line(), self.provenance_line())
        return [self.line()] + [line for line in optional if line is not None] + self.fault_lines()

    @classmethod
    def parse(cls, line: str) -> "SwaDivergenceRecord":
        """Parse the first record in ``line`` (a log line, possibly with a prefix before the record).

        Raises:
            MalformedRecordError: no record prefix in ``line``, or what follows the first one is not
                a record by the rules of the module docstring (the reason says which).
        """
        return _reader.parse_record(line)

    # Convenience aliases so that the record type owns its finders, as in SGLang.
    @staticmethod
    def find_last(text: str) -> "tuple[SwaDivergenceRecord, str] | None":
        """See :func:`~otel_swa.record.find_last`."""
        return _reader.find_last(text)

    @staticmethod
    def find_all(text: str) -> "Any":
        """See :func:`~otel_swa.record.find_all`."""
        return _reader.find_all(text)


#: The record's field names in order, their defaults, where each stands, and all its values at once
#: (one C call): what :meth:`SwaDivergenceRecord._replaced` copies, without
#: :func:`dataclasses.fields` on every line read.
_NAMES = tuple(item.name for item in dataclasses.fields(SwaDivergenceRecord))
_DEFAULTS = tuple(item.default for item in dataclasses.fields(SwaDivergenceRecord))
_INDEX = {name: index for index, name in enumerate(_NAMES)}
_VALUES = operator.attrgetter(*_NAMES)
#: The provenance fields' values at once (a tuple: ``forward_ct`` last, never ``None``).
_PROVENANCE_VALUES = operator.attrgetter(*PROVENANCE_FIELDS, "forward_ct")


#: Each field's slot setter (its member descriptor's ``__set__``: what ``object.__setattr__`` does
#: for it, without the name lookup), by field name.
_SETTERS = {name: getattr(SwaDivergenceRecord, name).__set__ for name in _NAMES}


def _builder() -> Any:
    """``build(cls, values)``: a new record of ``cls`` holding ``values`` (a list, one per field of
    :data:`_NAMES`), one slot store per field in straight-line code (what ``dataclasses`` makes of
    an ``__init__``, without its checks)."""
    namespace: dict = {"_new": object.__new__}
    body = ["def build(cls, values):", "    record = _new(cls)"]
    for index, name in enumerate(_NAMES):
        namespace[f"_set{index}"] = _SETTERS[name]
        body.append(f"    _set{index}(record, values[{index}])")
    body.append("    return record")
    exec("\n".join(body), namespace)  # noqa: S102 - our own field names, fixed at import
    return namespace["build"]


#: A record of ``cls`` holding ``values`` (a list, one per field of :data:`_NAMES`), not checked.
_unchecked = _builder()


def _set_in_place(record: SwaDivergenceRecord, changes: "dict[str, Any]") -> None:
    """Set ``changes`` (field name -> value) on ``record`` itself, not checked: only for a record
    just decoded that nobody else holds yet (:meth:`~otel_swa.record.AuditPairing.with_lines` with
    ``fresh``), where a copy would be thrown away at once."""
    setters = _SETTERS
    for name, value in changes.items():
        setters[name](record, value)


#: The reader of every line kind (:mod:`otel_swa.record.parser`, which imports this module): it
#: registers itself when imported (:func:`register_reader`), so the record's own finders reach it
#: without an import back. Importing :mod:`otel_swa.record` imports it.
_reader: Any = None


def register_reader(reader: Any) -> None:
    """Make ``reader`` (a module with ``parse_record``, ``find_all`` and ``find_last``) the one the
    record's :meth:`~SwaDivergenceRecord.parse` and finders use."""
    global _reader
    _reader = reader


class RecordMatch(LineMatch):
    """One record found in a text (:class:`~otel_swa.record.LineMatch`); ``record`` (its ``value``):
    the parsed record, with the fields of its audit line (and the lines after it) once they were
    read (:class:`~otel_swa.record.AuditPairing`)."""

    __slots__ = ()
    record = LineMatch.value


def decode_record(data: dict, fail: Callable[[str], Exception], source: str | None) -> "tuple[SwaDivergenceRecord, int]":
    """``(record, forward_ct)`` of SGLang's line's JSON object, by SGLang's parser's rules (see
    :mod:`otel_swa.record`), tagged with ``source``.

    Raises:
        MalformedRecordError (through ``fail``): a key SGLang's record does not have, a missing
            field, a value that is no int64.
    """
    if data.keys() == _FIELD_SET:  # the common case: the five fields, each an int64
        for value in data.values():
            if type(value) is not int or not INT64_MIN <= value <= INT64_MAX:  # noqa: E721
                break
        else:
            return SwaDivergenceRecord._as_logged(data, source), data["forward_ct"]
    unknown = [key for key in data if key not in _FIELD_SET]
    if unknown:
        raise fail(f"unknown key(s) {', '.join(map(repr, unknown))}: SGLang's SwaDivergenceLog(**fields) "
                   "raises TypeError on them")
    missing = [name for name in FIELDS if name not in data and name not in _SGLANG_DEFAULTS]
    if missing:
        raise fail(f"missing field(s) {', '.join(missing)}")
    values = {name: data.get(name, _SGLANG_DEFAULTS.get(name)) for name in FIELDS}
    for name in FIELDS:
        reason = logged_int(name, values[name], INT64_MIN)
        if reason is not None:
            raise fail(reason)
    return SwaDivergenceRecord._as_logged(values, source), values["forward_ct"]
