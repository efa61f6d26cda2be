"""The JSON object after a prefix, decoded by SGLang's rule (the run of non-space characters after
the prefix), and the error of a line that is not valid (:class:`MalformedRecordError`)."""

from __future__ import annotations

import json
import re

from otel_swa.record.logtext import glued_log_prefix
from otel_swa.record.prefixes import LINE_PREFIX, PREFIX_RE, PREFIX_WORDS

__all__ = ["MalformedRecordError", "decode_object"]

# SGLang's rule: the run of non-whitespace characters after the prefix.
_RUN_RE = re.compile(r"\S*")
_DECODER = json.JSONDecoder()


class MalformedRecordError(ValueError):
    """A prefix is present but what follows it is not a valid line of its kind (a record, an
    audit line, a fault line, a run start marker, a liveness warning...).

    Attributes:
        text: the text that was being parsed (after colour codes were removed).
        reason: what was wrong, in words.
        line_no: 1-based line number where it was found, ``None`` when not known.
        prefix: which prefix (:data:`~otel_swa.record.LINE_PREFIX`,
            :data:`~otel_swa.record.AUDIT_PREFIX`, ...: a key of
            :data:`~otel_swa.record.prefixes.PREFIX_WORDS`).
    """

    def __init__(self, text: str, reason: str, line_no: int | None = None, prefix: str = LINE_PREFIX) -> None:
        self.text = text
        self.reason = reason
        self.line_no = line_no
        self.prefix = prefix
        shown = text if len(text) <= 300 else text[:297] + "..."
        where = f"line {line_no}: " if line_no is not None else ""
        super().__init__(f"{where}malformed {prefix!r} {PREFIX_WORDS.get(prefix, 'record')}: {reason}; in {shown!r}")


def decode_object(text: str, match: re.Match, line_no: int | None) -> tuple[dict, int]:
    """Decode the JSON object after the prefix ``match`` by SGLang's rule (the run of non-space
    characters after it); return it and where it ends.

    Raises:
        MalformedRecordError: nothing after the prefix, text that is no JSON object, JSON with
            spaces, or text glued after the object with no other prefix later on the line.
    """
    prefix = match.group(0)
    start = match.end()
    run_end = _RUN_RE.match(text, start).end()

    def fail(reason: str) -> MalformedRecordError:
        return MalformedRecordError(text[match.start():run_end], reason, line_no, prefix)

    if run_end == start:
        raise fail("nothing follows the prefix (SGLang's parser skips such a line)")
    payload = text[start:run_end]
    try:
        data, end = _DECODER.raw_decode(payload)
    except ValueError as exc:
        try:  # the same text with its spaces: json.dumps without separators=(",", ":")
            spaced, _ = _DECODER.raw_decode(text[start:_line_end(text, start)])
        except ValueError:
            spaced = None
        if isinstance(spaced, dict):
            raise fail("the JSON holds spaces: SGLang's parser (and this one) reads only up to the first space; "
                       "write compact JSON, json.dumps(..., separators=(',', ':'))") from None
        raise fail(f"the text after the prefix is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise fail(f"expected a JSON object, got {type(data).__name__}")
    if end < len(payload) and PREFIX_RE.search(text, start + end, _line_end(text, start)) is None \
            and not glued_log_prefix(text, start + end):
        raise fail(f"text glued after the JSON object ({payload[end:][:40]!r}); SGLang's parser rejects the record")
    return data, start + end


def _line_end(text: str, start: int) -> int:
    """Where the line that holds ``start`` ends (its LF, or the end of ``text``)."""
    end = text.find("\n", start)
    return len(text) if end < 0 else end
