"""Run ``otel-swa`` (``otel_swa.cli.main``) in a child process with stand-ins that hold it at a
point a Ctrl-C test chooses, so that the test sends SIGINT after a line the child printed, never
after a guessed time.

Environment of the child (read here only):

* ``SHIM_SLOW_IMPORT=torch``: the first import of that module prints ``shim: importing torch`` on
  stderr and then blocks. Stands in for torch's own import, which takes 3-4 s on a loaded 2-core
  machine, during which users press Ctrl-C (``otel-swa replay`` imports torch after its options
  were checked).
* ``SHIM_SWALLOWING_IMPORT=torch``: the same, but the import swallows the ``KeyboardInterrupt``
  the Ctrl-C raises in it and goes on. Stands in for a Ctrl-C lost inside torch's import (seen:
  a Ctrl-C 0.3 - 0.4 s into ``otel-swa replay`` let the run set itself up and report "interrupted at
  forward step 0"), which the command must still honour before the run.
* ``SHIM_CUT_GRACE_S=600``: :data:`otel_swa.telemetry.stopping.CUT_GRACE_S`, the time the
  providers still get once a Ctrl-C cut the exporters' waits short. Stands in for exporters that
  do not finish after the cut (an exporter blocked in a socket call it cannot leave), so that a
  second Ctrl-C reaches the process while it still stops.

Usage: ``python tests/cli/interrupt_shims.py replay --requests 10 ...``.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import time


class _SlowImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, swallow: bool = False) -> None:
        self.name = name
        self.swallow = swallow

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            sys.stderr.write(f"shim: importing {fullname}\n")
            sys.stderr.flush()
            try:
                time.sleep(600)
            except KeyboardInterrupt:
                if not self.swallow:
                    raise
                self.name = None  # the import goes on, once
        return None


def main() -> int:
    slow = os.environ.get("SHIM_SLOW_IMPORT")
    if slow:
        sys.meta_path.insert(0, _SlowImport(slow))
    swallowing = os.environ.get("SHIM_SWALLOWING_IMPORT")
    if swallowing:
        sys.meta_path.insert(0, _SlowImport(swallowing, swallow=True))
    grace = os.environ.get("SHIM_CUT_GRACE_S")
    if grace:
        from otel_swa.telemetry import stopping

        stopping.CUT_GRACE_S = float(grace)
    from otel_swa.cli import main as cli_main

    sys.argv[0] = "otel-swa"
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
