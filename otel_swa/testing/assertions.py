"""Judge whether a run shows the SWA path working, and wait for it while the log is being written.

The rules are those of SGLang's CI helper ``assert_swa_divergence_observed`` (sgl-project/sglang
PR #26820):

* ``swa_full_idx_divergence`` and ``swa_out_of_window_tokens`` are judged on their **peak** over all
  records (under pipeline parallelism one micro-batch is sampled per interval, so a single record
  may show an idle micro-batch);
* ``verify_swa < verify_full`` is judged on the **last** record (the counters are cumulative).

This module does not import pytest; ``otel-swa check`` uses it too.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, Union

from otel_swa.logsource import LogFollower, logged_records
from otel_swa.record import LINE_PREFIX, MalformedRecordError, SwaDivergenceRecord

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_POLL_S",
    "SIGNALS",
    "SwaDivergenceNotObserved",
    "SwaObservation",
    "judge",
    "open_source",
    "wait_for_observation",
    "assert_swa_divergence_observed",
]

#: Default wait for a source that can still grow (a log file, captured output), in seconds.
DEFAULT_TIMEOUT_S = 30.0
#: Default pause between two reads of a growing source, in seconds.
DEFAULT_POLL_S = 0.25

#: The three signals, by name: what is judged and on which record(s).
SIGNALS = ("divergence", "out-of-window", "verify lag")


class SwaDivergenceNotObserved(AssertionError):
    """The SWA path was not observed; the message explains what was seen.

    Attributes:
        observation: the :class:`SwaObservation` that failed.
    """

    def __init__(self, observation: "SwaObservation") -> None:
        self.observation = observation
        super().__init__(observation.explain())


@dataclass(frozen=True)
class SwaObservation:
    """The verdict over the records of one run.

    Attributes:
        source: what was read, in words (a path, "in-process sink"...).
        records: how many valid records were seen.
        malformed: how many malformed records were skipped.
        peak_divergence: the largest ``swa_full_idx_divergence`` (0 with no record).
        peak_divergence_at: ``forward_ct`` of the first record holding that peak, or ``None``.
        peak_out_of_window: the largest ``swa_out_of_window_tokens`` (0 with no record).
        peak_out_of_window_at: ``forward_ct`` of the first record holding that peak, or ``None``.
        last: the last record, or ``None``.
        last_line_no: its line number when it came from a log, else ``None``.
        min_divergence, min_out_of_window, require_verify_lag: the thresholds judged.
        failed: the names (from :data:`SIGNALS`) of the signals that failed, in that order.
        waited_s: seconds spent waiting for the source to grow.
        problem: why the source could not be read (missing file, permission...), else ``None``.
        empty: the source held no text at all (e.g. the captured output of an engine that crashed
            before logging anything), as opposed to text without records.
    """

    source: str
    records: int
    malformed: int
    peak_divergence: int
    peak_divergence_at: int | None
    peak_out_of_window: int
    peak_out_of_window_at: int | None
    last: SwaDivergenceRecord | None
    last_line_no: int | None
    min_divergence: int
    min_out_of_window: int
    require_verify_lag: bool
    failed: tuple[str, ...]
    waited_s: float = 0.0
    problem: str | None = None
    empty: bool = False

    @property
    def ok(self) -> bool:
        """All required signals were observed and the source was readable."""
        return not self.failed and self.problem is None

    def explain(self) -> str:
        """A multi-line account for a CI log: counts, peaks, the last record, each signal's verdict."""
        head = "SWA path observed" if self.ok else "SWA path NOT observed"
        seen = f"{self.records} record(s) seen"
        if self.malformed:
            seen += f" ({self.malformed} malformed skipped)"
        waited = f", waited {self.waited_s:.1f} s" if self.waited_s else ""
        lines = [f"{head} in {self.source}: {seen}{waited}"]
        if self.problem is not None:
            lines.append(f"  unusable source: {self.problem}")
        if self.empty and self.problem is None:
            lines.append("  the source was empty (no text at all): did the engine crash, or log to another stream?")
        elif self.records == 0 and self.problem is None:
            lines.append(
                f"  no {LINE_PREFIX!r} record found; is the reporter on (interval > 0) and the run long enough?"
            )

        def verdict(name: str) -> str:
            return "FAILED" if name in self.failed else "ok    "

        at = lambda ct: "" if ct is None else f" at forward_ct={ct}"  # noqa: E731
        lines.append(
            f"  {verdict('divergence')} divergence: peak swa_full_idx_divergence={self.peak_divergence}"
            f"{at(self.peak_divergence_at)} (need >= {self.min_divergence})"
        )
        lines.append(
            f"  {verdict('out-of-window')} out-of-window: peak swa_out_of_window_tokens={self.peak_out_of_window}"
            f"{at(self.peak_out_of_window_at)} (need >= {self.min_out_of_window})"
        )
        if not self.require_verify_lag:
            lines.append("  skip   verify lag: not required")
        elif self.last is None:
            lines.append(f"  {verdict('verify lag')} verify lag: no last record (need verify_swa < verify_full)")
        else:
            relation = "<" if self.last.verify_swa < self.last.verify_full else "is not <"
            lines.append(
                f"  {verdict('verify lag')} verify lag: last record verify_swa={self.last.verify_swa} {relation} "
                f"verify_full={self.last.verify_full}"
            )
        if self.last is not None:
            where = f" (line {self.last_line_no})" if self.last_line_no is not None else ""
            lines.append(f"  last record{where}: {self.last.format()}")
        return "\n".join(lines)


