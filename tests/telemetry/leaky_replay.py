"""``otel-swa replay`` with the reference engine's SWA pool leaking one page in every ``EVERY`` it
frees (``tests/cli/leaky_swa_pool.py``: SGLang #27789 / #36081), for tests that need the leak in a
process of its own (its Prometheus endpoint, its exit status).

Usage: ``python tests/telemetry/leaky_replay.py EVERY replay --requests 40 ...`` (``EVERY`` 0: no
leak).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))

import pytest  # noqa: E402

import leaky_swa_pool  # noqa: E402
from otel_swa.cli import main  # noqa: E402

if __name__ == "__main__":
    every = int(sys.argv[1])
    if every:
        leaky_swa_pool.install(pytest.MonkeyPatch(), every=every)
    sys.argv = ["otel-swa", *sys.argv[2:]]
    sys.exit(main())
