"""The fault line (:data:`~otel_swa.record.FAULT_PREFIX`): one fault's first offender
(:class:`Offender`), written after the record's audit line, same tag, same ``forward_ct``::

    otel_swa[verify=attention] otel_swa_fault={"forward_ct":40,"fault":"swa_read_mismatches","request":"7","row":3,...}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from otel_swa.record.matches import LineMatch
from otel_swa.record.values import check_optional_ints, logged_int

__all__ = ["FAULT_FIELDS", "OFFENDER_KEYS", "Offender", "FaultMatch", "fault_line_fields", "decode_fault", "fault_changes",
           "fault_refusal"]

#: The audit fields that are faults: a sample where one is above 0 names its first offender on a
#: fault line (:class:`Offender`). The SWA slot audit's three, the window check's premature
#: evictions, the read check's mismatches (sliding-window attention read other KV than the mapping
#: says), and the KV block audit of engines without a FULL-to-SWA mapping (vLLM): blocks in use that
#: no request and no prefix-cache entry holds, blocks a running request's table references that
#: are on the free queue, blocks not in the prefix cache that two requests' tables reference.
FAULT_FIELDS = (
    "swa_leaked_slots",
    "swa_stale_tokens",
    "swa_shared_slots",
    "swa_premature_evictions",
    "swa_read_mismatches",
    "kv_leaked_blocks",
    "kv_freed_blocks_in_use",
    "kv_shared_blocks",
)

#: Where a fault's first offender is, in the order the fault line writes them (each only when known):
#: ``request`` (the engine's request id, a string), ``row`` (its ``req_to_token`` row, or its batch
#: entry where the engine has no rows), ``position`` (token position in the request), ``full_slot``,
#: ``swa_slot``, ``swa_page``, ``other_full_slot`` (a shared SWA slot's second FULL slot),
#: ``layer`` (the attention layer, read mismatches), ``block`` (a KV block id, vLLM) and
#: ``kv_cache_group`` (vLLM's KV cache group of that block).
OFFENDER_KEYS = (
    "request",
    "row",
    "position",
    "full_slot",
    "swa_slot",
    "swa_page",
    "other_full_slot",
    "layer",
    "block",
    "kv_cache_group",
)
#: The offender keys whose values are strings (the others are ints).
_STRING_KEYS = ("request",)
_INT_KEYS = tuple(name for name in OFFENDER_KEYS if name not in _STRING_KEYS)


@dataclass(frozen=True, slots=True)
class Offender:
    """Where a fault of a sample was first seen: its first offender.

    Computed on the device with the sample (the first index of the fault's mask, in the order the
    engine's batch, the holders or the checked queries are given) and copied with it, so it names
    the state at the sampled forward step. Written on the fault line
    (:meth:`~otel_swa.record.SwaDivergenceRecord.fault_lines`), read back by
    :func:`~otel_swa.record.find_all`.

    Attributes:
        fault: the fault, one of :data:`FAULT_FIELDS` (the record field whose count it locates).
        request: the engine's request id (SGLang's ``rid``, the reference engine's request number),
            when the view gave the batch's ids and the offender is a token of the batch.
        row: the request's ``req_to_token`` row (vLLM: its batch entry), when known.
        position: the token position in the request (a read mismatch: the query's position).
        full_slot, swa_slot, swa_page: the token's FULL slot, its SWA slot and that slot's page (a
            leaked page: ``swa_page`` only).
        other_full_slot: a shared SWA slot's other FULL slot.
        layer: the attention layer (``layer_id``) of a read mismatch.
        block, kv_cache_group: a KV block id and its KV cache group (vLLM's block audit).

    Every location is an int from 0 to :data:`INT64_MAX` (``request``: a string) or ``None``.

    Raises:
        ValueError: ``fault`` is not one of :data:`FAULT_FIELDS`; a location is negative or above
            int64.
        TypeError: a location is not an int (``request``: not a string).
    """

    fault: str
    request: "str | None" = None
    row: "int | None" = None
    position: "int | None" = None
    full_slot: "int | None" = None
    swa_slot: "int | None" = None
    swa_page: "int | None" = None
    other_full_slot: "int | None" = None
    layer: "int | None" = None
    block: "int | None" = None
    kv_cache_group: "int | None" = None

    def __post_init__(self) -> None:
        if self.fault not in FAULT_FIELDS:
            raise ValueError(f"Offender.fault must be one of {', '.join(FAULT_FIELDS)}, got {self.fault!r}")
        for name in _STRING_KEYS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"Offender.{name} must be a str or None, got {value!r}")
        check_optional_ints("Offender", self, _INT_KEYS)

    def location(self) -> dict[str, "int | str"]:
        """The locations known, in :data:`OFFENDER_KEYS` order."""
        return {name: getattr(self, name) for name in OFFENDER_KEYS if getattr(self, name) is not None}

    def describe(self) -> str:
        """The locations in words: ``request 7 (row 3), position 17, FULL slot 130, SWA slot 12
        (page 12), layer 1``; ``no location`` when none is known."""
        parts = []
        if self.request is not None:
            parts.append(f"request {self.request}" + (f" (row {self.row})" if self.row is not None else ""))
        elif self.row is not None:
            parts.append(f"row {self.row}")
        if self.position is not None:
            parts.append(f"position {self.position}")
        if self.full_slot is not None:
            parts.append(f"FULL slot {self.full_slot}")
        if self.swa_slot is not None:
            parts.append(f"SWA slot {self.swa_slot}" + (f" (page {self.swa_page})" if self.swa_page is not None else ""))
        elif self.swa_page is not None:
            parts.append(f"SWA page {self.swa_page}")
        if self.other_full_slot is not None:
            parts.append(f"also mapped from FULL slot {self.other_full_slot}")
        if self.layer is not None:
            parts.append(f"layer {self.layer}")
        if self.block is not None:
            parts.append(f"block {self.block}" + (f" (KV cache group {self.kv_cache_group})"
                                                  if self.kv_cache_group is not None else ""))
        return ", ".join(parts) if parts else "no location"


class FaultMatch(LineMatch):
    """One fault line found in a text (:class:`~otel_swa.record.LineMatch`); ``offender`` (its
    ``value``): the first offender it names."""

    __slots__ = ()
    per_record = True
    offender = LineMatch.value


def fault_line_fields(offender: Offender) -> dict[str, "int | str"]:
    """What the fault line of ``offender`` carries besides ``forward_ct``: ``fault``, then the
    locations known (:data:`OFFENDER_KEYS` order)."""
    return {"fault": offender.fault, **offender.location()}


def decode_fault(data: dict, fail: Callable[[str], Exception], source: str | None) -> "tuple[Offender, int]":
    """``(offender, forward_ct)`` of a fault line's JSON object; unknown keys are ignored.

    Raises:
        MalformedRecordError (through ``fail``): ``forward_ct`` or ``fault`` missing or invalid, a
            location that is not a non-negative int64 (``request``: not a string).
    """
    if "forward_ct" not in data:
        raise fail("missing field forward_ct")
    reason = logged_int("forward_ct", data["forward_ct"], 0)
    if reason is not None:
        raise fail(reason)
    fault = data.get("fault")
    if fault not in FAULT_FIELDS:
        raise fail(f"fault={json.dumps(fault)} is not one of {', '.join(FAULT_FIELDS)}")
    where: dict[str, Any] = {}
    for name in OFFENDER_KEYS:
        if name not in data:
            continue
        value = data[name]
        if name in _STRING_KEYS:
            if not isinstance(value, str):
                raise fail(f"{name}={json.dumps(value)} is not a string")
        else:
            reason = logged_int(name, value, 0)
            if reason is not None:
                raise fail(reason)
        where[name] = value
    return Offender(fault, **where), data["forward_ct"]


def fault_refusal(record: Any, offender: Offender) -> str | None:
    """Why ``offender`` cannot belong to ``record``: a place for a fault its record counts 0 is not
    otel-swa's line (``None`` when it can: a count above 0, or unknown)."""
    if getattr(record, offender.fault, None) == 0:
        return (f"a {offender.fault} offender for the record with forward_ct={record.forward_ct}, "
                f"which counts {offender.fault}=0")
    return None


def fault_changes(record: Any, offender: Offender) -> dict:
    """The record field a fault line sets on its record: its offenders, this one appended."""
    return {"offenders": record.offenders + (offender,)}