def _check_threshold(name: str, value: object) -> int:
    if type(value) is not int or value < 0:  # noqa: E721 - bool refused
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _is_seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def judge(
    records: Sequence[SwaDivergenceRecord],
    *,
    malformed: int = 0,
    min_divergence: int = 1,
    min_out_of_window: int = 1,
    require_verify_lag: bool = True,
    source: str = "records",
    last_line_no: int | None = None,
    waited_s: float = 0.0,
    problem: str | None = None,
    empty: bool = False,
) -> SwaObservation:
    """Judge ``records`` (in log order) by the peak/last rules of the module docstring.

    Raises:
        ValueError: a threshold is not an int >= 0.
    """
    _check_threshold("min_divergence", min_divergence)
    _check_threshold("min_out_of_window", min_out_of_window)
    peak_div, peak_div_at, peak_oow, peak_oow_at = 0, None, 0, None
    for record in records:
        if peak_div_at is None or record.swa_full_idx_divergence > peak_div:
            peak_div, peak_div_at = record.swa_full_idx_divergence, record.forward_ct
        if peak_oow_at is None or record.swa_out_of_window_tokens > peak_oow:
            peak_oow, peak_oow_at = record.swa_out_of_window_tokens, record.forward_ct
    last = records[-1] if records else None
    failed = []
    if not records or peak_div < min_divergence:
        failed.append("divergence")
    if not records or peak_oow < min_out_of_window:
        failed.append("out-of-window")
    if require_verify_lag and (last is None or not last.verify_swa < last.verify_full):
        failed.append("verify lag")
    return SwaObservation(
        source=source,
        records=len(records),
        malformed=malformed,
        peak_divergence=peak_div,
        peak_divergence_at=peak_div_at,
        peak_out_of_window=peak_oow,
        peak_out_of_window_at=peak_oow_at,
        last=last,
        last_line_no=last_line_no if last is not None else None,
        min_divergence=min_divergence,
        min_out_of_window=min_out_of_window,
        require_verify_lag=bool(require_verify_lag),
        failed=tuple(failed),
        waited_s=waited_s,
        problem=problem,
        empty=bool(empty) and not records,
    )


# ---------------------------------------------------------------------------------------- sources
@dataclass
class _Snapshot:
    records: list[SwaDivergenceRecord]
    malformed: int = 0
    last_line_no: int | None = None
    problem: str | None = None
    empty: bool = False


class _Source:
    """A readable source of records: ``read(final)`` returns everything seen so far."""

    describe = "records"
    growing = False

    def read(self, final: bool = False) -> _Snapshot:  # pragma: no cover - interface
        raise NotImplementedError


