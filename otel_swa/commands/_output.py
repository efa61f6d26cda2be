"""Standard output that its reader may close (``otel-swa replay | head -1``, ``check run.log | true``)
or that cannot take more (``> /dev/full``).

Python ignores ``SIGPIPE``, so a write to a closed pipe raises :class:`BrokenPipeError` instead of
ending the process. Following the Python documentation (``signal`` module, "Note on SIGPIPE"), the
commands then point the standard output file descriptor at ``os.devnull``, so that later writes and
the flush at interpreter exit succeed silently, and go on to their normal exit status. Any other
write error (a full disk) is said once, in one line on standard error, and output stops the same way.

:class:`GuardedStdout` does this for every writer of a long command (the log-line handler, the
OpenTelemetry console exporters on their own threads, the summary), so that none of them prints a
traceback.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading

__all__ = ["discard_stdout", "stdout_closed", "StdoutLogHandler", "GuardedStdout", "print_result"]


def discard_stdout() -> None:
    """Send whatever is still written to standard output to ``os.devnull``.

    The file descriptor is redirected when ``sys.stdout`` has one; a stand-in without one (a
    ``StringIO`` in tests) is replaced by an ``os.devnull`` text stream.
    """
    try:
        fileno = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives until exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fileno)
    finally:
        os.close(devnull)


def stdout_closed() -> int:
    """Standard output was closed by its reader (``| head``): stop writing quietly; return 0."""
    discard_stdout()
    return 0


def print_result(text: str) -> bool:
    """Print ``text`` on standard output; ``False`` when it could not be written.

    A reader that closed the pipe is not an error (nothing is said); any other write error (a full
    disk, ``> /dev/full``) is named in one line on standard error. Either way standard output is
    then discarded (:func:`discard_stdout`) so that the exit is clean, and the caller keeps its
    exit status.
    """
    try:
        print(text, flush=True)
        return True
    except BrokenPipeError:
        discard_stdout()
    except OSError as exc:
        discard_stdout()
        print(f"otel-swa: cannot write to standard output: {exc.strerror or exc}", file=sys.stderr)
    return False


class GuardedStdout(io.TextIOBase):
    """A text stream over standard output that never raises for a reader gone or a full disk.

    The first :class:`BrokenPipeError` (the reader closed the pipe) sets :attr:`reader_gone`
    quietly; the first other ``OSError`` (``ENOSPC``...) is said in one line on standard error,
    ``otel-swa: cannot write to standard output: No space left on device``, and kept in
    :attr:`failed`. Either way standard output is then discarded (:func:`discard_stdout`) and
    everything written later is dropped. Thread-safe: the OpenTelemetry console exporters write
    from their own threads.

    Args:
        stream: the stream to write to (default: ``sys.stdout`` at the time of each write).

    Attributes:
        reader_gone: the reader closed the pipe.
        failed: the write error other than a closed pipe, or ``None``.
    """

    def __init__(self, stream: "io.TextIOBase | None" = None) -> None:
        super().__init__()
        self._stream = stream
        self._lock = threading.Lock()
        self.reader_gone = False
        self.failed: OSError | None = None

    @property
    def stopped(self) -> bool:
        """Nothing more is written (the reader is gone or a write failed)."""
        return self.reader_gone or self.failed is not None

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not self.stopped:
            try:
                (self._stream or sys.stdout).write(text)
            except OSError as exc:
                self._stop(exc)
        return len(text)

    def flush(self) -> None:
        if not self.stopped:
            try:
                (self._stream or sys.stdout).flush()
            except OSError as exc:
                self._stop(exc)

    def _stop(self, exc: OSError) -> None:
        with self._lock:
            if self.stopped:
                return
            if isinstance(exc, BrokenPipeError):
                self.reader_gone = True
            else:
                self.failed = exc
            discard_stdout()
            if self.failed is not None:
                try:
                    print(f"otel-swa: cannot write to standard output: {exc.strerror or exc}", file=sys.stderr, flush=True)
                except OSError:
                    pass


class StdoutLogHandler(logging.StreamHandler):
    """A logging handler on standard output that stops writing, quietly, once its reader is gone,
    and after one line on stderr when standard output cannot take more (a full disk).

    A plain :class:`logging.StreamHandler` reports a :class:`BrokenPipeError` or a full disk through
    ``handleError`` on every record ("--- Logging error ---" with a traceback on stderr). This one
    writes through a :class:`GuardedStdout` (``stream``, shared with the command's other writers
    when given) and drops every record once it has stopped.

    Attributes:
        reader_gone: the reader closed the pipe; nothing more is written.
    """

    def __init__(self, stream: GuardedStdout | None = None) -> None:
        self.guard = stream if stream is not None else GuardedStdout()
        super().__init__(self.guard)

    @property
    def reader_gone(self) -> bool:
        return self.guard.reader_gone

    def emit(self, record: logging.LogRecord) -> None:
        if self.guard.stopped:
            return
        try:
            self.guard.write(self.format(record) + self.terminator)
            self.guard.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        self.guard.flush()
