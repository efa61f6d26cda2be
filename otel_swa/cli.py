"""The ``otel-swa`` command: ``replay``, ``check``, ``records``, ``plot``.

Each subcommand lives in its own module under :mod:`otel_swa.commands` with two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this module only dispatches.

Exit status: 0 success; 1 the command ran and its check failed (``check``: the SWA path was not
observed; ``replay``: its own SWA slot audit found faults, or it took no sample); 2 unusable input,
arguments or environment (the message names the value and what was expected; ``check``,
``records`` and ``plot``: also an empty file, one that is not a text log, and, for ``records`` and
``plot``, a log whose records are all malformed), or an output that could not be written
(standard output or ``replay --log-file`` on a full disk, a log file that is a pipe nobody reads:
one line on stderr names it and the error; ``check`` keeps its verdict, ``replay`` its 1 and 130);
3 ``replay`` ran but every export of a signal failed (nothing reached the collector); 130
interrupted (Ctrl-C), after the summary so far. When the reader of standard output goes away
(``otel-swa replay | head -1``), output stops quietly and the exit status is the one the command
would have had.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Sequence

from otel_swa.commands._interrupt import INTERRUPTED, CommandInterrupt
from otel_swa.version import __version__

#: When this module was imported, on the ``time.monotonic()`` clock: the start of an ``otel-swa``
#: command (its console script imports this module first). Not the process's start as
#: ``/proc/self/stat`` gives it: that is when the process was forked, and a shell that runs its
#: last command with ``exec`` (``bash -c "pip install ... && otel-swa replay"``) forks the process
#: long before otel-swa runs in it. The interpreter's own start-up (tens of milliseconds) is left out.
_IMPORTED_AT = time.monotonic()

#: subcommand -> (module under otel_swa.commands, one-line help)
SUBCOMMANDS = {
    "replay": ("replay", "replay an LLM request trace through the reference hybrid-SWA engine with the reporter on"),
    "check": ("check", "assert that a log shows the SWA path working (divergence, out-of-window, verify lag, "
                       "a clean SWA slot audit; the last run, every rank)"),
    "records": ("records", "print the records of a log as JSON lines or CSV"),
    "plot": ("plot", "draw a run's records against forward_ct (needs the 'plot' extra)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otel-swa",
        description="Observe the sliding-window-attention KV cache of an LLM inference engine with OpenTelemetry.",
    )
    parser.add_argument("--version", action="version", version=f"otel-swa {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"otel_swa.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"otel_swa.commands.{module_name}":
                raise
            continue
        sp = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip().splitlines()[0])
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` names (``None``: the process's own, ``sys.argv[1:]``); return its
    exit status. The process's own command, interrupted (130), ends the process at once once its
    output is flushed: the interpreter's clean-up after a Ctrl-C (torch's, a few tenths of a
    second) is where a second Ctrl-C would kill it by the signal, with no line said."""
    status = _main(argv)
    if argv is None and status == INTERRUPTED:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed pipe, a full disk: nothing more to keep
                pass
        os._exit(INTERRUPTED)
    return status


def _main(argv: Sequence[str] | None) -> int:
    # The wall time ``replay`` prints counts from the start of the command when this is the
    # process's command (``argv`` None: its imports included), else from this call.
    started_at = _IMPORTED_AT if argv is None else time.monotonic()
    command = _command_name(sys.argv[1:] if argv is None else argv)
    if sys.stdout is None:  # started with standard output closed (>&-): one line and exit 2, no traceback
        from otel_swa.commands._output import ClosedStdout

        sys.stdout = ClosedStdout()
    interrupt = CommandInterrupt(command or "").install()  # Ctrl-C: never a traceback (commands/_interrupt.py)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.started_at = started_at
        args.interrupt = interrupt
        if getattr(args, "_run", None) is None:
            parser.print_help()
            return 2
        return int(args._run(args) or 0)
    except BrokenPipeError:
        # Standard output was closed by its reader. As the Python documentation advises (signal
        # module, "Note on SIGPIPE"), point it at devnull so that the flush at exit cannot fail again.
        from otel_swa.commands._output import stdout_closed

        return stdout_closed()
    except KeyboardInterrupt:
        name = f"otel-swa {command}" if command else "otel-swa"
        print(f"{name}: interrupted (Ctrl-C); exit status {INTERRUPTED}", file=sys.stderr)
        return INTERRUPTED
    finally:
        if argv is None:
            interrupt.exiting()  # the process's own command: a Ctrl-C while it exits ends it at once
        else:
            interrupt.uninstall()


def _command_name(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is one), for messages."""
    return next((word for word in argv if word in SUBCOMMANDS), None)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