class _FileSource(_Source):
    growing = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.follower = LogFollower(path)
        self.describe = os.fspath(path)

    def read(self, final: bool = False) -> _Snapshot:
        follower = self.follower
        follower.poll(final=final)
        problem = None
        if follower.missing:
            problem = f"log file {self.describe!r} does not exist"
        elif follower.error is not None:
            problem = f"log file {self.describe!r} cannot be read ({follower.error.strerror or follower.error})"
        found = follower.records
        return _Snapshot(
            [item.record for item in found],
            follower.malformed,
            found[-1].line_no if found else None,
            problem,
        )


class _TextSource(_Source):
    def __init__(self, get_text: Callable[[], str | bytes], describe: str, growing: bool) -> None:
        self.get_text = get_text
        self.describe = describe
        self.growing = growing

    def read(self, final: bool = False) -> _Snapshot:
        text = self.get_text()
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if not isinstance(text, str):
            raise TypeError(f"a text source must return str or bytes, got {type(text).__name__}")
        errors: list[MalformedRecordError] = []
        found = logged_records(text, errors=errors)
        return _Snapshot(
            [item.record for item in found], len(errors), found[-1].line_no if found else None, empty=not text.strip()
        )


class _RecordsSource(_Source):
    def __init__(
        self,
        get_records: Callable[[], Sequence[SwaDivergenceRecord]],
        describe: str,
        growing: bool,
        get_malformed: Callable[[], int] = lambda: 0,
    ) -> None:
        self.get_records = get_records
        self.get_malformed = get_malformed
        self.describe = describe
        self.growing = growing

    def read(self, final: bool = False) -> _Snapshot:
        records = list(self.get_records())
        for record in records:
            if not isinstance(record, SwaDivergenceRecord):
                raise TypeError(f"expected SwaDivergenceRecord items, got {type(record).__name__}: {record!r}")
        return _Snapshot(records, self.get_malformed())


#: What :func:`open_source` accepts (see there); ``object`` stands for a ``SwaRecordCapture``.
SourceLike = Union[
    str, "os.PathLike[str]", bytes, Callable[[], Union[str, bytes]], Iterable[SwaDivergenceRecord], object
]


def open_source(source: SourceLike) -> _Source:
    """Adapt what the caller has to a record source.

    Accepted:
        * a :class:`~otel_swa.testing.SwaRecordCapture` (the ``swa_records`` fixture): its sink,
          captured logging and followed files; grows when it follows a file or captured output;
        * a path (``str`` or ``os.PathLike``) of a log file, possibly still being written (grows);
        * log text: a ``str`` holding a newline or the record prefix, an empty or blank ``str``
          (e.g. the empty ``stdout`` of an engine that crashed: no records, judged at once), or
          ``bytes`` (fixed);
        * a callable returning the whole log text so far, e.g. captured server output (grows);
        * an object with ``getvalue()`` (``io.StringIO``) holding the log text (grows);
        * an iterable of :class:`~otel_swa.record.SwaDivergenceRecord` (fixed).

    Raises:
        TypeError: ``source`` is none of these.
    """
    as_source = getattr(source, "_as_source", None)
    if callable(as_source):
        return as_source()
    if isinstance(source, bytes):
        return _TextSource(lambda: source, "log text", growing=False)
    if isinstance(source, str):
        if not source.strip():
            return _TextSource(lambda: source, "empty log text", growing=False)
        if "\n" in source or LINE_PREFIX in source:
            return _TextSource(lambda: source, "log text", growing=False)
        return _FileSource(source)
    if isinstance(source, os.PathLike):
        return _FileSource(source)
    getvalue = getattr(source, "getvalue", None)
    if callable(getvalue):
        return _TextSource(getvalue, "captured output", growing=True)
    if callable(source):
        return _TextSource(source, "captured output", growing=True)
    if isinstance(source, Iterable):
        items = list(source)
        return _RecordsSource(lambda: items, "records", growing=False)
    raise TypeError(
        "source must be a log file path, log text, a callable returning log text, a SwaRecordCapture or "
        f"an iterable of SwaDivergenceRecord; got {type(source).__name__}: {source!r}"
    )


