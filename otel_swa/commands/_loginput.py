"""Argument types and input handling shared by ``check``, ``records`` and ``plot``."""

from __future__ import annotations

import argparse
import os
import sys

from otel_swa.commands._args import non_negative_int, positive_seconds, seconds
from otel_swa.commands._output import stdout_closed
from otel_swa.logsource import (
    TEXT_PROBE_BYTES,
    LogFollower,
    LoggedEntry,
    LoggedRecord,
    decode_log,
    logged_entries,
    not_a_text_log,
    read_data,
    split_cut_line,
)
from otel_swa.record import MalformedRecordError

__all__ = [
    "InputError",
    "non_negative_int",
    "seconds",
    "positive_seconds",
    "add_source_argument",
    "load_entries",
    "check_log_start",
    "source_name",
    "unusable_text",
    "load_records",
    "malformed_summary",
    "error",
    "stdout_closed",
]


class InputError(Exception):
    """The input cannot be used (exit status 2); the message says why."""


def add_source_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="FILE|-", help="log file to read, or '-' for standard input")


def source_name(source: str) -> str:
    """The source in words: ``standard input`` for ``-``, else ``log file 'PATH'``."""
    return "standard input" if source == "-" else f"log file {source!r}"


def unusable_text(source: str, data: "bytes | str") -> InputError | None:
    """The error for a source whose content (or its start) ``data`` is empty or not a text log
    (:func:`otel_swa.logsource.not_a_text_log`), else ``None``."""
    why = not_a_text_log(data)
    if why is None:
        return None
    if why == "empty":
        return InputError(f"{source_name(source)} is empty: no log text at all (did the engine log to another "
                          "stream or file?)")
    return InputError(f"{source_name(source)} is {why}")


def load_entries(source: str) -> tuple[list[LoggedEntry], list[MalformedRecordError]]:
    """The records and run start markers of a complete log, and the malformed lines skipped.

    A regular file is read in chunks (:class:`otel_swa.logsource.LogFollower`: the text held at
    once is one chunk), standard input and a pipe whole. A last line cut in the middle
    (:func:`otel_swa.logsource.split_cut_line`: a log still being written) is left out, and one
    line on stderr says so (``otel-swa: log file 'run.log': the last line (19) has no line end and
    cannot be read (...); read without it``).

    Raises:
        InputError: the file is missing or cannot be read, is empty, or is not a text log.
    """
    if source != "-" and os.path.isfile(source):  # a pipe (`records <(engine ...)`) is read once, whole
        return _load_file(source)
    errors: list[MalformedRecordError] = []
    try:
        data = read_data(source)
    except FileNotFoundError:
        raise InputError(f"log file {source!r} does not exist") from None
    except OSError as exc:
        raise InputError(f"{source_name(source)} cannot be read: {exc.strerror or exc}") from None
    problem = unusable_text(source, data)
    if problem is not None:
        raise problem
    text, cut = split_cut_line(decode_log(data))
    if cut is not None:
        print(f"otel-swa: {source_name(source)}: {cut.describe()}", file=sys.stderr)
    return logged_entries(text, errors=errors), errors


def check_log_start(path: str, source: str | None = None) -> None:
    """Refuse the regular file at ``path`` when it is missing or unreadable, empty (blanks only),
    or not a text log, from its first bytes (``source``: what the messages name, ``"-"`` for
    standard input copied to ``path``; default the file).

    Raises:
        InputError: the message says which.
    """
    try:
        with open(path, "rb") as stream:
            head = stream.read(TEXT_PROBE_BYTES)
            longer = bool(stream.read(1))
    except FileNotFoundError:
        raise InputError(f"log file {path!r} does not exist") from None
    except OSError as exc:
        raise InputError(f"{source_name(path)} cannot be read: {exc.strerror or exc}") from None
    problem = None if longer and not head.strip() else unusable_text(source or path, head)  # blanks first, text later
    if problem is not None:
        raise problem


def _load_file(path: str) -> tuple[list[LoggedEntry], list[MalformedRecordError]]:
    check_log_start(path)
    follower = LogFollower(path)
    follower.poll(final=True)
    if follower.missing or follower.error is not None:
        why = "it was removed" if follower.missing else (follower.error.strerror or str(follower.error))
        raise InputError(f"{source_name(path)} cannot be read: {why}")
    if follower.cut_line is not None:
        print(f"otel-swa: {source_name(path)}: {follower.cut_line.describe()}", file=sys.stderr)
    return follower.entries, follower.errors


def load_records(source: str) -> tuple[list[LoggedRecord], int]:
    """The records of a complete log and the number of malformed lines skipped.

    Raises:
        InputError: the file is missing or cannot be read, is empty, or is not a text log.
    """
    entries, errors = load_entries(source)
    return [entry for entry in entries if isinstance(entry, LoggedRecord)], len(errors)


def malformed_summary(errors: list[MalformedRecordError], verbose: bool) -> list[str]:
    """Lines for stderr about the malformed lines skipped: the count and the first reason (every
    one with ``verbose``)."""
    if not errors:
        return []
    shown = errors if verbose else errors[:1]
    lines = [f"otel-swa: {len(errors)} malformed line(s) skipped"]
    lines += [f"otel-swa:   line {e.line_no}: {e.reason}" for e in shown]
    if len(errors) > len(shown):
        lines.append("otel-swa:   ... (--verbose lists them all)")
    return lines


def error(message: str) -> int:
    """Print ``otel-swa: error: message`` on stderr; return exit status 2."""
    print(f"otel-swa: error: {message}", file=sys.stderr)
    return 2
