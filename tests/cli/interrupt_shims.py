"""Run ``otel-swa`` (``otel_swa.cli.main``) in a child process with stand-ins that hold it at a
point a Ctrl-C test chooses, so that the test sends SIGINT after a line the child printed, never
after a guessed time.

Environment of the child (read here only):

* ``SHIM_SLOW_IMPORT=torch``: the first import of that module prints ``shim: importing torch`` on
  stderr and then blocks. Stands in for torch's own import, which takes 3-4 s on a loaded 2-core
  machine, during which users press Ctrl-C (``otel-swa replay`` imports torch after its options
  were checked).
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
    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            sys.stderr.write(f"shim: importing {fullname}\n")
            sys.stderr.flush()
            time.sleep(600)
        return None


def main() -> int:
    slow = os.environ.get("SHIM_SLOW_IMPORT")
    if slow:
        sys.meta_path.insert(0, _SlowImport(slow))
    grace = os.environ.get("SHIM_CUT_GRACE_S")
    if grace:
        from otel_swa.telemetry import stopping

        stopping.CUT_GRACE_S = float(grace)
    from otel_swa.cli import main as cli_main

    sys.argv[0] = "otel-swa"
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
