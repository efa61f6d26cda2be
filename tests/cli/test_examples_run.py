"""The example scripts run as a user runs them and show the SWA path (checked by SGLang's rule)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PREFIX = "kv_canary_swa_divergence="


def records(text):
    out = []
    for line in text.splitlines():
        at = line.find(PREFIX)
        if at >= 0:
            out.append(json.loads(re.match(r"\S+", line[at + len(PREFIX):]).group(0)))
    return out


@pytest.mark.parametrize("script, args", [("reporter_by_hand.py", []), ("engine_by_hand.py", ["--exporters", "logline"])])
def test_example_shows_divergence_out_of_window_and_verify_lag(script, args):
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = records(done.stdout + done.stderr)
    assert len(found) >= 3
    assert max(r["swa_full_idx_divergence"] for r in found) >= 1
    assert max(r["swa_out_of_window_tokens"] for r in found) >= 1
    assert found[-1]["verify_swa"] < found[-1]["verify_full"]
