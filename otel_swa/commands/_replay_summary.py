"""The summary ``otel-swa replay`` prints at the end of a run, and the run's own verdict.

The verdict (:class:`ReplayVerdict`) gives the exit status: 1 when the SWA slot audit of the run
found leaked slots, stale tokens or shared slots, the window check premature evictions, the read
check mismatches, the write check or provenance KV that is not the named token's (the judge's
``AUDIT_RULES`` and ``PROVENANCE_RULES``), or when the reporter was on and took no sample
(the run ended before the first sampling step); 3 when every export of a signal (traces, metrics
or logs) to an exporter that sends (OTLP, console) failed, so that nothing of it reached its
destination (a collector down, a wrong endpoint); 130 when the run was interrupted (Ctrl-C), after
every sample taken so far was delivered; else 0. When several apply, the first of 130, 1, 3.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Sequence, TextIO

from otel_swa.checks import CHECKS
from otel_swa.record import FAULT_FIELDS, SwaDivergenceRecord

__all__ = ["ReplayVerdict", "Progress", "WallTime", "verdict_of", "summary_rows", "print_summary", "export_row",
           "EXPORTS_FAILED"]

#: Exit status of a run interrupted by SIGINT (128 + 2, as a shell reports it).
INTERRUPTED = 130
#: Exit status of a run whose exports of a signal all failed (nothing of it was sent).
EXPORTS_FAILED = 3


@dataclass(frozen=True)
class WallTime:
    """Wall-clock seconds of the command, for the summary.

    Attributes:
        total_s: from the start of the command to the summary: the run, and the stop after it
            (the reporter's last samples delivered, the exporters' last exports and their waits).
        stop_s: the stop alone.
    """

    total_s: float
    stop_s: float


@dataclass
class Progress:
    """What an ``on_step`` hook saw, for the summary of an interrupted run.

    Attributes:
        forward_steps: the ``forward_ct`` of the last forward step seen.
        finished: requests finished so far.
    """

    forward_steps: int = 0
    finished: int = 0

    def __call__(self, result: Any) -> None:
        self.forward_steps = result.forward_ct
        self.finished += len(result.finished)


@dataclass(frozen=True)
class ReplayVerdict:
    """What the run found about itself.

    Attributes:
        audit_faults: the peak of each audit field over the audited samples, when any is above 0.
        no_sample: the reporter was on and took no sample.
        interrupted: the run was interrupted (SIGINT).
        exports_failed: the signals whose every export failed (none of their items was sent), in
            the order traces, metrics, logs.
        none_delivered: the reporter took samples and delivered none of them (each was invalid:
            the log says why), so nothing was checked.
    """

    audit_faults: dict
    no_sample: bool
    interrupted: bool
    exports_failed: tuple = ()
    none_delivered: int = 0

    @property
    def exit_status(self) -> int:
        if self.interrupted:
            return INTERRUPTED
        if self.audit_faults or self.no_sample or self.none_delivered:
            return 1
        return EXPORTS_FAILED if self.exports_failed else 0

    def reasons(self, interval: int, forward_steps: int) -> list[str]:
        """One line per reason for a non-zero exit status (for stderr)."""
        out = []
        found: dict[str, list[str]] = {}  # each check's reason (checks may share one) -> name=peak
        for check in CHECKS:
            for name in check.faults:
                if name in self.audit_faults:
                    found.setdefault(check.reason, []).append(f"{name}={self.audit_faults[name]}")
        out.extend(reason.format(found=", ".join(peaks)) for reason, peaks in found.items())
        if self.no_sample:
            out.append(f"the reporter took no sample in {forward_steps} forward step(s) (interval {interval}); "
                       "exit status 1")
        if self.none_delivered:
            out.append(f"the reporter took {self.none_delivered} sample(s) and delivered none: each was invalid (the "
                       "errors above say why), so nothing was checked; exit status 1")
        if self.exports_failed:
            status = ("" if self.audit_faults or self.no_sample or self.none_delivered or self.interrupted
                      else f"; exit status {EXPORTS_FAILED}")
            out.append(f"every export of {', '.join(self.exports_failed)} failed: nothing of it reached its "
                       f"destination{status}")
        if self.interrupted:
            out.append(f"interrupted at forward step {forward_steps}; every sample taken was delivered; exit status "
                       f"{INTERRUPTED}")
        return out


def verdict_of(records: Sequence[SwaDivergenceRecord], stats: Any, interrupted: bool,
               export_stats: "dict | None" = None) -> ReplayVerdict:
    """The run's verdict from its records, the reporter's stats (``None``: reporter off) and what
    the exporters sent (:meth:`otel_swa.telemetry.SwaTelemetry.export_stats`; ``None`` or empty:
    no exporter that sends)."""
    faults = {}
    for name in FAULT_FIELDS:
        values = [getattr(r, name) for r in records if getattr(r, name) is not None]
        if values and max(values) > 0:
            faults[name] = max(values)
    no_sample = stats is not None and stats.samples_taken == 0 and not interrupted
    none_delivered = (stats.samples_taken if stats is not None and stats.samples_taken and not stats.samples_delivered
                      and not interrupted else 0)
    failed = tuple(signal for signal in ("traces", "metrics", "logs")
                   if signal in (export_stats or {}) and export_stats[signal].failed_exports
                   and not export_stats[signal].exported)
    return ReplayVerdict(faults, no_sample, interrupted, failed, none_delivered)


def summary_rows(
    args: argparse.Namespace,
    interval: int,
    summary: Any,
    records: Sequence[SwaDivergenceRecord],
    stats: Any,
    verdict: ReplayVerdict,
    total: int,
    wall: "WallTime | None" = None,
) -> list[tuple[str, str]]:
    """The rows of the summary, ``(name, value)``. ``summary`` is the engine's ``ReplaySummary``
    (of the forward steps run until a Ctrl-C, when interrupted in the engine), or a
    :class:`Progress` when the run was interrupted before the engine's summary could be had;
    ``total``: requests submitted; ``wall``: the command's wall time (default: the replay's own,
    ``summary.wall_s``, when it ended)."""
    last = records[-1] if records else None
    whole = not isinstance(summary, Progress)  # the engine's own summary
    finished = summary.requests_finished if whole else summary.finished
    rows = [
        ("trace", f"{args.trace} ({total} requests)"),
        ("engine", f"window {args.window}, FULL pool {args.full_pool} slots, SWA pool {args.swa_pool} slots, "
                   f"page size {args.page_size}"),
        ("forward steps", f"{summary.forward_steps}"),
        ("requests finished", f"{finished} / {total}"),
        *([("requests skipped", summary.skipped_line())] if whole else []),
        ("samples delivered", _samples(stats, interval, summary.forward_steps, verdict)),
        ("peak divergence", _peak(records, "swa_full_idx_divergence", "tokens")),
        ("peak out-of-window", _peak(records, "swa_out_of_window_tokens", "tokens")),
        ("last verify_full", f"{last.verify_full} entries" if last else "n/a"),
        ("last verify_swa", f"{last.verify_swa} entries" if last else "n/a"),
        *[(check.title, check.summary(records)) for check in CHECKS
          if check.always_summarised or any(check.present(r) for r in records)],
    ]
    if whole:
        rows.append(("peak slots in use", f"FULL {summary.peak_full_slots} / {summary.full_pool_size}, "
                                          f"SWA {summary.peak_swa_slots} / {summary.swa_pool_size}"))
    if verdict.interrupted:
        rows.append(("interrupted", f"at forward step {summary.forward_steps} (Ctrl-C); every sample taken was delivered"))
    if wall is not None:
        replayed = f"replay {summary.wall_s:.1f} s, " if whole else ""
        rows.append(("wall time", f"{wall.total_s:.1f} s ({replayed}stop {wall.stop_s:.1f} s)"))
    elif whole:
        rows.append(("wall time", f"{summary.wall_s:.1f} s"))
    return rows


_UNITS = {"traces": "spans", "metrics": "data points", "logs": "log records"}


def export_row(export_stats: dict) -> str | None:
    """The ``exported`` row from :meth:`otel_swa.telemetry.SwaTelemetry.export_stats` (``None``
    when no exporter that sends was set up): what each signal's exporters sent, and what failed."""
    if not export_stats:
        return None
    parts = []
    for signal in ("traces", "metrics", "logs"):
        counts = export_stats.get(signal)
        if counts is None:
            continue
        text = f"{signal} {counts.exported} {_UNITS[signal]}"
        if counts.failed_exports:
            text += f" ({counts.failed} in {counts.failed_exports} failed export(s))"
        parts.append(text)
    failed = any(c.failed_exports for c in export_stats.values())
    return ", ".join(parts) + ("; EXPORTS FAILED: see the warnings above" if failed else "")


def print_summary(rows: list[tuple[str, str]], out: TextIO) -> None:
    """Print the summary to ``out``: a title line, then one aligned row per item."""
    width = max(len(name) for name, _ in rows)
    out.write("otel-swa replay summary\n")
    for name, value in rows:
        out.write(f"  {name:<{width}}  {value}\n")
    out.flush()


def _samples(stats: Any, interval: int, forward_steps: int, verdict: ReplayVerdict) -> str:
    if stats is None:
        return "reporter off (interval 0)"
    text = f"{stats.samples_delivered} / {stats.samples_taken} taken (every {interval} forward steps)"
    if verdict.no_sample:
        why = ("no request ran (all were skipped)" if forward_steps == 0
               else "the run ended before the first sampling step (lower --interval)")
        text += f": NONE in {forward_steps} forward step(s), {why}"
    return text


def _peak(records: Sequence[SwaDivergenceRecord], field: str, unit: str) -> str:
    return f"{max(getattr(r, field) for r in records)} {unit}" if records else "n/a"
