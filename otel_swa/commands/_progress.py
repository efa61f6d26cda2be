"""Progress of a long ``otel-swa replay`` as plain lines, for a standard error that is not a terminal.

On a terminal ``replay`` draws a tqdm bar, which redraws one line in place; in a CI log or a file
that would be a stream of carriage returns, so there the run instead writes one line every
:data:`PROGRESS_EVERY_S` seconds of wall time (a short run, under that, writes none)::

    otel-swa replay: 1,234 / 91,804 requests finished, 5,678 forward steps, 30 s elapsed, about 2,200 s left
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

__all__ = ["PROGRESS_EVERY_S", "ProgressLines"]

#: Seconds of wall time between two progress lines.
PROGRESS_EVERY_S = 30.0


class ProgressLines:
    """A ``replay`` ``on_step`` hook that writes a progress line every ``every_s`` seconds.

    The estimate of the time left assumes the requests still to finish take as long, on average, as
    those finished so far (it is omitted until one has finished). Writing never raises: once the
    stream fails (closed, full), the hook stops writing.

    Args:
        total_requests: requests submitted to the run.
        every_s: seconds of wall time between two lines (default :data:`PROGRESS_EVERY_S`; 0 writes
            one per forward step).
        stream: where lines go (default ``sys.stderr`` at the time of writing).
        clock: monotonic seconds (``time.monotonic``); replaceable for tests.

    Raises:
        ValueError: ``every_s`` is negative or not a number.

    Attributes:
        finished: requests finished so far.
        lines: progress lines written so far.
    """

    def __init__(
        self,
        total_requests: int,
        *,
        every_s: float | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_s is None:
            every_s = PROGRESS_EVERY_S
        if not every_s >= 0:
            raise ValueError(f"every_s={every_s!r}; expected seconds >= 0")
        self.total = total_requests
        self.every_s = every_s
        self.stream = stream
        self.clock = clock
        self.start = clock()
        self._next_at = self.start + every_s
        self.finished = 0
        self.lines = 0
        self._broken = False

    def __call__(self, result: Any) -> None:
        """Count ``result.finished`` (a forward step's ``StepResult``); write a line when due."""
        self.finished += len(result.finished)
        now = self.clock()
        if now < self._next_at or self._broken:
            return
        self._next_at = now + self.every_s
        self._write(self.line(result.forward_ct, now - self.start))

    def line(self, forward_steps: int, elapsed_s: float) -> str:
        """The progress line for ``forward_steps`` steps after ``elapsed_s`` seconds."""
        text = (
            f"otel-swa replay: {self.finished:,} / {self.total:,} requests finished, "
            f"{forward_steps:,} forward steps, {elapsed_s:,.0f} s elapsed"
        )
        if 0 < self.finished < self.total:
            left = elapsed_s * (self.total - self.finished) / self.finished
            text += f", about {left:,.0f} s left"
        return text

    def _write(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        try:
            stream.write(text + "\n")
            stream.flush()
        except (OSError, ValueError):  # closed or full: progress is not worth failing the run
            self._broken = True
            return
        self.lines += 1
