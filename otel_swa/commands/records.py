"""Print the records of a log as JSON lines or CSV, with their line number, timestamp, rank and run.

Columns, in order: ``line_no`` (1-based line of the log), ``timestamp`` (the log prefix's time as
written there, empty/null when absent), ``rank`` (SGLang's rank tokens such as ``DP1 TP0``, empty/null
when absent), ``run`` (1-based run of the log, counted per writer: see
:mod:`otel_swa.testing.runs`), ``verify_source`` (otel-swa's tag; empty/null for SGLang's own lines),
the five record fields in SGLang's order, the audit line's fields (:data:`otel_swa.record.AUDIT_FIELDS`,
empty/null when the record has no audit line), ``micro_batch`` (the pipeline micro-batch sampled;
empty/null without one), ``offenders`` (the first offender of each fault, as JSON), then the
provenance line's fields (:data:`otel_swa.record.PROVENANCE_FIELDS`; empty/null when the record
has no provenance line).
Malformed lines are skipped and counted on stderr with the first reason (every one with
``--verbose``).

Numbers are written exactly, as decimal integers (up to 2**63 - 1). Some readers round integers
above 2**53 (JavaScript's ``JSON.parse`` and viewers built on it, jq 1.6); pandas, Python's ``json``
and ``csv`` keep them. Exit status 2 when the file is missing, unreadable, empty or not a text log,
or when it holds malformed records and no valid one, or when standard output cannot be written (a
full disk: one line on stderr); a reader that closes the pipe is not an error. A text log without
any record is no error: nothing is printed (CSV: the header).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import tempfile
from typing import IO, Callable

from otel_swa.commands._loginput import (
    InputError,
    add_source_argument,
    check_log_start,
    error,
    load_entries,
    malformed_summary,
    source_name,
    stdout_closed,
)
from otel_swa.commands._output import discard_stdout
from otel_swa.commands._streamed import stream_runs
from otel_swa.logsource import ROW_FIELDS, LoggedRecord
from otel_swa.testing.runs import RunRecord, split_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_argument(parser)
    parser.add_argument("--format", choices=("jsonl", "csv"), default="jsonl",
                        help="jsonl: one JSON object per record (default); csv: a header row, then one row per record")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list every malformed line with its number and reason (default: the first)")


def _row_writer(out: IO[str], fmt: str) -> Callable[[LoggedRecord, int], None]:
    """A function writing one record's row (with its run) to ``out`` in format ``fmt`` (the CSV
    header written first)."""
    if fmt == "csv":
        writer = csv.DictWriter(out, fieldnames=ROW_FIELDS, lineterminator="\n")
        writer.writeheader()
        return lambda item, run: writer.writerow(
            {k: ("" if v is None else _compact(v) if isinstance(v, list) else v) for k, v in item.to_row(run).items()})
    return lambda item, run: out.write(_compact(item.to_row(run)) + "\n")


#: Compact JSON (what ``json.dumps(value, separators=(",", ":"))`` writes, one encoder for every row).
_compact = json.JSONEncoder(separators=(",", ":")).encode


def _no_valid_record(args: argparse.Namespace, errors: list) -> int:
    for line in malformed_summary(errors, args.verbose):
        print(line, file=sys.stderr)
    return error(f"no valid record in {source_name(args.source)}: its {len(errors)} record line(s) are all malformed")


def _print_rows(args: argparse.Namespace, write_rows: Callable[[IO[str]], None], errors: list) -> int:
    try:
        out = sys.stdout
        write_rows(out)
        out.flush()
    except BrokenPipeError:
        return stdout_closed()
    except OSError as exc:
        discard_stdout()
        print(f"otel-swa: cannot write to standard output: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for line in malformed_summary(errors, args.verbose):
        print(line, file=sys.stderr)
    return 0


def _streamed(args: argparse.Namespace) -> int | None:
    """Print the rows of a complete regular file read once (:func:`~otel_swa.commands._streamed.stream_runs`),
    each row formatted as its record is read and kept in a temporary file (not in memory) until the
    log's runs are known to be split as :func:`~otel_swa.testing.runs.split_runs` splits the whole
    log; ``None`` when they need the whole log (lines of several processes at once, a record that
    fits no rank, a line written far from its record) or the file could not be read to its end:
    then it is read whole."""
    with tempfile.TemporaryFile("w+", encoding="utf-8", newline="") as rows:
        write = _row_writer(rows, args.format)
        count = 0

        def on_record(entry: LoggedRecord, item: RunRecord) -> None:
            nonlocal count
            count += 1
            write(entry, item.run)

        follower = stream_runs(args.source, on_record)
        if follower is None:
            return None
        errors = list(follower.errors)
        if not count and errors:  # records there were, and none could be read
            return _no_valid_record(args, errors)
        rows.seek(0)
        return _print_rows(args, lambda out: shutil.copyfileobj(rows, out), errors)


def run(args: argparse.Namespace) -> int:
    if args.source != "-" and os.path.isfile(args.source):  # a regular file: read once, rows kept on disk
        try:
            check_log_start(args.source)
        except InputError as exc:
            return error(str(exc))
        done = _streamed(args)
        if done is not None:
            return done
    try:
        entries, errors = load_entries(args.source)
    except InputError as exc:
        return error(str(exc))
    records = [entry for entry in entries if isinstance(entry, LoggedRecord)]
    if not records and errors:  # records there were, and none could be read
        return _no_valid_record(args, errors)
    runs = [item.run for item in split_runs(entries)]

    def write_rows(out: IO[str]) -> None:
        write = _row_writer(out, args.format)
        for item, run in zip(records, runs):
            write(item, run)

    return _print_rows(args, write_rows, errors)
