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

A row of more records than :data:`ENVELOPE_CAPACITY` (a long log read by ``otel-swa plot``) can be
given as a :class:`RowEnvelope`, fed one record at a time in bounded memory: it keeps the minimum and
maximum of each series per bucket of forward steps, and the figure draws those (lines through the
minimum and maximum points, the lag as a band from its minimum to its maximum) and says so above the
row ("min and max per 128 forward steps"). Peaks are kept exactly; no point is drawn that was not
measured.

matplotlib is the optional extra ``plot`` (``pip install 'otel-swa[plot]'``); it is imported only
when a figure is drawn, through its object API with the Agg canvas, so the caller's pyplot state
and backend are left alone.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping, Sequence

from otel_swa.record import SwaDivergenceRecord

__all__ = [
    "PlotUnavailableError",
    "PLOT_INSTALL_HINT",
    "verify_lag_per_interval",
    "ENVELOPE_CAPACITY",
    "RowEnvelope",
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
    return RowEnvelope.of(records)._lags  # every interval: the envelope's rule, never reduced


#: Records a :class:`RowEnvelope` keeps every point of; past it, the minimum and maximum per bucket.
ENVELOPE_CAPACITY = 2048

# the extremes of one bucket: [value, forward_ct] per slot, None where no value fell in it yet
_DIV_MIN, _DIV_MAX, _OOW_MIN, _OOW_MAX, _LAG_MIN, _LAG_MAX = range(6)
_SERIES = ("swa_full_idx_divergence", "swa_out_of_window_tokens")


def _keep(bucket: list, slot: int, value: int, ct: int, lower: bool) -> None:
    held = bucket[slot]
    if held is None or (value < held[0] if lower else value > held[0]):
        bucket[slot] = (value, ct)


def _merged(a: list | None, b: list | None) -> list | None:
    """The extremes of two adjacent buckets, ``a`` the lower (it wins ties)."""
    if a is None or b is None:
        return a if b is None else b
    out = []
    for slot in range(6):
        x, y = a[slot], b[slot]
        lower = slot % 2 == 0
        out.append(x if y is None or (x is not None and (x[0] <= y[0] if lower else x[0] >= y[0])) else y)
    return out


class RowEnvelope:
    """The points of one row of the figure, fed one record at a time, in bounded memory.

    Up to ``capacity`` records it keeps every point: ``forward_ct``, ``swa_full_idx_divergence``
    and ``swa_out_of_window_tokens`` (unit ``{token}``) of each record, and the verify lag of each
    interval between consecutive records (:func:`verify_lag_per_interval`: a pair whose
    ``forward_ct`` does not increase has none). Past it, the row is *reduced*: forward steps are
    cut into buckets of :attr:`width` steps (``forward_ct // width``), and each bucket keeps the
    minimum and maximum of each series with the ``forward_ct`` where each occurred (the lag at the
    ``forward_ct`` that ends its interval; on a tie the earlier point, or the lower bucket's on a
    merge). The width starts at 1 and doubles, adjacent buckets merged, whenever more than
    ``capacity`` buckets would hold values: at most ``capacity`` buckets of 6 extremes, whatever
    the number of records. Minima and maxima, hence peaks, are exact.

    Args:
        capacity: records kept exactly, and buckets at most past them (``None``: every point,
            never reduced).

    Attributes:
        count: records fed.
        width: forward steps per bucket; ``0`` while every point is kept.
    """

    def __init__(self, capacity: int | None = ENVELOPE_CAPACITY) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.count = 0
        self.width = 0
        self._points: list[tuple[int, int, int]] = []  # (forward_ct, divergence, out of window) while exact
        self._lags: list[tuple[int, int, int]] = []  # (start, end, lag) while exact
        self._buckets: dict[int, list] = {}
        self._prev: tuple[int, int] | None = None  # (forward_ct, verify_full - verify_swa) of the last record
        self._lag_span: list[int] | None = None  # [first start, last end] of the lag intervals

    @classmethod
    def of(cls, records: Sequence[SwaDivergenceRecord], capacity: int | None = None) -> "RowEnvelope":
        """An envelope fed ``records`` (every point kept by default)."""
        row = cls(capacity)
        for record in records:
            row.add(record)
        return row

    @property
    def reduced(self) -> bool:
        """Whether the row holds minima and maxima per bucket instead of every point."""
        return self.width > 0

    def add(self, record: SwaDivergenceRecord) -> None:
        """Feed the next record of the row (log order).

        Raises:
            TypeError: ``record`` is not a :class:`~otel_swa.record.SwaDivergenceRecord`.
        """
        if not isinstance(record, SwaDivergenceRecord):
            raise TypeError(f"expected SwaDivergenceRecord items, got {type(record).__name__}")
        ct, held = record.forward_ct, record.verify_full - record.verify_swa
        lag = None
        if self._prev is not None and ct > self._prev[0]:
            lag = (self._prev[0], ct, held - self._prev[1])
        self._prev = (ct, held)
        self.count += 1
        if not self.width:
            self._points.append((ct, record.swa_full_idx_divergence, record.swa_out_of_window_tokens))
            if lag is not None:
                self._lags.append(lag)
            if self.capacity is not None and self.count > self.capacity:
                self._reduce()
            return
        self._bucket_point(ct, record.swa_full_idx_divergence, record.swa_out_of_window_tokens)
        if lag is not None:
            self._bucket_lag(*lag)
        if len(self._buckets) > self.capacity:
            self._widen()

    def _bucket(self, ct: int) -> list:
        key = ct // self.width
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = [None] * 6
        return bucket

    def _bucket_point(self, ct: int, divergence: int, out_of_window: int) -> None:
        bucket = self._bucket(ct)
        _keep(bucket, _DIV_MIN, divergence, ct, True)
        _keep(bucket, _DIV_MAX, divergence, ct, False)
        _keep(bucket, _OOW_MIN, out_of_window, ct, True)
        _keep(bucket, _OOW_MAX, out_of_window, ct, False)

    def _bucket_lag(self, start: int, end: int, lag: int) -> None:
        bucket = self._bucket(end)
        _keep(bucket, _LAG_MIN, lag, end, True)
        _keep(bucket, _LAG_MAX, lag, end, False)
        span = self._lag_span
        if span is None:
            self._lag_span = [start, end]
        else:
            span[0], span[1] = min(span[0], start), max(span[1], end)

    def _reduce(self) -> None:
        self.width = 1
        for point in self._points:
            self._bucket_point(*point)
        for lag in self._lags:
            self._bucket_lag(*lag)
        self._points, self._lags = [], []
        self._widen()

    def _widen(self) -> None:
        while len(self._buckets) > self.capacity:
            self.width *= 2
            merged: dict[int, list] = {}
            for key in sorted(self._buckets):
                half = key // 2
                merged[half] = _merged(merged.get(half), self._buckets[key])
            self._buckets = merged

    def series(self) -> dict[str, tuple[list[int], list[int]]]:
        """The points drawn for each of ``swa_full_idx_divergence`` and
        ``swa_out_of_window_tokens``: ``(forward_ct list, value list)``; every point in log order,
        or, reduced, each bucket's minimum and maximum points in ``forward_ct`` order."""
        if not self.width:
            x = [p[0] for p in self._points]
            return {name: (x, [p[i] for p in self._points]) for i, name in enumerate(_SERIES, 1)}
        out = {}
        for name, lo in zip(_SERIES, (_DIV_MIN, _OOW_MIN)):
            held = (bucket[slot] for bucket in self._buckets.values() for slot in (lo, lo + 1))
            points = sorted({(ct, value) for value, ct in (h for h in held if h is not None)})
            out[name] = ([ct for ct, _ in points], [v for _, v in points])
        return out

    def lag_steps(self) -> tuple[list[float], list[int], list[float] | None] | None:
        """The verify lag drawn as steps: ``(values, edges, baseline)`` for ``Axes.stairs``;
        ``None`` without an interval. Every interval's lag over its span (baseline ``None``), or,
        reduced, the maximum per bucket over its span (clipped to the intervals' extent) with the
        minimum as baseline, ``nan`` over buckets without an interval."""
        if not self.width:
            if not self._lags:
                return None
            return [lag for _, _, lag in self._lags], [self._lags[0][0]] + [end for _, end, _ in self._lags], None
        keys = sorted(k for k, b in self._buckets.items() if b[_LAG_MIN] is not None)
        if not keys:
            return None
        width, (first, last) = self.width, self._lag_span
        edges = [max(keys[0] * width, first)]
        highs: list[float] = []
        lows: list[float] = []
        for i, key in enumerate(keys):
            if i and key != keys[i - 1] + 1:  # buckets without an interval between: a gap
                edges.append(key * width)
                highs.append(math.nan)
                lows.append(math.nan)
            bucket = self._buckets[key]
            highs.append(bucket[_LAG_MAX][0])
            lows.append(bucket[_LAG_MIN][0])
            edges.append(min((key + 1) * width, last) if i == len(keys) - 1 else (key + 1) * width)
        return highs, edges, lows


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


def _envelopes(records_by_rank: Mapping | Sequence) -> list[tuple[str | None, RowEnvelope]]:
    """The rows to draw, each as a :class:`RowEnvelope` (a sequence of records: every point), empty rows left out."""
    if not isinstance(records_by_rank, Mapping):
        records_by_rank = {None: list(records_by_rank)}
    rows = []
    for rank, records in records_by_rank.items():
        if not isinstance(records, RowEnvelope):
            try:
                records = RowEnvelope.of(records)
            except TypeError as exc:
                raise TypeError(f"rank {rank!r}: {exc}") from None
        if records.count:
            rows.append((rank, records))
    return rows


#: Path vertices Agg rasterizes at once when a row is reduced (matplotlib's ``agg.path.chunksize``).
_AGG_CHUNK = 512


def _reduced_note(row: RowEnvelope) -> str:
    return f"min and max per {row.width} forward steps ({row.count} records)"


def plot_records(
    records_by_rank: Mapping[str | None, Sequence[SwaDivergenceRecord] | RowEnvelope] | Sequence[SwaDivergenceRecord],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    dpi: int = 110,
) -> Path:
    """Draw the run and write it to ``path`` (format from the suffix: ``.png``, ``.svg``, ``.pdf``...).

    Args:
        records_by_rank: the records of each row in log order, keyed by row label (``"TP0"``,
            ``"DP1 TP0"``, ``"run 2 TP0"``; ``None`` for a log without ranks), e.g. from
            :func:`otel_swa.logsource.group_by_rank`, or a :class:`RowEnvelope` per row (a row it
            reduced is drawn as its minima and maxima, and says so above it); a plain sequence of
            records is one row. A sequence is drawn point by point, however long.
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
    ranks = _envelopes(records_by_rank)
    if not ranks:
        raise ValueError("no record to plot: every rank is empty")
    Figure, FigureCanvasAgg = _import_matplotlib()
    out = check_image_path(path)

    total = sum(row.count for _, row in ranks)
    named = [rank for rank, _ in ranks if rank is not None]
    fig = Figure(figsize=(12, 1.2 + 2.9 * len(ranks)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(ranks), 2, sharex=True, squeeze=False)
    for row, (rank, envelope) in enumerate(ranks):
        ax_tokens, ax_lag = axes[row]
        marker = "o" if envelope.count <= 60 and not envelope.reduced else None
        series = envelope.series()
        for (name, (x, y)), color in zip(series.items(), ("tab:blue", "tab:orange")):
            ax_tokens.plot(x, y, marker=marker, markersize=3, color=color, label=name)
        ax_tokens.set_ylabel(f"{_row_label(rank, bool(named))}tokens at sampled step")
        peak = max((value for _, values in series.values() for value in values), default=0)
        ax_tokens.set_ylim(0, max(peak, 1) * 1.25)  # headroom for the legend
        ax_tokens.grid(True, alpha=0.3)

        steps = envelope.lag_steps()
        if steps is not None:
            values, edges, baseline = steps
            band = {} if baseline is None else {"baseline": baseline}
            ax_lag.stairs(values, edges, fill=True, alpha=0.35, color="tab:green", **band)
            ax_lag.stairs(values, edges, color="tab:green", **band)
        else:
            ax_lag.text(0.5, 0.5, "fewer than 2 records: no interval", ha="center", va="center",
                        transform=ax_lag.transAxes, color="gray")
        ax_lag.set_ylabel("KV entries per interval")
        ax_lag.grid(True, alpha=0.3)
        tokens_title, lag_title = ("divergence and out-of-window tokens",
                                   "verify lag per interval: Δ(verify_full − verify_swa)") if row == 0 else ("", "")
        if envelope.reduced:  # never imply points that were not measured
            note = _reduced_note(envelope)
            tokens_title = f"{tokens_title}\n{note}".strip()
            lag_title = f"{lag_title}\nband from min to max per {envelope.width} forward steps".strip()
        ax_tokens.set_title(tokens_title)
        ax_lag.set_title(lag_title)
        if row == 0:
            ax_tokens.legend(loc="upper left", ncols=2, fontsize="small")
    for ax in axes[-1]:
        ax.set_xlabel("forward_ct (forward steps)")
    # rows, not named ranks: lines without a rank, next to ranked ones, are a row of their own
    rank_note = f", {len(ranks)} row{'s' if len(ranks) != 1 else ''}" if named else ""
    fig.suptitle(title or f"SWA KV cache over a run: {total} record{'s' if total != 1 else ''}{rank_note}")
    from matplotlib import rc_context

    # a reduced row's lines run from each bucket's minimum to its maximum: rasterized in chunks, the
    # memory Agg takes does not grow with how far they swing (BENCHMARKS.md, section 15)
    with rc_context({"agg.path.chunksize": _AGG_CHUNK} if any(row.reduced for _, row in ranks) else {}):
        fig.savefig(out, dpi=dpi)
    return out
