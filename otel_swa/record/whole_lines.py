"""Whole lines read in one step: what otel-swa's line sinks write, one writer's line at a time
(``[time ranks] otel_swa[verify=...] <prefix>{...}`` and the line end, nothing else), read
without the general rules' work for text that writers interleave (:mod:`otel_swa.record.parser`
uses both; on such lines both give the same entries, which the tests hold equal).

* :func:`whole_line`: one such line, of any kind;
* :func:`record_groups`: a run of records, each with the audit and provenance lines the sinks
  write right after it (the same log prefix and tag, its ``forward_ct``), their JSON objects
  decoded in one call: what :class:`~otel_swa.record.AuditPairing` would attach to each record
  when its lines were read one by one.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from otel_swa.record.audit_line import AUDIT_FIELDS
from otel_swa.record.decoding import _DECODER
from otel_swa.record.kinds import KIND_OF_PREFIX
from otel_swa.record.logtext import SGLANG_PREFIX_RE
from otel_swa.record.prefixes import AUDIT_PREFIX, LINE_PREFIX, PREFIX_RE, PROVENANCE_PREFIX, VERIFY_SOURCES
from otel_swa.record.provenance_line import PROVENANCE_FIELDS
from otel_swa.record.sglang_line import _DEFAULTS, _INDEX, FIELDS, RecordMatch, SwaDivergenceRecord, _unchecked
from otel_swa.record.values import MICRO_BATCH_MAX

__all__ = ["RecordGroup", "WHOLE_LINE_RE", "whole_line", "record_groups"]

# SGLang's log prefix (time, rank tokens) and otel-swa's tag of a known verify source: groups 1
# (the time), 2 (the rank tokens), 3 (the verify source).
_HEAD = (SGLANG_PREFIX_RE.pattern.replace("(?P<ts>", "(").replace("(?P<rank>", "(")
         + r" otel_swa\[verify=(" + "|".join(map(re.escape, VERIFY_SOURCES)) + r")\] ")

#: One writer's whole line: the head (groups 1 - 3), group 4 the prefix, group 5 the run of
#: non-space characters after it (SGLang's rule for the object), then the line end.
WHOLE_LINE_RE = re.compile(_HEAD + "(" + "|".join(map(re.escape, KIND_OF_PREFIX)) + r")(\{\S*)\n")

# The objects of a group's lines as otel-swa writes them: flat, plain keys, integers of at most 18
# digits without leading zeros (inside int64: no bound left to check), negative ones on the record's
# line only (SGLang's parser takes them there). Text of this form is exactly one JSON object, so
# the objects of many lines joined by commas decode in one call, one array element each.
_COUNT = r"(?:0|[1-9]\d{0,17})"
_COUNTS = r'\{"[a-z_]+":' + _COUNT + r'(?:,"[a-z_]+":' + _COUNT + r")*\}"
_TOTALS = _COUNTS.replace(_COUNT, "-?" + _COUNT)
_SAME_HEAD = r"\[\1\2\] otel_swa\[verify=\3\] "

#: A record on a whole line, then, on whole lines of the same head, its audit line and its
#: provenance line (each optional, in the order the sinks write them): groups 1 - 3 the head, 4
#: the record's object, 5 the audit line's, 6 the provenance line's (``None`` when absent).
_GROUP_RE = re.compile(
    _HEAD + re.escape(LINE_PREFIX) + "(" + _TOTALS + r")\n"
    + "(?:" + _SAME_HEAD + re.escape(AUDIT_PREFIX) + "(" + _COUNTS + r")\n)?"
    + "(?:" + _SAME_HEAD + re.escape(PROVENANCE_PREFIX) + "(" + _COUNTS + r")\n)?"
)
_RECORD_KEYS = tuple(FIELDS)
_BASE = list(_DEFAULTS)  # a record's values before its lines' (divergence_applicable true)
_SOURCE, _MICRO_BATCH = _INDEX["verify_source"], _INDEX["micro_batch"]
_LINE_PREFIX_SIZE = len(LINE_PREFIX)
_AUDIT = KIND_OF_PREFIX[AUDIT_PREFIX]
_PROVENANCE = KIND_OF_PREFIX[PROVENANCE_PREFIX]
_PLANS: dict = {}  # (names, the object's keys) -> where each value goes, or None


def _plan(names: "tuple[str, ...]", keys: tuple) -> "tuple[int, ...] | None":
    """Where each value of a line's object with ``keys`` (in order) goes in a record's values,
    ``forward_ct`` first and left out; ``None`` unless the keys are ``forward_ct`` then some of
    ``micro_batch`` and ``names`` in that order (as the sinks write them), nothing else."""
    order = ("micro_batch",) + names
    if not keys or keys[0] != "forward_ct" or not set(keys[1:]) <= set(order):
        return None
    at = [order.index(key) for key in keys[1:]]
    return tuple(_INDEX[key] for key in keys[1:]) if at == sorted(at) else None


def _plan_of(names: "tuple[str, ...]", data: dict) -> "tuple[int, ...] | None":
    keys = tuple(data)
    try:
        return _PLANS[names, keys]
    except KeyError:
        if len(_PLANS) >= 4096:  # bounded: a log of ever new key orders is read, more slowly
            _PLANS.clear()
        plan = _PLANS[names, keys] = _plan(names, keys)
        return plan


#: A line of the engine's own (``[time ranks] Decode batch. ...``): its log prefix, then text
#: without another ``[`` that is no otel-swa tag, so the prefix is that line's and waits for no
#: message (:class:`~otel_swa.record.PrefixClaims`); a line holding a prefix of
#: :data:`~otel_swa.record.prefixes.PREFIX_RE` is never one (looked at apart).
_ENGINE_LINE_RE = re.compile(_HEAD.split(r" otel_swa\[")[0] + r" (?!otel_swa\[)[^\n\[]*[^\s\[][^\n\[]*\n")

#: At most this many groups are decoded in one call.
GROUPS_AT_ONCE = 1024


class RecordGroup(NamedTuple):
    """A record read together with the lines right after it that belong to it.

    Attributes:
        entry: the record's :class:`~otel_swa.record.RecordMatch`; its record already carries what
            each of ``lines`` sets on it (as :meth:`~otel_swa.record.AuditPairing.with_lines`
            leaves it).
        lines: the lines' entries, in order (at most one per kind, each of a ``once`` kind).
    """

    entry: RecordMatch
    lines: tuple


class _NotWhole(Exception):
    """A whole line that the general rules must read (its object is not a valid line of its kind)."""


def _not_whole(reason: str) -> _NotWhole:
    return _NotWhole(reason)


def whole_line(text: str, line: re.Match, line_no: int) -> Any:
    """The entry (:class:`~otel_swa.record.LineMatch` of its kind) of the whole line ``line``
    (:data:`WHOLE_LINE_RE`), numbered ``line_no``; ``None`` when its object is not exactly one
    valid line of its kind (the general rules then read it, and say why)."""
    payload = line.group(5)
    try:
        data, end = _DECODER.raw_decode(payload)
    except ValueError:
        return None
    if end != len(payload) or type(data) is not dict:  # noqa: E721
        return None
    kind = KIND_OF_PREFIX[line.group(4)]
    source = line.group(3)
    try:
        value, forward_ct = kind.decode(data, _not_whole, source)
    except _NotWhole:
        return None
    return kind.match_type(value, text[line.start(4):line.end() - 1], line_no, line.group(2).strip() or None,
                           line.group(1), source, (), forward_ct)


def record_groups(text: str, pos: int, line_no: int) -> "tuple[list[Any], int]":
    """The record groups (:class:`RecordGroup`, or a :class:`~otel_swa.record.RecordMatch` for a
    record without lines) on the whole lines from ``pos`` (a line start) on, the first numbered
    ``line_no``; at most :data:`GROUPS_AT_ONCE`; and where they end (``pos`` when none is read).

    The run stops before the first group that is not exactly a record with its own lines as the
    sinks write them (other keys or key order, a micro-batch above its bound, another
    ``forward_ct``): the general rules read that one. What is read is what decoding each line by
    its kind and pairing them gives (:mod:`otel_swa.record.sglang_line`, ``audit_line``,
    ``provenance_line``, :class:`~otel_swa.record.AuditPairing`).
    """
    matches = []
    skipped = []  # per group: the engine's own lines passed over right before it
    match, engine_line = _GROUP_RE.match, _ENGINE_LINE_RE.match
    end = pos
    while len(matches) < GROUPS_AT_ONCE:
        group = match(text, end)
        passed = 0
        if group is None and matches:  # the engine's own lines between two groups are passed over
            probe = end
            while (line := engine_line(text, probe)) is not None and not PREFIX_RE.search(text, probe, line.end()):
                probe, passed = line.end(), passed + 1
            group = match(text, probe) if passed else None
        if group is None:
            break
        matches.append(group)
        skipped.append(passed)
        end = group.end()
    if not matches:
        return [], pos
    payloads: list = []
    for group in matches:
        payloads.extend(filter(None, group.group(4, 5, 6)))
    try:
        objects = iter(json.loads("[" + ",".join(payloads) + "]"))
    except ValueError:  # not expected of text the pattern took: the general rules read it
        return [], pos
    out: list = []
    end = pos
    new, build, plan_of, make = SwaDivergenceRecord, _unchecked, _plan_of, tuple.__new__
    for group, passed in zip(matches, skipped):
        line_no += passed
        data = next(objects)
        if tuple(data) != _RECORD_KEYS:
            break
        values = _BASE.copy()
        values[0:5] = data.values()
        forward_ct = values[0]
        timestamp, rank, source = group.group(1, 2, 3)
        rank = rank.strip() or None
        values[_SOURCE] = source
        lines = []
        for index, kind, names in ((5, _AUDIT, AUDIT_FIELDS), (6, _PROVENANCE, PROVENANCE_FIELDS)):
            start = group.start(index)
            if start < 0:
                continue
            data = next(objects)
            plan = plan_of(names, data)
            counts = dict(data)
            line_ct = counts.pop("forward_ct", None)
            if plan is None or line_ct != forward_ct or counts.get("micro_batch", 0) > MICRO_BATCH_MAX:
                break
            micro_batch = values[_MICRO_BATCH]
            for at, value in zip(plan, counts.values()):
                values[at] = value
            if micro_batch is not None:  # a provenance line's micro-batch is the record's only when it has none
                values[_MICRO_BATCH] = micro_batch
            lines.append(make(kind.match_type, (counts, text[start - len(kind.prefix):group.end(index)],
                                                line_no + len(lines) + 1, rank, timestamp, source, (), forward_ct)))
        else:
            entry = make(RecordMatch, (build(new, values), text[group.start(4) - _LINE_PREFIX_SIZE:group.end(4)],
                                       line_no, rank, timestamp, source, (), forward_ct))
            out.append(make(RecordGroup, (entry, tuple(lines))) if lines else entry)
            line_no += 1 + len(lines)
            end = group.end()
            continue
        break
    return out, end
