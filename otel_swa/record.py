"""One SWA divergence sample and its SGLang-compatible log line.

This module knows neither torch nor OpenTelemetry: the record is the only object that crosses from
the device side of the package to its telemetry side.

The line format is the one SGLang's KV canary prints (sgl-project/sglang PR #26820,
``python/sglang/srt/kv_canary/runner/swa_divergence.py``)::

    kv_canary_swa_divergence={"forward_ct":40,"verify_full":5120,"verify_swa":2048,"swa_full_idx_divergence":17,"swa_out_of_window_tokens":311}

i.e. the prefix followed directly by compact JSON (separators ``","`` and ``":"``) of five integer
fields in this order. SGLang's parser finds the prefix, takes the following run of non-space
characters and JSON-decodes it; :meth:`SwaDivergenceRecord.parse` and the ``find_*`` functions apply
the same rule, after removing ANSI colour codes and reading CRLF or bare CR as line ends, so that
coloured, CRLF and progress-bar-interleaved logs parse too.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple

__all__ = [
    "LINE_PREFIX",
    "FIELDS",
    "AUDIT_FIELDS",
    "VERIFY_SOURCES",
    "MalformedRecordError",
    "SwaDivergenceRecord",
    "RecordMatch",
    "FoundRecords",
    "find_all",
    "find_last",
    "iter_matches",
]

#: The prefix SGLang prints before the JSON object. Existing CI greps search for it.
LINE_PREFIX = "kv_canary_swa_divergence="

#: The record's fields, in SGLang's order (the order of the JSON keys in the line).
FIELDS = (
    "forward_ct",
    "verify_full",
    "verify_swa",
    "swa_full_idx_divergence",
    "swa_out_of_window_tokens",
)

#: Fields beyond SGLang's (never in the line): the SWA slot audit, ``None`` when not audited.
AUDIT_FIELDS = (
    "swa_leaked_slots",
    "swa_stale_tokens",
    "swa_shared_slots",
    "swa_pages_in_use",
    "swa_pages_referenced",
)

#: What ``verify_full`` / ``verify_swa`` count, as carried by :attr:`SwaDivergenceRecord.verify_source`:
#: ``kv_canary``: the KV entries SGLang's KV canary verified (its verify plans, SGLang's meaning of the
#: fields); ``attention``: the KV entries attention read at each forward step (``seq_len`` per request
#: in the FULL pool, the tokens still held in the window in the SWA pool), where no canary runs.
VERIFY_SOURCES = ("attention", "kv_canary")

#: Written before the record on otel-swa's own lines (``otel_swa[verify=kv_canary] kv_canary_swa_...``):
#: it tells otel-swa's line from SGLang's in one log and what the verify counts are, without touching
#: the JSON (SGLang's parser searches for the record prefix and ignores what stands before it).
LINE_TAG = "otel_swa[verify={}]"
_TAG_BEFORE_RE = re.compile(r"otel_swa\[verify=([a-z_]+)\] ?$")

# CSI sequences such as "\x1b[32m" (colour) and "\x1b[0m" (reset), as written by coloured log handlers.
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# The prefix, then SGLang's rule: the run of non-whitespace characters that follows it.
_MATCH_RE = re.compile(re.escape(LINE_PREFIX) + r"(\S*)")


class MalformedRecordError(ValueError):
    """A record prefix is present but what follows it is not a valid record.

    Attributes:
        text: the text that was being parsed (after colour codes were removed).
        reason: what was wrong, in words.
    """

    def __init__(self, text: str, reason: str) -> None:
        self.text = text
        self.reason = reason
        shown = text if len(text) <= 300 else text[:297] + "..."
        super().__init__(f"malformed {LINE_PREFIX!r} record: {reason}; in {shown!r}")


def _clean(text: str) -> str:
    """Remove ANSI escape sequences; CRLF and bare CR (progress-bar redraws, old Mac files) end
    lines like LF."""
    if "\x1b" in text:
        text = _ANSI_RE.sub("", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


@dataclass(frozen=True, slots=True)
class SwaDivergenceRecord:
    """One sample of the SWA KV cache, as SGLang's SWA divergence reporter defines it.

    All fields are non-negative Python ``int`` (``bool`` is refused).

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

    Beyond SGLang's five fields, keyword-only and never written into the line:

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
        verify_source: what ``verify_full`` / ``verify_swa`` count, one of :data:`VERIFY_SOURCES`,
            or ``None`` when unknown (a line SGLang itself wrote, which counts what its canary
            verified). Written as the line's tag by :meth:`line`, never into the JSON.

    Raises:
        TypeError: a field is not an ``int`` (or is a ``bool``); an audit field is neither
            ``None`` nor an ``int``; ``divergence_applicable`` is not a ``bool``.
        ValueError: a field is negative; ``verify_source`` is not ``None`` nor one of
            :data:`VERIFY_SOURCES`.
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
    verify_source: "str | None" = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        for name in FIELDS + AUDIT_FIELDS:
            value = getattr(self, name)
            if value is None and name in AUDIT_FIELDS:
                continue
            if type(value) is not int:  # noqa: E721 - bool and int subclasses are refused on purpose
                raise TypeError(
                    f"SwaDivergenceRecord.{name} must be an int, got {value!r} ({type(value).__name__})"
                )
            if value < 0:
                raise ValueError(f"SwaDivergenceRecord.{name} must be >= 0, got {value}")
        if type(self.divergence_applicable) is not bool:
            raise TypeError(f"SwaDivergenceRecord.divergence_applicable must be a bool, got {self.divergence_applicable!r}")
        if self.verify_source is not None and self.verify_source not in VERIFY_SOURCES:
            raise ValueError(
                f"SwaDivergenceRecord.verify_source must be None or one of {', '.join(VERIFY_SOURCES)}, "
                f"got {self.verify_source!r}"
            )

    @property
    def audited(self) -> bool:
        """Whether the SWA slot audit fields are present."""
        return self.swa_leaked_slots is not None

    def audit_dict(self) -> dict[str, int]:
        """The audit fields that are present (empty when not audited)."""
        return {name: getattr(self, name) for name in AUDIT_FIELDS if getattr(self, name) is not None}

    # ------------------------------------------------------------------ conversions
    def to_dict(self) -> dict[str, int]:
        """SGLang's five fields as a dict, in SGLang's key order (the line's JSON object)."""
        return {name: getattr(self, name) for name in FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SwaDivergenceRecord":
        """Build a record from a decoded JSON object; keys beyond the five are ignored.

        Raises:
            KeyError: a field is missing.
            TypeError, ValueError: as the constructor.
        """
        missing = [name for name in FIELDS if name not in data]
        if missing:
            raise KeyError(f"missing field(s) {', '.join(missing)}")
        return cls(**{name: data[name] for name in FIELDS})

    def replace(self, **changes: int) -> "SwaDivergenceRecord":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ the line
    def format(self) -> str:
        """The SGLang line body: ``kv_canary_swa_divergence=`` + compact JSON, no spaces.

        Byte-identical to SGLang's ``json.dumps(..., separators=(",", ":"))`` output for the same
        five values. The logging prefix (time, level, rank...) is the log handler's business.
        """
        return LINE_PREFIX + json.dumps(self.to_dict(), separators=(",", ":"))

    def line(self) -> str:
        """The message otel-swa logs: :meth:`format`, after the tag ``otel_swa[verify=<source>]``
        when :attr:`verify_source` is known (``otel_swa[verify=kv_canary] kv_canary_swa_divergence={...}``).

        The record part stays byte-identical to SGLang's line, so greps for the prefix and SGLang's
        ``SwaDivergenceLog.find_all`` read it; :func:`find_all` reads the tag back into
        :attr:`verify_source`.
        """
        body = self.format()
        return body if self.verify_source is None else f"{LINE_TAG.format(self.verify_source)} {body}"

    @classmethod
    def parse(cls, line: str) -> "SwaDivergenceRecord":
        """Parse the first record in ``line`` (a log line, possibly with a prefix before the record).

        Raises:
            MalformedRecordError: no record prefix in ``line``, or the text after it is not a JSON
                object holding the five fields as non-negative integers.
        """
        text = _clean(line)
        match = _MATCH_RE.search(text)
        if match is None:
            raise MalformedRecordError(text, f"no {LINE_PREFIX!r} prefix found")
        return _with_tag(_decode(match.group(1), text), text, match.start())

    # Convenience aliases so that the record type owns its finders, as in SGLang.
    @staticmethod
    def find_last(text: str) -> "tuple[SwaDivergenceRecord, str] | None":
        """See :func:`find_last`."""
        return find_last(text)

    @staticmethod
    def find_all(text: str) -> "FoundRecords":
        """See :func:`find_all`."""
        return find_all(text)


def _decode(payload: str, context: str) -> SwaDivergenceRecord:
    try:
        data = json.loads(payload)
    except ValueError as exc:
        raise MalformedRecordError(context, f"text after the prefix is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise MalformedRecordError(context, f"expected a JSON object, got {type(data).__name__}")
    try:
        return SwaDivergenceRecord.from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        reason = exc.args[0] if exc.args else str(exc)
        raise MalformedRecordError(context, str(reason)) from None


def _with_tag(record: SwaDivergenceRecord, text: str, start: int) -> SwaDivergenceRecord:
    """``record`` with the ``verify_source`` of an otel-swa tag just before ``start`` on its line."""
    line_start = text.rfind("\n", 0, start) + 1
    tag = _TAG_BEFORE_RE.search(text, line_start, start)
    if tag is None or tag.group(1) not in VERIFY_SOURCES:
        return record
    return dataclasses.replace(record, verify_source=tag.group(1))


class RecordMatch(NamedTuple):
    """One record found in a text.

    Attributes:
        record: the parsed record.
        text: the matched text: the prefix and its JSON object, exactly as in the log.
        line_no: 1-based number of the line (of the cleaned text) the record was found on.
    """

    record: SwaDivergenceRecord
    text: str
    line_no: int


class FoundRecords(list):
    """The records found in a text, in order (a ``list`` of :class:`SwaDivergenceRecord`).

    Attributes:
        matches: a :class:`RecordMatch` per record, same order.
        malformed: how many record prefixes were followed by something that is not a record;
            they were skipped.
        errors: the :class:`MalformedRecordError` for each skipped one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.matches: list[RecordMatch] = []
        self.errors: list[MalformedRecordError] = []

    @property
    def malformed(self) -> int:
        return len(self.errors)


def iter_matches(text: str, errors: list[MalformedRecordError] | None = None) -> Iterator[RecordMatch]:
    """Yield every record in ``text`` (any number of lines), in order.

    Malformed records are skipped; when ``errors`` is given, their errors are appended to it.
    """
    cleaned = _clean(text)
    line_no = 1
    last_pos = 0
    for match in _MATCH_RE.finditer(cleaned):
        line_no += cleaned.count("\n", last_pos, match.start())
        last_pos = match.start()
        try:
            record = _with_tag(_decode(match.group(1), match.group(0)), cleaned, match.start())
        except MalformedRecordError as exc:
            if errors is not None:
                errors.append(exc)
            continue
        yield RecordMatch(record, match.group(0), line_no)


def find_all(text: str) -> FoundRecords:
    """Every record in ``text``, in order; an empty result when there is none.

    Malformed records are skipped and counted in ``result.malformed``; nothing is raised.
    """
    found = FoundRecords()
    for match in iter_matches(text, found.errors):
        found.append(match.record)
        found.matches.append(match)
    return found


def find_last(text: str) -> tuple[SwaDivergenceRecord, str] | None:
    """The last valid record in ``text`` and the matched text, or ``None`` when there is none.

    Mirrors SGLang's ``find_last``; malformed records are skipped.
    """
    last: RecordMatch | None = None
    for match in iter_matches(text):
        last = match
    return None if last is None else (last.record, last.text)
