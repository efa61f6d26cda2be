"""Print the records of a log as JSON lines or CSV, with their line number, timestamp and rank.

Columns, in order: ``line_no`` (1-based line of the log), ``timestamp`` (the log prefix's time as
written there, empty/null when absent), ``rank`` (SGLang's rank tokens such as ``DP1 TP0``, empty/null
when absent), then the five record fields in SGLang's order. Malformed records are skipped and counted
on stderr. Exit status 2 when the file is missing or unreadable.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

from otel_swa.commands._loginput import InputError, add_source_argument, error, load_records, stdout_closed
from otel_swa.logsource import ROW_FIELDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_argument(parser)
    parser.add_argument("--format", choices=("jsonl", "csv"), default="jsonl",
                        help="jsonl: one JSON object per record (default); csv: a header row, then one row per record")


def run(args: argparse.Namespace) -> int:
    try:
        found, malformed = load_records(args.source)
    except InputError as exc:
        return error(str(exc))
    try:
        out = sys.stdout
        if args.format == "csv":
            writer = csv.DictWriter(out, fieldnames=ROW_FIELDS, lineterminator="\n")
            writer.writeheader()
            for item in found:
                writer.writerow({k: ("" if v is None else v) for k, v in item.to_row().items()})
        else:
            for item in found:
                out.write(json.dumps(item.to_row(), separators=(",", ":")) + "\n")
        out.flush()
    except BrokenPipeError:
        return stdout_closed()
    if malformed:
        print(f"otel-swa: {malformed} malformed record(s) skipped", file=sys.stderr)
    return 0