def wait_for_observation(
    source: SourceLike,
    *,
    min_divergence: int = 1,
    min_out_of_window: int = 1,
    require_verify_lag: bool = True,
    timeout_s: float | None = None,
    poll_s: float = DEFAULT_POLL_S,
) -> SwaObservation:
    """Read ``source`` until the signals are observed or ``timeout_s`` has passed; never raises for
    what the source holds.

    A source that can grow (file, captured output, a capture following one) is read again every
    ``poll_s`` seconds until all required signals are observed, up to ``timeout_s`` (default
    :data:`DEFAULT_TIMEOUT_S`; for a fixed source the default is 0, i.e. one read). The last read is a
    final one: an unterminated last line counts too. A missing log file is waited for like a late
    record; if it still does not exist at the end, :attr:`SwaObservation.problem` says so.

    Raises:
        ValueError: a threshold is not an int >= 0, ``timeout_s`` < 0 or ``poll_s`` <= 0 (or not
            finite).
        TypeError: ``source`` is of no accepted kind (see :func:`open_source`).
    """
    _check_threshold("min_divergence", min_divergence)
    _check_threshold("min_out_of_window", min_out_of_window)
    src = open_source(source)
    if timeout_s is None:
        timeout_s = DEFAULT_TIMEOUT_S if src.growing else 0.0
    if not _is_seconds(timeout_s) or not timeout_s >= 0:
        raise ValueError(f"timeout_s must be a finite number of seconds >= 0, got {timeout_s!r}")
    if not _is_seconds(poll_s) or not poll_s > 0:
        raise ValueError(f"poll_s must be a finite number of seconds > 0, got {poll_s!r}")
    if not src.growing:
        timeout_s = 0.0  # a fixed source cannot change: one read, whatever timeout was asked
    start = time.monotonic()
    deadline = start + timeout_s

    def observe(snap: _Snapshot, waited: float) -> SwaObservation:
        return judge(
            snap.records,
            malformed=snap.malformed,
            min_divergence=min_divergence,
            min_out_of_window=min_out_of_window,
            require_verify_lag=require_verify_lag,
            source=src.describe,
            last_line_no=snap.last_line_no,
            waited_s=waited,
            problem=snap.problem,
            empty=snap.empty,
        )

    while True:
        now = time.monotonic()
        final = now >= deadline
        observation = observe(src.read(final=final), round(now - start, 3) if timeout_s else 0.0)
        if observation.ok or final:
            return observation
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))


def assert_swa_divergence_observed(
    source: SourceLike,
    *,
    min_divergence: int = 1,
    min_out_of_window: int = 1,
    require_verify_lag: bool = True,
    timeout_s: float | None = None,
    poll_s: float = DEFAULT_POLL_S,
) -> SwaObservation:
    """Assert that a run shows the SWA path working; wait for it while the log is being written.

    Passes when the peak ``swa_full_idx_divergence`` over all records is >= ``min_divergence``, the
    peak ``swa_out_of_window_tokens`` is >= ``min_out_of_window``, and (when
    ``require_verify_lag``) the last record has ``verify_swa < verify_full``. ``source`` is any of
    :func:`open_source`'s kinds; waiting follows :func:`wait_for_observation`.

    Returns:
        the :class:`SwaObservation` (counts, peaks, last record) for further checks.

    Raises:
        SwaDivergenceNotObserved: (an ``AssertionError``) a signal was not observed by the timeout,
            or the source could not be read; the message shows the records seen, malformed ones
            skipped, the peaks, the last record and the failed signal(s).
        ValueError, TypeError: bad arguments, as :func:`wait_for_observation`.
    """
    observation = wait_for_observation(
        source,
        min_divergence=min_divergence,
        min_out_of_window=min_out_of_window,
        require_verify_lag=require_verify_lag,
        timeout_s=timeout_s,
        poll_s=poll_s,
    )
    if not observation.ok:
        raise SwaDivergenceNotObserved(observation)
    return observation

