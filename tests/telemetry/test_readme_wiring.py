"""The README's "Wiring an engine" snippet runs as written and prints the line the README shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _section() -> str:
    text = README.read_text()
    start = text.index("## Wiring an engine")
    return text[start:text.index("\n## ", start + 1)]


def test_the_wiring_snippet_runs_and_prints_the_documented_line(tmp_path):
    section = _section()
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    expected = re.search(r"```text\n(.*?)\n```", section, re.S).group(1)
    script = tmp_path / "wiring.py"
    script.write_text(code)
    env = {"PATH": "/usr/bin:/bin"}  # no OTEL_* / OTEL_SWA_* variables: the snippet needs none
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    printed = re.sub(r'"pid":\d+', '"pid":12345', run.stderr.strip())
    assert printed == expected  # every line, the run start marker with its process id first
    # and the numbers are the snippet's: 12 live tokens, 4 with SWA slot 0, 8 remapped
    assert '"swa_full_idx_divergence":8,"swa_out_of_window_tokens":4' in expected
