"""Draw a run's records against forward_ct: divergence, out-of-window tokens, verify lag per interval.

One row per rank when the log names several (SGLang's ``TP0``, ``DP1 TP0``...), and one per run when
several runs wrote the log (``run 2 TP0``; runs as ``otel-swa check`` counts them, see
:mod:`otel_swa.testing.runs`), so that a restarted run is a row of its own, never a zig-zag drawn
back to its start. ``--run last`` draws the last run only. When otel-swa's tagged lines and
SGLang's own lines are both in the log, otel-swa's are drawn. The image format follows the suffix of
``-o`` (``.png``, ``.svg``, ``.pdf``). Needs matplotlib, the optional extra ``plot`` (``pip install
'otel-swa[plot]'``). Exit status 2 when the input is missing, unreadable, empty, not a text log or
holds no record, when
the rows would be too many to read (more than :data:`MAX_ROWS`), or when matplotlib is not installed, or when standard output cannot be written (a full disk).
"""

from __future__ import annotations

import argparse

from otel_swa.commands._loginput import InputError, add_source_argument, error, load_entries
from otel_swa.commands._output import print_result
from otel_swa.plot import PlotUnavailableError, plot_records
from otel_swa.testing.runs import OTEL_SWA_LINES, split_runs

#: Most panel rows drawn in one image.
MAX_ROWS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_argument(parser)
    parser.add_argument("-o", "--output", required=True, metavar="IMAGE", help="image file to write (e.g. run.png)")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument("--run", dest="runs", choices=("each", "last"), default="each",
                        help="draw every run of the log, one row each (default), or the last one only")


def rows_of(entries: list, runs: str = "each") -> dict:
    """The records to draw per row label (``"run 2 TP0"``, ``"TP1"``, ``None`` for one row without
    rank), otel-swa's lines when present, else SGLang's; in log order."""
    items = split_runs(entries)
    writers = {item.writer for item in items}
    if len(writers) > 1:
        items = [item for item in items if item.writer == OTEL_SWA_LINES]
    last = max((item.run for item in items), default=0)
    if runs == "last":
        items = [item for item in items if item.run == last]
    several = runs == "each" and last > 1
    rows: dict = {}
    for item in items:
        label = " ".join(p for p in (f"run {item.run}" if several else None, item.rank) if p) or None
        rows.setdefault(label, []).append(item.record)
    return rows


def run(args: argparse.Namespace) -> int:
    try:
        entries, errors = load_entries(args.source)
    except InputError as exc:
        return error(str(exc))
    rows = rows_of(entries, args.runs)
    records = sum(len(r) for r in rows.values())
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
