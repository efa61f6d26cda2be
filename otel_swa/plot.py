"""A picture of a run: the records of each rank against ``forward_ct``.

One row per label: a rank, or a run and a rank when several runs wrote the log (``"run 2 TP0"``,
as ``otel-swa plot`` labels them, so a restarted run is a row of its own instead of a line drawn
back to its start). One row when the log names no rank; when only some lines name a rank, the
lines without one get their own row, labelled "no rank". Two panels per row:

* left: ``swa_full_idx_divergence`` and ``swa_out_of_window_tokens`` at each sampled forward step,
  unit ``{token}``;
* right: the verify lag per interval, ``Δ(verify_full - verify_swa)`` between consecutive records of
  the rank, unit ``{entry}``: how many fewer KV entries the SWA pool checked than the FULL pool over
  that interval (the memory the sliding window saves in reads). Drawn as steps spanning the
  interval; a record whose ``forward_ct`` does not exceed the previous one (a restarted reporter)
  starts a new series and has no lag point.

matplotlib is the optional extra ``plot`` (``pip install 'otel-swa[plot]'``); it is imported only
when a figure is drawn, through its object API with the Agg canvas, so the caller's pyplot state
and backend are left alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from otel_swa.record import SwaDivergenceRecord

__all__ = [
    "PlotUnavailableError",
    "PLOT_INSTALL_HINT",
    "verify_lag_per_interval",
    "image_suffixes",
    "check_image_path",
    "plot_records",
]

#: The command that installs what :func:`plot_records` needs.
PLOT_INSTALL_HINT = "pip install 'otel-swa[plot]'"


class PlotUnavailableError(ImportError):
    """matplotlib is not installed; the message gives the pip command."""


def verify_lag_per_interval(records: Sequence[SwaDivergenceRecord]) -> list[tuple[int, int, int]]:
    """The verify lag of each interval between consecutive records of one rank.

    Returns:
        ``(start_forward_ct, end_forward_ct, lag)`` per pair of consecutive records whose
        ``forward_ct`` increases, with ``lag = (full_b - swa_b) - (full_a - swa_a)`` in KV entries
        (it can be negative only if the counters were reset without ``forward_ct`` going back).
    """
    out: list[tuple[int, int, int]] = []
    for prev, cur in zip(records, records[1:]):
        if cur.forward_ct <= prev.forward_ct:
            continue
        lag = (cur.verify_full - cur.verify_swa) - (prev.verify_full - prev.verify_swa)
        out.append((prev.forward_ct, cur.forward_ct, lag))
    return out


def _import_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailableError(
            f"drawing a plot needs matplotlib, which is not installed ({exc}); install it with: {PLOT_INSTALL_HINT}"
        ) from exc
    return Figure, FigureCanvasAgg


def image_suffixes() -> list[str]:
    """The file suffixes matplotlib can write (``[".eps", ".jpg", ".pdf", ".png", ".svg", ...]``), sorted.

    Raises:
        PlotUnavailableError: matplotlib is not installed.
    """
    _, FigureCanvasAgg = _import_matplotlib()
    return sorted("." + name for name in FigureCanvasAgg.get_supported_filetypes())


def check_image_path(path: str | os.PathLike[str]) -> Path:
    """Check, before any drawing, that an image can be written at ``path``.

    The suffix must be one matplotlib writes and the folder must exist. A path without a suffix gets
    ``.png`` (as matplotlib would append it).

    Returns:
        the path the image will have, as a :class:`~pathlib.Path`.

    Raises:
        PlotUnavailableError: matplotlib is not installed.
        ValueError: the suffix is not an image format; the message lists the ones that work.
        FileNotFoundError: the folder does not exist (``NotADirectoryError``: it is a file).
    """
    out = Path(path)
    if not out.suffix:
        out = out.with_name(out.name + ".png")
    suffixes = image_suffixes()
    if out.suffix and out.suffix.lower() not in suffixes:
        raise ValueError(
            f"cannot write {os.fspath(path)!r}: {out.suffix!r} is not an image format matplotlib writes; "
            f"use one of {', '.join(suffixes)}"
        )
    folder = out.parent
    if not folder.exists():
        raise FileNotFoundError(f"cannot write {os.fspath(path)!r}: the folder {os.fspath(folder)!r} does not exist")
    if not folder.is_dir():
        raise NotADirectoryError(f"cannot write {os.fspath(path)!r}: {os.fspath(folder)!r} is not a folder")
    return out


#: Row label of the records without a rank in a log where other lines name one.
NO_RANK_LABEL = "no rank"


def _row_label(rank: str | None, any_named: bool) -> str:
    if rank is not None:
        return f"{rank}\n"
    return f"{NO_RANK_LABEL}\n" if any_named else ""


def plot_records(
    records_by_rank: Mapping[str | None, Sequence[SwaDivergenceRecord]] | Sequence[SwaDivergenceRecord],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    dpi: int = 110,
) -> Path:
    """Draw the run and write it to ``path`` (format from the suffix: ``.png``, ``.svg``, ``.pdf``...).

    Args:
        records_by_rank: the records of each row in log order, keyed by row label (``"TP0"``,
            ``"DP1 TP0"``, ``"run 2 TP0"``; ``None`` for a log without ranks), e.g. from
            :func:`otel_swa.logsource.group_by_rank`; a plain sequence of records is one row.
        path: the image file to write; its folder must exist.
        title: the figure title (default: counts of records and ranks).
        dpi: resolution of raster formats.

    Returns:
        the path written, as a :class:`~pathlib.Path` (``.png`` appended when ``path`` has no suffix).

    Raises:
        PlotUnavailableError: matplotlib is not installed (an ``ImportError``; the message gives
            :data:`PLOT_INSTALL_HINT`).
        ValueError: there is no record to draw, or the suffix of ``path`` is no image format (the
            message lists those that work; see :func:`check_image_path`).
        TypeError: an item is not a :class:`~otel_swa.record.SwaDivergenceRecord`.
        OSError: the file cannot be written.
    """
    if not isinstance(records_by_rank, Mapping):
        records_by_rank = {None: list(records_by_rank)}
    ranks = [(rank, list(records)) for rank, records in records_by_rank.items() if len(records)]
    for rank, records in ranks:
        for record in records:
            if not isinstance(record, SwaDivergenceRecord):
                raise TypeError(f"rank {rank!r}: expected SwaDivergenceRecord items, got {type(record).__name__}")
    if not ranks:
        raise ValueError("no record to plot: every rank is empty")
    Figure, FigureCanvasAgg = _import_matplotlib()
    out = check_image_path(path)

    total = sum(len(records) for _, records in ranks)
    named = [rank for rank, _ in ranks if rank is not None]
    fig = Figure(figsize=(12, 1.2 + 2.9 * len(ranks)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(ranks), 2, sharex=True, squeeze=False)
    for row, (rank, records) in enumerate(ranks):
        ax_tokens, ax_lag = axes[row]
        x = [r.forward_ct for r in records]
        marker = "o" if len(records) <= 60 else None
        ax_tokens.plot(x, [r.swa_full_idx_divergence for r in records], marker=marker, markersize=3,
                       color="tab:blue", label="swa_full_idx_divergence")
        ax_tokens.plot(x, [r.swa_out_of_window_tokens for r in records], marker=marker, markersize=3,
                       color="tab:orange", label="swa_out_of_window_tokens")
        ax_tokens.set_ylabel(f"{_row_label(rank, bool(named))}tokens at sampled step")
        peak = max(max(r.swa_full_idx_divergence, r.swa_out_of_window_tokens) for r in records)
        ax_tokens.set_ylim(0, max(peak, 1) * 1.25)  # headroom for the legend
        ax_tokens.grid(True, alpha=0.3)

        lags = verify_lag_per_interval(records)
        if lags:
            edges = [lags[0][0]] + [end for _, end, _ in lags]
            values = [lag for _, _, lag in lags]
            ax_lag.stairs(values, edges, fill=True, alpha=0.35, color="tab:green")
            ax_lag.stairs(values, edges, color="tab:green")
        else:
            ax_lag.text(0.5, 0.5, "fewer than 2 records: no interval", ha="center", va="center",
                        transform=ax_lag.transAxes, color="gray")
        ax_lag.set_ylabel("KV entries per interval")
        ax_lag.grid(True, alpha=0.3)
        if row == 0:
            ax_tokens.set_title("divergence and out-of-window tokens")
            ax_lag.set_title("verify lag per interval: Δ(verify_full − verify_swa)")
            ax_tokens.legend(loc="upper left", ncols=2, fontsize="small")
    for ax in axes[-1]:
        ax.set_xlabel("forward_ct (forward steps)")
    # rows, not named ranks: lines without a rank, next to ranked ones, are a row of their own
    rank_note = f", {len(ranks)} row{'s' if len(ranks) != 1 else ''}" if named else ""
    fig.suptitle(title or f"SWA KV cache over a run: {total} record{'s' if total != 1 else ''}{rank_note}")
    fig.savefig(out, dpi=dpi)
    return out
