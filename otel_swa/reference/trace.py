"""Request traces in the Azure LLM inference trace CSV format.

The format (Azure Public Dataset, "Azure LLM inference trace 2023")::

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:15:46.6805900,374,44

``TIMESTAMP`` is the invocation time (``YYYY-MM-DD HH:MM:SS`` with up to 9 fractional digits; the
published files use 7, which :meth:`datetime.fromisoformat` does not accept on every Python version,
so it is parsed by hand here), ``ContextTokens`` the prompt length and ``GeneratedTokens`` the number
of output tokens, both in tokens.

Two files ship with the package (``source="conv"`` and ``source="code"``): the conversation and the
code-completion services, 19,366 and 8,819 requests collected on 2023-11-16. They are the data of
"Splitwise: Efficient generative LLM inference using phase splitting" (Patel et al., ISCA 2024),
published by Microsoft Azure under the Creative Commons Attribution 4.0 license (CC-BY 4.0); see
``otel_swa/reference/data/README.md`` and ``LICENSE``.

In the published files no request has 0 context or 0 generated tokens. The loader accepts 0 in both
columns (the format allows it); the reference engine gives a request with 0 context tokens a
one-token prompt, and a request with 0 generated tokens only its prefill (see
:mod:`otel_swa.reference.scheduler`). Negative counts are an error.
"""

from __future__ import annotations

import calendar
import csv
import os
import time
from dataclasses import dataclass
from fractions import Fraction
from importlib import resources
from typing import TextIO

__all__ = ["TraceRequest", "TraceFormatError", "load_trace", "scale_contexts", "write_trace", "PACKAGED_TRACES", "HEADER"]

#: The header of the format, in order. Extra columns after these are ignored.
HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

#: Names accepted as ``source`` for the packaged files -> file name under ``otel_swa/reference/data``.
PACKAGED_TRACES = {
    "conv": "AzureLLMInferenceTrace_conv.csv",
    "code": "AzureLLMInferenceTrace_code.csv",
}


class TraceFormatError(ValueError):
    """A trace file is not in the expected format.

    Attributes:
        file: the file name (or ``"<stream>"``).
        line_no: 1-based line number of the offending line (``0`` for an empty file).
    """

    def __init__(self, file: str, line_no: int, message: str) -> None:
        self.file = file
        self.line_no = line_no
        super().__init__(f"{file}:{line_no}: {message}")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: seconds since the first request of the trace (float, >= 0).
        context_tokens: prompt length in tokens (int, >= 0).
        generated_tokens: output length in tokens (int, >= 0).
    """

    arrival_s: float
    context_tokens: int
    generated_tokens: int


def _parse_timestamp(text: str) -> tuple[int, float]:
    """``"2023-11-16 18:15:46.6805900"`` -> (whole seconds since the epoch (UTC), fraction in [0, 1)).

    Raises:
        ValueError: not in the form ``YYYY-MM-DD HH:MM:SS[.fraction]`` (1 to 9 fractional digits).
    """
    text = text.strip()
    whole, dot, fraction = text.partition(".")
    if dot and not (1 <= len(fraction) <= 9 and fraction.isdigit()):
        raise ValueError("bad fractional seconds")
    parsed = time.strptime(whole, "%Y-%m-%d %H:%M:%S")
    seconds = calendar.timegm(parsed)
    return seconds, (int(fraction) / 10 ** len(fraction)) if dot else 0.0


def _parse_count(text: str) -> int:
    value = text.strip()
    if not value.isdigit():
        raise ValueError
    return int(value)


def _read(stream: TextIO, file: str, limit: int | None) -> list[TraceRequest]:
    reader = csv.reader(stream)
    header = None
    for row in reader:
        if any(cell.strip() for cell in row):
            header = row
            break
    if header is None:
        raise TraceFormatError(file, 0, f"empty file; expected the header {','.join(HEADER)}")
    names = tuple(cell.strip().lstrip("\ufeff") for cell in header[: len(HEADER)])
    if names != HEADER:
        raise TraceFormatError(
            file, reader.line_num, f"bad header {','.join(header)!r}; expected {','.join(HEADER)!r}"
        )
    requests: list[TraceRequest] = []
    first: tuple[int, float] | None = None
    last_arrival = 0.0
    for row in reader:
        if limit is not None and len(requests) >= limit:
            break
        line_no = reader.line_num
        if not any(cell.strip() for cell in row):
            continue
        if len(row) < len(HEADER):
            raise TraceFormatError(file, line_no, f"expected {len(HEADER)} columns, got {len(row)}: {','.join(row)!r}")
        try:
            stamp = _parse_timestamp(row[0])
        except ValueError:
            raise TraceFormatError(
                file, line_no, f"bad TIMESTAMP {row[0]!r}; expected 'YYYY-MM-DD HH:MM:SS.fffffff'"
            ) from None
        counts = []
        for column, cell in zip(HEADER[1:], row[1:3]):
            try:
                counts.append(_parse_count(cell))
            except ValueError:
                raise TraceFormatError(
                    file, line_no, f"bad {column} {cell!r}; expected a non-negative integer"
                ) from None
        if first is None:
            first = stamp
        arrival = (stamp[0] - first[0]) + (stamp[1] - first[1])
        if arrival < last_arrival:
            raise TraceFormatError(
                file, line_no, f"TIMESTAMP {row[0]!r} is earlier than the line before; expected non-decreasing times"
            )
        last_arrival = arrival
        requests.append(TraceRequest(arrival, counts[0], counts[1]))
    return requests


def load_trace(source: "str | os.PathLike[str]", limit: int | None = None) -> list[TraceRequest]:
    """Load a trace in the Azure LLM inference trace CSV format.

    Args:
        source: ``"conv"`` or ``"code"`` for the packaged 2023 files, or the path of a CSV file.
        limit: read at most this many requests (the first ones), or all when ``None``.

    Returns:
        The requests in file order, ``arrival_s`` relative to the first request.

    Raises:
        TraceFormatError: empty file, bad header, a bad TIMESTAMP or count, times going
            backwards, or a file that is not UTF-8 text; the message names the file, the line
            number and the bad value.
        FileNotFoundError: ``source`` is neither a packaged name nor an existing file.
        ValueError: ``limit`` is not ``None`` or an integer >= 1.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit={limit!r}; expected None or an integer >= 1")
    if isinstance(source, str) and source in PACKAGED_TRACES:
        name = PACKAGED_TRACES[source]
        resource = resources.files("otel_swa.reference").joinpath("data", name)
        with resource.open("r", encoding="utf-8", newline="") as stream:
            return _read(stream, name, limit)
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"trace {path!r} is not a file; expected a CSV path or one of {', '.join(sorted(PACKAGED_TRACES))}"
        )
    with open(path, "r", encoding="utf-8", newline="") as stream:
        try:
            return _read(stream, path, limit)
        except UnicodeDecodeError:
            pass  # its offsets are within the decoder's chunk: found again in the whole file below
    line_no, column, reason = _first_undecodable(path)
    raise TraceFormatError(path, line_no, f"the line is not UTF-8 text ({reason} at byte {column} of the line); "
                                          "write the CSV in UTF-8")


