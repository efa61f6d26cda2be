"""Argument types and input handling shared by ``check``, ``records`` and ``plot``."""

from __future__ import annotations

import argparse
import sys

from otel_swa.commands._args import non_negative_int, positive_seconds, seconds
from otel_swa.commands._output import stdout_closed
from otel_swa.logsource import LoggedRecord, read_log
from otel_swa.record import MalformedRecordError

__all__ = [
    "InputError",
    "non_negative_int",
    "seconds",
    "positive_seconds",
    "add_source_argument",
    "load_records",
    "error",
    "stdout_closed",
]


class InputError(Exception):
    """The input cannot be used (exit status 2); the message says why."""


def add_source_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="FILE|-", help="log file to read, or '-' for standard input")


def load_records(source: str) -> tuple[list[LoggedRecord], int]:
    """The records of a complete log and the number of malformed ones skipped.

    Raises:
        InputError: the file is missing or cannot be read.
    """
    errors: list[MalformedRecordError] = []
    try:
        found = read_log(source, errors=errors)
    except FileNotFoundError:
        raise InputError(f"log file {source!r} does not exist") from None
    except OSError as exc:
        raise InputError(f"log file {source!r} cannot be read: {exc.strerror or exc}") from None
    return found, len(errors)


def error(message: str) -> int:
    """Print ``otel-swa: error: message`` on stderr; return exit status 2."""
    print(f"otel-swa: error: {message}", file=sys.stderr)
    return 2
