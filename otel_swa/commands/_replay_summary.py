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

from otel_swa.record import SwaDivergenceRecord
from otel_swa.testing.judge import AUDIT_RULES, PROVENANCE_RULES

_PROVENANCE_FIELDS = frozenset(rule.field for rule in PROVENANCE_RULES)

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
    """

    audit_faults: dict
    no_sample: bool
    interrupted: bool
    exports_failed: tuple = ()

    @property
    def exit_status(self) -> int:
        if self.interrupted:
            return INTERRUPTED
        if self.audit_faults or self.no_sample:
            return 1
        return EXPORTS_FAILED if self.exports_failed else 0

    def reasons(self, interval: int, forward_steps: int) -> list[str]:
        """One line per reason for a non-zero exit status (for stderr)."""
        out = []
        slots = {name: peak for name, peak in self.audit_faults.items()
                 if name not in ("swa_premature_evictions", "swa_read_mismatches") and name not in _PROVENANCE_FIELDS}
        if slots:
            found = ", ".join(f"{name}={peak}" for name, peak in slots.items())
            out.append(f"the SWA slot audit found faults (peak {found}); exit status 1")
        if "swa_premature_evictions" in self.audit_faults:
            out.append(f"the window check found live tokens inside the sliding window without an SWA slot (peak "
                       f"swa_premature_evictions={self.audit_faults['swa_premature_evictions']}); exit status 1")
        if "swa_read_mismatches" in self.audit_faults:
            out.append(f"the read check found sliding-window attention reading other KV than the mapping gives (peak "
                       f"swa_read_mismatches={self.audit_faults['swa_read_mismatches']}); exit status 1")
        provenance = {name: peak for name, peak in self.audit_faults.items() if name in _PROVENANCE_FIELDS}
        if provenance:
            found = ", ".join(f"{name}={peak}" for name, peak in provenance.items())
            out.append(f"the write check and provenance found KV that is not the KV of the token the tables name "
                       f"(peak {found}); exit status 1")
        if self.no_sample:
            out.append(f"the reporter took no sample in {forward_steps} forward step(s) (interval {interval}); "
                       "exit status 1")
        if self.exports_failed:
            status = "" if self.audit_faults or self.no_sample or self.interrupted else f"; exit status {EXPORTS_FAILED}"
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
    for rule in (*AUDIT_RULES, *PROVENANCE_RULES):
        values = [getattr(r, rule.field) for r in records if getattr(r, rule.field) is not None]
        if values and max(values) > 0:
            faults[rule.field] = max(values)
    no_sample = stats is not None and stats.samples_taken == 0 and not interrupted
    failed = tuple(signal for signal in ("traces", "metrics", "logs")
                   if signal in (export_stats or {}) and export_stats[signal].failed_exports
                   and not export_stats[signal].exported)
    return ReplayVerdict(faults, no_sample, interrupted, failed)


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
    """The rows of the summary, ``(name, value)``. ``summary`` is the engine's ``ReplaySummary``,
    or a :class:`Progress` when the run was interrupted; ``total``: requests submitted; ``wall``:
    the command's wall time (default: the replay's own, ``summary.wall_s``, when it ended)."""
    last = records[-1] if records else None
    complete = not verdict.interrupted
    finished = summary.requests_finished if complete else summary.finished
    rows = [
        ("trace", f"{args.trace} ({total} requests)"),
        ("engine", f"window {args.window}, FULL pool {args.full_pool} slots, SWA pool {args.swa_pool} slots, "
                   f"page size {args.page_size}"),
        ("forward steps", f"{summary.forward_steps}"),
        ("requests finished", f"{finished} / {total}"),
        *([("requests skipped", summary.skipped_line())] if complete else []),
        ("samples delivered", _samples(stats, interval, summary.forward_steps, verdict)),
        ("peak divergence", _peak(records, "swa_full_idx_divergence", "tokens")),
        ("peak out-of-window", _peak(records, "swa_out_of_window_tokens", "tokens")),
        ("last verify_full", f"{last.verify_full} entries" if last else "n/a"),
        ("last verify_swa", f"{last.verify_swa} entries" if last else "n/a"),
        ("SWA slot audit", _audit_summary(records)),
        *([("window check", _window_summary(records))] if any(r.window_checked for r in records) else []),
        *([("read check", _read_summary(records))] if any(r.read_checked for r in records) else []),
        *([("write check", _write_summary(records))] if any(r.kv_write_checks is not None for r in records) else []),
        *([("provenance", _provenance_summary(records))] if any(r.kv_stamp_checks is not None for r in records)
          else []),
    ]
    if complete:
        rows.append(("peak slots in use", f"FULL {summary.peak_full_slots} / {summary.full_pool_size}, "
                                          f"SWA {summary.peak_swa_slots} / {summary.swa_pool_size}"))
    else:
        rows.append(("interrupted", f"at forward step {summary.forward_steps} (Ctrl-C); every sample taken was delivered"))
    if wall is not None:
        replayed = f"replay {summary.wall_s:.1f} s, " if complete else ""
        rows.append(("wall time", f"{wall.total_s:.1f} s ({replayed}stop {wall.stop_s:.1f} s)"))
    elif complete:
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


def _audit_summary(records: Sequence[SwaDivergenceRecord]) -> str:
    audited = [r for r in records if r.audited]
    if not audited:
        return "n/a"
    peaks = {name: max(getattr(r, name) for r in audited) for name in ("swa_leaked_slots", "swa_stale_tokens", "swa_shared_slots")}
    verdict = "clean" if not any(peaks.values()) else "FAULTS"
    return (f"{verdict}: peak leaked {peaks['swa_leaked_slots']} slots, stale {peaks['swa_stale_tokens']} tokens, "
            f"shared {peaks['swa_shared_slots']} slots ({len(audited)} samples)")


def _window_summary(records: Sequence[SwaDivergenceRecord]) -> str:
    checked = [r for r in records if r.window_checked]
    premature = max(r.swa_premature_evictions for r in checked)
    late = max(r.swa_late_held_slots for r in checked)
    verdict = "clean" if not premature else "PREMATURE EVICTION"
    return f"{verdict}: peak premature evictions {premature} tokens, late-held {late} slots ({len(checked)} samples)"


def _first_fault(checked: Sequence[SwaDivergenceRecord], fault: str) -> str:
    """``; first at forward_ct=N: <offender>`` of the first record with ``fault``, or ``""``."""
    first = next((r for r in checked if getattr(r, fault)), None)
    if first is None:
        return ""
    offender = first.offender(fault)
    return f"; first at forward_ct={first.forward_ct}" + (f": {offender.describe()}" if offender else "")


def _write_summary(records: Sequence[SwaDivergenceRecord]) -> str:
    checked = [r for r in records if r.kv_write_checks is not None]
    pairs = sum(r.kv_write_checks for r in checked)
    mismatched = sum(r.kv_write_mismatches for r in checked)
    unchecked = sum(r.kv_write_unchecked for r in checked)
    verdict = "clean" if not mismatched else "WRONG WRITES"
    tail = f", {unchecked} unchecked" if unchecked else ""
    return (f"{verdict}: {mismatched} of {pairs} (token, layer) stores mismatched{tail} ({len(checked)} samples)"
            f"{_first_fault(checked, 'kv_write_mismatches')}")


def _provenance_summary(records: Sequence[SwaDivergenceRecord]) -> str:
    checked = [r for r in records if r.kv_stamp_checks is not None]
    stamps = sum(r.kv_stamp_checks for r in checked)
    foreign = sum(r.kv_foreign_tokens for r in checked)
    unchecked = sum(r.kv_stamp_unchecked for r in checked)
    hashed = [r for r in checked if r.kv_checksum_checks is not None]
    corrupt = sum(r.kv_corrupt_tokens for r in hashed)
    verdict = "clean" if not foreign and not corrupt else "FOREIGN OR CORRUPT KV"
    text = f"{verdict}: {foreign} foreign of {stamps} slots stamped ({unchecked} unchecked)"
    if hashed:
        text += f", {corrupt} corrupt of {sum(r.kv_checksum_checks for r in hashed)} hashed"
    return (f"{text} ({len(checked)} samples){_first_fault(checked, 'kv_foreign_tokens')}"
            f"{_first_fault(hashed, 'kv_corrupt_tokens')}")


def _read_summary(records: Sequence[SwaDivergenceRecord]) -> str:
    checked = [r for r in records if r.read_checked]
    queries = sum(r.swa_read_checks for r in checked)
    mismatched = sum(r.swa_read_mismatches for r in checked)
    unchecked = sum(r.swa_read_unchecked for r in checked)
    verdict = "clean" if not mismatched else "WRONG READS"
    tail = f", {unchecked} unchecked" if unchecked else ""
    first = next((r for r in checked if r.swa_read_mismatches), None)
    where = ""
    if first is not None:
        offender = first.offender("swa_read_mismatches")
        where = f"; first at forward_ct={first.forward_ct}" + (f": {offender.describe()}" if offender else "")
    return f"{verdict}: {mismatched} of {queries} queries disagreed{tail} ({len(checked)} samples){where}"
