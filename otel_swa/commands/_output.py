"""Standard output that its reader may close (``otel-swa replay | head -1``, ``check run.log | true``).

Python ignores ``SIGPIPE``, so a write to a closed pipe raises :class:`BrokenPipeError` instead of
ending the process. Following the Python documentation (``signal`` module, "Note on SIGPIPE"), the
commands then point the standard output file descriptor at ``os.devnull``, so that later writes and
the flush at interpreter exit succeed silently, and go on to their normal exit status.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["discard_stdout", "stdout_closed", "StdoutLogHandler", "print_result"]


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


class StdoutLogHandler(logging.StreamHandler):
    """A logging handler on standard output that stops writing, quietly, once its reader is gone.

    A plain :class:`logging.StreamHandler` reports a :class:`BrokenPipeError` through
    ``handleError`` on every record ("--- Logging error ---" with a traceback on stderr). This one
    sets :attr:`reader_gone`, discards standard output (:func:`discard_stdout`) and drops every later
    record. Other errors are reported as usual.

    Attributes:
        reader_gone: the reader closed the pipe; nothing more is written.
    """

    def __init__(self) -> None:
        super().__init__(sys.stdout)
        self.reader_gone = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.reader_gone:
            return
        try:
            self.stream.write(self.format(record) + self.terminator)
            self.stream.flush()
        except BrokenPipeError:
            self._stop()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        if self.reader_gone:
            return
        try:
            super().flush()
        except BrokenPipeError:
            self._stop()

    def _stop(self) -> None:
        self.reader_gone = True
        discard_stdout()
