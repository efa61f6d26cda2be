"""Draw a run's records against forward_ct: divergence, out-of-window tokens, verify lag per interval.

One row per rank when the log names several (SGLang's ``TP0``, ``DP1 TP0``...), and one per run when
several runs wrote the log (``run 2 TP0``; runs as ``otel-swa check`` counts them, see
:mod:`otel_swa.testing.runs`), so that a restarted run is a row of its own, never a zig-zag drawn
back to its start. ``--run last`` draws the last run only. When otel-swa's tagged lines and
SGLang's own lines are both in the log, otel-swa's are drawn. A complete regular file is read once
(:func:`~otel_swa.commands._streamed.stream_runs`, as ``otel-swa records`` reads it; read whole
where only the whole log can split its runs) and each row is kept as a
:class:`~otel_swa.plot.RowEnvelope`: every point up to :data:`~otel_swa.plot.ENVELOPE_CAPACITY`
records, then the minimum and maximum per bucket of forward steps, drawn as such and said so above
the row; memory is bounded by the runs and ranks, not the records (79 - 81 MiB peak from 20,000 to
400,000 records of ``benchmarks/bench_plot_long_log.py``'s log, where the whole read took 103 -
737 MiB). The image format follows the suffix of
``-o`` (``.png``, ``.svg``, ``.pdf``). Needs matplotlib, the optional extra ``plot`` (``pip install
'otel-swa[plot]'``). Exit status 2 when the input is missing, unreadable, empty, not a text log or
holds no record, when
the rows would be too many to read (more than :data:`MAX_ROWS`), or when matplotlib is not installed, or when standard output cannot be written (a full disk).
"""

from __future__ import annotations

import argparse
import os
from typing import Iterable

from otel_swa.commands._loginput import InputError, add_source_argument, check_log_start, error, load_entries
from otel_swa.commands._output import print_result
from otel_swa.commands._streamed import stream_runs
from otel_swa.plot import ENVELOPE_CAPACITY, PlotUnavailableError, RowEnvelope, plot_records
from otel_swa.testing.runs import OTEL_SWA_LINES, RunRecord, split_runs

#: Most panel rows drawn in one image.
MAX_ROWS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_argument(parser)
    parser.add_argument("-o", "--output", required=True, metavar="IMAGE", help="image file to write (e.g. run.png)")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument("--run", dest="runs", choices=("each", "last"), default="each",
                        help="draw every run of the log, one row each (default), or the last one only")


def _labels(keys: Iterable[tuple], runs: str) -> dict:
    """The row label of each ``(writer, run, rank)`` drawn, in the order given (the order of their
    first records): otel-swa's lines when both writers are present, the last run with ``runs ==
    "last"``; ``"run 2 TP0"`` when several runs are drawn, else the rank (``None``: no rank)."""
    keys = list(keys)
    if len({writer for writer, _, _ in keys}) > 1:
        keys = [key for key in keys if key[0] == OTEL_SWA_LINES]
    last = max((run for _, run, _ in keys), default=0)
    if runs == "last":
        keys = [key for key in keys if key[1] == last]
    several = runs == "each" and last > 1
    return {(writer, run, rank): " ".join(p for p in (f"run {run}" if several else None, rank) if p) or None
            for writer, run, rank in keys}


def rows_of(entries: list, runs: str = "each") -> dict:
    """The records to draw per row label (``"run 2 TP0"``, ``"TP1"``, ``None`` for one row without
    rank), otel-swa's lines when present, else SGLang's; in log order."""
    items = split_runs(entries)
    labels = _labels(dict.fromkeys((item.writer, item.run, item.rank) for item in items), runs)
    rows: dict = {}
    for item in items:
        key = (item.writer, item.run, item.rank)
        if key in labels:
            rows.setdefault(labels[key], []).append(item.record)
    return rows


def streamed_rows(path: str, runs: str = "each") -> tuple[dict, list] | None:
    """The rows of the complete regular file at ``path`` read once, as :func:`rows_of` labels them,
    each a :class:`~otel_swa.plot.RowEnvelope` fed as its records are read (memory bounded by the
    runs and ranks, not the records), and the malformed lines skipped; ``None`` when the log must
    be read whole (see :func:`~otel_swa.commands._streamed.stream_runs`)."""
    envelopes: dict = {}

    def on_record(entry: object, item: RunRecord) -> None:
        key = (item.writer, item.run, item.rank)
        row = envelopes.get(key)
        if row is None:
            row = envelopes[key] = RowEnvelope()
        row.add(item.record)

    follower = stream_runs(path, on_record)
    if follower is None:
        return None
    return {label: envelopes[key] for key, label in _labels(envelopes, runs).items()}, list(follower.errors)


def run(args: argparse.Namespace) -> int:
    rows = None
    if args.source != "-" and os.path.isfile(args.source):  # a regular file: read once, each row kept bounded
        try:
            check_log_start(args.source)
        except InputError as exc:
            return error(str(exc))
        rows = streamed_rows(args.source, args.runs)
    if rows is not None:
        rows, errors = rows
    else:
        try:
            entries, errors = load_entries(args.source)
        except InputError as exc:
            return error(str(exc))
        rows = {label: RowEnvelope.of(records, ENVELOPE_CAPACITY)  # as the streamed read keeps them
                for label, records in rows_of(entries, args.runs).items()}
    records = sum(row.count for row in rows.values())
    if not records:
        what = "standard input" if args.source == "-" else repr(args.source)
        extra = f" ({len(errors)} malformed skipped)" if errors else ""
        return error(f"no kv_canary_swa_divergence record in {what}{extra}; nothing to plot")
    if len(rows) > MAX_ROWS:
        return error(f"{len(rows)} panel rows (runs x ranks) are too many for one image (at most {MAX_ROWS}); "
                     "draw the last run with --run last, or split the log")
    try:
        path = plot_records(rows, args.output, title=args.title)
    except (PlotUnavailableError, ValueError) as exc:
        return error(str(exc))
    except OSError as exc:
        return error(f"cannot write {args.output!r}: {exc.strerror}" if exc.strerror else str(exc))
    failed = print_result(f"wrote {path} ({records} records, {len(rows)} panel row(s))")
    return 2 if failed is not None else 0
