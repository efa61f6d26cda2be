"""Standard output that its reader may close (``otel-swa replay | head -1``, ``check run.log | true``)
or that cannot take more (``> /dev/full``).

Python ignores ``SIGPIPE``, so a write to a closed pipe raises :class:`BrokenPipeError` instead of
ending the process. Following the Python documentation (``signal`` module, "Note on SIGPIPE"), the
commands then point the standard output file descriptor at ``os.devnull``, so that later writes and
the flush at interpreter exit succeed silently, and go on to their normal exit status. Any other
write error (a full disk) is said once, in one line on standard error, and output stops the same way;
the command then exits 2 (``check`` keeps its verdict).

:class:`GuardedStdout` does this for every writer of a long command (the log-line handler, the
OpenTelemetry console exporters on their own threads, the summary), so that none of them prints a
traceback; :class:`GuardedFile` the same for a log file (``replay --log-file``), where any write
error, a pipe whose reader left included, is said once and ends the writes to that file only.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import sys
import threading

__all__ = [
    "discard_stdout", "stdout_closed", "print_result", "GuardedStream", "GuardedStdout", "GuardedFile",
    "GuardedLogHandler", "StdoutLogHandler", "FileLogHandler",
]


class ClosedStdout(io.TextIOBase):
    """What ``sys.stdout`` is for a command started with standard output closed (``>&-``: Python
    then sets it to ``None``): every write and flush fails as a write to a closed descriptor does
    (``EBADF``), so the commands' usual handling says it in one line and exits 2."""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        raise OSError(errno.EBADF, "it is closed")

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "it is closed")

    def flush(self) -> None:
        raise OSError(errno.EBADF, "it is closed")


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


def print_result(text: str) -> OSError | None:
    """Print ``text`` on standard output; return the write error when it could not be written
    (``None`` when it was, or when its reader had closed the pipe).

    A reader that closed the pipe is not an error (nothing is said); any other write error (a full
    disk, ``> /dev/full``) is named in one line on standard error. Either way standard output is
    then discarded (:func:`discard_stdout`) so that the exit is clean; the caller chooses its exit
    status.
    """
    try:
        print(text, flush=True)
    except BrokenPipeError:
        discard_stdout()
    except OSError as exc:
        discard_stdout()
        print(f"otel-swa: cannot write to standard output: {exc.strerror or exc}", file=sys.stderr)
        return exc
    return None


class GuardedStream(io.TextIOBase):
    """A text stream that never raises for a reader gone or a full disk: the first write error
    stops it, said once in one line on standard error, and everything written later is dropped.

    Thread-safe: the OpenTelemetry console exporters write from their own threads.

    Args:
        stream: the stream to write to (``None``: ``sys.stdout`` at the time of each write).
        name: the destination in words, for the message (``standard output``, ``log file 'run.log'``).
        quiet_pipe: a :class:`BrokenPipeError` (the reader closed the pipe) stops the stream without
            a word and is no failure (standard output under ``| head``); ``False``: it is a write
            error like any other (a log file that is a pipe nobody reads).

    Attributes:
        reader_gone: the reader closed the pipe (only with ``quiet_pipe``).
        failed: the write error that stopped the stream (``ENOSPC``, ``EPIPE``...), or ``None``.
    """

    def __init__(self, stream: "io.TextIOBase | None" = None, *, name: str = "standard output",
                 quiet_pipe: bool = True) -> None:
        super().__init__()
        self._stream = stream
        self._lock = threading.Lock()
        self.name = name
        self.quiet_pipe = quiet_pipe
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

    def _discard(self) -> None:
        """Drop what is still buffered for the destination, so that a later flush cannot fail."""
        discard_stdout()

    def _stop(self, exc: OSError) -> None:
        with self._lock:
            if self.stopped:
                return
            if isinstance(exc, BrokenPipeError) and self.quiet_pipe:
                self.reader_gone = True
            else:
                self.failed = exc
            self._discard()
            if self.failed is not None:
                try:
                    print(f"otel-swa: cannot write to {self.name}: {exc.strerror or exc}", file=sys.stderr, flush=True)
                except OSError:
                    pass


class GuardedStdout(GuardedStream):
    """A :class:`GuardedStream` over standard output: a reader that closed the pipe stops it
    quietly; any other write error (``> /dev/full``) is said in one line on standard error,
    ``otel-swa: cannot write to standard output: No space left on device``. Either way standard
    output is then discarded (:func:`discard_stdout`)."""

    def __init__(self, stream: "io.TextIOBase | None" = None) -> None:
        super().__init__(stream, name="standard output", quiet_pipe=True)


class GuardedFile(GuardedStream):
    """A :class:`GuardedStream` over a file opened for appending (``--log-file``): the first write
    error (a full disk, a pipe whose reader is gone, a file system gone read-only) is said in one
    line, ``otel-swa: cannot write to log file 'run.log': No space left on device``, the file is
    closed, and nothing more is written to it.

    Raises:
        OSError: the file cannot be opened for appending (permission, a missing folder).
    """

    def __init__(self, path: str) -> None:
        super().__init__(open(path, "a", encoding="utf-8"), name=f"log file {path!r}", quiet_pipe=False)  # noqa: SIM115

    def _discard(self) -> None:
        self.close_quietly()

    def close_quietly(self) -> None:
        """Close the file; a write error of its last flush is the failure already said (or said now)."""
        stream = self._stream
        if stream is None or stream.closed:
            return
        try:
            stream.close()  # a failing flush still closes the descriptor
        except OSError as exc:
            if self.failed is None:
                self.failed = exc
                try:
                    print(f"otel-swa: cannot write to {self.name}: {exc.strerror or exc}", file=sys.stderr, flush=True)
                except OSError:
                    pass


class GuardedLogHandler(logging.StreamHandler):
    """A logging handler over a :class:`GuardedStream`: it stops writing, quietly, once its reader
    is gone, and after one line on stderr when its destination cannot take more (a full disk).

    A plain :class:`logging.StreamHandler` reports a :class:`BrokenPipeError` or a full disk through
    ``handleError`` on every record ("--- Logging error ---" with a traceback on stderr), and a
    :class:`logging.FileHandler` once more when it is closed. This one drops every record once its
    stream has stopped.

    Attributes:
        guard: the stream written to.
    """

    def __init__(self, guard: GuardedStream) -> None:
        self.guard = guard
        super().__init__(guard)

    @property
    def reader_gone(self) -> bool:
        return self.guard.reader_gone

    @property
    def failed(self) -> OSError | None:
        """The write error that stopped the handler's stream, or ``None``."""
        return self.guard.failed

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

    def close(self) -> None:
        self.flush()
        if isinstance(self.guard, GuardedFile):
            self.guard.close_quietly()
        super().close()


class StdoutLogHandler(GuardedLogHandler):
    """A :class:`GuardedLogHandler` on standard output (``stream``: a :class:`GuardedStdout`
    shared with the command's other writers, else a new one)."""

    def __init__(self, stream: GuardedStdout | None = None) -> None:
        super().__init__(stream if stream is not None else GuardedStdout())


class FileLogHandler(GuardedLogHandler):
    """A :class:`GuardedLogHandler` appending to the file at ``path`` (``--log-file``).

    Raises:
        OSError: the file cannot be opened for appending.
    """

    def __init__(self, path: str) -> None:
        super().__init__(GuardedFile(path))