def _first_undecodable(path: str) -> tuple[int, int, str]:
    """``(line, byte, reason)`` of the first byte of file ``path`` that is not UTF-8: its 1-based
    line number (lines ended by LF), its 1-based byte within that line, and the decoder's reason."""
    with open(path, "rb") as stream:
        data = stream.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        return data.count(b"\n", 0, exc.start) + 1, exc.start - line_start + 1, exc.reason
    return 0, 0, "undecodable text"  # pragma: no cover - the text reader found one


def scale_contexts(requests: "list[TraceRequest]", longest: int) -> list[TraceRequest]:
    """The same requests with every prompt stretched by one factor, for long-context runs.

    The factor is the largest that keeps every request's KV length (``context + generated - 1``
    tokens, what the engine holds at its end) within ``longest``; each context becomes
    ``max(1, floor(context x factor))``. Arrival times and generated tokens are unchanged, so the
    trace keeps its mix of prompt lengths and its load over time, only longer: e.g. the first 200
    requests of the conversation trace (prompts up to 4,107 tokens) with ``longest=131072`` get
    prompts up to about 128K tokens.

    Raises:
        ValueError: ``longest`` is not an integer >= 1, or a request generates more than
            ``longest`` tokens (no prompt length fits).
    """
    if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
        raise ValueError(f"longest={longest!r}; expected an integer >= 1 (tokens)")
    factor = None  # exact: no rounding may push the longest request past the limit
    for index, request in enumerate(requests):
        room = longest - max(0, request.generated_tokens - 1)
        if room < 1:
            raise ValueError(
                f"request {index} generates {request.generated_tokens} tokens; no prompt fits in longest={longest}"
            )
        if request.context_tokens > 0:
            ratio = Fraction(room, request.context_tokens)
            factor = ratio if factor is None else min(factor, ratio)
    if factor is None:
        return list(requests)
    return [TraceRequest(r.arrival_s, max(1, r.context_tokens * factor.numerator // factor.denominator),
                         r.generated_tokens) for r in requests]


def write_trace(requests: "list[TraceRequest]", path: "str | os.PathLike[str]", start: str = "2023-11-16 18:15:46") -> None:
    """Write ``requests`` as a CSV file in the Azure trace format (read back by :func:`load_trace`).

    ``TIMESTAMP`` is ``start`` (``YYYY-MM-DD HH:MM:SS``, UTC) plus each ``arrival_s``, with 7
    fractional digits as in the published files.

    Raises:
        ValueError: ``start`` is not in that form.
        OSError: the file cannot be written.
    """
    try:
        base = calendar.timegm(time.strptime(start, "%Y-%m-%d %H:%M:%S"))
    except ValueError:
        raise ValueError(f"start={start!r}; expected 'YYYY-MM-DD HH:MM:SS'") from None
    with open(path, "w", encoding="utf-8", newline="") as stream:
        writer = csv.writer(stream, lineterminator="\n")
        writer.writerow(HEADER)
        for request in requests:
            ticks = round(request.arrival_s * 10**7)
            whole, fraction = divmod(ticks, 10**7)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(base + whole))
            writer.writerow((f"{stamp}.{fraction:07d}", request.context_tokens, request.generated_tokens))
