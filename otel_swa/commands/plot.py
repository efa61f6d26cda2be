"""Draw a run's records against forward_ct: divergence, out-of-window tokens, verify lag per interval.

One row per rank when the log names several (SGLang's ``TP0``, ``DP1 TP0``...). The image format
follows the suffix of ``-o`` (``.png``, ``.svg``, ``.pdf``). Needs matplotlib, the optional extra
``plot`` (``pip install 'otel-swa[plot]'``). Exit status 2 when the input is missing, unreadable or
holds no record, or when matplotlib is not installed.
"""

from __future__ import annotations

import argparse

from otel_swa.commands._loginput import InputError, add_source_argument, error, load_records
from otel_swa.logsource import group_by_rank
from otel_swa.plot import PlotUnavailableError, plot_records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_argument(parser)
    parser.add_argument("-o", "--output", required=True, metavar="IMAGE", help="image file to write (e.g. run.png)")
    parser.add_argument("--title", default=None, help="figure title")


def run(args: argparse.Namespace) -> int:
    try:
        found, malformed = load_records(args.source)
    except InputError as exc:
        return error(str(exc))
    if not found:
        what = "standard input" if args.source == "-" else repr(args.source)
        extra = f" ({malformed} malformed skipped)" if malformed else ""
        return error(f"no kv_canary_swa_divergence record in {what}{extra}; nothing to plot")
    try:
        path = plot_records(group_by_rank(found), args.output, title=args.title)
    except (PlotUnavailableError, ValueError) as exc:
        return error(str(exc))
    except OSError as exc:
        return error(f"cannot write {args.output!r}: {exc.strerror}" if exc.strerror else str(exc))
    ranks = len({item.rank for item in found})
    print(f"wrote {path} ({len(found)} records, {ranks} panel row(s))")
    return 0
