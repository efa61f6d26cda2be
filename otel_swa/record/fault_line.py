"""The fault line (:data:`~otel_swa.record.FAULT_PREFIX`): one fault's first offender
(:class:`Offender`), written after the record's audit and provenance lines, same tag, same
``forward_ct``::

    otel_swa[verify=attention] otel_swa_fault={"forward_ct":40,"fault":...,"request":"7","row":3,...}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from otel_swa.checks import fault_fields, field_spec
from otel_swa.record.matches import LineMatch
from otel_swa.record.values import check_optional_ints, logged_int

__all__ = ["FAULT_FIELDS", "OFFENDER_KEYS", "OFFENDER_POOLS", "Offender", "FaultMatch", "fault_line_fields", "decode_fault", "fault_changes",
           "fault_refusal"]

#: The record fields that are faults: a sample where one is above 0 names its first offender on a
#: fault line (:class:`Offender`): the fault fields of every check (:data:`otel_swa.checks.CHECKS`),
#: those of the audit line first, then the provenance line's (:data:`~otel_swa.record.PROVENANCE_FAULTS`).
FAULT_FIELDS = fault_fields()

#: Where a fault's first offender is, in the order the fault line writes them (each only when known):
#: ``request`` (the engine's request id, a string), ``row`` (its ``req_to_token`` row, or its batch
#: entry where the engine has no rows), ``position`` (token position in the request), ``full_slot``,
#: ``swa_slot``, ``swa_page``, ``other_full_slot`` (a shared SWA slot's second FULL slot),
#: ``layer`` (the attention layer: read and write mismatches), ``layer_name`` (its name in the
#: engine, a string: vLLM's ``model.layers.3.self_attn.attn``), ``block`` (a KV block id, vLLM),
#: ``kv_cache_group`` (vLLM's KV cache group of that block), ``host_slot`` (the host-tier slot a
#: loaded device slot came from: SGLang's HiCache), then the provenance checks' keys:
#: ``pool`` (the KV pool of the slot, :data:`OFFENDER_POOLS`), ``expected_token`` and
#: ``expected_position`` (what the stamp expected from the request's own tokens says),
#: ``found_token`` and ``found_position`` (what the slot's stamp says; absent when it was never
#: stamped), ``other_request`` (the request whose KV or block it really is, a string).
OFFENDER_KEYS = (
    "request",
    "row",
    "position",
    "full_slot",
    "swa_slot",
    "swa_page",
    "other_full_slot",
    "layer",
    "layer_name",
    "block",
    "kv_cache_group",
    "host_slot",
    "pool",
    "expected_token",
    "expected_position",
    "found_token",
    "found_position",
    "other_request",
)
#: The values of :attr:`Offender.pool`: the FULL or the SWA pool (engines with one pool: ``full``).
OFFENDER_POOLS = ("full", "swa")
#: The offender keys whose values are strings (the others are ints).
_STRING_KEYS = ("request", "layer_name", "pool", "other_request")
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
        layer: the attention layer (``layer_id``) of a read or write mismatch.
        layer_name: that layer's name in the engine (vLLM's layer name), when known.
        block, kv_cache_group: a KV block id and its KV cache group (vLLM's block audit, its block
            hashes).
        host_slot: the host-tier slot the device slot was last loaded from (SGLang's HiCache host
            pool), while it holds what that load brought; a foreign or corrupt token.
        pool: the KV pool of the slot (one of :data:`OFFENDER_POOLS`): a write mismatch, a foreign
            or corrupt token.
        expected_token, expected_position: the token id and position the slot's stamp should
            carry (from the request's own tokens); a foreign token.
        found_token, found_position: those the slot's stamp carries; ``None`` when the slot was
            never stamped.
        other_request: the request whose KV (or block) the slot really holds, when known.

    Every location is an int from 0 to :data:`~otel_swa.record.INT64_MAX` (``request``,
    ``layer_name``, ``pool``, ``other_request``: a string) or ``None``.

    Raises:
        ValueError: ``fault`` is not one of :data:`FAULT_FIELDS`; a location is negative or above
            int64; ``pool`` is not one of :data:`OFFENDER_POOLS`.
        TypeError: a location is not an int (``request``, ``layer_name``, ``pool``, ``other_request``:
            not a string).
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
    layer_name: "str | None" = None
    block: "int | None" = None
    kv_cache_group: "int | None" = None
    host_slot: "int | None" = None
    pool: "str | None" = None
    expected_token: "int | None" = None
    expected_position: "int | None" = None
    found_token: "int | None" = None
    found_position: "int | None" = None
    other_request: "str | None" = None

    def __post_init__(self) -> None:
        if self.fault not in FAULT_FIELDS:
            raise ValueError(f"Offender.fault must be one of {', '.join(FAULT_FIELDS)}, got {self.fault!r}")
        for name in _STRING_KEYS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"Offender.{name} must be a str or None, got {value!r}")
        check_optional_ints("Offender", self, _INT_KEYS)
        if self.pool is not None and self.pool not in OFFENDER_POOLS:
            raise ValueError(f"Offender.pool must be None or one of {', '.join(OFFENDER_POOLS)}, got {self.pool!r}")

    def location(self) -> dict[str, "int | str"]:
        """The locations known, in :data:`OFFENDER_KEYS` order."""
        return {name: getattr(self, name) for name in OFFENDER_KEYS if getattr(self, name) is not None}

    def describe(self) -> str:
        """The locations in words: ``request 7 (row 3), position 17, FULL slot 130, SWA slot 12
        (page 12), layer 1``, then the provenance checks' (``SWA pool, expected token 42 at
        position 17, found token 99 at position 3, KV of request 8``); ``no location`` when none is
        known."""
        parts = [
            _words("request", self.request, _words("row", self.row)) or _words("row", self.row),
            _words("position", self.position),
            _words("FULL slot", self.full_slot),
            _words("SWA slot", self.swa_slot, _words("page", self.swa_page)) or _words("SWA page", self.swa_page),
            _words("also mapped from FULL slot", self.other_full_slot),
            _words("layer", self.layer, self.layer_name) or _words("layer", self.layer_name),
            _words("block", self.block, _words("KV cache group", self.kv_cache_group)),
            _words("loaded from host slot", self.host_slot),
            None if self.pool is None else f"{self.pool.upper()} pool",
            _stamp_words("expected", self.expected_token, self.expected_position),
            _stamp_words("found", self.found_token, self.found_position),
            None if self.other_request is None else f"KV of request {self.other_request}",
        ]
        if parts[-3] is not None and parts[-2] is None:  # expected, and nothing found (never written)
            parts[-2] = field_spec(self.fault).nothing_found
        return ", ".join(part for part in parts if part is not None) or "no location"


def _words(label: str, value: "int | str | None", note: "str | None" = None) -> "str | None":
    """``label value`` (``label value (note)``), or ``None`` when ``value`` is."""
    if value is None:
        return None
    return f"{label} {value}" + (f" ({note})" if note is not None else "")


def _stamp_words(what: str, token: "int | None", position: "int | None") -> "str | None":
    """``expected token 42 at position 17`` (either part alone when the other is unknown), or
    ``None`` when neither is known."""
    if token is None and position is None:
        return None
    if token is None:
        return f"{what} position {position}"
    return f"{what} token {token}" + (f" at position {position}" if position is not None else "")

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
            if name == "pool" and value not in OFFENDER_POOLS:
                raise fail(f"pool={json.dumps(value)} is not one of {', '.join(OFFENDER_POOLS)}")
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
