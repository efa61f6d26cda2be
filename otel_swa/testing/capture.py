"""Capture the records of a running engine: in process, from ``logging``, or from its log file."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Callable

from opentelemetry.context import Context

from otel_swa.logsource import LogFollower, logged_entries, split_cut_line
from otel_swa.record import (
    AuditPairing,
    LivenessMatch,
    LivenessWarning,
    MalformedRecordError,
    SwaDivergenceRecord,
    iter_entries,
)
from otel_swa.record.prefixes import PREFIX_RE
from otel_swa.testing.assertions import DEFAULT_POLL_S, DEFAULT_QUIET_S, SwaObservation, assert_swa_divergence_observed
from otel_swa.testing.runs import RunRecord, RunRecords, split_runs
from otel_swa.testing.sources import Snapshot, Source, cut_line_note, follower_problem, text_of

__all__ = ["SwaRecordCapture"]


class _RecordLogHandler(logging.Handler):
    """Keeps the records found in the messages that pass through it."""

    def __init__(self, capture: "SwaRecordCapture", level: int) -> None:
        super().__init__(level)
        self._capture = capture

    def emit(self, log_record: logging.LogRecord) -> None:
        try:
            message = log_record.getMessage()
        except Exception:  # a message whose arguments do not format is not ours to judge
            return
        if PREFIX_RE.search(message) is not None:  # a line of any kind otel-swa reads
            self._capture._add_logged(message)


class SwaRecordCapture:
    """Collects :class:`~otel_swa.record.SwaDivergenceRecord` from every place a run puts them.

    The object is itself a reporter sink, ``sink(record, context)``::

        reporter = SwaDivergenceReporter(interval=20, device="cpu", sinks=[swa_records])

    and it can also read the records that reach ``logging`` (:meth:`capture_logging`), a log file
    written by another process (:meth:`follow`), or captured server output (:meth:`follow_output`).
    Pass it to :func:`~otel_swa.testing.assert_swa_divergence_observed` (or call
    :meth:`assert_observed`): it is read again at each poll. It waits (default timeout 30 s) only when
    it follows a file or output, which another process may still be writing; records that reach
    the sink or ``logging`` are in place once the reporter's ``flush()`` has returned.

    When records come from more than one place (the sink, ``logging``, each followed file, each
    captured output), each place is judged on its own, with its own runs and ranks, and every place
    that holds records must show the SWA path; :attr:`records` lists them all, merged in
    ``forward_ct`` order (stable). Audit lines and run start markers that reach ``logging`` are read
    too (an audit line attached to the record logged just before it).

    The sink is thread-safe; it raises ``TypeError`` for anything but a record (the reporter catches
    and counts sink errors). It takes the reporter's liveness warnings too (:meth:`liveness`): a
    capture whose reporter was on and delivered nothing fails with "instrumented, 0 samples".

    The ``swa_records`` fixture fails a test that collected records (or set the capture to read
    ``logging``, a file or output) and never judged them nor read them: :meth:`assert_observed`,
    :func:`~otel_swa.testing.assert_swa_divergence_observed` on the capture, or reading
    :attr:`records`, :attr:`contexts`, :attr:`malformed` count (:attr:`looked_at`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sunk: list[SwaDivergenceRecord] = []
        self._contexts: list[Context | None] = []
        self._logged: list = []  # RecordMatch and RunStartMatch, audit lines attached
        self._logged_pairing = AuditPairing()
        self._logged_errors: list[MalformedRecordError] = []
        self._followers: list[LogFollower] = []
        self._outputs: list[Callable[[], str | bytes]] = []
        self._handlers: list[tuple[logging.Logger, _RecordLogHandler, int]] = []
        self._looked_at = False
        self._fed = False  # something was handed to it or it was told where to read

    # ------------------------------------------------------------------ inputs
    def __call__(self, record: SwaDivergenceRecord, context: Context | None = None) -> None:
        """The reporter sink: keep ``record`` and the forward step's ``context``."""
        if not isinstance(record, SwaDivergenceRecord):
            raise TypeError(f"expected a SwaDivergenceRecord, got {type(record).__name__}: {record!r}")
        with self._lock:
            self._sunk.append(record)
            self._contexts.append(context)
            self._fed = True

    def liveness(self, warning: LivenessWarning, context: Context | None = None) -> None:
        """The reporter's liveness warning (on, and no sample delivered): kept in order with the
        sink's records, judged as otel-swa's ``otel_swa_liveness=`` line is."""
        if not isinstance(warning, LivenessWarning):
            raise TypeError(f"expected a LivenessWarning, got {type(warning).__name__}: {warning!r}")
        entry = LivenessMatch(warning.to_dict(), warning.line(), None, None, None, warning.verify_source)
        with self._lock:
            self._sunk.append(entry)
            self._fed = True

    @property
    def looked_at(self) -> bool:
        """Whether what the capture collected was judged or read (the fixture fails a test that
        collected and never looked)."""
        return self._looked_at

    @property
    def unjudged(self) -> bool:
        """Whether the capture was fed (records, a warning, or places to read) and never looked at."""
        return self._fed and not self._looked_at
    def _add_logged(self, message: str) -> None:
        errors: list[MalformedRecordError] = []
        entries = list(iter_entries(message, errors))
        with self._lock:
            for entry in entries:
                if entry.per_record:
                    error = self._logged_pairing.attach(entry)
                    if error is not None:
                        errors.append(error)
                else:
                    self._logged_pairing.add(self._logged, entry)
            self._logged_errors.extend(errors)

    def capture_logging(
        self, logger: str | logging.Logger | None = None, level: int = logging.INFO
    ) -> logging.Handler:
        """Keep the records logged through ``logger`` (default: the root logger) from now on.

        The logger's level is lowered to ``level`` if needed (restored by :meth:`close`) so that
        INFO lines reach the handler even when the application logs at WARNING.

        Returns:
            the handler added to the logger (removed by :meth:`close`).
        """
        target = logger if isinstance(logger, logging.Logger) else logging.getLogger(logger)
        handler = _RecordLogHandler(self, level)
        self._fed = True
        old_level = target.level
        if target.getEffectiveLevel() > level:
            target.setLevel(level)
        target.addHandler(handler)
        with self._lock:
            self._handlers.append((target, handler, old_level))
        return handler

    def follow(self, path: str | os.PathLike[str]) -> LogFollower:
        """Read the records of the log file ``path`` (which may not exist yet, or still grow)."""
        follower = LogFollower(path)
        with self._lock:
            self._followers.append(follower)
            self._fed = True
        return follower

    def follow_output(self, get_text: Callable[[], str | bytes]) -> None:
        """Read the records of captured output: ``get_text()`` returns the whole text so far.

        Raises:
            TypeError: ``get_text`` is not callable.
        """
        if not callable(get_text):
            raise TypeError(f"get_text must be a callable returning the output so far, got {get_text!r}")
        with self._lock:
            self._outputs.append(get_text)
            self._fed = True

    # ------------------------------------------------------------------ outputs
    def _parts(self, final: bool = False) -> tuple[list[tuple[str, list[RunRecord]]], list, list[str], list[str]]:
        """``(label, records)`` per place, the malformed lines, the problems of followed files and the
        notes on cut last lines left out."""
        with self._lock:
            sunk = list(self._sunk)
            logged = list(self._logged)
            errors: list[MalformedRecordError] = list(self._logged_errors)
            followers = list(self._followers)
            outputs = list(self._outputs)
        parts = [("sink", split_runs(sunk, part="sink", line_numbers=False)),
                 ("logging", split_runs(logged, part="logging", line_numbers=False))]
        problems = []
        notes = []
        for follower in followers:
            label = os.fspath(follower.path)
            follower.poll(final=final)
            parts.append((label, split_runs(follower.entries, part=label)))
            errors.extend(follower.errors)
            problem = follower_problem(follower)
            if problem is not None:
                problems.append(problem)
            if follower.cut_line is not None:
                notes.append(cut_line_note(follower.cut_line, label))
        for number, get_text in enumerate(outputs, 1):
            label = "captured output" if len(outputs) == 1 else f"captured output {number}"
            found: list[MalformedRecordError] = []
            whole, cut = split_cut_line(text_of(get_text()))
            entries = logged_entries(whole, errors=found)
            parts.append((label, split_runs(entries, part=label)))
            errors.extend(found)
            if cut is not None:
                notes.append(cut_line_note(cut, label))
        return parts, errors, problems, notes

    def _snapshot(self, final: bool = False) -> Snapshot:
        parts, errors, problems, notes = self._parts(final)
        nonempty = [records for _, records in parts if records or records.silent]
        merged = RunRecords.merge((records for _, records in parts), [item for part in nonempty for item in part])
        if len(nonempty) == 1:  # one place: no part labels in the explanation
            merged = merged.derive([dataclasses.replace(item, part=None) for item in merged], part=None)
        duplicates = sum(f.duplicates.count for f in self._followers)
        first = min((f.duplicates.first_line_no for f in self._followers if f.duplicates.first_line_no), default=None)
        return Snapshot(merged, errors, "; ".join(problems) or None, duplicates=duplicates, first_duplicate_line_no=first,
                        notes=tuple(notes))

    def _as_source(self) -> Source:
        capture = self
        self._looked_at = True  # handed to the assertion

        class _CaptureSource(Source):
            describe = "the captured records (" + capture._describe() + ")"
            growing = bool(capture._followers or capture._outputs)

            def read(self, final: bool = False) -> Snapshot:
                return capture._snapshot(final)

        return _CaptureSource()

    def _describe(self) -> str:
        kinds = ["sink"]
        if self._handlers:
            kinds.append("logging")
        kinds += [os.fspath(f.path) for f in self._followers]
        if self._outputs:
            kinds.append("captured output")
        return ", ".join(kinds)

    @property
    def records(self) -> list[SwaDivergenceRecord]:
        """Every record captured so far (files and output read again now), merged in ``forward_ct``
        order (stable)."""
        self._looked_at = True
        parts, _, _, _ = self._parts()
        return sorted((item.record for _, part in parts for item in part), key=lambda r: r.forward_ct)

    @property
    def contexts(self) -> list[Context | None]:
        """The OpenTelemetry context handed to the sink with each of its records, in order."""
        self._looked_at = True
        with self._lock:
            return list(self._contexts)

    @property
    def malformed(self) -> int:
        """Malformed lines skipped in logged messages, files and output."""
        self._looked_at = True
        return len(self._parts()[1])

    def assert_observed(
        self,
        *,
        min_divergence: int = 1,
        min_out_of_window: int = 1,
        require_verify_lag: bool = True,
        require_clean_audit: bool = True,
        runs: str = "last",
        ranks: str = "each",
        lines: str = "auto",
        timeout_s: float | None = None,
        poll_s: float = DEFAULT_POLL_S,
        until: str = "pass",
        quiet_s: float = DEFAULT_QUIET_S,
    ) -> SwaObservation:
        """:func:`~otel_swa.testing.assert_swa_divergence_observed` on this capture (same rules
        and arguments).

        Raises:
            SwaDivergenceNotObserved: the verdict is not a pass (the message says why).
        """
        return assert_swa_divergence_observed(
            self,
            min_divergence=min_divergence,
            min_out_of_window=min_out_of_window,
            require_verify_lag=require_verify_lag,
            require_clean_audit=require_clean_audit,
            runs=runs,
            ranks=ranks,
            lines=lines,
            timeout_s=timeout_s,
            poll_s=poll_s,
            until=until,
            quiet_s=quiet_s,
        )

    def close(self) -> None:
        """Remove the logging handlers (restoring logger levels) and stop following; idempotent."""
        with self._lock:
            handlers, self._handlers = self._handlers, []
        for target, handler, old_level in reversed(handlers):
            target.removeHandler(handler)
            target.setLevel(old_level)
