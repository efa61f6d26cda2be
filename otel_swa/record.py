"""One SWA divergence sample and every line otel-swa writes or reads for it.

This module knows neither torch nor OpenTelemetry: the record is the only object that crosses from
the device side of the package to its telemetry side. Every line prefix otel-swa writes or reads is
spelled here, and nowhere else.

**SGLang's line.** The format is the one SGLang's KV canary prints (sgl-project/sglang PR #26820,
``python/sglang/srt/kv_canary/runner/swa_divergence.py``)::

    kv_canary_swa_divergence={"forward_ct":40,"verify_full":5120,"verify_swa":2048,"swa_full_idx_divergence":17,"swa_out_of_window_tokens":311}

i.e. the prefix followed directly by compact JSON (separators ``","`` and ``":"``) of five integer
fields in this order. SGLang 0.5.23's parser (``SwaDivergenceLog.parse`` / ``find_all``) matches
``kv_canary_swa_divergence=(\\S+)`` and builds its record with ``cls(**json.loads(...))``. The
readers here (:meth:`SwaDivergenceRecord.parse`, :func:`iter_entries`, the ``find_*`` functions)
accept what that parser accepts and reject what it rejects, each rejection with its line number
and reason (:class:`MalformedRecordError`):

* rejected like SGLang: JSON with spaces (``json.dumps`` without ``separators``: SGLang reads only
  up to the first space), text that is not a JSON object, a missing field (except
  ``swa_out_of_window_tokens``, which SGLang defaults to 0), a key SGLang's record does not have
  (a ``TypeError`` there), a prefix with nothing after it (SGLang's regex skips it);
* accepted like SGLang: negative integers (SGLang's int32 verify counters wrap past 2**31 - 1;
  the CI judge then says why such a record fails) and keys in any order;
* accepted beyond SGLang: ANSI colour codes (removed), CRLF and bare CR line ends, and several
  records glued on one line (``...}kv_canary_swa_divergence={...``, two writers without a line
  end between them): every whole record is recovered, each with the rank of the nearest log
  prefix before it;
* refused though SGLang would take it: a value that is not a JSON integer (``1.5``, ``"3"``,
  ``true``), or an integer outside int64 (what OTLP carries; see :data:`INT64_MAX`).

**otel-swa's lines.** otel-swa logs the record after a tag, ``otel_swa[verify=attention]
kv_canary_swa_divergence={...}`` (:meth:`SwaDivergenceRecord.line`), and writes two more lines of
its own prefixes, which SGLang's parser never matches (neither prefix contains SGLang's):

* the **SWA slot audit** of an audited record, right after its line, same tag, same
  ``forward_ct`` (:meth:`SwaDivergenceRecord.audit_line`)::

      otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,"swa_leaked_slots":0,"swa_stale_tokens":0,"swa_shared_slots":0,"swa_pages_in_use":12,"swa_pages_referenced":12}

  compact JSON of ``forward_ct``, the record's micro-batch when known (``"micro_batch":1``, under
  pipeline parallelism), ``"divergence_applicable":false`` for an engine without a FULL-to-SWA
  mapping (vLLM: the line's divergence is a placeholder 0, which the CI judge then does not judge)
  and the audit fields (:data:`AUDIT_FIELDS`) present: the SWA slot audit's
  and the sliding-window check's (``swa_premature_evictions``, ``swa_late_held_slots``), each only
  when measured; a record with any of them (or with a micro-batch) writes the line. Keys this
  version does not know are ignored, so fields can be added later, and lines without the window
  fields read as before. It is attached back to the
  latest record of the same tag and log rank when that record has the same ``forward_ct``;
* a **fault** line per fault the sample shows, right after the audit line, same tag, same
  ``forward_ct`` (:meth:`SwaDivergenceRecord.fault_lines`): the fault's first offender
  (:class:`Offender`: where in the batch, the pools or the layers the fault's mask was first
  true), attached back to its record as the audit line is::

      otel_swa[verify=attention] otel_swa_fault={"forward_ct":40,"fault":"swa_read_mismatches","request":"7","row":3,"position":17,"full_slot":130,"swa_slot":12,"swa_page":12,"layer":1}

  compact JSON of ``forward_ct``, ``fault`` (one of :data:`FAULT_FIELDS`) and the location keys
  known (:data:`OFFENDER_KEYS`); keys this version does not know are ignored;
* a **run start** marker, before the first record a line sink writes (:func:`run_start_line`)::

      otel_swa[verify=attention] otel_swa_run_start={"pid":4242}

  so that a log appended to by several runs shows where each began (unknown keys ignored);
* a **liveness warning**, when a reporter is on and delivers no sample (:class:`LivenessWarning`,
  :meth:`LivenessWarning.line`)::

      otel_swa[verify=attention] otel_swa_liveness={"pid":4242,"forward_ct":0,"steps":0,"samples_delivered":0,...,"cause":"no_forward_step"}

  (unknown keys ignored).

Text is read after removing ANSI colour codes and reading CRLF or bare CR as line ends, so that
coloured, CRLF and progress-bar-interleaved logs parse too. Line numbers count LF line ends only,
as ``grep -n`` and editors do: a record after a bare CR (a progress bar's redraw) has the number of
the line the CR stands on. The log prefix before a line (time,
SGLang's rank tokens) is read by :func:`parse_log_prefix`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Union

__all__ = [
    "LINE_PREFIX",
    "AUDIT_PREFIX",
    "RUN_START_PREFIX",
    "FAULT_PREFIX",
    "LINE_TAG",
    "FIELDS",
    "AUDIT_FIELDS",
    "FAULT_FIELDS",
    "OFFENDER_KEYS",
    "Offender",
    "MICRO_BATCH_MAX",
    "VERIFY_SOURCES",
    "INT64_MAX",
    "INT64_MIN",
    "MalformedRecordError",
    "SwaDivergenceRecord",
    "LogPrefix",
    "parse_log_prefix",
    "RecordMatch",
    "AuditMatch",
    "FaultMatch",
    "RunStartMatch",
    "AuditPairing",
    "FoundRecords",
    "run_start_line",
    "iter_entries",
    "iter_matches",
    "find_all",
    "find_last",
]

#: The prefix SGLang prints before the JSON object. Existing CI greps search for it.
LINE_PREFIX = "kv_canary_swa_divergence="
#: The prefix of otel-swa's audit line (written after the record's line; never SGLang's).
AUDIT_PREFIX = "otel_swa_audit="
#: The prefix of otel-swa's run start marker (written before a line sink's first record).
RUN_START_PREFIX = "otel_swa_run_start="
#: The prefix of otel-swa's fault line: one fault's first offender (written after the audit line).
FAULT_PREFIX = "otel_swa_fault="
#: The prefix of otel-swa's liveness warning: a reporter that is on and delivers no sample
#: (:class:`LivenessWarning`; never SGLang's).
LIVENESS_PREFIX = "otel_swa_liveness="
_PREFIXES = (LINE_PREFIX, AUDIT_PREFIX, RUN_START_PREFIX, FAULT_PREFIX, LIVENESS_PREFIX)

#: The record's fields, in SGLang's order (the order of the JSON keys in the line).
FIELDS = (
    "forward_ct",
    "verify_full",
    "verify_swa",
    "swa_full_idx_divergence",
    "swa_out_of_window_tokens",
)

#: Fields beyond SGLang's (never in SGLang's line; on the audit line): the SWA slot audit, then
#: the sliding-window check; each ``None`` when not measured.
AUDIT_FIELDS = (
    "swa_leaked_slots",
    "swa_stale_tokens",
    "swa_shared_slots",
    "swa_pages_in_use",
    "swa_pages_referenced",
    "swa_premature_evictions",
    "swa_late_held_slots",
    "swa_read_checks",
    "swa_read_mismatches",
    "swa_read_unchecked",
    "kv_leaked_blocks",
    "kv_freed_blocks_in_use",
    "kv_shared_blocks",
)

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

#: The largest micro-batch index a record takes (micro-batches are a pipeline's few in-flight batches,
#: SGLang's ``mb_id`` in ``range(pp_loop_size)``; the bound keeps the metric attribute bounded).
MICRO_BATCH_MAX = 1023

#: What ``verify_full`` / ``verify_swa`` count, as carried by :attr:`SwaDivergenceRecord.verify_source`:
#: ``kv_canary``: the KV entries SGLang's KV canary verified (its verify plans, SGLang's meaning of the
#: fields); ``attention``: the KV entries attention read at each forward step (``seq_len`` per request
#: in the FULL pool, the tokens still held in the window in the SWA pool), where no canary runs.
VERIFY_SOURCES = ("attention", "kv_canary")

#: Bounds of every field: int64, what OTLP carries (an OTLP integer data point is an ``sfixed64``;
#: a larger Python int makes the whole metrics export fail with ``ValueError: Value out of range``).
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

#: Written before the record on otel-swa's own lines (``otel_swa[verify=kv_canary] kv_canary_swa_...``):
#: it tells otel-swa's line from SGLang's in one log and what the verify counts are, without touching
#: the JSON (SGLang's parser searches for the record prefix and ignores what stands before it).
LINE_TAG = "otel_swa[verify={}]"
_TAG_BEFORE_RE = re.compile(r"otel_swa\[verify=([a-z_]+)\] ?$")

# CSI sequences such as "\x1b[32m" (colour) and "\x1b[0m" (reset), as written by coloured log handlers.
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# Any of the prefixes above, wherever it stands.
_PREFIX_RE = re.compile("|".join(re.escape(p) for p in _PREFIXES))
# SGLang's rule: the run of non-whitespace characters after the prefix.
_RUN_RE = re.compile(r"\S*")
_DECODER = json.JSONDecoder()

_TIME = r"\d{2}:\d{2}:\d{2}(?:[.,]\d+)?"
# SGLang: "[" asctime (with or without year, or time only) rank tokens "]".
_SGLANG_PREFIX_RE = re.compile(
    r"\[(?P<ts>(?:(?:\d{4}-)?\d{2}-\d{2} )?" + _TIME + r")(?P<rank>(?: [A-Z][A-Z_]*\d+)*)\]"
)
# Python logging: an ISO-like date and time at the start of the line (after optional blanks).
_PLAIN_PREFIX_RE = re.compile(r"^\s*(?P<ts>\d{4}-\d{2}-\d{2}[ T]" + _TIME + r")(?![\d:])")

_KIND_WORDS = {LINE_PREFIX: "record", AUDIT_PREFIX: "audit line", RUN_START_PREFIX: "run start line",
               FAULT_PREFIX: "fault line", LIVENESS_PREFIX: "liveness warning"}


class MalformedRecordError(ValueError):
    """A prefix is present but what follows it is not a valid record (or audit line, run start).

    Attributes:
        text: the text that was being parsed (after colour codes were removed).
        reason: what was wrong, in words.
        line_no: 1-based line number where it was found, ``None`` when not known.
        prefix: which prefix: :data:`LINE_PREFIX`, :data:`AUDIT_PREFIX` or :data:`RUN_START_PREFIX`.
    """

    def __init__(self, text: str, reason: str, line_no: int | None = None, prefix: str = LINE_PREFIX) -> None:
        self.text = text
        self.reason = reason
        self.line_no = line_no
        self.prefix = prefix
        shown = text if len(text) <= 300 else text[:297] + "..."
        where = f"line {line_no}: " if line_no is not None else ""
        super().__init__(f"{where}malformed {prefix!r} {_KIND_WORDS.get(prefix, 'record')}: {reason}; in {shown!r}")


def _clean_marked(text: str) -> tuple[str, list[int]]:
    """:func:`_clean`, and where its bare CRs were (sorted indices into the cleaned text, each now
    a LF): they end a line for the parser but not for line numbers, which count LF line ends as
    ``grep -n`` and editors do."""
    if "\x1b" in text:
        text = _ANSI_RE.sub("", text)
    marks: list[int] = []
    if "\r" in text:
        text = text.replace("\r\n", "\n")
        if "\r" in text:
            marks = [m.start() for m in re.finditer("\r", text)]
            text = text.replace("\r", "\n")
    return text, marks


def _clean(text: str) -> str:
    """Remove ANSI escape sequences; CRLF and bare CR (progress-bar redraws, old Mac files) end
    lines like LF."""
    return _clean_marked(text)[0]


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    if type(value) is not int:  # noqa: E721 - bool and int subclasses are refused on purpose
        raise TypeError(f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")
    if value > INT64_MAX:
        raise ValueError(
            f"{owner}.{name}={value} is above the int64 maximum 2**63 - 1 = {INT64_MAX} (OTLP carries int64)"
        )


@dataclass(frozen=True, slots=True)
class Offender:
    """Where a fault of a sample was first seen: its first offender.

    Computed on the device with the sample (the first index of the fault's mask, in the order the
    engine's batch, the holders or the checked queries are given) and copied with it, so it names
    the state at the sampled forward step. Written on the fault line
    (:meth:`SwaDivergenceRecord.fault_lines`), read back by :func:`find_all`.

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
        if self.request is not None and not isinstance(self.request, str):
            raise TypeError(f"Offender.request must be a str or None, got {self.request!r}")
        for name in OFFENDER_KEYS[1:]:
            value = getattr(self, name)
            if value is not None:
                _check_int("Offender", name, value, 0)

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


@dataclass(frozen=True, slots=True)
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

    Beyond SGLang's five fields, keyword-only and never written into SGLang's line (the audit
    fields go on the audit line, :meth:`audit_line`):

    Attributes:
        divergence_applicable: ``False`` for engines without a FULL-to-SWA mapping (vLLM): the
            line still carries ``swa_full_idx_divergence`` (0) for compatibility, but telemetry
            does not report it as a measurement.
        swa_leaked_slots: SWA slots of pages in use that no live token maps into (leaked), or
            ``None`` when the engine gave no audit inputs.
        swa_stale_tokens: live tokens whose SWA page is on the free list (stale), or ``None``.
        swa_shared_slots: SWA slots that two distinct live FULL slots map to, or ``None``.
        swa_pages_in_use: SWA pages allocated (not on the free list), unit ``{page}``, or ``None``.
        swa_pages_referenced: SWA pages in use that at least one live token maps into, unit
            ``{page}``, or ``None`` (``swa_pages_in_use - swa_pages_referenced`` pages are leaked).
        swa_premature_evictions: live tokens of the sampled batch inside the sliding window
            (the positions the step's queries read: the last ``window + extend_len - 1``) whose
            SWA mapping is 0: attention reads KV that was freed (sgl-project/sglang#29860), unit
            ``{token}``, or ``None`` when the engine gave no window (:mod:`otel_swa.device.window`).
        swa_late_held_slots: live tokens of the sampled batch older than the oldest position the
            step reads plus the engine's eviction allowance that still hold an SWA slot (late
            eviction, runaway SWA usage), unit ``{slot}``, or ``None`` when the engine gave no
            window.
        swa_read_checks: queries of the sampled step whose sliding-window attention output was
            recomputed from the KV pool through the mapping and compared with the engine's (the
            read check, :mod:`otel_swa.device.read_check`), unit ``{query}``, or ``None`` when the
            engine has no read check.
        swa_read_mismatches: those whose output disagreed beyond the dtype's tolerance: attention
            read other KV than the mapping's inside the window, unit ``{query}``, or ``None``.
        swa_read_unchecked: queries that would have been checked but could not be (an attention
            variant the check does not cover, a step replayed from a CUDA graph), or ``None``.
        kv_leaked_blocks: KV blocks in use that no request and no prefix-cache entry holds (vLLM's
            block audit), unit ``{block}``, or ``None``.
        kv_freed_blocks_in_use: KV blocks a running request's block table references that are on the
            free queue (freed while in use; vLLM), unit ``{block}``, or ``None``.
        kv_shared_blocks: KV blocks not in the prefix cache that two requests' tables reference
            (handed out again while in use; vLLM), unit ``{block}``, or ``None``.
        offenders: the first offender of each fault the sample shows (:class:`Offender`, at most
            one per fault of :data:`FAULT_FIELDS`), on the fault lines; ``()`` when none is known.
        verify_source: what ``verify_full`` / ``verify_swa`` count, one of :data:`VERIFY_SOURCES`,
            or ``None`` when unknown (a line SGLang itself wrote, which counts what its canary
            verified). Written as the line's tag by :meth:`line`, never into the JSON.
        micro_batch: under pipeline parallelism, the index of the micro-batch the sampled forward
            step ran (``0 .. MICRO_BATCH_MAX``; SGLang's ``mb_id``), or ``None`` when the engine
            gave none. On the audit line, never in SGLang's line.

    Raises:
        TypeError: a field is not an ``int`` (or is a ``bool``); an audit field is neither
            ``None`` nor an ``int``; ``divergence_applicable`` is not a ``bool``.
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
    swa_leaked_slots: "int | None" = field(default=None, kw_only=True)
    swa_stale_tokens: "int | None" = field(default=None, kw_only=True)
    swa_shared_slots: "int | None" = field(default=None, kw_only=True)
    swa_pages_in_use: "int | None" = field(default=None, kw_only=True)
    swa_pages_referenced: "int | None" = field(default=None, kw_only=True)
    swa_premature_evictions: "int | None" = field(default=None, kw_only=True)
    swa_late_held_slots: "int | None" = field(default=None, kw_only=True)
    swa_read_checks: "int | None" = field(default=None, kw_only=True)
    swa_read_mismatches: "int | None" = field(default=None, kw_only=True)
    swa_read_unchecked: "int | None" = field(default=None, kw_only=True)
    kv_leaked_blocks: "int | None" = field(default=None, kw_only=True)
    kv_freed_blocks_in_use: "int | None" = field(default=None, kw_only=True)
    kv_shared_blocks: "int | None" = field(default=None, kw_only=True)
    verify_source: "str | None" = field(default=None, kw_only=True)
    micro_batch: "int | None" = field(default=None, kw_only=True)
    offenders: "tuple[Offender, ...]" = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        for name in FIELDS + AUDIT_FIELDS:
            value = getattr(self, name)
            if value is None and name in AUDIT_FIELDS:
                continue
            _check_int("SwaDivergenceRecord", name, value, 0)
        if type(self.divergence_applicable) is not bool:
            raise TypeError(f"SwaDivergenceRecord.divergence_applicable must be a bool, got {self.divergence_applicable!r}")
        if self.verify_source is not None and self.verify_source not in VERIFY_SOURCES:
            raise ValueError(
                f"SwaDivergenceRecord.verify_source must be None or one of {', '.join(VERIFY_SOURCES)}, "
                f"got {self.verify_source!r}"
            )
        if self.micro_batch is not None:
            _check_int("SwaDivergenceRecord", "micro_batch", self.micro_batch, 0)
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
        record = object.__new__(cls)
        for name in FIELDS:
            object.__setattr__(record, name, values[name])
        if audit is not None and audit.get("divergence_applicable") is False:
            divergence_applicable = False
        object.__setattr__(record, "divergence_applicable", divergence_applicable)
        for name in AUDIT_FIELDS:
            object.__setattr__(record, name, None if audit is None else audit.get(name))
        object.__setattr__(record, "verify_source", verify_source)
        object.__setattr__(record, "micro_batch", None if audit is None else audit.get("micro_batch"))
        object.__setattr__(record, "offenders", ())
        return record

    def offender(self, fault: str) -> "Offender | None":
        """The first offender of ``fault`` (one of :data:`FAULT_FIELDS`) in this sample, or ``None``."""
        return next((o for o in self.offenders if o.fault == fault), None)

    @property
    def read_checked(self) -> bool:
        """Whether the read check's fields are present (the engine checks what attention read)."""
        return self.swa_read_checks is not None

    @property
    def audited(self) -> bool:
        """Whether the SWA slot audit fields are present."""
        return self.swa_leaked_slots is not None

    @property
    def window_checked(self) -> bool:
        """Whether the sliding-window check fields are present (the engine gave its window)."""
        return self.swa_premature_evictions is not None

    def audit_dict(self) -> dict[str, int]:
        """The audit fields that are present (empty when not audited)."""
        return {name: getattr(self, name) for name in AUDIT_FIELDS if getattr(self, name) is not None}

    def _audit_line_fields(self) -> dict[str, "int | bool"]:
        """What the audit line carries besides ``forward_ct``: the micro-batch,
        ``divergence_applicable`` when false, then the audit."""
        fields: dict[str, int | bool] = {}
        if self.micro_batch is not None:
            fields["micro_batch"] = self.micro_batch
        if not self.divergence_applicable:
            fields["divergence_applicable"] = False
        fields.update(self.audit_dict())
        return fields

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
        return LINE_PREFIX + json.dumps(self.to_dict(), separators=(",", ":"))

    def _tagged(self, body: str) -> str:
        return body if self.verify_source is None else f"{LINE_TAG.format(self.verify_source)} {body}"

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

            otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,"swa_leaked_slots":0,...}
            otel_swa[verify=attention] otel_swa_audit={"forward_ct":41,"micro_batch":1}
            otel_swa[verify=attention] otel_swa_audit={"forward_ct":42,"divergence_applicable":false,...}
        """
        audit = self._audit_line_fields()
        if not audit:
            return None
        body = AUDIT_PREFIX + json.dumps({"forward_ct": self.forward_ct, **audit}, separators=(",", ":"))
        return self._tagged(body)

    def fault_lines(self) -> list[str]:
        """One fault line per offender (:attr:`offenders`, in their order), written after the audit
        line: the same tag, then :data:`FAULT_PREFIX` and compact JSON of ``forward_ct``, ``fault``
        and the locations known (:data:`OFFENDER_KEYS` order)::

            otel_swa[verify=attention] otel_swa_fault={"forward_ct":40,"fault":"swa_stale_tokens","full_slot":88,"swa_slot":9,"swa_page":9}
        """
        return [
            self._tagged(FAULT_PREFIX + json.dumps(
                {"forward_ct": self.forward_ct, "fault": o.fault, **o.location()}, separators=(",", ":")))
            for o in self.offenders
        ]

    def lines(self) -> list[str]:
        """What a line sink logs for this record: :meth:`line`, then :meth:`audit_line` if any, then
        :meth:`fault_lines`."""
        audit = self.audit_line()
        return [self.line()] + ([] if audit is None else [audit]) + self.fault_lines()

    @classmethod
    def parse(cls, line: str) -> "SwaDivergenceRecord":
        """Parse the first record in ``line`` (a log line, possibly with a prefix before the record).

        Raises:
            MalformedRecordError: no record prefix in ``line``, or what follows the first one is not
                a record by the rules of the module docstring (the reason says which).
        """
        text = _clean(line)
        for match in _PREFIX_RE.finditer(text):
            if match.group(0) != LINE_PREFIX:
                continue
            return _decode_at(text, match, None, _NO_PREFIX).record
        raise MalformedRecordError(text, f"no {LINE_PREFIX!r} prefix found")

    # Convenience aliases so that the record type owns its finders, as in SGLang.
    @staticmethod
    def find_last(text: str) -> "tuple[SwaDivergenceRecord, str] | None":
        """See :func:`find_last`."""
        return find_last(text)

    @staticmethod
    def find_all(text: str) -> "FoundRecords":
        """See :func:`find_all`."""
        return find_all(text)


def run_start_line(verify_source: str | None, pid: int | None = None) -> str:
    """otel-swa's run start marker: ``otel_swa[verify=<source>] otel_swa_run_start={"pid":N}``.

    A line sink writes it once, before the first record it writes, so a log that several runs
    append to shows where each began. ``pid`` defaults to this process's id.

    Raises:
        ValueError: ``verify_source`` is not ``None`` nor one of :data:`VERIFY_SOURCES`.
    """
    if verify_source is not None and verify_source not in VERIFY_SOURCES:
        raise ValueError(f"verify_source must be None or one of {', '.join(VERIFY_SOURCES)}, got {verify_source!r}")
    body = RUN_START_PREFIX + json.dumps({"pid": os.getpid() if pid is None else pid}, separators=(",", ":"))
    return body if verify_source is None else f"{LINE_TAG.format(verify_source)} {body}"


# ---------------------------------------------------------------------------------- log prefixes
@dataclass(frozen=True, slots=True)
class LogPrefix:
    """What a log line says before a record.

    Two shapes are recognised:

    * SGLang's scheduler processes log with ``[%(asctime)s{prefix}] %(message)s``
      (``sglang.srt.utils.configure_logger``), ``asctime`` as ``%Y-%m-%d %H:%M:%S`` (older
      releases) or ``%m-%d %H:%M:%S`` (newer ones, coloured), and ``prefix`` built in
      ``run_scheduler_process`` from space-separated rank tokens such as `` DP1``, `` PP0``,
      `` TP3``, `` EP2`` (also ``ATTN_CP``/``MOE_DP``; the order varies between versions):
      ``[2025-06-01 12:34:56 DP1 TP0] kv_canary_swa_divergence={...}``;
    * plain Python ``logging`` whose format starts with ``%(asctime)s`` (default date format
      ``%Y-%m-%d %H:%M:%S,mmm``): ``2025-06-01 12:34:56,789 INFO kv_canary_swa_divergence={...}``.

    Attributes:
        timestamp: the time text as written in the log (``"2025-06-01 12:34:56"``,
            ``"06-01 12:34:56"``, ``"2025-06-01 12:34:56,789"``; no time zone is written there,
            so none is invented), or ``None``.
        rank: the rank tokens of SGLang's prefix joined by one space (``"TP0"``, ``"DP1 TP0"``,
            ``"PP1 TP0"``), or ``None`` when the line names no rank.
    """

    timestamp: str | None = None
    rank: str | None = None


_NO_PREFIX = LogPrefix()


def _nearest_prefix(head: str) -> LogPrefix:
    """The log prefix nearest before a record: the last SGLang prefix in ``head`` (the cleaned
    text from the start of its line to the record), else a plain-logging time at its start."""
    last = None
    if "[" in head:
        for last in _SGLANG_PREFIX_RE.finditer(head):
            pass
    if last is not None:
        return LogPrefix(last.group("ts"), last.group("rank").strip() or None)
    plain = _PLAIN_PREFIX_RE.search(head)
    return LogPrefix(plain.group("ts"), None) if plain is not None else _NO_PREFIX


def parse_log_prefix(text: str) -> LogPrefix:
    """Read the timestamp and rank from the text that stands before a record on its line (the
    nearest SGLang prefix when there are several, see :class:`LogPrefix`).

    ``text`` may hold ANSI colour codes; they are ignored. Text in neither recognised shape gives
    ``LogPrefix(None, None)``; nothing is raised.
    """
    return _nearest_prefix(_clean(text))


# ---------------------------------------------------------------------------------- entries
def _rank_sure(entry: Any) -> bool:
    """Whether the entry's rank is sure: no other process's log prefix was waiting when it was
    read (``rank_candidates`` empty, :class:`PrefixClaims`)."""
    return not entry.rank_candidates


class RecordMatch(NamedTuple):
    """One record found in a text.

    Attributes:
        record: the parsed record (with its audit fields once its audit line was read).
        text: the matched text: the prefix and its JSON object, exactly as in the log.
        line_no: 1-based number of the line (of the cleaned text) the record was found on.
        rank, timestamp: from the log prefix nearest before it on its line (:class:`LogPrefix`);
            when it stands after another record or at the start of a line, the rank is that of the
            prefix it claims (:class:`PrefixClaims`).
        rank_candidates: when several log prefixes were waiting for their messages as it was read
            (processes writing one log in parts), their ranks (its own among them: its ``rank`` is
            then a guess, :class:`PrefixClaims`); empty when its rank is sure.
    """

    record: SwaDivergenceRecord
    text: str
    line_no: int
    rank: str | None = None
    timestamp: str | None = None
    rank_candidates: tuple = ()

    rank_sure = property(_rank_sure)


class AuditMatch(NamedTuple):
    """One audit line (:data:`AUDIT_PREFIX`) found in a text.

    Attributes:
        forward_ct: the ``forward_ct`` of the record it belongs to.
        audit: the fields it holds besides ``forward_ct`` (``micro_batch``,
            ``divergence_applicable`` and names of :data:`AUDIT_FIELDS`; unknown keys left out).
        text, line_no, rank, timestamp, rank_candidates: as in :class:`RecordMatch`.
        verify_source: from the tag before it, ``None`` without one.
    """

    forward_ct: int
    audit: dict
    text: str
    line_no: int
    rank: str | None = None
    timestamp: str | None = None
    verify_source: str | None = None
    rank_candidates: tuple = ()

    rank_sure = property(_rank_sure)


class FaultMatch(NamedTuple):
    """One fault line (:data:`FAULT_PREFIX`) found in a text.

    Attributes:
        forward_ct: the ``forward_ct`` of the record it belongs to.
        offender: the first offender it names.
        text, line_no, rank, timestamp, verify_source: as in :class:`AuditMatch`.
    """

    forward_ct: int
    offender: Offender
    text: str
    line_no: int
    rank: str | None = None
    timestamp: str | None = None
    verify_source: str | None = None


class RunStartMatch(NamedTuple):
    """One run start marker (:data:`RUN_START_PREFIX`) found in a text.

    Attributes:
        fields: its JSON object (``{"pid": 4242}``; unknown keys kept, never required).
        text, line_no, rank, timestamp, verify_source: as in :class:`AuditMatch`.
        rank_candidates: as in :class:`RecordMatch`.
    """

    fields: dict
    text: str
    line_no: int
    rank: str | None = None
    timestamp: str | None = None
    verify_source: str | None = None
    rank_candidates: tuple = ()

    rank_sure = property(_rank_sure)

    @property
    def pid(self) -> int | None:
        """The process id the marker names, or ``None``."""
        pid = self.fields.get("pid")
        return pid if type(pid) is int else None  # noqa: E721


Entry = Union[RecordMatch, AuditMatch, FaultMatch, RunStartMatch]

#: SGLang's record keys (``SwaDivergenceLog``); ``swa_out_of_window_tokens`` defaults to 0 there.
_SGLANG_DEFAULTS = {"swa_out_of_window_tokens": 0}


def _tag_before(text: str, line_start: int, start: int) -> str | None:
    tag = _TAG_BEFORE_RE.search(text, line_start, start)
    if tag is None or tag.group(1) not in VERIFY_SOURCES:
        return None
    return tag.group(1)


_TAG_RE = re.compile(r"otel_swa\[verify=([a-z_]+)\] ?")


def _glued_tag(text: str, line_start: int, start: int) -> str | None:
    """The tag of the record that ``start`` is glued to: the last tag on the line before ``start``,
    when ``start`` directly follows a JSON object (``}``) and a record prefix stands after that tag."""
    if start <= line_start or text[start - 1] != "}":
        return None
    tags = list(_TAG_RE.finditer(text, line_start, start))
    if not tags or text.find(LINE_PREFIX, tags[-1].end(), start) < 0:
        return None
    return tags[-1].group(1) if tags[-1].group(1) in VERIFY_SOURCES else None


def _with_tag(record: SwaDivergenceRecord, text: str, start: int) -> SwaDivergenceRecord:
    """``record`` with the ``verify_source`` of an otel-swa tag just before ``start`` on its line."""
    source = _tag_before(text, text.rfind("\n", 0, start) + 1, start)
    if source is None:
        return record
    return SwaDivergenceRecord._as_logged(record.to_dict(), source, record._audit_line_fields() or None,
                                          record.divergence_applicable)


_FIELD_SET = frozenset(FIELDS)
_AUDIT_KEYS = ("forward_ct", "micro_batch") + AUDIT_FIELDS


def _logged_int(name: str, value: Any, minimum: int) -> str | None:
    """Why ``value`` cannot be field ``name`` of a logged line, or ``None`` when it can."""
    if type(value) is int and minimum <= value <= INT64_MAX:  # noqa: E721 - the common case first
        return None
    if type(value) is not int:  # noqa: E721 - bool refused
        return f"{name}={json.dumps(value)} is not an integer"
    if value < minimum:
        return f"{name}={value} is negative"
    if not INT64_MIN <= value <= INT64_MAX:
        return f"{name}={value} is outside int64 (-2**63 .. 2**63 - 1, what OTLP carries)"
    return None


def _decode_object(text: str, match: re.Match, line_no: int | None) -> tuple[dict, int]:
    """Decode the JSON object after the prefix ``match`` by SGLang's rule (the run of non-space
    characters after it); return it and where it ends.

    Raises:
        MalformedRecordError: nothing after the prefix, text that is no JSON object, JSON with
            spaces, or text glued after the object with no other prefix later on the line.
    """
    prefix = match.group(0)
    start = match.end()
    run_end = _RUN_RE.match(text, start).end()
    line_end = text.find("\n", start)
    line_end = len(text) if line_end < 0 else line_end
    shown = text[match.start():run_end]

    def fail(reason: str) -> MalformedRecordError:
        return MalformedRecordError(shown, reason, line_no, prefix)

    if run_end == start:
        raise fail("nothing follows the prefix (SGLang's parser skips such a line)")
    payload = text[start:run_end]
    try:
        data, end = _DECODER.raw_decode(payload)
    except ValueError as exc:
        try:  # the same text with its spaces: json.dumps without separators=(",", ":")
            spaced, _ = _DECODER.raw_decode(text[start:line_end])
        except ValueError:
            spaced = None
        if isinstance(spaced, dict):
            raise fail("the JSON holds spaces: SGLang's parser (and this one) reads only up to the first space; "
                       "write compact JSON, json.dumps(..., separators=(',', ':'))") from None
        raise fail(f"the text after the prefix is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise fail(f"expected a JSON object, got {type(data).__name__}")
    if end < len(payload) and _PREFIX_RE.search(text, start + end, line_end) is None \
            and not _glued_log_prefix(text, start + end):
        raise fail(f"text glued after the JSON object ({payload[end:][:40]!r}); SGLang's parser rejects the record")
    return data, start + end


def _glued_log_prefix(text: str, at: int) -> bool:
    """Whether another writer's log prefix (SGLang's ``[time ranks]``) or otel-swa tag starts at
    ``at``: a process writing its line in parts put it right after this object (the object is
    whole; its own line end comes later)."""
    return _SGLANG_PREFIX_RE.match(text, at) is not None or _TAG_RE.match(text, at) is not None


def _decode_at(text: str, match: re.Match, line_no: int | None, prefix: LogPrefix, line_start: int | None = None) -> Entry:
    """The entry whose prefix is ``match`` in the cleaned ``text`` (``line_start``: where its
    line starts, found when not given).

    Raises:
        MalformedRecordError: what follows the prefix is not valid (the reason says why).
    """
    kind = match.group(0)
    data, end = _decode_object(text, match, line_no)
    shown = text[match.start():end]
    if line_start is None:
        line_start = text.rfind("\n", 0, match.start()) + 1
    source = _tag_before(text, line_start, match.start()) if "]" in text[line_start:match.start()] else None
    if source is None and kind != LINE_PREFIX:
        # an audit line or run start glued right after a record on one line belongs with that
        # record: it takes the tag the record had
        source = _glued_tag(text, line_start, match.start())

    def fail(reason: str) -> MalformedRecordError:
        return MalformedRecordError(shown, reason, line_no, kind)

    if kind == LINE_PREFIX:
        unknown = [key for key in data if key not in _FIELD_SET]
        if unknown:
            raise fail(f"unknown key(s) {', '.join(map(repr, unknown))}: SGLang's SwaDivergenceLog(**fields) "
                       "raises TypeError on them")
        missing = [name for name in FIELDS if name not in data and name not in _SGLANG_DEFAULTS]
        if missing:
            raise fail(f"missing field(s) {', '.join(missing)}")
        values = {name: data.get(name, _SGLANG_DEFAULTS.get(name)) for name in FIELDS}
        for name in FIELDS:
            reason = _logged_int(name, values[name], INT64_MIN)
            if reason is not None:
                raise fail(reason)
        record = SwaDivergenceRecord._as_logged(values, source)
        return RecordMatch(record, shown, line_no, prefix.rank, prefix.timestamp)
    if kind == AUDIT_PREFIX:
        if "forward_ct" not in data:
            raise fail("missing field forward_ct")
        audit = {}
        for name in _AUDIT_KEYS:
            if name in data:
                reason = _logged_int(name, data[name], 0)
                if reason is None and name == "micro_batch" and data[name] > MICRO_BATCH_MAX:
                    reason = f"micro_batch={data[name]} is above {MICRO_BATCH_MAX}"
                if reason is not None:
                    raise fail(reason)
                if name != "forward_ct":
                    audit[name] = data[name]
        if "divergence_applicable" in data:
            if type(data["divergence_applicable"]) is not bool:  # noqa: E721 - a JSON true/false only
                raise fail(f"divergence_applicable={json.dumps(data['divergence_applicable'])} is not true or false")
            audit["divergence_applicable"] = data["divergence_applicable"]
        return AuditMatch(data["forward_ct"], audit, shown, line_no, prefix.rank, prefix.timestamp, source)
    if kind == FAULT_PREFIX:
        return FaultMatch(*_decode_fault(data, fail), shown, line_no, prefix.rank, prefix.timestamp, source)
    if kind == LIVENESS_PREFIX:
        return _liveness_match(data, shown, line_no, prefix, source, fail)
    return RunStartMatch(data, shown, line_no, prefix.rank, prefix.timestamp, source)


def _decode_fault(data: dict, fail: Any) -> "tuple[int, Offender]":
    """``(forward_ct, offender)`` of a fault line's JSON object; unknown keys are ignored.

    Raises:
        MalformedRecordError (through ``fail``): ``forward_ct`` or ``fault`` missing or invalid, a
            location that is not a non-negative int64 (``request``: not a string).
    """
    if "forward_ct" not in data:
        raise fail("missing field forward_ct")
    reason = _logged_int("forward_ct", data["forward_ct"], 0)
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
        if name == "request":
            if not isinstance(value, str):
                raise fail(f"request={json.dumps(value)} is not a string")
        else:
            reason = _logged_int(name, value, 0)
            if reason is not None:
                raise fail(reason)
        where[name] = value
    return data["forward_ct"], Offender(fault, **where)


def iter_entries(
    text: str, errors: list[MalformedRecordError] | None = None, *, first_line_no: int = 1,
    prefixes: "PrefixClaims | None" = None,
) -> Iterator[Entry]:
    """Yield every record, audit line, run start marker and liveness warning in ``text``, in
    order, as found (an audit line is not attached to its record here: see :class:`AuditPairing`
    and :func:`find_all`).

    Malformed ones are skipped; when ``errors`` is given, their errors (with line number and
    reason) are appended to it. ``first_line_no`` is the number of the first line of ``text`` in
    the whole log (a later chunk of a file being followed), ``prefixes`` the
    :class:`PrefixClaims` of the chunks before it.
    """
    cleaned, bare_crs = _clean_marked(text)
    claims = PrefixClaims() if prefixes is None else prefixes
    line_no = first_line_no
    last_pos = 0
    consumed = 0  # end of the last object decoded: a prefix inside it is not a new entry
    for match in _PREFIX_RE.finditer(cleaned):
        if match.start() < consumed:
            continue
        line_no += cleaned.count("\n", last_pos, match.start())
        if bare_crs:  # a bare CR ends a line for the parser, not for the line numbers
            line_no -= bisect.bisect_left(bare_crs, match.start()) - bisect.bisect_left(bare_crs, last_pos)
        last_pos = match.start()
        line_start = cleaned.rfind("\n", 0, match.start()) + 1
        claims.read(cleaned, consumed, match.start())
        prefix = _nearest_prefix(cleaned[line_start:match.start()])
        claimed, rank, candidates = claims.claim()
        # its rank: the prefix nearest before it, when one stands between the entry before and it
        # (no rank's sequence known yet says otherwise: :mod:`otel_swa.testing.runs` may move it),
        # else the prefix it claims (it stands after another record, or at the start of a line)
        own = _nearest_prefix(cleaned[max(line_start, consumed):match.start()]).rank
        if own is not None:
            rank = own
        if claimed and rank != prefix.rank:
            prefix = LogPrefix(prefix.timestamp, rank)
        try:
            entry = _decode_at(cleaned, match, line_no, prefix, line_start)
        except MalformedRecordError as exc:
            if errors is not None:
                errors.append(exc)
            consumed = match.end()
            continue
        consumed = match.start() + len(entry.text)
        if candidates:
            entry = entry._replace(rank_candidates=candidates)
        yield entry


class PrefixClaims:
    """Which log prefix each line otel-swa reads belongs to, when processes write one log in parts.

    A process that writes its log prefix, its message and its line end in separate writes lets
    other processes' writes land in between: ``[.. TP0] [.. TP1] <TP0's message><TP1's
    message>``, or a message at the start of a later line. Each message belongs to one prefix
    written before it, by its own process, and each prefix to one message. This keeps the SGLang
    prefixes (``[time ranks]``) read and not yet claimed by a message, in order: a message claims
    the oldest (the process that wrote its prefix first writes its message first, as often as
    not), and its rank is sure only when that prefix was the only one waiting, written while none
    was. A prefix followed by other text (an engine log line of its own) is no message's. At most
    :attr:`LIMIT` prefixes wait (the oldest are forgotten).

    The rank :func:`iter_entries` gives a message whose rank is not sure is the nearest prefix
    before it (``[.. TP0] [.. TP1] <message>``: TP1), when one stands right before it, else the
    claimed one's; the ranks' sequences (:mod:`otel_swa.testing.runs`) decide among the candidates.
    On logs of 2 to 8 writers interleaved by a seeded scheduler, the nearest prefix misnamed fewer
    ranks than the claimed one (4 against 13 wrong verdicts in 960 logs).
    """

    LIMIT = 256

    def __init__(self) -> None:
        self._pending: collections.deque = collections.deque(maxlen=self.LIMIT)

    def read(self, text: str, start: int, end: int) -> None:
        """Take the prefixes of ``text[start:end]`` (the text between two entries)."""
        if "[" not in text[start:end]:
            return
        found = list(_SGLANG_PREFIX_RE.finditer(text, start, end))
        for index, match in enumerate(found):
            gap_end = found[index + 1].start() if index + 1 < len(found) else end
            gap = text[match.end():gap_end]
            if gap.strip() and _TAG_RE.sub("", gap).strip():
                continue  # the prefix of another log line
            self._pending.append((match.group("rank").strip() or None, not self._pending))

    def claim(self) -> tuple[bool, str | None, tuple]:
        """``(claimed, rank, candidates)`` for the next message: whether a prefix was waiting, its
        rank, and, unless it was the only one and written while none was, the ranks of the
        prefixes waiting (the message's own among them); ``()`` when sure."""
        if not self._pending:
            return False, None, ()
        candidates = tuple(dict.fromkeys(rank for rank, _ in self._pending))
        rank, alone = self._pending.popleft()
        return True, rank, () if alone and not self._pending else candidates


def _with_audit(record: SwaDivergenceRecord, audit: dict) -> SwaDivergenceRecord:
    logged = SwaDivergenceRecord._as_logged(record.to_dict(), record.verify_source, audit, record.divergence_applicable)
    object.__setattr__(logged, "offenders", record.offenders)
    return logged


def _with_offender(record: SwaDivergenceRecord, offender: Offender) -> SwaDivergenceRecord:
    logged = object.__new__(SwaDivergenceRecord)  # no check again: a logged record may hold negative values
    for item in dataclasses.fields(SwaDivergenceRecord):
        object.__setattr__(logged, item.name, getattr(record, item.name))
    object.__setattr__(logged, "offenders", record.offenders + (offender,))
    return logged


class AuditPairing:
    """Attaches audit lines and fault lines to their records while a log is read, possibly in chunks.

    An audit line belongs to the latest record before it with the same tag (``verify_source``)
    and the same log rank, when that record has the audit line's ``forward_ct`` and no audit line
    yet (the line sinks write it right after the record's line, through the same logger). When
    there is none, it belongs to a recent record of its tag with its ``forward_ct`` and no audit
    line yet, of another rank or none (several processes writing one log at once can move a line's
    log prefix to another line: :mod:`otel_swa.testing.runs`). A fault line belongs to the latest
    record before it with the same tag and rank, when that record has its ``forward_ct`` (a record
    may have several), else to the latest record of its tag with its ``forward_ct`` of any rank.
    Any other audit or fault line is an error
    (``MalformedRecordError`` with the reason).

    Use :meth:`add` for every record (or other entry) in order, into a list the caller keeps, and
    :meth:`attach` for every audit or fault line: the record's entry in that list is replaced by one
    whose record carries the audit fields (or the offender). Entries are :class:`RecordMatch` or any
    object with ``record`` and ``rank`` attributes that ``_replace`` (named tuples) or
    :func:`dataclasses.replace` can copy.
    """

    def __init__(self) -> None:
        self._latest: dict[tuple[str | None, str | None], tuple[list, int, int]] = {}
        self._recent: dict[tuple[str | None, str | None], tuple[list, int, int]] = {}
        self._waiting: dict[tuple, list] = {}  # (tag, forward_ct) -> records without an audit line: _attach_elsewhere
        self._order: collections.deque = collections.deque()
        self._outstanding = 0

    def add(self, entries: list, entry: Any) -> None:
        """Append ``entry`` to ``entries``; remember it when it holds a record."""
        entries.append(entry)
        record = getattr(entry, "record", None)
        if isinstance(record, SwaDivergenceRecord):
            key = (record.verify_source, entry.rank)
            self._latest[key] = self._recent[key] = (entries, len(entries) - 1, record.forward_ct)
            self._remember_waiting(entries, record, entry.rank)

    def attach(self, line: "AuditMatch | FaultMatch") -> MalformedRecordError | None:
        """Attach an audit or fault line to its record; return the error when it has none
        (nothing changed)."""
        if isinstance(line, FaultMatch):
            return self._attach_fault(line)
        audit = line
        slot = self._latest.pop((audit.verify_source, audit.rank), None)
        if slot is None or slot[2] != audit.forward_ct:
            if slot is not None:
                self._latest[(audit.verify_source, audit.rank)] = slot
            if self._attach_elsewhere(audit):
                return None
            rank = f" of rank {audit.rank}" if audit.rank else ""
            return MalformedRecordError(
                audit.text, f"no record{rank} with forward_ct={audit.forward_ct} just before this audit line",
                audit.line_no, AUDIT_PREFIX,
            )
        entries, index, _ = slot
        self._replace_record(entries, index, _with_audit(entries[index].record, audit.audit))
        self._mark_attached(entries, index)
        return None

    def _attach_fault(self, fault: "FaultMatch") -> MalformedRecordError | None:
        slot = self._recent.get((fault.verify_source, fault.rank))
        if slot is None or slot[2] != fault.forward_ct:
            # its log prefix moved by another process's write: the latest record of its tag with its
            # forward_ct, of any rank
            candidates = [item for (tag, _), item in self._recent.items()
                          if tag == fault.verify_source and item[2] == fault.forward_ct]
            slot = max(candidates, key=lambda item: item[1]) if candidates else None
        if slot is None:
            rank = f" of rank {fault.rank}" if fault.rank else ""
            return MalformedRecordError(
                fault.text, f"no record{rank} with forward_ct={fault.forward_ct} just before this fault line",
                fault.line_no, FAULT_PREFIX,
            )
        entries, index, _ = slot
        record = entries[index].record
        count = getattr(record, fault.offender.fault, None)
        if count == 0:  # a place for a fault its record does not count: not otel-swa's line
            return MalformedRecordError(
                fault.text, f"a {fault.offender.fault} offender for the record with forward_ct={fault.forward_ct}, "
                f"which counts {fault.offender.fault}=0", fault.line_no, FAULT_PREFIX,
            )
        self._replace_record(entries, index, _with_offender(record, fault.offender))
        return None

    @staticmethod
    def _replace_record(entries: list, index: int, record: SwaDivergenceRecord) -> None:
        entry = entries[index]
        entries[index] = entry._replace(record=record) if hasattr(entry, "_replace") else dataclasses.replace(entry, record=record)

    # -- lines written by several processes at once (their parts interleaved): an audit line whose
    # log prefix was taken by another process's write names the wrong rank, or none, and may come
    # many lines after its record (its process was descheduled while the others wrote on)
    _WAITING = 65536  # records without an audit line yet that such an audit line may belong to

    def _remember_waiting(self, entries: list, record: SwaDivergenceRecord, rank: str | None) -> None:
        key = (record.verify_source, record.forward_ct)
        item = [entries, len(entries) - 1, rank, False]
        self._waiting.setdefault(key, []).append(item)
        order = self._order
        order.append((key, item))
        self._outstanding += 1
        while self._outstanding > self._WAITING:  # the oldest records still without one are let go
            old_key, old_item = order.popleft()
            if not old_item[3]:
                self._forget(old_key, old_item)
        if len(order) > 2 * self._WAITING:
            self._order = collections.deque(pair for pair in order if not pair[1][3])

    def _forget(self, key: tuple, item: list) -> None:
        item[3] = True
        self._outstanding -= 1
        items = self._waiting.get(key)
        if items is not None:
            items.remove(item)
            if not items:
                del self._waiting[key]

    def _mark_attached(self, entries: list, index: int) -> None:
        record = entries[index].record
        key = (record.verify_source, record.forward_ct)
        for item in self._waiting.get(key, ()):
            if item[0] is entries and item[1] == index:
                self._forget(key, item)
                return

    def _attach_elsewhere(self, audit: AuditMatch) -> bool:
        """Attach ``audit`` to a record of its tag with its ``forward_ct`` and no audit line yet,
        of its rank first, else the latest; ``False`` when there is none."""
        key = (audit.verify_source, audit.forward_ct)
        found = None
        for item in self._waiting.get(key, ()):
            if found is None or item[2] == audit.rank or (found[2] != audit.rank and item[1] > found[1]):
                found = item
        if found is None:
            return False
        entries, index, rank, _ = found
        latest = self._latest.get((audit.verify_source, rank))
        if latest is not None and latest[0] is entries and latest[1] == index:
            del self._latest[(audit.verify_source, rank)]
        self._replace_record(entries, index, _with_audit(entries[index].record, audit.audit))
        self._forget(key, found)
        return True


class FoundRecords(list):
    """The records found in a text, in order (a ``list`` of :class:`SwaDivergenceRecord`), each
    with the audit fields of its audit line when one followed it.

    Attributes:
        matches: a :class:`RecordMatch` per record, same order.
        entries: every record, audit line and run start marker, in order (:class:`RecordMatch`,
            :class:`AuditMatch`, :class:`RunStartMatch`).
        malformed: how many prefixes were followed by something that is not valid; they were
            skipped.
        errors: the :class:`MalformedRecordError` for each skipped one (line number and reason).
    """

    def __init__(self) -> None:
        super().__init__()
        self.matches: list[RecordMatch] = []
        self.entries: list[Entry] = []
        self.errors: list[MalformedRecordError] = []

    @property
    def malformed(self) -> int:
        return len(self.errors)


def find_all(text: str) -> FoundRecords:
    """Every record in ``text``, in order, audit lines attached (:class:`AuditPairing`); an empty
    result when there is none.

    Malformed lines are skipped and counted in ``result.malformed`` (``result.errors`` says where
    and why); nothing is raised.
    """
    found = FoundRecords()
    pairing = AuditPairing()
    for entry in iter_entries(text, found.errors):
        if isinstance(entry, (AuditMatch, FaultMatch)):
            error = pairing.attach(entry)
            if error is not None:
                found.errors.append(error)
            found.entries.append(entry)
        else:
            pairing.add(found.entries, entry)
    found.matches.extend(entry for entry in found.entries if isinstance(entry, RecordMatch))
    found.extend(match.record for match in found.matches)
    return found


def iter_matches(text: str, errors: list[MalformedRecordError] | None = None) -> Iterator[RecordMatch]:
    """Yield every record in ``text`` (any number of lines), in order, audit lines attached.

    Malformed lines are skipped; when ``errors`` is given, their errors are appended to it.
    """
    found = find_all(text)
    if errors is not None:
        errors.extend(found.errors)
    yield from found.matches


def find_last(text: str) -> tuple[SwaDivergenceRecord, str] | None:
    """The last valid record in ``text`` and the matched text, or ``None`` when there is none.

    Mirrors SGLang's ``find_last``; malformed records are skipped.
    """
    found = find_all(text)
    if not found.matches:
        return None
    last = found.matches[-1]
    return last.record, last.text


# ---------------------------------------------------------------------------------- liveness warnings
#: Why a reporter that is on delivered no sample (:attr:`LivenessWarning.cause`): ``no_forward_step``:
#: no forward step reached it, the engine's forward-step hook never fired (reported at process exit);
#: ``no_sample_delivered``: forward steps reached it and, for :attr:`LivenessWarning.steps` of them,
#: no sample was delivered (every view refused, sampling skipped).
LIVENESS_CAUSES = ("no_forward_step", "no_sample_delivered")
_LIVENESS_COUNTS = ("forward_ct", "steps", "samples_delivered", "samples_taken", "invalid_samples", "skipped_captures")


@dataclass(frozen=True, slots=True)
class LivenessWarning:
    """otel-swa on and not working: a reporter that delivered no sample, as SGLang's KV canary says
    "canary path is not executing" when a kernel's run counter is still 0 after its warm-up.

    Written by the line sinks as otel-swa's own line (:meth:`line`), after the run start marker::

        otel_swa[verify=attention] otel_swa_liveness={"pid":4242,"forward_ct":0,"steps":0,"samples_delivered":0,"samples_taken":0,"invalid_samples":0,"skipped_captures":0,"cause":"no_forward_step"}

    Attributes:
        cause: one of :data:`LIVENESS_CAUSES`.
        forward_ct: forward steps the reporter had seen.
        steps: forward steps since its last delivered sample (all of them when none was).
        samples_delivered: records it delivered in its life (0 when it never worked).
        samples_taken, invalid_samples, skipped_captures: its counts of the same names
            (``ReporterStats``): what explains the silence.
        verify_source: the reporter's tag (:data:`VERIFY_SOURCES`), or ``None``.
        pid: the process id, or ``None`` (then :meth:`line` writes this process's).
        hook: where the engine was expected to step the reporter (``"SGLang
            ModelRunner.forward"``), or ``None``.

    Raises:
        ValueError: an unknown ``cause`` or ``verify_source``; TypeError: a count that is no int,
            a ``hook`` that is no string.
    """

    cause: str
    forward_ct: int = 0
    steps: int = 0
    samples_delivered: int = 0
    samples_taken: int = 0
    invalid_samples: int = 0
    skipped_captures: int = 0
    verify_source: "str | None" = None
    pid: "int | None" = None
    hook: "str | None" = None

    def __post_init__(self) -> None:
        if self.hook is not None and not isinstance(self.hook, str):
            raise TypeError(f"LivenessWarning.hook must be None or a str, got {self.hook!r}")
        if self.cause not in LIVENESS_CAUSES:
            raise ValueError(f"LivenessWarning.cause must be one of {', '.join(LIVENESS_CAUSES)}, got {self.cause!r}")
        for name in _LIVENESS_COUNTS:
            _check_int("LivenessWarning", name, getattr(self, name), 0)
        if self.verify_source is not None and self.verify_source not in VERIFY_SOURCES:
            raise ValueError(f"LivenessWarning.verify_source must be None or one of {', '.join(VERIFY_SOURCES)}, "
                             f"got {self.verify_source!r}")

    def to_dict(self) -> dict:
        """The line's JSON object: ``pid``, the counts, ``cause``."""
        fields: dict = {"pid": os.getpid() if self.pid is None else self.pid}
        fields.update((name, getattr(self, name)) for name in _LIVENESS_COUNTS)
        fields["cause"] = self.cause
        if self.hook is not None:
            fields["hook"] = self.hook
        return fields

    def line(self) -> str:
        """``otel_swa[verify=<source>] otel_swa_liveness={...}`` (compact JSON; no tag without a source)."""
        body = LIVENESS_PREFIX + json.dumps(self.to_dict(), separators=(",", ":"))
        return body if self.verify_source is None else f"{LINE_TAG.format(self.verify_source)} {body}"

    def summary(self) -> str:
        """The warning in words: ``instrumented, 0 samples in N steps: <why>``."""
        return liveness_summary(self.to_dict())


def liveness_summary(fields: dict) -> str:
    """:meth:`LivenessWarning.summary` of a liveness line's JSON object (missing counts read as 0)."""
    count = {name: fields.get(name) if type(fields.get(name)) is int else 0 for name in _LIVENESS_COUNTS}  # noqa: E721
    head = f"instrumented, {count['samples_delivered']} samples in {count['steps']} steps"
    if fields.get("cause") == "no_forward_step":
        hook = fields.get("hook")
        why = "no forward step reached the reporter (" + (
            f"the engine was to step it from {hook}" if isinstance(hook, str) else "the engine's forward-step hook never "
            "stepped it") + ")"
        if count["skipped_captures"]:
            why += f"; {count['skipped_captures']} step() call(s) during CUDA graph capture were ignored"
        return f"{head}: {why}"
    if count["samples_delivered"]:
        head = f"instrumented, 0 samples in the last {count['steps']} steps ({count['samples_delivered']} before)"
    reasons = []
    if count["samples_taken"] == 0:
        reasons.append("no sample was taken (every sampling step failed before its sample: a view the reporter refused?)")
    elif count["invalid_samples"]:
        reasons.append(f"{count['invalid_samples']} of {count['samples_taken']} sample(s) taken were refused (view "
                       "faults or invalid values: kv_cache.swa.reporter.view_faults)")
    if count["skipped_captures"]:
        reasons.append(f"{count['skipped_captures']} step() call(s) during CUDA graph capture were ignored")
    return f"{head}: " + ("; ".join(reasons) or "samples taken and not delivered")


class LivenessMatch(NamedTuple):
    """One liveness warning (:data:`LIVENESS_PREFIX`) found in a text.

    Attributes:
        fields: its JSON object (unknown keys kept, never required).
        text, line_no, rank, timestamp, verify_source: as in :class:`AuditMatch`.
        rank_candidates: as in :class:`RecordMatch`.
    """

    fields: dict
    text: str
    line_no: int
    rank: str | None = None
    timestamp: str | None = None
    verify_source: str | None = None
    rank_candidates: tuple = ()

    rank_sure = property(_rank_sure)

    @property
    def summary(self) -> str:
        """The warning in words (:func:`liveness_summary`)."""
        return liveness_summary(self.fields)


def _liveness_match(data: dict, shown: str, line_no: int | None, prefix: LogPrefix, source: str | None,
                    fail: Any) -> LivenessMatch:
    for name in _LIVENESS_COUNTS:
        if name in data:
            reason = _logged_int(name, data[name], 0)
            if reason is not None:
                raise fail(reason)
    for name in ("cause", "hook"):
        if name in data and not isinstance(data[name], str):
            raise fail(f"{name}={json.dumps(data[name])} is not a string")
    return LivenessMatch(data, shown, line_no, prefix.rank, prefix.timestamp, source)


__all__ += ["LIVENESS_PREFIX", "LIVENESS_CAUSES", "LivenessWarning", "LivenessMatch", "liveness_summary",
            "PrefixClaims"]
