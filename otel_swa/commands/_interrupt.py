"""Ctrl-C (SIGINT) in the ``otel-swa`` commands: the first stops the command where it is safe to,
the second at once; neither prints a traceback.

:func:`otel_swa.cli.main` installs one :class:`CommandInterrupt` for the whole command (in the
main thread, where Python runs signal handlers). The first Ctrl-C

* sets :attr:`CommandInterrupt.requested` and :attr:`CommandInterrupt.event`, and calls the
  callbacks registered with :meth:`CommandInterrupt.on_first` (each must only set a flag or an
  event: it runs inside the signal handler; ``replay`` registers the telemetry's
  :meth:`~otel_swa.telemetry.SwaTelemetry.cut_short`, which ends the exporters' waits);
* raises :class:`KeyboardInterrupt` where the main thread is, unless the command has deferred it
  (:meth:`CommandInterrupt.deferred`: ``replay`` while its engine runs and stops, so that every
  sample taken is delivered and the summary printed; it checks :attr:`requested` at the end of each
  forward step). :func:`otel_swa.cli.main` turns a :class:`KeyboardInterrupt` that reaches it into
  one line, ``otel-swa check: interrupted (Ctrl-C); exit status 130``, and exit status 130.

The second Ctrl-C writes one line, ``otel-swa replay: interrupted again (Ctrl-C): stopped at once
...``, and ends the process with status 130 at once (``os._exit``: no interpreter clean-up, no
exporter's wait, no traceback). Once the command has returned, while the interpreter exits, a
Ctrl-C does the same.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator

__all__ = ["INTERRUPTED", "CommandInterrupt"]

#: Exit status of an interrupted command (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


class CommandInterrupt:
    """The SIGINT handler of one command (see the module docstring).

    Args:
        command: the command's name, for the lines it writes (``replay``).

    Attributes:
        requested: a Ctrl-C came.
        event: set at the first Ctrl-C (for waits that should end at once).
        installed: the handler is installed (only in the main thread).
    """

    def __init__(self, command: str) -> None:
        self.command = command
        self.requested = False
        self.event = threading.Event()
        self.installed = False
        self._count = 0
        self._defer = 0
        self._exiting = False
        self._callbacks: list[Callable[[], None]] = []
        self._messages: list[str] = []
        self._previous: Any = None

    def install(self) -> "CommandInterrupt":
        """Handle SIGINT from now on (nothing happens outside the main thread)."""
        if threading.current_thread() is threading.main_thread() and not self.installed:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self.installed = True
        return self

    def uninstall(self) -> None:
        """Give SIGINT back to the handler that was there before :meth:`install`."""
        if self.installed:
            signal.signal(signal.SIGINT, self._previous)
            self.installed = False

    def exiting(self) -> None:
        """The command has returned: from now on a Ctrl-C ends the process at once, quietly
        (a Ctrl-C while the interpreter exits would otherwise print a traceback)."""
        self._exiting = True

    def on_first(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (inside the signal handler: it must only set a flag or an event) at
        the first Ctrl-C, or now when it already came."""
        self._callbacks.append(callback)
        if self.requested:
            callback()

    @contextlib.contextmanager
    def deferred(self, message: str) -> Iterator["CommandInterrupt"]:
        """Inside, the first Ctrl-C raises nothing: the command checks :attr:`requested` itself,
        and ``message`` is written on stderr at once (``otel-swa replay: interrupted (Ctrl-C):
        <message>; Ctrl-C again stops at once``), so that the user knows it was heard."""
        self._defer += 1
        self._messages.append(message)
        try:
            yield self
        finally:
            self._defer -= 1
            self._messages.pop()

    def raise_if_requested(self) -> None:
        """Raise :class:`KeyboardInterrupt` when a Ctrl-C came (a point where the command stops)."""
        if self.requested:
            raise KeyboardInterrupt

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self._count += 1
        if self._count > 1 or self._exiting:
            self._exit_now()
        self.requested = True
        self.event.set()
        for callback in self._callbacks:
            callback()
        if not self._defer:
            raise KeyboardInterrupt
        self._write(f"interrupted (Ctrl-C): {self._messages[-1]}; Ctrl-C again stops at once")

    def _exit_now(self) -> None:
        if self._exiting and self._count == 1:
            why = "while exiting: stopped at once"
        else:
            why = "again (Ctrl-C): stopped at once; what was not yet written or exported is lost"
        try:
            sys.stdout.flush()
        except Exception:  # a write under way in the main thread, a closed stream: nothing to keep
            pass
        self._write(f"interrupted {why}; exit status {INTERRUPTED}")
        os._exit(INTERRUPTED)

    def _write(self, text: str) -> None:
        """One line on stderr, written with ``os.write`` (a signal handler may run while the main
        thread is inside ``sys.stderr``'s own write)."""
        try:
            os.write(2, f"otel-swa {self.command}: {text}\n".encode())
        except OSError:
            pass
